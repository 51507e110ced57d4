"""--qk-norm-lr-mult: the QK-norm gains and biases train at a multiple of the learning rate, on the CPU
optimizer (its own param group, read by Megatron's scheduler) and in the overrides handed to
Megatron-Core's optimizer on GPUs (which must keep the standard no-weight-decay rule)."""

import pytest
import torch

from megatron_dsv.training.arguments import parse_args
from megatron_dsv.training.optim import is_qk_norm_param, qk_norm_overrides
from tests.training.helpers import SMALL, run


def test_names():
    assert is_qk_norm_param("module.decoder.layers.3.self_attention.q_layernorm.weight")
    assert is_qk_norm_param("decoder.layers.0.self_attention.k_layernorm.bias")
    assert not is_qk_norm_param("decoder.layers.0.input_layernorm.weight")
    assert not is_qk_norm_param("decoder.layers.0.self_attention.linear_qkv.weight")


def test_first_update_moves_qk_norm_by_the_multiple(tmp_path):
    """The DiT's zero-initialised output and gates keep the norms' gradients at zero for the first two
    steps, so two runs with multipliers 1 and 10 are identical until step 3, each norm gain's first Adam
    update: there the QK-norm gains move 10x as far with the multiplier, the other gains as far."""
    from megatron_dsv.training.optim import unwrap

    def moved(mult, name):
        result = run(tmp_path, "--train-iters", "3", "--qk-norm-lr-mult", mult, "--lr-warmup-iters", "0",
                     "--lr-decay-style", "constant", "--no-save", name=name)
        return {n: (p.detach() - 1.0).abs() for n, p in unwrap(result.model).named_parameters()
                if n.endswith("layernorm.weight")}

    base, fast = moved("1", "base"), moved("10", "fast")
    qk = [n for n in base if is_qk_norm_param(n)]
    assert len(qk) == 4 and len(base) > 4
    for n in base:
        assert float(base[n].max()) > 0, n
        want = 10.0 * base[n] if n in qk else base[n]
        torch.testing.assert_close(fast[n], want, rtol=1e-3, atol=2e-6)  # fp32 ulp at 1: 1.2e-7, x10


def test_scheduler_reads_the_group_max_lr(tmp_path):
    from megatron_dsv.training.optim import LocalAdam, build_scheduler

    args = parse_args([*SMALL, "--qk-norm-lr-mult", "10", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
                       "--output-dir", str(tmp_path)])
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(4, 4)
    model.q_layernorm = torch.nn.LayerNorm(4)
    outer = torch.nn.Module()
    outer.attn = model
    opt = LocalAdam(outer, args, None)
    build_scheduler(opt, args).step(1)
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs[0] == pytest.approx(2e-3) and lrs[-1] == pytest.approx(2e-2)


def test_megatron_overrides_keep_the_standard_rule():
    from megatron.core.optimizer import OptimizerConfig

    args = parse_args([*SMALL, "--qk-norm-lr-mult", "10"])
    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr)
    over = qk_norm_overrides(args, config)
    assert qk_norm_overrides(parse_args(SMALL), config) is None
    qk = torch.nn.Parameter(torch.ones(8))
    bias = torch.nn.Parameter(torch.ones(8))
    w = torch.nn.Parameter(torch.ones(8, 8))
    def matched(p, name):
        return [v for k, v in over.items() if k.matches(p, name)]

    got = matched(qk, "module.decoder.layers.0.self_attention.q_layernorm.weight")
    assert {"max_lr": args.lr * 10, "min_lr": args.min_lr * 10} in got and {"wd_mult": 0.0} in got
    assert matched(bias, "module.decoder.layers.0.linear_fc1.bias") == [{"wd_mult": 0.0}]
    assert matched(w, "module.decoder.layers.0.linear_fc1.weight") == []


def test_bad_multiplier_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--qk-norm-lr-mult", "0"])
    assert "--qk-norm-lr-mult" in capsys.readouterr().err


def test_resume_with_another_multiplier_names_the_flag(tmp_path):
    from megatron_dsv.training.checkpointing import CheckpointError

    ck = str(tmp_path / "ck")
    run(tmp_path, "--train-iters", "2", "--qk-norm-lr-mult", "10", "--save", ck, "--save-interval", "2", name="a")
    resumed = run(tmp_path, "--train-iters", "3", "--qk-norm-lr-mult", "10", "--load", ck, "--no-save",
                  "--use-checkpoint-opt_param-scheduler", name="b")
    assert (resumed.start_iteration, resumed.iteration) == (2, 3)
    with pytest.raises(CheckpointError, match="--qk-norm-lr-mult is 1.0 but .* --qk-norm-lr-mult 10.0"):
        run(tmp_path, "--train-iters", "3", "--load", ck, "--no-save", name="c")

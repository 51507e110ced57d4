"""Bad flags and presets give clear errors naming the flag."""

import pytest
import torch

from megatron_dsv.train import main
from megatron_dsv.training.arguments import parse_args

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only error")


@pytest.mark.parametrize("flags, named", [
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--lr-decay-style", "zigzag"], "--lr-decay-style"),
    (["--recompute-granularity", "half"], "--recompute-granularity"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr"),
    (["--train-iters", "10", "--lr-warmup-iters", "10"], "--lr-warmup-iters"),
    (["--load", "/nonexistent/ckpt"], "--load"),
    (["--data-path", "/nonexistent/shards"], "--data-path"),
    (["--model-override", "layers"], "--model-override"),
    (["--dsv-theta", "abc"], "--dsv-theta"),
    (["--bogus-flag"], "--bogus-flag"),
    (["--use-dsv-attention", "--dsv-theta", "1.5"], "--dsv-theta must be in (0, 1), got 1.5"),
    (["--use-dsv-attention", "--dsv-stage-switch-rule", "steps", "--dsv-stage-switch-steps", "none"],
     "--dsv-stage-switch-steps must be set (an int >= 0) when --dsv-stage-switch-rule is 'steps'"),
    (["--ema-decay", "1"], "--ema-decay: must be in [0, 1)"),
])
def test_bad_flag_names_the_flag_in_one_line(flags, named, capsys):
    """One line naming the flag (the --dsv-* flag, not the DSVConfig field), not the usage block first."""
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert "usage:" not in err and "DSVConfig" not in err


@pytest.mark.parametrize("flags, message", [
    (["--preset", "huge"], "preset must be one of"),
    (["--model-override", "no_such_field=3"], "unknown VideoDiTConfig field"),
    pytest.param(["--bf16"], "--bf16 needs a GPU", marks=CPU_ONLY),
    pytest.param(["--tensor-model-parallel-size", "2"], "needs GPUs", marks=CPU_ONLY),
    pytest.param(["--recompute-granularity", "full"], "--recompute-granularity full needs a GPU", marks=CPU_ONLY),
])
def test_bad_values_exit_with_a_clear_message(tmp_path, flags, message, capsys):
    code = main(["--train-iters", "2", "--no-save", "--no-sample", "--output-dir", str(tmp_path), *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_embedded_demo():
    """The README's main job is the defaults plus --use-dsv-attention, the switch of Megatron-LM scripts."""
    args = parse_args(["--use-dsv-attention"])
    assert args.preset == "tiny" and args.use_dsv_attention and args.dsv_stage_switch_steps == 150
    assert args.train_iters == 300 and args.save.endswith("outputs/default/checkpoints") and args.sample
    assert not parse_args([]).use_dsv_attention  # without the switch: dense attention
    assert not parse_args(["--use-dsv-attention", "--no-dsv"]).use_dsv_attention


def test_embedded_default_runs_sparse_at_the_demo_sparsity():
    """The default job's DSV settings dispatch its layers sparse at the sparsity its 512-token videos
    reach (0.52-0.61 measured), with the budgets the demo uses; the recall rule, uncapped, at the
    densities those videos need (~0.9 for 0.96 recall) would keep them dense."""
    from dataclasses import replace

    from megatron_dsv.arguments import dsv_config_from_args
    from megatron_dsv.attention.dispatcher import SpeedupTable, plan_layer

    cfg = dsv_config_from_args(parse_args(["--use-dsv-attention"]))
    assert cfg.budget_rule == "sparsity" and cfg.sparsity_threshold == 0.4
    table = SpeedupTable.from_config(cfg, head_dim=64)
    sparsity, density = torch.full((2,), 0.55), torch.full((2,), 0.9)
    sparse, budgets, tokens = plan_layer(sparsity, density, 512, cfg, table)
    assert sparse and int(tokens.max()) < 512
    assert not plan_layer(sparsity, density, 512, replace(cfg, budget_rule="recall", max_density=None), table)[0]


def test_help_shows_the_defaults_in_effect(capsys):
    """The demo's --dsv-* defaults differ from DSVConfig's: --help shows both."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.4) [the demo's; DSVConfig default: 0.7]" in text  # --dsv-sparsity-threshold
    assert "(default: 150) [the demo's; DSVConfig default: 400]" in text  # --dsv-stage-switch-steps


def test_run_starts_with_megatrons_arguments_block(tmp_path, capsys):
    import dataclasses
    import re

    from megatron_dsv.config import DSVConfig
    from tests.training.helpers import run

    run(tmp_path, "--train-iters", "1", "--no-save", "--dsv-theta", "0.85")
    out = capsys.readouterr().out
    block = out.split("------------------------ arguments ------------------------\n", 1)[1]
    block = block.split("-------------------- end of arguments ---------------------", 1)[0].splitlines()
    rows = dict(re.match(r"^  (\w+) \.+ (.*)$", line).groups() for line in block)
    assert all(line[50:52] == ". " for line in block)  # the values start in one column, as Megatron-LM's
    assert [line.lower() for line in block] == sorted(line.lower() for line in block)
    for f in dataclasses.fields(DSVConfig):
        assert "dsv_" + f.name in rows, f.name
    assert rows["dsv_theta"] == "0.85" and rows["dsv_sparsity_threshold"] == "0.4"
    assert rows["use_dsv_attention"] == "True"

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
])
def test_bad_flag_names_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--preset", "huge"], "preset must be one of"),
    (["--model-override", "no_such_field=3"], "unknown VideoDiTConfig field"),
    (["--dsv-theta", "1.5"], "DSVConfig.theta"),
    pytest.param(["--bf16"], "--bf16 needs a GPU", marks=CPU_ONLY),
    pytest.param(["--tensor-model-parallel-size", "2"], "needs GPUs", marks=CPU_ONLY),
    pytest.param(["--recompute-granularity", "full"], "--recompute-granularity full needs a GPU", marks=CPU_ONLY),
])
def test_bad_values_exit_with_a_clear_message(tmp_path, flags, message, capsys):
    code = main(["--train-iters", "2", "--no-save", "--no-sample", "--output-dir", str(tmp_path), *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_embedded_demo():
    args = parse_args([])
    assert args.preset == "tiny" and args.use_dsv_attention and args.dsv_stage_switch_steps == 150
    assert args.train_iters == 300 and args.save.endswith("outputs/default/checkpoints") and args.sample
    assert not parse_args(["--no-dsv"]).use_dsv_attention

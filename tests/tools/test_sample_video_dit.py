"""tools/sample_video_dit.py samples from a trainer checkpoint: its EMA weights by default (as validation
uses them), the live weights with --live-weights; both write the GIF, the grid and the latents."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_samples_from_the_ema_by_default(megatron_cpu, tmp_path, capsys):
    from tests.training.helpers import run

    run(tmp_path, "--train-iters", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "3",
        "--eval-iters", "0")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from sample_video_dit import main

    outs = {}
    for name, extra in (("ema", []), ("live", ["--live-weights"])):
        prefix = str(tmp_path / name)
        assert main(["--ckpt", str(tmp_path / "ckpt"), "--steps", "2", "--labels", "0", "--out", prefix,
                     "--device", "cpu", *extra]) == 0
        assert f"with the {'EMA' if name == 'ema' else 'live'} weights" in capsys.readouterr().out
        for ext in (".gif", ".png", ".safetensors"):
            assert os.path.getsize(prefix + ext) > 0
        from safetensors.torch import load_file

        outs[name] = load_file(prefix + ".safetensors")["latents"]
    assert not torch.equal(outs["ema"], outs["live"])  # three steps in, the average is not the weights

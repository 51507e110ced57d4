"""Arm keys of the study's training runs (``benchmarks/video_runs.py``): DSV's list granularity."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.video_runs import parse_arm  # noqa: E402


def test_gran_key_parses_labels_and_rejects_unknown():
    assert parse_arm("data=synthetic")["gran"] == "block"
    arm = parse_arm("data=synthetic,frames=4,res=64,gran=token")
    assert arm["gran"] == "token" and arm["label"] == "synthetic-dsv-tokenlists-S256"
    assert parse_arm("data=synthetic,frames=4,res=64,gran=token,attn=full")["label"] == "synthetic-full-S256"
    with pytest.raises(ValueError, match="gran must be one of"):
        parse_arm("gran=tokens")


@pytest.mark.timeout(300)
def test_token_lists_arm_trains_into_stage_two(megatron_cpu, tmp_path):
    """gran=token reaches the DSV layers (token lists, no key blocks) and a short run profiles and
    switches stage with them."""
    from benchmarks.video_runs import train_arm
    from megatron_dsv.attention import dsv_layers
    from tests.test_benchmarks_smoke import _run_args

    model, _, summary = train_arm(parse_arm("data=synthetic,frames=4,res=64,stage1=3,steps=6,gran=token"),
                                  _run_args(tmp_path))
    layers = dsv_layers(model)
    assert layers and all(m.dsv_config.granularity == "token" and m.dsv_config.block_size == 0 for m in layers)
    assert summary["steps"] == 6 and 0.0 < summary["budget_density"] <= 1.0 and summary["recall"] > 0.0

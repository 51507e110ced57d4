"""The Megatron-LM entry point (examples/video_dit/pretrain_video_dit.py): provider signatures and flags.

megatron-core's wheel does not ship ``megatron.training``; these tests run only where a Megatron-LM
checkout is importable (e.g. PYTHONPATH=<Megatron-LM core_v0.16.1>)."""

import argparse
import importlib.util
import inspect
import os

import pytest
import torch

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "video_dit", "pretrain_video_dit.py")


def _megatron_training_importable() -> bool:
    try:
        import megatron.training  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not _megatron_training_importable(),
                                reason="megatron.training (Megatron-LM) is not importable; megatron-core alone "
                                       "does not ship it")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("pretrain_video_dit", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_provider_signatures_match_megatron_lm(example):
    params = inspect.signature(example.model_provider).parameters
    assert list(params)[:5] == ["pre_process", "post_process", "vp_stage", "config", "pg_collection"]
    assert list(inspect.signature(example.train_valid_test_datasets_provider).parameters) == [
        "train_val_test_num_samples", "vp_stage"]
    assert list(inspect.signature(example.forward_step).parameters) == ["data_iterator", "model"]


def test_extra_args_provider_adds_dsv_and_video_flags(example):
    parser = example.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args(["--use-dsv-attention", "--preset", "tiny", "--dsv-stage-switch-steps", "5",
                              "--model-override", "latent_frames=4"])
    assert args.use_dsv_attention and args.dsv_stage_switch_steps == 5 and args.preset == "tiny"


def test_loss_func_reports_a_sum_and_a_count(example):
    loss, count, report = example.loss_func(torch.tensor(0.25))
    assert float(loss) == 0.25 and int(count) == 1
    assert report["flow loss"].tolist() == [0.25, 1.0]

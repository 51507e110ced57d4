"""The Megatron-LM entry point (examples/video_dit/pretrain_video_dit.py): provider signatures, flags and
the two calling conventions of Megatron-LM's pretrain().

megatron-core's wheel does not ship ``megatron.training``: it comes from a Megatron-LM tree, either already
importable or the core_v0.16.1 tarball in ../shared/megatron-lm/ (unpacked once per session and put on
sys.path). megatron.training also needs six, regex, pyyaml and pydantic; without them the tests skip."""

import argparse
import importlib
import importlib.util
import inspect
import os
import sys

import pytest
import torch

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "video_dit", "pretrain_video_dit.py")
NEEDED = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic"}


def _importable() -> bool:
    try:
        import megatron.training  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def example(megatron_lm_tree):
    if not _importable():
        missing = [pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None]
        if missing:
            pytest.skip(f"Megatron-LM's megatron.training needs {', '.join(missing)}: pip install {' '.join(missing)}")
        sys.path.append(megatron_lm_tree("core_v0.16.1"))  # after site-packages: megatron.core stays the wheel's
        importlib.invalidate_caches()
        assert _importable(), "megatron.training does not import from the unpacked core_v0.16.1 tree"
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


def test_main_calls_pretrain_in_each_tags_convention(example, monkeypatch):
    """core_v0.16.1: pretrain(datasets, model_provider, type, forward, extra_args_provider=, args_defaults=)
    with --eval-interval defaulted (None there is a TypeError); core_v0.19: the script parses and passes
    a config container and model_provider=."""
    calls = []

    def pretrain_16(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                    extra_args_provider=None, args_defaults=None):
        calls.append(("0.16", model_provider, args_defaults))

    monkeypatch.setattr(example, "pretrain", pretrain_16)
    example.main()
    assert calls[-1][1] is example.model_provider and calls[-1][2]["eval_interval"] == 1000

    def pretrain_19(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                    model_provider=None):
        calls.append(("0.19", model_provider, cfg_container))

    import megatron.training.argument_utils as argument_utils
    import megatron.training.arguments as arguments

    seen = {}
    monkeypatch.setattr(arguments, "parse_and_validate_args",
                        lambda extra_args_provider=None, args_defaults=None: seen.update(defaults=args_defaults)
                        or "ARGS", raising=False)
    monkeypatch.setattr(argument_utils, "pretrain_cfg_container_from_args", lambda args: ("CFG", args), raising=False)
    monkeypatch.setattr(example, "pretrain", pretrain_19)
    example.main()
    assert calls[-1] == ("0.19", example.model_provider, ("CFG", "ARGS"))
    assert seen["defaults"]["eval_interval"] == 1000

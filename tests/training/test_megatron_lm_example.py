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


WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)


@pytest.fixture(scope="module")
def converted_wan(megatron_cpu, tmp_path_factory):
    """(converted checkpoint folder, shard folder with text, the converted weights) of a tiny diffusers Wan2.1."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed: pip install -e .[wan]")
    pytest.importorskip("safetensors", reason="safetensors is not installed: pip install -e .[wan]")
    from megatron_dsv.data import write_shard
    from megatron_dsv.models.wan_convert import convert_diffusers_folder

    root = tmp_path_factory.mktemp("mlm_wan")
    torch.manual_seed(0)
    theirs = diffusers.WanTransformer3DModel(**WAN_TINY)
    with torch.no_grad():  # off the init (zero biases, unit norms)
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs.save_pretrained(str(root / "diffusers"), safe_serialization=True)
    cfg, model = convert_diffusers_folder(str(root / "diffusers"), str(root / "wan"), latent_grid=(2, 8, 8))
    (root / "shards").mkdir()
    g = torch.Generator().manual_seed(1)
    write_shard(str(root / "shards" / "s0.safetensors"), torch.randn(4, 4, 2, 8, 8, generator=g),
                text=torch.randn(4, 5, 24, generator=g))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return str(root / "wan"), str(root / "shards"), weights


def _megatron_args(example, converted_wan, *flags, **megatron):
    """What Megatron-LM's get_args() would hold: the example's flags plus the Megatron fields the providers read."""
    ckpt, shards, _ = converted_wan
    args = example.extra_args_provider(argparse.ArgumentParser()).parse_args(
        ["--use-dsv-attention", "--pretrained", ckpt, "--dsv-query-group-shape", "1", "4", "4", *flags])
    values = dict(pipeline_model_parallel_size=1, tensor_model_parallel_size=1, context_parallel_size=1,
                  sequence_parallel=False, recompute_granularity=None, transformer_impl="local",
                  params_dtype=torch.float32, data_path=[shards], mock_data=False, num_layers=2, hidden_size=64,
                  num_attention_heads=2, kv_channels=32, seed=0, curr_iteration=0, log_interval=1)
    values.update(megatron)
    for key, value in values.items():
        setattr(args, key, value)
    return args


def test_pretrained_wan_loads_and_trains_a_step(example, converted_wan, monkeypatch):
    """--pretrained: the model provider builds the Wan transformer of the converted checkpoint with its weights
    and DSV attention, the datasets are the text shards, and one forward step gives a finite loss with gradients."""
    from megatron_dsv.attention import dsv_layers, dsv_stage

    args = _megatron_args(example, converted_wan)
    monkeypatch.setattr(example, "get_args", lambda: args)
    model = example.model_provider()
    assert type(model).__name__ == "WanTransformer" and len(dsv_layers(model)) == 2 and dsv_stage(model) == 1
    state, weights = model.state_dict(), converted_wan[2]
    for key in ("patch_embed.weight", "decoder.layers.1.self_attention.linear_qkv.weight",
                "text_embedder.linear_1.bias", "proj_out.bias"):
        assert torch.equal(state[key], weights[key]), key
    train, valid, test = example.train_valid_test_datasets_provider([4, 0, 0])
    assert type(train).__name__ == "LatentShardDataset" and valid is None and test is None
    batch = torch.utils.data.default_collate([train[0], train[1]])
    model.train()
    loss, reduce = example.forward_step(iter([batch]), model)
    assert torch.isfinite(loss) and loss.dim() == 0
    loss.backward()
    assert model.patch_embed.weight.grad.abs().sum() > 0
    assert reduce(loss)[2]["flow loss"][1] == 1.0


@pytest.mark.parametrize("megatron, message", [
    (dict(mock_data=True), "not --mock-data"),
    (dict(data_path=None), "--data-path"),
    (dict(num_layers=3), r"--num-layers 3 \(the checkpoint's: 2\)"),
    (dict(hidden_size=128, kv_channels=64), r"--hidden-size 128 .*--kv-channels 64"),
], ids=["mock-data", "no-data", "layers", "hidden"])
def test_pretrained_wan_bad_flags_name_the_flag(example, converted_wan, monkeypatch, megatron, message):
    args = _megatron_args(example, converted_wan, **megatron)
    monkeypatch.setattr(example, "get_args", lambda: args)
    with pytest.raises(ValueError, match=message):
        example.model_provider()
    if "data_path" in megatron or "mock_data" in megatron:
        with pytest.raises(ValueError, match="--pretrained"):
            example.train_valid_test_datasets_provider([4, 0, 0])


def test_launcher_pretrained_takes_the_checkpoints_shape(tmp_path):
    """pretrain_video_dit.sh with PRETRAINED and DATA_PATH: --pretrained and the shards instead of --preset and
    --mock-data, Megatron's shape flags from wan_config.json; a folder without it is one line, exit 2."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(EXAMPLE), "pretrain_video_dit.sh")
    (tmp_path / "wan").mkdir()
    (tmp_path / "shards").mkdir()
    (tmp_path / "wan" / "wan_config.json").write_text(json.dumps(dict(num_layers=30, num_attention_heads=12,
                                                                      attention_head_dim=128)))
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), PYTHON=sys.executable, DSV_DRY_RUN="1", NPROC="1",
               FUSION_FLAGS="0", PRETRAINED=str(tmp_path / "wan"), DATA_PATH=str(tmp_path / "shards"))
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout
    assert f"--pretrained {tmp_path / 'wan'} --data-path {tmp_path / 'shards'} --dataloader-type cyclic" in cmd
    assert "--num-layers 30 --hidden-size 1536 --num-attention-heads 12 --kv-channels 128" in cmd
    assert "--mock-data" not in cmd and "--preset" not in cmd and "--model-override" not in cmd
    proc = subprocess.run(["bash", script], env=dict(env, PRETRAINED=str(tmp_path / "shards")), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "holds no wan_config.json" in proc.stderr

"""Wan2.1 on Megatron-Core against diffusers' WanTransformer3DModel: a tiny random model saved with
save_pretrained, converted, run on the same latents / timesteps / text (fp32, dense and DSV stage 1),
exact round trips (state dict, safetensors folder, dist checkpoint, TP=2 over gloo), errors naming
the key or shape, and DSV fine-tuning steps with an exact resume."""

import json
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed: pip install -e .[wan] (or .[test])")
pytest.importorskip("safetensors", reason="safetensors is not installed: pip install -e .[wan]")

from megatron_dsv.config import DSVConfig  # noqa: E402
from megatron_dsv.models.wan import build_wan, count_wan_parameters  # noqa: E402
from megatron_dsv.models.wan_config import WAN_PRESETS, WanConfig  # noqa: E402
from megatron_dsv.models.wan_convert import (diffusers_shapes, diffusers_to_ours, full_state_from_model,  # noqa: E402
                                             load_diffusers_folder, load_into_model, load_megatron_checkpoint,
                                             ours_to_diffusers, save_diffusers_folder, save_megatron_checkpoint)

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=64, ffn_dim=256, num_layers=2, rope_max_seq_len=64)
LATENT = (4, 16, 16)  # -> 4 x 8 x 8 = 256 tokens
REL_TOL = 1e-5


def _tiny_diffusers(seed=0):
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**TINY).eval()
    with torch.no_grad():  # off the init (zero biases, unit norms): every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_tiny")
    _tiny_diffusers().save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


def _inputs(batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TINY["in_channels"], *LATENT, generator=g)
    t = torch.rand(batch, generator=g)
    text = torch.randn(batch, 7, TINY["text_dim"], generator=g)
    return x, t, text


def _diffusers_from_folder(folder):
    """diffusers' model from a folder: its config, then a strict load of the safetensors (from_pretrained
    would need accelerate for Wan's fp32-kept modules)."""
    from safetensors.torch import load_file

    model = diffusers.WanTransformer3DModel.from_config(diffusers.WanTransformer3DModel.load_config(folder))
    model.load_state_dict(load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors")), strict=True)
    return model


def _reference(folder, x, t, text):
    ref = _diffusers_from_folder(folder).eval()
    with torch.no_grad():
        return ref(x, t * 1000.0, text, return_dict=False)[0]  # Wan's scheduler timestep is 1000 * sigma


def _converted(folder, dsv_config=None, **overrides):
    # on the CPU on a GPU host too (tools/gpu_check.sh stage models), where Megatron, and so build_wan, put the
    # model on the GPU unless use_cpu_initialization: the tests feed it CPU tensors
    overrides.setdefault("use_cpu_initialization", True)
    config, state = load_diffusers_folder(folder)
    cfg = WanConfig.from_diffusers(config, latent_grid=LATENT)
    model = build_wan(cfg, dsv_config=dsv_config, use_te=False, **overrides)
    load_into_model(model, diffusers_to_ours(state, cfg))
    return model, cfg, state


def _rel(a, b):
    return float((a - b).abs().max() / a.abs().max())


def test_matches_diffusers_dense_any_token_order(megatron_cpu, wan_folder):
    x, t, text = _inputs()
    ref = _reference(wan_folder, x, t, text)
    model, _, _ = _converted(wan_folder)
    model.eval()
    with torch.no_grad():
        out = model(x, t, text=text)
        assert out.shape == ref.shape == x.shape and ref.abs().max() > 0.1
        assert _rel(ref, out) < REL_TOL, _rel(ref, out)
        # the cube-major order is a permutation: any cube gives the same velocity
        for cube in ((1, 1, 1), (4, 2, 2), (1, 4, 4)):
            model.cube = cube
            assert _rel(ref, model(x, t, text=text)) < REL_TOL, cube


@pytest.mark.parametrize("variant", [dict(cross_attn_norm=False), dict(out_channels=6),
                                     dict(attention_head_dim=70, num_attention_heads=3),
                                     dict(attention_head_dim=40, patch_size=(2, 2, 2))],
                         ids=["no-cross-norm", "out6", "H3-D70", "D40-patch222"])
def test_matches_diffusers_variants(megatron_cpu, tmp_path, variant):
    # odd RoPE bands (D=70: t 26, h and w 22 channels), other output widths, patches and no norm2
    torch.manual_seed(0)
    theirs = diffusers.WanTransformer3DModel(**{**TINY, **variant}).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs.save_pretrained(str(tmp_path), safe_serialization=True)
    grid = (4, 12, 16)
    config, state = load_diffusers_folder(str(tmp_path))
    cfg = WanConfig.from_diffusers(config, latent_grid=grid)
    model = build_wan(cfg, use_te=False, use_cpu_initialization=True).eval()
    load_into_model(model, diffusers_to_ours(state, cfg))
    g = torch.Generator().manual_seed(1)
    x, t, text = torch.randn(2, 4, *grid, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 32, generator=g)
    with torch.no_grad():
        ref = theirs(x, t * 1000.0, text, return_dict=False)[0]
        out = model(x, t, text=text)
    assert out.shape == ref.shape and _rel(ref, out) < REL_TOL
    back = ours_to_diffusers(full_state_from_model(model), cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("predictor_input", ["qk", "hidden"])
def test_dsv_stage1_matches_diffusers(megatron_cpu, wan_folder, predictor_input):
    x, t, text = _inputs()
    ref = _reference(wan_folder, x, t, text)
    dsv = DSVConfig(query_group_shape=(1, 4, 4), kernel_backend="naive", topk_backend="naive", k_min=16,
                    predictor_input=predictor_input)
    model, _, _ = _converted(wan_folder, dsv_config=dsv)
    core = model.decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "DSVCoreAttention" and core.stage_host == 1 and model.cube == (1, 4, 4)
    assert core.dsv_config.stage1_local_radius == (0, 0, 0)  # pretrained dense: auto's window stays off
    assert type(model.decoder.layers[0].cross_attention.core_attention).__name__ == "TextCrossCoreAttention"
    model.train()  # a training forward: the predictors sample queries, attention stays dense
    out = model(x, t, text=text)
    assert _rel(ref, out.detach()) < REL_TOL, _rel(ref, out.detach())


def test_explicit_stage1_window_holds_for_wan(megatron_cpu, wan_folder):
    """Only the default (auto) stage-1 window is off for the pretrained Wan; one asked for by radius is kept."""
    dsv = DSVConfig(query_group_shape=(1, 4, 4), kernel_backend="naive", topk_backend="naive", k_min=16,
                    stage1_local_radius=(0, 1, 1))
    model, _, _ = _converted(wan_folder, dsv_config=dsv)
    assert model.decoder.layers[0].self_attention.core_attention.dsv_config.stage1_local_radius == (0, 1, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_within_diffusers_own_error(megatron_cpu, wan_folder, device):
    # bf16: the error to the fp32 reference at most twice diffusers' own bf16 error on the same device.
    # diffusers keeps its time embedder, modulation tables and norms in fp32; ours is bf16 throughout, as
    # Megatron's Float16Module makes a model (measured on the CPU: 0.0080 vs diffusers' 0.0074, max-abs relative).
    x, t, text = _inputs()
    ref = _reference(wan_folder, x, t, text)
    theirs = _diffusers_from_folder(wan_folder).eval().to(torch.bfloat16)
    for name, module in theirs.named_modules():
        if any(k in name.split(".") for k in theirs._keep_in_fp32_modules):
            module.float()
    model, _, _ = _converted(wan_folder, use_cpu_initialization=device == "cpu")
    model, theirs = model.to(device=device, dtype=torch.bfloat16).eval(), theirs.to(device)
    x, t, text = x.to(device, torch.bfloat16), t.to(device), text.to(device, torch.bfloat16)
    with torch.no_grad():
        out_theirs = theirs(x, t * 1000.0, text, return_dict=False)[0].float().cpu()
        out = model(x, t, text=text)
    assert out.dtype == torch.bfloat16
    err, err_theirs = _rel(ref, out.float().cpu()), _rel(ref, out_theirs)
    assert err <= 2 * err_theirs, (err, err_theirs)


def test_roundtrip_exact(megatron_cpu, wan_folder, tmp_path):
    model, cfg, state = _converted(wan_folder)
    back = ours_to_diffusers(full_state_from_model(model), cfg)
    assert set(back) == set(state) == set(diffusers_shapes(cfg))
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    # a diffusers folder diffusers itself loads, strictly, with the same tensors
    out = tmp_path / "export"
    save_diffusers_folder(str(out), cfg, back)
    reloaded = _diffusers_from_folder(str(out))
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert json.loads((out / "config.json").read_text())["num_layers"] == TINY["num_layers"]
    # sharded safetensors (index) read back the same
    save_diffusers_folder(str(tmp_path / "sharded"), cfg, back, max_shard_bytes=200_000)
    assert len([n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]) > 1
    _, resharded = load_diffusers_folder(str(tmp_path / "sharded"))
    assert all(torch.equal(resharded[k], v) for k, v in state.items())


def _cli():
    """tools/convert_checkpoint.py as a module (its main() runs in this process)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_checkpoint_roundtrip_and_cli(megatron_cpu, wan_folder, tmp_path):
    convert_checkpoint = _cli()
    model, cfg, state = _converted(wan_folder)
    save_megatron_checkpoint(model, str(tmp_path / "ckpt"))
    fresh = build_wan(cfg, use_te=False, use_cpu_initialization=True)
    load_megatron_checkpoint(fresh, str(tmp_path / "ckpt"))
    back = ours_to_diffusers(full_state_from_model(fresh), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    rc = convert_checkpoint.main(["to-diffusers", "--megatron", str(tmp_path / "ckpt"), "--out", str(tmp_path / "d")])
    assert rc == 0
    _, exported = load_diffusers_folder(str(tmp_path / "d"))
    assert set(exported) == set(state) and all(torch.equal(exported[k], v) for k, v in state.items())
    # the CLI both ways: diffusers -> Megatron -> diffusers, and its errors as one line, exit code 2
    rc = convert_checkpoint.main(["to-megatron", "--diffusers", wan_folder, "--out", str(tmp_path / "cli")])
    assert rc == 0 and (tmp_path / "cli" / "wan_config.json").is_file()
    rc = convert_checkpoint.main(["to-diffusers", "--megatron", str(tmp_path / "cli"), "--out", str(tmp_path / "e")])
    _, exported = load_diffusers_folder(str(tmp_path / "e"))
    assert rc == 0 and all(torch.equal(exported[k], v) for k, v in state.items())
    assert convert_checkpoint.main(["to-megatron", "--diffusers", wan_folder, "--out", str(tmp_path / "cli")]) == 2
    no_config = ["to-diffusers", "--megatron", str(tmp_path / "d"), "--out", str(tmp_path / "f")]
    assert convert_checkpoint.main(no_config) == 2  # a diffusers folder is not a Megatron checkpoint


def test_text_mask_hides_padding(megatron_cpu, wan_folder):
    # Wan attends to the zero padding (no mask, as diffusers); a mask, when given, makes padding irrelevant
    model, _, _ = _converted(wan_folder)
    model.eval()
    x, t, text = _inputs()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7], dtype=torch.bool)
    with torch.no_grad():
        out = model(x, t, text=text, text_mask=mask)
        text2 = text.clone()
        text2[0, 4:] = 50.0
        torch.testing.assert_close(model(x, t, text=text2, text_mask=mask), out)
        assert _rel(out, model(x, t, text=text2)) > 1e-3


def test_export_of_a_trainer_checkpoint_and_its_ema(megatron_cpu, wan_folder, tmp_path):
    # the trainer's layout: {"model", "ema"} (+ optimizer) in an iter_* folder without wan_config.json
    from megatron.core import dist_checkpointing

    from megatron_dsv.training.checkpointing import _save_strategy
    from megatron_dsv.training.ema import ModelEMA

    model, cfg, state = _converted(wan_folder, dsv_config=DSVConfig(query_group_shape=(1, 4, 4)))
    ema = ModelEMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    ema.update(model)  # the average now differs from both the original and the live weights
    sharded = model.sharded_state_dict()
    (tmp_path / "iter").mkdir()
    dist_checkpointing.save({"model": sharded, "ema": ema.sharded_state_dict(sharded)}, str(tmp_path / "iter"),
                            sharded_strategy=_save_strategy())
    convert_checkpoint = _cli()
    for flag, name in (([], "live"), (["--ema"], "ema")):
        args = ["to-diffusers", "--megatron", str(tmp_path / "iter"), "--config-from", wan_folder,
                "--out", str(tmp_path / name)] + flag
        assert convert_checkpoint.main(args) == 0
    _, live = load_diffusers_folder(str(tmp_path / "live"))
    _, averaged = load_diffusers_folder(str(tmp_path / "ema"))
    expected_live = ours_to_diffusers(full_state_from_model(model), cfg)
    ema.copy_to(model)
    expected_ema = ours_to_diffusers(full_state_from_model(model), cfg)
    for key in state:
        assert torch.equal(live[key], expected_live[key]) and torch.equal(averaged[key], expected_ema[key]), key
    assert not torch.equal(live["proj_out.weight"], averaged["proj_out.weight"])


def test_errors_name_the_key_or_shape(megatron_cpu, wan_folder, tmp_path):
    config, state = load_diffusers_folder(wan_folder)
    cfg = WanConfig.from_diffusers(config, latent_grid=LATENT)
    bad = dict(state)
    bad["blocks.1.attn2.to_k.weight"] = torch.zeros(128, 31)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn2\.to_k\.weight.*\(128, 31\).*\(128, 128\)"):
        diffusers_to_ours(bad, cfg)
    bad = {k: v for k, v in state.items() if k != "blocks.0.norm2.bias"}
    bad["blocks.0.attn1.to_qkv.weight"] = torch.ones(384, 128)  # fused projections: not a saved layout
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.0\.norm2\.bias'\].*attn1\.to_qkv"):
        diffusers_to_ours(bad, cfg)
    # what diffusers itself ignores on load is ignored here too
    assert diffusers_to_ours({**state, "blocks.0.attn2.norm_added_q.weight": torch.ones(128)}, cfg).keys() \
        == diffusers_to_ours(state, cfg).keys()
    with pytest.raises(ValueError, match="image_dim"):
        WanConfig.from_diffusers({**config, "image_dim": 1280, "added_kv_proj_dim": 128})
    with pytest.raises(ValueError, match="num_frames"):
        WanConfig.from_diffusers({**config, "num_frames": 3})
    with pytest.raises(ValueError, match="_class_name"):
        WanConfig.from_diffusers({**config, "_class_name": "FluxTransformer2DModel"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never loaded"):
        load_diffusers_folder(str(tmp_path))
    other = build_wan(WanConfig(**{**cfg.to_dict(), "ffn_dim": 128}), use_te=False)
    with pytest.raises(ValueError, match=r"mlp\.linear_fc1\.weight.*\(256, 128\).*\(128, 128\)"):
        load_into_model(other, diffusers_to_ours(state, cfg))
    model = build_wan(cfg, use_te=False)
    x, t, text = _inputs()
    with pytest.raises(ValueError, match="text"):
        model(x, t)
    with pytest.raises(ValueError, match="labels"):
        model(x, t, torch.zeros(2, dtype=torch.long), text=text)


def test_presets_are_the_published_shapes():
    small = WanConfig.from_preset("wan2.1-t2v-1.3b")
    big = WanConfig.from_preset("wan2.1-t2v-14b")
    assert (small.num_layers, small.hidden, small.num_attention_heads, small.ffn_dim) == (30, 1536, 12, 8960)
    assert (big.num_layers, big.hidden, big.num_attention_heads, big.ffn_dim) == (40, 5120, 40, 13824)
    defaults = WanConfig()  # diffusers' own defaults are the 14B shape
    assert all(getattr(defaults, k) == v for k, v in WAN_PRESETS["wan2.1-t2v-14b"].items())
    assert 1.2e9 < count_wan_parameters(small) < 1.5e9 and 13e9 < count_wan_parameters(big) < 15e9
    assert small.token_grid() == (21, 30, 52)  # 81 x 480 x 832 frames: 32760 tokens


def test_param_count_matches_diffusers(megatron_cpu, wan_folder):
    model, cfg, state = _converted(wan_folder)
    assert count_wan_parameters(cfg) == sum(v.numel() for v in state.values())
    assert count_wan_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_sparsity_analysis_of_the_converted_model(megatron_cpu, wan_folder):
    # the analysis tools/analyze_sparsity.py plots, on a converted model before any training (the
    # forward signature is VideoDiT's; the coordinates are the model's cube-major order)
    from megatron_dsv.attention.analysis import analyze
    from megatron_dsv.attention.grouping import cube_order_coords

    model, cfg, _ = _converted(wan_folder, dsv_config=DSVConfig(query_group_shape=(1, 4, 4), k_min=16,
                                                                kernel_backend="naive", topk_backend="naive"))
    x, t, text = _inputs(batch=1)
    coords = cube_order_coords(cfg.token_grid(x.shape[2:]), model.cube)
    report = analyze(model, x, t, None, text=text, coords=coords, max_queries=64)
    assert len(report["layers"]) == cfg.num_layers and report["S"] == coords.shape[0]
    assert all(0.0 <= s <= 1.0 for layer in report["layers"] for s in layer["sparsity"])


def _flow_step(model, opt, step, seed):
    from megatron_dsv.attention import dsv_on_step_end

    x0, _, text = _inputs(batch=1, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    noise, t = torch.randn(x0.shape, generator=g), torch.rand(1, generator=g)
    x_t = (1 - t.view(1, 1, 1, 1, 1)) * x0 + t.view(1, 1, 1, 1, 1) * noise
    loss = torch.nn.functional.mse_loss(model(x_t, t, text=text), noise - x0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    dsv_on_step_end(model, step)
    return float(loss.detach())


def test_dsv_finetune_steps_and_exact_resume(megatron_cpu, wan_folder, tmp_path, fast_table):
    from megatron.core import dist_checkpointing

    from megatron_dsv.attention import dsv_layers, dsv_stage
    from megatron_dsv.training.checkpointing import _save_strategy

    dsv = DSVConfig(query_group_shape=(1, 4, 4), granularity="token", k_min=16, kernel_backend="naive",
                    topk_backend="naive", predictor_query_stride=8, profile_interval=1, stage_switch_rule="steps",
                    stage_switch_steps=2, sparsity_threshold=0.0, speedup_table=fast_table)
    model, cfg, _ = _converted(wan_folder, dsv_config=dsv)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = [_flow_step(model, opt, step, seed=step) for step in (1, 2, 3)]
    assert all(torch.isfinite(torch.tensor(losses))) and dsv_stage(model) == 2
    assert any(layer.last_sparse for layer in dsv_layers(model))  # step 3 ran sparse
    (tmp_path / "resume").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "resume"), sharded_strategy=_save_strategy())
    resumed = build_wan(cfg, dsv_config=dsv, use_te=False, use_cpu_initialization=True)
    resumed.load_state_dict(dist_checkpointing.load(resumed.sharded_state_dict(), str(tmp_path / "resume")),
                            strict=True)
    resumed.train()
    assert dsv_stage(resumed) == 2
    a = _flow_step(model, opt, 4, seed=4)
    b = _flow_step(resumed, torch.optim.SGD(resumed.parameters(), lr=1e-2), 4, seed=4)
    assert a == b
    for (name, p), (_, q) in zip(model.state_dict().items(), resumed.state_dict().items()):
        if isinstance(p, torch.Tensor):
            assert torch.equal(p, q), name


def test_dsv_saves_a_copy_of_v_below_fp32():
    # WanQKNorm computes in fp32: in bf16 it keeps a copy of q/k, not a view of the fused QKV buffer, so a
    # saved v view would pin that whole buffer; DSVCoreAttention reads config.dsv_save_v_view
    from megatron_dsv.models.wan import _transformer_config

    cfg = WanConfig(num_attention_heads=2, attention_head_dim=64, ffn_dim=128, num_layers=1, text_dim=32)
    assert _transformer_config(cfg, torch.float32, {}).dsv_save_v_view is True
    assert _transformer_config(cfg, torch.bfloat16, {}).dsv_save_v_view is False

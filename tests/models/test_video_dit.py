"""VideoDiT: preset layer shapes, layout round trips, RoPE, conditioning, errors, checkpoint state."""

import pytest
import torch

from megatron_dsv.config import DSVConfig
from megatron_dsv.models.rope3d import rope_3d_freqs, rope_3d_table, rope_bands
from megatron_dsv.models.video_dit import (PRESETS, VideoDiTConfig, build_video_dit, count_parameters,
                                           flow_matching_loss, get_video_dit_layer_spec, patchify, unpatchify)

SMALL = dict(in_channels=4, latent_frames=2, latent_height=8, latent_width=8, num_classes=4)
# The tests that feed a model CPU tensors build it with use_cpu_initialization=True: CPU tests on a GPU host too
# (tools/gpu_check.sh stage models), where Megatron, and so build_video_dit, put the model on the GPU otherwise.


def _inputs(cfg, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, *cfg.latent_grid, generator=g)
    return x, torch.rand(batch, generator=g), torch.randint(cfg.num_classes, (batch,), generator=g)


def _randomise(model, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "predictor" not in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * std)


@pytest.mark.parametrize("use_dsv", [False, True], ids=["dense", "dsv"])
@pytest.mark.parametrize("preset", ["tiny", "0.8b", "2.7b", "30b"])
def test_preset_layer_shape_forward_backward(megatron_cpu, preset, use_dsv):
    # One layer with the preset's heads x head_dim (96, 128, 256 ...) at a small hidden size.
    cfg = VideoDiTConfig.from_preset(preset, hidden=64, layers=1, **SMALL)
    assert (cfg.heads, cfg.head_dim) == (PRESETS[preset]["heads"], PRESETS[preset]["head_dim"])
    dsv = DSVConfig(query_group_shape=(1, 4, 4)) if use_dsv else None
    model = build_video_dit(cfg, dsv_config=dsv, use_te=False, use_cpu_initialization=True)
    _randomise(model)
    x, t, y = _inputs(cfg)
    v = model(x, t, y)
    assert v.shape == x.shape and torch.isfinite(v).all()
    v.square().mean().backward()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (3 * cfg.heads * cfg.head_dim, 64)
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0


def test_param_count_matches_formula(megatron_cpu):
    for overrides in ({}, {"text_dim": 24}, {"qk_layernorm": False}):
        cfg = VideoDiTConfig.from_preset("tiny", **overrides)
        model = build_video_dit(cfg, use_te=False)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)
    approx = {k: count_parameters(VideoDiTConfig.from_preset(k)) / 1e9 for k in ("0.8b", "2.7b", "30b")}
    assert 0.6 < approx["0.8b"] < 0.9 and 2.2 < approx["2.7b"] < 3.0 and 26 < approx["30b"] < 32


def test_patchify_roundtrip():
    x = torch.randn(2, 3, 4, 6, 10)
    for patch in ((1, 2, 2), (2, 3, 5), (1, 1, 1)):
        tokens = patchify(x, patch)
        grid = (4 // patch[0], 6 // patch[1], 10 // patch[2])
        assert tokens.shape == (2, grid[0] * grid[1] * grid[2], 3 * patch[0] * patch[1] * patch[2])
        assert torch.equal(unpatchify(tokens, grid, patch, 3), x)
    # token 1 is the patch right of token 0 (raster order, w fastest)
    t = patchify(x, (1, 2, 2))
    assert torch.equal(t[0, 1].view(3, 1, 2, 2), x[0, :, 0:1, 0:2, 2:4])


def test_identity_blocks_return_input_layout(megatron_cpu):
    # adaLN-Zero: at init every layer is the identity. With random embed/final weights the model is then a
    # per-token map; it must equal the same map applied in raster order (cube order restored at the output).
    cfg = VideoDiTConfig.from_preset("tiny", layers=2, latent_frames=4, latent_height=8, latent_width=12)
    model = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)
    with torch.no_grad():
        for lin in (model.final_adaln, model.final_linear):
            lin.weight.normal_(std=0.1)
            lin.bias.normal_(std=0.1)
    x, t, y = _inputs(cfg)
    out = model(x, t, y)
    with torch.no_grad():
        cond = model.t_embedder(__import__("megatron_dsv.models.video_dit", fromlist=["x"]).timestep_features(
            t, cfg.frequency_embedding_size)) + model.y_embedder(y)
        h = model.patch_embed(patchify(x, cfg.patch))
        shift, scale = model.final_adaln(torch.nn.functional.silu(cond)).chunk(2, dim=-1)
        h = model.final_norm(h) * (1 + scale[:, None]) + shift[:, None]
        expected = unpatchify(model.final_linear(h), cfg.token_grid(), cfg.patch, cfg.in_channels)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_output_independent_of_cube(megatron_cpu):
    # RoPE follows the cube-order coordinates, so attention sees the same geometry in any token order:
    # the full (trained-looking) model gives the same velocity for any cube.
    cfg = VideoDiTConfig.from_preset("tiny", layers=2, latent_frames=4, latent_height=8, latent_width=8)
    model = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)
    _randomise(model, std=0.1)
    x, t, y = _inputs(cfg)
    with torch.no_grad():
        model.cube = (2, 4, 4)
        a = model(x, t, y)
        model.cube = (1, 1, 1)
        b = model(x, t, y)
        model.cube = (4, 2, 2)
        c = model(x, t, y)
    assert a.abs().max() > 1e-3
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_dsv_cube_is_query_group_shape(megatron_cpu):
    cfg = VideoDiTConfig.from_preset("tiny", layers=1)
    assert build_video_dit(cfg, use_te=False).cube == cfg.cube
    model = build_video_dit(cfg, dsv_config=DSVConfig(query_group_shape=(1, 4, 4)), use_te=False)
    assert model.cube == (1, 4, 4)
    core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    assert core == "DSVCoreAttention"
    assert type(build_video_dit(cfg, use_te=False).decoder.layers[0].self_attention.core_attention).__name__ \
        == "DenseCoreAttention"


def test_rope_bands():
    assert rope_bands(32) == (6, 5, 5)
    assert rope_bands(96) == (16, 16, 16)
    assert rope_bands(128) == (22, 21, 21)
    assert rope_bands(256) == (44, 42, 42)
    assert sum(rope_bands(72)) == 36
    coords = torch.tensor([[0, 0, 0], [3, 0, 0], [0, 5, 0], [0, 0, 7]])
    f = rope_3d_freqs(coords, 96)
    nt, nh, nw = rope_bands(96)
    assert torch.all(f[0] == 0)
    # a t move turns only the t band, h only the h band, w only the w band
    assert f[1, :nt].abs().min() > 0 and f[1, nt:].abs().max() == 0
    assert f[2, nt:nt + nh].abs().min() > 0 and f[2, :nt].abs().max() == 0 and f[2, nt + nh:].abs().max() == 0
    assert f[3, nt + nh:].abs().min() > 0 and f[3, :nt + nh].abs().max() == 0
    assert f[1, 0] == 3.0 and f[2, nt] == 5.0 and f[3, nt + nh] == 7.0  # lowest rung turns 1 rad per step
    with pytest.raises(ValueError, match="head_dim"):
        rope_bands(33)


def test_rope_relative_with_megatron_apply():
    # Megatron's own apply_rotary_pos_emb with our table: q.k depends only on the 3D offset.
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    grid, cube, d = (6, 6, 6), (2, 2, 2), 12
    table = rope_3d_table(grid, cube, d)  # [S, 1, 1, d]
    assert table.shape == (216, 1, 1, d) and table.dtype == torch.float32
    from megatron_dsv.attention.grouping import cube_order_coords

    coords = cube_order_coords(grid, cube)
    index = {tuple(c.tolist()): i for i, c in enumerate(coords)}
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, d, generator=g), torch.randn(1, 1, 1, d, generator=g)

    def score(pq, pk):
        rq = _apply_rotary_pos_emb_bshd(q, table[index[pq]][None])
        rk = _apply_rotary_pos_emb_bshd(k, table[index[pk]][None])
        return float((rq * rk).sum())

    # same offset (2, 2, 1) at three different places
    base = score((0, 1, 0), (2, 3, 1))
    for pq in ((1, 0, 2), (2, 2, 2), (1, 1, 1)):
        pk = tuple(a + b for a, b in zip(pq, (2, 2, 1)))
        torch.testing.assert_close(torch.tensor(score(pq, pk)), torch.tensor(base), rtol=1e-5, atol=1e-5)
    assert abs(score((0, 1, 0), (2, 3, 2)) - base) > 1e-4  # another offset, another score


def test_text_cross_attention(megatron_cpu):
    cfg = VideoDiTConfig.from_preset("tiny", layers=1, text_dim=24, **SMALL)
    model = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)
    _randomise(model, std=0.1)
    x, t, y = _inputs(cfg)
    text = torch.randn(2, 5, 24)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = model(x, t, y, text=text, text_mask=mask)
    assert out.shape == x.shape
    # padded text tokens do not matter
    text2 = text.clone()
    text2[0, 3:] = 100.0
    torch.testing.assert_close(model(x, t, y, text=text2, text_mask=mask), out)
    loss = flow_matching_loss(model, x, y, generator=torch.Generator().manual_seed(0), text=text, text_mask=mask)
    loss.backward()
    assert model.text_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="text"):
        model(x, t, y)


def test_bad_presets_and_shapes(megatron_cpu):
    with pytest.raises(ValueError, match="preset"):
        VideoDiTConfig.from_preset("7b")
    with pytest.raises(ValueError, match="unknown VideoDiTConfig field"):
        VideoDiTConfig.from_preset("tiny", hiden=3)
    with pytest.raises(ValueError, match="head_dim"):
        VideoDiTConfig.from_preset("tiny", head_dim=33)
    with pytest.raises(ValueError, match="latent grid H"):
        VideoDiTConfig.from_preset("tiny", latent_height=15)
    with pytest.raises(ValueError, match="timestep_sampling"):
        VideoDiTConfig.from_preset("tiny", timestep_sampling="cosine")
    cfg = VideoDiTConfig.from_preset("tiny", layers=1, **SMALL)
    model = build_video_dit(cfg, use_te=False)
    x, t, y = _inputs(cfg)
    with pytest.raises(ValueError, match="in_channels"):
        model(torch.randn(2, 3, 2, 8, 8), t, y)
    with pytest.raises(ValueError, match="latent grid W"):
        model(torch.randn(2, 4, 2, 8, 7), t, y)
    with pytest.raises(ValueError, match=r"\[B, C, T, H, W\]"):
        model(torch.randn(4, 2, 8, 8), t, y)
    with pytest.raises(ValueError, match="labels"):
        model(x, t, None)
    with pytest.raises(ValueError, match="labels must be in"):
        model(x, t, torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="timesteps"):
        model(x, t[:1], y)
    with pytest.raises(ValueError, match="dtype"):
        build_video_dit(cfg, dtype=torch.int32)
    with pytest.raises(ValueError, match="dsv_config"):
        build_video_dit(cfg, dsv_config={"query_group_shape": (2, 4, 4)})
    with pytest.raises(ValueError, match="use_dsv"):
        get_video_dit_layer_spec(use_dsv="yes")
    with pytest.raises(ValueError, match="timestep_sampling"):
        flow_matching_loss(model, x, y, timestep_sampling="cosine")


def test_dist_checkpoint_roundtrip(megatron_cpu, tmp_path):
    from megatron.core import dist_checkpointing

    cfg = VideoDiTConfig.from_preset("tiny", layers=2, **SMALL)
    a = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)
    _randomise(a, seed=1)
    # dist_checkpointing's default writer stages through CUDA: use the trainer's CPU-safe strategy
    strategy = pytest.importorskip("megatron_dsv.training.checkpointing")._save_strategy()
    dist_checkpointing.save(a.sharded_state_dict(), str(tmp_path), sharded_strategy=strategy)
    b = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)
    b.load_state_dict(dist_checkpointing.load(b.sharded_state_dict(), str(tmp_path)), strict=True)
    x, t, y = _inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(a(x, t, y), b(x, t, y), rtol=0, atol=0)


@pytest.mark.gpu
def test_builders_put_the_whole_model_on_the_gpu(megatron_cpu):
    # Megatron-Core builds its layers on the GPU; the model's own embedders and heads must follow, or a
    # user's first forward fails on mixed devices (seen on the H200 before the builders moved them)
    from megatron_dsv.models.wan import build_wan
    from megatron_dsv.models.wan_config import WanConfig

    cfg = VideoDiTConfig.from_preset("tiny", layers=1, **SMALL)
    wan = WanConfig(num_attention_heads=2, attention_head_dim=64, ffn_dim=128, num_layers=1, text_dim=32)
    for model in (build_video_dit(cfg, use_te=False), build_wan(wan, use_te=False)):
        assert {p.device.type for p in model.parameters()} == {"cuda"}, type(model).__name__


@pytest.mark.gpu
def test_recompute_matches_and_bf16_runs(megatron_cpu):
    # Megatron's activation checkpoint stores CUDA RNG states: GPU only. The conditioning travels in the
    # block's attention_mask slot, so recomputation must still give the embedders their gradients.
    cfg = VideoDiTConfig.from_preset("tiny", layers=2, **SMALL)
    torch.manual_seed(0)
    plain = build_video_dit(cfg, use_te=False).cuda()
    _randomise(plain, std=0.1)
    recompute = build_video_dit(cfg, use_te=False, recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=1).cuda()
    recompute.load_state_dict(plain.state_dict())
    x, t, y = (a.cuda() for a in _inputs(cfg))
    for m in (plain, recompute):
        m(x, t, y).square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recompute.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert plain.t_embedder[0].weight.grad.abs().sum() > 0
    bf16 = build_video_dit(cfg, use_te=False, dtype=torch.bfloat16).cuda()
    assert bf16(x.bfloat16(), t, y).dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dsv_training_steps_deterministic_mode(megatron_cpu, fast_table, device, monkeypatch):
    """Megatron's --deterministic-mode (torch.use_deterministic_algorithms(True)) over DSV training steps with
    the library's lists (block lists, the auto neighbourhood, sparse layers, a profile step, predictor training):
    nothing raises, and two runs from the same state give the same losses and gradients, bit for bit."""
    from megatron_dsv.attention import dsv_layers, dsv_on_step_end

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what torch asks of a deterministic cuBLAS
    cfg = VideoDiTConfig.from_preset("tiny", layers=2, in_channels=4, latent_frames=4, latent_height=32,
                                     latent_width=32, num_classes=4)
    # grid (4, 16, 16): the 4x4x8 cube tiles it; on the CPU the naive kernels (the check of the test itself: the
    # interpreter runs Triton's programs one after another, atomics included), on the GPU the library's
    naive = dict(kernel_backend="naive", topk_backend="naive") if device == "cpu" else {}
    dsv = DSVConfig(sparsity_threshold=0.0, speedup_table=fast_table, stage_switch_rule="steps",
                    stage_switch_steps=1, profile_interval=2, **naive)
    torch.manual_seed(0)
    base = build_video_dit(cfg, dsv_config=dsv, use_te=False, use_cpu_initialization=True)
    _randomise(base)
    state = {k: v.clone() for k, v in base.state_dict().items() if v is not None}
    x, t, y = (a.to(device) for a in _inputs(cfg))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            model = build_video_dit(cfg, dsv_config=dsv, use_te=False, use_cpu_initialization=True)
            model.load_state_dict(state)
            model.to(device)
            losses, sparse = [], []
            for step in range(4):  # stage 1, then stage 2 (a profile step at 2)
                model.zero_grad(set_to_none=True)
                loss = model(x, t, y).square().mean()
                loss.backward()
                losses.append(loss.detach())
                sparse.append([layer.last_sparse for layer in dsv_layers(model)])
                dsv_on_step_end(model, step + 1)
            runs.append((losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                         sparse))
    finally:
        torch.use_deterministic_algorithms(before)
    (l1, g1, s1), (l2, g2, s2) = runs
    assert any(any(row) for row in s1), s1  # sparse layers ran
    assert dsv_layers(model)[0]._local_tokens(cfg.latent_frames * 16 * 16) > 0  # with the neighbourhood
    assert all(torch.equal(a, b) for a, b in zip(l1, l2)) and g1.keys() == g2.keys()
    assert all(torch.equal(g1[n], g2[n]) for n in g1), [n for n in g1 if not torch.equal(g1[n], g2[n])]

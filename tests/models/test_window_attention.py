"""3D local-window attention baseline: exact lists, density, a dense masked reference, the DiT wiring."""

import itertools
import math
import os

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention.grouping import cube_order_coords
from megatron_dsv.config import DSVConfig
from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit, flow_matching_loss
from megatron_dsv.models.window_attention import (WindowConfig, WindowCoreAttention, get_window_layer_spec,
                                                  kept_fraction, radius_for_fraction, window_block_lists)

ODD_GRID, ODD_CUBE = (8, 12, 16), (2, 4, 8)  # cube grid 4 x 3 x 2, G = 64


def _brute_force(ncubes, radius):
    cubes = list(itertools.product(*(range(n) for n in ncubes)))  # raster order of the cube grid
    return [{j for j, other in enumerate(cubes) if all(abs(a - b) <= r for a, b, r in zip(c, other, radius))}
            for c in cubes]


@pytest.mark.parametrize("radius", [(1, 1, 0), (0, 2, 1), (0, 0, 0), (5, 5, 5)], ids=str)
def test_lists_are_the_neighbourhood(radius):
    idx, counts = window_block_lists(ODD_GRID, ODD_CUBE, radius)
    assert idx.dtype == counts.dtype == torch.int32 and idx.shape[0] == counts.shape[0] == 24
    expected = _brute_force((4, 3, 2), radius)
    assert idx.shape[1] == max(len(e) for e in expected)
    for g, want in enumerate(expected):
        row = idx[g, :counts[g]].tolist()
        assert row == sorted(want), (g, row, sorted(want))
        assert (idx[g, counts[g]:] == -1).all()
    assert window_block_lists(ODD_GRID, ODD_CUBE, radius)[0] is idx  # cached


@pytest.mark.parametrize("radius", [(1, 1, 0), (0, 2, 1), (1, 0, 1), (3, 3, 3)], ids=str)
def test_kept_fraction_matches_lists(radius):
    _, counts = window_block_lists(ODD_GRID, ODD_CUBE, radius)
    from_lists = counts.double().mean().item() / counts.numel()  # every cube is one block of G keys
    assert kept_fraction(ODD_GRID, ODD_CUBE, radius) == pytest.approx(from_lists, rel=1e-12)
    assert kept_fraction(ODD_GRID, ODD_CUBE, radius) == pytest.approx(_token_mask(ODD_GRID, ODD_CUBE, radius)
                                                                      .double().mean().item(), rel=1e-12)


def test_radius_for_fraction():
    grid, cube = (16, 32, 32), (4, 4, 8)  # cube grid 4 x 8 x 4
    assert radius_for_fraction(grid, cube, 1e-6) == (0, 0, 0)
    assert radius_for_fraction(grid, cube, 1.0) == (3, 7, 3)
    for target in (0.05, 0.1, 0.25, 0.5, 0.9):
        r = radius_for_fraction(grid, cube, target)
        assert kept_fraction(grid, cube, r) >= target
        # one step back on the path (the last-grown axis) falls short
        smaller = [tuple(x - (a == i) for a, x in enumerate(r)) for i in range(3) if r[i] > 0]
        assert any(kept_fraction(grid, cube, s) < target for s in smaller)
    with pytest.raises(ValueError, match="target"):
        radius_for_fraction(grid, cube, 0.0)


def _token_mask(grid, cube, radius):
    """[S, S] bool, True where query token i (cube order) may attend key token j, from token coordinates."""
    cc = cube_order_coords(grid, cube) // torch.tensor(cube)
    return ((cc[:, None, :] - cc[None, :, :]).abs() <= torch.tensor(radius)).all(-1)


def _config(heads, groups, head_dim=64):
    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0)


def _core(megatron_cpu, wc, grid, heads=2, groups=2, mask_type=AttnMaskType.no_mask):
    return WindowCoreAttention(_config(heads, groups), layer_number=1, attn_mask_type=mask_type,
                               attention_type="self", pg_collection=megatron_cpu, window_config=wc, token_grid=grid)


def _reference(q, k, v, keep, scale):
    """fp32 softmax attention on Megatron layouts, GQA by repetition; keep [S, S] True = attend."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.float(), k.float()) * scale
    p = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", p, v.float())
    return out.reshape(out.shape[0], out.shape[1], -1)


# grid 6 x 12 x 8 with cube 2 x 4 x 8: cube grid 3 x 3 x 1, lists of 4, 6 and 9 cubes (three size classes);
# grid 10 x 12 x 16: cube grid 5 x 3 x 2 at radius (2, 1, 1), six classes (12, 16, 18, 20, 24, 30 cubes)
# not in raster order, so the class permutation is exercised
@pytest.mark.parametrize("heads,groups", [(2, 2), (4, 2)], ids=["MHA-H2", "GQA-H4-KV2"])
@pytest.mark.parametrize("grid,radius", [((6, 12, 8), (1, 1, 0)), ((4, 8, 16), (0, 1, 0)),
                                         ((10, 12, 16), (2, 1, 1))],
                         ids=["S576-r110", "S512-r010", "S1920-r211"])
def test_matches_dense_masked_reference(megatron_cpu, heads, groups, grid, radius):
    wc = WindowConfig(cube=(2, 4, 8), radius=radius, block_size=64)
    core = _core(megatron_cpu, wc, grid, heads, groups)
    S, B, D = math.prod(grid), 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, h, D, generator=g).requires_grad_() for h in (heads, groups, groups))
    do = torch.randn(S, B, heads * D, generator=g)
    out = core(q, k, v, None)
    grads = torch.autograd.grad(out, (q, k, v), do)
    keep = _token_mask(grid, wc.cube, radius)
    ref = _reference(q, k, v, keep, 1.0 / math.sqrt(D))
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    assert out.shape == (S, B, heads * D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_path_one_call_matches_reference(megatron_cpu, monkeypatch):
    """The module routed through the Triton kernels (interpreter, fp32): one call over every query and key,
    one list length per query cube (edge cubes shorter), forward and gradients equal the dense masked
    reference."""
    import megatron_dsv.models.window_attention as wa
    from megatron_dsv.ops.sparse_attention import sparse_attention

    calls = []

    def triton_op(q, k, v, idx, counts, G, BS, scale):
        calls.append((q.shape[2], k.shape[2], tuple(idx.shape), counts[0, 0].tolist()))
        return sparse_attention(q, k, v, idx, counts, G, BS, scale, backend="triton")

    monkeypatch.setattr(wa, "sparse_attention_naive", triton_op)
    grid, radius = (6, 12, 8), (1, 1, 0)  # cube grid 3 x 3 x 1: lists of 4, 6 and 9 cubes
    wc = WindowConfig(cube=(2, 4, 8), radius=radius, block_size=64)
    core = _core(megatron_cpu, wc, grid, heads=2, groups=1)
    S, B, D = math.prod(grid), 2, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, B, h, D, generator=g).requires_grad_() for h in (2, 1, 1))
    do = torch.randn(S, B, 2 * D, generator=g)
    out = core(q, k, v, None)
    grads = torch.autograd.grad(out, (q, k, v), do)
    _, counts = window_block_lists(grid, wc.cube, radius)
    assert calls == [(S, S, (B, 2, 9, 9), counts.tolist())]
    assert sorted(set(counts.tolist())) == [4, 6, 9]
    ref = _reference(q, k, v, _token_mask(grid, wc.cube, radius), 1.0 / math.sqrt(D))
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_bad_inputs_raise(megatron_cpu):
    with pytest.raises(ValueError, match="cube"):
        WindowConfig(cube=(2, 4, 4), block_size=64)
    with pytest.raises(ValueError, match="block_size"):
        WindowConfig(cube=(2, 4, 4), block_size=32)
    with pytest.raises(ValueError, match="radius"):
        WindowConfig(cube=(2, 4, 8), radius=(1, -1, 0), block_size=64)
    with pytest.raises(ValueError, match="token_grid"):
        window_block_lists((8, 10, 16), (2, 4, 8), (1, 1, 1))
    with pytest.raises(ValueError, match="token_grid"):
        kept_fraction((8, 12, 12), (2, 4, 8), (1, 1, 1))
    wc = WindowConfig(cube=(2, 4, 8), block_size=64)
    with pytest.raises(ValueError, match="token_grid"):
        _core(megatron_cpu, wc, (6, 12, 12))
    with pytest.raises(ValueError, match="attn_mask_type"):
        _core(megatron_cpu, wc, (4, 8, 16), mask_type=AttnMaskType.causal)
    with pytest.raises(ValueError, match="window_config"):
        _core(megatron_cpu, None, (4, 8, 16))
    core = _core(megatron_cpu, wc, (4, 8, 16))
    x = torch.randn(512, 1, 2, 64)
    with pytest.raises(ValueError, match="sq"):
        core(x[:256], x[:256], x[:256], None)
    with pytest.raises(ValueError, match="attention_bias"):
        core(x, x, x, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="packed_seq_params"):
        core(x, x, x, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="attn_mask_type"):
        core(x, x, x, None, attn_mask_type=AttnMaskType.causal)
    cfg = VideoDiTConfig.from_preset("tiny", heads=2, head_dim=64, layers=1)
    with pytest.raises(ValueError, match="window_config"):
        build_video_dit(cfg, dsv_config=DSVConfig(), window_config=wc, use_te=False)
    with pytest.raises(ValueError, match="base_spec"):
        get_window_layer_spec(object(), wc, (4, 8, 16))


def _tiny(layers=2):
    # latent 8 x 16 x 32, patch (1, 2, 2) -> token grid 8 x 8 x 16 = 1024 tokens; cubes 2 x 4 x 8 -> grid 4 x 2 x 2
    return VideoDiTConfig.from_preset("tiny", heads=2, head_dim=64, layers=layers, latent_frames=8,
                                      latent_height=16, latent_width=32, cube=(2, 4, 8))


def _randomise(model, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * std)


def test_video_dit_with_window_trains(megatron_cpu):
    cfg = _tiny()
    wc = WindowConfig(cube=(2, 4, 8), radius=(1, 1, 1), block_size=64)  # list lengths 8 and 12 of 16 cubes
    model = build_video_dit(cfg, window_config=wc, use_te=False, use_cpu_initialization=True)
    assert model.cube == wc.cube
    core = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, WindowCoreAttention) and core.token_grid == (8, 8, 16)
    _randomise(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, *cfg.latent_grid, generator=g)
    loss = flow_matching_loss(model, x, torch.tensor([0, 3]), generator=g)
    assert torch.isfinite(loss)
    loss.backward()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0


def test_video_dit_full_window_equals_dense(megatron_cpu):
    # a window spanning the whole cube grid is full attention: same outputs as the dense model
    cfg = _tiny(layers=1)
    dense = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)  # CPU test, on a GPU host too
    _randomise(dense)
    window = build_video_dit(cfg, window_config=WindowConfig(cube=(2, 4, 8), radius=(3, 1, 1), block_size=64),
                             use_te=False, use_cpu_initialization=True)
    window.load_state_dict(dense.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.in_channels, *cfg.latent_grid, generator=g)
    t, y = torch.rand(1, generator=g), torch.tensor([2])
    torch.testing.assert_close(window(x, t, y), dense(x, t, y), rtol=1e-4, atol=1e-5)


def _rel_rmse(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("cube,grid,radius", [((2, 4, 8), (6, 12, 8), (1, 1, 0)), ((4, 4, 8), (8, 16, 32), (1, 1, 1))],
                         ids=["G64-S576-triton", "G128-S4096"])
def test_cuda_bf16_matches_reference(megatron_cpu, cube, grid, radius):
    wc = WindowConfig(cube=cube, radius=radius, block_size=math.prod(cube))
    core = _core(megatron_cpu, wc, grid, heads=4, groups=2)
    S, B, D = math.prod(grid), 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(S, B, h, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (4, 2, 2))
    do = torch.randn(S, B, 4 * D, generator=g, device="cuda", dtype=torch.bfloat16)
    out = core(q, k, v, None)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = _reference(q, k, v, _token_mask(grid, cube, radius).cuda(), 1.0 / math.sqrt(D))
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.float())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel_rmse(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all() and _rel_rmse(got, want) < 2e-2


@pytest.mark.gpu
def test_cuda_video_dit_with_window_trains(megatron_cpu):
    cfg = _tiny()
    model = build_video_dit(cfg, window_config=WindowConfig(cube=(2, 4, 8), radius=(1, 1, 1), block_size=64),
                            use_te=False, dtype=torch.bfloat16).cuda()
    _randomise(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, cfg.in_channels, *cfg.latent_grid, generator=g, device="cuda").bfloat16()
    loss = flow_matching_loss(model, x, torch.tensor([0, 3], device="cuda"), generator=g)
    loss.backward()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert torch.isfinite(loss) and torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0

"""Local + predicted lists (DSVConfig.local_radius): the neighbourhood geometry against a brute-force
scan of token coordinates, the layer's lists (every query cube keeps its neighbourhood, the budget
counts it, the floor makes it fit), the recall curve that ranks the neighbourhood first (it equals the
oracle's recall of the lists actually built at every budget), clear errors, and a video DiT that
trains in stage 2 with them."""

import pytest
import torch

from megatron_dsv.attention import _ops, dsv_metrics, dsv_on_step_end
from megatron_dsv.attention.grouping import cube_order_coords
from megatron_dsv.attention.neighbourhood import local_item_lists
from megatron_dsv.attention.profiler import recall_curve
from megatron_dsv.attention.schedule import sampled_queries
from megatron_dsv.config import DSVConfig

from .conftest import as_megatron, force_state, planted


@pytest.mark.parametrize("grid,cube,radius,bs", [
    ((4, 8, 16), (2, 4, 8), (0, 1, 1), 64),
    ((4, 8, 16), (2, 4, 4), (1, 0, 1), 64),   # 32-token cubes, two per 64-key block
    ((4, 8, 16), (2, 4, 8), (1, 1, 0), 0),    # token lists
    ((2, 8, 8), (1, 4, 8), (0, 2, 2), 128),   # 32-token cubes, a 128-key block holds four
], ids=["blk64-G64", "blk64-G32", "tok-G64", "blk128-G32-radius-past-grid"])
def test_local_items_match_token_coordinates(grid, cube, radius, bs):
    coords = cube_order_coords(grid, cube)  # [S, 3] (t, h, w) of each cube-major token
    S = coords.shape[0]
    G = int(torch.tensor(cube).prod())
    cid = torch.div(coords, torch.tensor(cube), rounding_mode="floor")  # cube coordinates per token
    items = local_item_lists(grid, cube, radius, bs)
    assert items.shape[0] == S // G
    for g in range(S // G):
        near = ((cid - cid[g * G]).abs() <= torch.tensor(radius)).all(-1)  # tokens of neighbour cubes
        toks = near.nonzero().squeeze(-1)
        want = sorted(set((toks // bs).tolist())) if bs else toks.tolist()
        row = items[g][items[g] >= 0].tolist()
        assert row == want, g


def test_layer_lists_keep_the_neighbourhood(make_layer, fast_table):
    grid, cube = (4, 8, 16), (2, 4, 8)  # 512 tokens, 8 cubes of 64
    layer = make_layer(query_group_shape=cube, granularity="block", kv_block_size=64, k_min=1,
                       local_radius=(0, 0, 1), budget_rule="sparsity", sparsity_threshold=0.5,
                       speedup_table=fast_table)
    layer.token_grid = grid
    force_state(layer, stage=2, sparsity=0.95)  # (1 - s) S = 26 tokens: one block, below the neighbourhood
    sparse, budgets, tokens = layer.decide(512)
    local = local_item_lists(grid, cube, (0, 0, 1), 64)
    assert sparse and budgets.tolist() == [local.shape[1]] * 2 and tokens.tolist() == [64 * local.shape[1]] * 2
    q, k = planted()
    idx, counts = layer._estimate(q, k, None, budgets + 2)
    for g in range(local.shape[0]):
        assert set(local[g][local[g] >= 0].tolist()) <= set(idx[0, 0, g, :int(counts[0, 0])].tolist())
    # the layer runs on them: output equals the naive op on the same lists
    layer.eval()
    v = torch.randn_like(k)
    out = layer(as_megatron(q), as_megatron(k), as_megatron(v), None)
    lists = layer._estimate(q, k, None, budgets)
    ref = _ops.sparse_attention_naive(q, k, v, *lists, 64, 64, layer.softmax_scale)
    assert torch.allclose(out, ref.permute(2, 0, 1, 3).reshape(512, 1, -1), atol=1e-5)


def test_recall_curve_ranks_the_neighbourhood_first(make_layer):
    grid, cube = (4, 8, 16), (2, 4, 8)
    layer = make_layer(query_group_shape=cube, granularity="block", kv_block_size=64, local_radius=(1, 0, 0))
    layer.token_grid = grid
    q, k = planted()
    q_lr, k_lr = layer.predictor.project(q, k, None, dtype=q.dtype)
    forced = layer._local_items(512, "cpu")
    qidx = sampled_queries(512, 8, 0, "cpu")
    curve = recall_curve(q, k, q_lr, k_lr, 64, 64, 0.9, None, qidx, forced=forced)
    plain = recall_curve(q, k, q_lr, k_lr, 64, 64, 0.9, None, qidx)
    assert not torch.allclose(curve, plain)
    for K in (1, 2, 3, 5, 8):
        lists = _ops.estimate_topk_naive(q_lr, k_lr, K, 64, 64, forced=forced)
        rec = _ops.critical_mass_recall(q, k, *lists, 64, 64, 0.9, None, qidx)
        assert torch.allclose(curve[..., K - 1], rec.double(), atol=1e-6), K


def test_profile_and_stage2_with_local_lists(make_layer, fast_table):
    """A recall-rule profile measures the lists that run (local first); the budget never drops below
    the neighbourhood; metrics stay finite."""
    layer = make_layer(query_group_shape=(2, 4, 8), granularity="block", kv_block_size=64, k_min=1,
                       local_radius=(0, 1, 1), recall_target=0.5, sparsity_threshold=0.0, speedup_table=fast_table)
    layer.token_grid = (4, 8, 16)
    force_state(layer, stage=2, sparsity=0.9, density=0.1)
    q, k = planted()
    layer.train()
    out = layer(as_megatron(q), as_megatron(k), as_megatron(torch.randn_like(k)), None)
    dsv_on_step_end(layer, 1)
    m = dsv_metrics(layer)
    assert torch.isfinite(out).all() and layer.last_sparse
    floor = layer._local_tokens(512)
    assert floor == 64 * 4 and layer.decide(512)[2].min() >= floor
    assert 0.0 < m["dsv/layer1/recall"] <= 1.0


def test_local_radius_errors(make_layer):
    with pytest.raises(ValueError, match="local_radius"):
        DSVConfig(local_radius=(1, -1, 0))
    layer = make_layer(query_group_shape=(2, 4, 8), granularity="block", kv_block_size=64, local_radius=(0, 0, 1))
    with pytest.raises(ValueError, match="needs the token grid"):
        layer._local_items(512, "cpu")
    layer.token_grid = (4, 8, 8)
    with pytest.raises(ValueError, match="needs the token grid"):
        layer._local_items(512, "cpu")
    with pytest.raises(ValueError, match="multiple of cube"):
        local_item_lists((4, 8, 12), (2, 4, 8), (0, 0, 1), 64)


@pytest.mark.parametrize("mode", ["shared", "window"])
def test_video_dit_trains_with_local_lists(megatron_cpu, fast_table, mode):
    """The video DiT hands its token grid to every DSV layer; stage 2 runs sparse with local lists (either
    local_mode: here every cube has as many neighbours, so both keep the same number of keys)."""
    from megatron_dsv.models.dit_config import VideoDiTConfig
    from megatron_dsv.models.video_dit import build_video_dit

    # token grid (4, 8, 16): a 2 x 2 x 2 grid of 64-token cubes, so radius (0, 0, 1) keeps 2 of 8 cubes
    cfg = VideoDiTConfig.from_preset("tiny", layers=2, latent_frames=4, latent_height=16, latent_width=32)
    dsv = DSVConfig(query_group_shape=(2, 4, 8), kv_block_size=64, local_radius=(0, 0, 1), local_mode=mode, k_min=1,
                    budget_rule="sparsity", sparsity_threshold=0.0, stage_switch_rule="steps", stage_switch_steps=1,
                    profile_interval=1, kernel_backend="naive", topk_backend="naive", predictor_query_stride=8,
                    speedup_table=fast_table)
    torch.manual_seed(0)
    model = build_video_dit(cfg, dsv_config=dsv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = next(model.parameters()).device  # Megatron builds on the GPU where there is one
    x = torch.randn(1, cfg.in_channels, 4, 16, 32, device=dev)
    for step in range(3):
        loss = model(x, torch.tensor([0.5], device=dev), torch.tensor([1], device=dev)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dsv_on_step_end(model, step + 1)
    cores = model._dsv_cores()
    assert len(cores) == 2 and all(c.token_grid == (4, 8, 16) for c in cores)
    assert all(c.last_sparse for c in cores) and torch.isfinite(loss)
    for c in cores:  # the lists keep fewer keys than the sequence, the neighbourhood at least
        tokens = c.decide(512)[2]
        assert (tokens >= c._local_tokens(512)).all() and (tokens < 512).all() and c._local_tokens(512) == 128


def test_auto_neighbourhood_follows_the_resolved_topk_backend(monkeypatch, megatron_cpu):
    """DSV_TOPK_BACKEND=cuda with the default (auto) radius: no local part (the CUDA estimator takes none),
    instead of forced items the CUDA backend would refuse at the first sparse step."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dsv.attention.core_attention import DSVCoreAttention
    from tests.attention.conftest import tf_config

    monkeypatch.setenv("DSV_TOPK_BACKEND", "cuda")
    layer = DSVCoreAttention(tf_config(), 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu,
                             dsv_config=DSVConfig())
    layer.token_grid = (16, 32, 32)
    assert layer.topk_backend == "cuda" and layer._local_items(16 * 32 * 32, "cpu") is None
    monkeypatch.setenv("DSV_TOPK_BACKEND", "naive")
    layer = DSVCoreAttention(tf_config(), 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu,
                             dsv_config=DSVConfig())
    layer.token_grid = (16, 32, 32)
    assert layer._local_items(16 * 32 * 32, "cpu") is not None


def test_window_mode_keeps_each_cubes_own_neighbourhood_plus_the_predicted_budget(make_layer, fast_table):
    """local_mode 'window': a neighbourhood as wide as the grid's middle (radius (1, 1, 0) on a 2 x 2 x 2 grid of
    cubes: 4 of 8 cubes for every cube here, but 2-4 on a 3 x 3 grid) sets no floor at its largest size: each
    cube keeps exactly its own neighbourhood plus the head's predicted blocks, the budget counts the mean
    neighbourhood, the layer runs sparse, and its output equals the naive op on those per-cube lists."""
    grid, cube, radius = (6, 12, 8), (2, 4, 8), (1, 1, 0)  # 576 tokens, a 3 x 3 x 1 grid of 64-token cubes
    common = dict(query_group_shape=cube, granularity="block", kv_block_size=64, k_min=1, local_radius=radius,
                  budget_rule="sparsity", sparsity_threshold=0.3, speedup_table=fast_table)
    shared = make_layer(**common)
    window = make_layer(**common, local_mode="window")
    for layer in (shared, window):
        layer.token_grid = grid
        force_state(layer, stage=2, sparsity=0.7)  # (1 - s) S = 173 tokens: 3 blocks of 64
    local = local_item_lists(grid, cube, radius, 64)
    sizes = (local >= 0).sum(1)
    assert sizes.tolist() == [4, 6, 4, 6, 9, 6, 4, 6, 4]  # corners, edges, the middle
    assert shared._local_tokens(576) == 64 * 9 and not shared.decide(576)[0]  # floored at 9 of 9 blocks: dense
    mean = -(-int(sizes.sum()) // 9)  # 49 / 9 -> 6 blocks
    assert window._local_tokens(576) == 64 * mean and window._local_mean_items(576) == mean
    sparse, budgets, tokens = window.decide(576)
    assert sparse and budgets.tolist() == [mean] * 2
    assert torch.allclose(tokens, torch.full((2,), 64 * 49 / 9))  # keys a query attends: the mean neighbourhood
    q, k = planted(S=576)
    idx, counts = window._estimate(q, k, None, budgets + 1)  # one predicted block past the mean neighbourhood
    assert counts.shape == (1, 2, 9) and idx.shape == (1, 2, 9, local.shape[1] + 1)
    for g in range(9):
        own = set(local[g][local[g] >= 0].tolist())
        for h in range(2):
            row = idx[0, h, g, :int(counts[0, h, g])].tolist()
            assert row == sorted(row) and own <= set(row) and len(row) == min(9, len(own) + 1), (g, h)
    window.eval()
    v = torch.randn_like(k)
    out = window(as_megatron(q), as_megatron(k), as_megatron(v), None)
    assert window.last_sparse
    lists = window._estimate(q, k, None, budgets)  # the mean neighbourhood exactly: the window itself
    assert torch.equal(lists[1][0, 0], sizes.to(torch.int32))
    ref = _ops.sparse_attention_naive(q, k, v, *lists, 64, 64, window.softmax_scale)
    assert torch.allclose(out, ref.permute(2, 0, 1, 3).reshape(576, 1, -1), atol=1e-5)


def test_window_mode_profiles_and_trains(make_layer, fast_table):
    """A profile step measures the recall of the per-cube lists (counts [B, H, NG]), the step end runs, and a
    mode the config does not know is refused by name."""
    layer = make_layer(query_group_shape=(2, 4, 8), granularity="block", kv_block_size=64, k_min=1,
                       local_radius=(1, 1, 0), local_mode="window", budget_rule="sparsity", sparsity_threshold=0.3,
                       speedup_table=fast_table, profile_interval=1)
    layer.token_grid = (6, 12, 8)
    force_state(layer, stage=2, sparsity=0.6)
    q, k = planted(S=576)
    layer.train()
    out = layer(as_megatron(q), as_megatron(k), as_megatron(torch.randn_like(k)), None)
    dsv_on_step_end(layer, 1)
    m = dsv_metrics(layer)
    assert torch.isfinite(out).all() and layer.last_sparse and 0.0 < m["dsv/layer1/recall"] <= 1.0
    with pytest.raises(ValueError, match="local_mode"):
        DSVConfig(local_mode="cube")

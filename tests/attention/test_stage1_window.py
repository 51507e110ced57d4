"""A windowed stage 1 (DSVConfig.stage1_local_radius): in stage 1 every query attends only the keys of its query
cube's 3D neighbourhood (checked against a mask built from token coordinates, forward and backward), the
predictors learn the same statistics as under a dense stage 1, stage 2 and the dispatcher's dense layers are
untouched, ``force_stage1`` (the timing harness) attends as stage 1 does, the default (None) picks (2, 2, 1) where
it applies and a dense stage 1 elsewhere, and bad input gets a clear error. Under context parallelism:
tests/parallel/test_cp_attention.py."""


import pytest
import torch

from megatron_dsv.arguments import add_dsv_args, dsv_config_from_args
from megatron_dsv.attention.grouping import cube_order_coords
from megatron_dsv.config import DSVConfig

from .conftest import as_megatron, force_state

GRID, CUBE = (4, 8, 16), (2, 4, 8)  # 512 tokens in 8 cubes of 64, cube grid (2, 2, 2)
S = 512


def window_mask(grid, cube, radius) -> torch.Tensor:
    """Bool [S, S]: query token i may attend key token j (their cubes within ``radius`` cubes on every axis),
    from the cube-major tokens' coordinates alone."""
    cid = torch.div(cube_order_coords(grid, cube), torch.tensor(cube), rounding_mode="floor")
    return ((cid[:, None, :] - cid[None, :, :]).abs() <= torch.tensor(radius)).all(-1)


def qkv(seed=0, H=2, D=64, S=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, S, D, generator=g) for _ in range(3)]


def run(layer, q, k, v):
    """The layer's output [S, B, H*D] and the gradients of q, k, v under a fixed upstream gradient."""
    q, k, v = (as_megatron(t).requires_grad_(True) for t in (q, k, v))
    out = layer(q, k, v, None)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).to(out.dtype).view_as(out))
    return out.detach(), q.grad, k.grad, v.grad


def reference(q, k, v, mask, scale):
    """Masked dense attention in float64 (mask None: dense), as ``run`` returns it."""
    q, k, v = (as_megatron(t).double().requires_grad_(True) for t in (q, k, v))
    s = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v).reshape(q.shape[0], 1, -1)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device=out.device).view_as(out))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("gran,block,radius", [("block", 64, (0, 1, 0)), ("block", 128, (1, 0, 1)),
                                               ("token", 128, (0, 0, 1))], ids=["blk64", "blk128", "token"])
def test_stage1_attends_the_window(make_layer, gran, block, radius):
    layer = make_layer(query_group_shape=CUBE, granularity=gran, kv_block_size=block, stage1_local_radius=radius)
    layer.token_grid = GRID
    assert layer.stage_host == 1
    q, k, v = qkv()
    got = run(layer, q, k, v)
    want = reference(q, k, v, window_mask(GRID, CUBE, radius), layer.softmax_scale)
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, atol=1e-5), (a.double() - b).abs().max()
    # the keys it reports: the mean neighbourhood (edge cubes keep fewer)
    kept = window_mask(GRID, CUBE, radius).sum(1).double().mean().item()
    assert layer.last_k.tolist() == pytest.approx([kept] * 2)
    assert not layer.last_sparse  # no predicted lists ran


def test_dense_stage1_is_unchanged_and_predictors_learn_the_same(make_layer):
    q, k, v = qkv(seed=1)
    dense = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64)
    window = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64, stage1_local_radius=(0, 1, 1))
    window.load_state_dict(dense.state_dict())
    for layer in (dense, window):
        layer.token_grid = GRID
    out_dense = run(dense, q, k, v)
    want = reference(q, k, v, None, dense.softmax_scale)
    assert torch.allclose(out_dense[0].double(), want[0], atol=1e-5)
    out_window = run(window, q, k, v)
    assert not torch.allclose(out_window[0], out_dense[0], atol=1e-3)  # the window changes what the model sees
    # ... but not what the predictors learn from: the exact scores of the same sampled queries
    a, b = dense.predictor, window.predictor
    assert a.grad_count == b.grad_count == 1 and len(a._stash) == len(b._stash) == 1
    for x, y in zip(a._stash[0][:5], b._stash[0][:5]):  # the sampled rows and the moments the loss is built from
        assert torch.equal(x, y)
    from megatron_dsv.attention.predictor import train_predictors

    (loss_a, n_a), (loss_b, n_b) = (train_predictors([p]) for p in (a, b))
    assert n_a == n_b == [1] and torch.equal(loss_a, loss_b)
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):  # the gradients it added
        assert torch.equal(x, y), name


def test_stage2_and_dense_layers_leave_the_window(make_layer, fast_table):
    radius = (0, 1, 0)
    layer = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64, stage1_local_radius=radius,
                       budget_rule="sparsity", sparsity_threshold=0.99, speedup_table=fast_table)
    layer.token_grid = GRID
    q, k, v = qkv(seed=2)
    dense = reference(q, k, v, None, layer.softmax_scale)[0]
    windowed = reference(q, k, v, window_mask(GRID, CUBE, radius), layer.softmax_scale)[0]
    force_state(layer, stage=2, sparsity=0.5)  # under the threshold: the dispatcher keeps the layer dense
    assert torch.allclose(run(layer, q, k, v)[0].double(), dense, atol=1e-5)
    layer.force_stage1 = True  # the timing harness's stage 1, from a stage-2 run
    assert torch.allclose(run(layer, q, k, v)[0].double(), windowed, atol=1e-5)
    layer.force_dense = True  # bench_recall's baseline wins over everything
    assert torch.allclose(run(layer, q, k, v)[0].double(), dense, atol=1e-5)


def test_stage2_runs_its_predicted_lists_not_the_window(make_layer, fast_table):
    layer = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64, stage1_local_radius=(1, 1, 1),
                       local_radius=(0, 0, 0), budget_rule="sparsity", sparsity_threshold=0.5, k_min=1,
                       speedup_table=fast_table)
    layer.token_grid = GRID
    force_state(layer, stage=2, sparsity=0.75)
    q, k, v = qkv(seed=3)
    out = run(layer, q, k, v)[0]
    assert layer.last_sparse
    sparse, budgets, _ = layer.decide(S)
    from megatron_dsv.attention import _ops

    lists = layer._estimate(q, k, None, budgets)
    ref = _ops.sparse_attention_naive(q, k, v, *lists, 64, 64, layer.softmax_scale)
    assert torch.allclose(out, ref.permute(2, 0, 1, 3).reshape(S, 1, -1), atol=1e-5)
    # radius (1, 1, 1) covers the whole 2x2x2 cube grid: the window would be dense attention, the lists are not
    assert not torch.allclose(out.double(), reference(q, k, v, None, layer.softmax_scale)[0], atol=1e-3)


def test_needs_the_token_grid(make_layer):
    layer = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64, stage1_local_radius=(0, 1, 0))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="stage1_local_radius.*--dsv-stage1-local-radius.*token grid"):
        run(layer, q, k, v)
    layer.token_grid = (4, 8, 8)  # 256 tokens, not this sequence's 512
    with pytest.raises(ValueError, match="token grid"):
        run(layer, q, k, v)
    layer.token_grid = (2, 2, 128)  # 512 tokens, but the 2x4x8 cube does not tile the height
    with pytest.raises(ValueError, match=r"query cube tiles.*--dsv-query-group-shape"):
        run(layer, q, k, v)


@pytest.mark.parametrize("bad", [(1, 1), (1, -1, 0), (1.0, 1, 1), (True, 0, 0)])
def test_config_refuses_bad_radius(bad):
    with pytest.raises(ValueError, match=r"DSVConfig.stage1_local_radius must be None \(auto\) or three ints >= 0"):
        DSVConfig(stage1_local_radius=bad)


def test_flag():
    import argparse

    parser = add_dsv_args(argparse.ArgumentParser())
    args = parser.parse_args(["--use-dsv-attention", "--dsv-stage1-local-radius", "2", "2", "1"])
    assert dsv_config_from_args(args).stage1_local_radius == (2, 2, 1)
    assert dsv_config_from_args(parser.parse_args(["--use-dsv-attention"])).stage1_local_radius is None
    args = parser.parse_args(["--use-dsv-attention", "--dsv-stage1-local-radius", "auto"])
    assert dsv_config_from_args(args).stage1_local_radius is None
    args = parser.parse_args(["--use-dsv-attention", "--dsv-stage1-local-radius", "0", "0", "0"])
    assert dsv_config_from_args(args).stage1_radius_for((16, 32, 32)) is None
    assert DSVConfig(stage1_local_radius=[1, 0, 1]).stage1_local_radius == (1, 0, 1)


def test_auto_radius_where_it_applies():
    """The default (None): (2, 2, 1) where the grid is known, tiled by the cube, lists are key blocks and the window
    keeps at most 1 - sparsity_threshold of the keys; dense elsewhere; an explicit radius holds as given."""
    from megatron_dsv.attention.neighbourhood import kept_fraction
    from megatron_dsv.config import DEFAULT_STAGE1_LOCAL_RADIUS

    d = DSVConfig()
    assert d.stage1_local_radius is None and DEFAULT_STAGE1_LOCAL_RADIUS == (2, 2, 1)
    cube = d.query_group_shape  # 4x4x8
    for grid in ((16, 32, 32), (32, 32, 32), (64, 32, 32)):  # 16K, 32K, 64K tokens of 256x256 video
        assert kept_fraction(grid, cube, (2, 2, 1)) <= 1 - d.sparsity_threshold
        assert d.stage1_radius_for(grid) == (2, 2, 1)
    assert kept_fraction((8, 32, 32), cube, (2, 2, 1)) > 1 - d.sparsity_threshold
    assert d.stage1_radius_for((8, 32, 32)) is None  # 8K: the window would keep 33% of the keys
    assert DSVConfig(sparsity_threshold=0.6).stage1_radius_for((8, 32, 32)) == (2, 2, 1)
    assert d.stage1_radius_for(None) is None  # text: no grid
    assert d.stage1_radius_for((16, 30, 32)) is None  # partial cubes (Wan's grids)
    assert DSVConfig(granularity="token").stage1_radius_for((16, 32, 32)) is None
    assert DSVConfig(stage1_local_radius=(0, 0, 0)).stage1_radius_for((16, 32, 32)) is None
    assert DSVConfig(stage1_local_radius=(0, 1, 0)).stage1_radius_for(None) == (0, 1, 0)
    # the keys the block lists hold decide, not the cubes': 1x8x8 cubes in 128-key blocks on a 4x48x48 grid, the
    # window's cubes are 26% of the keys but its blocks 32%
    small = DSVConfig(query_group_shape=(1, 8, 8), kv_block_size=128)
    assert kept_fraction((4, 48, 48), (1, 8, 8), (2, 2, 1)) <= 0.3 and small.stage1_radius_for((4, 48, 48)) is None


@pytest.mark.parametrize("threshold,windowed", [(0.3, True), (0.4, False)])
def test_default_layer_attends_the_auto_window(make_layer, threshold, windowed):
    """A layer on the default radius: on a 4x24x16 grid of 2x4x8 cubes the (2, 2, 1) window keeps 2/3 of the keys,
    so it runs where 1 - sparsity_threshold >= 2/3 and stage 1 is dense otherwise; without a grid it is dense
    (no error: the default asks for no grid)."""
    grid, s = (4, 24, 16), 4 * 24 * 16
    layer = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64, sparsity_threshold=threshold)
    assert layer.dsv_config.stage1_local_radius is None
    q, k, v = qkv(seed=5, S=s)
    dense = reference(q, k, v, None, layer.softmax_scale)
    layer.token_grid = None
    assert torch.allclose(run(layer, q, k, v)[0].double(), dense[0], atol=1e-5)
    layer.token_grid = grid
    want = reference(q, k, v, window_mask(grid, CUBE, (2, 2, 1)), layer.softmax_scale) if windowed else dense
    for a, b in zip(run(layer, q, k, v), want):
        assert torch.allclose(a.double(), b, atol=1e-5), (a.double() - b).abs().max()
    kept = window_mask(grid, CUBE, (2, 2, 1)).sum(1).double().mean().item() if windowed else s
    assert layer.last_k.tolist() == pytest.approx([kept] * 2)


def test_set_token_grid_reaches_every_layer(make_layer):
    """dsv_set_token_grid (a video model's forward, e.g. in Megatron-LM): every DSV layer of the model gets the
    grid, the default window then applies; None clears it (dense again); a bad grid is refused by name."""
    from megatron_dsv.attention import dsv_set_token_grid

    grid, s = (4, 24, 16), 4 * 24 * 16
    model = torch.nn.ModuleList([make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=64,
                                            sparsity_threshold=0.3, layer_number=n) for n in (1, 2)])
    dsv_set_token_grid(model, [4, 24, 16])
    assert [m.token_grid for m in model] == [grid, grid]
    q, k, v = qkv(seed=6, S=s)
    want = reference(q, k, v, window_mask(grid, CUBE, (2, 2, 1)), model[1].softmax_scale)[0]
    assert torch.allclose(run(model[1], q, k, v)[0].double(), want, atol=1e-5)
    dsv_set_token_grid(model, None)
    assert [m.token_grid for m in model] == [None, None]
    assert float(run(model[0], q, k, v)[0].isfinite().all()) and model[0].last_k.tolist() == [s, s]
    for bad in ((4, 24), (4, 0, 16), (4.0, 24, 16)):
        with pytest.raises(ValueError, match="dsv_set_token_grid: token_grid must be three positive ints"):
            dsv_set_token_grid(model, bad)


def test_resume_of_a_checkpoint_from_before_the_window_says_so(make_layer, capsys):
    """A run with the default (auto) window resuming a checkpoint saved before stage1_local_radius existed (a
    dense stage 1) is told how to keep it dense; a checkpoint that has the field, or an explicit radius, is not."""
    from megatron_dsv.training.checkpointing import check_dsv_state

    saved = DSVConfig().to_dict()
    del saved["stage1_local_radius"]
    auto = torch.nn.ModuleList([make_layer()])
    assert check_dsv_state({"dsv_config": saved}, auto, "ckpt") == []
    assert "--dsv-stage1-local-radius 0 0 0 to keep a dense stage 1" in capsys.readouterr().out
    check_dsv_state({"dsv_config": DSVConfig().to_dict()}, auto, "ckpt")
    check_dsv_state({"dsv_config": saved}, torch.nn.ModuleList([make_layer(stage1_local_radius=(0, 0, 0))]), "ckpt")
    assert "stage1-local-radius" not in capsys.readouterr().out


@pytest.mark.gpu
def test_stage1_window_on_the_gpu_kernel(make_layer):
    layer = make_layer(query_group_shape=CUBE, granularity="block", kv_block_size=128, stage1_local_radius=(1, 0, 1),
                       kernel_backend="auto").cuda()
    layer.token_grid = GRID
    q, k, v = (t.cuda() for t in qkv(seed=4))
    got = run(layer, *(t.bfloat16() for t in (q, k, v)))
    want = reference(q.double(), k.double(), v.double(), window_mask(GRID, CUBE, (1, 0, 1)).cuda(),
                     layer.softmax_scale)
    lowp = reference(*(t.bfloat16().float() for t in (q, k, v)), window_mask(GRID, CUBE, (1, 0, 1)).cuda(),
                     layer.softmax_scale)  # the error bf16 inputs alone make
    for a, b, c in zip(got, want, lowp):
        err, floor = (a.double() - b).abs().max().item(), (c.double() - b).abs().max().item()
        assert err <= 2 * floor + 1e-2 * b.abs().max().item(), (err, floor)


def test_resume_under_another_stage_switch_says_so(make_layer, capsys):
    """A checkpoint saved under the loss rule (the default before the step rule at 400) resumed with today's switch
    is told the switch changed; the same switch says nothing."""
    from megatron_dsv.training.checkpointing import check_dsv_state

    layer = torch.nn.ModuleList([make_layer(stage_switch_rule="steps", stage_switch_steps=400)])
    old = dict(DSVConfig().to_dict(), stage_switch_rule="loss_or_steps", stage_switch_steps=None)
    assert check_dsv_state({"dsv_config": old}, layer, "ckpt") == []
    out = capsys.readouterr().out
    assert "rule 'loss_or_steps' at step None; this run's is 'steps' at step 400" in out
    check_dsv_state({"dsv_config": DSVConfig().to_dict()}, layer, "ckpt")
    assert "stage switch" not in capsys.readouterr().out

"""A windowed stage 1 (DSVConfig.stage1_local_radius): in stage 1 every query attends only the keys of its query
cube's 3D neighbourhood (checked against a mask built from token coordinates, forward and backward), the
predictors learn the same statistics as under a dense stage 1, stage 2 and the dispatcher's dense layers are
untouched, ``force_stage1`` (the timing harness) attends as stage 1 does, and bad input gets a clear error."""

import types

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


def qkv(seed=0, H=2, D=64):
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
    out = torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v).reshape(S, 1, -1)
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
    with pytest.raises(ValueError, match="DSVConfig.stage1_local_radius must be three ints >= 0"):
        DSVConfig(stage1_local_radius=bad)


def test_flag():
    import argparse

    parser = add_dsv_args(argparse.ArgumentParser())
    args = parser.parse_args(["--use-dsv-attention", "--dsv-stage1-local-radius", "2", "2", "1"])
    assert dsv_config_from_args(args).stage1_local_radius == (2, 2, 1)
    assert dsv_config_from_args(parser.parse_args(["--use-dsv-attention"])).stage1_local_radius == (0, 0, 0)
    assert DSVConfig(stage1_local_radius=[1, 0, 1]).stage1_local_radius == (1, 0, 1)


def test_context_parallel_refuses_it(make_layer, megatron_cpu):
    class TwoRanks:
        def size(self):
            return 2

    pgs = types.SimpleNamespace(**{name: getattr(megatron_cpu, name) for name in vars(megatron_cpu)})
    pgs.cp = TwoRanks()
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dsv.attention.core_attention import DSVCoreAttention

    from .conftest import dsv_config, tf_config

    cfg = dsv_config(query_group_shape=CUBE, granularity="block", kv_block_size=64, cp_mode="head",
                     stage1_local_radius=(1, 1, 1))
    with pytest.raises(ValueError, match="stage1_local_radius.*0 0 0.*context_parallel_size=2"):
        DSVCoreAttention(tf_config(), 1, AttnMaskType.no_mask, "self", pg_collection=pgs, dsv_config=cfg)


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

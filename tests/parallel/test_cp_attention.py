"""DSV attention under context parallelism equals the single-process result (gloo, 2 and 4 CPU ranks).

Two levels, each in one spawned world per size (``spawn.run_world``):

* :func:`cp_attention` for every layout (hcp x scp, both placements) and head placement (even,
  LPT on uneven budgets), token lists (G=16) and block lists (G=64, 64-key blocks), one list length
  per head or per query group, dense, and GQA: outputs and dq, dk, dv of each rank's shard equal the
  slices of one process's naive sparse attention with the same global lists.
* ``DSVCoreAttention`` with a CP group (``cp_mode`` 'hybrid' and 'seq') against the same layer
  without CP: a stage-1 step (dense, predictor collects, profiler measures) gives the same outputs
  and gradients and, after ``dsv_on_step_end``, the same profiled state and predictor weights; a
  stage-2 step runs sparse with the same lists and gives the same outputs and gradients.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.parallel.plans import every_plan
from tests.parallel.spawn import run_world

H, D = 4, 64


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(name, got, want, atol=2e-5):
    err = (got - want).abs().max().item()
    assert err <= atol * max(1.0, want.abs().max().item()), f"{name}: max error {err:.3g}"


def _shard(t, rank, world, dim=2):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _check_cp_attention(rank, world):
    from megatron_dsv.ops.sparse_attention import sparse_attention_naive
    from megatron_dsv.ops.topk_estimation import estimate_topk_naive
    from megatron_dsv.parallel.cp_attention import CPContext, cp_attention

    ctx = CPContext.get(dist.group.WORLD, H)
    S, scale = 512, 1.0 / math.sqrt(D)
    # (G, key block, budgets, KV heads, one list length per query group instead of per head)
    cases = [(16, 0, [24, 96, 200, 512], H, False), (64, 64, [1, 2, 5, 8], H, False),
             (16, 0, [40, 40, 300, 100], 2, False), (64, 64, [3, 2, 5, 8], 2, True)]
    for case, (G, block, budgets, hkv, per_group) in enumerate(cases):
        q = _randn(10 + case, 1, H, S, D)
        k, v = _randn(20 + case, 1, hkv, S, D), _randn(30 + case, 1, hkv, S, D)
        do = _randn(40 + case, 1, H, S, D)
        lists = estimate_topk_naive(_randn(50, 1, H, S, 8), _randn(51, 1, H, S, 8), torch.tensor(budgets), G, block)
        if per_group:  # each group keeps a prefix of its list, 1 to all of it (a prefix of an ascending list)
            frac = torch.rand(1, H, S // G, generator=torch.Generator().manual_seed(52))
            counts = (1 + (frac * lists[1][:, :, None]).long()).clamp(max=lists[1][:, :, None]).to(torch.int32)
            assert len(counts.unique()) > 1
            lists = (lists[0], counts)
        ng = S // world // G

        def naive(qq, kk, vv, idx, counts, G=G, block=block):
            return sparse_attention_naive(qq, kk, vv, idx, counts, G, block, scale)

        for sparse in (True, False):
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            if sparse:
                ref = naive(*ref_in, *lists)
            else:
                kk, vv = (t.repeat_interleave(H // hkv, 1) for t in ref_in[1:])
                ref = torch.softmax(ref_in[0] @ kk.transpose(-1, -2) * scale, -1) @ vv
            ref.backward(do)
            unit = max(block, 1)
            density = [min(1.0, b * unit / S) for b in budgets]
            for plan in every_plan(world, H, density):
                layout, placement = plan.layout, plan.placement
                mine = [_shard(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
                mine_groups = slice(rank * ng, (rank + 1) * ng)
                local = (lists[0][:, :, mine_groups].contiguous(),
                         lists[1][:, :, mine_groups].contiguous() if per_group else lists[1]) if sparse else None
                out = cp_attention(*mine, ctx, plan, lists=local, group_size=G, block_size=block,
                                   softmax_scale=scale, sparse_fn=naive)
                out.backward(_shard(do, rank, world))
                what = f"case {case} sparse={sparse} {layout.name} {placement} rank {rank}"
                _close(f"out {what}", out, _shard(ref, rank, world))
                for name, got, full in zip("qkv", mine, ref_in):
                    _close(f"d{name} {what}", got.grad, _shard(full.grad, rank, world))


def _check_core_attention(rank, world):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dsv.attention import dsv_eval_forward, dsv_on_step_end
    from megatron_dsv.attention.core_attention import DSVCoreAttention
    from tests.attention.conftest import dsv_config, force_state, planted, tf_config

    S = 512
    qb, kb = planted(S=S, H=H, D=D, seed=3)
    vb = _randn(7, 1, H, S, D)
    do = _randn(8, S, 1, H * D)
    q, k, v = (t.permute(2, 0, 1, 3).contiguous() for t in (qb, kb, vb))  # Megatron's [s, b, heads, hn]
    world_group = SimpleNamespace(tp=None, cp=dist.group.WORLD)
    with pytest.raises(ValueError, match="needs DSVConfig.cp_mode"):
        DSVCoreAttention(tf_config(hidden=H * D, heads=H), 1, AttnMaskType.no_mask, "self",
                         dsv_config=dsv_config(), pg_collection=world_group)
    if world == 4:  # 2 heads cannot be split over 4 CP ranks
        with pytest.raises(ValueError, match="must be divisible by context_parallel_size"):
            DSVCoreAttention(tf_config(hidden=2 * D, heads=2), 1, AttnMaskType.no_mask, "self",
                             dsv_config=dsv_config(cp_mode="hybrid"), pg_collection=world_group)
    # a profile cap that thins the 64 sampled queries to one in 22: shards of 256 / 128 tokens cannot hold
    # equal shares of them, which the error names (raised on every rank before any collective)
    bad = DSVCoreAttention(tf_config(hidden=H * D, heads=H), 1, AttnMaskType.no_mask, "self",
                           dsv_config=dsv_config(cp_mode="seq", profile_max_queries=3), pg_collection=world_group)
    bad.train()
    with pytest.raises(ValueError, match="--dsv-profile-max-queries"):
        bad(*[_shard(t, rank, world, dim=0).clone() for t in (q, k, v)], None)
    # "hybrid" profiles one in 4 of the sampled queries (cap 16 of 64), "seq" all of them (cap 0); the third
    # pass adds local + predicted lists (the neighbourhood of each 1x4x4 cube on the 2x16x16 token grid,
    # indexed by global query group, then sliced per rank as one process's lists); the fourth sizes them per cube
    # (local_mode 'window': one list length per query group through the KV gather); the fifth attends a 3D window
    # in stage 1 (stage1_local_radius: per-cube lengths, placed by the planner like sparse lists)
    passes = (("hybrid", 16, (0, 0, 0), {}), ("seq", 0, (0, 0, 0), {}), ("hybrid", 16, (0, 1, 1), {}),
              ("seq", 0, (0, 1, 1), dict(local_mode="window")),
              ("hybrid", 16, (0, 0, 0), dict(stage1_local_radius=(0, 1, 1))))
    for mode, cap, local, extra in passes:
        cfg = dsv_config(cp_mode=mode, sparsity_threshold=0.3, profile_max_queries=cap, local_radius=local, **extra)
        tf = tf_config(hidden=H * D, heads=H)
        layers = {name: DSVCoreAttention(tf, 1, AttnMaskType.no_mask, "self", dsv_config=cfg,
                                         pg_collection=SimpleNamespace(tp=None, cp=group))
                  for name, group in (("one", None), ("cp", dist.group.WORLD))}
        for layer in layers.values():
            layer.token_grid = (2, 16, 16)
        mode = f"{mode}{'-local' if any(local) else ''}{''.join(f'-{k}' for k in extra)}"

        def step(what):
            outs = {}
            for name, layer in layers.items():
                ins = [t.clone() if name == "one" else _shard(t, rank, world, dim=0).clone() for t in (q, k, v)]
                ins = [t.requires_grad_() for t in ins]
                out = layer(*ins, None)
                out.backward(do if name == "one" else _shard(do, rank, world, dim=0))
                outs[name] = (out, ins)
            (out1, in1), (outc, inc) = outs["one"], outs["cp"]
            _close(f"{mode} {what} out rank {rank}", outc, _shard(out1, rank, world, dim=0))
            for n, a, b in zip("qkv", inc, in1):
                _close(f"{mode} {what} d{n} rank {rank}", a.grad, _shard(b.grad, rank, world, dim=0))

        step("stage 1")  # dense (or the window); predictor collects, profiler measures (profile_interval=1)
        if "stage1_local_radius" in extra:  # the (1, 3, 3)-cube window: 100 of 512 keys on average
            assert float(layers["cp"].last_k.max()) == float(layers["one"].last_k.max()) == 100.0
            assert layers["cp"].cp_plan is not None, "the windowed stage 1 is planned like a sparse layer"
        for layer in layers.values():
            dsv_on_step_end(layer, 1)
        one, cp = layers["one"], layers["cp"]
        for name in ("sparsity", "budget_density", "recall", "predictor_loss"):
            _close(f"{mode} state {name}", getattr(cp, name), getattr(one, name), atol=1e-5)
        for (name, a), (_, b) in zip(cp.predictor.named_parameters(), one.predictor.named_parameters()):
            _close(f"{mode} predictor {name}", a, b, atol=1e-5)
        for layer in layers.values():
            force_state(layer, stage=2, sparsity=[0.5, 0.7, 0.85, 0.95], density=[0.5, 0.3, 0.15, 0.05])
        step("stage 2 + profile")
        assert cp.last_sparse and one.last_sparse, "the stage-2 step must run sparse"
        if any(local) and not extra:  # every head keeps at least the neighbourhood (9 cubes of 16 tokens inside)
            assert cp._local_tokens(S) == 144 and float(cp.last_k.min()) >= 144 and float(cp.last_k.max()) < S
        assert cp.cp_plan is not None and int(cp.cp_plan_state[0, 0]) == cp.cp_plan.layout.hcp
        for layer in layers.values():
            layer.profiling = layer.predictor_training = False
        step("stage 2")
        # an eval forward (validation) plans for itself: the training plan and its checkpointed state stay,
        # also when it is the step's first forward (the step end cleared the layer's cached decisions)
        for layer in layers.values():
            dsv_on_step_end(layer, 2)
        plan, state = cp.cp_plan, cp.cp_plan_state.clone()
        with dsv_eval_forward(cp), torch.no_grad():
            out = cp(*[_shard(t, rank, world, dim=0).clone() for t in (q, k, v)], None)
        assert torch.isfinite(out).all() and cp.training
        assert cp.cp_plan is plan and torch.equal(cp.cp_plan_state, state), "an eval forward replaced the CP plan"


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_every_layout_matches_one_process(world, tmp_path):
    run_world(_check_cp_attention, world, tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_core_attention_under_cp_matches_one_process(world, tmp_path):
    run_world(_check_core_attention, world, tmp_path)

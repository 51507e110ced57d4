"""DSV context parallelism with NCCL on 2+ GPUs: the Triton kernels (key length != query length), bf16.

For every layout and head placement, each rank's output and dq, dk, dv shards under
:func:`cp_attention` equal the slices of the same rank's one-GPU sparse attention over the whole
sequence with the same lists (within bf16 rounding: the SCP backward sums dK, dV contributions of
several ranks in another order). Skipped without two CUDA GPUs (the ``nvidia-h200-x2`` device kind).
"""

import math

import pytest
import torch
import torch.distributed as dist

from tests.parallel.plans import every_plan
from tests.parallel.spawn import run_world

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs with NCCL (runs on the 2-GPU device kind, not in CPU CI)")]

H, D, S = 4, 128, 8192


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _check(rank, world):
    from megatron_dsv.ops.sparse_attention import sparse_attention
    from megatron_dsv.ops.topk_estimation import estimate_topk
    from megatron_dsv.parallel.cp_attention import CPContext, cp_attention

    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = CPContext.get(dist.group.WORLD, H)
    scale, s = 1.0 / math.sqrt(D), S // world
    for G, block, frac in ((128, 128, (0.05, 0.1, 0.2, 0.6)), (64, 0, (0.02, 0.05, 0.1, 0.3))):
        gen = torch.Generator(device=dev).manual_seed(G + block)
        q, k, v, do = (torch.randn(1, H, S, D, generator=gen, device=dev, dtype=torch.bfloat16) for _ in range(4))
        items = S if block == 0 else S // block
        budgets = torch.tensor([max(1, round(f * items)) for f in frac])
        q_lr, k_lr = (torch.randn(1, H, S, 16, generator=gen, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lists = estimate_topk(q_lr, k_lr, budgets, G, block)

        def fn(qq, kk, vv, idx, cnt, G=G, block=block):
            return sparse_attention(qq, kk, vv, idx, cnt, G, block, scale)

        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = fn(*full, *lists)
        ref.backward(do)
        ng = s // G
        local = (lists[0][:, :, rank * ng:(rank + 1) * ng].contiguous(), lists[1])
        density = [b * max(block, 1) / S for b in budgets.tolist()]
        for plan in every_plan(world, H, density):
            layout, placement = plan.layout, plan.placement
            mine = [t[:, :, rank * s:(rank + 1) * s].clone().requires_grad_() for t in (q, k, v)]
            out = cp_attention(*mine, ctx, plan, lists=local, group_size=G, block_size=block, softmax_scale=scale,
                               sparse_fn=fn)
            out.backward(do[:, :, rank * s:(rank + 1) * s])
            what = f"G{G} block{block} {layout.name} {placement} rank {rank}"
            assert _rel(out, ref[:, :, rank * s:(rank + 1) * s]) < 1e-3, what
            for name, got, want in zip("qkv", mine, full):
                err = _rel(got.grad, want.grad[:, :, rank * s:(rank + 1) * s])
                assert err < 1e-2, f"d{name} {what}: {err:.3g}"


def test_cp_attention_nccl_matches_one_gpu(tmp_path):
    run_world(_check, min(torch.cuda.device_count(), 4), tmp_path, deadline_s=300, backend="nccl")

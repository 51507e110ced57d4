"""DSV context parallelism: one attention layer's fwd+bwd time and bytes per rank, four ways, under torchrun.

Every rank holds an equal shard of a sequence of S tokens (H heads of D, bf16), and the heads have
heterogeneous sparsity (``--sparsity-min`` .. ``--sparsity-max``, mean ``--sparsity-mean``); the
block lists (G = block = 128) come from the low-rank estimator on random low-rank q, k, with per-head
budgets = (1 - s_h) S. Methods, all on the same inputs, fwd+bwd of one layer:

* ``dsv_hybrid``: the planner's layout and head placement (``parallel.planner.plan_layer``, with the
  bandwidth measured on the group at start-up) through ``parallel.cp_attention``;
* ``naive_hcp``: head-wise CP (Ulysses) with heads placed evenly, then the sparse kernel;
* ``naive_scp``: sequence-wise CP that all-gathers all of K and V, then the sparse kernel on the
  local queries;
* ``dense_ulysses``: head-wise CP with even heads and dense attention (cuDNN through SDPA).

Time: median of ``--reps`` CUDA-event timings, max over ranks. Bytes: received per rank (each
all-to-all's output minus the rank's own chunk; each all-gather's other ranks' parts), counted in one
fwd+bwd, max over ranks; ``bytes_vs_full_kv_gather`` divides by ``naive_scp``'s (the full K, V all-gather
and its gradient return). Rows carry ``speedup_vs_best_naive`` and ``speedup_vs_dense_ulysses``.

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --seq-lens 131072 262144        # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --quick                          # CPU check (gloo)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import collect_meta, head_sparsity, sync, write_results  # noqa: E402

METHODS = ("dsv_hybrid", "naive_hcp", "naive_scp", "dense_ulysses")


@contextmanager
def count_bytes(world: int):
    """Bytes this rank receives from other ranks through all_to_all_single and all_gather."""
    counter = {"bytes": 0}
    a2a, ag = dist.all_to_all_single, dist.all_gather

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me, n = dist.get_rank(group), dist.get_world_size(group)
        row = output.numel() // max(1, output.shape[0]) if output.dim() else 1
        own = (output_split_sizes[me] * row if output_split_sizes else output.numel() // n)
        counter["bytes"] += (output.numel() - own) * output.element_size()
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_gather(tensor_list, tensor, group=None, **kw):
        counter["bytes"] += (len(tensor_list) - 1) * tensor.numel() * tensor.element_size()
        return ag(tensor_list, tensor, group=group, **kw)

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
    try:
        yield counter
    finally:
        dist.all_to_all_single, dist.all_gather = a2a, ag


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        dist.barrier()
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return _max_over_ranks(statistics.median(times))


def run_case(S: int, args, ctx, world: int, rank: int) -> list:
    from megatron_dsv.ops.sparse_attention import sparse_attention, sparse_attention_naive
    from megatron_dsv.ops.topk_estimation import estimate_topk
    from megatron_dsv.parallel.collectives import gather_seq
    from megatron_dsv.parallel.cp_attention import cp_attention, dense_head_ms
    from megatron_dsv.parallel.groups import CPLayout
    from megatron_dsv.parallel.placement import even_placement
    from megatron_dsv.parallel.planner import LayerPlan, plan_layer

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, D, G, blk = args.heads, args.head_dim, args.group_size, args.block_size
    s = S // world
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, H, s, D, generator=gen, device=dev, dtype=dtype) for _ in range(3))
    do = torch.randn(1, H, s, D, generator=gen, device=dev, dtype=dtype)
    sparsity = head_sparsity(H, args.sparsity_min, args.sparsity_max, args.sparsity_mean)
    n_blocks = -(-S // blk)
    budgets = torch.tensor([max(1, round((1 - sp) * n_blocks)) for sp in sparsity])
    lr_gen = torch.Generator(device=dev).manual_seed(1)  # the same low-rank q, k (so lists) on every rank
    q_lr, k_lr = (torch.randn(1, H, S, 16, generator=lr_gen, device=dev, dtype=dtype) for _ in range(2))
    idx, counts = estimate_topk(q_lr, k_lr, budgets, G, blk)
    ng = s // G
    local = (idx[:, :, rank * ng:(rank + 1) * ng].contiguous(), counts)
    del q_lr, k_lr, idx
    scale = 1.0 / math.sqrt(D)
    kernel = sparse_attention if dev.type == "cuda" else sparse_attention_naive

    def sparse_fn(qq, kk, vv, ii, cc):
        return kernel(qq, kk, vv, ii, cc, G, blk, scale)

    density = [float(c) * blk / S for c in budgets.tolist()]
    speed = None
    if args.speedup_table:
        from megatron_dsv.attention.dispatcher import SpeedupTable

        table = SpeedupTable.from_config(SimpleCfg(args.speedup_table, G, blk), D)
        speed = lambda d: max(1e-3, table.speedup(S, 1 - d, True))  # noqa: E731
    plan = plan_layer(density, True, S, D, world, dense_head_ms(S, D), ctx.comm, speedup=speed,
                      cp_ranks=ctx.groups.cp_ranks)
    even = LayerPlan(layout=CPLayout(world, 1), placement="even", heads=even_placement(H, world), est_ms=0.0,
                     compute_ms=0.0, comm_ms=0.0, peak_bytes=0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step(method):
        for t in leaves:
            t.grad = None
        ql, kl, vl = leaves
        match method:
            case "dsv_hybrid":
                out = cp_attention(ql, kl, vl, ctx, plan, lists=local, group_size=G, block_size=blk,
                                   softmax_scale=scale, sparse_fn=sparse_fn)
            case "naive_hcp":
                out = cp_attention(ql, kl, vl, ctx, even, lists=local, group_size=G, block_size=blk,
                                   softmax_scale=scale, sparse_fn=sparse_fn)
            case "naive_scp":
                out = sparse_fn(ql, gather_seq(kl, ctx.cp_group), gather_seq(vl, ctx.cp_group), *local)
            case "dense_ulysses":
                out = cp_attention(ql, kl, vl, ctx, even, lists=None, group_size=G, block_size=blk,
                                   softmax_scale=scale, sparse_fn=sparse_fn)
        out.backward(do)

    rows, ms = [], {}
    for method in METHODS:
        step(method)  # warm-up (compilation, autotuning)
        with count_bytes(world) as counter:
            step(method)
        sync()
        ms[method] = _time_ms(lambda m=method: step(m), args.reps)
        rows.append(dict(bench="cp", method=method, S=S, H=H, D=D, group_size=G, block_size=blk, cp=world,
                         gpu_count=world, sparsity_mean=sum(sparsity) / H, sparsity_per_head=sparsity,
                         ms_fwd_bwd=ms[method], bytes_recv_per_rank=_max_over_ranks(counter["bytes"]),
                         plan=plan.to_dict() if method == "dsv_hybrid" else None))
    best_naive = min(ms["naive_hcp"], ms["naive_scp"])
    full_kv = rows[METHODS.index("naive_scp")]["bytes_recv_per_rank"]  # all of K and V gathered (fwd + bwd)
    for r in rows:
        r["speedup_vs_best_naive"] = best_naive / r["ms_fwd_bwd"]
        r["speedup_vs_dense_ulysses"] = ms["dense_ulysses"] / r["ms_fwd_bwd"]
        r["bytes_vs_full_kv_gather"] = r["bytes_recv_per_rank"] / full_kv
    return rows


class SimpleCfg:
    """The DSVConfig fields SpeedupTable.from_config reads."""

    def __init__(self, table, group_size, block_size):
        self.speedup_table, self.group_size, self.block_size = table, group_size, block_size
        self.granularity, self.predictor_rank = "block", 16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--sparsity-min", type=float, default=0.80)
    ap.add_argument("--sparsity-max", type=float, default=0.98)
    ap.add_argument("--sparsity-mean", type=float, default=0.90)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--speedup-table", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                            "sparse_attention-h200-20261130.json"))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU check under torchrun with gloo: tiny shapes")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_lens, args.heads, args.head_dim, args.group_size, args.block_size = [512], 4, 64, 64, 64
        args.reps, args.speedup_table = 2, None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise SystemExit("bench_cp.py needs at least 2 ranks: torchrun --nproc-per-node N (N = CP size)")
    from megatron_dsv.parallel.cp_attention import CPContext

    ctx = CPContext.get(dist.group.WORLD, args.heads)
    rows = []
    for S in args.seq_lens:
        rows += run_case(S, args, ctx, world, rank)
        if rank == 0:
            print(f"{'method':>14} {'S':>7} {'ms fwd+bwd':>11} {'MB recv/rank':>13} {'vs best naive':>14} "
                  f"{'vs dense':>9}", flush=True)
            for r in rows[-len(METHODS):]:
                print(f"{r['method']:>14} {r['S']:>7} {r['ms_fwd_bwd']:>11.2f} {r['bytes_recv_per_rank'] / 2**20:>13.1f} "
                      f"{r['speedup_vs_best_naive']:>14.2f} {r['speedup_vs_dense_ulysses']:>9.2f}", flush=True)
            print(f"   plan: {rows[-len(METHODS)]['plan']}", flush=True)
    if rank == 0:
        meta = dict(collect_meta(), gpu_count=world, cp=world,
                    comm_model=dict(bandwidth_intra=ctx.comm.bandwidth_intra, bandwidth_inter=ctx.comm.bandwidth_inter))
        print("wrote", write_results("cp" + ("-quick" if args.quick else ""), rows, args.out_dir, meta=meta))
    dist.barrier()
    CPContext.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Sparse attention kernels vs cuDNN dense and FlexAttention on identical lists.

    PYTHONPATH=. python benchmarks/bench_sparse_attention.py [--quick] [--tune] [--out DIR]
    PYTHONPATH=. python benchmarks/bench_sparse_attention.py --groups-sweep [--warm-only --shard I/N]

Rows (DESIGN.md section 6): S, H, D, B, G, block_size, sparsity, granularity,
ms_fwd/ms_bwd (our Triton path through the public op, value checks skipped),
same-run cuDNN dense ms_dense_*, speedup_*, effective tflops_* on the kept
FLOPs, and for block lists ms_flex_*/speedup_vs_flex_* (FlexAttention, BlockMask
built from the same lists, compiled once per shape). ``--tune`` first sweeps
tile configs at S=64K, 90% sparsity, and uses the winners for the table.

``--groups-sweep``: (group size, block size) in SWEEP_SHAPES at S=64K and 16K,
90% sparse: our forward (default tiles, and 128-wide steps over two 64-blocks),
split backward, fused backward (each FUSED_SPACE config, checked against split
first), FlexAttention. Writes ``sparse_attention-groups`` (every row) and
``sparse_attention`` (rows in the main table's format, ms_bwd = the faster
backward, named in bwd_mode). ``--warm-only`` runs every kernel once without
timing, so parallel shards fill Triton's and Inductor's on-disk caches before
the timed run (compiling flex per shape dominates otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DSV_SKIP_CHECKS", "1")  # lists are ours and valid; time the kernels
os.environ.setdefault("DSV_SPARSE_ATTN_BACKEND", "triton")  # rows measure our kernels; flex has its own columns

from benchmarks.common import bench_ms, collect_meta, dense_fwd_bwd_ms, write_results  # noqa: E402
from megatron_dsv.ops.sparse_attention import launch  # noqa: E402
from megatron_dsv.ops.sparse_attention.flex import build_block_mask, sparse_attention_flex  # noqa: E402
from megatron_dsv.ops.sparse_attention.op import sparse_attention  # noqa: E402

H, D, B = 16, 128, 1


def make_lists(S, G, BS, sparsity, seed=0):
    """Random sorted lists, the same budget for every head: K = round((1 - s) * #keys)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    NG = math.ceil(S / G)
    nk = S if BS == 0 else math.ceil(S / BS)
    K = max(1, round((1 - sparsity) * nk))
    idx = torch.empty(B, H, NG, K, device="cuda", dtype=torch.int32)
    for h in range(H):  # one head at a time bounds the sort's memory at 128K tokens
        perm = torch.rand(NG, nk, device="cuda", generator=gen).argsort(-1)[:, :K]
        idx[0, h] = perm.sort(-1).values.to(torch.int32)
    cnt = torch.full((B, H), K, device="cuda", dtype=torch.int32)
    return idx, cnt, K * (1 if BS == 0 else BS)


def inputs(S, dtype=torch.bfloat16):
    return [torch.randn(B, H, S, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def fwd_bwd_ms(fn, q, k, v):
    fwd = bench_ms(fn)
    o = fn()
    do = torch.randn_like(o)
    bwd = bench_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return fwd, bwd


def ours_ms(q, k, v, idx, cnt, G, BS):
    return fwd_bwd_ms(lambda: sparse_attention(q, k, v, idx, cnt, G, BS), q, k, v)


def flex_ms(q, k, v, idx, cnt, G, BS):
    bm = build_block_mask(idx, cnt, q.shape[2], G, BS)
    return fwd_bwd_ms(lambda: sparse_attention_flex(q, k, v, idx, cnt, G, BS, block_mask=bm), q, k, v)


def one_row(S, sparsity, BS, G, dense, with_flex):
    q, k, v = inputs(S)
    idx, cnt, kept = make_lists(S, G, BS, sparsity)
    fwd, bwd = ours_ms(q, k, v, idx, cnt, G, BS)
    flops_fwd = 4.0 * B * H * S * kept * D
    row = dict(S=S, H=H, D=D, B=B, G=G, block_size=BS, sparsity=sparsity,
               granularity="token" if BS == 0 else "block", keys_per_group=kept,
               ms_fwd=fwd, ms_bwd=bwd, **dense,
               speedup_fwd=dense["ms_dense_fwd"] / fwd, speedup_bwd=dense["ms_dense_bwd"] / bwd,
               speedup_fwd_bwd=(dense["ms_dense_fwd"] + dense["ms_dense_bwd"]) / (fwd + bwd),
               tflops_fwd=flops_fwd / fwd * 1e-9, tflops_bwd=2.5 * flops_fwd / bwd * 1e-9)
    if with_flex and BS > 0:
        ffwd, fbwd = flex_ms(q, k, v, idx, cnt, G, BS)
        row.update(ms_flex_fwd=ffwd, ms_flex_bwd=fbwd, speedup_vs_flex_fwd=ffwd / fwd,
                   speedup_vs_flex_bwd=fbwd / bwd, speedup_vs_flex_fwd_bwd=(ffwd + fbwd) / (fwd + bwd))
    return row


TUNE_SPACE = {
    # pass -> candidate (BM, BN, num_warps, num_stages)
    "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2)],
    "bwd_q": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 2),
              (128, 128, 8, 2), (64, 32, 4, 3)],
    "bwd_kv": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2), (64, 64, 8, 2),
               (128, 64, 4, 2), (64, 128, 8, 2)],
    "fwd_tok": [(128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
    "bwd_q_tok": [(128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
}


def _time_pass(kind, cfg, q, k, v, o, lse, do, idx, cnt, G, BS, scale):
    if kind == "fwd":
        return bench_ms(lambda: launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale, cfg=cfg))
    cq = cfg if kind == "bwd_q" else None
    ckv = cfg if kind == "bwd_kv" else None
    # block-level dq kernel timed alone; the dk/dv kernel as the whole backward
    if kind == "bwd_q" and BS > 0:
        do = do.contiguous()
        return bench_ms(lambda: launch.sparse_bwd_q(do, q, k, v, o, lse, idx, cnt, G, BS, scale, False, cfg_q=cq))
    return bench_ms(lambda: launch.sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, scale, cfg_q=cq, cfg_kv=ckv))


def tune(S, G, sparsity=0.9):
    """Sweep each pass's configs at one shape; install winners in launch.CONFIG_OVERRIDES."""
    rows = []
    scale = 1 / math.sqrt(D)
    for BS in (128, 0):
        q, k, v = (t.detach() for t in inputs(S))
        idx, cnt, _ = make_lists(S, G, BS, sparsity)
        o, lse = launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale)
        do = torch.randn_like(o)
        passes = ("fwd", "bwd_q", "bwd_kv") if BS else ("fwd_tok", "bwd_q_tok")
        for name in passes:
            kind = name.replace("_tok", "")
            best = (float("inf"), None)
            for BM, BN, w, st in TUNE_SPACE[name]:
                cfg = dict(BM=min(BM, G), BN=BN, num_warps=w, num_stages=st)
                try:
                    ms = _time_pass(kind, cfg, q, k, v, o, lse, do, idx, cnt, G, BS, scale)
                except Exception as e:  # out of shared memory etc.: not a candidate
                    ms = float("inf")
                    print(f"  {name} {cfg} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                rows.append(dict(pass_=name, S=S, G=G, block_size=BS, sparsity=sparsity, ms=ms, **cfg))
                print(f"  tune {name:10s} BM={BM:3d} BN={BN:3d} w={w} s={st}: {ms:8.3f} ms", flush=True)
                best = min(best, (ms, cfg), key=lambda t: t[0])
            launch.CONFIG_OVERRIDES[(kind, D, G, BS)] = best[1]
            print(f"tune {name}: best {best[1]} {best[0]:.3f} ms", flush=True)
        if BS:
            cq = dict(BM=128, BN=64, num_warps=8, num_stages=2)  # the atomic variant needs smaller tiles
            try:
                ms = bench_ms(lambda: launch.sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, scale,
                                                        atomic_kv=True, cfg_q=cq))
            except Exception as e:
                ms = float("inf")
                print(f"  atomic variant failed: {type(e).__name__}", flush=True)
            rows.append(dict(pass_="bwd_atomic", S=S, G=G, block_size=BS, sparsity=sparsity, ms=ms))
            print(f"tune bwd with atomics instead of inverse map: {ms:.3f} ms", flush=True)
    return rows


SWEEP_SHAPES = ((128, 128), (128, 64), (64, 128), (64, 64), (32, 64))  # (G, block_size)
SWEEP_S = (65536, 16384)


def fused_space(G, BS):
    """(BM, BN, warps, stages, DQ): key tiles of 64 and, for 128-blocks, 128 rows (half the
    atomics per FLOP); DQ 1 = pointer atomics, 2 = TMA reduce-add."""
    space = [(64, 64, 4, 2, 1), (64, 64, 4, 2, 2)]
    if BS == 128:
        space += [(64, 128, 8, 2, 1), (64, 128, 8, 2, 2)]
    return [dict(BM=min(BM, G), BN=BN, num_warps=w, num_stages=st, DQ=dq) for BM, BN, w, st, dq in space]


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_row(S, G, BS, dense, warm):
    """One (S, G, block) point: every forward and backward variant and flex on the same lists."""
    timed = (lambda fn: (fn(), 0.0)[1]) if warm else bench_ms
    q, k, v = inputs(S)
    idx, cnt, kept = make_lists(S, G, BS, 0.9)
    scale = 1 / math.sqrt(D)
    row = dict(S=S, H=H, D=D, B=B, G=G, group_size=G, block_size=BS, sparsity=0.9, granularity="block",
               keys_per_group=kept, **dense)
    fn = lambda: sparse_attention(q, k, v, idx, cnt, G, BS)  # noqa: E731
    row["ms_fwd_default"] = timed(fn)
    row["fwd_cfg_default"] = launch.pick_config("fwd", D, G, BS)
    if BS == 64:  # two 64-blocks per 128-wide step
        pair = dict(BM=min(128, G), BN=128, num_warps=8, num_stages=3)
        launch.CONFIG_OVERRIDES[("fwd", D, G, BS)] = pair
        try:
            row["ms_fwd_pair"] = timed(fn)
        except Exception as e:
            print(f"  paired fwd failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        del launch.CONFIG_OVERRIDES[("fwd", D, G, BS)]
    o = fn()
    do = torch.randn_like(o)
    bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
    os.environ["DSV_SPARSE_BWD"] = "split"
    row["ms_bwd_split"] = timed(bwd)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    od, lse = launch.sparse_fwd(qd, kd, vd, idx, cnt, G, BS, scale)
    ref = launch.sparse_bwd(do, qd, kd, vd, od, lse, idx, cnt, G, BS, scale, mode="split")
    fused = []
    for cfg in fused_space(G, BS):
        tag = "BN{BN}-w{num_warps}-dq{DQ}".format(**cfg)
        try:
            got = launch.sparse_bwd(do, qd, kd, vd, od, lse, idx, cnt, G, BS, scale, mode="fused", cfg_kv=cfg)
            err = max(_rel(a, b) for a, b in zip(got, ref))
            launch.CONFIG_OVERRIDES[("bwd_fused", D, G, BS)] = cfg
            os.environ["DSV_SPARSE_BWD"] = "fused"
            ms = timed(bwd) if err < 2e-2 else float("inf")
        except Exception as e:
            err, ms = float("nan"), float("inf")
            print(f"  fused {tag} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        row[f"ms_bwd_fused_{tag}"] = ms
        row[f"err_fused_{tag}"] = err
        fused.append((ms, tag, cfg))
    launch.CONFIG_OVERRIDES.pop(("bwd_fused", D, G, BS), None)
    os.environ["DSV_SPARSE_BWD"] = "split"
    best = min(fused, key=lambda t: t[0])
    row.update(ms_bwd_fused=best[0], bwd_fused_cfg=best[2])
    row["ms_fwd"] = min(row["ms_fwd_default"], row.get("ms_fwd_pair", float("inf")))
    row["fwd_variant"] = "pair" if row["ms_fwd"] < row["ms_fwd_default"] else "default"
    row["ms_bwd"] = min(row["ms_bwd_split"], row["ms_bwd_fused"])
    row["bwd_mode"] = "fused" if row["ms_bwd_fused"] < row["ms_bwd_split"] else "split"
    if flex_supported_shape(G, BS):
        bm = build_block_mask(idx, cnt, S, G, BS)
        ffn = lambda: sparse_attention_flex(q, k, v, idx, cnt, G, BS, block_mask=bm)  # noqa: E731
        try:
            row["ms_flex_fwd"] = timed(ffn)
            fo = ffn()
            row["ms_flex_bwd"] = timed(lambda: torch.autograd.grad(fo, (q, k, v), do, retain_graph=True))
        except Exception as e:  # flex can't lower some tile/block combinations: record, don't abort
            row.pop("ms_flex_fwd", None)
            row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"  flex failed: {row['flex_error']}", flush=True)
    if not warm:
        flops_fwd = 4.0 * B * H * S * kept * D
        row.update(tflops_fwd=flops_fwd / row["ms_fwd"] * 1e-9, tflops_bwd=2.5 * flops_fwd / row["ms_bwd"] * 1e-9,
                   speedup_fwd=dense["ms_dense_fwd"] / row["ms_fwd"], speedup_bwd=dense["ms_dense_bwd"] / row["ms_bwd"],
                   speedup_fwd_bwd=(dense["ms_dense_fwd"] + dense["ms_dense_bwd"]) / (row["ms_fwd"] + row["ms_bwd"]),
                   speedup_bwd_fused_vs_split=row["ms_bwd_split"] / row["ms_bwd_fused"])
        if "ms_flex_fwd" in row:
            row.update(speedup_vs_flex_fwd=row["ms_flex_fwd"] / row["ms_fwd"],
                       speedup_vs_flex_bwd=row["ms_flex_bwd"] / row["ms_bwd"],
                       speedup_vs_flex_fwd_bwd=(row["ms_flex_fwd"] + row["ms_flex_bwd"]) / (row["ms_fwd"] + row["ms_bwd"]),
                       speedup_vs_flex_bwd_split=row["ms_flex_bwd"] / row["ms_bwd_split"],
                       speedup_vs_flex_bwd_fused=row["ms_flex_bwd"] / row["ms_bwd_fused"])
    return row


def flex_supported_shape(G, BS):
    from megatron_dsv.ops.sparse_attention.flex import flex_supported

    return flex_supported(0, G, BS)


MAIN_KEYS = ("S", "H", "D", "B", "G", "group_size", "block_size", "sparsity", "granularity", "keys_per_group",
             "ms_fwd", "ms_bwd", "bwd_mode", "ms_bwd_split", "ms_bwd_fused", "ms_dense_fwd", "ms_dense_bwd",
             "dense_backend", "speedup_fwd", "speedup_bwd", "speedup_fwd_bwd", "tflops_fwd", "tflops_bwd",
             "ms_flex_fwd", "ms_flex_bwd", "speedup_vs_flex_fwd", "speedup_vs_flex_bwd", "speedup_vs_flex_fwd_bwd")


def groups_sweep(args, meta):
    i_shard, n_shard = (int(x) for x in args.shard.split("/"))
    shapes = [tuple(int(x) for x in t.split("x")) for t in args.shapes.split(",")] if args.shapes else SWEEP_SHAPES
    points = [(S, G, BS) for (G, BS) in shapes for S in SWEEP_S]
    if args.warm_only:  # shard by (G, BS): one process compiles a shape's kernels for both S
        points = [p for p in points if shapes.index(p[1:]) % n_shard == i_shard]
    else:  # the main table's shape first, both S, then the rest: a cut-off run keeps what matters
        points.sort(key=lambda p: (p[1:] != (128, 128), -p[0]))
    rows, dense_by_s = [], {}
    for S, G, BS in points:
        t0 = time.time()
        if S not in dense_by_s:
            dense_by_s[S] = {} if args.warm_only else dense_fwd_bwd_ms(B, H, S, D, rep=100)
        row = sweep_row(S, G, BS, dense_by_s[S], args.warm_only)
        print(f"S={S} G={G} BS={BS} done [{time.time() - t0:.0f}s]", flush=True)
        if args.warm_only:
            continue
        rows.append(row)
        write_results("sparse_attention-groups", rows, args.out, meta)
        write_results("sparse_attention", [{k: r[k] for k in MAIN_KEYS if k in r} for r in rows], args.out, meta)
        print_sweep(rows[-1:], header=len(rows) == 1)
        torch.cuda.empty_cache()
    if rows:
        print_sweep(rows)


def print_sweep(rows, header=True):
    if header:
        print(f"{'S':>6} {'G':>4} {'BS':>4} {'fwd':>6} {'pair':>6} {'flexF':>6} {'split':>6} {'fused':>6} "
              f"{'flexB':>6} {'xF':>5} {'xB':>5} {'vsflexF':>7} {'vsflexB':>7}  fused cfg")
    nan = float("nan")
    for r in rows:
        c = r["bwd_fused_cfg"]
        print(f"{r['S']:>6} {r['G']:>4} {r['block_size']:>4} {r['ms_fwd_default']:6.2f} {r.get('ms_fwd_pair', nan):6.2f} "
              f"{r.get('ms_flex_fwd', nan):6.2f} {r['ms_bwd_split']:6.2f} {r['ms_bwd_fused']:6.2f} "
              f"{r.get('ms_flex_bwd', nan):6.2f} {r['speedup_fwd']:5.2f} {r['speedup_bwd']:5.2f} "
              f"{r.get('speedup_vs_flex_fwd', nan):7.2f} {r.get('speedup_vs_flex_bwd', nan):7.2f}  "
              f"BN{c['BN']} w{c['num_warps']} dq{c['DQ']}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S in {16K, 64K}, sparsity 0.9 only")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs first (S=64K, 90%%)")
    ap.add_argument("--groups-sweep", action="store_true", help="(G, block) sweep, split vs fused bwd, flex")
    ap.add_argument("--warm-only", action="store_true", help="with --groups-sweep: compile and run once, no timing")
    ap.add_argument("--shard", default="0/1", help="with --warm-only: I/N, this process's share of the shapes")
    ap.add_argument("--shapes", default=None, help="with --groups-sweep: GxBS list, e.g. 128x64,64x64")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    meta = collect_meta()
    if args.groups_sweep:
        groups_sweep(args, meta)
        return
    G = args.group_size
    seqs = (16384, 65536) if args.quick else (16384, 32768, 65536, 131072)
    sparsities = (0.9,) if args.quick else (0.8, 0.9, 0.95, 0.98)
    if args.tune:
        t0 = time.time()
        trows = tune(65536, G)
        write_results("sparse_attention-tune", trows, args.out, meta)
        print(f"tuning took {time.time() - t0:.0f} s; configs: {json.dumps({str(k): v for k, v in launch.CONFIG_OVERRIDES.items()})}")
    rows = []
    for S in seqs:
        dense = dense_fwd_bwd_ms(B, H, S, D, rep=100)  # cached once per S
        for BS in (128, 0):
            for sp in sparsities:
                t0 = time.time()
                row = one_row(S, sp, BS, G, dense, with_flex=not args.no_flex)
                row["tuned_configs"] = {f"{k[0]}": v for k, v in launch.CONFIG_OVERRIDES.items() if k[3] == BS}
                rows.append(row)
                flex = f" flex {row['ms_flex_fwd']:.2f}/{row['ms_flex_bwd']:.2f}" if "ms_flex_fwd" in row else ""
                print(f"S={S} {row['granularity']:5s} s={sp}: fwd {row['ms_fwd']:.2f} bwd {row['ms_bwd']:.2f} ms"
                      f" (dense {dense['ms_dense_fwd']:.1f}/{dense['ms_dense_bwd']:.1f}){flex} [{time.time() - t0:.0f}s]",
                      flush=True)
                write_results("sparse_attention", rows, args.out, meta)
        torch.cuda.empty_cache()
    print_table(rows)


def print_table(rows):
    print(f"{'S':>6} {'gran':5} {'sp':>4} {'fwd':>7} {'bwd':>7} {'x_fwd':>6} {'x_bwd':>6} {'x_f+b':>6} "
          f"{'TF_f':>5} {'TF_b':>5} {'vsflex_f':>8} {'vsflex_b':>8}")
    for r in rows:
        vf = f"{r['speedup_vs_flex_fwd']:8.2f} {r['speedup_vs_flex_bwd']:8.2f}" if "ms_flex_fwd" in r else ""
        print(f"{r['S']:>6} {r['granularity']:5} {r['sparsity']:>4} {r['ms_fwd']:7.2f} {r['ms_bwd']:7.2f} "
              f"{r['speedup_fwd']:6.2f} {r['speedup_bwd']:6.2f} {r['speedup_fwd_bwd']:6.2f} "
              f"{r['tflops_fwd']:5.0f} {r['tflops_bwd']:5.0f} {vf}")


if __name__ == "__main__":
    main()

"""Sparse attention kernels vs cuDNN dense and FlexAttention on identical lists.

    PYTHONPATH=. python benchmarks/bench_sparse_attention.py [--quick] [--tune] [--out DIR]

Rows (DESIGN.md section 6): S, H, D, B, G, block_size, sparsity, granularity,
ms_fwd/ms_bwd (our Triton path through the public op, value checks skipped),
same-run cuDNN dense ms_dense_*, speedup_*, effective tflops_* on the kept
FLOPs, and for block lists ms_flex_*/speedup_vs_flex_* (FlexAttention, BlockMask
built from the same lists, compiled once per shape). ``--tune`` first sweeps
tile configs at S=64K, 90% sparsity, and uses the winners for the table.
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
    only_dq = kind == "bwd_q" and BS > 0
    return bench_ms(lambda: launch.sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, scale, cfg_q=cq, cfg_kv=ckv,
                                              _only_dq=only_dq))


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S in {16K, 64K}, sparsity 0.9 only")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs first (S=64K, 90%%)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
    G = args.group_size
    seqs = (16384, 65536) if args.quick else (16384, 32768, 65536, 131072)
    sparsities = (0.9,) if args.quick else (0.8, 0.9, 0.95, 0.98)
    meta = collect_meta()
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

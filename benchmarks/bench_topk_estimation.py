"""Top-k estimation benchmark: CUDA kernel vs Triton vs materialise + torch.topk (the artifact path).

H=16, r=16, G=32 (--group-size), 90% sparsity (K = 10% of S rounded up to 128: 6656 at 64K), bf16, B=1.
Per S and backend: ms_select, peak extra memory (max_memory_allocated delta, output
included) against the output lists' size, and the same-run cuDNN dense fwd/bwd of the
layer (H=16, D=128). Also block-level (block 64) selection. Writes
benchmarks/results/topk_estimation-<gpu>-<date>.json (DESIGN.md section 6).

    python benchmarks/bench_topk_estimation.py [--quick] [--out DIR] [--sizes 16384,65536]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import bench_ms, collect_meta, dense_fwd_bwd_ms, write_results  # noqa: E402
from megatron_dsv.ops.topk_estimation.common import tensor_core_scorable  # noqa: E402
from megatron_dsv.ops.topk_estimation.cuda_impl import cuda_extension, estimate_topk_cuda  # noqa: E402
from megatron_dsv.ops.topk_estimation.naive import group_proxies  # noqa: E402
from megatron_dsv.ops.topk_estimation.triton_impl import METHODS, estimate_topk_triton, resolve_method  # noqa: E402

H, R, D, SPARSITY = 16, 16, 128, 0.9
COOL_DOWN_S = 2.0  # idle seconds before each size's selection timings


def artifact_topk(q_lr, k_lr, K, G):
    """The public artifact's way: dense proxy x key scores, torch.topk, sort the indices."""
    p = group_proxies(q_lr, G, "mean")
    s = torch.matmul(p, k_lr.transpose(-1, -2))  # [B, H, NG, S]
    idx = torch.topk(s, K, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values.to(torch.int32)


def measure(fn, rep=100):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    ms = bench_ms(fn, warmup=10, rep=rep)
    return ms, peak


# the Triton top-k's scorings on token lists, each set in full (triton_impl.kernel_meta; "triton" runs the
# defaults, triton_impl.resolve_scoring: tensor cores and 4 probes a reduction since run 21): the loop over r on FMA
# units (the default until run 21), one fp32 tl.dot per tile, tensor cores, each with 1 or 4 probes counted per
# cross-thread reduction in the searches
PASS_TILES = ((16, 64), (32, 64), (64, 32), (128, 32), (32, 128))
TRITON_CANDIDATES = {"triton_loop": dict(dot=False, pack_counts=1), "triton_pack4": dict(dot=False, pack_counts=4),
                     "triton_dot": dict(dot=True, pack_counts=1), "triton_dot_pack4": dict(dot=True, pack_counts=4),
                     "triton_tc": dict(dot="tc", pack_counts=1), "triton_tc_pack4": dict(dot="tc", pack_counts=4),
                     # the window pass of "sample" and the write pass on other tiles than resolve_pass_tile's (run 27:
                     # 16 x 64 was the fused sample kernel's, whose 236 registers held one program an SM)
                     **{f"triton_pass{g}x{n}": dict(pass_tile=(g, n)) for g, n in PASS_TILES},
                     # the window and write passes without scan_store (triton_impl.scan_store_mode, the default
                     # since run 29): the keys, masks and positions converted to tl.store's layout after the scan
                     "triton_tl_store": dict(scan_store=False)}
# block lists: "gemm" (the default until run 27: every token's score through cuBLAS, read back by the selection) and
# method "keys" scoring each tile's blocks with one tensor-core product over their tokens then the block max
# (scoring._scores_at; the default since run 27 on resolve_tile's 64 groups x 256 tokens): BG groups x BN blocks a
# tile (run 27 at 128-key blocks: 16 x 4 / 32 x 4 / 64 x 2 / 128 x 2)
TRITON_BLOCK_CANDIDATES = {"triton_gemm": dict(method="gemm"),
                           "triton_keys_tc": dict(method="keys", dot="tc", BG=16, BN=4),
                           "triton_keys_tc_g32": dict(method="keys", dot="tc", BG=32, BN=4),
                           "triton_keys_tc_g64": dict(method="keys", dot="tc", BG=64, BN=2),
                           "triton_keys_tc_g128": dict(method="keys", dot="tc", BG=128, BN=2)}
BACKENDS = ("cuda", "triton", *TRITON_CANDIDATES, *TRITON_BLOCK_CANDIDATES, "torch_topk")


def run(sizes, triton_max_s, out_dir, G=32, block=64, backends=("cuda", "triton", "torch_topk"), triton_method="auto",
        granularities=("token", "block")):
    """One row per (S, backend, granularity); G query-group size, ``block`` KV block size,
    ``triton_method`` the Triton backend's method (one of ``triton_impl.METHODS``), ``granularities``
    the list kinds measured."""
    bench = "topk_estimation" if (G, block) == (32, 64) else f"topk_estimation-g{G}-b{block}"
    rows = []
    meta = collect_meta()
    for S in sizes:
        K = int(math.ceil((1 - SPARSITY) * S / 128) * 128)
        Kb = int(math.ceil((1 - SPARSITY) * S / block))
        NG = -(-S // G)
        q = torch.randn(1, H, S, R, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, H, S, R, device="cuda", dtype=torch.bfloat16)
        # Selection first, after an idle pause, then the dense baseline: a dense run of seconds just
        # before heats the GPU and lowers its clocks for whatever follows (up to 40% at 128K).
        torch.cuda.synchronize()
        time.sleep(COOL_DOWN_S)
        base = dict(S=S, H=H, B=1, D=D, r=R, G=G, sparsity=SPARSITY, dtype="bf16", order="selection, then dense",
                    cool_down_s=COOL_DOWN_S)
        cases = [("cuda", "token", K, lambda: estimate_topk_cuda(q, k, K, G)),
                 ("cuda", "block", Kb, lambda: estimate_topk_cuda(q, k, Kb, G, block)),
                 ("triton", "token", K, lambda st=None: estimate_topk_triton(q, k, K, G, method=triton_method,
                                                                             stats=st)),
                 ("triton", "block", Kb, lambda st=None: estimate_topk_triton(q, k, Kb, G, block,
                                                                              method=triton_method, stats=st)),
                 *[(name, "token", K, lambda st=None, kw=kw: estimate_topk_triton(q, k, K, G, method=triton_method,
                                                                                   stats=st, **kw))
                   for name, kw in TRITON_CANDIDATES.items()
                   if "pass_tile" not in kw or triton_method in ("auto", "sample", "search")],  # passes of these
                 *[(name, "block", Kb, lambda kw=kw: estimate_topk_triton(q, k, Kb, G, block, **kw))
                   for name, kw in TRITON_BLOCK_CANDIDATES.items()],
                 ("torch_topk", "token", K, lambda: artifact_topk(q, k, K, G))]
        size_rows = []
        cuda_lists = None  # the CUDA kernel's token lists: how many entries each Triton candidate's differ by
        cuda_block_lists = None  # and its block lists, for the block candidates
        for backend, gran, kk, fn in cases:
            if backend not in backends or gran not in granularities or (backend == "cuda" and cuda_extension() is None):
                continue
            row = dict(base, backend=backend, granularity=gran, block_size=block if gran == "block" else 0, K=kk,
                       out_bytes=NG * H * kk * 4)
            if backend.startswith("triton"):  # the method that ran ("auto" has meant different ones over time)
                row["triton_method"] = resolve_method(triton_method, row["block_size"],
                                                      tensor_core_scorable(q.dtype, R))
            if backend in TRITON_BLOCK_CANDIDATES:
                row.update(triton_method=TRITON_BLOCK_CANDIDATES[backend]["method"],
                           candidate=TRITON_BLOCK_CANDIDATES[backend])
            if backend.startswith("triton") and S > triton_max_s:
                row["skipped"] = f"S > {triton_max_s} (too slow for the lease)"
                size_rows.append(row)
                continue
            try:
                t0 = time.time()
                ms, peak = measure(fn, rep=100)
                row.update(ms_select=ms, peak_extra_bytes=peak, peak_over_out=peak / row["out_bytes"],
                           wall_s=time.time() - t0)
                if backend.startswith("triton") and row["triton_method"] in ("sample", "search"):
                    st = {}  # one more call, its kernels timed apart and the groups left to the search counted
                    lists = fn(st)[0]
                    row["phases"] = st
                    if gran == "token" and cuda_lists is not None:  # near-exact ties may go either way
                        row["entries_differ_from_cuda"] = int((lists != cuda_lists).sum())
                    del lists
                elif backend in TRITON_BLOCK_CANDIDATES and cuda_block_lists is not None:  # near-exact ties
                    row["entries_differ_from_cuda"] = int((fn()[0] != cuda_block_lists).sum())
                elif backend == "cuda" and gran == "token":
                    cuda_lists = fn()[0]
                elif backend == "cuda":
                    cuda_block_lists = fn()[0]
            except torch.cuda.OutOfMemoryError as err:
                row["skipped"] = f"OOM: {str(err)[:120]}"
            torch.cuda.empty_cache()
            size_rows.append(row)
        cuda_lists = cuda_block_lists = None  # (3.5 GB at 128K) freed before the dense baseline
        dense = dense_fwd_bwd_ms(1, H, S, D)
        torch.cuda.empty_cache()
        dense_total = dense["ms_dense_fwd"] + dense["ms_dense_bwd"]
        for row in size_rows:
            row.update(dense)
            if "ms_select" in row:
                row["select_frac_of_dense"] = row["ms_select"] / dense_total
            rows.append(row)
            print(_fmt(row), flush=True)
        q = k = None  # freed before the next size (lambdas above read them late: no del)
        torch.cuda.empty_cache()
        write_results(bench, rows, out_dir, meta)  # partial results survive a timeout
    path = write_results(bench, rows, out_dir, meta)
    print(f"\nwrote {path}")
    print(f"{'S':>7} {'gran':>5} {'backend':>19} {'K':>6} {'ms_select':>10} {'peak/out':>8} {'%dense':>7}")
    for r in rows:
        print(_fmt(r))
    return rows


def _fmt(r):
    if "ms_select" not in r:
        return f"{r['S']:>7} {r['granularity']:>5} {r['backend']:>19} {r['K']:>6} {'-':>10} {r.get('skipped', '')}"
    ph = r.get("phases")
    extra = "" if not ph else (" | " + " ".join(f"{k[3:]} {v:.2f}" for k, v in ph.items() if k.startswith("ms_"))
                               + f" ms; search on {ph['fallback_groups']} of {ph['groups']} groups"
                               f" ({ph['fallback_tiles']} of {ph['tiles']} tiles)")
    if "entries_differ_from_cuda" in r:
        extra += f"; {r['entries_differ_from_cuda']} list entries differ from CUDA's"
    return (f"{r['S']:>7} {r['granularity']:>5} {r['backend']:>19} {r['K']:>6} {r['ms_select']:>10.3f} "
            f"{r['peak_over_out']:>8.2f} {100 * r['select_frac_of_dense']:>6.2f}%{extra}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S in {16K, 64K} only")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--sizes", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--triton-max-s", type=int, default=65536, help="skip Triton above this S")
    ap.add_argument("--group-size", type=int, default=32, help="query group size G (results file tagged when not 32)")
    ap.add_argument("--block-size", type=int, default=64, help="KV block size of the block-level rows")
    ap.add_argument("--backends", default="cuda,triton,torch_topk",
                    help=f"comma-separated, of {', '.join(BACKENDS)} (triton_*: token lists, TRITON_CANDIDATES; "
                         "triton_keys_*: block lists, TRITON_BLOCK_CANDIDATES)")
    ap.add_argument("--granularity", default="token,block", help="comma-separated list kinds: token, block")
    ap.add_argument("--triton-method", default="auto", choices=METHODS,
                    help="method of the Triton backend (auto: sample for token lists, gemm for block lists)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [16384, 65536] if args.quick else [16384, 32768, 65536, 131072])
    backends = tuple(args.backends.split(","))
    if not set(backends) <= set(BACKENDS):
        ap.error(f"--backends takes {', '.join(BACKENDS)}, got {args.backends!r}")
    granularities = tuple(args.granularity.split(","))
    if not set(granularities) <= {"token", "block"}:
        ap.error(f"--granularity takes token and/or block, got {args.granularity!r}")
    run(sizes, args.triton_max_s, args.out, args.group_size, args.block_size, backends, args.triton_method,
        granularities)


if __name__ == "__main__":
    main()

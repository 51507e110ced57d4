"""Run the CUDA top-k estimation kernel, or the Triton one (``--backend triton``), a few times on one shape (for
ncu / timing by hand).

    ncu --clock-control none -k regex:topk_kernel -s 2 -c 1 python benchmarks/profile_topk.py --S 65536
    ncu --clock-control none -k regex:'_ss_window|_tk_write' -s 2 -c 2 python benchmarks/profile_topk.py \
        --backend triton --S 65536

(``-s 2``: past the first call's launches; the Triton kernels compile before their first launch, which ncu does not
count.) ``tools/gpu_check.sh OUT topkprof`` runs the second with the sections that say where a kernel's time goes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import bench_ms  # noqa: E402
from megatron_dsv.ops.topk_estimation.cuda_impl import estimate_topk_cuda  # noqa: E402
from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("cuda", "triton"), default="cuda")
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--G", type=int, default=32)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also time with CUDA events")
    ap.add_argument("--sample-stride", type=int, default=0, help="force the kernel's sample stride (0 = auto)")
    ap.add_argument("--force-fallback", action="store_true", help="every row takes the exact fallback")
    ap.add_argument("--flags", type=int, default=0, help="debug stops: 2 = after the main pass, 4 = before compaction")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    q = torch.randn(1, a.H, a.S, a.r, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, a.H, a.S, a.r, device="cuda", dtype=torch.bfloat16)
    unit = a.block or 1
    kept = (1 - a.sparsity) * a.S / unit
    K = int(math.ceil(kept / 128) * 128) if unit == 1 else int(math.ceil(kept))
    if a.backend == "cuda":
        kw = dict(sample_stride=a.sample_stride, force_fallback=a.force_fallback, debug_flags=a.flags)
        fn = estimate_topk_cuda
    elif a.sample_stride or a.force_fallback or a.flags:
        raise SystemExit("--sample-stride, --force-fallback and --flags are the CUDA kernel's (--backend cuda)")
    else:
        kw, fn = {}, estimate_topk_triton
    for _ in range(a.launches):
        fn(q, k, K, a.G, a.block, **kw)
    torch.cuda.synchronize()
    if a.time:
        ms = bench_ms(lambda: fn(q, k, K, a.G, a.block, **kw))
        print(f"{a.backend} S={a.S} G={a.G} block={a.block} K={K} {kw}: {ms:.3f} ms")


if __name__ == "__main__":
    main()

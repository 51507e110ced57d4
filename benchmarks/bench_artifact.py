"""Our token-list kernels against the DSV paper's artifact on identical lists (issue 26: "our forward faster than the
DSV artifact's at G = 32"), with the same-run cuDNN baseline.

    git clone -b ae https://github.com/NetX-lab/DSV /path/to/dsv-ae     # the artifact; never part of this project
    PYTHONPATH=. python benchmarks/bench_artifact.py --artifact-dir /path/to/dsv-ae [--groups 32,64,128] [--out DIR]

The artifact's sparse attention (``DSV/triton_plugin/fused_attention_no_causal_sparse_query_group.py``: one
Triton program per 32 queries, ``SparseGroupAttention.apply(q, k, v, causal, sm_scale, kv_index, topk_per_head,
group_size)``) takes, like ours, one sorted list of key tokens per group of ``G`` consecutive queries and a count
per head. The file is loaded by path (only torch and triton are imported with it), never installed or copied.
Per (S, G, sparsity): the video-shaped token lists of ``list_shapes.video_lists`` (D = 128, H = 16, bf16), both
outputs checked against each other first (a row records the largest difference, and a row whose outputs disagree
beyond bf16's rounding is marked ``mismatch`` instead of timed), then fwd and bwd ms of ours (the public op,
``DSV_SPARSE_ATTN_BACKEND=triton``), the artifact's, and cuDNN dense, each median of ``triton.testing.do_bench``.
Writes ``artifact_compare-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_ms, collect_meta, dense_fwd_bwd_ms, write_results  # noqa: E402
from benchmarks.list_shapes import video_lists  # noqa: E402

ARTIFACT_FILE = "DSV/triton_plugin/fused_attention_no_causal_sparse_query_group.py"
ARTIFACT_GROUPS = 32  # its query tile: G must be a multiple of it
MISMATCH_TOL = 0.05  # max |ours - artifact| of outputs ~N(0, 1/sqrt(kept)) in bf16; an index bug gives ~1


def load_artifact(artifact_dir: str):
    """The artifact's ``SparseGroupAttention.apply`` from ``artifact_dir`` (a checkout of NetX-lab/DSV, branch ae)."""
    path = Path(artifact_dir) / ARTIFACT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--artifact-dir {artifact_dir!r}: no {ARTIFACT_FILE} there; pass the root of a "
                                "checkout of https://github.com/NetX-lab/DSV at branch ae")
    spec = importlib.util.spec_from_file_location("dsv_artifact_sparse_group_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "SparseGroupAttention"):
        raise AttributeError(f"{path} defines no SparseGroupAttention: not the artifact version this bench knows")
    return module.SparseGroupAttention.apply


def check_groups(groups: List[int]) -> List[int]:
    bad = [g for g in groups if g < ARTIFACT_GROUPS or g % ARTIFACT_GROUPS]
    if bad:
        raise ValueError(f"--groups: the artifact needs multiples of {ARTIFACT_GROUPS}, got {bad}")
    return groups


def fwd_bwd(fn, q, k, v) -> Dict[str, float]:
    o = fn()
    do = torch.randn_like(o)
    return {"fwd": bench_ms(fn), "bwd": bench_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))}


def one_row(artifact, S: int, G: int, sparsity: float, dim: int, heads: int, dense: Dict[str, float]) -> Dict:
    from megatron_dsv.ops.sparse_attention.op import sparse_attention

    q, k, v = (torch.randn(1, heads, S, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    idx, cnt, kept = video_lists(S, G, 0, sparsity, heads, batch=1, device="cuda")
    scale = 1.0 / math.sqrt(dim)
    ours = lambda: sparse_attention(q, k, v, idx, cnt, G, 0)  # noqa: E731
    theirs = lambda: artifact(q, k, v, False, scale, idx, cnt, G)  # noqa: E731
    row = {"S": S, "H": heads, "D": dim, "G": G, "sparsity": sparsity, "granularity": "token", "lists": "video",
           "kept_keys_per_group": kept, **dense}
    with torch.no_grad():
        row["max_abs_diff_out"] = float((ours().float() - theirs().float()).abs().max())
    if not row["max_abs_diff_out"] <= MISMATCH_TOL:
        row["mismatch"] = f"outputs differ by {row['max_abs_diff_out']:.3g} (> {MISMATCH_TOL}): not timed"
        return row
    for name, fn in (("ours", ours), ("artifact", theirs)):
        t = fwd_bwd(fn, q, k, v)
        row[f"ms_{name}_fwd"], row[f"ms_{name}_bwd"] = t["fwd"], t["bwd"]
        dense_ms = dense["ms_dense_fwd"] + dense["ms_dense_bwd"]
        row[f"speedup_{name}_vs_dense_fwd_bwd"] = dense_ms / (t["fwd"] + t["bwd"])
    row["ours_vs_artifact_fwd"] = row["ms_artifact_fwd"] / row["ms_ours_fwd"]
    row["ours_vs_artifact_bwd"] = row["ms_artifact_bwd"] / row["ms_ours_bwd"]
    row["ours_vs_artifact_fwd_bwd"] = ((row["ms_artifact_fwd"] + row["ms_artifact_bwd"])
                                       / (row["ms_ours_fwd"] + row["ms_ours_bwd"]))
    return row


def print_rows(rows: List[Dict]) -> None:
    print(f"{'S':>7} {'G':>4} {'sp':>5} {'ours f/b':>15} {'artifact f/b':>15} {'cuDNN f/b':>15} "
          f"{'x fwd':>6} {'x bwd':>6} {'x f+b':>6} {'diff':>7}")
    for r in rows:
        if "mismatch" in r:
            print(f"{r['S']:>7} {r['G']:>4} {r['sparsity']:>5} {r['mismatch']}")
            continue
        print(f"{r['S']:>7} {r['G']:>4} {r['sparsity']:>5} {r['ms_ours_fwd']:>7.2f}/{r['ms_ours_bwd']:<7.2f} "
              f"{r['ms_artifact_fwd']:>7.2f}/{r['ms_artifact_bwd']:<7.2f} {r['ms_dense_fwd']:>7.2f}/"
              f"{r['ms_dense_bwd']:<7.2f} {r['ours_vs_artifact_fwd']:>6.2f} {r['ours_vs_artifact_bwd']:>6.2f} "
              f"{r['ours_vs_artifact_fwd_bwd']:>6.2f} {r['max_abs_diff_out']:>7.4f}")


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact-dir", required=True, help="root of a checkout of NetX-lab/DSV at branch ae")
    ap.add_argument("--groups", type=_ints, default=[32, 64, 128], help="query group sizes (multiples of 32)")
    ap.add_argument("--seq-lens", type=_ints, default=[65536])
    ap.add_argument("--sparsities", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.9])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    check_groups(args.groups)
    artifact = load_artifact(args.artifact_dir)
    if not torch.cuda.is_available():
        raise SystemExit("bench_artifact.py times CUDA kernels: no GPU here")
    os.environ.setdefault("DSV_SKIP_CHECKS", "1")  # our lists are valid by construction; time the kernels
    os.environ.setdefault("DSV_SPARSE_ATTN_BACKEND", "triton")
    rows = []
    for S in args.seq_lens:
        dense = dense_fwd_bwd_ms(1, args.heads, S, args.head_dim)
        for G in args.groups:
            for sp in args.sparsities:
                rows.append(one_row(artifact, S, G, sp, args.head_dim, args.heads, dense))
                print_rows(rows[-1:])
    meta = collect_meta()
    meta["artifact"] = {"file": ARTIFACT_FILE, "dir": os.path.abspath(args.artifact_dir)}
    path = write_results("artifact_compare", rows, args.out, meta)
    print_rows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our token-list kernels against the DSV paper's artifact on identical lists (issue 26: "our forward faster than the
DSV artifact's at G = 32"), with the same-run cuDNN baseline.

    git clone -b ae https://github.com/NetX-lab/DSV /path/to/dsv-ae     # the artifact; never part of this project
    PYTHONPATH=. python benchmarks/bench_artifact.py --artifact-dir /path/to/dsv-ae [--groups 32,64,128] [--out DIR]

The artifact's sparse attention (``DSV/triton_plugin/fused_attention_no_causal_sparse_query_group.py``: one
Triton program per 32 queries, ``SparseGroupAttention.apply(q, k, v, causal, sm_scale, kv_index, topk_per_head,
group_size)``) takes, like ours, one sorted list of key tokens per group of ``G`` consecutive queries and a count
per head. Its kernels assume what its own caller guarantees: a list length that is a multiple of 256 (its backward
reads whole tiles of indices without a mask, its forward scores masked-out slots as 0), so every list here keeps
``K = 256 * round((1 - sparsity) * S / 256)`` keys (the row records the sparsity that gives). The file is loaded
by path (only torch and triton are imported with it), never installed or copied.
Per (S, G, sparsity): the video-shaped token lists of ``list_shapes.video_lists`` (D = 128, H = 16, bf16); the
outputs and the gradients of both are checked against each other first (a row whose largest difference exceeds
``MISMATCH_REL`` of the largest value is marked ``mismatch`` and not timed: bf16 rounding gives ~0.3%, a tenth of
the lists wrong ~50%); then fwd and bwd ms of ours (the public op on its Triton backend), the artifact's, and cuDNN
dense, each the median of ``triton.testing.do_bench``. Writes ``artifact_compare-<gpu>-<date>.json`` and a PNG of
ours against the artifact per (S, G) beside it.

    PYTHONPATH=. python benchmarks/bench_artifact.py --join A.json B.json ... --out DIR

joins the rows of several calls of one machine (no GPU needed; each row keeps its call's date, the meta is the first
file's, and the files must name one GPU) into one JSON and PNG.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_sparse_attention import _floats, _ints, _seq_lens, fwd_bwd_ms  # noqa: E402
from benchmarks.common import bench_ms, collect_meta, dense_fwd_bwd_ms, write_results  # noqa: E402
from benchmarks.list_shapes import video_lists  # noqa: E402

ARTIFACT_FILE = "DSV/triton_plugin/fused_attention_no_causal_sparse_query_group.py"
ARTIFACT_TILE = 32  # its query tile: G must be a multiple of it
ARTIFACT_LIST_MULTIPLE = 256  # list lengths its kernels read without masks (its caller rounds to this)
MISMATCH_REL = 0.02


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
    bad = [g for g in groups if g < ARTIFACT_TILE or g % ARTIFACT_TILE]
    if bad:
        raise ValueError(f"--groups: the artifact needs multiples of {ARTIFACT_TILE}, got {bad}")
    return groups


def check_seq_len(S: int) -> int:
    if S % ARTIFACT_LIST_MULTIPLE:
        raise ValueError(f"--seq-lens: the artifact's backward needs S a multiple of {ARTIFACT_LIST_MULTIPLE}, got {S}")
    return S


def artifact_keys(S: int, sparsity: float) -> int:
    """Kept keys per group: ``(1 - sparsity) * S`` rounded to a multiple of 256 (at least 256, at most S)."""
    m = ARTIFACT_LIST_MULTIPLE
    return min(check_seq_len(S), max(m, round((1.0 - sparsity) * S / m) * m))


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def compare(ours: Callable, theirs: Callable, q, k, v) -> Dict[str, float]:
    """The largest difference of the output and of dq, dk, dv, each relative to the artifact's largest value."""
    out = {}
    o_ours, o_theirs = ours(), theirs()
    do = torch.randn_like(o_ours)
    g_ours = torch.autograd.grad(o_ours, (q, k, v), do)
    g_theirs = torch.autograd.grad(o_theirs, (q, k, v), do)
    out["rel_diff_out"] = _rel_diff(o_ours.detach(), o_theirs.detach())
    for name, a, b in zip(("dq", "dk", "dv"), g_ours, g_theirs):
        out[f"rel_diff_{name}"] = _rel_diff(a, b)
    return out


def one_row(artifact, S: int, G: int, sparsity: float, dim: int, heads: int, dense: Dict[str, float],
            device: str = "cuda", dtype=torch.bfloat16, timer=bench_ms, attention=None) -> Dict:
    """One point: the lists, the check, then both kernels timed. ``attention`` is our op (default the public
    ``sparse_attention`` on its Triton backend, value checks off: the lists are valid by construction)."""
    if attention is None:
        from megatron_dsv.ops.sparse_attention.op import sparse_attention

        def attention(q, k, v, idx, cnt, G):
            return sparse_attention(q, k, v, idx, cnt, G, 0, check_values=False, backend="triton")

    K = artifact_keys(S, sparsity)
    q, k, v = (torch.randn(1, heads, S, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    idx, cnt, kept = video_lists(S, G, 0, 1.0 - K / S, heads, batch=1, device=device)
    if kept != K:
        raise AssertionError(f"video_lists kept {kept} keys, the artifact's lists need {K}")
    scale = 1.0 / math.sqrt(dim)
    ours = lambda: attention(q, k, v, idx, cnt, G)  # noqa: E731
    theirs = lambda: artifact(q, k, v, False, scale, idx, cnt, G)  # noqa: E731
    row = {"S": S, "H": heads, "D": dim, "G": G, "sparsity": 1.0 - K / S, "sparsity_asked": sparsity,
           "granularity": "token", "lists": "video", "kept_keys_per_group": K, **dense}
    row.update(compare(ours, theirs, q, k, v))
    worst = max(v for key, v in row.items() if key.startswith("rel_diff_"))
    if not worst <= MISMATCH_REL:
        row["mismatch"] = f"ours and the artifact's differ by {worst:.3g} of the largest value: not timed"
        return row
    dense_ms = dense["ms_dense_fwd"] + dense["ms_dense_bwd"]
    for name, fn in (("ours", ours), ("artifact", theirs)):
        fwd, bwd = fwd_bwd_ms(fn, q, k, v, timer)
        row[f"ms_{name}_fwd"], row[f"ms_{name}_bwd"] = fwd, bwd
        row[f"speedup_{name}_vs_dense_fwd_bwd"] = dense_ms / (fwd + bwd)
    # > 1: ours is faster
    row["ours_vs_artifact_fwd"] = row["ms_artifact_fwd"] / row["ms_ours_fwd"]
    row["ours_vs_artifact_bwd"] = row["ms_artifact_bwd"] / row["ms_ours_bwd"]
    row["ours_vs_artifact_fwd_bwd"] = ((row["ms_artifact_fwd"] + row["ms_artifact_bwd"])
                                       / (row["ms_ours_fwd"] + row["ms_ours_bwd"]))
    return row


def print_rows(rows: List[Dict]) -> None:
    print(f"{'S':>7} {'G':>4} {'sp':>6} {'ours f/b':>15} {'artifact f/b':>15} {'cuDNN f/b':>15} "
          f"{'x fwd':>6} {'x bwd':>6} {'x f+b':>6} {'diff':>7}")
    for r in rows:
        if "mismatch" in r:
            print(f"{r['S']:>7} {r['G']:>4} {r['sparsity']:>6.3f} {r['mismatch']}")
            continue
        worst = max(v for key, v in r.items() if key.startswith("rel_diff_"))
        print(f"{r['S']:>7} {r['G']:>4} {r['sparsity']:>6.3f} {r['ms_ours_fwd']:>7.2f}/{r['ms_ours_bwd']:<7.2f} "
              f"{r['ms_artifact_fwd']:>7.2f}/{r['ms_artifact_bwd']:<7.2f} {r['ms_dense_fwd']:>7.2f}/"
              f"{r['ms_dense_bwd']:<7.2f} {r['ours_vs_artifact_fwd']:>6.2f} {r['ours_vs_artifact_bwd']:>6.2f} "
              f"{r['ours_vs_artifact_fwd_bwd']:>6.2f} {worst:>7.4f}")


def plot_rows(rows: List[Dict], path: str) -> None:
    """ours / artifact (fwd, bwd, fwd+bwd; > 1: ours faster) per (S, G), and both against same-run cuDNN."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if "mismatch" not in r), key=lambda r: (r["S"], r["G"]))
    labels = [f"{r['S'] // 1024}K\nG={r['G']}" for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(rows) * 2), 4.5))
    for i, (key, name) in enumerate([("fwd", "fwd"), ("bwd", "bwd"), ("fwd_bwd", "fwd+bwd")]):
        a.bar([j + (i - 1) * 0.27 for j in x], [r[f"ours_vs_artifact_{key}"] for r in rows], 0.27, label=name)
    a.axhline(1.0, color="k", lw=0.8)
    a.set_title("ours vs the DSV artifact (its ms / ours; > 1: ours faster)", fontsize=9)
    for i, who in enumerate(("ours", "artifact")):
        b.bar([j + (i - 0.5) * 0.4 for j in x], [r[f"speedup_{who}_vs_dense_fwd_bwd"] for r in rows], 0.4, label=who)
    b.axhline(1.0, color="k", lw=0.8)
    b.set_title("fwd+bwd speedup over same-run cuDNN", fontsize=9)
    for ax in (a, b):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("token lists (video-shaped), D = 128, H = 16, bf16, ~90% sparse", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def join(paths: List[str], out_dir: str | None) -> Path:
    """One JSON (and PNG) from several calls' JSONs of one GPU; each row keeps the date of its call."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    gpus = {d["meta"].get("gpu") for d in docs}
    if len(gpus) != 1:
        raise ValueError(f"--join: the files name {len(gpus)} GPUs ({sorted(map(str, gpus))}); join one GPU's calls")
    rows = [dict(r, call_date=d["meta"].get("date")) for d in docs for r in d["rows"]]
    meta = dict(docs[0]["meta"], joined_from=[dict(file=os.path.basename(p), date=d["meta"].get("date"),
                                                   commit=d["meta"].get("commit")) for p, d in zip(paths, docs)])
    path = write_results("artifact_compare", rows, out_dir, meta)
    plot_rows(rows, str(path.with_suffix(".png")))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact-dir", default=None, help="root of a checkout of NetX-lab/DSV at branch ae")
    ap.add_argument("--groups", type=_ints, default=[32, 64, 128], help="query group sizes (multiples of 32)")
    ap.add_argument("--seq-lens", type=_seq_lens, default=[65536], help="e.g. 16K,64K")
    ap.add_argument("--sparsities", type=_floats, default=[0.9])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--join", nargs="+", default=None, metavar="JSON",
                    help="join these calls' results into one JSON and PNG (no GPU, no artifact needed)")
    args = ap.parse_args(argv)
    if args.join:
        path = join(args.join, args.out)
        print(f"wrote {path} and its PNG")
        return 0
    if not args.artifact_dir:
        raise SystemExit("bench_artifact.py: --artifact-dir is required (the root of a checkout of NetX-lab/DSV "
                         "at branch ae), unless --join")
    check_groups(args.groups)
    for S in args.seq_lens:
        check_seq_len(S)
    artifact = load_artifact(args.artifact_dir)
    if not torch.cuda.is_available():
        raise SystemExit("bench_artifact.py times CUDA kernels: no GPU here")
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
    plot_rows(rows, str(path.with_suffix(".png")))
    print_rows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

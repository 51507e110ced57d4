"""Plots of the committed GPU results (PNG next to each JSON in benchmarks/results/).

    python benchmarks/plot_results.py [--results benchmarks/results]

- ``topk_estimation-*.png``: selection time against S (log-log) per backend and granularity, with
  the same-run dense fwd+bwd of the layer and 2.5% of it (the issue's budget for selection).
- ``sparse_attention-*.png``: sparse over cuDNN speedup against sparsity, forward and backward.
- ``recall-*.png``: per layer, recall of the theta critical mass, exact sparsity and the budget
  density the dispatcher used.
- ``recall_trajectory-*.png``: over training steps, mean over layers of the exact sparsity (last
  profile), the budget density, the recall of the built lists and the share of layers running sparse.
Only files that exist are plotted; nothing is measured here.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(path):
    with open(path) as f:
        data = json.load(f)
    return data.get("meta", {}), data.get("rows", [])


def _title(meta, what):
    return f"{what} - {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, commit {meta.get('commit', '?')}"


def plot_topk(path):
    meta, rows = _load(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if "ms_select" in r:
            series.setdefault(f"{r['backend']} {r['granularity']}", []).append((r["S"], r["ms_select"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    dense = sorted({(r["S"], r["ms_dense_fwd"] + r["ms_dense_bwd"]) for r in rows if "ms_dense_fwd" in r})
    if dense:
        ax.plot([d[0] for d in dense], [d[1] for d in dense], "k--", label="dense fwd+bwd (cuDNN)")
        ax.plot([d[0] for d in dense], [0.025 * d[1] for d in dense], "k:", label="2.5% of dense")
    G = rows[0].get("G", "?") if rows else "?"
    ax.set(xscale="log", yscale="log", xlabel="sequence length S", ylabel="ms",
           title=_title(meta, f"top-k estimation, G={G}"))
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_sparse(path):
    meta, rows = _load(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if "speedup_fwd" in r and r.get("G", r.get("group_size")) == 128:
            key = (r["S"], r["granularity"])
            series.setdefault(key, []).append((r["sparsity"], r["speedup_fwd"], r.get("speedup_bwd")))
    for (S, gran), pts in sorted(series.items()):
        pts.sort()
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"S={S} {gran} fwd")
        if all(p[2] is not None for p in pts):
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=line.get_color(), label=f"S={S} {gran} bwd")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="sparsity", ylabel="speedup over cuDNN (same run)", title=_title(meta, "sparse attention, G=128"))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    return fig


def _by_input(rows):
    """{predictor input: its rows}, inputs sorted."""
    out = {}
    for r in rows:
        out.setdefault(r.get("predictor_input", "?"), []).append(r)
    return dict(sorted(out.items()))


def plot_recall(path):
    meta, rows = _load(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for inp, mine in _by_input(rows).items():
        mine = sorted(mine, key=lambda r: r["layer"])
        layers = [r["layer"] for r in mine]
        ax.plot(layers, [r["recall"] for r in mine], "o-", label=f"recall ({inp})")
        ax.plot(layers, [r["sparsity"] for r in mine], "s--", label=f"exact sparsity at theta ({inp})")
        if all("budget_density" in r for r in mine):
            ax.plot(layers, [r["budget_density"] for r in mine], "^:", label=f"budget density ({inp})")
    if rows:
        r0 = rows[0]
        depth = f" {r0['layers']} layers" if r0.get("layers") else ""
        what = (f"recall, {r0.get('preset')}{depth} S={r0.get('S')} {r0.get('granularity')} "
                f"cube {r0.get('cube')} rule {r0.get('budget_rule', 'sparsity')}")
    else:
        what = "recall"
    return _unit_axes(fig, ax, meta, what, "layer")


def _unit_axes(fig, ax, meta, what, xlabel):
    """Shared finish of the recall plots: values in [0, 1] with the 0.95 recall target dotted."""
    ax.axhline(0.95, color="k", lw=0.8, ls=":")
    ax.set(xlabel=xlabel, ylim=(0, 1.02), title=_title(meta, what))
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return fig


def plot_trajectory(path):
    meta, rows = _load(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for inp, mine in _by_input(rows).items():
        by_step = {}
        for r in mine:
            by_step.setdefault(r["step"], []).append(r)
        steps = sorted(by_step)
        mean = lambda key: [sum(float(r[key]) for r in by_step[s]) / len(by_step[s]) for s in steps]  # noqa: E731
        ax.plot(steps, mean("sparsity_measured"), "-", label=f"exact sparsity at theta ({inp})")
        ax.plot(steps, mean("budget_density"), ":", label=f"budget density ({inp})")
        ax.plot(steps, mean("recall"), "-", label=f"recall of the built lists ({inp})")
        ax.plot(steps, mean("sparse"), "--", label=f"share of layers sparse ({inp})")
        switch = next((s for s in steps if by_step[s][0].get("stage") == 2), None)
        if switch is not None:
            ax.axvline(switch, color="gray", lw=0.8)
    return _unit_axes(fig, ax, meta, "DSV over training",
                      "training step (mean over layers; grey: first stage-2 profile)")


# first matching prefix wins: the longer one first
PLOTTERS = {"topk_estimation": plot_topk, "sparse_attention-h200": plot_sparse,
            "recall_trajectory": plot_trajectory, "recall": plot_recall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    written = []
    for path in sorted(glob.glob(os.path.join(args.results, "*.json"))):
        name = os.path.basename(path)
        fn = next((f for prefix, f in PLOTTERS.items() if name.startswith(prefix)), None)
        if fn is None:
            continue
        fig = fn(path)
        out = path[:-5] + ".png"
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
        print(f"wrote {out}")
    return written


if __name__ == "__main__":
    main()

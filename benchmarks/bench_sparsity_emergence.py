"""Does attention become sparse? The exact theta=0.9 sparsity of every layer over training, per arm.

Each arm (``benchmarks/video_runs.py`` documents the ``key=value`` syntax) trains the video DiT with
DSV attention on one data source at one sequence length, and every profile (``--profile-every``
steps) measures each layer's exact sparsity on sampled queries (the profiler's oracle, never the
predictor). Arms differ in data (synthetic panning textures, ViZDoom, ALE), tokens, QK-norm,
learning rate and RoPE base. DSV's stage 2 starts at ``stage1`` steps, so the same runs also show
how many layer-steps the dispatcher ran sparse and the recall of the lists it used.

Writes ``benchmarks/results/sparsity_emergence-<gpu>-<yyyymmdd>.json`` (rows: ``arm``, ``data``,
``S``, ``preset``, ``layers``, ``step``, ``sparsity_mean``, per-layer ``sparsity``, ``stage``,
``recall``, ``sparse_layers``; one ``final`` row per arm with the run's summary) and a PNG of mean
and best-layer sparsity over steps per arm. The JSON is rewritten after every arm, so a run cut
short keeps what it measured.

    PYTHONPATH=. python benchmarks/bench_sparsity_emergence.py --quick              # CPU check
    PYTHONPATH=. python benchmarks/bench_sparsity_emergence.py \\
        --arm data=vizdoom,frames=32,res=256,steps=2000,minutes=4 --arm data=ale,frames=32,res=256  # H200
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_dist, write_results  # noqa: E402
from benchmarks.video_runs import add_run_args, layer_sparsity, parse_arm, tokens_of, train_arm  # noqa: E402
from megatron_dsv.attention import dsv_metrics  # noqa: E402

QUICK_ARMS = ("data=synthetic,frames=4,res=64,steps=12,stage1=6,minutes=2",
              "data=ale,frames=4,res=64,steps=12,stage1=6,minutes=2")


def _row(arm, args, step, model) -> dict:
    m = dsv_metrics(model)
    sp = layer_sparsity(model)
    n = len(sp)
    return dict(bench="sparsity_emergence", arm=arm["label"], data=arm["data"], S=tokens_of(arm),
                frames=arm["frames"], res=arm["res"], preset=args.preset, layers=n, samples=args.samples, lr=arm["lr"],
                qk_norm=arm["qk_norm"], rope=arm["rope"], step=step, stage=int(m["dsv/stage"]),
                sparsity_mean=sum(sp) / n, sparsity_max=max(sp), sparsity=sp,
                sparsity_smoothed=m["dsv/sparsity_mean"], budget_density=m["dsv/budget_density_mean"],
                recall=m["dsv/recall_mean"], sparse_layers=round(m["dsv/sparse_fraction"] * n),
                predictor_loss=m["dsv/predictor_loss"])


def plot(rows, path):
    """Mean (solid) and best-layer (dashed) exact sparsity over steps, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    arms = list(dict.fromkeys(r["arm"] for r in rows if r.get("kind") == "profile"))
    for i, name in enumerate(arms):
        mine = [r for r in rows if r["arm"] == name and r.get("kind") == "profile"]
        color = f"C{i % 10}"
        ax.plot([r["step"] for r in mine], [r["sparsity_mean"] for r in mine], color=color, label=name)
        ax.plot([r["step"] for r in mine], [r["sparsity_max"] for r in mine], color=color, ls="--", lw=0.8)
    ax.axhline(0.8, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("exact sparsity at theta = 0.9 (mean; dashed: best layer)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stop(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--arm", action="append", default=[], help="an arm (repeatable; video_runs.py has the keys)")
    ap.add_argument("--tag", default="", help="suffix of the result file name (sparsity_emergence<tag>-...)")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, two small arms")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.samples, args.val_samples = "tiny", 2, 4, 1
        args.profile_every, args.log_every, args.val_every, args.warmup = 3, 6, 6, 2
        args.arm = args.arm or list(QUICK_ARMS)
    if not args.arm:
        ap.error("give at least one --arm (or --quick)")
    arms = [parse_arm(a) for a in args.arm]
    for arm in arms:
        if arm["attn"] != "dsv":
            ap.error(f"the study measures DSV's profiler: arm {arm['label']!r} must have attn=dsv")
    init_dist()
    signal.signal(signal.SIGTERM, _stop)
    rows, bench = [], "sparsity_emergence" + args.tag
    try:
        for arm in arms:
            def on_profile(step, model, arm=arm):
                rows.append(dict(kind="profile", **_row(arm, args, step, model)))

            model, _, summary = train_arm(arm, args, on_profile=on_profile)
            rows.append({"kind": "final", **_row(arm, args, summary["steps"], model), **summary})
            print(f"== {arm['label']}: {summary['steps']} steps, sparsity {summary['sparsity_mean']:.3f} "
                  f"(best layer {max(layer_sparsity(model)):.3f}), sparse layer-steps "
                  f"{summary['sparse_layer_fraction']:.2f}, recall {summary['recall']:.3f}, "
                  f"val loss {summary['val_loss']:.4f}", flush=True)
            path = write_results(bench, rows, args.out_dir)
            del model
    finally:
        if rows:
            path = write_results(bench, rows, args.out_dir)
            try:
                plot(rows, str(path).replace(".json", ".png"))
            except ImportError as err:
                print(f"no plot ({err}): pip install -e '.[plots]'")
            print("wrote", path)


if __name__ == "__main__":
    main()

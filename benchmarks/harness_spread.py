"""How precisely a quality harness resolves an arm against full attention: the seed spread of studies that differ
only in their harness (learning-rate schedule, batch, EMA), read from their trained curves.

Each ``--study NAME=SAVE_DIR`` is a ``bench_quality --launch`` save-dir (its ``curves/<arm>-s<seed>.json``). Per
study and validation step, over the seeds every run of the study reached:

* full attention's loss: mean and sd over seeds, in % of the mean (what an unpaired comparison fights);
* per other arm, the paired delta ``100 (arm / full - 1)`` seed by seed: mean, sd and se, and the seeds the 0.5% se
  target takes at that sd (:func:`benchmarks.quality_report.seeds_for_se`).

    PYTHONPATH=. python benchmarks/harness_spread.py --study const=runs/cpu-cool-const --study wsd=runs/cpu-cool-wsd \
        --out benchmarks/results/harness-spread-cpu-20261205.json --plot

The JSON has one row per (study, arm, step); the plot shows both sds against the step, one line per study. With
``--by-class``, rows of ``kind: by_class`` too: at each study's last common step, each arm's paired delta per class
(footage: per source video) and per timestep, from the curves' ``val_breakdown`` (runs that recorded one), so a
spread can be traced to the videos or noise levels it comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.quality_report import (SE_TARGET_PCT, check_one_harness, check_one_schedule,  # noqa: E402
                                      load_records, mean_se, seeds_for_se)


def load_study(save_dir: str):
    """``({arm: {seed: {step: val_loss}}}, schedule, {arm: {seed: {step: breakdown}}}, harness)`` of a study's curves
    (the breakdowns: :func:`benchmarks.video_runs.val_breakdown`, where the run recorded them; the harness: batch,
    fixed init and order, :func:`benchmarks.quality_report.harness_of`): refused when its runs mix learning-rate
    schedules, batches, initial weights or clip orders (:func:`benchmarks.quality_report.check_one_schedule`,
    ``check_one_harness``)."""
    records = load_records(argparse.Namespace(save_dir=save_dir, at_step=None))
    schedule = check_one_schedule(records)
    harness = check_one_harness(records)
    curves = {arm: {seed: dict(rec["curve"]) for seed, rec in runs.items()} for arm, runs in records.items()}
    parts = {arm: {seed: {int(k): v for k, v in rec.get("val_breakdown", {}).items()} for seed, rec in runs.items()}
             for arm, runs in records.items()}
    return curves, schedule, parts, harness


def _flat(breakdown: dict) -> Dict[str, float]:
    """A breakdown's parts by name: each class's, then ``t=0.1`` .. ``t=0.9``."""
    return {**breakdown["by_class"], **{f"t={0.1 + 0.2 * i:.1f}": v for i, v in enumerate(breakdown["by_t"])}}


def class_rows(name: str, parts: Dict[str, Dict[int, Dict[int, dict]]]) -> List[dict]:
    """Per arm but full, at the last step where it and full attention both hold a breakdown for every common seed:
    the paired delta ``100 (arm / full - 1)`` of each class's loss and each timestep's (mean, sd, per seed)."""
    full, rows = parts.get("full", {}), []
    for arm, runs in sorted(parts.items()):
        seeds = sorted(s for s in set(runs) & set(full) if runs[s] and full[s])
        steps = sorted(set.intersection(*(set(runs[s]) & set(full[s]) for s in seeds))) if seeds else []
        if arm == "full" or not steps:
            continue
        step = steps[-1]
        a = {s: _flat(runs[s][step]) for s in seeds}
        f = {s: _flat(full[s][step]) for s in seeds}
        for part in f[seeds[0]]:
            paired = [100.0 * (a[s][part] / f[s][part] - 1.0) for s in seeds]
            mean, se = mean_se(paired)
            rows.append(dict(kind="by_class", study=name, arm=arm, step=step, seeds=seeds, part=part,
                             full_loss=sum(f[s][part] for s in seeds) / len(seeds), delta_pct=mean,
                             delta_sd_pct=se * math.sqrt(len(paired)) if len(paired) > 1 else None,
                             delta_per_seed=dict(zip(seeds, paired))))
    return rows


def _sd_pct(xs: List[float]) -> float:
    mean, se = mean_se(xs)
    return 100.0 * se * math.sqrt(len(xs)) / mean


def spread_rows(name: str, study: Dict[str, Dict[int, Dict[int, float]]], schedule=None,
                harness: Optional[dict] = None) -> List[dict]:
    """One row per (arm, step) over the seeds that every arm of the study validated at that step."""
    full = study["full"]
    rows = []
    for arm, runs in sorted(study.items()):
        seeds = sorted(set(runs) & set(full))
        steps = sorted(set.intersection(*(set(runs[s]) & set(full[s]) for s in seeds))) if seeds else []
        for step in steps:
            f = [full[s][step] for s in seeds]
            row = dict(study=name, arm=arm, step=step, seeds=seeds, full_loss=sum(f) / len(f),
                       full_sd_pct=_sd_pct(f) if len(f) > 1 else None, schedule=schedule, **(harness or {}))
            if arm != "full":
                paired = [100.0 * (runs[s][step] / full[s][step] - 1.0) for s in seeds]
                mean, se = mean_se(paired)
                row.update(delta_pct=mean, delta_se_pct=se if len(paired) > 1 else None,
                           delta_sd_pct=se * math.sqrt(len(paired)) if len(paired) > 1 else None,
                           seeds_for_se_target=seeds_for_se(paired), delta_per_seed=dict(zip(seeds, paired)))
            rows.append(row)
    return rows


def plot(rows: List[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for study in sorted({r["study"] for r in rows}):
        full = [r for r in rows if r["study"] == study and r["arm"] == "full" and r["full_sd_pct"] is not None]
        axes[0].plot([r["step"] for r in full], [r["full_sd_pct"] for r in full], marker="o", label=study)
        for arm in sorted({r["arm"] for r in rows if r["study"] == study and r["arm"] != "full"}):
            pts = [r for r in rows if r["study"] == study and r["arm"] == arm and r["delta_sd_pct"] is not None]
            axes[1].plot([r["step"] for r in pts], [r["delta_sd_pct"] for r in pts], marker="o",
                         label=f"{study}: {arm} - full")
    axes[0].set_title("full attention's seed spread (sd, % of its mean loss)")
    axes[1].set_title("paired delta's seed spread (sd, % of full's loss)")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", action="append", required=True, metavar="NAME=SAVE_DIR",
                    help="a study to compare (repeat): its name and its bench_quality --save-dir")
    ap.add_argument("--out", default=None, help="write the rows (and with --plot a PNG beside) here")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--note", default=None, help="kept in the JSON's meta")
    ap.add_argument("--by-class", action="store_true",
                    help="also each arm's paired delta per class and per timestep at the last common step")
    args = ap.parse_args(argv)
    rows, by_class = [], []
    for spec in args.study:
        if "=" not in spec:
            raise SystemExit(f"harness_spread: --study takes NAME=SAVE_DIR, got {spec!r}")
        name, save_dir = spec.split("=", 1)
        study, schedule, parts, harness = load_study(save_dir)
        rows += spread_rows(name, study, schedule=schedule, harness=harness)
        if args.by_class:
            by_class += class_rows(name, parts)
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print(f"{'study':10s} {'arm':10s} {'step':>5s} {'seeds':>5s} {'full loss':>9s} {'full sd%':>8s} "
          f"{'delta%':>7s} {'sd%':>6s} {'se%':>6s} {f'seeds@{SE_TARGET_PCT:g}':>8s}")
    for r in rows:
        print(f"{r['study']:10s} {r['arm']:10s} {r['step']:5d} {len(r['seeds']):5d} {r['full_loss']:9.4f} "
              f"{fmt(r['full_sd_pct'], '8.2f')} {fmt(r.get('delta_pct'), '+7.2f')} {fmt(r.get('delta_sd_pct'), '6.2f')} "
              f"{fmt(r.get('delta_se_pct'), '6.2f')} {fmt(r.get('seeds_for_se_target'), '8d')}")
    if by_class:
        print(f"\n{'study':10s} {'arm':18s} {'step':>5s} {'part':18s} {'full loss':>9s} {'delta%':>7s} {'sd%':>6s}  per seed")
    for r in by_class:
        print(f"{r['study']:10s} {r['arm']:18s} {r['step']:5d} {r['part']:18s} {r['full_loss']:9.4f} "
              f"{r['delta_pct']:+7.2f} {fmt(r['delta_sd_pct'], '6.2f')}  "
              + " ".join(f"s{s}:{d:+.1f}" for s, d in r["delta_per_seed"].items()))
    if args.out:
        from benchmarks.common import collect_meta

        meta = collect_meta()
        if args.note:
            meta["note"] = args.note
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows + by_class}, f, indent=1)
        print("wrote", args.out)
        if args.plot:
            print("wrote", plot(rows, args.out.rsplit(".", 1)[0] + ".png"))


if __name__ == "__main__":
    main()

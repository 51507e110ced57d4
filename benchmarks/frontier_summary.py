"""The quality frontier over every committed study: one table and one plot, so a user can pick their own point.

Each session's study writes its own results JSON (``bench_quality --report``: its arms, its seeds, its steps), and
``join_seeds.py`` joins one arm's seeds across sessions. This reads them all (default: every
``quality-frontier-*.json`` and ``quality-joined-*.json`` under benchmarks/results) and keeps, for each data source,
length, arm and step count, the comparison with the most seeds (ties: the newest file). Every row is paired against
full attention *of its own study* (same seeds, same harness), so rows from harnesses that changed between sessions
(validation set, clips, EMA) stay comparable as differences, not as losses.

    PYTHONPATH=. python benchmarks/frontier_summary.py --out benchmarks/results/quality-frontier-summary-20261208

writes ``<out>.json`` (the rows, the library default's rows and why it is the default) and ``<out>.png``: per data
source, validation loss against full attention (%, mean +- se over seeds) against the kept fraction of keys; colour
= tokens per sample, marker = family (the library default, the window, the paper's rule, other DSV arms).
Nothing is measured here.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_quality import FRONTIER  # noqa: E402
from benchmarks.common import collect_meta  # noqa: E402
from benchmarks.quality_report import SE_TARGET_PCT, harness_of  # noqa: E402
from benchmarks.video_runs import schedule_key  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_ARM = "s1win_cap25_s400"  # the default's design, by name, in every study since run 11
SETTING_KEYS = ("attn", "budget_rule", "recall_target", "granularity", "local_radius", "local_mode", "stage1",
                "query_group_shape", "stage1_local", "sparsity_threshold", "max_density", "window_frac")
COLUMNS = ("data", "S", "name", "steps", "schedule", "batch", "init_seed", "order_seed", "seeds", "gpu",
           "delta_vs_full_pct", "delta_vs_full_se_pct", "kept_fraction", "sparse_layer_fraction", "recall",
           "time_to_full_loss_ratio", "time_to_full_loss_ratio_logged", "library_default", "settings", "source", "note")


def _finite(x) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def is_default(row: dict) -> bool:
    """A row of the library's default design: ``s1win_cap25_s400`` (its name since run 11), or bench_quality's
    ``default`` arm where its report marked it the library default at today's stage switch (older ``default`` rows
    were other designs)."""
    return row["name"] == DEFAULT_ARM or (row["name"] == "default" and bool(row.get("library_default"))
                                          and row.get("stage1") == DSVConfig().stage_switch_steps)


def settings_of(row: dict) -> str:
    """The arm's settings as its study recorded them (not today's FRONTIER entry of the same name)."""
    return ",".join(f"{k}={row[k]}" for k in SETTING_KEYS if row.get(k) not in (None, ""))


def schedule_of(row: dict) -> str:
    """The study's learning-rate schedule: ``"constant"`` (every study before run 30, and reports that recorded
    ``{"constant": true}``) or ``"cooldown <f>"``, the decayed share of the steps (``--lr-cooldown``)."""
    sch = row.get("lr_schedule")
    if schedule_key(sch) == "constant":  # also None and {"constant": true}: no decay_end past decay_start
        return "constant"
    return f"cooldown {(sch['decay_end'] - sch['decay_start']) / sch['decay_end']:.2g}"


def family(row: dict) -> str:
    """The arm's family on the plot: the default, the 3D window, the paper's rule alone, or another DSV arm."""
    name = row["name"]
    if row["library_default"]:
        return "library default"
    if name.startswith("window"):
        return "3D window"
    if name in ("paper", "control"):
        return name
    return "other DSV arm"


def study_rows(path: str) -> List[dict]:
    """The arm rows of one ``bench_quality --report`` JSON (full attention itself and rows without a delta left out)."""
    with open(path) as f:
        doc = json.load(f)
    meta = doc.get("meta", {})
    out = []
    for row in doc.get("rows", []):
        name = row.get("name")
        if (not isinstance(name, str) or name == "full" or _finite(row.get("delta_vs_full_pct")) is None
                or not row.get("seeds") or not row.get("steps")):  # full itself; a bare per-seed retrain check
            continue
        out.append(dict(
            data=row["data"], S=int(row["S"]), name=name, steps=row.get("steps"), schedule=schedule_of(row),
            **harness_of(row),
            seeds=list(row.get("seeds") or []),
            gpu=meta.get("gpu"), delta_vs_full_pct=row["delta_vs_full_pct"],
            delta_vs_full_se_pct=_finite(row.get("delta_vs_full_se_pct")),
            kept_fraction=_finite(row.get("kept_fraction")),
            sparse_layer_fraction=_finite(row.get("sparse_layer_fraction")),
            recall=_finite(row.get("recall")), time_to_full_loss_ratio=_finite(row.get("time_to_full_loss_ratio")),
            time_to_full_loss_ratio_logged=_finite(row.get("time_to_full_loss_ratio_logged")),
            library_default=is_default(row), settings=settings_of(row),
            source=os.path.basename(path), note=meta.get("note", ""), date=meta.get("date", "")))
    return out


def joined_row(path: str, studies: Dict[str, List[dict]]) -> Optional[dict]:
    """A ``join_seeds.py`` result as a row; data, length, kept fraction etc. from its source studies' rows."""
    with open(path) as f:
        doc = json.load(f)
    res, meta = doc.get("result") or {}, doc.get("meta", {})
    per_seed = res.get("per_seed", [])
    files = sorted({p["file"] for p in per_seed})
    src = [r for f in files for r in studies.get(f, [])  # the rows that hold a joined seed of this file
           if r["name"] == res.get("arm") and any(p["file"] == f and p["seed"] in r["seeds"] for p in per_seed)]
    if not src or len({(r["data"], r["S"]) + harness_key(r)[1:] for r in src}) != 1:
        return None  # sources not committed, or an arm joined across data, lengths or harnesses: not one point

    def mean_of(key):
        vals = [r[key] for r in src if r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    gpus = sorted({p.get("gpu") for p in res["per_seed"] if p.get("gpu")})
    return dict(
        data=src[0]["data"], S=src[0]["S"], name=res["arm"], steps=res["step"], schedule=src[0]["schedule"],
        batch=src[0]["batch"], init_seed=src[0]["init_seed"], order_seed=src[0]["order_seed"],
        seeds=list(res["seeds"]),
        gpu=" + ".join(gpus), delta_vs_full_pct=res["delta_vs_full_pct"],
        delta_vs_full_se_pct=res.get("delta_vs_full_se_pct"),
        kept_fraction=mean_of("kept_fraction"), sparse_layer_fraction=mean_of("sparse_layer_fraction"),
        recall=mean_of("recall"), time_to_full_loss_ratio=None, time_to_full_loss_ratio_logged=None,
        library_default=all(r["library_default"] for r in src), settings=src[0]["settings"],
        source=os.path.basename(path),
        note="seeds joined across " + ", ".join(files), date=meta.get("date", ""))


def harness_key(row: dict) -> tuple:
    """What a row's comparison depends on besides its data, length and arm: steps, learning-rate schedule, batch,
    fixed initial weights and fixed clip order (None: the seed's own)."""
    return row["steps"], row["schedule"], row["batch"], row["init_seed"], row["order_seed"]


def best_rows(rows: List[dict]) -> List[dict]:
    """Per (data, S, arm, :func:`harness_key`): the row with the most seeds, ties to the newest."""
    best: Dict[tuple, dict] = {}
    for row in rows:
        key = (row["data"], row["S"], row["name"]) + harness_key(row)
        rank = (len(row["seeds"]), row["date"])
        if key not in best or rank > (len(best[key]["seeds"]), best[key]["date"]):
            best[key] = row
    return sorted(best.values(), key=lambda r: (r["data"], r["S"], r["name"], r["steps"] or 0, r["schedule"],
                                                r["batch"], -1 if r["init_seed"] is None else r["init_seed"],
                                                -1 if r["order_seed"] is None else r["order_seed"]))


def collect(paths: List[str]) -> List[dict]:
    studies = {os.path.basename(p): study_rows(p) for p in paths if "quality-frontier-" in os.path.basename(p)}
    rows = [r for rs in studies.values() for r in rs]
    rows += [r for p in paths if "quality-joined-" in os.path.basename(p) for r in [joined_row(p, studies)] if r]
    return best_rows(rows)


def default_rows(rows: List[dict]) -> List[dict]:
    """The library default's row per data source and length: most seeds, then the most clips trained on (steps x
    batch), then the constant rate every study but the cooldown checks (run 30) trained at, then each seed's own
    initial weights and clip order."""
    keys = sorted({(r["data"], r["S"]) for r in rows if r["library_default"]})
    return [max((r for r in rows if r["library_default"] and (r["data"], r["S"]) == key),
                key=lambda c: (len(c["seeds"]), (c["steps"] or 0) * c["batch"], c["schedule"] == "constant",
                               c["init_seed"] is None and c["order_seed"] is None)) for key in keys]


def default_verdict(rows: List[dict]) -> List[dict]:
    """The library default's point per data source and length (:func:`default_rows`), against the targets of
    issue 24: within 1.0% of full attention with se <= 0.5% over >= 2 seeds, >= 60% sparse layer-steps."""
    out = []
    for r in default_rows(rows):
        se = r["delta_vs_full_se_pct"]
        out.append(dict(data=r["data"], S=r["S"], steps=r["steps"], batch=r["batch"], seeds=len(r["seeds"]),
                        delta_vs_full_pct=round(r["delta_vs_full_pct"], 3), se_pct=None if se is None else round(se, 3),
                        at_most_1pct_above_full=r["delta_vs_full_pct"] <= 1.0,
                        se_target_met=se is not None and se <= SE_TARGET_PCT,
                        sparse_layer_fraction=r["sparse_layer_fraction"], source=r["source"]))
    return out


def _point(r: dict) -> str:
    se = "" if r["delta_vs_full_se_pct"] is None else f" +- {r['delta_vs_full_se_pct']:.2f}"
    kept = "" if r["kept_fraction"] is None else f", kept {r['kept_fraction']:.2f}"
    return f"{r['name']} {r['delta_vs_full_pct']:+.2f}{se}% ({len(r['seeds'])} seeds{kept})"


def _harness_label(r: dict) -> str:
    """What sets a row apart from the usual harness (constant rate, batch 1, each seed's own init and order), for
    labels."""
    parts = [p for p in (r["schedule"] if r["schedule"] != "constant" else "",
                         f"batch {r['batch']}" if r["batch"] != 1 else "",
                         f"init {r['init_seed']}" if r["init_seed"] is not None else "",
                         f"order {r['order_seed']}" if r["order_seed"] is not None else "") if p]
    return "".join(f", {p}" for p in parts)


def why_default(rows: List[dict]) -> str:
    """Why the default is the default, from the rows themselves (no figure written by hand): per data source and
    length, the default's point, and every other arm measured at the same steps that came out below it."""
    parts = []
    for mine in default_rows(rows):
        at = (mine["data"], mine["S"]) + harness_key(mine)
        peers = [r for r in rows if not r["library_default"] and (r["data"], r["S"]) + harness_key(r) == at]
        lower = sorted((r for r in peers if r["delta_vs_full_pct"] < mine["delta_vs_full_pct"]),
                       key=lambda r: r["delta_vs_full_pct"])
        text = f"{mine['data']} {mine['S'] // 1024}K @{mine['steps']}{_harness_label(mine)}: {_point(mine)}"
        if peers:
            text += f"; of {len(peers)} other arms at these steps, " + (
                "below it: " + ", ".join(_point(r) for r in lower) if lower else "none below it")
        parts.append(text)
    return ("vs full attention of each study at equal steps, the default's point with the most seeds per data "
            "source and length (arms below it are candidates only where their se and kept fraction hold up; "
            "benchmarks/NOTES_quality.md gives each run's reading): " + "; ".join(parts))


def plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datas = sorted({r["data"] for r in rows})
    lengths = sorted({r["S"] for r in rows})
    colours = dict(zip(lengths, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    markers = {"library default": "*", "3D window": "s", "paper": "^", "control": "D", "other DSV arm": "o"}
    fig, axes = plt.subplots(1, len(datas), figsize=(7.5 * len(datas), 6), squeeze=False)
    for ax, data in zip(axes[0], datas):
        for r in (r for r in rows if r["data"] == data and r["kept_fraction"] is not None):
            fam = family(r)
            ax.errorbar(r["kept_fraction"], r["delta_vs_full_pct"], yerr=r["delta_vs_full_se_pct"], capsize=3,
                        fmt=markers[fam], ms=12 if fam == "library default" else 6, color=colours[r["S"]])
            ax.annotate(f"{r['name']} @{r['steps']} ({len(r['seeds'])}{_harness_label(r)})",
                        (r["kept_fraction"], r["delta_vs_full_pct"]), fontsize=6, textcoords="offset points",
                        xytext=(5, 3))
        ax.axhline(0.0, color="k", lw=0.8)
        ax.axhspan(1.0, ax.get_ylim()[1] if ax.get_ylim()[1] > 1.0 else 1.5, color="r", alpha=0.06)
        ax.set_title(f"{data}: every arm against full attention of its own study", fontsize=9)
        ax.set_xlabel("kept fraction of keys at the end (1 = dense)")
        ax.set_ylabel("validation loss vs full attention (%, mean +- se over seeds; red: > +1%)")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker=m, color="gray", label=f) for f, m in markers.items()]
    handles += [plt.Line2D([], [], ls="", marker="o", color=c, label=f"{S // 1024}K tokens")
                for S, c in colours.items()]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle("DSV quality frontier (labels: arm @steps (seeds)); each point paired by seed with full attention",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="results JSONs (default: every quality-frontier-* and quality-joined-* "
                    "under benchmarks/results, the summary itself left out)")
    ap.add_argument("--out", required=True, help="path prefix of the summary (.json and .png are added)")
    args = ap.parse_args(argv)
    paths = args.files or sorted(
        p for p in glob.glob(os.path.join(RESULTS, "quality-*.json"))
        if re.match(r"quality-(frontier|joined)-", os.path.basename(p)) and "-summary-" not in p)
    rows = collect(paths)
    if not rows:
        raise SystemExit("frontier_summary: no arm rows in the files given")
    doc = dict(meta=dict(collect_meta(), sources=[os.path.basename(p) for p in paths]), default=dict(
        arm=DEFAULT_ARM, settings=FRONTIER[DEFAULT_ARM], points=default_verdict(rows),
        why=why_default(rows)),
        rows=[{k: r[k] for k in COLUMNS} for r in rows])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    plot(rows, args.out + ".png")
    print(f"{'data':8s} {'S':>6s} {'arm':22s} {'steps':>5s} {'schedule':>12s} {'batch (init)':>5s} {'n':>2s} "
          f"{'delta %':>8s} "
          f"{'se':>5s} "
          f"{'kept':>5s}")
    for r in rows:
        se = r["delta_vs_full_se_pct"]
        kept = r["kept_fraction"]
        fixed = ("" if r["init_seed"] is None else f" init {r['init_seed']}") + \
            ("" if r["order_seed"] is None else f" order {r['order_seed']}")
        print(f"{r['data']:8s} {r['S']:6d} {r['name'][:22]:22s} {r['steps'] or 0:5d} {r['schedule']:>12s} "
              f"{r['batch']:5d}{fixed} "
              f"{len(r['seeds']):2d} "
              f"{r['delta_vs_full_pct']:+8.2f} {'' if se is None else f'{se:.2f}':>5s} "
              f"{'' if kept is None else f'{kept:.2f}':>5s}")
    print(f"wrote {args.out}.json and {args.out}.png ({len(rows)} rows from {len(paths)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

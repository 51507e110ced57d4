"""One arm's seeds joined across quality-frontier results at one step: the paired delta to full attention.

Studies of one harness add seeds over several sessions (a session's device time trains a few). Each results JSON
(``bench_quality --report``) pairs the arm with full attention of the same seed; this reads, from every file given,
each seed's loss of the arm and of full attention at ``--step`` (from the row's ``curve_per_seed`` where the
report kept it, else its ``val_loss_per_seed`` when the row was compared at that step), pairs them within the file,
and reports the joined paired delta ``100 (arm / full - 1)``: per seed, mean +- se, sd and the seeds the 0.5% se
target takes at that sd. A seed found in two files is refused (the same seed trained twice is not two seeds), and
so are files of different harnesses (learning-rate schedule, batch, fixed initial weights or clip order).

    PYTHONPATH=. python benchmarks/join_seeds.py --arm s1win_cap25_s400 --step 3000 \\
        benchmarks/results/quality-frontier-run10-vizdoom-h200-20261203.json \\
        benchmarks/results/quality-frontier-run14-vizdoom-h100-20261205.json --out joined.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import collect_meta  # noqa: E402
from benchmarks.quality_report import SE_TARGET_PCT, harness_of, mean_se, seeds_for_se, unpaired_delta  # noqa: E402
from benchmarks.video_runs import schedule_key  # noqa: E402


def losses_at(row: dict, step: int) -> Dict[int, float]:
    """``{seed: validation loss at step}`` of one results row: every seed whose curve reached ``step``."""
    if row.get("curve_per_seed"):
        return {int(seed): dict((int(s), v) for s, v in curve)[step]
                for seed, curve in row["curve_per_seed"].items() if step in {int(s) for s, _ in curve}}
    if int(row.get("steps", -1)) == step:
        return {int(seed): float(v) for seed, v in row["val_loss_per_seed"].items()}
    return {}


def join(paths: List[str], arm: str, step: int) -> dict:
    """The joined comparison (see the module doc); raises ValueError naming the file and seed at fault."""
    seeds: List[dict] = []
    where: Dict[int, str] = {}
    harness: Dict[str, str] = {}  # the harness of each file's rows: seeds of different harnesses are not one sample
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        rows = {r["name"]: r for r in results["rows"] if r.get("kind") == "arm"}
        if arm not in rows or "full" not in rows:
            raise ValueError(f"{path}: needs rows 'full' and {arm!r}; has {sorted(rows)}")
        for row in (rows[arm], rows["full"]):
            harness.setdefault(json.dumps(dict(schedule=schedule_key(row.get("lr_schedule")), **harness_of(row)),
                                          sort_keys=True), path)
        if len(harness) > 1:
            raise ValueError("the files trained in different harnesses (learning-rate schedule, batch, initial "
                             "weights, clip order): " + "; ".join(f"{p}: {h}" for h, p in harness.items()))
        got, full = losses_at(rows[arm], step), losses_at(rows["full"], step)
        for seed in sorted(set(got) & set(full)):
            if seed in where:
                raise ValueError(f"seed {seed} of {arm!r} is in {where[seed]} and {path}: a seed counts once")
            where[seed] = path
            seeds.append(dict(seed=seed, file=os.path.basename(path), gpu=results["meta"].get("gpu"),
                              arm_loss=got[seed], full_loss=full[seed],
                              delta_pct=100.0 * (got[seed] / full[seed] - 1.0)))
    if not seeds:
        raise ValueError(f"no seed of {arm!r} and full attention reached step {step} in {paths}")
    deltas = [s["delta_pct"] for s in seeds]
    mean, se = mean_se(deltas)
    unpaired, unpaired_se = unpaired_delta([s["arm_loss"] for s in seeds], [s["full_loss"] for s in seeds])
    return dict(bench="quality_joined", arm=arm, step=step, seeds=sorted(where), per_seed=seeds,
                delta_vs_full_pct=mean, delta_vs_full_se_pct=se,
                delta_vs_full_sd_pct=se * math.sqrt(len(deltas)) if len(deltas) > 1 else None,
                delta_vs_full_unpaired_pct=unpaired, delta_vs_full_unpaired_se_pct=unpaired_se,
                seeds_for_se_target=seeds_for_se(deltas), se_target_pct=SE_TARGET_PCT)


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="quality-frontier results JSONs (bench_quality --report)")
    ap.add_argument("--arm", required=True, help="the arm to join (a row name, e.g. s1win_cap25_s400)")
    ap.add_argument("--step", type=int, required=True, help="the validation step every joined seed is read at")
    ap.add_argument("--out", default=None, help="write the joined JSON here")
    args = ap.parse_args(argv)
    result = join(args.files, args.arm, args.step)
    for s in result["per_seed"]:
        print(f"seed {s['seed']:3d}  {s['arm_loss']:.5f} vs full {s['full_loss']:.5f}  {s['delta_pct']:+7.2f}%  "
              f"({s['gpu']}, {s['file']})")
    print(f"{args.arm} at step {args.step}, {len(result['seeds'])} seeds: {result['delta_vs_full_pct']:+.2f} +- "
          f"{result['delta_vs_full_se_pct']:.2f}% paired (sd {result['delta_vs_full_sd_pct'] or float('nan'):.2f}%;"
          f" the 0.5% se takes {result['seeds_for_se_target']} seeds), unpaired "
          f"{result['delta_vs_full_unpaired_pct']:+.2f} +- {result['delta_vs_full_unpaired_se_pct']:.2f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=dict(collect_meta(), sources=args.files), result=result), f, indent=1)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()

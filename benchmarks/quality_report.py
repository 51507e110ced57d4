"""The quality frontier's report: what the trained curves and the timing say, per arm (``bench_quality --report``).

Per arm, at the last validation step its runs and full attention's runs of the same seeds all reached: the loss, its
difference to full attention (paired over seeds, and unpaired: the ratio of the means), the kept fraction, the share
of stage-2 layer-steps that ran sparse, recall; on the step times measured alone (``timing.json``), the wall-clock of
each validation point and the time to reach full attention's final loss at each timed length; and the plots (loss
vs step, vs wall-clock, the frontier of loss against kept fraction).
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Dict, List, Optional

from benchmarks.video_runs import parse_arm, schedule_key, tokens_of
from megatron_dsv.config import DSVConfig

def is_library_default(arm: dict) -> bool:
    """True when a DSV arm's lists and stage switch are the library's defaults as committed (DSVConfig) on its token
    grid. The harness switches by steps (``stage1``), as the default does; its profiler runs every
    ``--profile-every`` steps throughout, where the library's slows to ``profile_interval_after_warmup`` after
    ``profile_warmup_steps`` (1000): not compared."""
    if arm.get("attn") != "dsv":
        return False
    d = DSVConfig()
    if d.stage_switch_rule != "steps" or arm.get("stage1") != d.stage_switch_steps:
        return False
    if tuple(arm.get("query_group_shape", d.query_group_shape)) != d.query_group_shape:
        return False
    grid = (arm["frames"], arm["res"] // 8, arm["res"] // 8)
    local = DSVConfig(local_radius=arm.get("local_radius")).local_radius_for(grid)
    return (arm.get("gran") == d.granularity and arm.get("rule") == d.budget_rule
            and (d.budget_rule != "recall" or arm.get("recall") == d.recall_target)
            and arm.get("thr", d.sparsity_threshold) == d.sparsity_threshold and local == d.local_radius_for(grid)
            and (arm.get("cap") or None) == d.max_density and arm.get("lmode", "shared") == d.local_mode
            and DSVConfig(stage1_local_radius=arm.get("stage1_local_radius", (0, 0, 0))).stage1_radius_for(grid)
            == d.stage1_radius_for(grid))


def study_seeds(args) -> List[int]:
    """The study's seeds, ``--seeds`` (default 0, 1)."""
    return [int(x) for x in (args.seeds or "0,1").split(",") if x]


def load_records(args) -> Dict[str, Dict[int, dict]]:
    """Every run's curve under ``args.save_dir``, by arm and seed; with ``args.seeds`` set, those seeds' only."""
    records: Dict[str, Dict[int, dict]] = {}
    asked = None if getattr(args, "seeds", None) is None else set(study_seeds(args))
    for path in sorted(glob.glob(os.path.join(args.save_dir, "curves", "*.json"))):
        rec = json.load(open(path))
        rec["curve"] = [(int(s), float(v)) for s, v in rec["curve"]]
        rec["sparse_counts"] = {int(k): tuple(v) for k, v in rec.get("sparse_counts", {}).items()}
        rec["train_seconds"] = {int(k): tuple(v) for k, v in rec.get("train_seconds", {}).items()}
        if not rec["curve"]:
            print(f"report: {path} has no validation yet: left out", flush=True)
            continue
        if asked is not None and int(rec["seed"]) not in asked:
            continue  # --seeds names the seeds to report
        records.setdefault(rec["name"], {})[int(rec["seed"])] = rec
    if getattr(args, "at_step", None) is not None:
        records = cut_records(records, args.at_step)
    if "full" not in records:
        raise ValueError(f"no curves of arm 'full' under {args.save_dir}/curves: run --launch first")
    return records


CONSTANT_SCHEDULE = "constant after the warm-up (no schedule recorded: runs before --lr-cooldown)"


def check_one_schedule(records: Dict[str, Dict[int, dict]]) -> dict:
    """The learning-rate schedule every run of a study trained on (a curve without one was trained at a constant
    rate). Runs of different schedules are not compared: a cooldown alone moves the final loss by more than the
    differences measured here. Raises ValueError naming a run of each."""
    seen: Dict[str, str] = {}
    for name, runs in records.items():
        for seed, rec in runs.items():
            seen.setdefault(schedule_key(rec.get("schedule")), f"{name} seed {seed}")
    if len(seen) > 1:
        raise ValueError("report: the runs trained on different learning-rate schedules: " +
                         "; ".join(f"{run}: {CONSTANT_SCHEDULE if key == 'constant' else key}"
                                   for key, run in seen.items()) + " (report each study from its own --save-dir)")
    key = next(iter(seen))
    return {"constant": True} if key == "constant" else json.loads(key)


def harness_of(rec: dict) -> dict:
    """What a run's curve depends on besides its arm and schedule: ``batch`` (clips a step; 1 where a curve does not
    record it: every study until run 31 trained at the --batch default, 1), ``init_seed`` and ``order_seed`` (the
    initial weights' and the clip order's seeds where a study fixed them apart from the seed, else None), as
    :func:`benchmarks.video_runs.run_harness` wrote them."""
    return dict(batch=int(rec.get("batch") or 1), init_seed=rec.get("init_seed"), order_seed=rec.get("order_seed"))


def check_one_harness(records: Dict[str, Dict[int, dict]]) -> dict:
    """The :func:`harness_of` every run of a study shares; runs of different batches, init or order seeds are not
    compared (raises ValueError naming a run of each)."""
    seen: Dict[str, str] = {}
    for name, runs in records.items():
        for seed, rec in runs.items():
            seen.setdefault(json.dumps(harness_of(rec), sort_keys=True), f"{name} seed {seed}")
    if len(seen) > 1:
        raise ValueError("report: the runs trained in different harnesses: " +
                         "; ".join(f"{run}: {key}" for key, run in seen.items()) +
                         " (report each study from its own --save-dir)")
    return json.loads(next(iter(seen)))


def cut_records(records: Dict[str, Dict[int, dict]], step: int) -> Dict[str, Dict[int, dict]]:
    """Every run's curve and sparse counts up to ``step``, which every run must have validated at."""
    out: Dict[str, Dict[int, dict]] = {}
    for name, runs in records.items():
        for seed, rec in runs.items():
            if step not in dict(rec["curve"]):
                raise ValueError(f"--at-step {step}: run {name} seed {seed} has no validation there (its steps: "
                                 f"{[s for s, _ in rec['curve']]}); pick a step every run validated at")
            cut = dict(rec, curve=[(s, v) for s, v in rec["curve"] if s <= step],
                       sparse_counts={s: c for s, c in rec["sparse_counts"].items() if s <= step})
            out.setdefault(name, {})[seed] = cut
    return out


def equal_step(records: Dict[str, Dict[int, dict]]) -> int:
    """The last validation step every run (every arm, every seed) reached."""
    sets = [{s for s, _ in rec["curve"]} for runs in records.values() for rec in runs.values()]
    common = set.intersection(*sets) if sets else set()
    if not common:
        raise ValueError("the runs share no validation step; raise `minutes` or lower --val-every")
    return max(common)


def paired_step(runs: Dict[int, dict], full: Dict[int, dict]) -> int:
    """The last validation step an arm's runs and full attention's runs of the same seeds all reached: each
    arm is set against full attention at its own equal step (an arm stopped early by its minutes is compared
    where it stopped, never against a longer full run)."""
    seeds = [s for s in runs if s in full]
    if not seeds:
        raise ValueError(f"no seed in common with full attention (arm seeds {sorted(runs)}, full {sorted(full)})")
    return equal_step({"arm": {s: runs[s] for s in seeds}, "full": {s: full[s] for s in seeds}})


def mean_se(xs: List[float]):
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


SE_TARGET_PCT = 0.5  # issue 24: the se of (arm - full) / full at the end, in % of full attention's loss


def seeds_for_se(paired: List[float], target: float = SE_TARGET_PCT) -> Optional[int]:
    """Seeds a paired study needs for an se of ``target`` (%) at the spread its paired deltas show:
    ``ceil((sd / target)^2)``, at least 2; None with fewer than 2 deltas (no spread to go by)."""
    if len(paired) < 2:
        return None
    _, se = mean_se(paired)
    sd = se * math.sqrt(len(paired))
    return max(2, math.ceil((sd / target) ** 2 - 1e-9))


def unpaired_delta(arm: List[float], full: List[float]):
    """``(100 (mean(arm) / mean(full) - 1), its se)``: the arm's mean loss against full attention's over every
    seed each has, not seed by seed; the se by the delta method from the two means' standard errors (nan with fewer
    than 2 values on a side). The paired difference removes what a seed does to both runs, which holds while their
    trajectories stay together; an arm that moves its trajectory early (e.g. a windowed stage 1) decorrelates them,
    and then this is the honest comparison."""
    (ma, sa), (mf, sf) = mean_se(arm), mean_se(full)
    return 100.0 * (ma / mf - 1.0), 100.0 * math.sqrt(sa ** 2 / mf ** 2 + ma ** 2 * sf ** 2 / mf ** 4)


def wall_clock(curve, arm: dict, timing: Optional[dict], counts: Optional[Dict[int, tuple]] = None,
               sparse_share: Optional[float] = None) -> Optional[List[tuple]]:
    """(seconds of training, val loss) per validation point, from the arm's measured step times alone.

    A stage-1 step costs the arm's stage-1 time (every layer dense); a stage-2 step costs that plus the share of
    its layers that ran sparse times the saving of one sparse layer, ``(stage-2 time - stage-1 time) /
    stage2_sparse_share``: the stage-2 time is timed on the trained decisions, with ``stage2_sparse_share`` of
    the layers sparse (1 where the timing did not record it; 0: nothing is known of a sparse layer's cost, and
    the step is charged dense). The share comes, per interval between validations, from the
    run's cumulative ``counts`` ``{step: (sparse layer-steps, stage-2 layer-steps)}``; without them, from
    ``sparse_share`` (the run's share over its whole stage 2: optimistic, since layers turn sparse during
    stage 2, so the early steps are denser than the average). Neither given: every stage-2 step is charged as
    all-sparse (optimistic; what runs 3-5 reported before 2026-12-02 evening)."""
    if not timing:
        return None
    ms1, ms2 = timing["stage1"], timing["stage2"]
    timed_share = timing.get("stage2_sparse_share", 1.0)
    per_layer = (ms2 - ms1) / timed_share if timed_share > 0 else 0.0  # one sparse layer's share of the saving
    stage1 = arm["stage1"] if arm["attn"] == "dsv" else 0
    out, seconds, prev = [], 0.0, 0
    prev_counts = (0, 0)
    for s, v in curve:
        dense_steps = max(0, min(s, stage1) - min(prev, stage1))
        stage2_steps = max(0, s - max(prev, stage1))
        if counts is not None and s in counts:
            d_sparse, d_layers = counts[s][0] - prev_counts[0], counts[s][1] - prev_counts[1]
            share = d_sparse / d_layers if d_layers > 0 else 0.0
            prev_counts = tuple(counts[s])
        else:
            share = 1.0 if sparse_share is None else sparse_share
        seconds += (dense_steps * ms1 + stage2_steps * (ms1 + share * per_layer)) / 1e3
        out.append((seconds, v))
        prev = s
    return out


def time_to_reach(points: List[tuple], target: float) -> Optional[float]:
    """First time (linear between validation points) at which the loss is <= target; None if never."""
    prev = None
    for t, v in points:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def logged_wall_clock(runs: Dict[int, dict], curve: List[tuple]):
    """The wall-clock the runs logged (``train_seconds``: training seconds at each validation, validations left out,
    one-off compiles in), charged to ``curve`` (the arm's mean loss curve): ``(points, seeds, ms_per_step)`` with
    ``points`` = (seconds, loss) per validation step, the seconds the mean over the seeds that trained **alone** up to
    the curve's last step (no second worker on the machine: ``shared`` seconds 0 there), and ``ms_per_step`` =
    (step, mean ms a step over the interval ending there). ``(None, [], None)`` when no seed qualifies (runs before
    2026-12-06, or seeds that shared the GPU). Unlike :func:`wall_clock` (a timing phase's step times, charged per
    interval), nothing is modelled: what the arm took, steps and decisions as trained. The seeds that qualify may
    differ between arms (and from the seeds of the loss curve): step times vary little between seeds."""
    steps = [st for st, _ in curve]
    alone = []
    for seed, rec in sorted(runs.items()):
        logged = rec.get("train_seconds", {})
        if steps and all(st in logged for st in steps) and logged[steps[-1]][1] == 0:
            alone.append(seed)
    if not alone:
        return None, [], None
    secs = {st: sum(runs[seed]["train_seconds"][st][0] for seed in alone) / len(alone) for st in steps}
    points = [(secs[st], v) for st, v in curve]
    ms, prev_step, prev_s = [], 0, 0.0
    for st in steps:
        ms.append((st, 1e3 * (secs[st] - prev_s) / (st - prev_step)))
        prev_step, prev_s = st, secs[st]
    return points, alone, ms


def report(args, names: List[str]) -> List[dict]:
    records = load_records(args)
    schedule = check_one_schedule(records)  # refused when the study's runs mix schedules
    harness = check_one_harness(records)  # ... or batches, or initial weights
    timing_path = os.path.join(args.save_dir, "timing.json")
    timing = json.load(open(timing_path)) if os.path.exists(timing_path) else {}
    S = tokens_of(parse_arm(args.arm))
    full_seeds = records["full"]
    full_step = equal_step({"full": full_seeds})  # full attention's final loss: the time-to-loss target
    full_mean = sum(dict(rec["curve"])[full_step] for rec in full_seeds.values()) / len(full_seeds)
    rows = []
    for name in names:
        runs = records.get(name)
        if not runs:
            continue
        arm = runs[min(runs)]["arm"]
        step = paired_step(runs, full_seeds)
        runs = {seed: rec for seed, rec in runs.items() if seed in full_seeds}
        full_at = {seed: dict(full_seeds[seed]["curve"])[step] for seed in runs}
        at = {seed: dict(rec["curve"])[step] for seed, rec in runs.items()}
        paired = [100.0 * (at[s] / full_at[s] - 1.0) for s in at if s in full_at]
        delta, delta_se = mean_se(paired) if paired else (float("nan"), float("nan"))
        loss, loss_se = mean_se(list(at.values()))
        # full attention over every seed that reached this step, whether or not the arm has it
        full_all = [dict(rec["curve"])[step] for rec in full_seeds.values() if step in dict(rec["curve"])]
        unpaired, unpaired_se = unpaired_delta(list(at.values()), full_all)
        summaries = [rec.get("summary", {}) for rec in runs.values()]
        t_arm = (timing.get(name) or {}).get(str(S))
        mean_curve = _mean_curve([rec["curve"] for rec in runs.values()], full_step if name == "full" else 10**12)
        counts = _mean_counts(runs.values(), [st for st, _ in mean_curve])
        share = _mean([s.get("sparse_layer_fraction") for s in summaries])
        charge = dict(counts=counts, sparse_share=share if arm["attn"] == "dsv" else None)
        wc = wall_clock(mean_curve, arm, t_arm, **charge)
        # per timed length: the first time the mean curve reaches the target (full attention by the same rule)
        wc_by_S = {length: wall_clock(mean_curve, arm, t, **charge) if t else None
                   for length, t in (timing.get(name) or {}).items()}
        reach_by_S = {length: time_to_reach(w, full_mean) if w else None for length, w in wc_by_S.items()}
        logged, logged_seeds, logged_ms = logged_wall_clock(runs, mean_curve)
        row = dict(bench="quality_frontier", kind="arm", name=name, data=arm["data"], S=S, steps=step,
                   seeds=sorted(at), attn=arm["attn"], budget_rule=arm.get("rule"), recall_target=arm.get("recall"),
                   local_radius=arm.get("local"), local_mode=arm.get("lmode") if arm["attn"] == "dsv" else None,
                   granularity=arm.get("gran"), stage1=arm.get("stage1"),
                   query_group_shape=arm.get("query_group_shape") if arm["attn"] == "dsv" else None,
                   stage1_local=arm.get("s1local") if arm["attn"] == "dsv" else None,
                   sparsity_threshold=arm.get("thr") if arm["attn"] == "dsv" else None,
                   max_density=(arm.get("cap") or None) if arm["attn"] == "dsv" else None,
                   window_frac=arm.get("window_frac") if arm["attn"] == "window" else None,
                   library_default=is_library_default(arm),
                   val_loss=loss, val_loss_se=loss_se, val_loss_per_seed=at, val_loss_full=sum(full_at.values()) /
                   len(full_at), full_loss_target=full_mean, full_loss_target_step=full_step,
                   delta_vs_full_pct=delta, delta_vs_full_se_pct=delta_se,
                   delta_vs_full_sd_pct=delta_se * math.sqrt(len(paired)) if len(paired) > 1 else None,
                   seeds_for_se_target=seeds_for_se(paired) if name != "full" else None,
                   se_target_pct=SE_TARGET_PCT,
                   delta_vs_full_unpaired_pct=unpaired, delta_vs_full_unpaired_se_pct=unpaired_se,
                   full_seeds_unpaired=len(full_all),
                   kept_fraction=_mean([r.get("kept_fraction") for r in runs.values()]),
                   sparse_layer_fraction=_sparse_share_at(runs.values(), step, summaries),
                   recall=_mean([s.get("recall") for s in summaries]),
                   sparsity_mean=_mean([s.get("sparsity_mean") for s in summaries]),
                   budget_density=_mean([s.get("budget_density") for s in summaries]),
                   ms_step_alone=(t_arm or {}).get("stage2"), ms_step_alone_stage1=(t_arm or {}).get("stage1"),
                   ms_step_alone_by_S={k: v for k, v in (timing.get(name) or {}).items()},
                   time_to_full_loss_s=reach_by_S.get(str(S)), curve=mean_curve,
                   # every seed's whole curve (not cut at the paired step): a later study can join these seeds
                   curve_per_seed={seed: rec["curve"] for seed, rec in sorted(runs.items())},
                   wall_clock=wc, wall_clock_by_S=wc_by_S,
                   time_to_full_loss_s_by_S=reach_by_S,
                   wall_clock_logged=logged, logged_alone_seeds=logged_seeds, ms_step_logged=logged_ms,
                   time_to_full_loss_logged_s=time_to_reach(logged, full_mean) if logged else None,
                   stage2_charging=("per_interval" if counts else "uniform_share") if arm["attn"] == "dsv" else None,
                   # --at-step: curves cut there; kept_fraction, recall, sparsity and budget density are the runs'
                   # ends (their summaries), the sparse share is counted up to the cut
                   cut_at_step=getattr(args, "at_step", None),
                   lr_schedule=schedule, **harness)
        rows.append(row)
    full_by_S = next((r["time_to_full_loss_s_by_S"] for r in rows if r["name"] == "full"), {})
    for row in rows:
        # the same loss curve (trained at the arm's length) on the step times measured at each timed length
        # with the same budgets: what the run would take there if its curve held
        row["time_to_full_loss_ratio_by_S"] = {
            length: (t / full_by_S[length] if t is not None and full_by_S.get(length) else None)
            for length, t in row["time_to_full_loss_s_by_S"].items()}
        row["time_to_full_loss_ratio"] = row["time_to_full_loss_ratio_by_S"].get(str(S))
    full_logged = next((r["time_to_full_loss_logged_s"] for r in rows if r["name"] == "full"), None)
    for row in rows:  # the same ratio from the logged wall-clock of the seeds that trained alone
        t = row["time_to_full_loss_logged_s"]
        row["time_to_full_loss_ratio_logged"] = t / full_logged if t is not None and full_logged else None
    return rows


def _mean_curve(curves, upto: int):
    steps = sorted(set.intersection(*({s for s, _ in c} for c in curves)))
    return [(s, sum(dict(c)[s] for c in curves) / len(curves)) for s in steps if s <= upto]


def _mean_counts(runs, steps) -> Optional[Dict[int, tuple]]:
    """Per validation step, the seeds' mean cumulative (sparse layer-steps, stage-2 layer-steps); None unless
    every run recorded them at every step (runs before 2026-12-02 evening did not)."""
    if not all(all(st in rec.get("sparse_counts", {}) for st in steps) for rec in runs):
        return None
    runs = list(runs)
    return {st: tuple(sum(rec["sparse_counts"][st][i] for rec in runs) / len(runs) for i in (0, 1)) for st in steps}


def _sparse_share_at(runs, step: int, summaries) -> Optional[float]:
    """Share of stage-2 layer-steps that ran sparse up to ``step``, mean over seeds: from the runs' cumulative
    counts where every run recorded them there, else their summaries (the whole run)."""
    runs = list(runs)
    if runs and all(step in rec.get("sparse_counts", {}) for rec in runs):
        shares = [rec["sparse_counts"][step][0] / rec["sparse_counts"][step][1] for rec in runs
                  if rec["sparse_counts"][step][1] > 0]
        if shares:  # no stage-2 layer-step yet (full attention, the window, an early cut): the summaries say
            return _mean(shares)
    return _mean([s.get("sparse_layer_fraction") for s in summaries])


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None


def plot(rows: List[dict], prefix: str, title: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    written = []
    # a third panel: the same curves charged at the longest timed length (the speed target's length), when longer
    longest = max((int(k) for row in rows for k, w in (row.get("wall_clock_by_S") or {}).items() if w), default=0)
    longest = longest if longest > rows[0]["S"] else 0
    # the middle panel: the timing phase's step times where it ran, else the seconds the alone seeds logged
    phase = any(row["wall_clock"] for row in rows)
    clock = (lambda row: row["wall_clock"]) if phase else (lambda row: row.get("wall_clock_logged"))
    timed = any(clock(row) for row in rows)
    fig, axes = plt.subplots(1, 3 if longest else 2, figsize=(18 if longest else 12, 4.5))
    full_runs = next((row["curve_per_seed"] for row in rows if row["name"] == "full"), {})
    for row in rows:
        label = f"{row['name']} ({row['delta_vs_full_pct']:+.2f}% at step {row['steps']})"
        axes[0].plot(*zip(*row["curve"]), marker="o", ms=3, label=label)
        if clock(row):
            axes[1].plot(*zip(*clock(row)), marker="o", ms=3, label=label)
        elif not timed and row["name"] != "full":  # no timing: each seed's paired delta instead
            for seed, curve in row["curve_per_seed"].items():
                full = dict(full_runs.get(seed, []))
                pts = [(s, 100.0 * (v / full[s] - 1.0)) for s, v in curve if s in full]
                if pts:
                    axes[1].plot(*zip(*pts), marker="o", ms=2, lw=1, label=f"{row['name']} seed {seed}")
        if longest and (row.get("wall_clock_by_S") or {}).get(str(longest)):
            ratio = (row.get("time_to_full_loss_ratio_by_S") or {}).get(str(longest))
            axes[2].plot(*zip(*row["wall_clock_by_S"][str(longest)]), marker="o", ms=3,
                         label=f"{row['name']} (full's loss in {ratio:.2f}x its time)" if ratio else row["name"])
    axes[0].set_xlabel("training step")
    source = "measured step times" if phase else "training seconds logged by the seeds that ran alone"
    axes[1].set_xlabel(f"training time alone on the GPU at {rows[0]['S']} tokens (s)\n({source})" if timed
                       else "training step (no step times in this study)")
    if longest:
        axes[2].set_xlabel(f"the same steps timed at {longest} tokens (s, measured step times)")
    for i, ax in enumerate(axes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        if i == 1 and not timed:
            ax.set_ylabel("validation loss vs full attention, same seed (%)")
            ax.axhline(0.0, color="k", lw=0.8)
            continue
        ax.set_ylabel("validation loss (EMA weights, held-out clips)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.4g"))  # plain numbers, not 1.1 x 10^0
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.4g"))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(prefix + "_curves.png", dpi=120)
    plt.close(fig)
    written.append(prefix + "_curves.png")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for row in rows:
        if row["kept_fraction"] is None:
            continue
        se = row["delta_vs_full_se_pct"]
        short = row["steps"] < row["full_loss_target_step"]  # compared earlier than full attention's end: hollow
        ax.errorbar(row["kept_fraction"], row["delta_vs_full_pct"], yerr=None if se != se else se, fmt="o", capsize=3,
                    mfc="none" if short else None)
        ax.annotate(f"{row['name']} @{row['steps']}", (row["kept_fraction"], row["delta_vs_full_pct"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("kept fraction of keys at the end (1 = full attention)")
    ax.set_ylabel("validation loss vs full attention (%, mean +- se over seeds)")
    ax.set_title(title.replace("; ", "\n"), fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(prefix + "_frontier.png", dpi=120)
    plt.close(fig)
    written.append(prefix + "_frontier.png")
    return written

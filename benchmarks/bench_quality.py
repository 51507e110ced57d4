"""The quality-speed frontier: which attention lists keep full attention's validation loss, at what speed.

Every *arm* (a named list design, :data:`FRONTIER`) trains the same video DiT on the same clips
(``--arm`` gives the data keys of ``benchmarks/video_runs.py``; ``--data-seed`` fixes the clips and the
held-out set) once per seed (``--seeds``: a seed is one draw of initial weights and data order, shared by
every arm, so differences are paired). Validation evaluates an EMA of the weights (``--ema-decay``) on
``--val-samples`` held-out clips x 5 fixed timesteps with fixed noise, every ``--val-every`` steps.

Phases (each resumable; a GPU session runs them over several calls):

* ``--launch``: one process per (arm, seed), all at once on the one GPU (their step times are therefore
  not speed figures), each saving its run (``--save-dir``) and its curve at every validation, stopping at
  ``steps`` or, after its ``minutes``, at its last validation step (``--align-stops``: every run then has
  validations at the same steps); a later ``--launch`` resumes them;
* ``--time``: each arm's step time **alone on the GPU**, from its trained checkpoint (seed 0): its own
  per-head budgets and lists as training left them, at the arm's length and every ``--time-lengths``
  (DSV arms: stage 2 as trained, and stage 1 = the same model attending as its stage 1 does), after a
  warm-up of a whole profile period (every kernel compiled) and over whole profile periods;
* ``--report`` (:mod:`benchmarks.quality_report`): per arm the final validation loss at the last step every run
  reached, its difference to full attention as mean +- standard error over seeds (paired, and unpaired), kept
  fraction, share of stage-2
  layer-steps sparse, recall, step time alone, and the time to reach full attention's final loss on the
  measured step times (loss curve x step time); writes ``quality-frontier-<gpu>-<date>.json`` and PNGs
  (loss vs step, loss vs wall-clock, the frontier: delta vs kept fraction).

    PYTHONPATH=. python benchmarks/bench_quality.py --quick                       # CPU check, all phases
    PYTHONPATH=. python benchmarks/bench_quality.py --launch --arm data=vizdoom,frames=16,res=256,steps=4000 \
        --seeds 0,1 --save-dir runs/frontier --heads 8 --head-dim 64 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import collect_meta, init_dist, write_results  # noqa: E402
from benchmarks.frontier_launch import launch  # noqa: E402
from benchmarks.quality_report import harness_of, plot, report, study_seeds  # noqa: E402
from benchmarks.video_runs import add_run_args, parse_arm, run_harness, tokens_of  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402

# name -> arm keys over the data arm. "control" is DSV that never leaves stage 1 (dense attention through
# DSV's path, predictors and profiler running): it must come out at 0 within the error.
_D = DSVConfig()
_DEFAULT_LISTS = (f"attn=dsv,rule={_D.budget_rule},recall={_D.recall_target:g},local=auto,"
                  f"thr={_D.sparsity_threshold:g},cap={_D.max_density or 0:g},"
                  f"s1local={'.'.join(map(str, _D.stage1_local_radius)) if _D.stage1_local_radius else 'auto'}"
                  + (f",stage1={_D.stage_switch_steps}" if _D.stage_switch_rule == "steps" else ""))
_S1WIN = "attn=dsv,rule=sparsity,local=auto,thr=0.7,cap=0.25,stage1=400,s1local=2.2.1"
_G32 = f"{_S1WIN},group=2.4.4,s1local=4.2.2"  # 32-query cubes, the stage-1 window widened in cubes to match
_G64 = f"{_S1WIN},group=2.4.8,s1local=4.2.1"  # 64-query cubes, likewise
_TOK = f"{_S1WIN},gran=token"
_RECALL90 = "rule=recall,recall=0.9"
FRONTIER: Dict[str, str] = {
    "full": "attn=full",
    "control": "attn=dsv,stage1=1000000000",
    # the library's defaults as committed (DSVConfig), whatever they are: its lists and its stage switch (by steps,
    # at DSVConfig.stage_switch_steps; the name "default_s400" of runs 5-6 is gone: this arm switches there now)
    "default": _DEFAULT_LISTS,
    # fixed designs (they do not follow the defaults): the paper's rule + the (1, 1, 1) neighbourhood, threshold 0.7
    # (the default of runs 3-5), and the same with every head's list capped at 25% of the keys (run 6; the default
    # since): layers run sparse from the switch instead of waiting for their measured sparsity
    "uncapped_s400": "attn=dsv,rule=sparsity,local=auto,thr=0.7,stage1=400",
    "cap25_s400": "attn=dsv,rule=sparsity,local=auto,thr=0.7,cap=0.25,stage1=400",
    # the 3D window of the `window` arm at 16K (radius 2 2 1 in 4x4x8 cubes: 29% of the keys), each cube keeping its
    # own neighbourhood (DSVConfig.local_mode 'window'), plus predicted blocks up to a 35% cap; threshold 0.6, so
    # the capped lists run sparse from the switch (not yet measured)
    "windowpred35_s400": "attn=dsv,rule=sparsity,local=2.2.1,lmode=window,thr=0.6,cap=0.35,stage1=400",
    # the default and windowpred35_s400 with the 3D window (radius 2 2 1, the `window` arm's at 16K) in stage 1
    # instead of dense attention (DSVConfig.stage1_local_radius): the window's lead from the first validation on,
    # then the predicted lists (not yet measured)
    "s1win_cap25_s400": _S1WIN,
    "s1win_windowpred35_s400": "attn=dsv,rule=sparsity,local=2.2.1,lmode=window,thr=0.6,cap=0.35,stage1=400,"
                               "s1local=2.2.1",
    # issue 24's frontier over the list design: s1win_cap25_s400 (the default since run 11) with one design choice
    # changed: query cubes of 64 (2x4x8) and 32 (2x4x4) tokens, the stage-1 window's radius in cubes widened in t
    # (and w) to span about the default's tokens (18-20 frames x 20 x 20-24 against 20 x 20 x 24; the (1, 1, 1)
    # neighbourhood stays in cubes, so it spans fewer tokens); token lists of the 128-query cubes (no neighbourhood:
    # it needs key blocks), the same stage-1 window; the recall rule at 0.9 and 0.8 in place of the paper's
    "g64_s1win_cap25_s400": _G64,
    "g32_s1win_cap25_s400": _G32,
    "tok_s1win_cap25_s400": _TOK,
    "recall90_s1win_cap25_s400": f"{_S1WIN},{_RECALL90}",
    "recall80_s1win_cap25_s400": f"{_S1WIN},rule=recall,recall=0.8",
    # the finer lists with budgets sized by the critical mass (recall 0.9, capped at 25% like the default) instead
    # of the paper's rule, which gave them fewer keys than the default in run 23 (0.195 and 0.128 against ~0.22)
    "g32_recall90_s1win_cap25_s400": f"{_G32},{_RECALL90}",
    "tok_recall90_s1win_cap25_s400": f"{_TOK},{_RECALL90}",
    # the finer cubes with an always-on neighbourhood as large as the default's in key blocks (run 24: every finer
    # design fell behind the default; at 16K, (1, 1, 1) in 2x4x4 or 2x4x8 cubes keeps at most 18 and on average
    # 9.5-11.3 of the 128 key blocks, the default's 4x4x8 cubes 27 and 17.2): radius (2, 1, 2) in 2x4x4 cubes and
    # (2, 1, 1) in 2x4x8 cubes keep at most 30 and on average 17.5 (neighbourhood.local_items_with_counts), under
    # the 25% cap (32 blocks)
    "g32_local212_recall90_s1win_cap25_s400": f"{_G32},local=2.1.2,{_RECALL90}",
    "g64_local211_s1win_cap25_s400": f"{_G64},local=2.1.1",
    "recall90": "attn=dsv,rule=recall,recall=0.9",
    "recall80": "attn=dsv,rule=recall,recall=0.8",
    "paper": "attn=dsv,rule=sparsity",
    "local": "attn=dsv,rule=sparsity,local=0.1.1",
    "local111": "attn=dsv,rule=sparsity,local=1.1.1,thr=0.8",
    "local111_thr07": "attn=dsv,rule=sparsity,local=1.1.1,thr=0.7",
    "local_recall90": "attn=dsv,rule=recall,recall=0.9,local=0.1.1",
    "window": "attn=window",
}
DEFAULT_ARMS = "full,control,paper,local,window"
QUICK_ARM = "data=synthetic,frames=4,res=64,steps=8,stage1=4,minutes=2"


def arm_of(name: str, base: str, args) -> dict:
    """The full arm dict of frontier arm ``name`` over the data keys ``base``."""
    if name not in FRONTIER:
        raise ValueError(f"unknown frontier arm {name!r}; allowed: {sorted(FRONTIER)}")
    keys = f"{base},{FRONTIER[name]}"
    if name == "window":
        keys += f",window_frac={args.window_frac}"
    arm = parse_arm(keys)
    if "stage1=" in FRONTIER[name] and arm["stage1"] < arm["steps"]:  # its own run path beside the study's switch
        head, tokens = arm["label"].rsplit("-S", 1)
        arm["label"] = f"{head}-stage1at{arm['stage1']}-S{tokens}"
    extra = getattr(args, "extra_steps", 0) or 0
    if name != "full" and extra:  # past full attention's last step: the time to reach its final loss exists
        arm["steps"] = int(round(arm["steps"] * (1 + extra / 100.0)))
    return arm


def check_distinct_runs(names: List[str], args) -> None:
    """Two arm names that are the same design share a run path (its label): two workers would write one
    checkpoint. Refused, naming both (two FRONTIER names whose keys give one label)."""
    seen: Dict[str, str] = {}
    for name in names:
        label = arm_of(name, args.arm, args)["label"]
        if label in seen:
            raise SystemExit(f"bench_quality: --arms {seen[label]!r} and {name!r} are the same run ({label}); "
                             "keep one of them")
        seen[label] = name


def _curve_path(args, name: str, seed: int) -> str:
    return os.path.join(args.save_dir, "curves", f"{name}-s{seed}.json")


# ---------------------------------------------------------------- train (one arm, one seed)
def train_one(name: str, args) -> dict:
    """Train arm ``name`` at ``args.seed`` (resuming its run), writing its curve file at every validation."""
    from benchmarks.video_runs import lr_schedule, schedule_key, train_arm

    arm = arm_of(name, args.arm, args)
    path = _curve_path(args, name, args.seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    old = json.load(open(path)) if os.path.exists(path) else {}
    schedule = lr_schedule(args, args.schedule_steps)
    if old and old.get("arm", {}).get("label") != arm["label"]:  # another run (design) under the name: a default moved
        print(f"{path}: holds run {old.get('arm', {}).get('label')!r}, not {arm['label']!r}: started over", flush=True)
        old = {}
    if old and schedule_key(old.get("schedule")) != schedule_key(schedule):  # another learning-rate schedule
        print(f"{path}: trained on schedule {old.get('schedule')}, not {schedule}: started over", flush=True)
        old = {}
    harness = run_harness(args)  # what else a curve depends on
    if old and harness_of(old) != harness:
        print(f"{path}: trained at {harness_of(old)}, not {harness}: its curve started over (a run checkpoint of "
              "that harness under --save-dir is refused when it loads)", flush=True)
        old = {}
    curve = dict(old.get("curve", []))
    # cumulative (sparse layer-steps, stage-2 layer-steps) at each validation: how a stage-2 step is charged
    counts = {int(k): v for k, v in old.get("sparse_counts", {}).items()}
    # the loss per class (footage: per source video) and per timestep at each validation: where a seed's spread sits
    parts = {int(k): v for k, v in old.get("val_breakdown", {}).items()}
    # cumulative (training seconds, of them shared with another worker) at each validation: the logged wall-clock
    seconds = {int(k): v for k, v in old.get("train_seconds", {}).items()}

    def record(**extra):
        return dict(name=name, seed=args.seed, arm=_plain(arm), schedule=schedule, **harness,
                    curve=sorted(curve.items()),
                    sparse_counts={str(k): v for k, v in sorted(counts.items())},
                    val_breakdown={str(k): v for k, v in sorted(parts.items())},
                    train_seconds={str(k): v for k, v in sorted(seconds.items())}, **extra)

    def on_val(step, loss, counters, breakdown):
        curve[int(step)] = float(loss)
        counts[int(step)] = [int(counters["sparse_steps"]), int(counters["layer_steps"])]
        parts[int(step)] = breakdown
        if "train_s" in counters:
            seconds[int(step)] = [round(float(counters["train_s"]), 3), round(float(counters["shared_s"]), 3)]
        _write_json(path, record())

    model, _, summary = train_arm(arm, args, on_val=on_val)
    record = record(summary=summary, kept_fraction=kept_fraction(model, arm, summary))
    _write_json(path, record)
    print(f"== {name} seed {args.seed}: {summary['steps']} steps, val loss {summary['val_loss']:.4f}", flush=True)
    return record


def kept_fraction(model, arm: dict, summary: dict) -> float:
    """Mean fraction of keys a query attends at the run's end: 1 for full attention, the window's fraction,
    DSV's budgets where its layers ran sparse (a dense layer keeps every key)."""
    from megatron_dsv.attention import dsv_layers

    if arm["attn"] == "full":
        return 1.0
    if arm["attn"] == "window":
        from megatron_dsv.models.window_attention import kept_fraction as window_kept

        core = next(m for m in model.modules() if type(m).__name__ == "WindowCoreAttention")
        return window_kept(core.token_grid, core.window_config.cube, core.window_config.radius)
    layers = dsv_layers(model)
    S = tokens_of(arm)
    fractions = []
    for layer in layers:
        sparse, _, tokens = layer.decide(S)
        fractions.append(float(tokens.mean()) / S if sparse and layer.stage_host == 2 else 1.0)
    return sum(fractions) / len(fractions)


def prepare_clips(args) -> None:
    """Render the study's clips once, into ``--clips-cache``, before the workers start (they load them)."""
    from benchmarks.video_runs import Clips
    from megatron_dsv.models.dit_config import VideoDiTConfig

    channels = VideoDiTConfig.from_preset(args.preset).in_channels
    Clips.for_arm(parse_arm(args.arm), args, channels, torch.device("cpu"), torch.float32)
    Clips._cache.clear()


# ---------------------------------------------------------------- step time alone
def time_arms(names: List[str], args) -> dict:
    """Each arm's step time alone, from its first seed's run: ``{name: {S: {"stage2": ms, "stage1": ms}}}``."""
    lengths = sorted({tokens_of(parse_arm(args.arm)), *[int(s) for s in args.time_lengths.split(",") if s]})
    seed = min(study_seeds(args))
    profiled = args.time_profile_at or lengths[-1]
    if args.time_profile and profiled not in lengths:
        raise ValueError(f"--time-profile-at {profiled} is not a timed length (the arm's and --time-lengths: "
                         f"{lengths})")
    # full attention's and the window's steps do not depend on their weights (no budgets, no lists learnt): an
    # untrained one is timed from its initial weights; a DSV arm's step needs its trained budgets
    missing = [name for name in names
               if arm_of(name, args.arm, args)["attn"] == "dsv" and not os.path.exists(_trained_run(name, args, seed))]
    if missing:  # before any arm is clocked: a GPU call's minutes are not spent on a timing that cannot finish
        raise ValueError(f"--time: arms {missing} have no trained run of seed {seed} under {args.save_dir} "
                         "(run --launch first, or name the trained arms in --arms)")
    out = {}
    for name in names:
        out[name] = {}
        for S in lengths:
            out[name][str(S)] = time_arm(name, S, args, profile=args.time_profile and S == profiled)
            print(f"[time] {name} S={S}: " + ", ".join(f"{k} {v:.2f}" if k.endswith("share") else f"{k} {v:.1f} ms"
                                                     for k, v in out[name][str(S)].items()), flush=True)
    _write_json(os.path.join(args.save_dir, "timing.json"), out)
    return out


def _trained_run(name: str, args, seed: int) -> str:
    """Where arm ``name``'s run of ``seed`` is saved."""
    from benchmarks.video_runs import run_path

    return run_path(arm_of(name, args.arm, args), argparse.Namespace(save_dir=args.save_dir, seed=seed))


def time_arm(name: str, S: int, args, profile: bool = False) -> dict:
    """ms per training step of arm ``name`` at S tokens (frames scaled), from its trained run (DSV arms: also the
    plain and the profile steps apart, ``<kind>_plain`` and ``<kind>_profile_step``); ``profile``: after the
    clock, print the kernels of three plain steps of the trained stage (:func:`print_kernel_profile`)."""
    from benchmarks.common import MainWeightsAdamW, flow_matching_step, sync
    from benchmarks.video_runs import build_model
    from megatron_dsv.attention import dsv_layers, dsv_on_step_end

    arm = arm_of(name, args.arm, args)
    per_frame = (arm["res"] // 8) ** 2
    if S % per_frame:
        raise ValueError(f"--time-lengths: {S} tokens is not a whole number of {arm['res']}px frames ({per_frame})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timed = dict(arm, frames=S // per_frame)
    model, cfg = build_model(timed, args, device, dtype)
    seed = min(study_seeds(args))
    path = _trained_run(name, args, seed)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
    elif arm["attn"] == "dsv":
        raise ValueError(f"--time: arm {name!r} has no trained run at {path} (seed {seed}): run --launch first")
    else:
        print(f"[time] {name}: no trained run at {path}; timed from its initial weights (its step does not depend "
              "on them)", flush=True)
    # built after the load: its fp32 main copies must be the trained weights (on bf16 its first step writes
    # them back into the model); the study's optimizer, at a rate that moves nothing
    opt = MainWeightsAdamW(model.parameters(), lr=1e-9, weight_decay=0.0)
    layers = dsv_layers(model)
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(args.batch, cfg.in_channels, *cfg.latent_grid, generator=g, device=device).to(dtype)
    labels = torch.zeros(args.batch, dtype=torch.long, device=device)
    model.train()

    from megatron_dsv.attention.schedule import is_profile_step

    dsv_cfg = layers[0].dsv_config if layers else None

    # DSV's steps differ by the schedule: a profile step every `period` steps, the period in effect at the run's
    # step (past the profiler's warm-up: profile_interval_after_warmup). Plain and profile steps are clocked
    # apart (after a warm-up that runs both, every kernel compiled) and a step costs plain + (profile - plain) /
    # period: a window of consecutive steps would hold 0 or 1 profile step by chance unless it spans whole periods
    period = profile_period(dsv_cfg, layers[0].step_host) if layers else 1
    split = bool(layers) and period > 1  # period 1: every step is a profile step
    # the budgets as training left them, put back before every clocked window: the warm-up's profile steps
    # measure these random latents and would move them (a layer could even fall under the threshold)
    kept = ("sparsity", "budget_density", "recall")
    trained = [{n: getattr(layer, n).detach().clone() for n in kept} for layer in layers]

    def restore():
        for layer, saved in zip(layers, trained):
            for n, t in saved.items():
                getattr(layer, n).copy_(t)
            layer._sync_host()  # host mirrors re-read, decisions dropped

    def steps(n, profiled=False):
        """n training steps; each DSV step ends by numbering the next one so that it is (``profiled``) or is
        not a profile step of the schedule (the step a layer runs is the one the last call numbered)."""
        for _ in range(n):
            flow_matching_step(model, opt, latents, labels, g)
            if layers:
                nxt = layers[0].step_host + 1
                while split and is_profile_step(nxt, dsv_cfg) != profiled:
                    nxt += 1
                dsv_on_step_end(model, nxt)

    def clock(n, profiled=False, windows=3):
        """ms a step: the median of ``windows`` clocked windows of ``n`` steps (a short host-bound step varies
        with what else the host does), each from the trained budgets."""
        steps(1, profiled)  # untimed: numbers the first timed step
        out = []
        for _ in range(windows):
            restore()
            sync()
            t0 = time.perf_counter()
            steps(n, profiled)
            sync()
            out.append(1e3 * (time.perf_counter() - t0) / n)
        return sorted(out)[len(out) // 2]

    result = {}
    stage = layers[0].stage_host if layers else 1
    kinds = ["stage2", "stage1"] if stage == 2 else ["step"]
    for kind in kinds:
        for layer in layers:
            layer.force_stage1 = kind == "stage1"
            layer._decisions = {}
        steps(args.time_warmup)
        if split:
            steps(2, profiled=True)
        plain = clock(max(1, args.time_steps // 3))
        if kind == "stage2":  # what the clocked stage-2 step ran: the trained decisions may keep a layer dense
            result["stage2_sparse_share"] = sum(int(layer.last_sparse) for layer in layers) / len(layers)
        if split:
            prof = clock(max(1, args.time_steps // 15), profiled=True)
            result[kind] = plain + (prof - plain) / period
            result[f"{kind}_plain"], result[f"{kind}_profile_step"] = plain, prof
        else:
            result[kind] = plain
        if profile and kind in ("stage2", "step"):
            steps(1)  # numbers plain steps again (the last clock numbered a profile step)
            restore()
            print_kernel_profile(f"{name} S={S} {kind} (plain steps)", lambda: steps(3), 3, device)
            restore()
            print_host_profile(f"{name} S={S} {kind} (plain steps)", lambda: steps(1), 3)
        if layers and layers[0].stage_host != stage:
            raise RuntimeError(f"--time: arm {name!r} changed stage while timed ({stage} -> {layers[0].stage_host}): "
                               "its run is not past its stage switch")
    if "step" in result:
        result = {"stage2": result["step"], "stage1": result["step"], "stage2_sparse_share": 0.0}
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_period(cfg, step: int) -> int:
    """Steps between two profile steps of the DSV schedule at ``step`` (attention.schedule.is_profile_step)."""
    return cfg.profile_interval if step < cfg.profile_warmup_steps else cfg.profile_interval_after_warmup


def print_kernel_profile(label: str, run, n_steps: int, device: torch.device, rows: int = 25) -> None:
    """Where a step's device time goes: ``run()`` (``n_steps`` steps) under torch.profiler, the top kernels by
    self device time per step (CPU time on a CPU). Profiling slows the steps: read the shares, not the clock."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    from benchmarks.host_ops import stack_config

    with profile(activities=activities, **(stack_config() if device.type == "cuda" else {})) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    if device.type == "cuda":  # the kernels themselves: an op's entry also carries its kernels' time
        from torch.autograd import DeviceType

        events = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) / n_steps / 1e3
    print(f"[profile] {label}: {total:.1f} ms of self {'device' if device.type == 'cuda' else 'CPU'} time per step "
          f"over {n_steps} steps (profiled); top kernels:", flush=True)
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:rows]:
        ms = getattr(e, attr) / n_steps / 1e3
        print(f"[profile]   {ms:8.3f} ms {100 * ms / max(total, 1e-9):5.1f}%  x{e.count / n_steps:6.1f}  {e.key[:110]}",
              flush=True)
    if device.type == "cuda":  # where the device waited for the host, by the code whose launch ended each wait
        from benchmarks.host_ops import idle_sites, print_idle

        try:
            print_idle(label, idle_sites(prof, n_steps))
        except Exception as err:  # a diagnostic: never lose the timing to it
            print(f"[idle] {label}: not attributed ({type(err).__name__}: {err})", flush=True)


def print_host_profile(label: str, run, n_steps: int, rows: int = 20) -> None:
    """Where a step's host time goes (``benchmarks/host_ops.host_profile``: cProfile, which slows the host: read
    the shares): its own time outside syncs, the top functions by own time and this repository's by cumulative
    time. A step whose host time exceeds its device time (``[profile]``) is host-bound: what to cut is here."""
    from benchmarks.host_ops import host_profile

    got = host_profile(run, n_steps, rows)
    print(f"[host] {label}: {got['ms_host']:.1f} ms of host time per step outside syncs ({got['ms_waiting']:.1f} ms "
          f"waiting), under cProfile; top functions by own time:", flush=True)
    for kind in ("host_top", "host_cumulative_ours"):
        if kind == "host_cumulative_ours":
            print("[host]   this repository's functions by cumulative time:", flush=True)
        for e in got[kind]:
            print(f"[host]   {e['ms']:8.3f} ms  x{e['calls']:7.1f}  {e['fn'][:110]}", flush=True)


# ---------------------------------------------------------------- plumbing
def _meta_from(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    meta = dict(json.load(open(path))["meta"])
    meta["reported"] = collect_meta()
    return meta


def _plain(arm: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in arm.items()}


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--arm", default=None, help="the data keys every arm shares (video_runs.py syntax)")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"frontier arms, comma-separated, of {sorted(FRONTIER)}")
    ap.add_argument("--seeds", default=None,
                    help="seeds (init + data order), comma-separated (default 0,1); --report: only these seeds' curves "
                         "(default: every curve under --save-dir)")
    ap.add_argument("--window-frac", type=float, default=0.2, help="kept fraction of keys of the window arm")
    ap.add_argument("--extra-steps", type=float, default=0.0,
                    help="every arm but full trains this many percent more steps than the arm's `steps` (full stops "
                         "there): the loss comparison stays at equal steps, and an arm that ends a little above full "
                         "attention can still be timed to full attention's final loss")
    ap.add_argument("--launch", action="store_true", help="train every (arm, seed) as concurrent processes")
    ap.add_argument("--worker", default=None, help="train one arm at --seed (what --launch runs)")
    ap.add_argument("--time", action="store_true", help="time each arm alone from its trained run")
    ap.add_argument("--time-lengths", default="32768", help="more lengths (tokens) for --time, comma-separated")
    ap.add_argument("--time-steps", type=int, default=30)
    ap.add_argument("--time-warmup", type=int, default=5)
    ap.add_argument("--time-profile", action="store_true",
                    help="--time: also print each arm's top kernels over three plain steps at the longest length")
    ap.add_argument("--time-profile-at", type=int, default=0,
                    help="--time-profile: profile at this timed length (tokens) instead of the longest (a host-bound "
                         "step shows its host work at a short length, a device-bound one hides it)")
    ap.add_argument("--report", action="store_true", help="write the frontier JSON and plots")
    ap.add_argument("--note", default=None, help="a note kept in the JSON's meta (what a reader must know)")
    ap.add_argument("--meta-from", default=None,
                    help="a results JSON whose meta (GPU, versions, date, commit) the report keeps: re-reporting a GPU "
                         "run's curves on another machine (its own meta goes under meta.reported)")
    ap.add_argument("--stagger", type=float, default=2.0, help="seconds between worker starts")
    ap.add_argument("--max-workers", type=int, default=0,
                    help="--launch: at most this many workers at once on the machine, counting other launchers' "
                         "(0: every (arm, seed) at once); the rest start as workers end")
    ap.add_argument("--oom-retries", type=int, default=3,
                    help="--launch: a worker that dies of CUDA out-of-memory resumes from its last save this many times")
    ap.add_argument("--at-step", type=int, default=None,
                    help="--report: compare at this validation step (every curve cut there; full attention's loss "
                         "there is the time-to-loss target): a longer study reported at a shorter length too")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, every phase in-process")
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.samples, args.val_samples = "tiny", 2, 4, 2
        args.profile_every, args.log_every, args.val_every, args.warmup = 2, 4, 4, 2
        args.arm = args.arm or QUICK_ARM
        args.time_lengths, args.time_steps, args.time_warmup, args.time_profile = "", 2, 1, True
        args.save_dir = args.save_dir or os.path.join(args.out_dir or ".", "frontier-quick")
    if args.arm is None or args.save_dir is None:
        raise SystemExit("bench_quality: give --arm and --save-dir (or --quick)")
    names = [n for n in args.arms.split(",") if n]
    for n in names:
        if n not in FRONTIER:
            raise SystemExit(f"bench_quality: unknown arm {n!r} in --arms; allowed: {sorted(FRONTIER)}")
    if "full" not in names and (args.time or args.report or args.quick):
        # training may add arms to a study whose full attention is trained (or trained elsewhere: its curves are
        # joined where the report is made); the timing's baseline and the report's differences need it
        raise SystemExit("bench_quality: --arms must include 'full' with --time or --report (every difference and "
                         "every ratio is to it)")
    check_distinct_runs(names, args)
    # the learning-rate schedule runs over the study's steps: an arm's extra steps stay at its floor
    args.schedule_steps = parse_arm(args.arm)["steps"]
    seeds = study_seeds(args)
    args.clips_cache = args.clips_cache or os.path.join(args.save_dir, "clips")
    args.align_stops = True  # every run of the study validates at the same steps, whenever its minutes end
    if args.data_seed is None:
        args.data_seed = 0
    if args.worker or args.time or args.quick:  # the launcher itself holds no GPU context
        init_dist()
    if args.worker:
        train_one(args.worker, args)
        return
    if args.quick:
        for name in names:
            for seed in seeds:
                args.seed = seed
                train_one(name, args)
        args.seed = 0
    elif args.launch:
        prepare_clips(args)
        launch(names, seeds, argv, args)
    if args.time or args.quick:
        time_arms(names, args)
    if args.report or args.quick:
        rows = report(args, names)
        S = rows[0]["S"]
        meta = _meta_from(args.meta_from)
        if args.note:
            meta = dict(meta or collect_meta(), note=args.note)
        path = write_results("quality-frontier", rows, args.out_dir, meta=meta)
        title = (f"{rows[0]['data']}, {S} tokens, {args.preset} layer shape"
                 f"{f' ({args.heads}x{args.head_dim})' if args.heads else ''} x {args.layers} layers, "
                 f"seeds {rows[0]['seeds']}, EMA {args.ema_decay}; each arm against full at its last common step")
        try:
            print("wrote", *plot(rows, str(path).replace(".json", ""), title))
        except ImportError as err:
            print(f"no plot ({err}): pip install -e '.[plots]'")
        print(f"{'arm':16s} {'step':>5s} {'val loss':>10s} {'vs full %':>14s} {'unpaired %':>14s} {'kept':>6s} "
              f"{'sparse':>7s} "
              f"{'recall':>7s} {'ms alone':>9s} {'t->full':>8s} {'logged':>7s} {'seeds@se':>8s} "
              f"{'t->full at each timed S':s}")
        for r in rows:
            fmt = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731
            print(f"{r['name']:16s} {r['steps']:5d} {r['val_loss']:10.4f} {fmt(r['delta_vs_full_pct'], '+7.2f')} +-"
                  f"{fmt(r['delta_vs_full_se_pct'], '4.2f')} {fmt(r['delta_vs_full_unpaired_pct'], '+7.2f')} +-"
                  f"{fmt(r['delta_vs_full_unpaired_se_pct'], '4.2f')} {fmt(r['kept_fraction'], '6.3f')} "
                  f"{fmt(r['sparse_layer_fraction'], '7.2f')} {fmt(r['recall'], '7.3f')} "
                  f"{fmt(r['ms_step_alone'], '9.1f')} {fmt(r['time_to_full_loss_ratio'], '8.2f')} "
                  f"{fmt(r['time_to_full_loss_ratio_logged'], '7.2f')} "
                  f"{fmt(r['seeds_for_se_target'], '8d')} "
                  + " ".join(f"{k}:{fmt(v, '.2f')}" for k, v in r["time_to_full_loss_ratio_by_S"].items()))
        print("wrote", path)


if __name__ == "__main__":
    main()

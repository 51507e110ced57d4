"""DSV predictor quality on the video DiT: recall of the theta-critical mass per layer.

Trains the video DiT (flow matching on synthetic videos) with DSV attention for a
short while, stage 1 then stage 2, for each predictor input ('qk', 'hidden'), and
writes ``benchmarks/results/recall-<gpu>-<yyyymmdd>.json`` with one row per
(predictor input, layer): ``recall`` (critical mass of the predicted lists, sampled
queries, last profiled step), ``sparsity`` (smoothed, exact), whether the layer ran
sparse, ``k_mean``, ``predictor_loss``, ``predictor_flops_per_token`` and
``recall_per_mflop``, ``budget_density`` (the budget rule's K_h / S), and the cost of the
method's own work, measured two ways:

* ``predictor_overhead_pct_all_layers`` (the figure the <= 3% target is about) is an A/B on
  stage-2 steps with no device syncs inside the step: arm A runs predictor training and the
  profiler as configured, arm B the same steps with both switched off
  (``layer.predictor_training`` / ``layer.profiling``), in alternating rounds. Per step:
  ``(median A training step - median B) / predictor_train_interval + (median A profiled step -
  median A training step) / profile_interval_after_warmup`` (the library's stage-2 cadence), as a
  % of median B; the medians are columns (``ms_step_dsv_off``, ``ms_step_train``, ``ms_step_profile``).
* ``*_synced`` columns: each layer's ``predictor.collect`` (the forward's share of predictor
  training; the batched loss/gradient pass of the step end is not per layer) and ``_profile``
  timed with a device sync around every call (an upper bound: the syncs serialise what the GPU
  would overlap).

    PYTHONPATH=. python benchmarks/bench_recall.py --quick            # CPU check (~1 min)
    PYTHONPATH=. python benchmarks/bench_recall.py --preset 0.8b --grid 8 32 32 --steps 300   # H200
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MainWeightsAdamW, flow_matching_step, init_dist, sync, write_results  # noqa: E402
from megatron_dsv.attention import dsv_layers, dsv_metrics, dsv_on_step_end, dsv_stage  # noqa: E402
from megatron_dsv.attention.predictor import predictor_flops_per_token  # noqa: E402
from megatron_dsv.attention.schedule import is_profile_step, trains_predictor  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402
from megatron_dsv.data.synthetic import BACKGROUNDS  # noqa: E402


class _Timers:
    """Wall time of each layer's predictor training and profiler calls (device-synchronised)."""

    def __init__(self, layers):
        self.ms = defaultdict(float)
        for layer in layers:
            self._wrap(layer.predictor, "collect", (layer.layer_number, "predictor"))
            self._wrap(layer, "_profile", (layer.layer_number, "profile"))

    def _wrap(self, obj, name, key):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            self.ms[key] += 1e3 * (time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)


def _train(model, data, steps, dtype, device, args, first_step=0, log=None):
    """Plain training steps; returns each step's wall time in ms (synchronised at step ends only).

    AdamW (fp32 main weights) at ``args.lr`` with a linear warm-up over ``args.warmup`` steps and gradient
    clipping at 1.
    ``log(step, loss)``, when given, is called after every step's timing (it may sync the device).
    """
    lr, warmup = args.lr, args.warmup
    opt = getattr(model, "_bench_opt", None) or MainWeightsAdamW(model.parameters(), lr=lr)
    model._bench_opt = opt
    g = torch.Generator().manual_seed(first_step)
    times = []
    for it in range(first_step, first_step + steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (it + 1) / warmup) if warmup else lr
        latents, labels = data.batch_at(it)
        sync()
        t0 = time.perf_counter()
        loss = flow_matching_step(model, opt, latents, labels, g)
        dsv_on_step_end(model, it + 1)
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
        if log is not None:
            log(it, loss.detach(), times[-1])
    return times


class _DeviceSamples:
    """The dataset rendered once and kept on the device: steps do not wait for the CPU renderer."""

    def __init__(self, ds, batch: int, device, dtype):
        items = [ds[i] for i in range(len(ds))]
        self.latents = torch.stack([x["latents"] for x in items]).to(device, dtype)
        self.labels = torch.stack([x["label"] for x in items]).to(device)
        self.batch = batch

    def batch_at(self, it: int):
        idx = [(it * self.batch + i) % len(self.labels) for i in range(self.batch)]
        return self.latents[idx], self.labels[idx]


_TRAJECTORY_ROWS: list = []  # every run's, so a run stopped by SIGTERM (a timeout) still writes them


class _Trajectory:
    """Per-layer DSV metrics after every profiled step (the ``recall_trajectory`` JSON) and a
    Megatron-style progress line every ``every`` steps."""

    def __init__(self, model, dsv, every: int, tag: str):
        self.model, self.dsv, self.every, self.tag = model, dsv, every, tag
        self.rows, self.ms = _TRAJECTORY_ROWS, []

    def __call__(self, step, loss, ms):
        self.ms.append(ms)
        metrics = None
        if is_profile_step(step, self.dsv):
            metrics = dsv_metrics(self.model)
            for layer in dsv_layers(self.model):
                p = f"dsv/layer{layer.layer_number}/"
                self.rows.append(dict(bench="recall_trajectory", predictor_input=self.tag, step=step + 1,
                                      layer=layer.layer_number, stage=int(metrics["dsv/stage"]),
                                      **{k: metrics[p + k] for k in ("sparsity_measured", "sparsity", "budget_density",
                                                                     "recall", "sparse", "predictor_loss")}))
        if (step + 1) % self.every == 0:
            m = metrics or dsv_metrics(self.model)
            n_layers = len(dsv_layers(self.model))
            print(f" [{self.tag}] iteration {step + 1:6d} | ms/step {_median(self.ms[-self.every:]):8.1f} | "
                  f"loss {float(loss):.4f} | stage {int(m['dsv/stage'])} | sparsity {m['dsv/sparsity_mean']:.3f} "
                  f"(last {m['dsv/sparsity_measured_mean']:.3f}) | density {m['dsv/budget_density_mean']:.3f} | "
                  f"recall {m['dsv/recall_mean']:.3f} | sparse layers {round(m['dsv/sparse_fraction'] * n_layers)}/"
                  f"{n_layers}", flush=True)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _set_method_work(layers, on: bool):
    for layer in layers:
        layer.predictor_training = on
        layer.profiling = on


def _set_dense(layers, dense: bool):
    for layer in layers:
        layer.force_dense = dense


def _overhead_ab(model, layers, data, args, dsv, dtype, device, first_step):
    """A/B of the method's own work on stage-2 steps (module docstring), plus arm C: the same steps
    all dense with the method off (the dense baseline of the stage-2 speedup); returns columns."""
    arm = {"a": [], "b": [], "c": []}
    step, half = first_step, max(1, args.timing_steps // 2)
    for _ in range(2):  # alternate rounds: drift in clocks or allocator state hits every arm
        for name in ("a", "b", "c"):
            _set_method_work(layers, name == "a")
            _set_dense(layers, name == "c")
            times = _train(model, data, half, dtype, device, args, first_step=step)
            arm[name] += [(step + i, t) for i, t in enumerate(times)]
            step += half
    _set_method_work(layers, True)
    _set_dense(layers, False)
    base = _median([t for _, t in arm["b"]])
    dense = _median([t for _, t in arm["c"]])
    trained = [t for s, t in arm["a"] if trains_predictor(s, 2, dsv) and not is_profile_step(s, dsv)]
    idle = [t for s, t in arm["a"] if not trains_predictor(s, 2, dsv) and not is_profile_step(s, dsv)]
    profiled = [t for s, t in arm["a"] if is_profile_step(s, dsv)]
    interval = dsv.predictor_train_interval
    train_ms = (_median(trained) - base) if trained and interval else 0.0
    idle_ms = (_median(idle) - base) if idle else 0.0  # what a step pays with the method idle (~0)
    prof_extra = (_median(profiled) - (_median(trained) if trained else base)) if profiled else float("nan")
    freq = 1.0 / interval if interval else 0.0
    per_step = freq * train_ms + (1 - freq) * idle_ms + prof_extra / DSVConfig().profile_interval_after_warmup
    return dict(ms_step=base, ms_step_dsv_off=base, ms_step_dense=dense, stage2_step_speedup=dense / base,
                ms_step_train=_median(trained) if trained else None,
                ms_step_idle=_median(idle) if idle else None, ms_step_profile=_median(profiled) if profiled else None,
                ab_steps_per_arm=len(arm["a"]), predictor_overhead_ms=per_step,
                predictor_overhead_pct_all_layers=100.0 * per_step / base), step


def run(args, predictor_input: str):
    from megatron_dsv.data.synthetic import SyntheticVideoDataset
    from megatron_dsv.models.dit_config import VideoDiTConfig
    from megatron_dsv.models.video_dit import build_video_dit

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    overrides = dict(latent_frames=args.grid[0], latent_height=args.grid[1], latent_width=args.grid[2])
    if args.preset == "tiny":
        overrides.update(heads=2, head_dim=64)  # tiny's head_dim 32 has no sparse kernel
    if args.layers:
        overrides.update(layers=args.layers)
    cfg = VideoDiTConfig.from_preset(args.preset, **overrides)
    stage1 = args.steps // 2 if args.stage1_steps is None else args.stage1_steps
    dsv = DSVConfig(predictor_input=predictor_input, stage_switch_rule="steps", stage_switch_steps=stage1,
                    profile_interval=args.profile_every, profile_warmup_steps=10**9,
                    predictor_query_stride=args.query_stride, predictor_lr=args.predictor_lr,
                    query_group_shape=tuple(args.cube), granularity=args.granularity, kv_block_size=args.kv_block,
                    speedup_table=args.speedup_table, budget_rule=args.budget_rule, recall_target=args.recall_target,
                    predictor_train_interval=args.train_interval)
    torch.manual_seed(args.seed)
    model = build_video_dit(cfg, dsv_config=dsv, dtype=dtype).to(device)
    model.train()
    data = _DeviceSamples(SyntheticVideoDataset(args.samples, channels=cfg.in_channels, frames=args.grid[0],
                                                height=args.grid[1], width=args.grid[2], seed=args.seed,
                                                num_classes=min(cfg.num_classes, 8),  # 4 shapes x 2 motions
                                                background=args.background), args.batch, device, dtype)
    trajectory = _Trajectory(model, dsv, args.log_every, predictor_input)
    _train(model, data, args.steps, dtype, device, args, log=trajectory)
    if dsv_stage(model) != 2:
        raise SystemExit(f"--stage1-steps ({stage1}) must be < --steps ({args.steps}): the bench measures stage 2")
    layers = dsv_layers(model)
    ab, next_step = _overhead_ab(model, layers, data, args, dsv, dtype, device, args.steps)
    metrics = dsv_metrics(model)
    # per-layer timings with a device sync around every predictor / profiler call (extra columns)
    timers = _Timers(layers)
    n = args.timing_steps
    _train(model, data, n, dtype, device, args, first_step=next_step)
    S = cfg.token_grid()[0] * cfg.token_grid()[1] * cfg.token_grid()[2]
    flops = predictor_flops_per_token(predictor_input, cfg.heads, cfg.head_dim, cfg.hidden, dsv.predictor_rank)
    profiles = max(1, sum(1 for s in range(next_step, next_step + n) if is_profile_step(s, dsv)))
    rows = []
    for layer in layers:
        p = f"dsv/layer{layer.layer_number}/"
        pred_ms = timers.ms[(layer.layer_number, "predictor")] / n
        prof_ms = timers.ms[(layer.layer_number, "profile")] / profiles / DSVConfig().profile_interval_after_warmup
        rows.append(dict(
            bench="recall", preset=args.preset, predictor_input=predictor_input, layer=layer.layer_number,
            S=S, H=cfg.heads, D=cfg.head_dim, B=args.batch, hidden=cfg.hidden, rank=dsv.predictor_rank,
            granularity=dsv.granularity, kv_block=dsv.kv_block_size, cube="x".join(map(str, dsv.query_group_shape)),
            budget_rule=dsv.budget_rule, recall_target=dsv.recall_target, train_interval=dsv.predictor_train_interval,
            layers=cfg.layers, background=args.background, samples=args.samples, lr=args.lr, warmup=args.warmup,
            stage1_steps=stage1, steps=args.steps, seed=args.seed, stage=dsv_stage(model),
            recall=metrics[p + "recall"], sparsity_measured=metrics[p + "sparsity_measured"],
            sparsity=metrics[p + "sparsity"], budget_density=metrics[p + "budget_density"],
            sparse=bool(metrics[p + "sparse"]), k_mean=metrics[p + "k_mean"],
            predictor_loss=metrics[p + "predictor_loss"], predictor_flops_per_token=flops,
            recall_per_mflop=metrics[p + "recall"] / (flops / 1e6), **ab,
            ms_predictor_synced=pred_ms, ms_profile_amortised_synced=prof_ms,
            predictor_overhead_pct_synced=100.0 * (pred_ms + prof_ms) / ab["ms_step"]))
    total_ms = sum(r["ms_predictor_synced"] + r["ms_profile_amortised_synced"] for r in rows)
    for r in rows:
        r["predictor_overhead_pct_all_layers_synced"] = 100.0 * total_ms / ab["ms_step"]
    return rows


def _stop_on_sigterm(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--grid", type=int, nargs=3, default=[8, 16, 16], help="latent frames, height, width")
    lib = DSVConfig()  # the library's defaults are the bench's defaults
    ap.add_argument("--cube", type=int, nargs=3, default=list(lib.query_group_shape), help="query-group cube (t, h, w)")
    ap.add_argument("--granularity", choices=["block", "token"], default=lib.granularity)
    ap.add_argument("--kv-block", type=int, choices=[64, 128], default=lib.kv_block_size,
                    help="KV block size (block granularity)")
    ap.add_argument("--budget-rule", choices=["recall", "sparsity"], default=lib.budget_rule)
    ap.add_argument("--recall-target", type=float, default=lib.recall_target)
    ap.add_argument("--train-interval", type=int, default=lib.predictor_train_interval,
                    help="stage-2 predictor training period (DSVConfig.predictor_train_interval)")
    ap.add_argument("--steps", type=int, default=200, help="training steps before the timed ones")
    ap.add_argument("--stage1-steps", type=int, default=None, help="steps in stage 1 (default: half of --steps)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the model")
    ap.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--log-every", type=int, default=50, help="progress line period (steps)")
    ap.add_argument("--timing-steps", type=int, default=20, help="steps per A/B arm (two rounds each)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=64, help="synthetic videos (rendered once, cycled)")
    ap.add_argument("--background", choices=BACKGROUNDS, default="gradient",
                    help="synthetic videos' background (SyntheticVideoDataset)")
    ap.add_argument("--query-stride", type=int, default=DSVConfig().predictor_query_stride,
                    help="sample 1 query in this many (default: the library default)")
    ap.add_argument("--profile-every", type=int, default=5)
    ap.add_argument("--predictor-lr", type=float, default=3e-3)
    ap.add_argument("--predictor-input", choices=["qk", "hidden", "both"], default="both")
    ap.add_argument("--speedup-table", default=None)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, 4x16x16 latents, 30 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.grid, args.steps, args.timing_steps, args.batch = "tiny", [4, 16, 16], 30, 8, 1
        args.profile_every = 2
    init_dist()
    inputs = ["qk", "hidden"] if args.predictor_input == "both" else [args.predictor_input]
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        rows = [row for name in inputs for row in run(args, name)]
    finally:  # the trajectory so far is worth keeping even when the run is cut short
        if _TRAJECTORY_ROWS:
            print("wrote", write_results("recall_trajectory", _TRAJECTORY_ROWS, args.out_dir))
    for r in rows:
        print(f"{r['predictor_input']:>6} layer {r['layer']:2d}  recall {r['recall']:.3f}  sparsity {r['sparsity']:.3f}  "
              f"density {r['budget_density']:.3f}  sparse {int(r['sparse'])}  loss {r['predictor_loss']:.4f}  "
              f"synced {r['predictor_overhead_pct_synced']:.2f}%  "
              f"recall/MFLOP {r['recall_per_mflop']:.4f}")
    for name in inputs:
        mine = [r for r in rows if r["predictor_input"] == name]
        print(f"{name:>6} all layers: mean recall {sum(r['recall'] for r in mine) / len(mine):.3f}, predictor + "
              f"profiler {mine[0]['predictor_overhead_pct_all_layers']:.1f}% of a {mine[0]['ms_step']:.1f} ms step "
              f"(A/B; synced per-layer sum {mine[0]['predictor_overhead_pct_all_layers_synced']:.1f}%)")
        print(f"{name:>6} stage-2 step {mine[0]['ms_step']:.1f} ms vs {mine[0]['ms_step_dense']:.1f} ms all dense "
              f"(x{mine[0]['stage2_step_speedup']:.2f})")
    print("wrote", write_results("recall", rows, args.out_dir))


if __name__ == "__main__":
    main()

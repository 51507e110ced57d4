"""Does attention become sparse? The exact theta=0.9 sparsity of every layer over training, per arm.

Each arm (``benchmarks/video_runs.py`` documents the ``key=value`` syntax) trains the video DiT with
DSV attention on one data source at one sequence length, and every profile (``--profile-every``
steps) measures each layer's exact sparsity on sampled queries (the profiler's oracle, never the
predictor). Arms differ in data (synthetic panning textures, ViZDoom, ALE), tokens, QK-norm,
learning rate and RoPE base. DSV's stage 2 starts at ``stage1`` steps, so the same runs also show
how many layer-steps the dispatcher ran sparse and the recall of the lists it used.

Writes ``benchmarks/results/sparsity_emergence-<gpu>-<yyyymmdd>.json`` (rows: ``arm``, ``data``,
``S``, ``preset``, ``layers``, ``step``, ``sparsity_mean``, per-layer ``sparsity``, ``stage``,
``recall``, ``sparse_layers``, per-layer ``budget_density_layers`` (the recall-rule lists' kept
fraction: against ``1 - sparsity`` it shows how much one list per query group multiplies a query's
share) and ``budget_density_measured_layers`` (the last profile's, before the budgets' smoothing, which
rises at once and falls with the momentum); one ``final`` row per arm with the run's summary) and a PNG of mean
and best-layer sparsity over steps per arm. The JSON is rewritten after every arm, so a run cut
short keeps what it measured.

    PYTHONPATH=. python benchmarks/bench_sparsity_emergence.py --quick              # CPU check
    PYTHONPATH=. python benchmarks/bench_sparsity_emergence.py \\
        --arm data=vizdoom,frames=32,res=256,steps=2000,minutes=4 --arm data=ale,frames=32,res=256  # H200

After step 1, then every ``--sweep-every`` steps, and at the end, a *sweep* probes the held-out clips at fixed flow-matching
times t (``--sweep-t``), every layer dense: ``kind="sweep"`` rows with, per layer, the exact sparsity, the
logits' spread over the keys (``logit_std``, mean over sampled queries and heads), the sparsity that
spread would give Gaussian logits (``gaussian_sparsity``: how much of the sparsity is scale, how much
tail) and the QK-norm gain factor (``qk_gain``). At the t nearest 0.5 the row also carries
``list_density``: per list shape (one query; one token list per 32 queries; per query group; per group
as whole key blocks), per layer, the kept fraction an oracle's lists need for the layer's
``recall_target`` (the budgets' recall) of the critical mass (``analysis.oracle_list_density``): which
step from a query's own need to the layer's budgets costs the keys; and ``predictor_list_density``: the
same per layer for the layer's group as token lists and as key blocks when the layer's own predictor
ranks the items, as the profiler does, on the same queries (``analysis.predictor_list_density``; never
below the oracle's value of the same name): what the predictor's ranking costs over the oracle's; its
``exact_<shape>`` entries rank by the same rule on the exact logits (full rank), which splits that cost
into the low rank's and the ranking rule's (one proxy query per group, a block's max). The
sweeps are plotted in ``..._sweep.png``.

Runs spread over several GPU calls (concurrent processes, a resumed arm) are merged into one file and
one plot with ``--merge PART.json ... --out FILE.json``; a call whose JSON did not come back can add
its log (``--log``): the iteration lines every ``--log-every`` steps become ``kind="log"`` rows with
the last profile's mean sparsity (no per-layer values).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_dist, write_results  # noqa: E402
from benchmarks.video_runs import (Clips, add_run_args, layer_sparsity, parse_arm, qk_gains, tokens_of,  # noqa: E402
                                   train_arm)
from megatron_dsv.attention import dsv_layers, dsv_metrics  # noqa: E402
from megatron_dsv.attention.analysis import (capture_qk, gaussian_sparsity, layer_list_densities,  # noqa: E402
                                             logit_spread, ranked_label, sample_queries)
from megatron_dsv.ops.topk_estimation.oracle import head_sparsity  # noqa: E402

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
                budget_density_layers=[m[f"dsv/layer{layer.layer_number}/budget_density"]
                                       for layer in dsv_layers(model)],
                budget_density_measured_layers=[m[f"dsv/layer{layer.layer_number}/budget_density_measured"]
                                                for layer in dsv_layers(model)],
                recall=m["dsv/recall_mean"], sparse_layers=round(m["dsv/sparse_fraction"] * n),
                predictor_loss=m["dsv/predictor_loss"])


def _sparsity_axes(ax, xlabel: str, ylabel: str) -> None:
    """The study's sparsity axes: 0..1, the dispatcher's 0.8 line, grid, legend."""
    ax.axhline(0.8, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


@torch.no_grad()
def sweep(arm, args, step, model) -> list:
    """``kind="sweep"`` rows at ``step``: per t of ``args.sweep_t``, per layer, on ``args.sweep_clips``
    held-out clips with fixed noise (seed 4321), every layer dense (see the module docstring)."""
    from megatron_dsv.models.video_dit import unwrap_video_dit

    dc = unwrap_video_dit(model).dit_config
    lat0 = next(model.parameters())
    clips = Clips.for_arm(arm, args, dc.in_channels, lat0.device, lat0.dtype)
    idx = list(range(clips.n_train, min(clips.latents.shape[0], clips.n_train + args.sweep_clips)))
    x0, labels = clips.latents[idx].float(), clips.labels[idx]
    g = torch.Generator(device=x0.device).manual_seed(4321)
    noise = torch.randn(x0.shape, generator=g, device=x0.device)
    gains = qk_gains(model)
    layers = {layer.layer_number: layer for layer in dsv_layers(model)}  # capture_qk's keys
    cfg = next(iter(layers.values())).dsv_config
    t_lists = min(args.sweep_t, key=lambda t: abs(t - 0.5))  # the list decomposition at one t (it costs most)
    rows = []
    for t in args.sweep_t:
        x_t = ((1 - t) * x0 + t * noise).to(clips.latents.dtype)
        captured = capture_qk(model, x_t, torch.full((len(idx),), float(t), device=x0.device), labels,
                              with_hidden=True)
        sp, std, gauss, lists, predicted = [], [], [], {}, {}
        for n in sorted(captured):
            q, k, hidden = captured.pop(n)  # hidden: None unless predictor_input='hidden'
            layer = layers[n]
            qi = sample_queries(q.shape[2], 8, 512, device=q.device)
            spread = logit_spread(q, k, qi)
            sp.append(float(head_sparsity(q, k, 0.9, query_index=qi).mean()))
            std.append(float(spread.mean()))
            gauss.append(float(gaussian_sparsity(spread, 0.9).mean()))
            if t == t_lists:  # the same queries, theta and scale for the oracle and the predictor
                oracle, ranked = layer_list_densities(layer, q, k, hidden, 0.9, args.sweep_groups)
                for name, dens in oracle.items():
                    lists.setdefault(name, []).append(float(dens.mean()))
                for name, dens in ranked.items():
                    predicted.setdefault(name, []).append(float(dens.mean()))
        row = dict(kind="sweep", bench="sparsity_emergence", arm=arm["label"], data=arm["data"],
                   S=tokens_of(arm), step=step, t=float(t), clips=len(idx), sparsity=sp,
                   sparsity_mean=sum(sp) / len(sp), logit_std=std, gaussian_sparsity=gauss, qk_gain=gains)
        if t == t_lists:
            row["list_density"], row["predictor_list_density"] = lists, predicted
        rows.append(row)
    print(f" [{arm['label']}] sweep at step {step}: " + ", ".join(
        f"t={r['t']:g} sparsity {r['sparsity_mean']:.3f} (logit std {sum(r['logit_std']) / len(r['logit_std']):.2f}, "
        f"gaussian {sum(r['gaussian_sparsity']) / len(r['gaussian_sparsity']):.3f})" for r in rows)
        + (f", qk gain {sum(gains) / len(gains):.3f}" if gains else "")
        + f"; oracle kept fraction at recall {cfg.recall_target:g}, t={t_lists:g}: " + ", ".join(
            f"{name} {sum(v) / len(v):.3f}" for r in rows if "list_density" in r
            for name, v in r["list_density"].items())
        + "; predictor kept fraction: " + ", ".join(
            f"{name} {sum(v) / len(v):.3f}" for r in rows if "predictor_list_density" in r
            for name, v in r["predictor_list_density"].items()),
        flush=True)
    return rows


def plot_sweeps(rows, path) -> bool:
    """Left: mean sparsity vs t at each arm's last sweep. Middle: measured vs Gaussian-predicted sparsity,
    one point per layer and sweep, coloured by step. Right (when sweeps carry ``list_density``): at each
    arm's last such sweep, the kept fraction, mean over layers, from a query's critical share through the
    oracle's list shapes and the predictor's to the profiler's budgets. False when there are no sweep rows."""
    sweeps = [r for r in rows if r.get("kind") == "sweep"]
    if not sweeps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lists = [r for r in sweeps if r.get("list_density")]
    fig, axes = plt.subplots(1, 3 if lists else 2, figsize=(18 if lists else 12, 5))
    ax, bx = axes[0], axes[1]
    if lists:
        _plot_list_costs(axes[2], rows, lists)
    arms = list(dict.fromkeys(r["arm"] for r in sweeps))
    for i, name in enumerate(arms):
        mine = [r for r in sweeps if r["arm"] == name]
        last = max(r["step"] for r in mine)
        pts = sorted((r["t"], r["sparsity_mean"]) for r in mine if r["step"] == last)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i % 10}", label=f"{name} @ {last}")
    _sparsity_axes(ax, "flow-matching t (0 data, 1 noise)", "exact sparsity at theta = 0.9, mean over layers")
    steps = [r["step"] for r in sweeps]
    xs = [v for r in sweeps for v in r["gaussian_sparsity"]]
    ys = [v for r in sweeps for v in r["sparsity"]]
    cs = [r["step"] for r in sweeps for _ in r["sparsity"]]
    sc = bx.scatter(xs, ys, c=cs, s=10, cmap="viridis", vmin=min(steps), vmax=max(steps))
    bx.plot([0, 1], [0, 1], color="grey", lw=0.8)
    bx.set_xlabel("Gaussian prediction Phi(logit std - 1.28)")
    bx.set_ylabel("measured exact sparsity (per layer)")
    bx.set_xlim(0, 1)
    bx.set_ylim(0, 1)
    bx.grid(alpha=0.3)
    fig.colorbar(sc, ax=bx, label="training step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_list_costs(ax, rows, lists) -> None:
    """Bars per arm (its last sweep with ``list_density``): ``1 - sparsity`` (a query's theta-critical
    share), each oracle list shape's kept fraction at the budgets' recall target, the predictor's own
    (``pred ...``, where the rows carry ``predictor_list_density``; files written before have none), and
    the budget density of the arm's profile nearest that step (the predictor's lists); all means over
    layers. The dispatcher's 0.2 line. Shapes are the union over the arms (a token-list arm has no block
    shape in the oracle's decomposition): a shape an arm lacks gets no bar."""
    def mean_of(dens, name):
        v = (dens or {}).get(name)
        return sum(v) / len(v) if v else float("nan")

    shapes = list(dict.fromkeys(n for r in lists for n in r["list_density"]))
    predicted = list(dict.fromkeys(n for r in lists for n in r.get("predictor_list_density") or {}))
    predicted.sort(key=lambda n: not n.startswith("exact_"))  # the exact logits' ranking, then the predictor's
    names = ["critical (1 - sparsity)", *shapes, *map(ranked_label, predicted), "budgets (predictor)"]
    arms = list(dict.fromkeys(r["arm"] for r in lists))
    width = 0.8 / len(arms)
    for i, name in enumerate(arms):
        row = max((r for r in lists if r["arm"] == name), key=lambda r: r["step"])
        profiles = [r for r in rows if r.get("kind") == "profile" and r["arm"] == name and "budget_density" in r]
        near = min(profiles, key=lambda r: abs(r["step"] - row["step"])) if profiles else None
        vals = [1.0 - row["sparsity_mean"], *[mean_of(row["list_density"], n) for n in shapes],
                *[mean_of(row.get("predictor_list_density"), n) for n in predicted],
                near["budget_density"] if near else float("nan")]
        ax.bar([j + i * width for j in range(len(vals))], vals, width, color=f"C{i % 10}",
               label=f"{name} @ {row['step']}")
    ax.axhline(0.2, color="grey", lw=0.8, ls=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("kept fraction of keys (mean over layers)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot(rows, path):
    """Mean (solid) and best-layer (dashed) exact sparsity over steps, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    arms = list(dict.fromkeys(r["arm"] for r in rows if r.get("kind") in ("profile", "log")))
    for i, name in enumerate(arms):
        mine = [r for r in rows if r["arm"] == name and r.get("kind") in ("profile", "log")]
        color = f"C{i % 10}"
        from_log = all(r["kind"] == "log" for r in mine)
        ax.plot([r["step"] for r in mine], [r["sparsity_mean"] for r in mine], color=color,
                label=name + (" (from log)" if from_log else ""), marker="." if from_log else None)
        best = [r for r in mine if "sparsity_max" in r]
        ax.plot([r["step"] for r in best], [r["sparsity_max"] for r in best], color=color, ls="--", lw=0.8)
    _sparsity_axes(ax, "training step", "exact sparsity at theta = 0.9 (mean; dashed: best layer)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_LOG_LINE = re.compile(r"\[(?P<arm>[^\]]+)\] iteration\s+(?P<step>\d+)/\d+ .*\| loss (?P<loss>[\d.]+) \| stage (?P<stage>\d) "
                       r"\| sparsity (?P<sp>[\d.]+) \(smoothed (?P<sm>[\d.]+)\) \| density (?P<dens>[\d.]+) \| "
                       r"recall (?P<rec>[\d.]+) \| sparse layers (?P<nsp>\d+)/(?P<n>\d+)")


def rows_from_log(path: str) -> list:
    """``kind="log"`` rows from a run's iteration lines (for a call whose JSON was lost; no per-layer values)."""
    rows = []
    with open(path) as f:
        for line in f:
            m = _LOG_LINE.search(line)
            if m:
                rows.append(dict(kind="log", bench="sparsity_emergence", arm=m["arm"], step=int(m["step"]),
                                 layers=int(m["n"]), stage=int(m["stage"]), loss=float(m["loss"]),
                                 sparsity_mean=float(m["sp"]), sparsity_smoothed=float(m["sm"]),
                                 budget_density=float(m["dens"]), recall=float(m["rec"]),
                                 sparse_layers=int(m["nsp"]), source=os.path.basename(path)))
    if not rows:
        raise ValueError(f"--log {path!r} holds no iteration lines of a DSV run")
    return rows


def merge(parts: list, logs: list, note: str = "") -> dict:
    """One result from several: rows of every part and log, de-duplicated by (arm, step, kind, t), in step order.

    ``meta`` is the newest part's, with ``parts`` listing each input file, its date and its arms.
    """
    rows, listed, newest = {}, [], None
    for path in parts:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "rows" not in data or "meta" not in data:
            raise ValueError(f"--merge {path!r} is not a benchmark result (a JSON object with meta and rows)")
        for sub in data["meta"].get("parts", []):  # an earlier merge: keep its list
            listed.append(sub)
        if not data["meta"].get("parts"):
            listed.append(dict(file=os.path.basename(path), date=data["meta"].get("date"),
                               arms=sorted({r["arm"] for r in data["rows"]})))
        if newest is None or str(data["meta"].get("date")) > str(newest.get("date")):
            newest = data["meta"]
        for r in data["rows"]:
            rows.setdefault((r["arm"], r["step"], r.get("kind"), r.get("t")), r)
    for path in logs:
        log_rows = rows_from_log(path)
        listed.append(dict(file=os.path.basename(path), arms=sorted({r["arm"] for r in log_rows}), kind="log"))
        for r in log_rows:
            rows.setdefault((r["arm"], r["step"], r["kind"], None), r)
    meta = dict(newest or {}, parts=listed)
    if note:
        meta["note"] = note
    return dict(meta=meta, rows=sorted(rows.values(), key=lambda r: (r["arm"], r["step"], str(r.get("kind")))))


def _stop(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--arm", action="append", default=[], help="an arm (repeatable; video_runs.py has the keys)")
    ap.add_argument("--tag", default="", help="suffix of the result file name (sparsity_emergence<tag>-...)")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, two small arms")
    ap.add_argument("--sweep-every", type=int, default=1000,
                    help="steps between sweeps over t, from step 1 (a multiple of --profile-every; 0: only at the end)")
    ap.add_argument("--sweep-t", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                    help="flow-matching times of a sweep")
    ap.add_argument("--sweep-clips", type=int, default=2, help="held-out clips per sweep (at most --val-samples)")
    ap.add_argument("--sweep-groups", type=int, default=16,
                    help="query groups (whole, evenly spread) of a sweep's list decomposition, at the t nearest 0.5")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PART.json",
                    help="merge these result files (and --log files) into --out instead of training")
    ap.add_argument("--log", nargs="+", default=[], help="with --merge: run logs whose JSON was lost")
    ap.add_argument("--out", default=None, help="with --merge: the merged JSON (its PNG is written beside it)")
    ap.add_argument("--note", default="", help="with --merge: meta note (how the parts ran)")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out FILE.json")
        merged = merge(args.merge, args.log, args.note)
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)
        plot(merged["rows"], args.out.replace(".json", ".png"))
        plot_sweeps(merged["rows"], args.out.replace(".json", "_sweep.png"))
        print(f"wrote {args.out}: {len(merged['rows'])} rows, arms {sorted({r['arm'] for r in merged['rows']})}")
        return
    if args.quick:
        args.preset, args.layers, args.samples, args.val_samples = "tiny", 2, 4, 1
        args.profile_every, args.log_every, args.val_every, args.warmup = 3, 6, 6, 2
        args.sweep_every, args.sweep_t, args.sweep_clips = 6, [0.2, 0.8], 1
        args.arm = args.arm or list(QUICK_ARMS)
    if not args.arm:
        ap.error("give at least one --arm (or --quick)")
    if args.sweep_every < 0 or (args.sweep_every and args.sweep_every % args.profile_every):
        ap.error(f"--sweep-every must be 0 or a multiple of --profile-every ({args.profile_every}), "
                 f"got {args.sweep_every}")
    if not all(0.0 <= t <= 1.0 for t in args.sweep_t):
        ap.error(f"--sweep-t values must be in [0, 1], got {args.sweep_t}")
    if not 1 <= args.sweep_clips <= args.val_samples:
        ap.error(f"--sweep-clips must be in [1, --val-samples={args.val_samples}], got {args.sweep_clips}")
    if args.sweep_groups < 1:
        ap.error(f"--sweep-groups must be >= 1, got {args.sweep_groups}")
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
                if args.sweep_every and (step - 1) % args.sweep_every == 0:  # profiles come after steps 1, 1 + P, ...
                    rows.extend(sweep(arm, args, step, model))

            def on_val(step, loss, counters, breakdown, arm=arm):
                rows.append(dict(kind="val", bench="sparsity_emergence", arm=arm["label"], step=step, val_loss=loss))

            model, _, summary = train_arm(arm, args, on_profile=on_profile, on_val=on_val)
            rows.append({"kind": "final", **_row(arm, args, summary["steps"], model), **summary})
            if not any(r.get("kind") == "sweep" and r["arm"] == arm["label"] and r["step"] == summary["steps"]
                       for r in rows):
                rows.extend(sweep(arm, args, summary["steps"], model))
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
                plot_sweeps(rows, str(path).replace(".json", "_sweep.png"))
            except ImportError as err:
                print(f"no plot ({err}): pip install -e '.[plots]'")
            print("wrote", path)


if __name__ == "__main__":
    main()

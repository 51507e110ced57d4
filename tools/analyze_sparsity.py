#!/usr/bin/env python
"""Attention-sparsity analysis of a video DiT with DSV attention: JSON and plots.

    python tools/analyze_sparsity.py --load runs/tiny/checkpoints --samples 2 --out-dir analysis/tiny
    python tools/analyze_sparsity.py --preset tiny --dsv-query-group-shape 1 4 4 --out-dir /tmp/a
    python tools/analyze_sparsity.py --pretrained wan-1.3b-megatron --grid 21 60 104 --bf16 --out-dir analysis/wan

Probes attention at one flow-matching time t (x_t = (1 - t) x0 + t noise, as in training) on a
few videos, measures per layer and head what DSV rests on (megatron_dsv.attention.analysis):
exact sparsity at theta, softmax mass vs keys kept, distances to critical keys, critical-set
overlap inside a query group, the recall of the layer predictor's lists, and the logits' spread with
the sparsity Gaussian logits of that spread would have (is the sparsity scale or tail?). Writes
``analysis.json`` and PNGs to --out-dir: sparsity_heatmap, mass_curves, distance_histogram,
cube_overlap, list_costs (the kept fraction from a query's own need through oracle lists shared by a
query group, token or block lists, and the same lists ranked by the predictor, to the predictor's
budgets), predictor_recall, and sparsity_trajectory with --trajectory (a benchmarks/bench_recall.py
trajectory JSON). The --dsv-* flags (the trainer's) configure a
--preset model and a --pretrained one; a --load checkpoint brings its own. Needs matplotlib (pip install -e .[plots]).

--pretrained DIR analyses a converted Wan2.1 checkpoint (tools/convert_checkpoint.py to-megatron) before any
training: its weights with DSV attention of the --dsv-* flags and fresh DSV state (the predictors are
untrained, so their recall is an untrained predictor's; the sparsity, mass and distance figures are the
pretrained model's own). With --data synthetic its text is synthetic too: --text-tokens random-normal
embeddings zero-padded to --text-len (Wan pads its umT5 text with zeros to 512), not umT5's; latent shards
bring their own text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dsv.arguments import add_dsv_args, dsv_config_from_args  # noqa: E402

USAGE = ("analyze_sparsity.py (--load CKPT_DIR | --pretrained WAN_DIR | --preset {tiny,0.8b,2.7b,30b}) "
         "[--data synthetic|SHARD_DIR] "
         "[--samples N] [--timestep T] [--theta THETA] [--trajectory JSON] [--out-dir DIR] [options] [--dsv-* flags]")
TRAJECTORY_RUN_KEYS = ("arm", "predictor_input")  # columns that separate runs in one trajectory file


def _key_value(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), value.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(usage=USAGE, description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", metavar="CKPT_DIR",
                     help="checkpoint written by `python -m megatron_dsv.train --save DIR` (the root: newest "
                          "iteration, or one iter_* folder); the model, its DSV config and state come from it")
    src.add_argument("--preset", choices=["tiny", "0.8b", "2.7b", "30b"],
                     help="a live, freshly initialised model of this preset (smoke tests); its DSV config "
                          "comes from the --dsv-* flags")
    src.add_argument("--pretrained", metavar="WAN_DIR",
                     help="a converted Wan2.1 checkpoint (`python tools/convert_checkpoint.py to-megatron`): its "
                          "wan_config.json and weights, DSV attention from the --dsv-* flags, DSV state fresh "
                          "(sparsity before any training)")
    p.add_argument("--model-override", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="with --preset: override one VideoDiTConfig field (repeatable), e.g. layers=2")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' (default: megatron_dsv.data.SyntheticVideoDataset at the model's grid) or "
                        "a folder of latent shards (megatron_dsv.data.LatentShardDataset)")
    p.add_argument("--grid", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                   help="latent grid of the synthetic videos (default: the model's)")
    p.add_argument("--background", choices=["gradient", "texture"], default="gradient",
                   help="synthetic videos' background (default gradient)")
    p.add_argument("--text-len", type=int, default=512,
                   help="--pretrained with --data synthetic: text length (default 512, Wan's zero-padded length)")
    p.add_argument("--text-tokens", type=int, default=32,
                   help="--pretrained with --data synthetic: random-normal text embeddings before the zero padding "
                        "(default 32)")
    p.add_argument("--samples", type=int, default=2, help="videos in the probed batch (default 2)")
    p.add_argument("--timestep", type=float, default=0.5,
                   help="flow-matching t in [0, 1] at which attention is probed (default 0.5; 1 = pure noise)")
    p.add_argument("--theta", type=float, default=0.9, help="softmax mass of a critical set (default 0.9)")
    p.add_argument("--query-stride", type=int, default=8, help="sample one query in this many (default 8)")
    p.add_argument("--max-queries", type=int, default=512, help="at most this many sampled queries (default 512)")
    p.add_argument("--bins", type=int, default=32, help="bins of the distance histogram (default 32)")
    p.add_argument("--radius", type=float, default=5.0,
                   help="radius in tokens for the 'critical keys nearby' share (default 5)")
    p.add_argument("--trajectory", metavar="JSON", default=None,
                   help="optional benchmarks/bench_recall.py trajectory file: plot sparsity over training per layer")
    p.add_argument("--trajectory-metric", default="sparsity",
                   help="trajectory column to plot (default sparsity, the smoothed one; or sparsity_measured)")
    p.add_argument("--out-dir", default="analysis", help="output folder (default ./analysis)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda when available")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16 (GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise, the samples and a --preset model")
    add_dsv_args(p)  # --dsv-*: the live model's DSVConfig (--use-dsv-attention is implied)
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    if not 0.0 <= args.timestep <= 1.0:
        p.error(f"--timestep must be in [0, 1], got {args.timestep}")
    if not 0.0 < args.theta <= 1.0:
        p.error(f"--theta must be in (0, 1], got {args.theta}")
    for name in ("query_stride", "max_queries", "bins"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.model_override and not args.preset:
        p.error("--model-override applies to --preset only (a checkpoint carries its own model config)")
    if not 1 <= args.text_tokens <= args.text_len:
        p.error(f"--text-tokens must be in [1, --text-len = {args.text_len}], got {args.text_tokens}")
    if args.pretrained and not os.path.isfile(os.path.join(args.pretrained, "wan_config.json")):
        p.error(f"--pretrained must be a converted Wan checkpoint folder (written by `python "
                f"tools/convert_checkpoint.py to-megatron`, holding wan_config.json), got {args.pretrained!r}")
    if args.trajectory and not os.path.isfile(args.trajectory):
        p.error(f"--trajectory {args.trajectory!r} is not a file")


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or a clear exit (checked before any model work)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("tools/analyze_sparsity.py needs matplotlib for its plots: pip install -e .[plots]")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------- model and batch
def _device(choice: str) -> torch.device:
    from megatron_dsv.training.distributed import resolve_device

    return resolve_device(choice)


def _init_megatron(args, device: torch.device) -> None:
    """One process group and Megatron's parallel state (as load_model_for_inference sets them up)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dsv.training.distributed import _init_default_group

    if not dist.is_initialized():
        _init_default_group("nccl" if device.type == "cuda" else "gloo", device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def _live_model(args, device: torch.device, dtype: torch.dtype):
    """A fresh VideoDiT of ``--preset`` with DSV attention."""
    import ast

    from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit

    overrides = {}
    for key, text in args.model_override:
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text
    _init_megatron(args, device)
    args.use_dsv_attention = True
    cfg = VideoDiTConfig.from_preset(args.preset, **overrides)
    return build_video_dit(cfg, dsv_config=dsv_config_from_args(args), dtype=dtype).to(device).eval()


def _pretrained_wan(args, device: torch.device, dtype: torch.dtype):
    """The Wan transformer of a converted checkpoint with its weights, DSV attention of the --dsv-* flags (fresh
    state: stage 1, untrained predictors); loaded in the checkpoint's dtype, then cast to ``dtype``."""
    import dataclasses

    from megatron_dsv.models.wan import build_wan
    from megatron_dsv.models.wan_convert import load_megatron_checkpoint, read_megatron_config

    _init_megatron(args, device)
    args.use_dsv_attention = True
    cfg, saved = read_megatron_config(args.pretrained)
    if args.grid:
        cfg = dataclasses.replace(cfg, latent_grid=tuple(args.grid))
    model = build_wan(cfg, dsv_config=dsv_config_from_args(args), dtype=saved, perform_initialization=False)
    load_megatron_checkpoint(model, args.pretrained)
    return model.to(device=device, dtype=dtype).eval()


def _model(args, device: torch.device):
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.pretrained:
        return (_pretrained_wan(args, device, dtype),
                f"converted Wan checkpoint {args.pretrained} (before training; DSV state fresh, predictors untrained)")
    if args.load:
        from megatron_dsv.training.checkpointing import load_model_for_inference

        model, _ = load_model_for_inference(args.load, device=device, dtype=dtype if args.bf16 else None)
        return model, f"checkpoint {args.load}"
    return _live_model(args, device, dtype), f"fresh {args.preset} model (--preset)"


def _dataset(args, cfg, num_classes: int):
    if args.data == "synthetic":
        from megatron_dsv.data.synthetic import SyntheticVideoDataset

        T, H, W = args.grid if args.grid else cfg.latent_grid
        return SyntheticVideoDataset(args.samples, channels=cfg.in_channels, frames=T, height=H, width=W,
                                     num_classes=min(max(num_classes, 1), 8), seed=args.seed,
                                     background=args.background)
    if args.grid:
        raise SystemExit("--grid applies to --data synthetic only (latent shards have their own grid)")
    from megatron_dsv.data.shards import LatentShardDataset

    return LatentShardDataset(args.data)


def _model_config(args, model):
    """(config, class count) of the model: a VideoDiT's dit_config, or a Wan transformer's wan_config (no classes)."""
    if args.pretrained:
        from megatron_dsv.models.wan import unwrap_wan

        return unwrap_wan(model).wan_config, 0
    from megatron_dsv.models.video_dit import unwrap_video_dit

    cfg = unwrap_video_dit(model).dit_config
    return cfg, cfg.num_classes


def synthetic_text(batch: int, length: int, tokens: int, dim: int, seed: int) -> torch.Tensor:
    """``[batch, length, dim]``: ``tokens`` random-normal embeddings, then zeros (Wan's padding of its umT5 text)."""
    text = torch.zeros(batch, length, dim)
    text[:, :tokens] = torch.randn(batch, tokens, dim, generator=torch.Generator().manual_seed(seed + 7))
    return text


def _batch(args, model, device: torch.device):
    """``(x_t, t, labels, text, text_mask)``: ``--samples`` videos noised to ``--timestep``."""
    cfg, num_classes = _model_config(args, model)
    ds = _dataset(args, cfg, num_classes)
    items = [ds[i % len(ds)] for i in range(args.samples)]
    x0 = torch.stack([it["latents"] for it in items]).float()
    labels = torch.stack([it["label"] for it in items]).clamp(max=num_classes) if num_classes > 0 else None
    text = text_mask = None
    dtype = next(model.parameters()).dtype
    if cfg.text_dim is not None and "text" in items[0]:
        text = torch.stack([it["text"] for it in items]).to(device)
        if "text_mask" in items[0]:
            text_mask = torch.stack([it["text_mask"] for it in items]).to(device)
    elif cfg.text_dim is not None and args.pretrained and args.data == "synthetic":
        text = synthetic_text(x0.shape[0], args.text_len, args.text_tokens, cfg.text_dim, args.seed).to(device, dtype)
    elif cfg.text_dim is not None:
        raise SystemExit("this model is text-conditioned: pass --data with latent shards that hold text")
    g = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(x0.shape, generator=g)
    x_t = (1.0 - args.timestep) * x0 + args.timestep * noise  # as video_dit.flow_matching_loss
    t = torch.full((x0.shape[0],), args.timestep, device=device)
    return (x_t.to(device, dtype), t, None if labels is None else labels.to(device), text, text_mask)


# ---------------------------------------------------------------- trajectory
def load_trajectory(path: str, metric: str = "sparsity") -> dict:
    """``{run: {layer: [(step, value), ...]}}`` from a results JSON (``{"meta", "rows"}``): rows with
    ``step``, ``layer`` and ``metric``; runs named by the first of TRAJECTORY_RUN_KEYS a row has."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"--trajectory {path!r} is not a readable JSON file: {err}")
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise SystemExit(f"--trajectory {path!r} must hold {{'meta': ..., 'rows': [...]}} (benchmarks/common.py)")
    runs: dict = {}
    for row in rows:
        if not isinstance(row, dict) or any(row.get(c) is None for c in ("step", "layer", metric)):
            continue
        run = next((f"{key}={row[key]}" for key in TRAJECTORY_RUN_KEYS if row.get(key) is not None), "run")
        runs.setdefault(run, {}).setdefault(int(row["layer"]), []).append((int(row["step"]), float(row[metric])))
    if not runs:
        raise SystemExit(f"--trajectory {path!r} has no rows with 'step', 'layer' and {metric!r}")
    for layers in runs.values():
        for points in layers.values():
            points.sort()
    return runs


def _trajectory_summary(runs: dict) -> dict:
    """Per run: median over layers of the metric at the first and the last step."""
    out = {}
    for run, layers in runs.items():
        first = sorted(p[0][1] for p in layers.values())
        last = sorted(p[-1][1] for p in layers.values())
        out[run] = {"layers": len(layers), "first_step": min(p[0][0] for p in layers.values()),
                    "last_step": max(p[-1][0] for p in layers.values()),
                    "median_first": first[len(first) // 2], "median_last": last[len(last) // 2]}
    return out


# ---------------------------------------------------------------- plots
def _layer_colors(plt, n: int):
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(1, n - 1)) for i in range(n)]


def _finish(plt, fig, ax, path: str, legend: bool) -> str:
    if legend:
        ax.legend(fontsize=7, ncol=2 if len(ax.get_lines()) > 8 else 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _heatmap(plt, out_dir: str, name: str, matrix, layers, title: str, label: str) -> str:
    rows = [[math.nan if v is None else v for v in row] for row in matrix]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(rows[0]) + 2.5), max(3.0, 0.3 * len(rows) + 1.5)))
    im = ax.imshow(rows, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
    fig.colorbar(im, ax=ax, label=label)
    ax.set_yticks(range(len(layers)), [str(n) for n in layers])
    ax.set_xticks(range(len(rows[0])))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    if len(rows) * len(rows[0]) <= 256:  # values readable only on small grids
        for i, row in enumerate(rows):
            for j, v in enumerate(row):
                ax.text(j, i, "" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 else "black")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(result: dict, out_dir: str, runs: Optional[dict] = None, metric: str = "sparsity") -> list:
    """Write the PNGs of ``result`` (the analysis dict) to ``out_dir``; returns their paths."""
    from megatron_dsv.attention.analysis import ranked_label

    plt = _pyplot()
    reps, theta = result["layers"], result["theta"]
    numbers = [r["layer"] for r in reps]
    colors = _layer_colors(plt, len(reps))
    few = len(reps) <= 16
    paths = [_heatmap(plt, out_dir, "sparsity_heatmap", [r["sparsity"] for r in reps], numbers,
                      f"exact sparsity at theta={theta:g} (median {result['summary']['sparsity_median']:.3f})",
                      "sparsity"),
             _heatmap(plt, out_dir, "predictor_recall", [r["predictor"]["recall"] for r in reps], numbers,
                      f"predictor recall of the theta={theta:g} critical mass at the layer's budgets", "recall")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, c in zip(reps, colors):
        ax.plot(r["mass_curve_mean"], result["key_fractions"], color=c, label=f"layer {r['layer']}")
    ax.axvline(theta, color="k", ls=":", lw=1)
    ax.axhline(0.1, color="gray", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("softmax mass held by the top keys (mean over sampled queries)")
    ax.set_ylabel("fraction of keys needed")
    ax.set_title(f"keys needed vs mass (S={result['S']}; dotted: theta, dashed: 10% of keys)", fontsize=10)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "mass_curves.png"), few))

    edges = result["distance_edges"]
    mids = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, c in zip(reps, colors):
        ax.plot(mids, r["distance_critical"], color=c, label=f"layer {r['layer']}")
    ax.plot(mids, reps[0]["distance_all_keys"], color="k", ls="--", label="all keys")
    ax.axvline(result["radius"], color="r", ls=":", lw=1)
    ax.set_xlabel("distance query -> key (tokens, 3D Euclidean)")
    ax.set_ylabel("share of (query, critical key) pairs")
    ax.set_title(f"distance to critical keys: {result['summary']['within_radius']:.1%} within "
                 f"{result['radius']:g} tokens", fontsize=10)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "distance_histogram.png"), few))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = list(range(len(reps)))
    get = lambda r, key: math.nan if r["cube_overlap"][key] is None else r["cube_overlap"][key]  # noqa: E731
    ax.bar([x - 0.2 for x in xs], [get(r, "jaccard_mean") for r in reps], width=0.4, label="Jaccard")
    ax.bar([x + 0.2 for x in xs], [get(r, "containment_mean") for r in reps], width=0.4, label="containment")
    ax.set_xticks(xs, [str(n) for n in numbers])
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer")
    ax.set_ylabel("critical-set overlap within a query group")
    ax.set_title(f"query groups of {reps[0]['cube_overlap']['group_size']} tokens (one cube), theta={theta:g}",
                 fontsize=10)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "cube_overlap.png"), True))

    # where the kept keys go: a query's critical share -> one oracle list per group -> blocks -> the predictor's
    # ranking of the same lists -> its budgets
    names = [n for n in reps[0]["list_density"] if n != "target"]
    bars = [("critical (1 - sparsity)", lambda r: 1 - sum(r["sparsity"]) / len(r["sparsity"]))]
    bars += [(n, lambda r, n=n: sum(r["list_density"][n]) / len(r["list_density"][n])) for n in names]
    predicted = [n for n in reps[0].get("predictor_list_density", {}) if n != "target"]  # older JSONs: none
    predicted.sort(key=lambda n: not n.startswith("exact_"))  # the exact logits' ranking, then the predictor's
    bars += [(ranked_label(n), lambda r, n=n: sum(r["predictor_list_density"][n]) / len(r["predictor_list_density"][n]))
             for n in predicted]
    bars += [("budgets (predictor)",
              lambda r: sum(r["predictor"]["budget_density"]) / len(r["predictor"]["budget_density"]))]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(reps) + 3), 4.5))
    width = 0.8 / len(bars)
    for j, (label, get) in enumerate(bars):
        ax.bar([x - 0.4 + (j + 0.5) * width for x in xs], [get(r) for r in reps], width=width, label=label)
    ax.axhline(1 - reps[0]["predictor"]["sparsity_threshold"], color="gray", ls=":", lw=1)  # the dispatcher's
    ax.set_xticks(xs, [str(n) for n in numbers])
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer")
    ax.set_ylabel("kept fraction of keys (mean over heads)")
    ax.set_title(f"keys kept for {reps[0]['list_density']['target']:g} recall of the theta={theta:g} critical mass "
                 "(oracle lists, the predictor's lists, its budgets)", fontsize=9)
    paths.append(_finish(plt, fig, ax, os.path.join(out_dir, "list_costs.png"), True))

    if runs:
        paths.append(_plot_trajectory(plt, runs, metric, os.path.join(out_dir, "sparsity_trajectory.png")))
    return paths


def _plot_trajectory(plt, runs: dict, metric: str, path: str) -> str:
    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.5), squeeze=False)
    for ax, (run, layers) in zip(axes[0], sorted(runs.items())):
        colors = _layer_colors(plt, len(layers))
        for (layer, points), c in zip(sorted(layers.items()), colors):
            ax.plot([p[0] for p in points], [p[1] for p in points], color=c, label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} over training ({run})", fontsize=10)
        if len(layers) <= 16:
            ax.legend(fontsize=7, ncol=2 if len(layers) > 8 else 1)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    _pyplot()  # fail before the model work when matplotlib is missing
    runs = load_trajectory(args.trajectory, args.trajectory_metric) if args.trajectory else None
    from megatron_dsv.attention.analysis import analyze

    device = _device(args.device)
    model, source = _model(args, device)
    x_t, t, labels, text, text_mask = _batch(args, model, device)
    print(f"analysing {source}: {args.samples} videos {tuple(x_t.shape[2:])} at t={args.timestep:g}, "
          f"theta={args.theta:g}, on {device}", flush=True)
    coords = grid = cube = None
    if args.pretrained:  # analyze() defaults to a VideoDiT's coordinates; a Wan model's are its own cube order
        from megatron_dsv.attention.grouping import cube_order_coords
        from megatron_dsv.models.wan import unwrap_wan

        wan = unwrap_wan(model)
        grid, cube = wan.wan_config.token_grid(x_t.shape[2:]), wan.cube
        coords = cube_order_coords(grid, cube)
    result = analyze(model, x_t, t, labels, theta=args.theta, query_stride=args.query_stride,
                     max_queries=args.max_queries, text=text, text_mask=text_mask, coords=coords, bins=args.bins,
                     radius=args.radius, progress=lambda line: print(line, flush=True))
    if grid is not None:
        result["grid"], result["cube"] = list(grid), list(cube)
    from benchmarks.common import collect_meta

    result["meta"] = {**collect_meta(), "source": source, "data": args.data, "samples": args.samples,
                      "timestep": args.timestep, "seed": args.seed, "device": str(device)}
    if args.pretrained:
        result["meta"]["text"] = (f"synthetic: {args.text_tokens} random-normal embeddings zero-padded to "
                                  f"{args.text_len} (not umT5's)" if args.data == "synthetic" else "the shards'")
    if runs:
        result["trajectory"] = {"file": args.trajectory, "metric": args.trajectory_metric,
                                "runs": _trajectory_summary(runs)}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "analysis.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    paths = plot_all(result, args.out_dir, runs, args.trajectory_metric)
    s = result["summary"]
    print(f"sparsity median {s['sparsity_median']:.3f} (heads {s['sparsity_min']:.3f}..{s['sparsity_max']:.3f}), "
          f"critical keys within {args.radius:g} tokens {s['within_radius']:.3f}, predictor recall "
          f"{s['predictor_recall']:.3f}, logit std {s['logit_std']:.2f} (Gaussian logits of that spread would "
          f"give sparsity {s['gaussian_sparsity']:.3f}: see benchmarks/NOTES_sparsity.md, run 14)")
    print(f"wrote {json_path} and {', '.join(os.path.basename(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

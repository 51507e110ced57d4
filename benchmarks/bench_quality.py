"""Quality at equal training: full attention vs DSV vs a 3D local-window baseline, same data and steps.

One data arm (``--arm``, the ``benchmarks/video_runs.py`` syntax; its ``attn`` key is ignored)
trains three times from the same initial weights on the same clips in the same order: full
attention (cuDNN first on a GPU), DSV (two stages, library defaults; stage 2 from ``stage1``), and
window attention keeping about the same fraction of keys as DSV's budgets did at the end
(``--window-frac``, default 0.1: the paper's regime). Each is validated every ``--val-every`` steps
on held-out clips at fixed noise and timesteps.

Writes ``benchmarks/results/quality-<gpu>-<yyyymmdd>.json`` (one ``final`` row: ``val_loss_full``,
``val_loss_dsv``, ``val_loss_window`` at ``steps``, the last validation step all three arms reached (an
arm stopped early by its ``minutes`` budget is never compared against longer ones; ``val_loss_last`` and
``steps_per_arm`` hold each arm's own end), ``seed``; and DSV's state at its own end: ``recall``,
``sparse_layer_fraction`` (share of stage-2 layer-steps DSV ran sparse), ``sparsity_mean``,
``budget_density``; plus ``curve`` rows per arm and validation), a PNG of the validation curves, and
(``--samples-out``) GIF / PNG grids of a few videos sampled from each model.

    PYTHONPATH=. python benchmarks/bench_quality.py --quick                      # CPU check
    PYTHONPATH=. python benchmarks/bench_quality.py --arm data=vizdoom,frames=32,res=128,steps=1500
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_dist, write_results  # noqa: E402
from benchmarks.video_runs import add_run_args, parse_arm, tokens_of, train_arm  # noqa: E402

QUICK_ARM = "data=synthetic,frames=4,res=64,steps=8,stage1=4,minutes=2"


def _sample_grid(model, clips, arm, path_prefix, n=2, steps=10):
    """GIF + PNG of ``n`` videos sampled from ``model`` (labels of the first validation clips)."""
    from megatron_dsv.models.sampling import sample_videos, write_gif_and_grid

    labels = clips.labels[clips.n_train:clips.n_train + n]
    g = torch.Generator(device=clips.latents.device).manual_seed(7)
    latents = sample_videos(model, labels, grid=tuple(clips.latents.shape[2:]), steps=steps, generator=g)
    if clips.decoder is not None:  # DCT latents -> RGB frames -> [B, 3, T, H, W] in [-1, 1] for the writer
        frames = torch.stack([torch.from_numpy(clips.decoder(x)) for x in latents])
        latents = frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    return write_gif_and_grid(latents, path_prefix, min_side=64)


def equal_step_losses(curves):
    """``(step, {attn: val_loss})`` at the last validation step every arm reached: arms stopped by their
    minutes budget at different steps are compared at equal training, never a longer run against a shorter."""
    if not curves:
        raise ValueError("equal_step_losses: `curves` is empty (no arm trained)")
    common = set.intersection(*({s for s, _ in pts} for pts in curves.values()))
    if not common:
        raise ValueError(f"the arms {sorted(curves)} share no validation step; raise `minutes` or lower `--val-every`")
    step = max(common)
    return step, {attn: dict(pts)[step] for attn, pts in curves.items()}


def plot(curves, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for attn, pts in curves.items():
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, label=attn)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation flow-matching loss (held-out clips)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--arm", default=None, help="the data arm (video_runs.py syntax)")
    ap.add_argument("--window-frac", type=float, default=0.1, help="kept fraction of keys of the window baseline")
    ap.add_argument("--samples-out", default=None, help="folder for sampled GIF / PNG grids (none if unset)")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny model, a few steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.samples, args.val_samples = "tiny", 2, 4, 2
        args.profile_every, args.log_every, args.val_every, args.warmup = 2, 4, 4, 2
        args.arm = args.arm or QUICK_ARM
    if args.arm is None:
        ap.error("give --arm (or --quick)")
    init_dist()
    base = parse_arm(args.arm)
    curves, summaries, rows = {}, {}, []
    for attn in ("full", "dsv", "window"):
        arm = dict(base, attn=attn, window_frac=args.window_frac, label=f"{base['data']}-{attn}-S{tokens_of(base)}")
        curves[attn] = []
        model, clips, summary = train_arm(arm, args, on_val=lambda s, v, c=curves[attn]: c.append((s, v)))
        summaries[attn] = summary
        rows += [dict(bench="quality", kind="curve", attn=attn, step=s, val_loss=v) for s, v in curves[attn]]
        print(f"== {attn}: {summary['steps']} steps, val loss {summary['val_loss']:.4f}, "
              f"{summary['ms_step']:.1f} ms/step", flush=True)
        if args.samples_out:
            print("wrote", *_sample_grid(model, clips, arm, os.path.join(args.samples_out, f"quality-{attn}")))
        del model
    dsv = summaries["dsv"]
    step, val = equal_step_losses(curves)
    if len({s["steps"] for s in summaries.values()}) > 1:
        print(f"warning: the arms stopped at different steps ({ {a: s['steps'] for a, s in summaries.items()} }, "
              f"their minutes budgets); the final row compares them at step {step}, the last validation all reached")
    final = dict(bench="quality", kind="final", data=base["data"], S=tokens_of(base), frames=base["frames"],
                 res=base["res"], preset=args.preset, layers=args.layers, lr=base["lr"], seed=args.seed,
                 samples=args.samples, steps=step,
                 steps_per_arm={a: s["steps"] for a, s in summaries.items()}, stage1=base["stage1"],
                 val_loss_full=val["full"], val_loss_dsv=val["dsv"], val_loss_window=val["window"],
                 val_loss_last={a: s["val_loss"] for a, s in summaries.items()}, window_frac=args.window_frac,
                 dsv_vs_full_pct=100.0 * (val["dsv"] / val["full"] - 1.0),
                 window_vs_full_pct=100.0 * (val["window"] / val["full"] - 1.0),
                 recall=dsv["recall"], sparse_layer_fraction=dsv["sparse_layer_fraction"],
                 sparsity_mean=dsv["sparsity_mean"], budget_density=dsv["budget_density"],
                 ms_step_full=summaries["full"]["ms_step"], ms_step_dsv=dsv["ms_step"],
                 ms_step_window=summaries["window"]["ms_step"])
    rows.append(final)
    path = write_results("quality", rows, args.out_dir)
    try:
        plot(curves, str(path).replace(".json", ".png"),
             f"{base['data']}, {tokens_of(base)} tokens, {args.preset} x {args.layers} layers; "
             f"DSV sparse layer-steps {final['sparse_layer_fraction']:.2f}")
    except ImportError as err:
        print(f"no plot ({err}): pip install -e '.[plots]'")
    print(f"val loss: full {final['val_loss_full']:.4f} | dsv {final['val_loss_dsv']:.4f} "
          f"({final['dsv_vs_full_pct']:+.2f}%) | window {final['val_loss_window']:.4f} "
          f"({final['window_vs_full_pct']:+.2f}%) | DSV sparse layer-steps {final['sparse_layer_fraction']:.2f}, "
          f"sparsity {final['sparsity_mean']:.3f}, recall {final['recall']:.3f}")
    print("wrote", path)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Generate videos from a VideoDiT checkpoint and write a GIF and a PNG grid.

    python tools/sample_video_dit.py --ckpt runs/tiny/checkpoints --labels 0 1 2 3 --steps 25 --out samples/tiny

``--ckpt`` is a checkpoint written by ``python -m megatron_dsv.train`` (a root folder, whose
newest iteration is used, or one iteration folder). The model is rebuilt from the
checkpoint's own config, including DSV (sparse attention at inference with the trained
predictors, when training reached stage 2). Writes ``<out>.gif``, ``<out>.png`` and
``<out>.safetensors`` (the raw latents).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dsv.models.sampling import sample_videos, write_gif_and_grid  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root or iteration directory")
    p.add_argument("--labels", type=int, nargs="+", default=None,
                   help="class labels to sample (default: 0..min(num_classes, 4)-1)")
    p.add_argument("--steps", type=int, default=25, help="Euler steps (default 25)")
    p.add_argument("--grid", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                   help="latent grid (default: the model's)")
    p.add_argument("--cfg-scale", type=float, default=1.0, help="classifier-free guidance scale (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16 (GPU)")
    p.add_argument("--out", default="samples/video_dit", help="output path prefix")
    p.add_argument("--fps", type=int, default=8, help="GIF frame rate")
    p.add_argument("--live-weights", action="store_true",
                   help="sample from the trained weights themselves, not their EMA (the default when the "
                        "checkpoint holds one, as validation uses it)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    from megatron_dsv.training.checkpointing import load_model_for_inference, read_train_state, resolve_checkpoint_dir

    ema = not args.live_weights and bool(read_train_state(resolve_checkpoint_dir(args.ckpt)).get("ema"))
    loaded = load_model_for_inference(args.ckpt, device=args.device, dtype=torch.bfloat16 if args.bf16 else None,
                                      ema=ema)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    print(f"sampling with the {'EMA' if ema else 'live'} weights of {args.ckpt}")
    cfg = model.dit_config
    if cfg.text_dim is not None:
        raise SystemExit("this checkpoint is text-conditioned; sampling from text embeddings is not wired in "
                         "this tool yet (call megatron_dsv.models.sampling.sample_videos with text=...)")
    labels = args.labels if args.labels is not None else list(range(min(cfg.num_classes, 4)))
    bad = [y for y in labels if not 0 <= y <= cfg.num_classes]
    if bad:
        raise SystemExit(f"--labels must be in [0, {cfg.num_classes}] ({cfg.num_classes} = null class), got {bad}")
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    latents = sample_videos(model, torch.tensor(labels, dtype=torch.long), grid=args.grid, steps=args.steps,
                            generator=g, cfg_scale=args.cfg_scale)
    gif, png = write_gif_and_grid(latents, args.out, fps=args.fps)
    from safetensors.torch import save_file

    save_file({"latents": latents.cpu().contiguous(), "labels": torch.tensor(labels)}, f"{args.out}.safetensors")
    print(f"wrote {gif}, {png} and {args.out}.safetensors ({len(labels)} videos, grid "
          f"{tuple(latents.shape[2:])}, {args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

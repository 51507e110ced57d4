"""Sample videos at the end of training (GIF + PNG grid) through megatron_dsv.models.sampling."""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["write_samples"]


def write_samples(model: torch.nn.Module, cfg, args, device: torch.device, iteration: int,
                  write: bool = True) -> Optional[str]:
    """Euler-sample ``--num-sample-videos`` videos and write them under ``<output-dir>/samples``.

    Every tensor-parallel rank of the model must call this (its forward runs TP collectives);
    only the one with ``write=True`` writes the files.
    Returns the output folder, or None when the sampling module is not available in this build
    or ``write`` is False."""
    try:
        from megatron_dsv.models.sampling import sample_videos, write_gif_and_grid
    except ImportError as err:
        print(f" > no sample GIF: megatron_dsv.models.sampling is not available ({err})", flush=True)
        return None
    out_dir = os.path.join(args.output_dir, "samples")
    os.makedirs(out_dir, exist_ok=True)
    num_classes = max(1, int(getattr(cfg, "num_classes", 1) or 1))
    labels = torch.arange(args.num_sample_videos, device=device) % num_classes
    generator = torch.Generator(device=device).manual_seed(args.seed)
    was_training = model.training
    model.eval()
    try:
        videos = sample_videos(model, labels, steps=args.sample_steps, generator=generator,
                               cfg_scale=args.sample_cfg_scale)
    finally:
        model.train(was_training)
    if not write:
        return None
    gif, grid = write_gif_and_grid(videos, os.path.join(out_dir, f"iter_{iteration:07d}"))
    print(f" > wrote {args.num_sample_videos} sample videos: {gif} and {grid}", flush=True)
    return out_dir

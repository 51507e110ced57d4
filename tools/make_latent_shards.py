#!/usr/bin/env python
"""Write latent shards (``.safetensors``) for :class:`megatron_dsv.data.LatentShardDataset` from frames.

    python tools/make_latent_shards.py --input videos/ --out shards/ --frames 8 --height 16 --width 16

Input: ``--input`` holds one entry per video, either a folder of frames (``*.png`` / ``*.jpg``,
sorted by name) or a ``.npy`` array ``[T, H, W, 3]`` (uint8, or float in [0, 1]; read with
``allow_pickle=False``). Labels come from ``--labels`` (a CSV of ``name,label`` lines, name =
folder or file stem); videos without a label get 0.

Output "latents" are pixel-space, as in the synthetic set (no VAE here): ``--frames`` frames
evenly spaced over the video, resized to ``--height x --width``, RGB + luminance (``--channels 4``,
the default: what the default tiny preset takes), RGB (``--channels 3``) or luminance
(``--channels 1``), mapped to [-1, 1]. To train on VAE latents, encode with your
VAE and call :func:`megatron_dsv.data.write_shard` with ``[N, C, T, H, W]`` tensors instead.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dsv.data.shards import write_shard  # noqa: E402

FRAME_EXTS = (".png", ".jpg", ".jpeg")


def progress(done: int, total: int, width: int = 30, stream=None) -> None:
    """One-line progress bar (no tqdm): ``[#####.....] 12/40``, on ``stream`` (default: the current sys.stderr,
    looked up at each call: a default bound at import would outlive a replaced stderr)."""
    stream = sys.stderr if stream is None else stream
    filled = int(width * done / max(total, 1))
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        stream.write("\n")
    stream.flush()


def list_videos(folder: str) -> List[str]:
    """Video entries of ``folder``: frame folders and ``.npy`` files, sorted by name."""
    if not os.path.isdir(folder):
        raise ValueError(f"--input must be a directory, got {folder!r}")
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".npy") or (os.path.isdir(path) and any(f.lower().endswith(FRAME_EXTS)
                                                                  for f in os.listdir(path))):
            out.append(path)
    if not out:
        raise ValueError(f"--input {folder!r} has no frame folders (*.png/*.jpg) or .npy videos")
    return out


def read_video(path: str) -> torch.Tensor:
    """Frames of one video as float32 ``[T, 3, H, W]`` in [0, 1]."""
    if path.endswith(".npy"):
        arr = np.load(path, allow_pickle=False)
        if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
            raise ValueError(f"{path}: a .npy video must be [T, H, W, 3] (or 1 channel), got {arr.shape}")
        x = torch.from_numpy(np.ascontiguousarray(arr))
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float().clamp(0, 1)
    else:
        from PIL import Image

        files = sorted(f for f in os.listdir(path) if f.lower().endswith(FRAME_EXTS))
        x = torch.stack([torch.from_numpy(np.asarray(Image.open(os.path.join(path, f)).convert("RGB")).copy())
                         for f in files]).float() / 255.0
    x = x.permute(0, 3, 1, 2)
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x


def to_latents(frames: torch.Tensor, t: int, h: int, w: int, channels: int) -> torch.Tensor:
    """``[T, 3, H, W]`` in [0, 1] -> pixel-space latents ``[C, t, h, w]`` in [-1, 1]."""
    idx = torch.linspace(0, frames.shape[0] - 1, t).round().long()
    x = F.interpolate(frames[idx], size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    luma = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]
    if channels == 1:
        x = luma
    elif channels == 4:
        x = torch.cat([x, luma], dim=1)
    return (x.clamp(0, 1) * 2 - 1).permute(1, 0, 2, 3).contiguous()


def read_labels(path: Optional[str]) -> Dict[str, int]:
    if path is None:
        return {}
    labels = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0].startswith("#"):
                continue
            if len(row) != 2 or not row[1].strip().lstrip("-").isdigit():
                raise ValueError(f"--labels {path!r}: each line must be 'name,label', got {row}")
            labels[row[0].strip()] = int(row[1])
    return labels


def _stem(path: str) -> str:
    name = os.path.basename(path.rstrip(os.sep))
    return name[:-4] if name.endswith(".npy") else name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="folder of videos (frame folders or .npy)")
    p.add_argument("--out", required=True, help="output folder for shard-XXXXX.safetensors")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--channels", type=int, default=4, choices=(1, 3, 4),
                   help="4 = RGB + luminance (the tiny preset's in_channels), 3 = RGB, 1 = luminance")
    p.add_argument("--shard-size", type=int, default=256, help="videos per shard")
    p.add_argument("--labels", default=None, help="CSV of name,label")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = p.parse_args(argv)
    for name in ("frames", "height", "width", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    videos, labels = list_videos(args.input), read_labels(args.labels)
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    buf, buf_labels, shard, skipped = [], [], 0, []

    def flush():
        nonlocal buf, buf_labels, shard
        if buf:
            write_shard(os.path.join(args.out, f"shard-{shard:05d}.safetensors"), torch.stack(buf).to(dtype),
                        labels=torch.tensor(buf_labels, dtype=torch.long))
            shard, buf, buf_labels = shard + 1, [], []

    for i, path in enumerate(videos):
        frames = read_video(path)
        if frames.shape[0] < args.frames:
            skipped.append(f"{path} ({frames.shape[0]} frames < {args.frames})")
        else:
            buf.append(to_latents(frames, args.frames, args.height, args.width, args.channels))
            buf_labels.append(labels.get(_stem(path), 0))
            if len(buf) == args.shard_size:
                flush()
        progress(i + 1, len(videos))
    flush()
    for s in skipped:
        print(f"skipped {s}", file=sys.stderr)
    print(f"wrote {shard} shard(s) of [{args.channels}, {args.frames}, {args.height}, {args.width}] latents "
          f"to {args.out} ({len(videos) - len(skipped)} videos)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Render game-engine videos or cut real footage into latent shards the trainer reads (``--data-path``).

    pip install -e '.[video]'
    python tools/render_videos.py --source vizdoom --samples 256 --frames 32 --size 256 --out data/vizdoom
    python tools/fetch_footage.py && python tools/render_videos.py --source footage --out data/footage
    python tools/render_videos.py --source footage --samples 24 --holdout data/footage --out data/footage-valid

Writes ``shard_XXXXX.safetensors`` (fp16 latents ``[N, 16, T, H/4, W/4]`` + labels; the
LatentShardDataset format), with ``--raw-frames`` also ``frames/shard_XXXXX.npy`` (uint8
``[N, T, H, W, 3]``), and with ``--gif`` a preview GIF / PNG grid of the first clips decoded
back from their latents (what the model sees). Sources, the scripted policies and the fixed DCT
downsampler are described in :mod:`megatron_dsv.data.rendered`. With ``--size 256``,
``--frames 32`` and the video DiT's patch (1, 2, 2), a clip is 32K tokens; the presets take
16-channel latents (``--channels``). Clips are deterministic in ``(--seed, index)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dsv.data.rendered import (DEFAULT_FRAME_SKIP, SOURCES, RenderedVideoDataset, decode_video,  # noqa: E402
                                        write_rendered_shards)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=sorted(SOURCES), required=True, help="renderer (package: the [video] extra)")
    ap.add_argument("--out", required=True, help="output folder of shards")
    ap.add_argument("--samples", type=int, default=64, help="clips to render")
    ap.add_argument("--frames", type=int, default=32, help="frames per clip (latent T)")
    ap.add_argument("--size", type=int, default=256, help="square frame side in pixels (latent side = size / factor)")
    ap.add_argument("--channels", type=int, default=16, help="latent channels (the presets take 16; tiny takes 4)")
    ap.add_argument("--factor", type=int, default=4, help="spatial downsampling of the DCT encoder")
    ap.add_argument("--frame-skip", type=int, default=None,
                    help="engine tics (games) or source frames (footage) between two frames; default: the source's")
    ap.add_argument("--shard-size", type=int, default=16, help="clips per shard file")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="renderer processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout", metavar="TRAIN_DIR", default=None,
                    help="write validation clips (for the trainer's --valid-data-path) with the settings and the "
                         "channel statistics of the training shards in TRAIN_DIR: footage clips from each video's "
                         "held-out end, which no training clip touches; game clips are episodes of their own, so "
                         "game validation shards need another --seed")
    ap.add_argument("--raw-frames", action="store_true", help="also keep the uint8 frames (frames/*.npy)")
    ap.add_argument("--gif", type=int, default=0, metavar="N", help="write preview.gif/png of the first N clips")
    args = ap.parse_args(argv)
    # what render_info.json records and a --holdout render must share with its training shards
    settings = dict(source=args.source, scenarios=list(SOURCES[args.source]), frames=args.frames, size=args.size,
                    channels=args.channels, factor=args.factor,
                    frame_skip=DEFAULT_FRAME_SKIP[args.source] if args.frame_skip is None else args.frame_skip)
    stats = None
    if args.holdout:
        path = os.path.join(args.holdout, "render_info.json")
        if not os.path.isfile(path):
            ap.error(f"--holdout {args.holdout!r} holds no render_info.json (the training shards' folder, written by "
                     f"this tool)")
        if os.path.realpath(args.holdout) == os.path.realpath(args.out):
            ap.error("--holdout names the training shards' folder: give the validation shards another --out")
        with open(path) as f:
            train_info = json.load(f)
        differ = {k: (train_info.get(k), v) for k, v in settings.items() if train_info.get(k) != v}
        if differ:
            ap.error(f"--holdout {args.holdout!r} was rendered with other settings (training, here): {differ}")
        if args.source != "footage" and args.seed == train_info.get("seed"):
            ap.error(f"--holdout: {args.source} clips are episodes seeded by (--seed, index): the same --seed "
                     f"{args.seed} would repeat the training clips; give the validation shards another --seed")
        stats = (train_info["channel_mean"], train_info["channel_std"])
    try:
        ds = RenderedVideoDataset(args.source, args.samples, frames=args.frames, height=args.size, width=args.size,
                                  channels=args.channels, factor=args.factor, frame_skip=settings["frame_skip"],
                                  seed=args.seed, holdout_from=0 if args.holdout else None, stats=stats)
    except (ImportError, ValueError) as err:
        ap.error(str(err))
    paths = write_rendered_shards(args.out, ds, args.shard_size, args.workers, args.raw_frames)
    mean, std = ds.channel_stats()
    info = dict(settings, samples=args.samples, seed=args.seed, holdout_of=args.holdout,
                channel_mean=mean.flatten().tolist(), channel_std=std.flatten().tolist())
    with open(os.path.join(args.out, "render_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    if args.gif:
        from megatron_dsv.models.sampling import write_gif_and_grid

        clips = [torch.from_numpy(decode_video(ds.denormalize(ds[i]["latents"]), args.factor))
                 for i in range(min(args.gif, len(ds)))]
        video = torch.stack(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # [B, 3, T, H, W]
        print("wrote", *write_gif_and_grid(video, os.path.join(args.out, "preview")))
    print(f"wrote {len(paths)} shards of {args.source} clips to {args.out} "
          f"(latents {tuple(ds[0]['latents'].shape)}, labels 0..{ds.num_classes - 1})")


if __name__ == "__main__":
    main()

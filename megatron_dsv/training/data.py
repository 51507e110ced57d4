"""Distributed, resumable batches: a sampler keyed by the global sample position.

Sample ``j`` of the run (``j = consumed_samples + offset``) is ``perm(epoch)[j % N]`` with
``epoch = j // N`` and ``perm(epoch)`` a permutation seeded by ``(seed, epoch)``. A global batch is
``global_batch_size`` consecutive positions; DP rank ``r`` takes its contiguous slice of it, cut into
micro batches. The batch sequence is therefore a pure function of (seed, consumed samples): a run
resumed from a checkpoint that stored ``consumed_samples`` reads exactly the next batch, and the
global batch does not depend on how many DP ranks share it.
"""

from __future__ import annotations

from typing import Dict, Iterator, List

import torch

__all__ = ["GlobalBatchSampler", "collate", "build_dataset", "build_valid_dataset", "step_batches"]

VALID_SEED_OFFSET = 1_000_003  # held-out synthetic videos: data seed + this (another stream of the same family)


class GlobalBatchSampler:
    """Yields, per optimizer step, this DP rank's list of micro batches (lists of dataset indices)."""

    def __init__(self, num_samples: int, micro_batch_size: int, global_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, consumed_samples: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size "
                             f"({micro_batch_size}) x data-parallel size ({dp_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.num_samples, self.mbs, self.gbs = num_samples, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.consumed_samples = consumed_samples
        self._perm_epoch, self._perm = None, None

    @property
    def num_micro_batches(self) -> int:
        return self.gbs // (self.mbs * self.dp_size)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def index(self, position: int) -> int:
        """Dataset index of the run's sample number ``position``."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self._permutation(epoch)[offset])

    def global_batch(self, consumed_samples: int) -> List[int]:
        return [self.index(consumed_samples + j) for j in range(self.gbs)]

    def local_micro_batches(self, consumed_samples: int) -> List[List[int]]:
        per_rank = self.gbs // self.dp_size
        start = consumed_samples + self.dp_rank * per_rank
        idx = [self.index(start + j) for j in range(per_rank)]
        return [idx[i:i + self.mbs] for i in range(0, per_rank, self.mbs)]

    def __iter__(self) -> Iterator[List[List[int]]]:
        while True:
            yield self.local_micro_batches(self.consumed_samples)
            self.consumed_samples += self.gbs


def collate(items: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    out = {"latents": torch.stack([it["latents"] for it in items]),
           "label": torch.stack([torch.as_tensor(it["label"], dtype=torch.int64) for it in items])}
    for key in ("text", "text_mask"):
        if key in items[0]:
            out[key] = torch.stack([it[key] for it in items])
    return out


class _MicroBatchStream:
    """torch ``batch_sampler``: this rank's micro batches, step after step, from ``consumed`` on."""

    def __init__(self, sampler: GlobalBatchSampler, consumed: int):
        self.sampler, self.consumed = sampler, consumed

    def __iter__(self):
        consumed = self.consumed
        while True:
            yield from self.sampler.local_micro_batches(consumed)
            consumed += self.sampler.gbs


def step_batches(dataset, sampler: GlobalBatchSampler, consumed: int, num_workers: int = 0):
    """Iterator over optimizer steps: each item is the list of this rank's collated micro batches.

    With ``num_workers > 0`` a DataLoader renders/reads the next batches in worker processes while
    the model trains; the order (and so the loss sequence) is the same as with 0 workers."""
    if num_workers > 0:
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=_MicroBatchStream(sampler, consumed),
                                             collate_fn=collate, num_workers=num_workers, prefetch_factor=2)
        stream = iter(loader)
    else:
        stream = (collate([dataset[i] for i in mb]) for mb in _MicroBatchStream(sampler, consumed))
    while True:
        yield [next(stream) for _ in range(sampler.num_micro_batches)]


def build_dataset(args, model_cfg):
    """Latent shards when --data-path is set, else synthetic videos shaped for ``model_cfg``."""
    if args.data_path is not None:
        return _shards(args.data_path, "--data-path", model_cfg)
    return _synthetic(model_cfg, args.synthetic_samples, args.data_seed, args.synthetic_background)


def build_valid_dataset(args, model_cfg, train_dataset):
    """The held-out set of --eval-iters, or None: --valid-data-path's shards (at least ``--eval-iters`` global
    batches of samples shaped as ``train_dataset``'s); held-out synthetic videos (that many, seed ``data
    seed + VALID_SEED_OFFSET``) when training on synthetic ones; None when training on --data-path without
    --valid-data-path, or with --eval-iters 0."""
    if not args.eval_iters:
        return None
    if args.valid_data_path is not None:
        valid = _shards(args.valid_data_path, "--valid-data-path", model_cfg)
        need = args.eval_iters * args.global_batch_size
        if len(valid) < need:
            raise ValueError(f"--valid-data-path {args.valid_data_path!r} holds {len(valid)} samples; --eval-iters "
                             f"{args.eval_iters} x --global-batch-size {args.global_batch_size} needs {need}: lower "
                             f"--eval-iters or write more (tools/render_videos.py --holdout)")
        shape, want = tuple(valid[0]["latents"].shape), tuple(train_dataset[0]["latents"].shape)
        if shape != want:
            raise ValueError(f"--valid-data-path {args.valid_data_path!r} holds latents {shape}, the training data "
                             f"{want}: validate on clips of the training shape")
        return valid
    if args.data_path is not None:
        return None
    return _synthetic(model_cfg, args.eval_iters * args.global_batch_size, args.data_seed + VALID_SEED_OFFSET,
                      args.synthetic_background)


def _shards(path: str, flag: str, model_cfg):
    from megatron_dsv.data import LatentShardDataset

    dataset = LatentShardDataset(path)
    channels, want = dataset.sample_shape[0], int(model_cfg.in_channels)
    if channels != want:
        raise ValueError(f"{flag} {path!r} holds {channels}-channel latents "
                         f"{tuple(dataset.sample_shape)} but the model takes in_channels = {want}: train with "
                         f"--model-override in_channels={channels}, or rewrite the shards with "
                         f"tools/make_latent_shards.py --channels {want} (tools/render_videos.py --channels {want})")
    return dataset


def _synthetic(model_cfg, samples: int, seed: int, background: str):
    from megatron_dsv.data import SyntheticVideoDataset

    c, t, h, w = latent_shape(model_cfg)
    return SyntheticVideoDataset(samples, channels=c, frames=t, height=h, width=w,
                                 num_classes=max(1, int(model_cfg.num_classes)), seed=seed, background=background)


def latent_shape(model_cfg) -> tuple:
    """(C, T, H, W) of the latents the model expects."""
    return (int(model_cfg.in_channels), *(int(g) for g in model_cfg.latent_grid))

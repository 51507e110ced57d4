"""Latent-shard datasets for real data: a folder of ``.safetensors`` or ``.npy`` shards.

Shard formats (every shard of a folder must hold latents of the same ``[C, T, H, W]``):

* ``<name>.safetensors`` with tensors ``latents`` ``[N, C, T, H, W]`` (float), and optionally
  ``labels`` ``[N]`` (integer), ``text`` ``[N, L, D]`` (float) and ``text_mask`` ``[N, L]`` (bool/uint8).
* ``<name>.npy`` holding ``latents`` ``[N, C, T, H, W]``, with optional siblings
  ``<name>.labels.npy``, ``<name>.text.npy``, ``<name>.text_mask.npy``.

Files are read with ``safetensors`` and ``np.load(allow_pickle=False, mmap_mode="r")`` only:
no pickle, and only the requested sample is read from disk. Shards are indexed at
construction (headers only), so a corrupt or inconsistent shard fails there, naming the file.
``tools/make_latent_shards.py`` writes such folders; :func:`write_shard` is its writer.
"""

from __future__ import annotations

import bisect
import os
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["LatentShardDataset", "CycledDataset", "write_shard", "SIDE_KEYS"]

SIDE_KEYS = ("labels", "text", "text_mask")
_SIDECAR_SUFFIXES = tuple(f".{k}.npy" for k in SIDE_KEYS)


def write_shard(path: str, latents: torch.Tensor, labels: Optional[torch.Tensor] = None,
                text: Optional[torch.Tensor] = None, text_mask: Optional[torch.Tensor] = None) -> str:
    """Write one ``.safetensors`` shard (atomically: temp file + rename). Returns the path."""
    from safetensors.torch import save_file

    if not path.endswith(".safetensors"):
        raise ValueError(f"path must end with .safetensors, got {path!r}")
    if latents.dim() != 5:
        raise ValueError(f"latents must be [N, C, T, H, W], got {tuple(latents.shape)}")
    tensors = {"latents": latents.contiguous()}
    for key, value in (("labels", labels), ("text", text), ("text_mask", text_mask)):
        if value is not None:
            if value.shape[0] != latents.shape[0]:
                raise ValueError(f"{key} must have N = {latents.shape[0]} rows, got {tuple(value.shape)}")
            tensors[key] = value.contiguous()
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "megatron_dsv.latent_shard.v1"})
    os.replace(tmp, path)
    return path


class _Shard:
    """One shard: its arrays' shapes (from headers) and lazy per-sample reads."""

    def __init__(self, path: str):
        self.path = path
        self.shapes: Dict[str, tuple] = {}
        self._npy: Dict[str, np.ndarray] = {}
        try:
            if path.endswith(".safetensors"):
                self._index_safetensors()
            else:
                self._index_npy()
        except Exception as err:  # safetensors / numpy raise assorted types on a damaged file
            raise ValueError(f"cannot read latent shard {path!r} ({type(err).__name__}: {err}); "
                             "the file is corrupt or not a latent shard") from err
        self._validate()

    def _index_safetensors(self):
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            keys = set(f.keys())
            for key in ("latents",) + SIDE_KEYS:
                if key in keys:
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def _index_npy(self):
        stem = self.path[:-len(".npy")]
        for key, file in [("latents", self.path)] + [(k, f"{stem}.{k}.npy") for k in SIDE_KEYS]:
            if os.path.exists(file):
                self._npy[key] = np.load(file, mmap_mode="r", allow_pickle=False)
                self.shapes[key] = tuple(self._npy[key].shape)

    def _validate(self):
        lat = self.shapes.get("latents")
        if lat is None or len(lat) != 5:
            raise ValueError(f"latent shard {self.path!r} must hold 'latents' [N, C, T, H, W], got {lat}")
        n = lat[0]
        for key in SIDE_KEYS:
            if key in self.shapes and self.shapes[key][0] != n:
                raise ValueError(f"latent shard {self.path!r}: {key!r} has {self.shapes[key][0]} rows, latents {n}")
        if "labels" in self.shapes and len(self.shapes["labels"]) != 1:
            raise ValueError(f"latent shard {self.path!r}: 'labels' must be [N], got {self.shapes['labels']}")
        if "text" in self.shapes and len(self.shapes["text"]) != 3:
            raise ValueError(f"latent shard {self.path!r}: 'text' must be [N, L, D], got {self.shapes['text']}")

    def __len__(self) -> int:
        return self.shapes["latents"][0]

    def read(self, i: int) -> Dict[str, torch.Tensor]:
        if self.path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                return {k: f.get_slice(k)[i:i + 1][0] for k in self.shapes}
        return {k: torch.from_numpy(np.array(a[i])) for k, a in self._npy.items()}


class LatentShardDataset(Dataset):
    """All samples of the shards in ``folder`` (sorted by file name), one index space.

    ``ds[i]`` -> ``{"latents": float32 [C, T, H, W], "label": int64 []}`` plus ``"text"`` float32
    ``[L, D]`` and ``"text_mask"`` bool ``[L]`` when the shards have them. Samples without
    labels get label 0.
    """

    def __init__(self, folder: str):
        if not os.path.isdir(folder):
            raise ValueError(f"folder must be an existing directory of latent shards, got {folder!r}")
        names = sorted(n for n in os.listdir(folder)
                       if n.endswith(".safetensors") or (n.endswith(".npy") and not n.endswith(_SIDECAR_SUFFIXES)))
        if not names:
            raise ValueError(f"folder {folder!r} has no .safetensors or .npy latent shards")
        self.folder = folder
        self.shards: List[_Shard] = [_Shard(os.path.join(folder, n)) for n in names]
        self._check_consistent()
        self._starts = np.cumsum([0] + [len(s) for s in self.shards]).tolist()

    def _check_consistent(self):
        first = self.shards[0]
        for shard in self.shards[1:]:
            for key in ("latents",) + SIDE_KEYS:
                a, b = first.shapes.get(key), shard.shapes.get(key)
                if (a is None) != (b is None) or (a is not None and a[1:] != b[1:]):
                    raise ValueError(f"latent shards disagree on {key!r}: {first.path!r} has {a}, "
                                     f"{shard.path!r} has {b} (all shards of a folder need the same per-sample shape)")

    @property
    def sample_shape(self) -> tuple:
        """``(C, T, H, W)`` of every sample."""
        return self.shards[0].shapes["latents"][1:]

    @property
    def has_text(self) -> bool:
        return "text" in self.shards[0].shapes

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        index %= n
        k = bisect.bisect_right(self._starts, index) - 1
        raw = self.shards[k].read(index - self._starts[k])
        item = {"latents": raw["latents"].float(),
                "label": raw["labels"].long() if "labels" in raw else torch.tensor(0, dtype=torch.long)}
        if "text" in raw:
            item["text"] = raw["text"].float()
        if "text_mask" in raw:
            item["text_mask"] = raw["text_mask"].bool()
        return item


class CycledDataset(Dataset):
    """``dataset`` repeated to ``length`` samples (sample ``i`` is ``dataset[i % len(dataset)]``): for a loop
    that reads a fixed number of samples from a finite set, as Megatron-LM's validation does."""

    def __init__(self, dataset, length: int):
        if len(dataset) < 1 or length < 1:
            raise ValueError(f"CycledDataset needs a non-empty dataset and length >= 1, got {len(dataset)} and "
                             f"{length}")
        self.dataset, self.length = dataset, int(length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        return self.dataset[index % len(self.dataset)]

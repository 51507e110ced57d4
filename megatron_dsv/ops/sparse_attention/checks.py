"""Input validation shared by every backend.

Shape/dtype/device checks are free (metadata only). Checks on index *values*
(range, sort order, counts) need the data: they run as one fused reduction and
a single small device-to-host copy, and ``DSV_SKIP_CHECKS=1`` turns them off
for production runs whose lists come from our own top-k kernel.
"""

from __future__ import annotations

import math
import os

import torch

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)
SUPPORTED_BLOCK_SIZES = (0, 64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_shapes(q, k, v, kv_indices, kv_counts, group_size: int, block_size: int) -> None:
    """Raise ValueError naming the argument for any metadata mismatch.

    q ``[B, H, Sq, D]``; k, v ``[B, Hkv, Sk, D]`` with any ``Sk >= 1`` (Sk != Sq: a context-parallel
    rank's queries against its gathered keys); kv_indices ``[B, H, ceil(Sq / G), Kmax]``;
    kv_counts ``[B, H]`` (one list length per head) or ``[B, H, NG]`` (one per query group).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, S, D]; got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype must be one of float16, bfloat16, float32; got {t.dtype}")
    B, H, S, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[2] < 1 or k.shape[3] != D:
        raise ValueError(f"k/v must be [B={B}, Hkv, Sk>=1, D={D}]; got {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or H % hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({hkv})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim D={D} is not supported; allowed: {SUPPORTED_HEAD_DIMS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}; got {group_size}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES} (0 = token-level); got {block_size}")
    ng = math.ceil(S / group_size)
    if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype != torch.int32 or kv_indices.dim() != 4:
        raise ValueError(f"kv_indices must be an int32 tensor [B, H, NG, Kmax]; got "
                         f"{getattr(kv_indices, 'dtype', type(kv_indices))} {tuple(getattr(kv_indices, 'shape', ()))}")
    if tuple(kv_indices.shape[:3]) != (B, H, ng):
        raise ValueError(f"kv_indices must be [B={B}, H={H}, NG=ceil(S/group_size)={ng}, Kmax] "
                         f"(S = q's length); "
                         f"got {tuple(kv_indices.shape)}")
    if (not isinstance(kv_counts, torch.Tensor) or kv_counts.dtype != torch.int32
            or tuple(kv_counts.shape) not in ((B, H), (B, H, ng))):
        raise ValueError(f"kv_counts must be an int32 tensor [B={B}, H={H}] or [B, H, NG={ng}]; got "
                         f"{getattr(kv_counts, 'dtype', type(kv_counts))} {tuple(getattr(kv_counts, 'shape', ()))}")
    for name, t in (("k", k), ("v", v), ("kv_indices", kv_indices), ("kv_counts", kv_counts)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")


def group_counts(kv_counts: torch.Tensor, num_groups: int) -> torch.Tensor:
    """kv_counts as ``[B, H, NG]``: per-head counts ``[B, H]`` broadcast over the query groups (a view),
    per-group counts as they are."""
    return kv_counts if kv_counts.dim() == 3 else kv_counts[:, :, None].expand(-1, -1, num_groups)


def num_keys(S: int, block_size: int) -> int:
    """How many distinct list entries exist for S keys: tokens or key blocks (the last may be partial)."""
    return S if block_size == 0 else math.ceil(S / block_size)


def skip_value_checks() -> bool:
    return os.environ.get("DSV_SKIP_CHECKS", "0") not in ("", "0")


def check_values(kv_indices: torch.Tensor, kv_counts: torch.Tensor, S: int, block_size: int) -> None:
    """Counts within [0, min(Kmax, #keys)], valid entries in range and strictly ascending.

    ``S`` is the KEY length (k.shape[2]): entries index its tokens or its key blocks.

    One reduction over the lists and one host sync for five scalars; padding
    entries (past the count) are masked out, never interpreted.
    """
    if skip_value_checks() or kv_indices.numel() == 0:
        return
    kmax = kv_indices.shape[-1]
    nk = num_keys(S, block_size)
    pos = torch.arange(kmax, device=kv_indices.device, dtype=torch.int32)
    valid = pos < group_counts(kv_counts, kv_indices.shape[2])[..., None]
    idx = kv_indices
    big = torch.iinfo(torch.int32).max
    lo = torch.where(valid, idx, big).amin()
    hi = torch.where(valid, idx, -1).amax()
    # sorted-unique: every valid entry after the first exceeds its predecessor
    step_ok = (idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]
    stats = torch.stack([kv_counts.amin(), kv_counts.amax(), lo, hi,
                         step_ok.all().to(torch.int32)]).tolist()
    cmin, cmax, lo, hi, ordered = stats
    what = "key positions" if block_size == 0 else "key-block ids"
    if cmin < 0 or cmax > kmax or cmax > nk:
        raise ValueError(f"kv_counts must lie in [0, min(Kmax={kmax}, number of {what}={nk})]; "
                         f"got min {cmin}, max {cmax}")
    if cmax > 0 and (lo < 0 or hi >= nk):
        raise ValueError(f"kv_indices ({what}) must lie in [0, {nk}) for block_size={block_size}; "
                         f"got min {lo}, max {hi} among valid entries")
    if not ordered:
        raise ValueError("kv_indices: the first kv_counts entries of every group must be sorted ascending and unique")

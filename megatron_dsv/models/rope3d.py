"""3D rotary position embedding for latent videos, in Megatron-Core's ``rotary_pos_emb`` format.

Megatron's ``SelfAttention`` applies ``rotary_pos_emb`` (a tensor ``[s, 1, 1, d]``,
or a ``(q, k)`` pair of them) with ``apply_rotary_pos_emb`` in the non-interleaved
("rotate half") layout: channel ``i`` and channel ``i + d/2`` of a head form one
rotation pair turned by angle ``freqs[..., i]``. The table therefore holds
``cat(angles, angles)`` with ``angles`` of width ``d/2``.

The ``d/2`` rotation pairs of a head are split into three bands, one per axis
(t, h, w), each band with its own geometric frequency ladder; a pair in the
t band turns by ``t * f``, never by h or w. The coordinates are those of the tokens
in cube-major order (:func:`megatron_dsv.attention.grouping.cube_order_coords`),
so the table lines up with the token order the model uses everywhere.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence, Tuple

import torch

from megatron_dsv.attention.grouping import cube_order_coords

__all__ = ["rope_bands", "rope_3d_freqs", "rope_3d_table"]


def rope_bands(head_dim: int) -> Tuple[int, int, int]:
    """Rotation pairs per axis ``(n_t, n_h, n_w)``; they sum to ``head_dim // 2``.

    h and w get equal shares (a frame has no preferred spatial axis); t takes the rest,
    so it gets the extra pairs when ``head_dim // 2`` is not a multiple of 3.
    """
    if head_dim % 2 != 0 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6 for 3D RoPE (two channels per axis at least), got {head_dim}")
    pairs = head_dim // 2
    n_hw = pairs // 3
    return pairs - 2 * n_hw, n_hw, n_hw


def _ladder(n: int, theta: float) -> torch.Tensor:
    # The usual 1D RoPE ladder for a band of 2n channels: theta^(-2k / 2n), k = 0..n-1.
    return 1.0 / (theta ** (torch.arange(n, dtype=torch.float64) / n))


def rope_3d_freqs(coords: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``[S, head_dim // 2]`` (float32) for (t, h, w) coordinates ``[S, 3]``.

    Columns ``[0, n_t)`` depend on t only, ``[n_t, n_t + n_h)`` on h only, the rest on w only.
    """
    if coords.dim() != 2 or coords.shape[1] != 3:
        raise ValueError(f"coords must be [S, 3] (t, h, w), got {tuple(coords.shape)}")
    if theta <= 1.0:
        raise ValueError(f"theta must be > 1, got {theta}")
    bands = rope_bands(head_dim)
    c = coords.to(torch.float64)
    parts = [c[:, axis:axis + 1] * _ladder(n, theta)[None, :] for axis, n in enumerate(bands)]
    return torch.cat(parts, dim=1).to(torch.float32)


@lru_cache(maxsize=32)
def _table(grid: Tuple[int, int, int], cube: Tuple[int, int, int], head_dim: int, theta: float) -> torch.Tensor:
    angles = rope_3d_freqs(cube_order_coords(grid, cube), head_dim, theta)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :].contiguous()


def rope_3d_table(grid: Sequence[int], cube: Sequence[int], head_dim: int, theta: float = 10000.0,
                  device=None) -> torch.Tensor:
    """``rotary_pos_emb`` for Megatron's ``SelfAttention``: float32 ``[T*H*W, 1, 1, head_dim]``.

    Row i belongs to token i of the cube-major order of ``grid`` (patch grid, not pixels).
    Kept in float32 whatever the model dtype: Megatron casts cos/sin to the activations'
    dtype itself, and bf16 angles would lose the position for long sequences.
    """
    key = (tuple(int(g) for g in grid), tuple(int(c) for c in cube), int(head_dim), float(theta))
    return _table(*key) if device is None else _table_on(*key, torch.device(device))


@lru_cache(maxsize=32)
def _table_on(grid, cube, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # one host-to-device copy per (shape, device), not one (pageable, synchronous) per forward
    return _table(grid, cube, head_dim, theta).to(device)

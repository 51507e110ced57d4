"""3D-cube-major token order: consecutive tokens form cubes of the latent grid.

DSV lets one KV list serve a query group of G consecutive tokens. Neighbouring
queries in space-time share critical keys, so the model orders the tokens of a
latent video ``(T, H, W)`` so that every run of ``G = ct*ch*cw`` tokens is one
``ct x ch x cw`` cube. The model reorders once at patch embedding
(:func:`to_cube_order`) and once back at the output (:func:`from_cube_order`);
RoPE uses the (t, h, w) coordinates of :func:`cube_order_coords`.

When a grid side is not a multiple of the cube side, the edge cubes are partial:
the order is still a bijection, but groups near the edge straddle cubes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence, Tuple

import torch

__all__ = ["cube_order_permutation", "cube_order_coords", "to_cube_order", "from_cube_order"]


def _check(grid: Sequence[int], cube: Sequence[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    grid, cube = tuple(int(x) for x in grid), tuple(int(x) for x in cube)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"grid must be three positive ints (T, H, W), got {grid}")
    if len(cube) != 3 or min(cube) < 1:
        raise ValueError(f"cube must be three positive ints (t, h, w), got {cube}")
    return grid, cube


@lru_cache(maxsize=64)
def _permutation(grid: Tuple[int, int, int], cube: Tuple[int, int, int]) -> torch.Tensor:
    T, H, W = grid
    ct, ch, cw = cube
    t = torch.arange(T).view(T, 1, 1).expand(T, H, W)
    h = torch.arange(H).view(1, H, 1).expand(T, H, W)
    w = torch.arange(W).view(1, 1, W).expand(T, H, W)
    nh, nw = -(-H // ch), -(-W // cw)
    # Sort key: (cube id in raster order of the cube grid, position inside the cube).
    cube_id = ((t // ct) * nh + (h // ch)) * nw + (w // cw)
    inner = ((t % ct) * ch + (h % ch)) * cw + (w % cw)
    key = (cube_id * (ct * ch * cw) + inner).reshape(-1)
    return torch.argsort(key, stable=True)


def cube_order_permutation(grid: Sequence[int], cube: Sequence[int]) -> torch.Tensor:
    """``perm`` (int64 ``[T*H*W]``): cube-major token i is raster token ``perm[i]``."""
    return _permutation(*_check(grid, cube))


def cube_order_coords(grid: Sequence[int], cube: Sequence[int]) -> torch.Tensor:
    """(t, h, w) coordinates (int64 ``[T*H*W, 3]``) of the tokens in cube-major order."""
    grid, cube = _check(grid, cube)
    perm = _permutation(grid, cube)
    T, H, W = grid
    return torch.stack([perm // (H * W), (perm // W) % H, perm % W], dim=-1)


@lru_cache(maxsize=64)
def _index_on(grid: Tuple[int, int, int], cube: Tuple[int, int, int], device: torch.device,
              inverse: bool) -> torch.Tensor:
    """The permutation (or its inverse) on ``device``: built and copied once per model forward shape,
    not once per forward."""
    perm = _permutation(grid, cube)
    if inverse:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        perm = inv
    return perm.to(device)


def _reorder(x: torch.Tensor, grid, cube, dim: int, inverse: bool) -> torch.Tensor:
    grid, cube = _check(grid, cube)
    n = grid[0] * grid[1] * grid[2]
    if x.shape[dim] != n:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must equal T*H*W = {n} for grid {tuple(grid)}")
    return x.index_select(dim, _index_on(grid, cube, x.device, inverse))


def to_cube_order(x: torch.Tensor, grid: Sequence[int], cube: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Reorder ``x`` along ``dim`` (raster order, length T*H*W) into cube-major order."""
    return _reorder(x, grid, cube, dim, inverse=False)


def from_cube_order(x: torch.Tensor, grid: Sequence[int], cube: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`to_cube_order`: cube-major order back to raster order."""
    return _reorder(x, grid, cube, dim, inverse=True)

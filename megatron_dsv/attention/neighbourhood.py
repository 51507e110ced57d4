"""3D neighbourhoods of query cubes: the window baseline's lists and DSV's always-on local part.

Tokens are in 3D-cube-major order (:mod:`megatron_dsv.attention.grouping`): every run of
``G = ct*ch*cw`` tokens is one cube of the token grid, cubes in raster order of the cube grid.
The neighbourhood of a cube at radius ``(rt, rh, rw)`` is every cube at most ``r_a`` cubes
away on axis ``a`` (a Chebyshev box in cube units, clipped at the grid's edges, the cube itself
included).

Two users: the static window baseline (``models/window_attention.py``: the query cube is the KV
block, lists of cube ids, :func:`window_block_lists`) and DSV's *local + predicted* lists
(``DSVConfig.local_radius``: :func:`local_item_lists` gives, per query group, the key items of
its neighbourhood, which the estimator then always keeps, filling the rest of the budget with its
own top-k).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence, Tuple

import torch

__all__ = ["Triple", "window_block_lists", "kept_fraction", "radius_for_fraction", "local_item_lists",
           "local_items_with_counts"]

Triple = Tuple[int, int, int]


def _geometry(token_grid: Sequence[int], cube: Sequence[int]) -> Tuple[Triple, Triple, Triple]:
    """(grid, cube, cube grid); ValueError unless every grid side is a positive multiple of the cube side."""
    grid, cube = tuple(int(x) for x in token_grid), tuple(int(x) for x in cube)
    if len(cube) != 3 or min(cube) < 1:
        raise ValueError(f"cube must be three positive ints (t, h, w), got {cube}")
    if len(grid) != 3 or min(grid) < 1 or any(g % c for g, c in zip(grid, cube)):
        # a partial edge cube would not be a whole KV block of the kernel
        raise ValueError(f"token_grid must be three positive ints (T, H, W), each a multiple of cube {cube}; "
                         f"got {grid}")
    return grid, cube, tuple(g // c for g, c in zip(grid, cube))


def _radius(radius: Sequence[int]) -> Triple:
    radius = tuple(int(x) for x in radius)
    if len(radius) != 3 or min(radius) < 0:
        raise ValueError(f"radius must be three ints >= 0 (rt, rh, rw) in cubes, got {radius}")
    return radius


@lru_cache(maxsize=32)
def _lists_cpu(ncubes: Triple, radius: Triple) -> Tuple[torch.Tensor, torch.Tensor]:
    # a radius past the grid names the same cubes as n - 1: clamp, so candidates stay few
    radius = tuple(min(r, n - 1) for r, n in zip(radius, ncubes))
    coords = torch.cartesian_prod(*(torch.arange(n) for n in ncubes)).view(-1, 1, 3)  # [nG, 1, 3] raster order
    offsets = torch.cartesian_prod(*(torch.arange(-r, r + 1) for r in radius)).view(1, -1, 3)  # [1, nC, 3]
    nbr = coords + offsets  # offsets are lexicographic, so valid neighbour ids come out ascending
    valid = ((nbr >= 0) & (nbr < torch.tensor(ncubes))).all(-1)
    ids = (nbr[..., 0] * ncubes[1] + nbr[..., 1]) * ncubes[2] + nbr[..., 2]
    counts = valid.sum(-1)
    # move the valid entries to the front, keeping their order; padding is -1 (never read)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[:, :int(counts.max())]
    idx = torch.where(valid.gather(1, order), ids.gather(1, order), -1)
    return idx.to(torch.int32), counts.to(torch.int32)


@lru_cache(maxsize=32)
def _lists_on(ncubes: Triple, radius: Triple, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    idx, counts = _lists_cpu(ncubes, radius)
    return idx.to(device), counts.to(device)


def window_block_lists(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int],
                       device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """KV-cube lists of every query cube.

    Returns ``(kv_indices, kv_counts)``: int32 ``[nG, Kmax]`` and ``[nG]``, ``nG = nT*nH*nW``
    cubes in raster order of the cube grid; row g holds, ascending, the ids of the cubes within
    ``radius`` of cube g on every axis (g itself included), then -1 padding. Cached per
    (grid, cube, radius, device): treat the tensors as read-only.
    """
    _, _, ncubes = _geometry(token_grid, cube)
    return _lists_on(ncubes, _radius(radius), torch.device(device if device is not None else "cpu"))


def _axis_coverage(n: int, r: int) -> float:
    """Mean over the n cubes of one axis of the fraction of that axis inside the window."""
    return sum(min(i + r, n - 1) - max(i - r, 0) + 1 for i in range(n)) / (n * n)


def kept_fraction(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int]) -> float:
    """Mean over queries of the fraction of keys attended (1 - sparsity), to match DSV's density.

    The window is a product of per-axis windows over a product grid, so the mean factorises by axis.
    """
    _, _, ncubes = _geometry(token_grid, cube)
    return math.prod(_axis_coverage(n, r) for n, r in zip(ncubes, _radius(radius)))


def radius_for_fraction(token_grid: Sequence[int], cube: Sequence[int], target: float) -> Triple:
    """The first radius on a balanced growth path whose :func:`kept_fraction` is >= ``target``.

    Search: start at (0, 0, 0); while the kept fraction is below ``target``, add one cube of
    radius to the axis whose window side in tokens, ``(2 r_a + 1) * cube_a``, is smallest (the
    earliest of t, h, w on ties), skipping axes the window already spans. Each step keeps
    the window as close to a token-space cube as the cube grid allows and strictly raises
    the fraction, so the path ends at full attention (1.0) and the answer is the smallest
    radius on it (not a search over every (rt, rh, rw)).
    """
    _, cube, ncubes = _geometry(token_grid, cube)
    if not 0.0 < float(target) <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    radius = [0, 0, 0]
    while kept_fraction(token_grid, cube, radius) < target:
        open_axes = [a for a in range(3) if radius[a] < ncubes[a] - 1]
        if not open_axes:  # float round-off at target ~ 1.0: the window is already everything
            break
        axis = min(open_axes, key=lambda a: ((2 * radius[a] + 1) * cube[a], a))
        radius[axis] += 1
    return tuple(radius)


@lru_cache(maxsize=32)
def _local_items_cpu(ncubes: Triple, cube: Triple, radius: Triple, block_size: int) -> torch.Tensor:
    cubes, counts = _lists_cpu(ncubes, radius)  # [nG, C] ascending cube ids, -1 padded
    G = math.prod(cube)
    n_cubes = cubes.shape[0]
    if block_size == 0:  # the neighbour cubes' tokens: cube c holds tokens c*G .. c*G + G - 1
        toks = cubes.long()[:, :, None] * G + torch.arange(G)
        valid = (cubes >= 0)[:, :, None].expand_as(toks)
        return torch.where(valid, toks, -1).reshape(n_cubes, -1).to(torch.int32)
    # key blocks covering the neighbour cubes' tokens (G and block_size are powers of two: a block is
    # a run of whole cubes, or a cube a run of whole blocks)
    n_blocks = -(-n_cubes * G // block_size)
    mark = torch.zeros(n_cubes, n_blocks + 1, dtype=torch.bool)
    first = torch.where(cubes >= 0, cubes.long() * G // block_size, n_blocks)
    last = torch.where(cubes >= 0, (cubes.long() * G + G - 1) // block_size, n_blocks)
    for off in range(int((last - first).max()) + 1):
        mark.scatter_(1, torch.minimum(first + off, last), True)
    mark = mark[:, :n_blocks]
    width = int(mark.sum(1).max())
    pos = torch.arange(n_blocks).expand(n_cubes, n_blocks)
    key = torch.where(mark, pos, n_blocks)
    items = torch.sort(key, dim=1).values[:, :width]
    return torch.where(items == n_blocks, -1, items).to(torch.int32)


@lru_cache(maxsize=32)
def _local_items_on(ncubes: Triple, cube: Triple, radius: Triple, block_size: int, device: torch.device):
    return _local_items_cpu(ncubes, cube, radius, block_size).to(device)


def local_item_lists(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int], block_size: int,
                     device=None) -> torch.Tensor:
    """Per query group (= cube, in cube-grid raster order), the key items of its neighbourhood.

    Returns int32 ``[nG, F]``: row g holds, ascending, the keys (``block_size`` 0) or the key blocks
    (``block_size`` 64 / 128, blocks of the cube-major token order) covering every cube within
    ``radius`` of cube g, then -1 padding (edge cubes have fewer neighbours). Cached per
    (grid, cube, radius, block, device): treat the tensor as read-only. ``F * max(block_size, 1)``
    tokens is the most any group's local part can hold.
    """
    return _local_items_on(*_cache_key(token_grid, cube, radius, block_size, device))


def _cache_key(token_grid, cube, radius, block_size, device) -> tuple:
    """``(cube grid, cube, radius, block_size, device)``, validated: the key of the neighbourhood caches."""
    _, cube, ncubes = _geometry(token_grid, cube)
    if block_size not in (0, 64, 128):
        raise ValueError(f"block_size must be one of (0, 64, 128) (0 = token lists), got {block_size!r}")
    return ncubes, cube, _radius(radius), int(block_size), torch.device(device if device is not None else "cpu")


@lru_cache(maxsize=32)
def _local_counts_on(ncubes: Triple, cube: Triple, radius: Triple, block_size: int, device: torch.device):
    counts = (_local_items_cpu(ncubes, cube, radius, block_size) >= 0).sum(1)
    return counts.to(device=device, dtype=torch.int32), counts.double().mean().item()


def local_items_with_counts(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int], block_size: int,
                            device=None) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """``(lists, counts, mean)``: :func:`local_item_lists`, the valid items of each of its rows (int32 ``[nG]`` on
    ``device``) and their mean over the query groups (a host float, in items); the arguments checked once. Cached
    like the lists: read-only."""
    key = _cache_key(token_grid, cube, radius, block_size, device)
    return (_local_items_on(*key), *_local_counts_on(*key))

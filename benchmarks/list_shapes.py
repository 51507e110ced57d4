"""Sparse-attention lists shaped like a video DiT's, for the kernel benchmark
(``bench_sparse_attention --lists video``).

The kernel table's default lists are uniform random draws: every query group keeps a random ``(1 - s)`` of the
keys, so neighbouring groups share almost nothing (mean Jaccard ``d / (2 - d)``, 0.05 at 90% sparsity). DSV's
lists are not like that: a group is a cube of the video, its top-k of predicted scores keeps its 3D neighbourhood
and keys its neighbours keep too. Kernels whose cost depends on how lists overlap (key tiles walked per group,
atomics merged across groups, L2 reuse) are timed on both shapes.

:func:`video_lists` lays the ``S / G`` query groups (cubes, in the library's cube order: consecutive tokens) on a
3D grid of cubes and scores every (group, key item) pair per head by

    -dist^2 / (2 sigma_h^2)  +  a_h <phi_h(p_g), phi_h(p_j)> / sqrt(F)  +  0.1 noise

(a local bump of head-specific width, a smooth long-range term of random Fourier features, and noise), then keeps
each group's top ``round((1 - s) * items)``. A key token sits in its cube with a random offset; a key block of
``BS`` tokens at the mean of the cubes it spans. Deterministic for a seed; the scores are made a chunk of groups at
a time (a few hundred MiB at 128K tokens).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["video_lists", "neighbour_overlap"]

_FEATURES = 16


def _cube_grid(n_cubes: int) -> Tuple[int, int, int]:
    """(frames, rows, cols) of cubes: a square frame of the largest power-of-two side holding at most a quarter
    of the cubes (so there are at least 4 frames), the rest along time; partial last frame allowed."""
    side = 1
    while (2 * side) ** 2 * 4 <= n_cubes:
        side *= 2
    return math.ceil(n_cubes / (side * side)), side, side


def _cube_positions(n_cubes: int, device) -> torch.Tensor:
    """[n_cubes, 3] float positions (frame, row, col) of the cubes in row-major cube order."""
    _, rows, cols = _cube_grid(n_cubes)
    c = torch.arange(n_cubes, device=device)
    return torch.stack((c // (rows * cols), (c // cols) % rows, c % cols), -1).float()


def video_lists(S: int, G: int, BS: int, sparsity: float, heads: int, batch: int = 1, seed: int = 0,
                device="cpu", chunk: int = 256) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(kv_indices int32 [batch, heads, ceil(S / G), K], kv_counts int32 [batch, heads], kept keys per group)``
    with ``K = max(1, round((1 - sparsity) * items))`` sorted item ids per group (items: S tokens, or
    ``ceil(S / BS)`` key blocks); every batch row gets the same lists."""
    if G < 1 or BS < 0 or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"video_lists: needs G >= 1, BS >= 0 and 0 <= sparsity < 1, got G={G}, BS={BS}, "
                         f"sparsity={sparsity}")
    gen = torch.Generator(device=device).manual_seed(seed)
    NG = math.ceil(S / G)
    n_items = S if BS == 0 else math.ceil(S / BS)
    K = max(1, round((1 - sparsity) * n_items))
    cubes = _cube_positions(NG, device)
    if BS == 0:  # a token: its cube, offset within it
        offset = torch.rand(S, 3, device=device, generator=gen) - 0.5
        items = cubes[torch.arange(S, device=device) // G] + offset
    else:  # a block: the mean position of the cubes its tokens fall in (its first and last token's cubes)
        first = torch.arange(n_items, device=device) * BS
        last = (first + BS - 1).clamp(max=S - 1)
        items = (cubes[first // G] + cubes[last // G]) / 2
    extent = cubes.amax(0) + 1  # grid size per axis, the Fourier features' length scale
    idx = torch.empty(heads, NG, K, device=device, dtype=torch.int32)
    for h in range(heads):
        sigma = 0.5 + 1.5 * torch.rand((), device=device, generator=gen)  # local width: 0.5-2 cubes
        amp = 0.5 + 1.5 * torch.rand((), device=device, generator=gen)
        w = torch.randn(3, _FEATURES, device=device, generator=gen) * (2 * math.pi / extent)[:, None]
        b = torch.rand(_FEATURES, device=device, generator=gen) * 2 * math.pi
        phi_items = torch.cos(items @ w + b)
        for g0 in range(0, NG, chunk):
            g1 = min(NG, g0 + chunk)
            pos = cubes[g0:g1]
            score = -torch.cdist(pos, items).square_() / (2 * sigma * sigma)
            score += (amp / math.sqrt(_FEATURES)) * (torch.cos(pos @ w + b) @ phi_items.T)
            score += 0.1 * torch.randn(score.shape, device=device, generator=gen)
            idx[h, g0:g1] = score.topk(K, dim=-1).indices.sort(-1).values.to(torch.int32)
            del score
    idx = idx.unsqueeze(0).expand(batch, heads, NG, K).contiguous()
    cnt = torch.full((batch, heads), K, device=device, dtype=torch.int32)
    return idx, cnt, K * (1 if BS == 0 else BS)


def neighbour_overlap(kv_indices: torch.Tensor, kv_counts: torch.Tensor, n_items: int, max_groups: int = 512) -> float:
    """Mean Jaccard similarity of consecutive query groups' lists (group g and g + 1, over the first
    ``max_groups`` groups of every batch row and head): how much of a list its neighbour shares. Uniform random
    lists of density d give about d / (2 - d)."""
    B, H, NG, K = kv_indices.shape
    n = min(NG, max_groups)
    if n < 2:
        return 0.0
    total = 0.0
    for b in range(B):
        for h in range(H):
            k = int(kv_counts[b, h])
            member = torch.zeros(n, n_items, dtype=torch.bool, device=kv_indices.device)
            member.scatter_(-1, kv_indices[b, h, :n, :k].long(), True)
            inter = (member[1:] & member[:-1]).sum(-1).float()
            union = (member[1:] | member[:-1]).sum(-1).float().clamp(min=1)
            total += (inter / union).mean().item()
    return total / (B * H)

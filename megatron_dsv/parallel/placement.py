"""Head placement over the ranks of an HCP (head-wise CP) group.

Sparse heads differ in cost (per-head density varies 2-20% in one layer), so a contiguous equal
split of the heads leaves some ranks straggling (+35.7% in the DSV paper). Longest-Processing-Time
(LPT) placement balances the summed cost instead: heads by descending cost, each to the rank with
the least load so far. LPT is within 4/3 of the optimal makespan and exact on uniform costs.

A placement is a list, per HCP rank, of ascending head ids; every head appears exactly once.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["even_placement", "lpt_placement", "makespan", "head_order_and_counts", "head_costs"]


def _check_ranks(ranks: int) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int (the HCP group size), got {ranks!r}")


def _check_costs(costs: Sequence[float]) -> List[float]:
    out = [float(c) for c in costs]
    if not out:
        raise ValueError("costs must hold one cost per head, got an empty sequence")
    for i, c in enumerate(out):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs must be finite and >= 0, got costs[{i}] = {c}")
    return out


def even_placement(num_heads: int, ranks: int) -> List[List[int]]:
    """Contiguous equal split: rank r gets heads ``[r*n/ranks, (r+1)*n/ranks)``.

    Raises ValueError unless ``num_heads`` is a positive multiple of ``ranks``.
    """
    _check_ranks(ranks)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or num_heads % ranks:
        raise ValueError(f"num_heads must be a positive multiple of ranks ({ranks}), got {num_heads!r}")
    per = num_heads // ranks
    return [list(range(r * per, (r + 1) * per)) for r in range(ranks)]


def lpt_placement(costs: Sequence[float], ranks: int) -> List[List[int]]:
    """Longest-Processing-Time placement of heads with ``costs`` over ``ranks`` ranks.

    Heads in order of descending cost (ties: lower head id first) each go to the rank with the
    least load so far; load ties go to the rank holding fewer heads (so zero-cost heads still
    spread out), then to the lower rank. Each rank's list is sorted ascending.
    """
    _check_ranks(ranks)
    values = _check_costs(costs)
    order = sorted(range(len(values)), key=lambda h: (-values[h], h))
    loads = [0.0] * ranks
    placement: List[List[int]] = [[] for _ in range(ranks)]
    for h in order:
        r = min(range(ranks), key=lambda i: (loads[i], len(placement[i]), i))
        loads[r] += values[h]
        placement[r].append(h)
    return [sorted(p) for p in placement]


def _check_placement(placement: Sequence[Sequence[int]], num_heads: Optional[int] = None) -> None:
    flat = [int(h) for p in placement for h in p]
    n = len(flat) if num_heads is None else num_heads
    if sorted(flat) != list(range(n)):
        raise ValueError(f"placement must hold every head 0..{n - 1} exactly once, got {list(map(list, placement))}")


def makespan(costs: Sequence[float], placement: Sequence[Sequence[int]]) -> float:
    """The largest per-rank sum of head costs under ``placement``."""
    values = _check_costs(costs)
    _check_placement(placement, len(values))
    return max(sum(values[h] for h in p) for p in placement)


def head_order_and_counts(placement: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """The flat head order (rank 0's heads, then rank 1's, ...) and per-rank head counts: what the
    head/sequence all-to-alls take to permute heads and size their splits."""
    _check_placement(placement)
    order = [int(h) for p in placement for h in p]
    return order, [len(p) for p in placement]


def head_costs(density: Sequence[float], sparse: bool,
               speedup: Optional[Callable[[float], float]] = None) -> List[float]:
    """Per-head compute cost in units of one dense head (dense attention over the same tokens).

    * a layer that runs dense (``sparse=False``): every head costs 1;
    * a sparse layer: head h costs ``1 / speedup(density[h])`` when ``speedup`` is given, where
      ``speedup(d) = dense_time / sparse_time`` measured at density d (fwd+bwd, e.g.
      ``lambda d: table.speedup(S, 1 - d)`` with a dispatcher ``SpeedupTable``); without it the
      cost is the density itself (the ideal kernel: time proportional to the keys it reads).

    Args:
        density: fraction of keys each head attends to, in (0, 1].
        sparse: whether the layer runs the sparse kernel.
        speedup: optional measured speedup as a function of density (must return > 0).
    """
    values = [float(d) for d in density]
    if not values:
        raise ValueError("density must hold one value per head, got an empty sequence")
    for i, d in enumerate(values):
        if not (0.0 < d <= 1.0):
            raise ValueError(f"density must lie in (0, 1], got density[{i}] = {d}")
    if not sparse:
        return [1.0] * len(values)
    if speedup is None:
        return values
    costs = []
    for i, d in enumerate(values):
        s = float(speedup(d))
        if not math.isfinite(s) or s <= 0:
            raise ValueError(f"speedup must return a finite value > 0, got speedup({d}) = {s} for head {i}")
        costs.append(1.0 / s)
    return costs

"""DSV context-parallel groups: hybrid layouts of head-wise (HCP) and sequence-wise (SCP) CP.

A CP group of ``cp`` ranks holds a video sequence split into ``cp`` equal shards, in CP rank order
(cube-major tokens; a shard never splits a query group). Per layer DSV factorises ``cp = hcp * scp``:

* an **HCP group** (``hcp`` ranks) runs Ulysses all-to-alls: each member ends up with the HCP
  group's whole stretch of sequence for a subset of the heads;
* an **SCP group** (``scp`` ranks, the members holding the same heads in different HCP groups)
  splits that sequence: each member keeps its own queries and fetches from the others only the
  key/value rows its sparse lists reference.

Which of the two groups gets consecutive CP ranks (and therefore usually stays inside a node) is
the layout's ``hcp_inner`` flag. The rank arithmetic is pure (:func:`layout_groups`);
:class:`DSVCPGroups` turns it into process groups once, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

__all__ = ["CPLayout", "cp_layouts", "layout_groups", "DSVCPGroups"]


@dataclass(frozen=True)
class CPLayout:
    """One factorisation ``hcp * scp`` of the CP size and the placement of its groups.

    Attributes:
        hcp: head-wise CP size (ranks of one Ulysses all-to-all group).
        scp: sequence-wise CP size (ranks that split one stretch of sequence).
        hcp_inner: True: an HCP group's ranks are consecutive CP ranks (HCP inside a node first);
            False: an SCP group's ranks are. When ``hcp == 1`` or ``scp == 1`` the placement does
            not matter and the flag is normalised to True, so equal layouts compare equal.
    """

    hcp: int
    scp: int
    hcp_inner: bool = True

    def __post_init__(self):
        for field in ("hcp", "scp"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CPLayout.{field} must be a positive int, got {value!r}")
        if self.degenerate:
            object.__setattr__(self, "hcp_inner", True)
        else:
            object.__setattr__(self, "hcp_inner", bool(self.hcp_inner))

    @property
    def cp(self) -> int:
        """The CP size ``hcp * scp``."""
        return self.hcp * self.scp

    @property
    def degenerate(self) -> bool:
        """True when one of the two groups has a single rank (pure HCP or pure SCP)."""
        return self.hcp == 1 or self.scp == 1

    @property
    def name(self) -> str:
        """Short label, e.g. ``'hcp2-scp2-hcp_inner'``; pure layouts have no suffix (``'hcp4-scp1'``)."""
        base = f"hcp{self.hcp}-scp{self.scp}"
        if self.degenerate:
            return base
        return base + ("-hcp_inner" if self.hcp_inner else "-scp_inner")


def cp_layouts(cp: int) -> List[CPLayout]:
    """Every layout of ``cp`` ranks: each factorisation ``hcp * scp = cp`` by ascending ``hcp``,
    with both placements (``hcp_inner`` True first) unless one factor is 1."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    layouts = []
    for hcp in range(1, cp + 1):
        if cp % hcp:
            continue
        scp = cp // hcp
        layouts.append(CPLayout(hcp, scp, True))
        if hcp != 1 and scp != 1:
            layouts.append(CPLayout(hcp, scp, False))
    return layouts


def _positions(layout: CPLayout) -> Tuple[List[List[int]], List[List[int]]]:
    """HCP and SCP groups as CP-rank positions (0..cp-1), each group in ascending order."""
    hcp, scp = layout.hcp, layout.scp
    if layout.hcp_inner:
        hcp_groups = [[j * hcp + a for a in range(hcp)] for j in range(scp)]
        scp_groups = [[j * hcp + a for j in range(scp)] for a in range(hcp)]
    else:
        scp_groups = [[j * scp + a for a in range(scp)] for j in range(hcp)]
        hcp_groups = [[j * scp + a for j in range(hcp)] for a in range(scp)]
    return hcp_groups, scp_groups


def layout_groups(cp_ranks: Sequence[int], layout: CPLayout) -> Tuple[List[List[int]], List[List[int]]]:
    """(HCP groups, SCP groups) of one CP group, as lists of global ranks.

    Args:
        cp_ranks: the CP group's global ranks in CP rank order (CP rank i is ``cp_ranks[i]``).
        layout: a :class:`CPLayout` with ``hcp * scp == len(cp_ranks)``.

    Every rank is in exactly one HCP and one SCP group, and the two meet only in that rank. Inside
    each group ranks follow CP rank order, so an SCP group's sequence shards stay in sequence order.
    A rank's HCP rank is its index in its HCP group (which heads it computes); its SCP rank is its
    index in its SCP group (which stretch of queries it owns).
    """
    ranks = [int(r) for r in cp_ranks]
    if not isinstance(layout, CPLayout):
        raise ValueError(f"layout must be a CPLayout, got {type(layout).__name__}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"cp_ranks must be distinct ranks, got {ranks}")
    if layout.cp != len(ranks):
        raise ValueError(f"layout {layout.name} needs hcp*scp == len(cp_ranks) ({len(ranks)}), "
                         f"got hcp*scp = {layout.cp}")
    hcp_pos, scp_pos = _positions(layout)
    return ([[ranks[p] for p in g] for g in hcp_pos], [[ranks[p] for p in g] for g in scp_pos])


def _group_ranks_in_order(group) -> List[int]:
    """Global ranks of ``group`` ordered by their rank inside the group."""
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda r: dist.get_group_rank(group, r))


def _check_partition(all_cp_ranks: List[List[int]], world: int) -> List[Tuple[int, ...]]:
    """The distinct CP groups, ordered by their first rank; checks they partition the world."""
    groups = sorted({tuple(r) for r in all_cp_ranks}, key=lambda g: g[0])
    seen: Dict[int, Tuple[int, ...]] = {}
    for g in groups:
        for r in g:
            if r in seen:
                raise ValueError(f"cp_group: rank {r} is in two different CP groups {seen[r]} and {g}")
            seen[r] = g
    for rank, own in enumerate(all_cp_ranks):
        if rank not in own:
            raise ValueError(f"cp_group: rank {rank} passed a CP group {own} that does not contain it")
    if len({len(g) for g in groups}) != 1 or len(seen) != world:
        raise ValueError(f"cp_group: CP groups must be of one size and cover the world, got {groups}")
    return groups


class DSVCPGroups:
    """Every HCP and SCP process group DSV needs, created once at start-up.

    Construction is a collective over the whole default (world) group: each rank contributes its
    CP group's ranks (``all_gather_object``) so that every rank calls ``new_group`` for every
    subgroup of every CP group, in one order. Groups equal to a whole CP group reuse ``cp_group``
    itself; groups of one rank are not created (``None``).

    Args:
        cp_group: this rank's context-parallel process group (Megatron's ``pg_collection.cp``).
        num_heads: attention heads per tensor-parallel rank; must be divisible by the CP size.
        layouts: the layouts to prepare (default: :func:`cp_layouts` of the CP size).
        tp_size: the tensor-parallel size, only to make the heads error message complete.
    """

    def __init__(self, cp_group, num_heads: int, layouts: Optional[Sequence[CPLayout]] = None,
                 tp_size: Optional[int] = None):
        self.cp_group = cp_group
        self.cp_ranks = _group_ranks_in_order(cp_group)
        self.cp_size = len(self.cp_ranks)
        self.num_heads = num_heads
        self._check_args(num_heads, tp_size)
        self.layouts = self._check_layouts(layouts)
        self.cp_rank = dist.get_rank(cp_group)
        world = dist.get_world_size()
        gathered: List[Optional[List[int]]] = [None] * world
        dist.all_gather_object(gathered, self.cp_ranks)
        self.all_cp_ranks = [list(g) for g in _check_partition(gathered, world)]
        self._mine: Dict[CPLayout, Tuple[object, object, int, int]] = {}
        self._mine_ranks: Dict[CPLayout, Tuple[List[int], List[int]]] = {}
        self._create_groups()

    # ------------------------------------------------------------------------
    def _check_args(self, num_heads: int, tp_size: Optional[int]) -> None:
        if self.cp_size <= 1:
            raise ValueError(f"DSV context parallelism needs context_parallel_size > 1, "
                             f"got a CP group of {self.cp_size} rank(s)")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int (attention heads per tensor-parallel rank), "
                             f"got {num_heads!r}")
        if num_heads % self.cp_size:
            tp = "unknown" if tp_size is None else str(tp_size)
            raise ValueError(f"num_attention_heads / tensor-parallel size ({num_heads} heads per rank, "
                             f"tensor-parallel size {tp}) must be divisible by context_parallel_size "
                             f"({self.cp_size}) for DSV context parallelism")

    def _check_layouts(self, layouts: Optional[Sequence[CPLayout]]) -> List[CPLayout]:
        if layouts is None:
            return cp_layouts(self.cp_size)
        out: List[CPLayout] = []
        for layout in layouts:
            if not isinstance(layout, CPLayout) or layout.cp != self.cp_size:
                raise ValueError(f"layouts must hold CPLayouts with hcp*scp == context_parallel_size "
                                 f"({self.cp_size}), got {layout!r}")
            if layout not in out:
                out.append(layout)
        if not out:
            raise ValueError("layouts must not be empty")
        return out

    def _create_groups(self) -> None:
        me = dist.get_rank()
        whole = {tuple(g) for g in self.all_cp_ranks}
        cache: Dict[Tuple[int, ...], object] = {}

        def make(ranks: List[int]):
            key = tuple(ranks)
            if len(key) == 1:
                return None
            if key in whole:  # a whole CP group: the one passed in (only its members ever use it)
                return self.cp_group if me in key else None
            if key not in cache:  # every rank calls new_group for every key, in the same order
                cache[key] = dist.new_group(list(key))
            return cache[key]

        for layout in self.layouts:
            for cp_ranks in self.all_cp_ranks:
                hcp_groups, scp_groups = layout_groups(cp_ranks, layout)
                made_h = [make(g) for g in hcp_groups]
                made_s = [make(g) for g in scp_groups]
                if cp_ranks != self.cp_ranks:
                    continue
                hi = next(i for i, g in enumerate(hcp_groups) if me in g)
                si = next(i for i, g in enumerate(scp_groups) if me in g)
                self._mine_ranks[layout] = (hcp_groups[hi], scp_groups[si])
                self._mine[layout] = (made_h[hi], made_s[si], hcp_groups[hi].index(me), scp_groups[si].index(me))

    # ------------------------------------------------------------------------
    def _lookup(self, layout: CPLayout, table: dict):
        if layout not in table:
            raise ValueError(f"layout must be one of {[l.name for l in self.layouts]}, got {layout!r}")
        return table[layout]

    def groups(self, layout: CPLayout) -> Tuple[Optional[object], Optional[object], int, int]:
        """This rank's ``(hcp_group, scp_group, hcp_rank, scp_rank)`` for ``layout``
        (a group of one rank is ``None``)."""
        return self._lookup(layout, self._mine)

    def group_ranks(self, layout: CPLayout) -> Tuple[List[int], List[int]]:
        """Global ranks of this rank's (HCP group, SCP group) for ``layout``."""
        return self._lookup(layout, self._mine_ranks)

    @classmethod
    def from_megatron(cls, num_heads: int, pg_collection=None,
                      layouts: Optional[Sequence[CPLayout]] = None) -> "DSVCPGroups":
        """Groups for Megatron's CP group: ``pg_collection.cp`` when given, else
        ``parallel_state.get_context_parallel_group()``. When Megatron's model-parallel state is
        initialised the group's ranks must equal ``get_context_parallel_global_ranks()``."""
        from megatron.core import parallel_state

        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group()
        tp_size = None
        if parallel_state.model_parallel_is_initialized():
            expected = list(parallel_state.get_context_parallel_global_ranks())
            got = _group_ranks_in_order(cp_group)
            if got != expected:
                raise ValueError(f"pg_collection.cp: groups do not match Megatron's context-parallel ranks: "
                                 f"{got} != {expected}")
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp is not None:
            tp_size = dist.get_world_size(tp)
        return cls(cp_group, num_heads, layouts=layouts, tp_size=tp_size)

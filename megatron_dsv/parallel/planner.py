"""Per-layer CP planner: pick the hybrid layout (hcp, scp, placement) and head placement of a layer.

The plan minimises the estimated step time of one attention layer, ``max over CP ranks of
(compute + communication)``, exhaustively over :func:`~megatron_dsv.parallel.groups.cp_layouts`
x {``'lpt'``, ``'even'``} head placement, under an optional memory cap.

Cost model (n heads per tensor-parallel rank, S tokens, D head dim, b bytes per element,
``P_r`` the heads of HCP rank r, ``c_r = |P_r|``, ``w_h`` head cost from
:func:`~megatron_dsv.parallel.placement.head_costs`, ``d_h`` head density (1 in a dense layer),
``T`` = ``head_ms_dense``, the fwd+bwd time of one dense head over the whole sequence)::

    compute_r  = T * sum_{h in P_r} w_h / scp                       (its 1/scp share of the queries)
    V_hcp      = (S / cp) * D * b * max_r max(n - c_r, (hcp - 1) * c_r)
                 bytes a rank sends or receives in one Ulysses all-to-all (hcp > 1); even heads:
                 (hcp-1)/hcp of its (S/cp) x n x D shard. 8 all-to-alls per step: q, k, v, out
                 forward and their gradients backward.
    V_scp(r)   = 2 * D * b * S * (scp - 1) / scp * sum_{h in P_r} d_h
                 key + value rows a rank fetches from the other SCP ranks (scp > 1): the rows
                 its sparse lists reference, the full all-gather for a dense layer. 2 collectives
                 per step: the forward gather and the return of dK, dV in backward.
    comm_r     = 8 * (latency + V_hcp / B(HCP group)) + 2 * (latency + V_scp(r) / B(SCP group))
    est        = max_r (compute_r + comm_r)
    peak_r     = b * (4 * (S / scp) * c_r * D  +  2 * D * S * (scp - 1) / scp * sum_{h in P_r} d_h)
                 q, k, v, out of the rank's heads over its queries plus the gathered key/values.

``B(group)`` is :class:`CommModel`'s intra-node bandwidth when all ranks of the group sit on one
node (global rank // ``gpus_per_node``), else its inter-node bandwidth. Collectives of one kind
synchronise their group, hence the max over the group in ``V_hcp``. Ties in ``est`` (relative
1e-9) go to fewer communicated bytes, then ``hcp_inner``, then lower ``hcp``, then ``'even'``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dsv.parallel.groups import CPLayout, cp_layouts, layout_groups
from megatron_dsv.parallel.placement import even_placement, head_costs, lpt_placement

__all__ = ["CommModel", "LayerPlan", "measure_bandwidth", "plan_layer", "plan_layers", "PLACEMENTS"]

PLACEMENTS = ("lpt", "even")
HCP_COLLECTIVES = 8  # q, k, v, out all-to-alls forward; their gradients backward
SCP_COLLECTIVES = 2  # selective K|V gather forward; dK|dV return backward
_REL_TIE = 1e-9


def _positive(name: str, value, kind=float) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


@dataclass
class CommModel:
    """Link speeds the planner charges communication at.

    Attributes:
        bandwidth_intra: bytes/s one rank moves in an all-to-all inside a node.
        bandwidth_inter: bytes/s one rank moves in an all-to-all across nodes.
        gpus_per_node: ranks per node (global rank // gpus_per_node is the node).
        latency_s: fixed cost of one collective, seconds.
    """

    bandwidth_intra: float = 300e9
    """Default: ~2/3 of H100/H200 NVLink's 450 GB/s per direction."""
    bandwidth_inter: float = 40e9
    """Default: ~80% of one 400 Gb/s InfiniBand NIC per GPU."""
    gpus_per_node: int = 8
    latency_s: float = 20e-6

    def __post_init__(self):
        _positive("CommModel.bandwidth_intra", self.bandwidth_intra)
        _positive("CommModel.bandwidth_inter", self.bandwidth_inter)
        _positive("CommModel.gpus_per_node", self.gpus_per_node, int)
        if isinstance(self.latency_s, bool) or not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"CommModel.latency_s must be a finite float >= 0, got {self.latency_s!r}")

    def bandwidth(self, ranks: Sequence[int]) -> float:
        """Bandwidth of a collective over global ``ranks``: intra-node iff they share one node."""
        nodes = {int(r) // self.gpus_per_node for r in ranks}
        return self.bandwidth_intra if len(nodes) <= 1 else self.bandwidth_inter


def measure_bandwidth(group, nbytes: int = 1 << 24, iters: int = 5) -> float:
    """Bytes/s one rank sends in an ``all_to_all_single`` over ``group`` (a collective on it).

    Each rank sends ``(size - 1) / size`` of a ``nbytes`` buffer; the slowest rank's mean time over
    ``iters`` runs (after one warm-up) is used, so every rank returns the same figure. Runs on CUDA
    tensors for an NCCL group, CPU tensors otherwise (gloo).
    """
    _positive("nbytes", nbytes, int)
    _positive("iters", iters, int)
    size = dist.get_world_size(group)
    if size < 2:
        raise ValueError(f"group must have at least 2 ranks to measure bandwidth, got {size}")
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    per_rank = max(nbytes // (4 * size), 1)  # float32 elements sent to each peer
    send = torch.ones(per_rank * size, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def sync():
        if nccl:
            torch.cuda.synchronize(device)

    dist.all_to_all_single(recv, send, group=group)
    sync()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_to_all_single(recv, send, group=group)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return per_rank * 4 * (size - 1) / max(float(elapsed.item()), 1e-12)


@dataclass
class LayerPlan:
    """The CP plan of one attention layer (saved in checkpoints: plain JSON types via to_dict)."""

    layout: CPLayout
    placement: str
    """``'lpt'`` or ``'even'``."""
    heads: List[List[int]]
    """Heads of each HCP rank of a group (the same in every HCP group)."""
    est_ms: float
    """Estimated fwd+bwd time of the slowest rank."""
    compute_ms: float
    """That rank's compute share."""
    comm_ms: float
    """That rank's communication share."""
    peak_bytes: int
    """Largest per-rank memory of q, k, v, out and gathered key/values."""
    comm_bytes: int = 0
    """Largest per-rank bytes communicated per fwd+bwd step."""

    def to_dict(self) -> Dict[str, object]:
        return {"layout": {"hcp": self.layout.hcp, "scp": self.layout.scp, "hcp_inner": self.layout.hcp_inner},
                "placement": self.placement, "heads": [[int(h) for h in p] for p in self.heads],
                "est_ms": float(self.est_ms), "compute_ms": float(self.compute_ms), "comm_ms": float(self.comm_ms),
                "peak_bytes": int(self.peak_bytes), "comm_bytes": int(self.comm_bytes)}

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> "LayerPlan":
        need = ("layout", "placement", "heads", "est_ms", "compute_ms", "comm_ms", "peak_bytes")
        if not isinstance(data, dict) or any(k not in data for k in need):
            raise ValueError(f"data must be a dict with keys {need} (LayerPlan.to_dict), got {data!r}")
        lay = data["layout"]
        if not isinstance(lay, dict) or any(k not in lay for k in ("hcp", "scp", "hcp_inner")):
            raise ValueError(f"data['layout'] must be a dict with hcp, scp, hcp_inner, got {lay!r}")
        if data["placement"] not in PLACEMENTS:
            raise ValueError(f"data['placement'] must be one of {PLACEMENTS}, got {data['placement']!r}")
        layout = CPLayout(int(lay["hcp"]), int(lay["scp"]), bool(lay["hcp_inner"]))
        heads = [[int(h) for h in p] for p in data["heads"]]
        if len(heads) != layout.hcp:
            raise ValueError(f"data['heads'] must hold one list per HCP rank ({layout.hcp}), got {len(heads)}")
        return cls(layout, str(data["placement"]), heads, float(data["est_ms"]), float(data["compute_ms"]),
                   float(data["comm_ms"]), int(data["peak_bytes"]), int(data.get("comm_bytes", 0)))

    def describe(self) -> str:
        """One log line."""
        return (f"{self.layout.name} {self.placement} heads={self.heads} est {self.est_ms:.3f} ms "
                f"(compute {self.compute_ms:.3f}, comm {self.comm_ms:.3f} ms, {self.comm_bytes / 2**20:.1f} MiB) "
                f"peak {self.peak_bytes / 2**30:.3f} GiB")


@dataclass
class _Problem:
    """Validated inputs of one layer, shared by every candidate."""

    costs: List[float]
    density: List[float]
    S: int
    D: int
    cp: int
    head_ms: float
    comm: CommModel
    b: int
    cp_ranks: List[int]


def _evaluate(p: _Problem, layout: CPLayout, placement: str, heads: List[List[int]]) -> LayerPlan:
    """Cost of one candidate under the module's model; the slowest position's figures."""
    n, hcp, scp = len(p.costs), layout.hcp, layout.scp
    counts = [len(h) for h in heads]
    v_hcp = (p.S / p.cp) * p.D * p.b * max(max(n - c, (hcp - 1) * c) for c in counts) if hcp > 1 else 0.0
    hcp_groups, scp_groups = layout_groups(p.cp_ranks, layout)
    bw_h = {r: p.comm.bandwidth(g) for g in hcp_groups for r in g}
    bw_s = {r: p.comm.bandwidth(g) for g in scp_groups for r in g}
    slowest, most_bytes, peak = None, 0.0, 0.0
    for g in hcp_groups:
        for r_idx, rank in enumerate(g):
            mine = heads[r_idx]
            compute = p.head_ms * sum(p.costs[h] for h in mine) / scp
            rows = p.S * (scp - 1) / scp * sum(p.density[h] for h in mine)
            v_scp = 2 * p.D * p.b * rows
            comm_s = 0.0
            if hcp > 1:
                comm_s += HCP_COLLECTIVES * (p.comm.latency_s + v_hcp / bw_h[rank])
            if scp > 1:
                comm_s += SCP_COLLECTIVES * (p.comm.latency_s + v_scp / bw_s[rank])
            total = compute + 1e3 * comm_s
            most_bytes = max(most_bytes, HCP_COLLECTIVES * v_hcp + SCP_COLLECTIVES * v_scp)
            peak = max(peak, p.b * (4 * (p.S / scp) * len(mine) * p.D + 2 * p.D * rows))
            if slowest is None or total > slowest[0]:
                slowest = (total, compute, 1e3 * comm_s)
    total, compute, comm_ms = slowest
    return LayerPlan(layout, placement, [list(h) for h in heads], total, compute, comm_ms,
                     int(math.ceil(peak)), int(math.ceil(most_bytes)))


def _better(a: LayerPlan, b: LayerPlan) -> bool:
    """True when candidate ``a`` beats ``b`` (see the module docstring for the tie order)."""
    if not math.isclose(a.est_ms, b.est_ms, rel_tol=_REL_TIE, abs_tol=1e-12):
        return a.est_ms < b.est_ms
    key = lambda c: (c.comm_bytes, not c.layout.hcp_inner, c.layout.hcp, c.placement != "even")
    return key(a) < key(b)


def _problem(density, sparse, S, head_dim, cp, head_ms_dense, comm, speedup, bytes_per_elem, cp_ranks) -> _Problem:
    _positive("S", S, int)
    _positive("head_dim", head_dim, int)
    _positive("cp", cp, int)
    _positive("head_ms_dense", head_ms_dense)
    _positive("bytes_per_elem", bytes_per_elem, int)
    if S % cp:
        raise ValueError(f"S must be divisible by cp ({cp}): CP shards are equal, got S={S}")
    if not isinstance(comm, CommModel):
        raise ValueError(f"comm must be a CommModel, got {type(comm).__name__}")
    costs = head_costs(density, sparse, speedup)
    dens = [float(d) for d in density] if sparse else [1.0] * len(costs)
    ranks = list(range(cp)) if cp_ranks is None else [int(r) for r in cp_ranks]
    if len(ranks) != cp or len(set(ranks)) != cp or min(ranks) < 0:
        raise ValueError(f"cp_ranks must be {cp} distinct non-negative global ranks (CP rank order), got {cp_ranks!r}")
    return _Problem(costs, dens, S, head_dim, cp, float(head_ms_dense), comm, bytes_per_elem, ranks)


def plan_layer(density: Sequence[float], sparse: bool, S: int, head_dim: int, cp: int, head_ms_dense: float,
               comm: CommModel, speedup: Optional[Callable[[float], float]] = None, bytes_per_elem: int = 2,
               memory_cap_bytes: Optional[int] = None, cp_ranks: Optional[Sequence[int]] = None,
               layouts: Optional[Sequence[CPLayout]] = None) -> LayerPlan:
    """The cheapest plan of one attention layer under the module's cost model.

    Args:
        density: per-head density (fraction of keys kept, 1.0 = dense), one per head of this
            tensor-parallel rank.
        sparse: whether the layer runs sparse (a dense layer costs 1 per head and all-gathers KV).
        S: tokens in the whole (unsharded) sequence; divisible by ``cp``.
        head_dim: D.
        cp: the CP size.
        head_ms_dense: fwd+bwd milliseconds of one dense head over the whole sequence S.
        comm: link model (:class:`CommModel`).
        speedup: optional ``speedup(density)`` (see :func:`head_costs`); default: cost = density.
        bytes_per_elem: element size of q, k, v (2 for bf16).
        memory_cap_bytes: skip candidates whose per-rank peak exceeds it.
        cp_ranks: the CP group's global ranks in CP rank order (default ``range(cp)``); with
            ``comm.gpus_per_node`` they decide which groups cross nodes.
        layouts: the layouts to consider (default :func:`cp_layouts` of ``cp``).
    """
    p = _problem(density, sparse, S, head_dim, cp, head_ms_dense, comm, speedup, bytes_per_elem, cp_ranks)
    if memory_cap_bytes is not None:
        _positive("memory_cap_bytes", memory_cap_bytes)
    candidates = cp_layouts(cp) if layouts is None else list(layouts)
    for layout in candidates:
        if not isinstance(layout, CPLayout) or layout.cp != cp:
            raise ValueError(f"layouts must hold CPLayouts with hcp*scp == cp ({cp}), got {layout!r}")
    n = len(p.costs)
    best, smallest_peak = None, None
    for layout in candidates:
        if layout.hcp > n:
            continue
        options = [("lpt", lpt_placement(p.costs, layout.hcp))]
        if n % layout.hcp == 0:
            options.append(("even", even_placement(n, layout.hcp)))
        for name, heads in options:
            plan = _evaluate(p, layout, name, heads)
            smallest_peak = plan.peak_bytes if smallest_peak is None else min(smallest_peak, plan.peak_bytes)
            if memory_cap_bytes is not None and plan.peak_bytes > memory_cap_bytes:
                continue
            if best is None or _better(plan, best):
                best = plan
    if best is None:
        if smallest_peak is None:
            raise ValueError(f"layouts: no layout has hcp <= the number of heads ({n})")
        raise ValueError(f"memory_cap_bytes={memory_cap_bytes} fits no layout; the smallest per-rank peak is "
                         f"{smallest_peak} bytes")
    return best


def plan_layers(densities: Sequence[Sequence[float]], sparse: Sequence[bool], S: int, head_dim: int, cp: int,
                head_ms_dense: float, comm: CommModel, **options) -> List[LayerPlan]:
    """:func:`plan_layer` for every layer; ``densities[i]`` and ``sparse[i]`` describe layer i and
    ``options`` (speedup, bytes_per_elem, memory_cap_bytes, cp_ranks, layouts) apply to all."""
    if len(densities) != len(sparse):
        raise ValueError(f"densities and sparse must have one entry per layer, got {len(densities)} and {len(sparse)}")
    return [plan_layer(d, bool(s), S, head_dim, cp, head_ms_dense, comm, **options)
            for d, s in zip(densities, sparse)]

"""One DSV layer's attention over a context-parallel group, as a :class:`LayerPlan` lays it out.

Every CP rank holds one contiguous shard of ``s`` tokens of the sequence (CP rank order, cube-major
tokens; a shard never splits a query group). :func:`cp_attention` takes q, k, v of that shard for
all (local tensor-parallel) heads, and, for a sparse layer, the KV lists of the shard's query groups
in **global** key (or key-block) ids, the same lists one GPU would build for those queries. Then:

1. HCP (``plan.layout.hcp > 1``): q, k, v and the lists go through the Ulysses all-to-all of the
   rank's HCP group (:func:`~megatron_dsv.parallel.collectives.seq_to_head`), so the rank holds
   its HCP group's stretch of ``hcp * s`` tokens ("super-shard") for the heads the plan placed on
   it (``plan.heads[hcp rank]``, uneven counts allowed).
2. SCP (``scp > 1``): the members of the rank's SCP group hold the same heads over different
   super-shards. A sparse layer fetches only the key/value rows its lists reference
   (:class:`~megatron_dsv.parallel.collectives.KVGatherPlan`, remapped to a compact buffer); a dense
   layer all-gathers k and v (:func:`~megatron_dsv.parallel.collectives.gather_seq`).
   With ``hcp_inner=False`` a super-shard is not contiguous in the sequence; the lists are
   renumbered into the SCP group's order of super-shards ("virtual order") first. Attention is a
   set operation over keys (RoPE is already in q and k), so the order of keys does not matter.
3. The kernel (sparse, query length != key length, or dense), then the inverse all-to-all.

Grouped-query attention: k and v are repeated to the query heads before the exchange (simple; the
all-to-all then moves ``H / Hkv`` times the KV bytes a GQA-aware placement would).

:class:`CPContext` holds what every layer shares: the DSV CP groups (every layout, created once)
and the communication model agreed by all ranks.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_dsv.ops.dense import dense_attention
from megatron_dsv.parallel.collectives import (KVGatherPlan, _order_on, gather_seq, head_to_seq, selective_kv_gather,
                                               seq_to_head, valid_entries)
from megatron_dsv.parallel.groups import CPLayout, DSVCPGroups
from megatron_dsv.parallel.placement import head_order_and_counts
from megatron_dsv.parallel.planner import CommModel, LayerPlan, measure_bandwidth

__all__ = ["CPContext", "cp_attention", "to_virtual_order", "DEFAULT_INTER_NODE_BYTES_PER_S"]

# Inter-node bandwidth per GPU assumed when the CP group sits inside one node (it cannot be measured
# there): one 400 Gb/s NIC per GPU, about 50 GB/s, at 80% efficiency.
DEFAULT_INTER_NODE_BYTES_PER_S = 40e9


class CPContext:
    """What all DSV layers of a process share under CP: :class:`DSVCPGroups` and the agreed
    :class:`CommModel`. Built once per (CP group, heads) by :meth:`get`, a collective over the world
    (process groups are created there), so every rank must build its layers in the same order."""

    _cache = {}

    def __init__(self, cp_group, num_heads: int, tp_size: int = 1):
        self.groups = DSVCPGroups(cp_group, num_heads, tp_size=tp_size)
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = self.groups.cp_size, self.groups.cp_rank
        self.comm = self._agreed_comm_model(cp_group)

    @classmethod
    def get(cls, cp_group, num_heads: int, tp_size: int = 1) -> "CPContext":
        key = (tuple(dist.get_process_group_ranks(cp_group)), num_heads)
        if key not in cls._cache:
            cls._cache[key] = cls(cp_group, num_heads, tp_size)
        return cls._cache[key]

    @classmethod
    def release(cls) -> None:
        """Forget every context (and with it the references to its process groups): call before
        ``destroy_process_group`` so no group outlives it into interpreter shutdown."""
        cls._cache.clear()

    @staticmethod
    def _agreed_comm_model(cp_group) -> CommModel:
        """Bandwidth of the CP group measured once (an all-to-all), the minimum over all ranks, so
        every rank plans with the same numbers. Nodes: ``LOCAL_WORLD_SIZE`` ranks each (torchrun)."""
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        measured = measure_bandwidth(cp_group)
        agreed = torch.tensor([measured], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            agreed = agreed.cuda()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        bw = float(agreed[0])
        ranks = dist.get_process_group_ranks(cp_group)
        spans_nodes = len({r // per_node for r in ranks}) > 1
        inter = bw if spans_nodes else min(bw, DEFAULT_INTER_NODE_BYTES_PER_S)
        return CommModel(bandwidth_intra=bw, bandwidth_inter=inter, gpus_per_node=per_node)


def to_virtual_order(lists: torch.Tensor, counts: torch.Tensor, layout: CPLayout, shard_items: int) -> torch.Tensor:
    """Global item ids -> the SCP group's order of super-shards, for ``hcp_inner=False`` layouts.

    ``lists`` int32 ``[B, H, NG, Kmax]`` (ids ascending in ``[:counts]``), ``counts`` int32 ``[B, H]`` or
    ``[B, H, NG]`` (one length per query group);
    ``shard_items``: items (tokens, or key blocks) per CP shard. CP shard ``c = j * scp + a`` is the
    ``j``-th piece of SCP rank ``a``'s super-shard, so item ``t`` of shard ``c`` goes to
    ``a * hcp * shard_items + j * shard_items + t % shard_items``. Valid entries are re-sorted
    ascending (the kernels need that); padding stays past ``counts`` (set to 0).
    """
    if layout.hcp_inner or layout.degenerate:
        return lists
    hcp, scp = layout.hcp, layout.scp
    ids = lists.long()
    shard, offset = ids // shard_items, ids % shard_items
    virt = (shard % scp) * (hcp * shard_items) + (shard // scp) * shard_items + offset
    valid = valid_entries(counts, lists.shape[2], lists.shape[-1])
    big = torch.iinfo(torch.int64).max
    virt = torch.sort(torch.where(valid, virt, big), dim=-1).values
    return torch.where(valid, virt, 0).to(torch.int32)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: CPContext, plan: LayerPlan, *,
                 lists: Optional[Tuple[torch.Tensor, torch.Tensor]], group_size: int, block_size: int,
                 softmax_scale: float, sparse_fn) -> torch.Tensor:
    """Attention of this rank's sequence shard under ``plan``.

    Args:
        q: ``[B, H, s, D]``; k, v: ``[B, Hkv, s, D]`` — this CP rank's shard (all local heads).
        ctx: the :class:`CPContext`; plan: the layer's :class:`LayerPlan` (layout and head placement).
        lists: ``None`` for a dense layer, else ``(kv_indices int32 [B, H, s / G, Kmax], kv_counts
            int32 [B, H] or [B, H, s / G])``: the shard's query groups' lists in global key / key-block ids,
            with one length per head or one per query group (a windowed stage 1, ``local_mode`` 'window').
        sparse_fn: ``fn(q, k, v, kv_indices, kv_counts) -> out`` (the layer's sparse kernel, which
            accepts a key length different from the query length).
    Returns ``[B, H, s, D]``.
    """
    B, H, s, D = q.shape
    if k.shape[1] != H:  # GQA: one KV head per query head before the exchange
        rep = H // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    layout = plan.layout
    hcp_group, scp_group, hcp_rank, _ = ctx.groups.groups(layout)
    order, head_counts = head_order_and_counts(plan.heads)
    mine = plan.heads[hcp_rank]
    if layout.hcp > 1:
        q, k, v = (seq_to_head(t, hcp_group, head_counts, order) for t in (q, k, v))
    if lists is None:
        if layout.scp > 1:
            k, v = gather_seq(k, scp_group), gather_seq(v, scp_group)
        out = dense_attention(q, k, v, softmax_scale=softmax_scale)
    else:
        idx, counts = lists
        if layout.hcp > 1:
            idx = seq_to_head(idx, hcp_group, head_counts, order)
            if counts.dim() == 3:  # one length per query group: the groups travel with their lists
                counts = seq_to_head(counts.unsqueeze(-1), hcp_group, head_counts, order).squeeze(-1)
            else:  # this rank's heads, in placement order: a slice of the placement-ordered counts (no host
                # list turned into a device index on every call)
                start = sum(len(p) for p in plan.heads[:hcp_rank])
                counts = counts.index_select(1, _order_on(torch.as_tensor(order), counts.device))
                counts = counts[:, start:start + len(mine)].contiguous()
        if layout.scp > 1:
            unit = max(block_size, 1)
            idx = to_virtual_order(idx, counts, layout, s // unit)
            gather = KVGatherPlan.build(idx, counts, scp_group, layout.hcp * s, block_size)
            k, v = selective_kv_gather(k, v, gather, scp_group)
            idx = gather.local_indices
        out = sparse_fn(q, k, v, idx, counts)
    if layout.hcp > 1:
        out = head_to_seq(out, hcp_group, head_counts, order)
    return out


# ---- the plan of a layer: planning, and its checkpointed form ---------------------------------------

# Dense attention throughput the planner assumes for compute time (cuDNN through SDPA on one H200,
# fwd+bwd, DESIGN.md section 2): only ratios of compute to communication matter to the choice.
DENSE_ATTENTION_FLOPS_PER_S = 580e12


def dense_head_ms(S: int, head_dim: int) -> float:
    """Milliseconds of one dense head over ``S`` tokens, forward + backward (4 S^2 D flops forward,
    2.5x that backward) at :data:`DENSE_ATTENTION_FLOPS_PER_S`."""
    return 4.0 * S * S * head_dim * 3.5 / DENSE_ATTENTION_FLOPS_PER_S * 1e3


def layouts_for_mode(mode: str, groups: DSVCPGroups):
    """``DSVConfig.cp_mode`` -> the layouts the planner may choose: 'head' pure HCP, 'seq' pure SCP,
    'hybrid' every factorisation and placement."""
    match mode:
        case "head":
            return [l for l in groups.layouts if l.scp == 1]
        case "seq":
            return [l for l in groups.layouts if l.hcp == 1]
        case "hybrid":
            return list(groups.layouts)
        case _:
            raise ValueError(f"DSVConfig.cp_mode must be one of ('head', 'seq', 'hybrid') under context "
                             f"parallelism, got {mode!r}")


def plan_for_layer(layer, S: int, sparse: bool, tokens: torch.Tensor) -> LayerPlan:
    """The :class:`LayerPlan` of a DSV layer (a ``DSVCoreAttention``) at this step's decision.

    Per-head density = the budget in tokens / S (1 for a dense layer); per-head cost from the
    layer's measured kernel speedups (``SpeedupTable``) at that density; communication from the
    agreed :class:`CommModel`. Every input is identical on all CP ranks, so is the plan."""
    from megatron_dsv.parallel.planner import plan_layer

    ctx = layer.cp_ctx
    density = [1.0] * len(tokens) if not sparse else [min(1.0, float(t) / S) for t in tokens.tolist()]
    table, training = layer.speedup_table, layer.training

    def speedup(d: float) -> float:
        return max(1e-3, table.speedup(S, 1.0 - d, training))

    return plan_layer(density, sparse, S, layer.head_dim, ctx.cp_size, dense_head_ms(S, layer.head_dim), ctx.comm,
                      speedup=speedup if sparse else None, cp_ranks=ctx.groups.cp_ranks,
                      layouts=layouts_for_mode(layer.dsv_config.cp_mode, ctx.groups))


def encode_plan(plan: LayerPlan, num_heads: int) -> torch.Tensor:
    """int64 ``[H, 5]``, one row per head: ``(hcp, scp, hcp_inner, lpt, the head's HCP rank)``."""
    rows = torch.zeros(num_heads, 5, dtype=torch.int64)
    rows[:, 0], rows[:, 1] = plan.layout.hcp, plan.layout.scp
    rows[:, 2], rows[:, 3] = int(plan.layout.hcp_inner), int(plan.placement == "lpt")
    for rank, heads in enumerate(plan.heads):
        for h in heads:
            rows[h, 4] = rank
    return rows


def decode_plan(rows: torch.Tensor) -> Optional[LayerPlan]:
    """Inverse of :func:`encode_plan` (layout and placement; the cost estimates are not kept);
    ``None`` for the all-zero rows of a layer that has no plan yet."""
    if int(rows[0, 0]) == 0:
        return None
    hcp, scp, inner, lpt = (int(x) for x in rows[0, :4])
    heads = [[h for h in range(rows.shape[0]) if int(rows[h, 4]) == r] for r in range(hcp)]
    return LayerPlan(layout=CPLayout(hcp, scp, bool(inner)), placement="lpt" if lpt else "even", heads=heads,
                     est_ms=float("nan"), compute_ms=float("nan"), comm_ms=float("nan"), peak_bytes=0)

"""Autograd collectives for DSV context parallelism (CP).

A video sequence (tokens in 3D-cube-major order) is split into ``P`` equal contiguous shards over
the ranks of a CP process group: rank ``r`` holds tokens ``[r * S_loc, (r + 1) * S_loc)``.
Two schemes combine as ``hcp x scp = cp``:

* head-wise CP (Ulysses): :func:`seq_to_head` turns sequence shards of all heads into full
  sequences of the heads placed on this rank (placed unevenly by cost, so head counts differ per
  rank); :func:`head_to_seq` is its inverse.
* sequence-wise CP: each rank keeps its queries and fetches only the key/value items its sparse
  lists reference (:class:`KVGatherPlan`, :func:`selective_kv_gather`); low-rank predictor keys
  are small and gathered whole (:func:`gather_seq`).

Every collective is a raw exchange plus an ``autograd.Function`` whose backward is the dual
exchange. Only ``all_to_all_single`` and ``all_gather`` are used, so gloo (CPU) and NCCL both
work. The process group is passed explicitly; ``None`` means "no CP" (one rank), like a group of
size 1, and takes a cheap path with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dsv.ops.sparse_attention.checks import group_counts

__all__ = [
    "seq_to_head",
    "head_to_seq",
    "gather_seq",
    "KVGatherPlan",
    "selective_kv_gather",
]


# ----------------------------------------------------------------------------- group helpers


def _world(group) -> tuple[int, int]:
    """(size, rank) of ``group``; ``None`` is a one-rank world."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_4d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 4-D tensor [B, H, S, D], got {got}")


# ----------------------------------------------------------------------------- head placement


def _head_layout(head_counts, head_order, num_heads: int, world: int) -> tuple[list[int], torch.Tensor]:
    """Validate a head placement.

    Returns ``(counts, order)``: ``counts`` P python ints >= 0 summing to ``num_heads``;
    ``order`` int64 ``[H]``, a permutation of ``range(H)`` (placement order).
    """
    counts = [int(c) for c in head_counts]
    if len(counts) != world:
        raise ValueError(f"head_counts must have one entry per rank of the group ({world}), got {len(counts)}")
    if any(c < 0 for c in counts) or sum(counts) != num_heads:
        raise ValueError(f"head_counts must be ints >= 0 summing to the number of heads {num_heads}, got {counts}")
    if head_order is None:
        return counts, torch.arange(num_heads)
    order = torch.as_tensor(list(head_order), dtype=torch.int64)
    if order.numel() != num_heads or not torch.equal(order.sort().values, torch.arange(num_heads)):
        raise ValueError(f"head_order must be a permutation of range({num_heads}), got {order.tolist()}")
    return counts, order


_DEVICE_ORDERS: dict = {}


def _order_on(order: torch.Tensor, device: torch.device, inverse: bool = False) -> torch.Tensor:
    """``order`` (or its inverse permutation) on ``device``, copied there once per (placement, device):
    a host tensor moved to CUDA on every call is a pageable copy that waits for the stream, several
    times per layer (q, k, v, lists, out and their gradients)."""
    if device.type == "cpu":
        return torch.argsort(order) if inverse else order
    key = (tuple(order.tolist()), str(device), inverse)
    if key not in _DEVICE_ORDERS:
        _DEVICE_ORDERS[key] = (torch.argsort(order) if inverse else order).to(device)
    return _DEVICE_ORDERS[key]


def _seq_to_head_raw(x: torch.Tensor, group, counts: list[int], order: torch.Tensor) -> torch.Tensor:
    """x [B, H, S_loc, D] -> [B, counts[rank], P * S_loc, D] (no autograd)."""
    world, rank = _world(group)
    b, _, s_loc, d = x.shape
    order = _order_on(order, x.device)
    if world == 1:
        return x.index_select(1, order)
    mine = counts[rank]
    # Head-major send buffer: all_to_all_single splits dim 0, and rank r's heads are the r-th run.
    send = x.index_select(1, order).transpose(0, 1).contiguous()  # [H, B, S_loc, D]
    recv = x.new_empty(world * mine, b, s_loc, d)  # [P * mine, B, S_loc, D], source-rank-major
    dist.all_to_all_single(recv, send, [mine] * world, counts, group=group)
    # [P, mine, B, S_loc, D] -> [B, mine, P, S_loc, D]: source ranks are consecutive shards.
    return recv.view(world, mine, b, s_loc, d).permute(2, 1, 0, 3, 4).reshape(b, mine, world * s_loc, d)


def _head_to_seq_raw(y: torch.Tensor, group, counts: list[int], order: torch.Tensor) -> torch.Tensor:
    """y [B, counts[rank], P * S_loc, D] -> [B, H, S_loc, D] in original head order (no autograd)."""
    world, rank = _world(group)
    b, mine, s_full, d = y.shape
    s_loc = s_full // world
    inverse = _order_on(order, y.device, inverse=True)  # placement position of each original head
    if world == 1:
        return y.index_select(1, inverse)
    # [B, mine, P, S_loc, D] -> [P, mine, B, S_loc, D]: the r-th run goes to rank r.
    send = y.view(b, mine, world, s_loc, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = y.new_empty(sum(counts), b, s_loc, d)  # [H (placement order), B, S_loc, D]
    dist.all_to_all_single(recv, send.view(world * mine, b, s_loc, d), counts, [mine] * world, group=group)
    return recv.transpose(0, 1).index_select(1, inverse).contiguous()


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counts, order):
        ctx.group, ctx.counts, ctx.order = group, counts, order
        return _seq_to_head_raw(x, group, counts, order)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq_raw(grad.contiguous(), ctx.group, ctx.counts, ctx.order), None, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, counts, order):
        ctx.group, ctx.counts, ctx.order = group, counts, order
        return _head_to_seq_raw(y, group, counts, order)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head_raw(grad.contiguous(), ctx.group, ctx.counts, ctx.order), None, None, None


def seq_to_head(
    x: torch.Tensor, group, head_counts: Sequence[int], head_order: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Head-wise CP entry: sequence shards of all heads -> full sequences of this rank's heads.

    Args:
        x: ``[B, H, S_loc, D]``, this rank's sequence shard of all ``H`` heads.
        group: the CP process group of ``P`` ranks (``None``: one rank).
        head_counts: ``P`` ints >= 0 summing to ``H``; rank ``r`` holds ``head_counts[r]`` heads.
        head_order: the ``H`` head ids in placement order (default ``range(H)``); rank ``r`` gets
            ``head_order[sum(head_counts[:r]) : sum(head_counts[:r + 1])]`` in that order.

    Returns:
        ``[B, head_counts[rank], P * S_loc, D]``: shards concatenated in rank order. Autograd: the
        backward is :func:`head_to_seq` of the gradient.
    """
    _check_4d("x", x)
    world, _ = _world(group)
    counts, order = _head_layout(head_counts, head_order, x.shape[1], world)
    return _SeqToHead.apply(x.contiguous(), group, counts, order)


def head_to_seq(
    y: torch.Tensor, group, head_counts: Sequence[int], head_order: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Head-wise CP exit, the inverse of :func:`seq_to_head`.

    Args:
        y: ``[B, head_counts[rank], P * S_loc, D]``, full sequences of this rank's heads.
        group, head_counts, head_order: as in :func:`seq_to_head` (``H = sum(head_counts)``).

    Returns:
        ``[B, H, S_loc, D]``: this rank's sequence shard of all heads, in the original head order.
        Autograd: the backward is :func:`seq_to_head` of the gradient.
    """
    _check_4d("y", y)
    world, rank = _world(group)
    num_heads = sum(int(c) for c in head_counts)
    counts, order = _head_layout(head_counts, head_order, num_heads, world)
    if y.shape[1] != counts[rank]:
        raise ValueError(f"y must hold head_counts[{rank}] = {counts[rank]} heads in dim 1, got {y.shape[1]}")
    if y.shape[2] % world:
        raise ValueError(f"y's sequence length {y.shape[2]} must be a multiple of the group size {world}")
    return _HeadToSeq.apply(y.contiguous(), group, counts, order)


# ----------------------------------------------------------------------------- all-gather of a sequence


def _all_to_all_rows(send: torch.Tensor, out_rows: Sequence[int], in_rows: Sequence[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0: send ``in_rows[r]`` rows to rank r, receive ``out_rows[r]`` from r."""
    recv = send.new_empty(sum(out_rows), *send.shape[1:])
    dist.all_to_all_single(recv, send.contiguous(), list(out_rows), list(in_rows), group=group)
    return recv


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        b, h, s_loc, r = x.shape
        full = x.new_empty(world, b, h, s_loc, r)
        dist.all_gather(list(full.unbind(0)), x, group=group)
        return full.permute(1, 2, 0, 3, 4).reshape(b, h, world * s_loc, r)

    @staticmethod
    def backward(ctx, grad):
        # Reduce-scatter written as an all-to-all (gloo has no reduce_scatter): shard r of every
        # rank's gradient goes to rank r, which sums the P pieces.
        world = ctx.world
        b, h, s_full, r = grad.shape
        s_loc = s_full // world
        pieces = grad.reshape(b, h, world, s_loc, r).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, H, S_loc, r]
        recv = _all_to_all_rows(pieces, [1] * world, [1] * world, ctx.group)
        return recv.sum(0), None, None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather a sequence-sharded tensor along the sequence.

    Args:
        x: ``[B, H, S_loc, r]``, this rank's shard (e.g. low-rank predictor keys).
        group: the CP process group of ``P`` ranks (``None``: one rank).

    Returns:
        ``[B, H, P * S_loc, r]``, shards in rank order. Autograd: each rank receives the sum over
        ranks of the gradient of its own shard.
    """
    _check_4d("x", x)
    world, _ = _world(group)
    if world == 1:
        return x
    return _GatherSeq.apply(x.contiguous(), group, world)


# ----------------------------------------------------------------------------- selective KV gather


def valid_entries(kv_counts: torch.Tensor, num_groups: int, kmax: int) -> torch.Tensor:
    """bool ``[B, H, NG, Kmax]``: entry j of query group g of (b, h) is on its list (``j <`` its count).

    ``kv_counts``: int ``[B, H]`` (one list length per head) or ``[B, H, NG]`` (one per query group: the
    windowed stage 1, ``local_mode`` 'window')."""
    return torch.arange(kmax, device=kv_counts.device) < group_counts(kv_counts, num_groups).unsqueeze(-1)


def _distinct_items(kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_items: int) -> torch.Tensor:
    """Which global items each (b, h) references (pure, no communication).

    Args:
        kv_indices: int ``[B, Hkv, NG, Kmax]`` global item ids, valid where :func:`valid_entries` says.
        kv_counts: int ``[B, Hkv]`` or ``[B, Hkv, NG]``.
        num_items: ``P * items_per_rank``; valid ids must lie in ``[0, num_items)``.

    Returns:
        bool ``[B, Hkv, num_items]``: ``present[b, h, i]`` iff some group of (b, h) lists item i.
    """
    b, hkv, ng, kmax = kv_indices.shape
    valid = valid_entries(kv_counts, ng, kmax)
    ids = kv_indices.long()
    if bool(((ids < 0) | (ids >= num_items)).logical_and(valid).any()):
        raise ValueError(f"kv_indices must lie in [0, {num_items}) wherever j < kv_counts[b, h]")
    present = torch.zeros(b, hkv, num_items + 1, dtype=torch.bool, device=kv_indices.device)
    # Padding is routed to a spare column so its value, whatever it is, is never used.
    ids = torch.where(valid, ids, torch.full_like(ids, num_items))
    present.scatter_(2, ids.reshape(b, hkv, ng * kmax), True)
    return present[..., :num_items].contiguous()


@dataclass
class KVGatherPlan:
    """Which key/value rows this rank fetches, from whom, and where they land (int work only).

    Built once per sparse layout by :meth:`build`; reused by the forward and backward of
    :func:`selective_kv_gather`. An *item* is a token (``block_size`` 0) or a key block of
    ``block_size`` tokens; ``R = max(block_size, 1)`` rows per item; ``n_loc = s_local // R``
    items per rank, item ``i`` owned by rank ``i // n_loc``.

    Attributes:
        local_indices: int32 ``[B, Hkv, NG, Kmax]``, the lists remapped to buffer item positions
            (ascending, since the buffer is in ascending global id order); padding set to 0.
        buffer_items: ``U``, the max over (b, h) of distinct items referenced (at least 1).
        buffer_len: ``U * R`` token rows per (b, h) in the gathered buffer.
        send_rows: token rows this rank sends to other ranks, counted per (b, h).
        recv_rows: token rows this rank receives from other ranks, counted per (b, h); items it
            owns are copied locally and not counted.
        block_size, s_local, world: the layout the plan was built for.
    """

    local_indices: torch.Tensor
    buffer_items: int
    buffer_len: int
    send_rows: int
    recv_rows: int
    block_size: int
    s_local: int
    world: int
    # Item-level routing, flat indices (int64, on the indices' device):
    _serve_src: torch.Tensor  # [n_send] rows of my k viewed [B*Hkv*n_loc, R, D], grouped by requester
    _send_counts: list  # items sent to each rank
    _recv_slots: torch.Tensor  # [n_recv] slots of the buffer viewed [B*Hkv*U, R, D], grouped by owner
    _recv_counts: list  # items received from each rank
    _local_src: torch.Tensor  # [n_self] my own items copied into the buffer ...
    _local_slots: torch.Tensor  # [n_self] ... at these slots

    @classmethod
    def build(cls, kv_indices: torch.Tensor, kv_counts: torch.Tensor, group, s_local: int, block_size: int):
        """Plan the gather and run the request exchange (one all-to-all of requested ids).

        Args:
            kv_indices: int32 ``[B, Hkv, NG, Kmax]`` GLOBAL item ids (tokens in ``[0, P * s_local)``
                or key blocks of ``block_size`` tokens), ascending within each group, valid for
                ``j < kv_counts[b, h]`` (or ``kv_counts[b, h, g]``); padding is ignored whatever its value.
            kv_counts: int32 ``[B, Hkv]`` (one list length per head) or ``[B, Hkv, NG]`` (one per query
                group), in ``[0, Kmax]``.
            group: the CP process group of ``P`` ranks (``None``: one rank).
            s_local: tokens per rank; a multiple of ``block_size`` when ``block_size > 0``.
            block_size: 0 for token items, else tokens per key block.
        """
        if kv_indices.dim() != 4 or kv_indices.dtype not in (torch.int32, torch.int64):
            got = f"{kv_indices.dtype} {tuple(kv_indices.shape)}"
            raise ValueError(f"kv_indices must be int32 [B, Hkv, NG, Kmax], got {got}")
        b, hkv, ng, kmax = kv_indices.shape
        if tuple(kv_counts.shape) not in ((b, hkv), (b, hkv, ng)) or kv_counts.is_floating_point():
            got = f"{kv_counts.dtype} {tuple(kv_counts.shape)}"
            raise ValueError(f"kv_counts must be int32 [B, Hkv] = {(b, hkv)} or [B, Hkv, NG] = {(b, hkv, ng)}, "
                             f"got {got}")
        if bool(((kv_counts < 0) | (kv_counts > kmax)).any()):
            raise ValueError(f"kv_counts must lie in [0, Kmax = {kmax}]")
        if block_size < 0 or s_local <= 0 or (block_size > 0 and s_local % block_size):
            raise ValueError(
                f"s_local ({s_local}) must be > 0 and a multiple of block_size ({block_size}); block_size >= 0"
            )
        world, rank = _world(group)
        rows = max(block_size, 1)
        n_loc = s_local // rows
        device = kv_indices.device

        present = _distinct_items(kv_indices, kv_counts.to(device), world * n_loc)  # [B, Hkv, P*n_loc]
        position = present.long().cumsum(-1) - 1  # buffer item position of each present item
        u = max(int(present.sum(-1).max()) if present.numel() else 0, 1)
        valid = valid_entries(kv_counts.to(device), ng, kmax)
        safe = torch.where(valid, kv_indices.long(), torch.zeros_like(kv_indices, dtype=torch.long))
        local = position.gather(2, safe.flatten(2)).view_as(safe)
        local = torch.where(valid, local, torch.zeros_like(local)).to(torch.int32)

        # Enumerate present items owner-major, so each owner's requests are one contiguous run.
        by_owner = present.view(b * hkv, world, n_loc).transpose(0, 1)  # [P, B*Hkv, n_loc]
        owner, bh, item = by_owner.nonzero(as_tuple=True)
        slots = bh * u + position.view(b * hkv, world * n_loc)[bh, owner * n_loc + item]
        src = bh * n_loc + item  # flat item row on the owner
        mine = owner == rank
        recv_counts = torch.bincount(owner[~mine], minlength=world)
        recv_counts_list = [int(c) for c in recv_counts.tolist()]
        send_counts_list, serve = cls._exchange_requests(src[~mine], recv_counts, recv_counts_list, group, world)
        return cls(
            local_indices=local, buffer_items=u, buffer_len=u * rows,
            send_rows=sum(send_counts_list) * rows, recv_rows=sum(recv_counts_list) * rows,
            block_size=block_size, s_local=s_local, world=world,
            _serve_src=serve, _send_counts=send_counts_list,
            _recv_slots=slots[~mine], _recv_counts=recv_counts_list,
            _local_src=src[mine], _local_slots=slots[mine],
        )

    @staticmethod
    def _exchange_requests(requests: torch.Tensor, recv_counts: torch.Tensor, recv_list: list, group, world: int):
        """Tell each owner which of its items this rank needs; learn what others need from us.

        ``requests`` int64 ``[n_recv]`` flat item rows on their owners, grouped by owner with
        ``recv_counts[r]`` for rank r (``recv_list``: the same counts on the host). Returns (items to
        send to each rank, int64 ``[n_send]`` flat rows of our own items to serve, grouped by requester).
        """
        if world == 1:
            return [0], requests
        counts = recv_counts.to(requests.device)
        send_counts = torch.empty_like(counts)
        dist.all_to_all_single(send_counts, counts, group=group)
        send_list = [int(c) for c in send_counts.tolist()]
        serve = _all_to_all_rows(requests, send_list, recv_list, group)
        return send_list, serve

    def bytes_moved(self, row_bytes: int) -> int:
        """Bytes this rank receives from other ranks for ONE of k or v in the forward.

        Defined as ``recv_rows * row_bytes`` (``row_bytes = D * element_size``). The forward moves
        k and v together, so the forward traffic is ``2 x`` this (with equal k/v head dims); the
        backward returns dk and dv rows the same way in reverse, so forward + backward is ``4 x``.
        """
        return self.recv_rows * int(row_bytes)


def _fill_buffer(items: torch.Tensor, recv: torch.Tensor, plan: KVGatherPlan, total: int) -> torch.Tensor:
    """Buffer ``[total, R, D]`` holding received rows and locally owned rows at their slots, else 0."""
    buf = items.new_zeros(total, *items.shape[1:])
    buf[plan._recv_slots] = recv
    buf[plan._local_slots] = items[plan._local_src]
    return buf


class _SelectiveKVGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, plan: KVGatherPlan, group):
        ctx.plan, ctx.group, ctx.shapes = plan, group, (k.shape, v.shape)
        b, hkv, s_local, dk = k.shape
        rows = max(plan.block_size, 1)
        k_items = k.reshape(b * hkv * (s_local // rows), rows, dk)
        v_items = v.reshape(b * hkv * (s_local // rows), rows, v.shape[-1])
        total = b * hkv * plan.buffer_items
        if plan.world == 1:
            recv_k = k_items.new_empty(0, rows, dk)
            recv_v = v_items.new_empty(0, rows, v.shape[-1])
        else:
            # k and v travel together: one data exchange.
            payload = torch.cat([k_items[plan._serve_src], v_items[plan._serve_src]], dim=-1)
            recv = _all_to_all_rows(payload, plan._recv_counts, plan._send_counts, group)
            recv_k, recv_v = recv.split([dk, v.shape[-1]], dim=-1)
        k_buf = _fill_buffer(k_items, recv_k, plan, total)
        v_buf = _fill_buffer(v_items, recv_v, plan, total)
        return (k_buf.view(b, hkv, plan.buffer_len, dk), v_buf.view(b, hkv, plan.buffer_len, v.shape[-1]))

    @staticmethod
    def backward(ctx, dk_buf, dv_buf):
        plan, group = ctx.plan, ctx.group
        (b, hkv, s_local, dk), v_shape = ctx.shapes
        dv = v_shape[-1]
        rows = max(plan.block_size, 1)
        n_items = b * hkv * (s_local // rows)
        dk_buf = dk_buf.reshape(b * hkv * plan.buffer_items, rows, dk)
        dv_buf = dv_buf.reshape(b * hkv * plan.buffer_items, rows, dv)
        grad_k = dk_buf.new_zeros(n_items, rows, dk)
        grad_v = dv_buf.new_zeros(n_items, rows, dv)
        grad_k.index_add_(0, plan._local_src, dk_buf[plan._local_slots])
        grad_v.index_add_(0, plan._local_src, dv_buf[plan._local_slots])
        if plan.world > 1:
            payload = torch.cat([dk_buf[plan._recv_slots], dv_buf[plan._recv_slots]], dim=-1)
            back = _all_to_all_rows(payload, plan._send_counts, plan._recv_counts, group)
            back_k, back_v = back.split([dk, dv], dim=-1)
            # An item requested by several ranks appears several times in _serve_src: all add up.
            grad_k.index_add_(0, plan._serve_src, back_k)
            grad_v.index_add_(0, plan._serve_src, back_v)
        return grad_k.view(b, hkv, s_local, dk), grad_v.view(b, hkv, s_local, dv), None, None


def selective_kv_gather(k: torch.Tensor, v: torch.Tensor, plan: KVGatherPlan, group):
    """Fetch the key/value items this rank's sparse lists reference into a compact buffer.

    Args:
        k: ``[B, Hkv, s_local, Dk]``, this rank's key shard.
        v: ``[B, Hkv, s_local, Dv]``, this rank's value shard (same dtype and device as k).
        plan: from :meth:`KVGatherPlan.build` for the same group, ``s_local`` and lists.
        group: the CP process group (``None``: one rank).

    Returns:
        ``(k_buf, v_buf)``: ``[B, Hkv, plan.buffer_len, Dk]`` and ``[..., Dv]``. Item ``u`` of
        (b, h) occupies rows ``[u * R, (u + 1) * R)``; unused slots are zero; index them with
        ``plan.local_indices``. Autograd: gradients of buffer rows go back to their owners and
        accumulate into dk, dv ``[B, Hkv, s_local, D]``.
    """
    _check_4d("k", k)
    _check_4d("v", v)
    world, _ = _world(group)
    if world != plan.world:
        raise ValueError(f"group has {world} ranks but the plan was built for {plan.world}")
    b, hkv = plan.local_indices.shape[:2]
    if tuple(k.shape[:3]) != (b, hkv, plan.s_local) or tuple(v.shape[:3]) != (b, hkv, plan.s_local):
        raise ValueError(
            f"k and v must be [B, Hkv, s_local, D] with (B, Hkv, s_local) = {(b, hkv, plan.s_local)}, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    return _SelectiveKVGather.apply(k.contiguous(), v.contiguous(), plan, group)

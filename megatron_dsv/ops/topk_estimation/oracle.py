"""Exact critical-set oracle (used by the profiler and the tests), chunked over queries.

The chunked pass feeds accumulators (``add(pos, crit, cmass)``, ``result(q, n)``); the method's
profiler (:mod:`megatron_dsv.attention.profiler`) adds its recall curve to the same pass.

A query's theta-critical set is the smallest set of keys whose softmax mass reaches
theta: its highest-probability keys. Only ``chunk_elems`` query x key probabilities
(per call, all heads together) are resident at once, never S x S.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch

__all__ = ["critical_counts", "head_sparsity", "critical_mass_recall"]


def _check(q, k, theta, query_index):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"critical set oracle: `{name}` must be a [B, H, S, D] tensor")
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"critical set oracle: `k` must be [B, Hkv, S, D] matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"critical set oracle: `k` heads ({k.shape[1]}) must divide q heads ({H})")
    if q.device != k.device:
        raise ValueError(f"critical set oracle: `k` device {k.device} must equal q's {q.device}")
    if not (0.0 < float(theta) <= 1.0):
        raise ValueError(f"critical set oracle: `theta` must be in (0, 1], got {theta}")
    if query_index is None:
        return torch.arange(S, device=q.device)
    qi = torch.as_tensor(query_index, device=q.device)
    if qi.dim() != 1 or qi.dtype not in (torch.int32, torch.int64):
        raise ValueError("critical set oracle: `query_index` must be a 1-D integer tensor")
    if qi.numel() and qi.device.type == "cpu":
        if int(qi.min()) < 0 or int(qi.max()) >= S:
            raise ValueError(f"critical set oracle: `query_index` entries must be in [0, {S})")
    elif qi.numel():  # on a GPU, checked where the queries are, without a host read (a sync per call)
        torch._assert_async(((qi >= 0) & (qi < S)).all(), f"critical set oracle: `query_index` entries must be in [0, {S})")
    return qi.long()


def _logit_chunks(q, k, softmax_scale, qi, chunk_elems) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield (query positions, scaled logits fp32 [B, H, n, S]) per chunk of ``chunk_elems`` logits
    (GQA keys repeated; scale default ``1 / sqrt(D)``)."""
    B, H, S, D = q.shape
    rep = H // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    kf = k.float().repeat_interleave(rep, dim=1) if rep > 1 else k.float()
    n = max(1, chunk_elems // (B * H * S))
    for c0 in range(0, qi.numel(), n):
        pos = qi[c0:c0 + n]
        yield pos, torch.matmul(q[:, :, pos].float(), kf.transpose(-1, -2)) * scale


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum(x, -1)``, or :func:`blocked_prefix_sum` where torch has no deterministic cumsum (floating
    CUDA tensors under ``torch.use_deterministic_algorithms(True)``, Megatron's ``--deterministic-mode``, where
    torch's cumsum raises)."""
    if x.is_cuda and x.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return blocked_prefix_sum(x)
    return torch.cumsum(x, dim=-1)


def blocked_prefix_sum(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Inclusive prefix sum over the last dim from matrix products (deterministic wherever matmul is): within
    blocks of ``block`` by an upper-triangular ones matrix, then the blocks' exclusive offsets the same way, all
    in float64 (rounded to x's dtype at the end)."""
    n = x.shape[-1]
    if n == 0:
        return x.clone()
    lead = x.shape[:-1]
    xd = torch.nn.functional.pad(x.double(), (0, (-n) % block)).reshape(*lead, -1, block)  # [..., m, block]
    tri = torch.ones(block, block, dtype=torch.float64, device=x.device).triu()  # tri[i, j] = 1 for i <= j
    within = xd @ tri
    m = within.shape[-2]
    offsets = within[..., -1] @ torch.ones(m, m, dtype=torch.float64, device=x.device).triu(1)  # before each block
    out = (within + offsets.unsqueeze(-1)).reshape(*lead, -1)[..., :n]
    return out.to(x.dtype)


def _prob_chunks(q, k, theta, softmax_scale, qi, chunk_elems) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (query positions, probs fp32 [B, H, n, S], critical mask [B, H, n, S]) per chunk."""
    for pos, logits in _logit_chunks(q, k, softmax_scale, qi, chunk_elems):
        probs = torch.softmax(logits, dim=-1)
        sp, order = torch.sort(probs, dim=-1, descending=True)
        before = prefix_sum(sp) - sp  # mass strictly before each sorted key
        crit_sorted = before < theta  # the key is needed to reach theta
        crit = torch.zeros_like(crit_sorted).scatter_(-1, order, crit_sorted)
        yield pos, probs, crit


class _Counts:
    """Per sampled query: the critical-set size (int32 [B, H, Nq])."""

    def __init__(self):
        self.parts = []

    def add(self, pos, crit, cmass):
        self.parts.append(crit.sum(-1).to(torch.int32))

    def result(self, q, n):
        if not self.parts:
            return torch.zeros(q.shape[0], q.shape[1], 0, dtype=torch.int32, device=q.device)
        return torch.cat(self.parts, dim=-1)


class _ListRecall:
    """Mean over sampled queries of the critical mass inside the query's group list (float32 [B, H])."""

    def __init__(self, q, kv_indices, kv_counts, group_size: int, block_size: int):
        B, H, S, _ = q.shape
        if block_size < 0:
            raise ValueError(f"critical_mass_recall: `block_size` must be >= 0, got {block_size}")
        if group_size < 1:
            raise ValueError(f"critical_mass_recall: `group_size` must be >= 1, got {group_size}")
        NG = -(-S // group_size)
        if kv_indices.dim() != 4 or tuple(kv_indices.shape[:3]) != (B, H, NG):
            raise ValueError(f"critical_mass_recall: `kv_indices` must be [B, H, {NG}, Kmax], "
                             f"got {tuple(kv_indices.shape)}")
        counts = torch.as_tensor(kv_counts, device=q.device)
        if counts.dim() not in (1, 2, 3) or counts.dim() == 3 and tuple(counts.shape) != (B, H, NG):
            raise ValueError(f"critical_mass_recall: `kv_counts` must be [H], [B, H] (one length per head) or "
                             f"[B, H, {NG}] (one per query group), got {tuple(counts.shape)}")
        if counts.dim() == 1:
            counts = counts.unsqueeze(0).expand(B, H)
        if counts.dim() == 2:
            counts = counts[..., None]  # [B, H, 1]: every group
        self.S, self.group_size, self.block_size, self.lists = S, group_size, block_size, kv_indices
        self.n_items = S if block_size == 0 else -(-S // block_size)
        self.valid = torch.arange(kv_indices.shape[-1], device=q.device) < counts[..., None]  # [B, H, 1 | NG, Kmax]
        self.total = torch.zeros(B, H, dtype=torch.float64, device=q.device)

    def add(self, pos, crit, cmass):
        groups = pos // self.group_size
        lists = self.lists[:, :, groups].long()  # [B, H, n, Kmax]
        valid = self.valid if self.valid.shape[2] == 1 else self.valid[:, :, groups]
        ok = valid & (lists >= 0)
        sel = torch.zeros(*lists.shape[:3], self.n_items + 1, dtype=torch.bool, device=lists.device)
        sel.scatter_(-1, torch.where(ok, lists, self.n_items), True)
        sel = sel[..., :self.n_items]
        if self.block_size:
            sel = sel.repeat_interleave(self.block_size, dim=-1)[..., :self.S]
        hit = (cmass * sel).sum(-1)
        self.total += (hit / cmass.sum(-1).clamp_min(1e-30)).double().sum(-1)

    def result(self, q, n):
        return (self.total / max(1, n)).float()


def _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, accumulators) -> list:
    """Run the chunked softmax / critical-set pass once over the (checked) query positions ``qi``
    and feed every accumulator (with the critical probability mass ``probs * crit``, computed once)."""
    for pos, probs, crit in _prob_chunks(q, k, theta, softmax_scale, qi, chunk_elems):
        cmass = probs * crit
        for acc in accumulators:
            acc.add(pos, crit, cmass)
    return [acc.result(q, qi.numel()) for acc in accumulators]


def critical_counts(q, k, theta: float = 0.9, softmax_scale: Optional[float] = None,
                    query_index: Optional[torch.Tensor] = None, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """int32 [B, H, Nq]: per (sampled) query, the fewest keys whose softmax mass reaches theta.

    q [B, H, S, D], k [B, Hkv, S, D] (GQA: Hkv divides H); query_index: positions to
    evaluate (default all S)."""
    qi = _check(q, k, theta, query_index)
    return _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, [_Counts()])[0]


def head_sparsity(q, k, theta: float = 0.9, softmax_scale: Optional[float] = None,
                  query_index: Optional[torch.Tensor] = None, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """float32 [B, H]: 1 - mean(critical_counts) / S."""
    c = critical_counts(q, k, theta, softmax_scale, query_index, chunk_elems)
    return _sparsity_of(c, q.shape[2])


def _sparsity_of(counts: torch.Tensor, S: int) -> torch.Tensor:
    return (1.0 - counts.float().mean(-1) / S).float()


def critical_mass_recall(q, k, kv_indices, kv_counts, group_size: int, block_size: int = 0, theta: float = 0.9,
                         softmax_scale: Optional[float] = None, query_index: Optional[torch.Tensor] = None,
                         chunk_elems: int = 1 << 24) -> torch.Tensor:
    """float32 [B, H]: mean over (sampled) queries of mass(critical keys inside the query's
    group list) / mass(critical keys). Lists: int32 [B, H, ceil(S/G), Kmax] token ids
    (block_size 0) or key-block ids (block_size > 0), first kv_counts[b, h] (or kv_counts[b, h, g]) entries valid."""
    qi = _check(q, k, theta, query_index)
    acc = _ListRecall(q, kv_indices, kv_counts, group_size, block_size)
    return _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, [acc])[0]

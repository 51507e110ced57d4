"""Exact critical-set oracle (used by the profiler and the tests), chunked over queries.

A query's theta-critical set is the smallest set of keys whose softmax mass reaches
theta: its highest-probability keys. Only ``chunk_elems`` query x key probabilities
(per call, all heads together) are resident at once, never S x S.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch

__all__ = ["critical_counts", "head_sparsity", "critical_mass_recall", "recall_curve", "profile_stats",
           "smallest_k_reaching", "budget_for_recall"]


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
    if qi.numel() and (int(qi.min()) < 0 or int(qi.max()) >= S):
        raise ValueError(f"critical set oracle: `query_index` entries must be in [0, {S})")
    return qi.long()


def _prob_chunks(q, k, theta, softmax_scale, qi, chunk_elems) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (query positions, probs fp32 [B, H, n, S], critical mask [B, H, n, S]) per chunk."""
    B, H, S, D = q.shape
    rep = H // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    kf = k.float().repeat_interleave(rep, dim=1) if rep > 1 else k.float()
    n = max(1, chunk_elems // (B * H * S))
    for c0 in range(0, qi.numel(), n):
        pos = qi[c0:c0 + n]
        logits = torch.matmul(q[:, :, pos].float(), kf.transpose(-1, -2)) * scale
        probs = torch.softmax(logits, dim=-1)
        sp, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass strictly before each sorted key
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
        if counts.dim() == 1:
            counts = counts.unsqueeze(0).expand(B, H)
        self.S, self.group_size, self.block_size, self.lists = S, group_size, block_size, kv_indices
        self.n_items = S if block_size == 0 else -(-S // block_size)
        self.valid = torch.arange(kv_indices.shape[-1], device=q.device) < counts[..., None, None]  # [B, H, 1, Kmax]
        self.total = torch.zeros(B, H, dtype=torch.float64, device=q.device)

    def add(self, pos, crit, cmass):
        lists = self.lists[:, :, pos // self.group_size].long()  # [B, H, n, Kmax]
        ok = self.valid & (lists >= 0)
        sel = torch.zeros(*lists.shape[:3], self.n_items + 1, dtype=torch.bool, device=lists.device)
        sel.scatter_(-1, torch.where(ok, lists, self.n_items), True)
        sel = sel[..., :self.n_items]
        if self.block_size:
            sel = sel.repeat_interleave(self.block_size, dim=-1)[..., :self.S]
        hit = (cmass * sel).sum(-1)
        self.total += (hit / cmass.sum(-1).clamp_min(1e-30)).double().sum(-1)

    def result(self, q, n):
        return (self.total / max(1, n)).float()


class _RecallCurve:
    """Mean recall of the estimator's lists at every list length (float64 [B, H, n_items])."""

    def __init__(self, q, q_lr, k_lr, group_size: int, block_size: int, proxy: str, block_score: str):
        from .naive import group_proxies  # the estimator's own score definition

        B, H, S, _ = q.shape
        if (not isinstance(q_lr, torch.Tensor) or not isinstance(k_lr, torch.Tensor)
                or tuple(q_lr.shape[:3]) != (B, H, S) or q_lr.shape != k_lr.shape):
            raise ValueError(f"recall_curve: `q_lr` and `k_lr` must both be [B, H, S, r] = [{B}, {H}, {S}, r], "
                             f"got {tuple(getattr(q_lr, 'shape', ()))} and {tuple(getattr(k_lr, 'shape', ()))}")
        if group_size < 1:
            raise ValueError(f"recall_curve: `group_size` must be >= 1, got {group_size}")
        if block_size not in (0, 64, 128):
            raise ValueError(f"recall_curve: `block_size` must be one of (0, 64, 128), got {block_size}")
        if proxy not in ("mean", "middle"):
            raise ValueError(f"recall_curve: `proxy` must be one of ('mean', 'middle'), got {proxy!r}")
        if block_score not in ("max", "lse"):
            raise ValueError(f"recall_curve: `block_score` must be one of ('max', 'lse'), got {block_score!r}")
        self.k_lr = k_lr.float()  # once, not per chunk
        self.group_size, self.block_size, self.block_score = group_size, block_size, block_score
        self.proxies = group_proxies(q_lr, group_size, proxy)  # [B, H, NG, r]
        n_items = S if block_size == 0 else -(-S // block_size)
        self.total = torch.zeros(B, H, n_items, dtype=torch.float64, device=q.device)

    def add(self, pos, crit, cmass):
        mass = _item_mass(cmass, self.block_size).double()  # [B, H, n, n_items]
        scores = _ranking_scores(self.proxies[:, :, pos // self.group_size], self.k_lr, self.block_size,
                                 self.block_score)
        # stable descending sort: among equal scores the lower index comes first, as in the estimator
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        cum = torch.cumsum(torch.gather(mass, -1, order), dim=-1)
        self.total += (cum / cum[..., -1:].clamp_min(1e-300)).sum(2)  # x / x == 1: the curve ends at exactly 1

    def result(self, q, n):
        return self.total / max(1, n)


def _ranking_scores(proxies: torch.Tensor, k_lr: torch.Tensor, block_size: int, block_score: str) -> torch.Tensor:
    """The estimator's item scores (``naive.item_scores``) with the token scores as one fp32 matmul
    rather than its fixed-order sum over r: equal up to rounding, so only near-exact ties can rank
    differently (the CUDA kernel's fused multiply-adds differ from the naive twin in the same way)."""
    from .naive import reduce_blocks

    return reduce_blocks(torch.matmul(proxies.float(), k_lr.transpose(-1, -2).float()), block_size, block_score)


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
    (block_size 0) or key-block ids (block_size > 0), first kv_counts[b, h] entries valid."""
    qi = _check(q, k, theta, query_index)
    acc = _ListRecall(q, kv_indices, kv_counts, group_size, block_size)
    return _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, [acc])[0]


def _item_mass(cmass: torch.Tensor, block_size: int) -> torch.Tensor:
    """Critical mass per item: per key (block_size 0) or summed over each key block."""
    if block_size == 0:
        return cmass
    from .naive import block_view

    return block_view(cmass, block_size, 0.0).sum(-1)


def recall_curve(q, k, q_lr, k_lr, group_size: int, block_size: int = 0, theta: float = 0.9,
                 softmax_scale: Optional[float] = None, query_index: Optional[torch.Tensor] = None,
                 proxy: str = "mean", block_score: str = "max", chunk_elems: int = 1 << 24) -> torch.Tensor:
    """float64 [B, H, n_items]: entry k-1 = mean over (sampled) queries of the share of the query's
    theta-critical mass inside its group's best k items by low-rank score.

    The ranking is the estimator's (``estimate_topk`` with the same ``proxy`` / ``block_score``):
    higher score first, lower index wins ties; so entry k-1 equals :func:`critical_mass_recall` of
    the lists ``estimate_topk(q_lr, k_lr, k, ...)`` builds, for every k at once (the scores are one
    matmul here, so items whose scores tie up to rounding may swap places). q [B, H, S, D],
    k [B, Hkv, S, D]; q_lr, k_lr [B, H, S, r]; items are keys (block_size 0) or key blocks.
    Memory: one chunk of sampled rows x S (``chunk_elems``), never S x S. Each curve is
    non-decreasing and ends at exactly 1.
    """
    qi = _check(q, k, theta, query_index)
    acc = _RecallCurve(q, q_lr, k_lr, group_size, block_size, proxy, block_score)
    return _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, [acc])[0]


def profile_stats(q, k, theta: float, softmax_scale: Optional[float], query_index: Optional[torch.Tensor], *,
                  curve: Optional[dict] = None, lists: Optional[tuple] = None,
                  chunk_elems: int = 1 << 24) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The profiler's measurements from ONE softmax / critical-set pass over the sampled rows:
    ``(head_sparsity [B, H], recall_curve or None, critical_mass_recall or None)``.

    ``curve``: the keyword arguments of :func:`recall_curve` after ``k`` (``q_lr``, ``k_lr``,
    ``group_size``, ``block_size``, ``proxy``, ``block_score``); ``lists``: ``(kv_indices, kv_counts,
    group_size, block_size)`` as for :func:`critical_mass_recall`. Each result equals its function's.
    """
    qi = _check(q, k, theta, query_index)
    accs = [_Counts()]
    if curve is not None:
        accs.append(_RecallCurve(q, curve["q_lr"], curve["k_lr"], curve["group_size"], curve["block_size"],
                                 curve.get("proxy", "mean"), curve.get("block_score", "max")))
    if lists is not None:
        accs.append(_ListRecall(q, *lists))
    out = _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, accs)
    sparsity = _sparsity_of(out[0], q.shape[2])
    rest = iter(out[1:])
    return sparsity, next(rest) if curve is not None else None, next(rest) if lists is not None else None


def smallest_k_reaching(curve: torch.Tensor, target: float, min_items: int = 1) -> torch.Tensor:
    """int64 [...]: the smallest k >= min_items with ``curve[..., k-1] >= target`` (curves are
    non-decreasing and end at 1, so a target <= 1 is always reached)."""
    if not (0.0 < float(target) <= 1.0):
        raise ValueError(f"smallest_k_reaching: `target` must be in (0, 1], got {target}")
    n = curve.shape[-1]
    k = (curve < target).sum(-1) + 1
    return k.clamp(min=min(max(1, int(min_items)), n), max=n).long()


def budget_for_recall(q, k, q_lr, k_lr, group_size: int, block_size: int, theta: float,
                      softmax_scale: Optional[float], query_index: Optional[torch.Tensor], target: float,
                      proxy: str = "mean", block_score: str = "max", min_items: int = 1,
                      chunk_elems: int = 1 << 24) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head), the smallest list length (tokens, or key blocks at block granularity)
    whose estimated lists reach ``target`` mean recall of the theta-critical mass.

    Returns ``(budget int64 [B, H], curve float64 [B, H, n_items])`` (see :func:`recall_curve`);
    ``min_items`` is a floor in the same units (e.g. ``ceil(k_min / block_size)``).
    """
    curve = recall_curve(q, k, q_lr, k_lr, group_size, block_size, theta, softmax_scale, query_index,
                         proxy, block_score, chunk_elems)
    return smallest_k_reaching(curve, target, min_items), curve

"""The profiler's measurements: exact sparsity, the recall curve of the estimator's lists, and the
budget a recall target asks for, all from one chunked softmax / critical-set pass.

The critical-set definition, the chunked pass and the list recall are the exact oracle's
(:mod:`megatron_dsv.ops.topk_estimation.oracle`); what is method-level lives here: ranking keys the
way the estimator does (``recall_curve``), reading a budget off that curve (``smallest_k_reaching``,
``budget_for_recall``, :func:`recall_density`) and the profiler's combined pass (``profile_stats``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_dsv.config import DSVConfig
from megatron_dsv.ops.topk_estimation.common import check_forced, forced_mask
from megatron_dsv.ops.topk_estimation.naive import block_view, group_proxies, reduce_blocks
# the oracle's accumulator protocol (``add(pos, crit, cmass)`` / ``result(q, n)``) and its one pass
from megatron_dsv.ops.topk_estimation.oracle import _check, _Counts, _ListRecall, _one_pass, _sparsity_of, prefix_sum

__all__ = ["recall_curve", "profile_stats", "smallest_k_reaching", "budget_for_recall", "recall_density"]


class _RecallCurve:
    """Mean recall of the estimator's lists at every list length (float64 [B, H, n_items])."""

    def __init__(self, q, q_lr, k_lr, group_size: int, block_size: int, proxy: str, block_score: str,
                 forced: Optional[torch.Tensor] = None):
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
        self.proxies = group_proxies(q_lr, group_size, proxy)  # [B, H, NG, r]: the estimator's own proxies
        n_items = S if block_size == 0 else -(-S // block_size)
        self.total = torch.zeros(B, H, n_items, dtype=torch.float64, device=q.device)
        # forced items (local + predicted lists) rank first, as in the estimator
        self.n_items = n_items
        self.forced = None if forced is None else check_forced(forced, self.proxies.shape[2], n_items, q.device)

    def add(self, pos, crit, cmass):
        mass = _item_mass(cmass, self.block_size).double()  # [B, H, n, n_items]
        scores = _ranking_scores(self.proxies[:, :, pos // self.group_size], self.k_lr, self.block_size,
                                 self.block_score)
        if self.forced is not None:
            scores.masked_fill_(forced_mask(self.forced[pos // self.group_size], self.n_items), float("inf"))
        # stable descending sort: among equal scores the lower index comes first, as in the estimator
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        cum = prefix_sum(torch.gather(mass, -1, order))
        self.total += (cum / cum[..., -1:].clamp_min(1e-300)).sum(2)  # x / x == 1: the curve ends at exactly 1

    def result(self, q, n):
        return self.total / max(1, n)


def _ranking_scores(proxies: torch.Tensor, k_lr: torch.Tensor, block_size: int, block_score: str) -> torch.Tensor:
    """The estimator's item scores (``naive.item_scores``) with the token scores as one fp32 matmul
    rather than its fixed-order sum over r: equal up to rounding, so only near-exact ties can rank
    differently (the CUDA kernel's fused multiply-adds differ from the naive twin in the same way)."""
    return reduce_blocks(torch.matmul(proxies.float(), k_lr.transpose(-1, -2).float()), block_size, block_score)


def _item_mass(cmass: torch.Tensor, block_size: int) -> torch.Tensor:
    """Critical mass per item: per key (block_size 0) or summed over each key block."""
    if block_size == 0:
        return cmass
    return block_view(cmass, block_size, 0.0).sum(-1)


def recall_curve(q, k, q_lr, k_lr, group_size: int, block_size: int = 0, theta: float = 0.9,
                 softmax_scale: Optional[float] = None, query_index: Optional[torch.Tensor] = None,
                 proxy: str = "mean", block_score: str = "max", chunk_elems: int = 1 << 24,
                 forced: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [B, H, n_items]: entry k-1 = mean over (sampled) queries of the share of the query's
    theta-critical mass inside its group's best k items by low-rank score (``forced`` [NG, F] items,
    DSV's local part, first, as ``estimate_topk(..., forced=...)`` ranks them).

    The ranking is the estimator's (``estimate_topk`` with the same ``proxy`` / ``block_score``):
    higher score first, lower index wins ties; so entry k-1 equals ``critical_mass_recall`` of
    the lists ``estimate_topk(q_lr, k_lr, k, ...)`` builds, for every k at once (the scores are one
    matmul here, so items whose scores tie up to rounding may swap places). q [B, H, S, D],
    k [B, Hkv, S, D]; q_lr, k_lr [B, H, S, r]; items are keys (block_size 0) or key blocks.
    Memory: one chunk of sampled rows x S (``chunk_elems``), never S x S. Each curve is
    non-decreasing and ends at exactly 1.
    """
    qi = _check(q, k, theta, query_index)
    acc = _RecallCurve(q, q_lr, k_lr, group_size, block_size, proxy, block_score, forced)
    return _one_pass(q, k, theta, softmax_scale, qi, chunk_elems, [acc])[0]


def profile_stats(q, k, theta: float, softmax_scale: Optional[float], query_index: Optional[torch.Tensor], *,
                  curve: Optional[dict] = None, lists: Optional[tuple] = None,
                  chunk_elems: int = 1 << 24) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The profiler's measurements from ONE softmax / critical-set pass over the sampled rows:
    ``(head_sparsity [B, H], recall_curve or None, critical_mass_recall or None)``.

    ``curve``: the keyword arguments of :func:`recall_curve` after ``k`` (``q_lr``, ``k_lr``,
    ``group_size``, ``block_size``, ``proxy``, ``block_score``, ``forced``); ``lists``: ``(kv_indices, kv_counts,
    group_size, block_size)`` as for ``critical_mass_recall``. Each result equals its function's.
    """
    qi = _check(q, k, theta, query_index)
    accs = [_Counts()]
    if curve is not None:
        accs.append(_RecallCurve(q, curve["q_lr"], curve["k_lr"], curve["group_size"], curve["block_size"],
                                 curve.get("proxy", "mean"), curve.get("block_score", "max"),
                                 curve.get("forced")))
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


def recall_density(curve: torch.Tensor, S: int, cfg: DSVConfig) -> torch.Tensor:
    """Per head (float32 ``[H]``, on the curve's device): the list length, in tokens / S, where the
    recall curve ``[B, H, n_items]`` (averaged over the batch) reaches ``cfg.recall_target``; never
    below ``cfg.k_min`` tokens."""
    unit = cfg.block_size or 1
    items = smallest_k_reaching(curve.mean(0), cfg.recall_target, min_items=-(-cfg.k_min // unit))
    return ((items * unit).clamp(max=S).double() / S).float()

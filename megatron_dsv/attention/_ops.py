"""The ops DSV attention calls, resolved once: the real ops when they are importable.

``megatron_dsv.ops.sparse_attention`` and ``megatron_dsv.ops.topk_estimation``
are written in parallel with this package. Until a package exports its public
functions, the method falls back to the naive twin (sparse attention) or to the
small PyTorch stand-ins below (estimation and the exact oracle), which follow
the same contracts (DESIGN.md section 4). The stand-ins go away once
``topk_estimation`` lands; nothing else in ``attention/`` changes then.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["sparse_attention", "sparse_attention_naive", "estimate_topk", "estimate_topk_naive", "head_sparsity", "critical_mass_recall", "OPS_SOURCE",
           "SUPPORTED_HEAD_DIMS"]

OPS_SOURCE = {}

try:
    from megatron_dsv.ops.sparse_attention.checks import SUPPORTED_HEAD_DIMS
except ImportError:  # pragma: no cover - the checks module predates this package
    SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)

from megatron_dsv.ops.sparse_attention.naive import sparse_attention_naive  # noqa: E402

try:
    from megatron_dsv.ops.sparse_attention import sparse_attention  # noqa: F401

    OPS_SOURCE["sparse_attention"] = "ops"
except ImportError:
    sparse_attention = sparse_attention_naive
    OPS_SOURCE["sparse_attention"] = "naive"


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _sampled_probs(q, k, softmax_scale, query_index):
    """Exact softmax rows ``[B, H, Nq, S]`` (fp32) of the sampled queries; k is expanded for GQA."""
    if query_index is not None:
        q = q.index_select(2, query_index.to(q.device))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * _scale(q, softmax_scale)
    return torch.softmax(scores, dim=-1)


def _critical_mask(probs: torch.Tensor, theta: float) -> torch.Tensor:
    """Bool ``[B, H, Nq, S]``: the smallest key set per row whose mass reaches theta."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly larger keys
    keep_sorted = before < theta
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _local_critical_counts(q, k, theta=0.9, softmax_scale=None, query_index=None):
    return _critical_mask(_sampled_probs(q, k, softmax_scale, query_index), theta).sum(-1).to(torch.int32)


def _local_head_sparsity(q, k, theta=0.9, softmax_scale=None, query_index=None):
    counts = _local_critical_counts(q, k, theta, softmax_scale, query_index)
    return 1.0 - counts.float().mean(-1) / k.shape[2]


def _group_mask(kv_indices, kv_counts, S, block_size):
    B, H, NG, kmax = kv_indices.shape
    nk = S if block_size == 0 else -(-S // block_size)
    valid = torch.arange(kmax, device=kv_indices.device) < kv_counts[:, :, None, None].long()
    col = torch.where(valid, kv_indices.long(), nk)
    sel = torch.zeros(B, H, NG, nk + 1, dtype=torch.bool, device=kv_indices.device).scatter_(3, col, True)[..., :nk]
    return sel.repeat_interleave(block_size, dim=3)[..., :S] if block_size > 0 else sel


def _local_critical_mass_recall(q, k, kv_indices, kv_counts, group_size, block_size=0, theta=0.9,
                                softmax_scale=None, query_index=None):
    """Mean over sampled queries of (critical mass covered by the list) / (critical mass)."""
    S = k.shape[2]
    if query_index is None:
        query_index = torch.arange(q.shape[2], device=q.device)
    probs = _sampled_probs(q, k, softmax_scale, query_index)
    crit = probs * _critical_mask(probs, theta)
    sel = _group_mask(kv_indices, kv_counts, S, block_size)
    sel = sel.index_select(2, (query_index.to(q.device) // group_size))
    return ((crit * sel).sum(-1) / crit.sum(-1).clamp_min(1e-20)).mean(-1)


def _local_estimate_topk(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max"):
    """Per-group top-k of low-rank scores; returns (idx int32 [B,H,NG,Kmax], counts int32 [B,H])."""
    B, H, S, r = q_lr.shape
    NG = -(-S // group_size)
    pad = NG * group_size - S
    qf = torch.nn.functional.pad(q_lr.float(), (0, 0, 0, pad)).view(B, H, NG, group_size, r)
    if proxy == "mean":
        n = torch.full((NG,), float(group_size), device=q_lr.device)
        n[-1] = group_size - pad
        qg = qf.sum(3) / n[:, None]
    else:
        mid = torch.clamp(torch.arange(NG, device=q_lr.device) * group_size + group_size // 2, max=S - 1)
        qg = q_lr.float().index_select(2, mid)
    scores = torch.matmul(qg, k_lr.float().transpose(-1, -2))  # [B, H, NG, S]
    if block_size > 0:
        nb = -(-S // block_size)
        padded = torch.nn.functional.pad(scores, (0, nb * block_size - S), value=float("-inf"))
        padded = padded.view(B, H, NG, nb, block_size)
        scores = padded.amax(-1) if block_score == "max" else torch.logsumexp(padded, -1)
    nk = scores.shape[-1]
    counts = budgets.to(q_lr.device).long().expand(B, H).clamp(1, nk)
    kmax = int(counts.max())
    top = scores.topk(kmax, dim=-1).indices
    valid = torch.arange(kmax, device=q_lr.device) < counts[:, :, None, None]
    idx = torch.where(valid, top, nk).sort(-1).values
    idx = torch.where(idx == nk, 0, idx)
    return idx.to(torch.int32).contiguous(), counts.to(torch.int32)


try:
    from megatron_dsv.ops.topk_estimation import critical_mass_recall, estimate_topk, head_sparsity  # noqa: F401
    from megatron_dsv.ops.topk_estimation import estimate_topk_naive  # noqa: F401

    OPS_SOURCE["topk_estimation"] = "ops"
except ImportError:
    estimate_topk = estimate_topk_naive = _local_estimate_topk
    head_sparsity = _local_head_sparsity
    critical_mass_recall = _local_critical_mass_recall
    OPS_SOURCE["topk_estimation"] = "local stand-in"

"""PyTorch reference for sparse attention over per-query-group KV lists.

The spec, the CPU path and the last fallback: fp32 upcast, an explicit dense
[B, H, Sq, Sk] mask built from the lists, ordinary softmax attention. Memory is
O(B*H*Sq*Sk): for tests and small inputs only. Sq (queries) and Sk (keys) may
differ: lists index Sk's tokens or key blocks, query groups tile Sq.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .checks import check_shapes, check_values, group_counts, num_keys


def build_dense_mask(kv_indices: torch.Tensor, kv_counts: torch.Tensor, S: int,
                     group_size: int, block_size: int, Sk: Optional[int] = None) -> torch.Tensor:
    """Boolean [B, H, S, Sk] mask, True where query row attends key column.

    kv_indices int32 [B, H, ceil(S / group_size), Kmax], kv_counts int32 [B, H]; S is the query
    length, Sk the key length (None: Sk = S).
    """
    Sk = S if Sk is None else Sk
    B, H, NG, kmax = kv_indices.shape
    nk = num_keys(Sk, block_size)
    pos = torch.arange(kmax, device=kv_indices.device)
    valid = pos < group_counts(kv_counts, kv_indices.shape[2])[..., None].long()
    # padding entries go to a spare column nk, dropped below, so they are never used
    col = torch.where(valid, kv_indices.long(), nk)
    sel = torch.zeros(B, H, NG, nk + 1, dtype=torch.bool, device=kv_indices.device)
    sel.scatter_(3, col, True)
    sel = sel[..., :nk]
    if block_size > 0:
        sel = sel.repeat_interleave(block_size, dim=3)[..., :Sk]
    return sel.repeat_interleave(group_size, dim=2)[:, :, :S]


def sparse_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_indices: torch.Tensor, kv_counts: torch.Tensor, group_size: int,
                           block_size: int = 0, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Reference sparse attention; same contract as :func:`sparse_attention`.

    q [B, H, Sq, D]; k, v [B, Hkv, Sk, D]; returns [B, H, Sq, D] in q's dtype.
    """
    check_shapes(q, k, v, kv_indices, kv_counts, group_size, block_size)
    B, H, S, D = q.shape
    Sk = k.shape[2]
    check_values(kv_indices, kv_counts, Sk, block_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    rep = H // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    mask = build_dense_mask(kv_indices, kv_counts, S, group_size, block_size, Sk)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    has_any = mask.any(-1, keepdim=True)
    # rows with an empty list output zeros; keep their softmax finite so grads stay 0, not NaN
    scores = torch.where(mask, scores, float("-inf"))
    scores = torch.where(has_any, scores, 0.0)
    p = torch.softmax(scores, dim=-1) * has_any
    return torch.matmul(p, vf).to(q.dtype)

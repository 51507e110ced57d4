"""FlexAttention on identical block lists: the peer we must beat, and the
dispatch target where it measured faster (block-level only).

The BlockMask is built straight from the lists (every listed block marked
*full*), so flex evaluates no mask function per token; the partial last key
block is bounded by flex's own sequence-length masking. Query and key lengths
must be equal here (``op.choose_backend`` never routes Sk != Sq to flex).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .checks import group_counts


def flex_supported(S: int, group_size: int, block_size: int) -> bool:
    """Only 128x128 blocks lower on the H200 with torch 2.11: (G, block) = (128, 64), (64, 128),
    (64, 64) fail in Inductor with flex's default tiles ("Q and KV block size must be divisible
    by BLOCK_M and BLOCK_N") and with 64x64 kernel_options (NoValidChoicesError in backward);
    G < 64 can't map onto a BlockMask at all (sparse_attention-groups-h200-20261130.json)."""
    return group_size == 128 and block_size == 128


def build_block_mask(kv_indices: torch.Tensor, kv_counts: torch.Tensor, S: int,
                     group_size: int, block_size: int):
    from torch.nn.attention.flex_attention import BlockMask

    B, H, NG, KM = kv_indices.shape
    nkb = math.ceil(S / block_size)
    counts = group_counts(kv_counts, NG)
    valid = torch.arange(KM, device=kv_indices.device, dtype=torch.int32) < counts[..., None]
    # BlockMask wants one index row as wide as the number of key blocks; padding -> 0, never read
    full_idx = torch.zeros(B, H, NG, nkb, device=kv_indices.device, dtype=torch.int32)
    width = min(KM, nkb)
    full_idx[..., :width] = torch.where(valid, kv_indices, 0)[..., :width]
    full_num = counts.contiguous()
    zero_num = torch.zeros_like(full_num)
    return BlockMask.from_kv_blocks(zero_num, torch.zeros_like(full_idx), full_num, full_idx,
                                    BLOCK_SIZE=(group_size, block_size), seq_lengths=(S, S))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def sparse_attention_flex(q, k, v, kv_indices, kv_counts, group_size: int, block_size: int,
                          softmax_scale: Optional[float] = None, block_mask=None) -> torch.Tensor:
    """Same contract as sparse_attention for the shapes :func:`flex_supported` accepts (128x128
    blocks, which flex's default tiles divide) and equal lengths (k, v ``[B, Hkv, S, D]`` like
    q ``[B, H, S, D]``); differentiable."""
    S = q.shape[2]
    if k.shape[2] != S:
        raise ValueError(f"sparse_attention_flex: k's length Sk={k.shape[2]} must equal q's length "
                         f"Sq={S}; use the triton or naive backend for Sk != Sq")
    if block_mask is None:
        block_mask = build_block_mask(kv_indices, kv_counts, S, group_size, block_size)
    # always compiled: eager flex ignores the BlockMask's sparsity and attends densely
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[1])

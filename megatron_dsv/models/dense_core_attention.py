"""Dense core attention for the video DiT's local (non-TE) spec.

Megatron-Core's own ``DotProductAttention`` materialises the ``[b, np, sq, sk]`` score
matrix in a CUDA-only global buffer: it cannot run on CPU, and on a GPU it is far slower
than cuDNN / flash kernels at video sequence lengths. This module keeps Megatron's
core_attention contract (DESIGN.md section 4) and calls the project's single dense path,
:func:`megatron_dsv.ops.dense.dense_attention` (cuDNN first on GPU, SDPA math on CPU).
With transformer-engine installed the spec uses ``TEDotProductAttention`` instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_dsv.ops.dense import dense_attention

__all__ = ["DenseCoreAttention", "check_core_attention_args"]


def check_core_attention_args(owner: str, config, attn_mask_type, attention_dropout, pg_collection,
                              cp_hint: str) -> None:
    """The constructor checks of this package's non-causal, dropout-free, single-CP-rank core attentions."""
    if attn_mask_type not in (AttnMaskType.no_mask, AttnMaskType.padding):
        raise ValueError(f"attn_mask_type must be no_mask or padding (a DiT is non-causal), got {attn_mask_type}")
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout != 0.0:
        raise ValueError(f"{owner} supports attention_dropout=0.0 only, got {dropout}")
    cp = getattr(getattr(pg_collection, "cp", None), "size", lambda: 1)()
    if cp > 1:
        raise ValueError(f"{owner} has no context parallelism (cp={cp}); {cp_hint}")


class DenseCoreAttention(MegatronModule):
    """Full (non-causal) attention with Megatron's core_attention signature; supports padding masks."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        check_core_attention_args("DenseCoreAttention", config, attn_mask_type, attention_dropout, pg_collection,
                                  cp_hint="use TE or DSV attention")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]``; mask True = masked out -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("DenseCoreAttention supports neither packed_seq_params nor attention_bias; pass None")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        keep = None if attention_mask is None else ~attention_mask.bool()
        out = dense_attention(q, k, v, softmax_scale=self.softmax_scale, attn_mask=keep)
        sq, b, heads, hn = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

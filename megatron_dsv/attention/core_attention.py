"""DSVCoreAttention: Megatron-Core's core_attention contract, backed by DSV.

Contract (megatron-core 0.16.1 .. 0.19.x, DESIGN.md section 4): constructed by
``SelfAttention`` with the keywords ``config, layer_number, attn_mask_type,
attention_type, cp_comm_type, softmax_scale, pg_collection``;
``forward(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
packed_seq_params)`` with q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]``
(GQA: ng divides np), RoPE already applied; returns ``[sq, b, np * hn]``.

The spec passes ``dsv_config`` (a DSVConfig) through ``ModuleSpec.params``.
This module computes dense attention through :func:`megatron_dsv.ops.dense.dense_attention`
(cuDNN first on GPU); the DSV method (predictor, profiler, dispatcher, sparse
kernels) plugs in behind :meth:`DSVCoreAttention._attend`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.config import DSVConfig
from megatron_dsv.ops.dense import dense_attention

__all__ = ["DSVCoreAttention", "SUPPORTED_MASK_TYPES"]

SUPPORTED_MASK_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


def _group_size(pg) -> int:
    return 1 if pg is None else pg.size()


class DSVCoreAttention(MegatronModule):
    """Core attention with DSV dynamic sparsity (non-causal, for DiTs)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        dsv_config: Optional[DSVConfig] = None,
    ):
        super().__init__(config=config)
        self.dsv_config = dsv_config if dsv_config is not None else DSVConfig()
        if not isinstance(self.dsv_config, DSVConfig):
            raise ValueError(f"dsv_config must be a DSVConfig, got {type(self.dsv_config).__name__}")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self._check_mask_type(attn_mask_type, "attn_mask_type")
        self.attn_mask_type = attn_mask_type
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(f"DSV attention supports attention_dropout=0.0 only, got {dropout} "
                             "(set TransformerConfig.attention_dropout=0.0)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"DSV attention supports softmax_type='vanilla' only, got {config.softmax_type!r}")

        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = getattr(pg_collection, "tp", None)
        self.cp_group = getattr(pg_collection, "cp", None)
        tp = _group_size(self.tp_group)
        for name, count in (("num_attention_heads", config.num_attention_heads),
                            ("num_query_groups", config.num_query_groups)):
            if count % tp != 0:
                raise ValueError(f"TransformerConfig.{name} ({count}) must be divisible by the tensor-parallel size ({tp})")
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        cp = _group_size(self.cp_group)
        if cp > 1:
            raise ValueError(f"DSV attention with context_parallel_size={cp} needs DSVConfig.cp_mode in "
                             f"('head', 'seq', 'hybrid'), which this release does not provide yet; use cp=1")
        # apply_query_key_layer_scaling only rescales inside fp16 softmax and cancels out: not needed here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def _check_mask_type(mask_type, name: str):
        if mask_type not in SUPPORTED_MASK_TYPES:
            raise ValueError(f"DSV attention {name} must be one of "
                             f"{[m.name for m in SUPPORTED_MASK_TYPES]} (a DiT is non-causal), got {mask_type}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise ValueError("DSV attention does not support packed_seq_params (THD packing); pass None")
        if attention_bias is not None:
            raise ValueError("DSV attention does not support attention_bias; pass None")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        self._check_mask_type(mask_type, "attn_mask_type")
        self._check_shapes(query, key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, hn]
        keep = self._keep_mask(attention_mask, mask_type, q.shape[0], q.shape[2], k.shape[2])
        out = self._attend(q, k, v, keep)  # [b, np, sq, hn]
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)

    def _attend(self, q, k, v, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention on ``[b, heads, s, hn]`` tensors; ``keep`` is a bool mask (True = attend) or None."""
        return dense_attention(q, k, v, softmax_scale=self.softmax_scale, attn_mask=keep)

    def _check_shapes(self, query, key, value):
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError("query, key, value must be [s, b, heads, head_dim]; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if query.shape[2] != self.num_heads or query.shape[3] != self.head_dim:
            raise ValueError(f"query must be [sq, b, {self.num_heads}, {self.head_dim}], got {tuple(query.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
        if key.shape[1] != query.shape[1] or key.shape[3] != self.head_dim:
            raise ValueError(f"key must be [sk, {query.shape[1]}, ng, {self.head_dim}], got {tuple(key.shape)}")
        if self.num_heads % key.shape[2] != 0:
            raise ValueError(f"key/value heads ({key.shape[2]}) must divide query heads ({self.num_heads})")

    @staticmethod
    def _keep_mask(attention_mask, mask_type, b: int, sq: int, sk: int) -> Optional[torch.Tensor]:
        """Megatron masks are True where attention is *blocked*; SDPA wants True = attend."""
        if mask_type == AttnMaskType.no_mask or attention_mask is None:
            return None
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be a bool tensor (True = masked out), got {attention_mask.dtype}")
        if attention_mask.dim() != 4 or attention_mask.shape[-1] != sk or attention_mask.shape[0] not in (1, b):
            raise ValueError(f"padding attention_mask must be [b, 1, 1 or sq, sk] = [{b}, 1, 1|{sq}, {sk}], "
                             f"got {tuple(attention_mask.shape)}")
        return ~attention_mask

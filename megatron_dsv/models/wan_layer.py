"""The Wan2.1 transformer layer as a Megatron-Core TransformerLayer, and its spec.

One layer (``e`` = the model's time projection ``[b, 6, hidden]``, shared by all layers; ``table`` =
this layer's learned ``[1, 6, hidden]`` offset; norms in fp32 as Wan has them):

    shift, scale, gate, c_shift, c_scale, c_gate = table + e
    x = x + gate * SelfAttn(LN(x) * (1 + scale) + shift)        LN without affine; 3D RoPE (interleaved)
    x = x + CrossAttn(LN_affine(x), text)                       not modulated, no RoPE
    x = x + c_gate * MLP(LN(x) * (1 + c_scale) + c_shift)       GELU (tanh)

Both attentions normalise q and k with an RMSNorm over the **whole projection** (all heads' channels
at once, ``hidden`` wide: diffusers' ``rms_norm_across_heads``), not per head as Megatron's
``q_layernorm`` usually does. :class:`WanQKNorm` takes Megatron's per-head ``[s, b, np, hn]`` tensors
and normalises over ``np * hn``; under tensor parallelism a rank holds only its heads, so the mean
square is summed over the TP group (autograd: the sum's backward is a sum too). Its ``hidden``-wide gain
is replicated on every TP rank, each rank applying its heads' slice, as Megatron-Core treats
``q_layernorm`` (``config.qk_layernorm``): the gain's gradient is partial per rank and summed over the TP
group, by Megatron-LM's ``finalize_model_grads`` and by the core trainer
(:func:`megatron_dsv.training.optim.sum_partial_grads_over_tp`).

As in ``dit_layer.py``, the block's ``attention_mask`` slot carries the conditioning ``e``: a DiT
has no self-attention mask, and the slot is threaded through TransformerBlock's recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import (CrossAttention, CrossAttentionSubmodules, SelfAttention,
                                                 SelfAttentionSubmodules)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_dsv.models.dense_core_attention import DenseCoreAttention

__all__ = ["WanLayerNorm", "WanAffineLayerNorm", "WanQKNorm", "WanCrossAttention", "WanCrossAttentionSubmodules",
           "TextCrossCoreAttention", "WanTransformerLayer", "get_wan_layer_spec"]


class WanLayerNorm(torch.nn.Module):
    """LayerNorm without affine, computed in fp32 (Wan's ``norm1`` / ``norm3`` / ``norm_out``)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.eps = int(hidden_size), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.hidden_size,), eps=self.eps)


class WanAffineLayerNorm(torch.nn.Module):
    """LayerNorm with weight and bias, computed in fp32 (Wan's ``norm2``, before cross-attention).
    The parameters are replicated over TP ranks (their gradients agree: every rank sees the full hidden)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``; backward: all-reduce (sum) of the gradients, because every rank's
    output feeds that rank's own (different) heads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _tp_group_and_size(config):
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if tp == 1:
        return None, 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), tp


class WanQKNorm(torch.nn.Module):
    """RMSNorm over all heads' channels of q or k: ``[s, b, np, hn]`` normalised over ``(np, hn)`` of
    the whole model (``num_attention_heads * hn``), weight ``[num_attention_heads * hn]`` replicated over
    TP ranks, each rank applying the slice of its heads (so its gradient is partial: summed over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.group, self.tp = _tp_group_and_size(config)
        heads = config.num_attention_heads
        if heads % self.tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size "
                             f"({self.tp})")
        self.heads_local, self.head_dim, self.eps = heads // self.tp, int(hidden_size), float(eps)
        self.full_width = heads * self.head_dim
        rank = dist.get_rank(self.group) if self.group is not None else 0
        self._slice = slice(rank * self.heads_local * self.head_dim, (rank + 1) * self.heads_local * self.head_dim)
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(self.full_width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.heads_local, self.head_dim):
            raise ValueError(f"WanQKNorm expects [s, b, {self.heads_local}, {self.head_dim}], got {tuple(x.shape)}")
        x32 = x.float()
        sq = x32.square().sum(dim=(-2, -1), keepdim=True)
        if self.group is not None:
            sq = _SumOverGroup.apply(sq, self.group)
        y = x32 * torch.rsqrt(sq / self.full_width + self.eps)
        return (y * self.weight[self._slice].float().view(self.heads_local, self.head_dim)).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets)  # replicated


class TextCrossCoreAttention(DenseCoreAttention):
    """Dense core attention for the cross-attention to text, also under context parallelism: a CP rank's
    queries are its shard of the video, but every rank holds the whole text (keys and values), so the
    attention is local and needs no CP exchange (a CP-aware core such as TE's would shard the text too)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=None)


@dataclass
class WanCrossAttentionSubmodules(CrossAttentionSubmodules):
    """Megatron's cross-attention submodules plus q/k norms (megatron-core's CrossAttention has none)."""

    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class WanCrossAttention(CrossAttention):
    """Megatron-Core CrossAttention with Wan's q/k RMSNorm over all heads (applied after the projections)."""

    def __init__(self, config, submodules: WanCrossAttentionSubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.padding, cp_comm_type=None, pg_collection=None, **kwargs):
        # kwargs: what newer megatron-core layers pass on (0.19: ``name``), handed to CrossAttention as is
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **kwargs)
        self.q_layernorm = self.k_layernorm = None
        for name in ("q_layernorm", "k_layernorm"):
            spec = getattr(submodules, name, None)
            if spec is not None:
                setattr(self, name, build_module(spec, hidden_size=self.hidden_size_per_attention_head,
                                                 config=self.config, eps=self.config.layernorm_epsilon))

    def get_query_key_value_tensors(self, hidden_states, key_value_states, output_gate=False, split_qkv=True):
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                                output_gate=output_gate, split_qkv=split_qkv)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


class WanTransformerLayer(TransformerLayer):
    """Wan2.1 block; ``attention_mask`` carries the time projection ``e`` ``[b, 6, hidden]``."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection, vp_stage=vp_stage)
        if config.sequence_parallel:
            raise ValueError("the Wan model does not support TransformerConfig.sequence_parallel=True yet; "
                             "set it False")
        h = config.hidden_size
        # Wan's init (randn / sqrt(hidden)); a converted checkpoint overwrites it. Replicated over TP ranks.
        self.scale_shift_table = torch.nn.Parameter(torch.randn(1, 6, h, dtype=config.params_dtype) / h ** 0.5)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                **kwargs):
        """hidden_states ``[s, b, h]``; ``attention_mask`` = time projection ``[b, 6, h]``. Returns (out, context)."""
        e = attention_mask
        h = self.config.hidden_size
        if e is None or e.dim() != 3 or e.shape[1:] != (6, h):
            raise ValueError("WanTransformerLayer expects the time projection [b, 6, hidden] in the attention_mask "
                             f"slot, got {None if e is None else tuple(e.shape)}")
        if context is None:
            raise ValueError("the Wan model cross-attends to text: pass text embeddings")
        mods = (self.scale_shift_table.float() + e.float()).unbind(dim=1)  # six [b, h], fp32
        shift, scale, gate, c_shift, c_scale, c_gate = (m.unsqueeze(0) for m in mods)
        dtype = hidden_states.dtype

        x = (self.input_layernorm(hidden_states) * (1 + scale) + shift).to(dtype)
        out, bias = self.self_attention(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
                                        packed_seq_params=packed_seq_params)
        hidden_states = (hidden_states.float() + _add_bias(out, bias) * gate).to(dtype)

        x = self.pre_cross_attn_layernorm(hidden_states).to(dtype)
        out, bias = self.cross_attention(x, attention_mask=context_mask, key_value_states=context)
        hidden_states = hidden_states + _add_bias(out, bias)

        x = (self.pre_mlp_layernorm(hidden_states) * (1 + c_scale) + c_shift).to(dtype)
        out, bias = self.mlp(x)
        hidden_states = (hidden_states.float() + _add_bias(out, bias).float() * c_gate).to(dtype)
        return hidden_states, context


def _add_bias(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x if bias is None else x + bias


def get_wan_layer_spec(use_dsv: bool = False, use_te: Optional[bool] = None, dsv_config=None,
                       cross_attn_norm: bool = True) -> ModuleSpec:
    """Layer spec of the Wan2.1 transformer: megatron.core linears and attention (TE linears and core
    attention when installed, ``use_te=None``), Wan's norms; ``use_dsv`` swaps the self-attention core for
    DSVCoreAttention through :func:`megatron_dsv.models.specs.get_dsv_layer_spec`; cross-attention is always
    :class:`TextCrossCoreAttention` (dense, CP-local)."""
    if not isinstance(use_dsv, bool):
        raise ValueError(f"use_dsv must be True or False, got {use_dsv!r}")
    from megatron_dsv.models.dit_layer import _backend

    backend = _backend(use_te)
    core = DenseCoreAttention if isinstance(backend, LocalSpecProvider) else backend.core_attention()
    self_attn = ModuleSpec(
        module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(linear_qkv=backend.column_parallel_linear(), core_attention=core,
                                           linear_proj=backend.row_parallel_linear(),
                                           q_layernorm=WanQKNorm, k_layernorm=WanQKNorm))
    cross = ModuleSpec(
        module=WanCrossAttention, params={"attn_mask_type": AttnMaskType.padding},
        submodules=WanCrossAttentionSubmodules(linear_q=backend.column_parallel_linear(),
                                               linear_kv=backend.column_parallel_linear(),
                                               core_attention=TextCrossCoreAttention,
                                               linear_proj=backend.row_parallel_linear(),
                                               q_layernorm=WanQKNorm, k_layernorm=WanQKNorm))
    spec = ModuleSpec(
        module=WanTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WanLayerNorm, self_attention=self_attn, self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=WanAffineLayerNorm if cross_attn_norm else IdentityOp,
            cross_attention=cross, cross_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=WanLayerNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                                                                linear_fc2=backend.row_parallel_linear())),
            mlp_bda=get_bias_dropout_add))
    if use_dsv:
        from megatron_dsv.models.specs import get_dsv_layer_spec

        spec = get_dsv_layer_spec(spec, dsv_config)
    return spec

"""The DiT transformer layer (adaLN-Zero) as a Megatron-Core TransformerLayer, and its spec.

Every layer is modulated by shift/scale/gate vectors computed from the conditioning
vector ``c`` (timestep + class (+ pooled text) embedding), as in DiT (Peebles & Xie):

    x = x + gate_msa * SelfAttn(LN(x) * (1 + scale_msa) + shift_msa)
    x = x + CrossAttn(LN(x), text)                      (only when text_dim is set)
    x = x + gate_mlp * MLP(LN(x) * (1 + scale_mlp) + shift_mlp)

The modulation linear is zero-initialised ("-Zero"): every layer starts as the identity.

How ``c`` reaches the layers: ``TransformerBlock.forward`` hands each layer a fixed set
of arguments and no free-form extras. A DiT has no attention mask (every token sees every
token), so the block's ``attention_mask`` slot carries ``c`` (``[b, hidden]``); the layer
calls self-attention with no mask. Using a slot the block already threads through keeps
``TransformerBlock`` unmodified *including* its activation recomputation, whose checkpoint
treats the slot as a tensor input, so gradients reach the timestep/class embedders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import (CrossAttention, CrossAttentionSubmodules, SelfAttention,
                                                 SelfAttentionSubmodules)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_dsv.models.dense_core_attention import DenseCoreAttention

__all__ = ["DiTLayerSubmodules", "DiTTransformerLayer", "get_video_dit_layer_spec", "modulate"]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` with x ``[s, b, h]`` and shift/scale ``[b, h]``."""
    return x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)


@dataclass
class DiTLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the adaLN modulation linear (hidden -> 6 * hidden)."""

    adaln_modulation: Union[ModuleSpec, type] = IdentityOp


class DiTTransformerLayer(TransformerLayer):
    """TransformerLayer with adaLN-Zero modulation; ``attention_mask`` carries the conditioning ``c``."""

    def __init__(self, config, submodules: DiTLayerSubmodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection, vp_stage=vp_stage)
        if config.sequence_parallel:
            raise ValueError("VideoDiT does not support TransformerConfig.sequence_parallel=True yet; set it False")
        # gather_output: every TP rank needs all 6 modulation vectors for its full-width residual stream.
        self.adaln_modulation = build_module(
            submodules.adaln_modulation, config.hidden_size, 6 * config.hidden_size, config=config,
            init_method=torch.nn.init.zeros_, bias=True, gather_output=True, skip_bias_add=False,
            is_expert=False, tp_group=self.pg_collection.tp)
        with torch.no_grad():  # adaLN-Zero, whatever init_method the linear class honoured
            self.adaln_modulation.weight.zero_()
            self.adaln_modulation.bias.zero_()
        self.has_cross_attention = not isinstance(self.cross_attention, IdentityOp)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                **kwargs):
        """hidden_states ``[s, b, h]``; ``attention_mask`` = conditioning ``c`` ``[b, h]``. Returns (out, context)."""
        cond = attention_mask
        if cond is None or cond.dim() != 2 or cond.shape[-1] != self.config.hidden_size:
            raise ValueError("DiTTransformerLayer expects the conditioning vector [b, hidden] in the attention_mask "
                             f"slot, got {None if cond is None else tuple(cond.shape)}")
        mods, _ = self.adaln_modulation(F.silu(cond))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=-1)

        x = modulate(self.input_layernorm(hidden_states), shift_msa, scale_msa)
        attn_out, attn_bias = self.self_attention(x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
                                                  attention_bias=attention_bias,
                                                  packed_seq_params=packed_seq_params)
        hidden_states = hidden_states + gate_msa.unsqueeze(0) * self._dropout(_add_bias(attn_out, attn_bias))

        if self.has_cross_attention:
            if context is None:
                raise ValueError("this VideoDiT has text cross-attention (text_dim set): pass text embeddings")
            x = self.pre_cross_attn_layernorm(hidden_states)
            out, bias = self.cross_attention(x, attention_mask=context_mask, key_value_states=context)
            hidden_states = hidden_states + self._dropout(_add_bias(out, bias))

        x = modulate(self.pre_mlp_layernorm(hidden_states), shift_mlp, scale_mlp)
        mlp_out, mlp_bias = self.mlp(x)
        hidden_states = hidden_states + gate_mlp.unsqueeze(0) * self._dropout(_add_bias(mlp_out, mlp_bias))
        return hidden_states, context

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=self.hidden_dropout, training=self.training) if self.hidden_dropout > 0 else x


def _add_bias(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x if bias is None else x + bias


def _backend(use_te: Optional[bool]):
    from megatron_dsv.models.specs import have_transformer_engine

    use_te = have_transformer_engine() if use_te is None else bool(use_te)
    if not use_te:
        return LocalSpecProvider()
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider()


def get_video_dit_layer_spec(use_dsv: bool = False, use_te: Optional[bool] = None, dsv_config=None,
                             cross_attention: bool = False, qk_layernorm: bool = True) -> ModuleSpec:
    """Layer spec of the video DiT: megatron.core linears/attention, TE when installed (``use_te=None``).

    Args:
        use_dsv: swap the self-attention core for DSVCoreAttention (via ``specs.get_dsv_layer_spec``).
        use_te: True/False force transformer-engine/local layers; None picks TE when it imports.
        dsv_config: DSVConfig for the DSV core (default DSVConfig()); ignored when ``use_dsv`` is False.
        cross_attention: add text cross-attention (PixArt style: after self-attention, not modulated).
        qk_layernorm: LayerNorm on q and k per head.
    Norms are never fused into the following linear (TE's LayerNormLinear) because the
    adaLN modulation sits between the norm and the linear.
    """
    if not isinstance(use_dsv, bool):
        raise ValueError(f"use_dsv must be True or False, got {use_dsv!r}")
    backend = _backend(use_te)
    norm = backend.layer_norm()
    # Megatron's local DotProductAttention is CUDA-only and materialises S x S: use the project's dense path.
    core = DenseCoreAttention if isinstance(backend, LocalSpecProvider) else backend.core_attention()
    qk_norm = backend.layer_norm(for_qk=True) if qk_layernorm else None
    self_attn = ModuleSpec(
        module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
        submodules=SelfAttentionSubmodules(linear_qkv=backend.column_parallel_linear(),
                                           core_attention=core,
                                           linear_proj=backend.row_parallel_linear(),
                                           q_layernorm=qk_norm, k_layernorm=qk_norm))
    cross = IdentityOp
    if cross_attention:
        cross = ModuleSpec(
            module=CrossAttention, params={"attn_mask_type": AttnMaskType.padding},
            submodules=CrossAttentionSubmodules(linear_q=backend.column_parallel_linear(),
                                                linear_kv=backend.column_parallel_linear(),
                                                core_attention=core,
                                                linear_proj=backend.row_parallel_linear()))
    spec = ModuleSpec(
        module=DiTTransformerLayer,
        submodules=DiTLayerSubmodules(
            input_layernorm=norm, self_attention=self_attn, self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=norm if cross_attention else IdentityOp, cross_attention=cross,
            cross_attn_bda=get_bias_dropout_add if cross_attention else IdentityOp,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                                                                linear_fc2=backend.row_parallel_linear())),
            mlp_bda=get_bias_dropout_add,
            # Megatron's own ColumnParallelLinear even with TE: TE linears refuse gather_output=True.
            adaln_modulation=ColumnParallelLinear))
    if use_dsv:
        from megatron_dsv.models.specs import get_dsv_layer_spec

        spec = get_dsv_layer_spec(spec, dsv_config)
    return spec

"""Layer specs with DSV core attention: customisation by spec, never by patching Megatron.

``get_dsv_layer_spec(base_spec, dsv_config)`` returns a copy of any Megatron-Core
transformer-layer spec (the GPT local spec, the TE spec, a DiT spec) whose
self-attention core is :class:`DSVCoreAttention`; the base spec is untouched.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.config import DSVConfig

__all__ = ["get_dsv_layer_spec", "get_gpt_dsv_layer_spec", "have_transformer_engine", "DSVSelfAttention",
           "HandsHiddenStatesToCore"]


class HandsHiddenStatesToCore:
    """Mixin for a Megatron ``SelfAttention`` (sub)class: hands the layer's input hidden states
    ``[s, b, hidden]`` to a :class:`DSVCoreAttention` for ``DSVConfig.predictor_input='hidden'``.

    Megatron's attention calls its core attention with q, k, v only; rather than copying
    its long forward, the hidden states ride on the core attention for the duration of
    this forward (the core attention takes them and clears the slot). Full-layer
    recomputation re-runs this forward, so it sees them again; selective recomputation of
    ``core_attn`` alone cannot, and DSVCoreAttention rejects that combination.
    """

    def forward(self, hidden_states, *args, **kwargs):
        core = getattr(self, "core_attention", None)
        if not isinstance(core, DSVCoreAttention):
            return super().forward(hidden_states, *args, **kwargs)
        core._hidden = hidden_states
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            core._hidden = None


class DSVSelfAttention(HandsHiddenStatesToCore, SelfAttention):
    """Megatron-Core ``SelfAttention`` that hands hidden states to DSV core attention."""


_HIDDEN_CLASSES = {SelfAttention: DSVSelfAttention}


def _with_hidden_states(module):
    """The self-attention class of a spec, extended with :class:`HandsHiddenStatesToCore`."""
    if not (isinstance(module, type) and issubclass(module, SelfAttention)):
        raise ValueError("DSVConfig.predictor_input='hidden' needs the spec's self_attention module to be "
                         f"megatron.core SelfAttention or a subclass, got {module!r}; use predictor_input='qk'")
    if issubclass(module, HandsHiddenStatesToCore):
        return module
    if module not in _HIDDEN_CLASSES:
        _HIDDEN_CLASSES[module] = type(f"DSV{module.__name__}", (HandsHiddenStatesToCore, module), {})
    return _HIDDEN_CLASSES[module]


def have_transformer_engine() -> bool:
    """True when transformer-engine imports (then TE layers are used; never required)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def replace_core_attention(layer_spec: ModuleSpec, core_attention: ModuleSpec, attn_mask_type) -> ModuleSpec:
    """Copy of a transformer-layer spec whose self-attention uses ``core_attention`` with mask type
    ``attn_mask_type`` (the one way this package swaps core attention: DSV, the window baseline)."""
    spec = copy.deepcopy(layer_spec)
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    core_holder = getattr(attn, "submodules", None)
    if core_holder is None or not hasattr(core_holder, "core_attention"):
        raise ValueError("base_spec has no submodules.self_attention.submodules.core_attention to replace: "
                         "pass a Megatron-Core transformer-layer spec (e.g. get_gpt_layer_local_spec())")
    core_holder.core_attention = core_attention
    attn.params = {**(attn.params or {}), "attn_mask_type": attn_mask_type}
    return spec


def _swap_core_attention(layer_spec: ModuleSpec, dsv_config: DSVConfig, attn_mask_type) -> ModuleSpec:
    spec = replace_core_attention(layer_spec, ModuleSpec(module=DSVCoreAttention, params={"dsv_config": dsv_config}),
                                  attn_mask_type)
    if dsv_config.predictor_input == "hidden":
        attn = spec.submodules.self_attention
        attn.module = _with_hidden_states(attn.module)
    return spec


def get_dsv_layer_spec(base_spec, dsv_config: Optional[DSVConfig] = None,
                       attn_mask_type: AttnMaskType = AttnMaskType.no_mask):
    """Copy of ``base_spec`` with DSV core attention.

    DSV attention is non-causal (video DiTs attend both ways), so the copy's
    self-attention mask type is set to ``attn_mask_type`` (``no_mask`` or
    ``padding``); a causal base spec such as GPT's becomes bidirectional.

    Args:
        base_spec: a transformer-layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``
            (every layer spec in it is converted).
        dsv_config: the DSV knobs (default: ``DSVConfig()``); ``None`` is not "off":
            to keep stock attention, do not call this function.
    """
    dsv_config = dsv_config if dsv_config is not None else DSVConfig()
    DSVCoreAttention._check_mask_type(attn_mask_type, "attn_mask_type")
    if hasattr(base_spec, "layer_specs"):
        block = copy.copy(base_spec)
        block.layer_specs = [_swap_core_attention(s, dsv_config, attn_mask_type) for s in base_spec.layer_specs]
        return block
    if not isinstance(base_spec, ModuleSpec):
        raise ValueError("base_spec must be a ModuleSpec or TransformerBlockSubmodules, got "
                         f"{type(base_spec).__name__}")
    return _swap_core_attention(base_spec, dsv_config, attn_mask_type)


def get_gpt_dsv_layer_spec(dsv_config: Optional[DSVConfig], use_te: Optional[bool] = None,
                           normalization: Optional[str] = None):
    """GPT layer spec (TE when installed, else local); DSV core attention when ``dsv_config`` is set."""
    use_te = have_transformer_engine() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        base = get_gpt_layer_local_spec(normalization=normalization)
    return base if dsv_config is None else get_dsv_layer_spec(base, dsv_config)

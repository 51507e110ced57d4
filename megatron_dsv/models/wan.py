"""Wan2.1 text-to-video transformer on a Megatron-Core TransformerBlock (DSV plugs in by spec).

Same architecture as diffusers' ``WanTransformer3DModel`` (text-to-video), so a converted checkpoint
(``tools/convert_checkpoint.py``, ``megatron_dsv/models/wan_convert.py``) gives diffusers' output:

    latents [B, C, T, H, W] -> patchify (1, 2, 2) -> cube-major order (once) -> linear patch embedding
    t in [0, 1] -> sinusoid of 1000 t (diffusers' Timesteps: cos first) -> time MLP -> temb [B, h]
        -> time projection of SiLU(temb) -> e [B, 6, h] (every layer adds its own table to e)
    text [B, L, text_dim] -> Linear, GELU(tanh), Linear -> context [L, B, h]
    TransformerBlock of WanTransformerLayer (wan_layer.py), 3D RoPE in Megatron's interleaved layout
    LN(x) * (1 + scale) + shift with (shift, scale) = table + temb -> Linear -> raster order (once)
        -> unpatchify (projection features ordered (pt, ph, pw, C), as diffusers) -> velocity

Timesteps follow our flow-matching convention (``x_t = (1 - t) x0 + t noise``, t = 1 is noise); Wan's
scheduler timestep is ``1000 t``, the same flow. The RoPE table is built on the cube-major order's
(t, h, w) coordinates, so the token order changes nothing but the order (dense attention is
permutation-equivariant). Context parallelism shards the cube-ordered sequence as ``VideoDiT`` does.
"""

from __future__ import annotations

import dataclasses

from functools import lru_cache
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention.grouping import cube_order_coords, from_cube_order, to_cube_order
from megatron_dsv.attention.hooks import dsv_set_token_grid
from megatron_dsv.models.dit_config import _check_dtype, _query_cube
from megatron_dsv.models.rope3d import rope_3d_freqs
from megatron_dsv.models.video_dit import VideoDiT, _cp_group, init_device, patchify, timestep_features, unwrap_model
from megatron_dsv.models.wan_config import WAN_PRESETS, WanConfig
from megatron_dsv.models.wan_layer import WanLayerNorm, get_wan_layer_spec

__all__ = ["WanTransformer", "WanConfig", "WAN_PRESETS", "build_wan", "wan_rope_table", "wan_unpatchify",
           "unwrap_wan", "count_wan_parameters"]


@lru_cache(maxsize=32)
def _rope(grid, cube, head_dim: int, theta: float) -> torch.Tensor:
    # Wan's bands (t takes head_dim - 2 * 2 * (head_dim // 6) channels, h and w 2 * (head_dim // 6) each) and
    # ladders (theta^(-k / n) within an n-pair band) are rope3d's; Wan pairs adjacent channels (2i, 2i + 1),
    # which is Megatron's rotary_interleaved layout: each angle appears twice in a row.
    angles = rope_3d_freqs(cube_order_coords(grid, cube), head_dim, theta)
    return angles.repeat_interleave(2, dim=-1)[:, None, None, :].contiguous()


def wan_rope_table(grid: Sequence[int], cube: Sequence[int], head_dim: int, theta: float = 10000.0,
                   device=None) -> torch.Tensor:
    """``rotary_pos_emb`` float32 ``[T*H*W, 1, 1, head_dim]`` for ``rotary_interleaved=True``; row i is
    token i of the cube-major order of the patch grid ``grid``."""
    table = _rope(tuple(int(g) for g in grid), tuple(int(c) for c in cube), int(head_dim), float(theta))
    return table if device is None else table.to(device)


def wan_unpatchify(tokens: torch.Tensor, token_grid: Sequence[int], patch: Sequence[int], channels: int):
    """``[B, S, pt*ph*pw*C]`` (raster order, features (pt, ph, pw, C) as Wan's proj_out) -> ``[B, C, T, H, W]``."""
    B = tokens.shape[0]
    (gt, gh, gw), (pt, ph, pw) = token_grid, patch
    x = tokens.reshape(B, gt, gh, gw, pt, ph, pw, channels)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # B, C, T', pt, H', ph, W', pw
    return x.reshape(B, channels, gt * pt, gh * ph, gw * pw)


class _TwoLinear(torch.nn.Module):
    """``linear_2(act(linear_1(x)))``: Wan's time embedder (SiLU) and text embedder (GELU tanh)."""

    def __init__(self, d_in: int, d_out: int, act):
        super().__init__()
        self.linear_1, self.linear_2, self.act = torch.nn.Linear(d_in, d_out), torch.nn.Linear(d_out, d_out), act

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class WanTransformer(MegatronModule):
    """Wan2.1 transformer. Build with :func:`build_wan`; ``forward`` returns the flow velocity."""

    def __init__(self, config: TransformerConfig, wan_config: WanConfig, layer_spec, cube: Sequence[int],
                 pg_collection=None):
        super().__init__(config=config)
        self.wan_config = wc = wan_config
        self.cube = tuple(int(c) for c in cube)
        h = config.hidden_size
        # Embedders and head are small and replicated on every TP rank, as in VideoDiT.
        self.patch_embed = torch.nn.Linear(wc.patch_dim, h)
        self.time_embedder = _TwoLinear(wc.freq_dim, h, torch.nn.SiLU())
        self.time_proj = torch.nn.Linear(h, 6 * h)
        self.text_embedder = _TwoLinear(wc.text_dim, h, torch.nn.GELU(approximate="tanh"))
        self.decoder = TransformerBlock(config=config, spec=layer_spec, post_layer_norm=False, pre_process=True,
                                        post_process=False, pg_collection=pg_collection)
        self.cp_group = _cp_group(pg_collection)
        self.norm_out = WanLayerNorm(config, h, wc.eps)
        self.scale_shift_table = torch.nn.Parameter(torch.randn(1, 2, h) / h ** 0.5)
        self.proj_out = torch.nn.Linear(h, wc.out_dim)

    # The sequence layout machinery is VideoDiT's: the same cube order, CP shards and gather.
    set_input_tensor = VideoDiT.set_input_tensor
    _dsv_cores = VideoDiT._dsv_cores
    _cp_size = VideoDiT._cp_size
    _cp_shard = VideoDiT._cp_shard
    _cp_gather = VideoDiT._cp_gather

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, labels=None, text: Optional[torch.Tensor] = None,
                text_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Velocity ``[B, out_channels, T, H, W]``.

        Args:
            latents: ``[B, in_channels, T, H, W]``, grid divisible by ``patch_size``.
            timesteps: ``[B]`` float in [0, 1] (1 = noise); diffusers' ``timestep`` is ``1000 * timesteps``.
            labels: must be None (Wan has no class conditioning; the slot keeps VideoDiT's signature).
            text: ``[B, L, text_dim]`` text-encoder embeddings (Wan: umT5, zero-padded to 512 tokens).
            text_mask: optional ``[B, L]`` bool, True = real token. Wan was trained attending to the zero
                padding too (diffusers passes no mask): leave None to reproduce it.
        """
        grid = self._check_inputs(latents, timesteps, labels, text, text_mask)
        dsv_set_token_grid(self._dsv_cores(), grid)  # the neighbourhoods of local lists and the stage-1 window
        wc, dtype = self.wan_config, self.patch_embed.weight.dtype
        tokens = to_cube_order(patchify(latents, wc.patch_size), grid, self.cube, dim=1)
        x = self.patch_embed(tokens.to(dtype)).transpose(0, 1).contiguous()  # [S, B, h]
        temb = self.time_embedder(timestep_features(timesteps, wc.freq_dim).to(dtype))
        e = self.time_proj(F.silu(temb)).unflatten(1, (6, -1))  # [B, 6, h]
        context = self.text_embedder(text.to(dtype)).transpose(0, 1).contiguous()  # [L, B, h]
        context_mask = None if text_mask is None else ~text_mask.bool()[:, None, None, :]  # True = masked out
        rope = wan_rope_table(grid, self.cube, self.config.kv_channels, wc.rope_theta, device=x.device)
        x, rope = self._cp_shard(x), self._cp_shard(rope)
        x = self.decoder(hidden_states=x, attention_mask=e, context=context, context_mask=context_mask,
                         rotary_pos_emb=rope)
        shift, scale = (self.scale_shift_table.float() + temb.float().unsqueeze(1)).unbind(dim=1)  # [B, h] each
        x = (self.norm_out(x) * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)).to(dtype)
        x = self._cp_gather(self.proj_out(x))
        x = from_cube_order(x.transpose(0, 1), grid, self.cube, dim=1)
        return wan_unpatchify(x, grid, wc.patch_size, wc.out_channels)

    def _check_inputs(self, latents, timesteps, labels, text, text_mask):
        wc = self.wan_config
        if latents.dim() != 5 or latents.shape[1] != wc.in_channels:
            raise ValueError(f"latents must be [B, C, T, H, W] with C = in_channels = {wc.in_channels}, got "
                             f"{tuple(latents.shape)}")
        B = latents.shape[0]
        grid = wc.token_grid(latents.shape[2:])
        if timesteps.shape != (B,) or not timesteps.is_floating_point():
            raise ValueError(f"timesteps must be a float tensor [B] = [{B}] in [0, 1], got "
                             f"{timesteps.dtype} {tuple(timesteps.shape)}")
        if labels is not None:
            raise ValueError("the Wan model has no class conditioning: pass labels=None")
        if text is None or text.dim() != 3 or text.shape[0] != B or text.shape[2] != wc.text_dim:
            raise ValueError(f"text must be [B, L, text_dim] = [{B}, L, {wc.text_dim}], got "
                             f"{None if text is None else tuple(text.shape)}")
        if text_mask is not None and tuple(text_mask.shape) != tuple(text.shape[:2]):
            raise ValueError(f"text_mask must be [B, L] = {tuple(text.shape[:2])}, got {tuple(text_mask.shape)}")
        return grid


def build_wan(cfg: WanConfig, dsv_config=None, use_te: Optional[bool] = None, pg_collection=None,
              dtype: torch.dtype = torch.float32, **transformer_overrides) -> WanTransformer:
    """Build a :class:`WanTransformer` (random weights: load a converted checkpoint to fine-tune Wan2.1).

    Args:
        cfg: the model shape (:meth:`WanConfig.from_preset`, :meth:`WanConfig.from_diffusers`).
        dsv_config: a DSVConfig for DSV self-attention (its ``query_group_shape`` becomes the token cube);
            None = dense attention and the cube ``cfg.cube``. Wan was pretrained with full attention and a
            fine-tune restarts at stage 1, so the default (auto) ``stage1_local_radius`` is dense here: the
            windowed stage 1 was measured training from scratch only. An explicit radius holds.
        use_te: force transformer-engine (True) or local (False) layers; None = TE when installed.
        pg_collection: process groups (default: megatron.core.parallel_state's).
        transformer_overrides: TransformerConfig fields (``tensor_model_parallel_size``, recomputation, ...).
    """
    if not isinstance(cfg, WanConfig):
        raise ValueError(f"cfg must be a WanConfig, got {type(cfg).__name__}")
    dtype = _check_dtype(dtype)
    cube = _query_cube(dsv_config, cfg.cube)
    if dsv_config is not None and dsv_config.stage1_local_radius is None:
        dsv_config = dataclasses.replace(dsv_config, stage1_local_radius=(0, 0, 0))
    config = _transformer_config(cfg, dtype, transformer_overrides)
    spec = get_wan_layer_spec(use_dsv=dsv_config is not None, use_te=use_te, dsv_config=dsv_config,
                              cross_attn_norm=cfg.cross_attn_norm)
    model = WanTransformer(config, cfg, spec, cube, pg_collection=pg_collection)
    return model.to(device=init_device(config), dtype=dtype)


def _transformer_config(cfg: WanConfig, dtype, overrides: dict) -> TransformerConfig:
    kwargs = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.attention_head_dim, ffn_hidden_size=cfg.ffn_dim, hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_epsilon=cfg.eps, add_bias_linear=True, gated_linear_unit=False,
        # the spec's q/k norms are Wan's (WanQKNorm): megatron-core >= 0.19 refuses a spec norm without this,
        # and Megatron-LM's finalize_model_grads then sums their partial gradients over TP, as they need
        qk_layernorm=True,
        activation_func=lambda x: F.gelu(x, approximate="tanh"), rotary_interleaved=True, apply_rope_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available())
    kwargs.update(overrides)
    try:
        config = TransformerConfig(**kwargs)
    except TypeError as err:
        raise ValueError(f"transformer_overrides has a key TransformerConfig does not accept: {err}") from err
    # read by DSVCoreAttention: WanQKNorm computes in fp32, so below fp32 it saves a copy of q/k, not a view of
    # the fused QKV buffer; a v view would then keep that whole buffer alive for backward (DSV copies v instead)
    config.dsv_save_v_view = config.params_dtype == torch.float32
    return config


def unwrap_wan(model) -> WanTransformer:
    """The WanTransformer inside Megatron wrappers (DDP, Float16Module, ...)."""
    return unwrap_model(model, WanTransformer)


def count_wan_parameters(cfg: WanConfig) -> int:
    """Parameter count of the Wan transformer for ``cfg`` (analytic; DSV predictors not included)."""
    h, f = cfg.hidden, cfg.ffn_dim
    attn = 4 * (h * h + h) + 2 * h  # q, k, v, out + q/k norms
    per_layer = 2 * attn + (h * f + f) + (f * h + h) + 6 * h + (2 * h if cfg.cross_attn_norm else 0)
    embed = cfg.patch_dim * h + h + (cfg.freq_dim * h + h) + (h * h + h) + (h * 6 * h + 6 * h)
    embed += cfg.text_dim * h + h + h * h + h
    head = 2 * h + h * cfg.out_dim + cfg.out_dim
    return cfg.num_layers * per_layer + embed + head

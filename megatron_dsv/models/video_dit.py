"""VideoDiT: a video Diffusion Transformer on a Megatron-Core TransformerBlock, trained by flow matching.

Data path (one forward):

    latents [B, C, T, H, W]
      -> patchify (patch (pt, ph, pw)) -> tokens [B, S, C*pt*ph*pw] in raster order
      -> cube-major order (once; every layer, RoPE row and CP shard sees this order)
      -> linear patch embedding -> [S, B, hidden] (Megatron's sequence-first layout)
      -> TransformerBlock of DiT layers (adaLN-Zero, 3D RoPE, optional text cross-attention)
      -> final adaLN + linear -> raster order (once) -> unpatchify -> velocity [B, C, T, H, W]

Context parallelism (``pg_collection.cp`` of size cp > 1): after the patch embedding each CP rank
keeps its contiguous slice of the cube-ordered sequence (whole cubes: a cube is G consecutive
tokens) and of the RoPE table; the layers see only that shard (DSV attention does the rest,
``megatron_dsv.parallel``); the final projection's shards are all-gathered (autograd: each rank's
shard receives the gradient of every rank's identical loss, summed, which the data-parallel
gradient average over DP x CP ranks turns back into the one-GPU gradient).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention.grouping import from_cube_order, to_cube_order
from megatron_dsv.attention.hooks import dsv_set_token_grid
from megatron_dsv.models.dit_config import PRESETS, VideoDiTConfig, _check_dtype, _query_cube, count_parameters
from megatron_dsv.models.dit_layer import get_video_dit_layer_spec, modulate
from megatron_dsv.models.rope3d import rope_3d_table

__all__ = ["VideoDiT", "VideoDiTConfig", "PRESETS", "build_video_dit", "get_video_dit_layer_spec",
           "flow_matching_loss", "patchify", "unpatchify", "count_parameters", "unwrap_video_dit"]


def patchify(latents: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """``[B, C, T, H, W]`` -> ``[B, S, C*pt*ph*pw]``, tokens in raster (t, h, w) order."""
    B, C, T, H, W = latents.shape
    pt, ph, pw = patch
    x = latents.reshape(B, C, T // pt, pt, H // ph, ph, W // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # B, T', H', W', C, pt, ph, pw
    return x.reshape(B, (T // pt) * (H // ph) * (W // pw), C * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, token_grid: Sequence[int], patch: Sequence[int], channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, S, C*pt*ph*pw]`` (raster order) -> ``[B, C, T, H, W]``."""
    B = tokens.shape[0]
    (gt, gh, gw), (pt, ph, pw) = token_grid, patch
    x = tokens.reshape(B, gt, gh, gw, channels, pt, ph, pw)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # B, C, T', pt, H', ph, W', pw
    return x.reshape(B, channels, gt * pt, gh * ph, gw * pw)


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` of t in [0, 1] (scaled by 1000 so the ladder spans the range, as in DiT)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class VideoDiT(MegatronModule):
    """Video DiT. Build with :func:`build_video_dit`; ``forward`` returns the flow velocity."""

    def __init__(self, config: TransformerConfig, dit_config: VideoDiTConfig, layer_spec, cube: Sequence[int],
                 pg_collection=None):
        super().__init__(config=config)
        self.dit_config = dit_config
        self.cube = tuple(int(c) for c in cube)
        h, dc = config.hidden_size, dit_config
        # Embedders are small and replicated on every TP rank (their grads agree across TP ranks because
        # Megatron's column-parallel linears all-reduce their input gradients).
        self.patch_embed = torch.nn.Linear(dc.patch_dim, h)
        self.t_embedder = torch.nn.Sequential(torch.nn.Linear(dc.frequency_embedding_size, h), torch.nn.SiLU(),
                                              torch.nn.Linear(h, h))
        # One extra row: the null class, used for classifier-free guidance.
        self.y_embedder = torch.nn.Embedding(dc.num_classes + 1, h) if dc.num_classes > 0 else None
        self.text_proj = torch.nn.Linear(dc.text_dim, h) if dc.text_dim is not None else None
        self.decoder = TransformerBlock(config=config, spec=layer_spec, post_layer_norm=False, pre_process=True,
                                        post_process=False, pg_collection=pg_collection)
        self.cp_group = _cp_group(pg_collection)
        self.final_norm = torch.nn.LayerNorm(h, elementwise_affine=False, eps=dc.layernorm_epsilon)
        self.final_adaln = torch.nn.Linear(h, 2 * h)
        self.final_linear = torch.nn.Linear(h, dc.patch_dim)
        self._init_weights()

    def _init_weights(self):
        # DiT's init: xavier patch embedding, small-normal label/timestep embedders, and zeros for
        # every output-side modulation so the network starts at velocity 0 (adaLN-Zero).
        with torch.no_grad():
            torch.nn.init.xavier_uniform_(self.patch_embed.weight)
            torch.nn.init.zeros_(self.patch_embed.bias)
            for lin in (self.t_embedder[0], self.t_embedder[2]):
                torch.nn.init.normal_(lin.weight, std=0.02)
                torch.nn.init.zeros_(lin.bias)
            if self.y_embedder is not None:
                torch.nn.init.normal_(self.y_embedder.weight, std=0.02)
            for lin in (self.final_adaln, self.final_linear):
                torch.nn.init.zeros_(lin.weight)
                torch.nn.init.zeros_(lin.bias)

    def set_input_tensor(self, input_tensor):
        """Pipeline-parallel hook (Megatron schedules call it); this model runs as one stage."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------
    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor] = None,
                text: Optional[torch.Tensor] = None, text_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Velocity ``[B, C, T, H, W]`` of the flow at ``latents`` (noised) and ``timesteps``.

        Args:
            latents: ``[B, C, T, H, W]``, grid divisible by the patch.
            timesteps: ``[B]`` float in [0, 1] (1 = pure noise).
            labels: ``[B]`` long in [0, num_classes]; ``num_classes`` = null class. Required when
                the model has class conditioning.
            text: ``[B, L, text_dim]`` embeddings, when the model has cross-attention.
            text_mask: optional ``[B, L]`` bool, True = real token (padding is False).
        """
        token_grid = self._check_inputs(latents, timesteps, labels, text, text_mask)
        dsv_set_token_grid(self._dsv_cores(), token_grid)  # the neighbourhoods of local lists and the stage-1 window
        dc = self.dit_config
        tokens = to_cube_order(patchify(latents, dc.patch), token_grid, self.cube, dim=1)
        x = self.patch_embed(tokens.to(self.patch_embed.weight.dtype)).transpose(0, 1).contiguous()
        cond, context, context_mask = self._conditioning(timesteps, labels, text, text_mask)
        rope = rope_3d_table(token_grid, self.cube, self.config.kv_channels, dc.rope_theta, device=x.device)
        x, rope = self._cp_shard(x), self._cp_shard(rope)
        # The block's attention_mask slot carries the adaLN conditioning (see dit_layer.py).
        x = self.decoder(hidden_states=x, attention_mask=cond, context=context, context_mask=context_mask,
                         rotary_pos_emb=rope)
        shift, scale = self.final_adaln(F.silu(cond)).chunk(2, dim=-1)
        x = self._cp_gather(self.final_linear(modulate(self.final_norm(x), shift, scale)))
        x = from_cube_order(x.transpose(0, 1), token_grid, self.cube, dim=1)
        return unpatchify(x, token_grid, dc.patch, dc.in_channels)

    def _dsv_cores(self):
        """This model's DSV core attentions (found once)."""
        if getattr(self, "_dsv_core_list", None) is None:
            from megatron_dsv.attention.core_attention import DSVCoreAttention

            self._dsv_core_list = [m for m in self.modules() if isinstance(m, DSVCoreAttention)]
        return self._dsv_core_list

    def _cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    def _cp_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's contiguous slice (dim 0) of the cube-ordered sequence."""
        cp = self._cp_size()
        if cp == 1:
            return x
        S, cube = x.shape[0], math.prod(self.cube)
        if S % (cp * cube):
            raise ValueError(f"context parallelism: the video's {S} tokens must split into context_parallel_size "
                             f"({cp}) shards of whole {'x'.join(map(str, self.cube))} cubes ({cube} tokens; the cube "
                             "is "
                             "DSVConfig.query_group_shape, --dsv-query-group-shape): change the latent size, the "
                             "patch, the cube or --context-parallel-size")
        s, r = S // cp, self.cp_group.rank()
        return x[r * s:(r + 1) * s]

    def _cp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, B, F]`` shards of all CP ranks -> ``[S, B, F]`` (autograd)."""
        if self._cp_size() == 1:
            return x
        from megatron_dsv.parallel.collectives import gather_seq

        s, B, F_ = x.shape
        return gather_seq(x.reshape(1, 1, s, B * F_), self.cp_group).reshape(-1, B, F_)

    def _conditioning(self, timesteps, labels, text, text_mask):
        dtype = self.patch_embed.weight.dtype
        cond = self.t_embedder(timestep_features(timesteps, self.dit_config.frequency_embedding_size).to(dtype))
        if self.y_embedder is not None:
            cond = cond + self.y_embedder(labels)
        context = context_mask = None
        if self.text_proj is not None:
            emb = self.text_proj(text.to(dtype))  # [B, L, h]
            if text_mask is None:
                pooled = emb.mean(dim=1)
            else:
                keep = text_mask.to(dtype).unsqueeze(-1)
                pooled = (emb * keep).sum(1) / keep.sum(1).clamp_min(1.0)
                context_mask = ~text_mask.bool()[:, None, None, :]  # Megatron: True = masked out
            cond = cond + pooled
            context = emb.transpose(0, 1).contiguous()
        return cond, context, context_mask

    def _check_inputs(self, latents, timesteps, labels, text, text_mask):
        dc = self.dit_config
        if latents.dim() != 5:
            raise ValueError(f"latents must be [B, C, T, H, W], got shape {tuple(latents.shape)}")
        B, C = latents.shape[:2]
        if C != dc.in_channels:
            raise ValueError(f"latents must have in_channels = {dc.in_channels} channels (dim 1), got {C}")
        token_grid = dc.token_grid(latents.shape[2:])
        if timesteps.shape != (B,) or not timesteps.is_floating_point():
            raise ValueError(f"timesteps must be a float tensor [B] = [{B}] in [0, 1], got "
                             f"{timesteps.dtype} {tuple(timesteps.shape)}")
        if self.y_embedder is not None:
            if labels is None or labels.shape != (B,) or labels.dtype != torch.long:
                raise ValueError(f"labels must be a long tensor [B] = [{B}] with values in [0, {dc.num_classes}] "
                                 f"({dc.num_classes} = null class), got "
                                 f"{None if labels is None else (labels.dtype, tuple(labels.shape))}")
            if labels.device.type == "cpu" and (labels.min() < 0 or labels.max() > dc.num_classes):
                raise ValueError(f"labels must be in [0, {dc.num_classes}], got range "
                                 f"[{int(labels.min())}, {int(labels.max())}]")
        if self.text_proj is None and text is not None:
            raise ValueError("text was given but this model has no cross-attention (VideoDiTConfig.text_dim is None)")
        if self.text_proj is not None:
            if text is None or text.dim() != 3 or text.shape[0] != B or text.shape[2] != dc.text_dim:
                raise ValueError(f"text must be [B, L, text_dim] = [{B}, L, {dc.text_dim}], got "
                                 f"{None if text is None else tuple(text.shape)}")
            if text_mask is not None and tuple(text_mask.shape) != tuple(text.shape[:2]):
                raise ValueError(f"text_mask must be [B, L] = {tuple(text.shape[:2])}, got {tuple(text_mask.shape)}")
        return token_grid


def _cp_group(pg_collection):
    """The context-parallel group: ``pg_collection.cp``, else Megatron's when initialised, else None."""
    if pg_collection is not None:
        return getattr(pg_collection, "cp", None)
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def build_video_dit(cfg: VideoDiTConfig, dsv_config=None, use_te: Optional[bool] = None, pg_collection=None,
                    dtype: torch.dtype = torch.float32, window_config=None, **transformer_overrides) -> VideoDiT:
    """Build a :class:`VideoDiT` (a megatron.core MegatronModule).

    Args:
        cfg: the model shape.
        dsv_config: a DSVConfig to use DSV core attention (its ``query_group_shape`` becomes the token
            cube); None = Megatron's stock core attention and the cube ``cfg.cube``.
        use_te: force transformer-engine (True) or local (False) layers; None = TE when installed.
        window_config: a WindowConfig for the static 3D local-window baseline
            (:class:`~megatron_dsv.models.window_attention.WindowCoreAttention`): its ``cube`` becomes the
            token cube, and the windows are laid out on the default token grid ``cfg.token_grid()`` (the
            model then takes only latents of ``cfg.latent_grid``). Excludes ``dsv_config``.
        pg_collection: process groups (default: megatron.core.parallel_state's).
        dtype: parameter dtype (float32, bfloat16, float16).
        transformer_overrides: extra TransformerConfig fields (e.g. ``recompute_granularity="full",
            recompute_method="uniform", recompute_num_layers=1``, ``tensor_model_parallel_size``).
    Needs megatron.core.parallel_state initialised (or ``pg_collection``).
    """
    if not isinstance(cfg, VideoDiTConfig):
        raise ValueError(f"cfg must be a VideoDiTConfig, got {type(cfg).__name__}")
    dtype = _check_dtype(dtype)
    cube = _query_cube(dsv_config, cfg.cube)
    if window_config is not None:
        from megatron_dsv.models.window_attention import WindowConfig, get_window_layer_spec

        if dsv_config is not None:
            raise ValueError("dsv_config and window_config are mutually exclusive: pass at most one")
        if not isinstance(window_config, WindowConfig):
            raise ValueError(f"window_config must be a WindowConfig or None, got {type(window_config).__name__}")
        cube = window_config.cube
    config = _transformer_config(cfg, dtype, transformer_overrides)
    spec = get_video_dit_layer_spec(use_dsv=dsv_config is not None, use_te=use_te, dsv_config=dsv_config,
                                    cross_attention=cfg.text_dim is not None, qk_layernorm=cfg.qk_layernorm)
    if window_config is not None:
        spec = get_window_layer_spec(spec, window_config, cfg.token_grid())
    model = VideoDiT(config, cfg, spec, cube, pg_collection=pg_collection)
    return model.to(device=init_device(config), dtype=dtype)


def init_device(config: TransformerConfig) -> torch.device:
    """Where Megatron-Core put the layers' weights (the GPU unless ``use_cpu_initialization``): the
    builders move the model's own parameters (embeddings, heads) there too, so a model is on one device."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _transformer_config(cfg: VideoDiTConfig, dtype, overrides: dict) -> TransformerConfig:
    kwargs = dict(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden, hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_epsilon=cfg.layernorm_epsilon, normalization="LayerNorm", add_bias_linear=True,
        gated_linear_unit=False, activation_func=lambda x: F.gelu(x, approximate="tanh"),
        qk_layernorm=cfg.qk_layernorm, apply_rope_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available())
    kwargs.update(overrides)
    try:
        return TransformerConfig(**kwargs)
    except TypeError as err:
        raise ValueError(f"transformer_overrides has a key TransformerConfig does not accept: {err}") from err


def unwrap_model(model, cls):
    """The ``cls`` instance inside Megatron wrappers (DDP, Float16Module, ...: each holds ``.module``)."""
    seen = model
    for _ in range(8):
        if isinstance(seen, cls):
            return seen
        seen = getattr(seen, "module", None)
    raise ValueError(f"model must be a {cls.__name__} or a wrapper of one (with .module), got {type(model).__name__}")


def unwrap_video_dit(model) -> VideoDiT:
    """The VideoDiT inside Megatron wrappers (DDP, Float16Module, ...)."""
    return unwrap_model(model, VideoDiT)


def _flow_settings(model):
    """(timestep_sampling, class_dropout_prob, num_classes, takes_labels) of the model inside ``model``'s
    wrappers: a VideoDiT's ``dit_config``; a text-conditioned model without one (``WanTransformer``: a
    ``wan_config``, no class labels): logit-normal timesteps, no label dropout, labels not passed."""
    seen = model
    for _ in range(8):
        if isinstance(seen, VideoDiT):
            dc = seen.dit_config
            return dc.timestep_sampling, dc.class_dropout_prob, dc.num_classes, True
        if hasattr(seen, "wan_config"):
            return "logit_normal", 0.0, 0, False
        seen = getattr(seen, "module", None)
    unwrap_video_dit(model)  # raises, naming the type
    raise AssertionError("unreachable")


def flow_matching_loss(model, latents: torch.Tensor, labels: Optional[torch.Tensor],
                       generator: Optional[torch.Generator] = None, text: Optional[torch.Tensor] = None,
                       text_mask: Optional[torch.Tensor] = None,
                       timestep_sampling: Optional[str] = None) -> torch.Tensor:
    """Rectified-flow loss (scalar, mean over every element).

    ``x_t = (1 - t) * x0 + t * noise`` with ``x0 = latents``; the model predicts the velocity
    ``noise - x0`` (so sampling integrates from t = 1, noise, to t = 0, data).
    t ~ logit-normal (``sigmoid(N(0, 1))``, SD3; puts weight mid-trajectory) or uniform, by
    ``timestep_sampling`` (default: the model's ``VideoDiTConfig.timestep_sampling``).
    In training mode a ``class_dropout_prob`` fraction of labels become the null class
    (classifier-free guidance). All randomness comes from ``generator`` (on its own device).
    A model without class conditioning (``WanTransformer``) gets ``labels=None`` and logit-normal t.
    """
    sampling, dropout, num_classes, takes_labels = _flow_settings(model)
    mode = sampling if timestep_sampling is None else timestep_sampling
    if mode not in ("logit_normal", "uniform"):
        raise ValueError(f"timestep_sampling must be one of ['logit_normal', 'uniform'], got {mode!r}")
    B, dev = latents.shape[0], latents.device
    gdev = generator.device if generator is not None else dev
    noise = torch.randn(latents.shape, generator=generator, device=gdev, dtype=torch.float32).to(dev)
    if mode == "logit_normal":
        t = torch.sigmoid(torch.randn(B, generator=generator, device=gdev)).to(dev)
    else:
        t = torch.rand(B, generator=generator, device=gdev).to(dev)
    if not takes_labels:
        labels = None
    if labels is not None and model.training and dropout > 0:
        drop = (torch.rand(B, generator=generator, device=gdev) < dropout).to(dev)
        labels = torch.where(drop, torch.full_like(labels, num_classes), labels)
    x0 = latents.float()
    tb = t.view(B, 1, 1, 1, 1)
    x_t = (1.0 - tb) * x0 + tb * noise
    target = noise - x0
    v = model(x_t.to(latents.dtype), t, labels, text=text, text_mask=text_mask)
    return F.mse_loss(v.float(), target)

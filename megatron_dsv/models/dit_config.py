"""VideoDiTConfig and the model presets.

The presets ``0.8b``, ``2.7b`` and ``30b`` follow the layer shapes of the DSV paper's
models (layers, heads, head dim); hidden = heads * head_dim and MLP ratio 4 as in DiT.
``tiny`` is the CPU demo: 100 steps on 8x16x16 latents take a couple of minutes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["VideoDiTConfig", "PRESETS", "TIMESTEP_SAMPLINGS", "count_parameters"]

TIMESTEP_SAMPLINGS = ("logit_normal", "uniform")


@dataclass
class VideoDiTConfig:
    """Shape and conditioning of a video DiT (the megatron TransformerConfig is derived from it)."""

    in_channels: int = 4
    """Channels C of the latent video ``[B, C, T, H, W]``."""
    latent_frames: int = 8
    """Default latent grid T (the model accepts any grid divisible by ``patch``)."""
    latent_height: int = 16
    """Default latent grid H."""
    latent_width: int = 16
    """Default latent grid W."""
    patch: Tuple[int, int, int] = (1, 2, 2)
    """Patch (pt, ph, pw) in latent voxels: one token per patch."""
    hidden: int = 128
    """Transformer hidden size. May differ from heads * head_dim (Megatron's kv_channels)."""
    layers: int = 4
    """Number of transformer layers."""
    heads: int = 4
    """Attention heads."""
    head_dim: int = 32
    """Channels per head (even, >= 6: 3D RoPE splits it into t/h/w bands)."""
    mlp_ratio: float = 4.0
    """MLP hidden size = mlp_ratio * hidden."""
    num_classes: int = 4
    """Class labels 0..num_classes-1; label ``num_classes`` is the null class (classifier-free guidance).
    0 = no class conditioning (then ``text_dim`` must be set)."""
    class_dropout_prob: float = 0.1
    """Fraction of labels replaced by the null class in :func:`flow_matching_loss` (enables CFG)."""
    text_dim: Optional[int] = None
    """Width of text embeddings ``[B, L, text_dim]`` for cross-attention; None = class conditioning only."""
    cube: Tuple[int, int, int] = (2, 4, 4)
    """Token-order cube (t, h, w) in patch tokens when DSV is off; with DSV the query-group shape wins."""
    rope_theta: float = 10000.0
    """Base of the RoPE frequency ladders."""
    qk_layernorm: bool = True
    """LayerNorm on q and k per head (keeps attention logits bounded in long video training)."""
    timestep_sampling: str = "logit_normal"
    """Training t distribution: 'logit_normal' (sigmoid of N(0, 1), SD3) or 'uniform'."""
    frequency_embedding_size: int = 256
    """Width of the sinusoidal timestep features fed to the timestep MLP."""
    layernorm_epsilon: float = 1e-6
    """Epsilon of every LayerNorm."""

    def __post_init__(self):
        self.patch = tuple(int(p) for p in self.patch)
        self.cube = tuple(int(c) for c in self.cube)
        self._validate()

    # ------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VideoDiTConfig":
        """Config of preset ``name`` (one of :data:`PRESETS`) with fields replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown VideoDiTConfig field(s) {unknown}; allowed: {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def latent_grid(self) -> Tuple[int, int, int]:
        """Default latent grid (T, H, W)."""
        return self.latent_frames, self.latent_height, self.latent_width

    @property
    def patch_dim(self) -> int:
        """Values per patch token: C * pt * ph * pw."""
        return self.in_channels * math.prod(self.patch)

    @property
    def ffn_hidden(self) -> int:
        return int(round(self.mlp_ratio * self.hidden))

    def token_grid(self, latent_grid=None) -> Tuple[int, int, int]:
        """Patch-token grid of ``latent_grid`` (default grid when None); ValueError if not divisible."""
        grid = self.latent_grid if latent_grid is None else tuple(int(g) for g in latent_grid)
        for axis, g, p in zip("THW", grid, self.patch):
            if g < 1 or g % p != 0:
                raise ValueError(f"latent grid {axis} = {g} must be a positive multiple of patch {self.patch} "
                                 f"(latents [B, C, T, H, W] with T % {self.patch[0]} == 0, H % {self.patch[1]} == 0, "
                                 f"W % {self.patch[2]} == 0)")
        return tuple(g // p for g, p in zip(grid, self.patch))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------
    def _validate(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                raise ValueError(f"VideoDiTConfig.{name} must be {allowed}, got {getattr(self, name)!r}")

        need(self.in_channels >= 1, "in_channels", ">= 1")
        for name in ("latent_frames", "latent_height", "latent_width", "hidden", "layers", "heads"):
            need(int(getattr(self, name)) >= 1, name, ">= 1")
        need(len(self.patch) == 3 and min(self.patch) >= 1, "patch", "three positive ints (pt, ph, pw)")
        need(len(self.cube) == 3 and min(self.cube) >= 1, "cube", "three positive ints (t, h, w)")
        need(self.head_dim >= 6 and self.head_dim % 2 == 0, "head_dim", "even and >= 6 (3D RoPE bands)")
        need(self.mlp_ratio > 0, "mlp_ratio", "> 0")
        need(self.num_classes >= 0, "num_classes", ">= 0")
        need(0.0 <= self.class_dropout_prob < 1.0, "class_dropout_prob", "in [0, 1)")
        need(self.text_dim is None or self.text_dim >= 1, "text_dim", "None or >= 1")
        need(self.num_classes > 0 or self.text_dim is not None, "num_classes",
             "> 0 when text_dim is None (the model needs some conditioning input)")
        need(self.rope_theta > 1.0, "rope_theta", "> 1")
        need(self.timestep_sampling in TIMESTEP_SAMPLINGS, "timestep_sampling", f"one of {list(TIMESTEP_SAMPLINGS)}")
        need(self.frequency_embedding_size >= 2 and self.frequency_embedding_size % 2 == 0,
             "frequency_embedding_size", "even and >= 2")
        need(self.layernorm_epsilon > 0, "layernorm_epsilon", "> 0")
        self.token_grid()  # the default grid must be divisible by the patch


PRESETS = {
    # CPU demo: 512 tokens for the 8x16x16 default grid.
    "tiny": dict(in_channels=4, latent_frames=8, latent_height=16, latent_width=16, hidden=128, layers=4,
                 heads=2, head_dim=64, num_classes=4),  # head dim 64: the sparse kernels' smallest
    # Paper shapes; 16-channel latents (a video VAE's), 16x64x64 latents -> 16384 tokens.
    "0.8b": dict(in_channels=16, latent_frames=16, latent_height=64, latent_width=64, hidden=1152, layers=28,
                 heads=12, head_dim=96, num_classes=1000),
    "2.7b": dict(in_channels=16, latent_frames=16, latent_height=64, latent_width=64, hidden=2048, layers=32,
                 heads=16, head_dim=128, num_classes=1000),
    "30b": dict(in_channels=16, latent_frames=16, latent_height=64, latent_width=64, hidden=6144, layers=42,
                heads=24, head_dim=256, num_classes=1000),
}


def count_parameters(cfg: VideoDiTConfig) -> int:
    """Parameter count of :class:`VideoDiT` for ``cfg`` (analytic; matches the built model)."""
    h, a, f = cfg.hidden, cfg.heads * cfg.head_dim, cfg.ffn_hidden
    per_layer = (h * 3 * a + 3 * a) + (a * h + h)  # qkv + proj
    per_layer += (h * f + f) + (f * h + h)  # mlp
    per_layer += h * 6 * h + 6 * h  # adaLN modulation
    per_layer += 2 * 2 * h  # two LayerNorms (Megatron's norms carry an affine; see dit_layer)
    if cfg.qk_layernorm:
        per_layer += 2 * 2 * cfg.head_dim
    if cfg.text_dim is not None:
        per_layer += (h * a + a) + (h * 2 * a + 2 * a) + (a * h + h) + 2 * h  # q, kv, proj, pre-norm
    embed = cfg.patch_dim * h + h
    embed += cfg.frequency_embedding_size * h + h + h * h + h  # timestep MLP
    if cfg.num_classes > 0:
        embed += (cfg.num_classes + 1) * h
    if cfg.text_dim is not None:
        embed += cfg.text_dim * h + h
    final = h * 2 * h + 2 * h + h * cfg.patch_dim + cfg.patch_dim
    return cfg.layers * per_layer + embed + final


def _check_dtype(dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype}")
    return dtype


def _query_cube(dsv_config, cube):
    """The query cube a model builder groups tokens by: ``dsv_config.query_group_shape``, or the model config's
    ``cube`` without DSV; ``dsv_config`` must be a DSVConfig or None."""
    if dsv_config is None:
        return cube
    from megatron_dsv.config import DSVConfig

    if not isinstance(dsv_config, DSVConfig):
        raise ValueError(f"dsv_config must be a DSVConfig or None, got {type(dsv_config).__name__}")
    return dsv_config.query_group_shape

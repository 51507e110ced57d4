"""WanConfig: the shape of a Wan2.1 text-to-video transformer, in diffusers' own field names.

The fields and defaults are those of diffusers' ``WanTransformer3DModel`` config (a converted
checkpoint's ``transformer/config.json`` reads straight into :meth:`WanConfig.from_diffusers`);
``cube``, ``rope_theta`` and the default latent grid are ours. The presets are the published
Wan2.1 text-to-video shapes as diffusers' conversion script (``scripts/convert_wan_to_diffusers.py``,
``Wan-T2V-1.3B`` / ``Wan-T2V-14B``) writes them into ``Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["WanConfig", "WAN_PRESETS", "DIFFUSERS_CLASS"]

DIFFUSERS_CLASS = "WanTransformer3DModel"

# diffusers config keys that describe the image-to-video branch (CLIP image tokens); they must be null.
_I2V_KEYS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
# diffusers bookkeeping keys: read and dropped.
_META_KEYS = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")


@dataclass
class WanConfig:
    """Wan2.1 transformer shape. Hidden size = ``num_attention_heads * attention_head_dim``."""

    patch_size: Tuple[int, int, int] = (1, 2, 2)
    """Patch (pt, ph, pw) in latent voxels (diffusers ``patch_size``)."""
    num_attention_heads: int = 40
    """Attention heads (self and cross)."""
    attention_head_dim: int = 128
    """Channels per head."""
    in_channels: int = 16
    """Latent channels in (the Wan VAE's 16)."""
    out_channels: int = 16
    """Latent channels out (the velocity)."""
    text_dim: int = 4096
    """Width of the text encoder's embeddings (umT5-XXL: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep features."""
    ffn_dim: int = 13824
    """MLP hidden size."""
    num_layers: int = 40
    """Transformer layers."""
    cross_attn_norm: bool = True
    """Affine LayerNorm on the hidden states before cross-attention (diffusers ``norm2``)."""
    qk_norm: Optional[str] = "rms_norm_across_heads"
    """Kept for the round trip: diffusers' WanAttention always has q/k RMSNorm over all heads' channels
    (``hidden`` wide, not per head), whatever this says, and so does this model."""
    eps: float = 1e-6
    """Epsilon of every norm (LayerNorms and the q/k RMSNorms)."""
    rope_max_seq_len: int = 1024
    """Largest token-grid side diffusers' RoPE tables cover (a longer side is refused, as diffusers fails)."""
    image_dim: Optional[int] = None
    """Image-to-video only (CLIP image embeddings): must be None here."""
    added_kv_proj_dim: Optional[int] = None
    """Image-to-video only: must be None here."""
    pos_embed_seq_len: Optional[int] = None
    """Image-to-video (FLF2V) only: must be None here."""
    # --- ours, not diffusers' ---
    cube: Tuple[int, int, int] = (2, 4, 4)
    """Token-order cube (t, h, w) in patch tokens when DSV is off; with DSV the query-group shape wins."""
    rope_theta: float = 10000.0
    """RoPE base (diffusers' WanRotaryPosEmbed uses 10000)."""
    latent_grid: Tuple[int, int, int] = (21, 60, 104)
    """Default latent grid (T, H, W): Wan's 81 frames x 480 x 832 through its VAE (stride 4, 8, 8)."""

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        self.cube = tuple(int(c) for c in self.cube)
        self.latent_grid = tuple(int(g) for g in self.latent_grid)
        self._validate()

    @property
    def hidden(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def out_dim(self) -> int:
        """Width of the output projection: ``pt * ph * pw * out_channels`` (that order)."""
        return self.out_channels * math.prod(self.patch_size)

    def token_grid(self, latent_grid=None) -> Tuple[int, int, int]:
        """Patch-token grid of ``latent_grid`` (default grid when None); ValueError if not divisible."""
        grid = self.latent_grid if latent_grid is None else tuple(int(g) for g in latent_grid)
        for axis, g, p in zip("THW", grid, self.patch_size):
            if g < 1 or g % p != 0:
                raise ValueError(f"latent grid {axis} = {g} must be a positive multiple of patch_size "
                                 f"{self.patch_size} (latents [B, C, T, H, W])")
        tokens = tuple(g // p for g, p in zip(grid, self.patch_size))
        if max(tokens) > self.rope_max_seq_len:
            raise ValueError(f"token grid {tokens} has a side longer than rope_max_seq_len = {self.rope_max_seq_len}")
        return tokens

    # ------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "WanConfig":
        """Config of preset ``name`` (one of :data:`WAN_PRESETS`) with fields replaced by ``overrides``."""
        if name not in WAN_PRESETS:
            raise ValueError(f"preset must be one of {sorted(WAN_PRESETS)}, got {name!r}")
        _check_fields(overrides, "override")
        return cls(**{**WAN_PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: dict, **ours) -> "WanConfig":
        """From a diffusers ``WanTransformer3DModel`` config dict (``config.json``); ``ours`` sets
        ``cube`` / ``rope_theta`` / ``latent_grid``. Unknown keys and image-to-video keys raise."""
        cls_name = config.get("_class_name", DIFFUSERS_CLASS)
        if cls_name != DIFFUSERS_CLASS:
            raise ValueError(f"config _class_name must be {DIFFUSERS_CLASS!r}, got {cls_name!r}")
        values = {k: v for k, v in config.items() if k not in _META_KEYS}
        i2v = [k for k in _I2V_KEYS if values.get(k) is not None]
        if i2v:
            raise ValueError(f"config keys {i2v} are set: an image-to-video Wan model; only text-to-video "
                             "(all of image_dim, added_kv_proj_dim, pos_embed_seq_len null) is supported")
        diffusers_fields = {f.name for f in dataclasses.fields(cls)} - set(_OURS)
        unknown = sorted(set(values) - diffusers_fields)
        if unknown:
            raise ValueError(f"config has keys WanConfig does not know: {unknown}; known: {sorted(diffusers_fields)}")
        _check_fields(ours, "argument")
        return cls(**values, **ours)

    def to_diffusers(self) -> dict:
        """The diffusers ``config.json`` dict of this shape (``WanTransformer3DModel.from_config`` takes it)."""
        out = {"_class_name": DIFFUSERS_CLASS}
        for f in dataclasses.fields(self):
            if f.name not in _OURS:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------
    def _validate(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                raise ValueError(f"WanConfig.{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("num_attention_heads", "in_channels", "out_channels", "text_dim", "ffn_dim", "num_layers"):
            need(int(getattr(self, name)) >= 1, name, ">= 1")
        need(self.attention_head_dim >= 6 and self.attention_head_dim % 2 == 0, "attention_head_dim",
             "even and >= 6 (3D RoPE: two channels per axis at least)")
        need(self.freq_dim >= 2 and self.freq_dim % 2 == 0, "freq_dim", "even and >= 2")
        need(len(self.patch_size) == 3 and min(self.patch_size) >= 1, "patch_size", "three positive ints")
        need(len(self.cube) == 3 and min(self.cube) >= 1, "cube", "three positive ints (t, h, w)")
        need(len(self.latent_grid) == 3, "latent_grid", "three positive ints (T, H, W)")
        need(self.eps > 0, "eps", "> 0")
        need(self.rope_theta > 1.0, "rope_theta", "> 1")
        need(self.rope_max_seq_len >= 1, "rope_max_seq_len", ">= 1")
        for name in _I2V_KEYS:
            need(getattr(self, name) is None, name, "None (image-to-video is not supported)")
        self.token_grid()


_OURS = ("cube", "rope_theta", "latent_grid")


def _check_fields(values: dict, what: str) -> None:
    fields = {f.name for f in dataclasses.fields(WanConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown WanConfig {what}(s) {unknown}; allowed: {sorted(fields)}")


WAN_PRESETS = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: hidden 1536.
    "wan2.1-t2v-1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                            in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, eps=1e-6),
    # Wan-AI/Wan2.1-T2V-14B-Diffusers: hidden 5120 (diffusers' defaults).
    "wan2.1-t2v-14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40,
                           in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, eps=1e-6),
}

"""Synthetic videos: moving, rotating, coloured shapes with class labels (no downloads).

Each sample is one shape on a background: a soft two-colour gradient (``background="gradient"``,
the default) or a two-colour procedural texture the camera pans across (``"texture"``: a sum of
oriented sinusoids with wavelengths of 1/16 to 1/4 of the frame, drifting at a constant velocity
per video, so, as in real footage, a patch is predicted by its neighbours and by the matching
patch of the previous frame rather than by the frame's average). The class picks the
shape and the motion: ``shape = SHAPES[label % 4]``, ``motion = MOTIONS[label // 4]``
(so ``num_classes <= 8``; with 4 classes the class is the shape and the motion is "bounce").
Position, size, colour, speed, direction and spin are drawn from a generator seeded by
``(seed, index)``: ``ds[i]`` is the same tensor on every machine and every call.

The "latents" are **pixel-space** (no VAE): frames are rendered at 2x the requested
``H x W`` and box-filtered down (anti-aliasing), as channels R, G, B and the shape's mask,
mapped from [0, 1] to [-1, 1]. Channel counts: 1 = luminance, 2 = luminance + mask,
3 = RGB, 4 = RGB + mask, C > 4 = RGB + mask + (C - 4) fixed linear mixes of those four.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["SyntheticVideoDataset", "SHAPES", "MOTIONS", "BACKGROUNDS", "render_video"]

SHAPES = ("pacman", "square", "triangle", "cross")
MOTIONS = ("bounce", "orbit")
BACKGROUNDS = ("gradient", "texture")
_TEXTURE_WAVES = 6
_SUPERSAMPLE = 2


def _hsv_to_rgb(h: float, s: float, v: float) -> torch.Tensor:
    k = (torch.tensor([5.0, 3.0, 1.0]) + h * 6.0) % 6.0
    return v - v * s * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)


def _inside(shape: str, u: torch.Tensor, v: torch.Tensor, r: float) -> torch.Tensor:
    """Soft-free boolean occupancy of ``shape`` of radius r in shape-local coordinates (u, v)."""
    if shape == "pacman":  # a disc with a 60-degree mouth, so rotation is visible
        ang = torch.atan2(v, u)
        return (u * u + v * v <= r * r) & (ang.abs() > math.pi / 6)
    if shape == "square":
        return torch.maximum(u.abs(), v.abs()) <= 0.8 * r
    if shape == "triangle":  # equilateral, circumradius r, three half-planes
        inside = torch.ones_like(u, dtype=torch.bool)
        for k in range(3):
            a = math.pi / 2 + k * 2 * math.pi / 3
            inside &= (u * math.cos(a) + v * math.sin(a)) >= -r / 2
        return inside
    if shape == "cross":
        arm = 0.3 * r
        return ((u.abs() <= arm) & (v.abs() <= r)) | ((v.abs() <= arm) & (u.abs() <= r))
    raise ValueError(f"shape must be one of {list(SHAPES)}, got {shape!r}")


def _trajectory(motion: str, g: torch.Generator, frames: int, radius: float):
    """Centre (x, y) per frame in [0, 1]^2 and the spin per frame (radians)."""
    u = torch.rand(6, generator=g)
    t = torch.arange(frames, dtype=torch.float32)
    if motion == "bounce":
        lo, hi = radius, 1.0 - radius
        start = lo + (hi - lo) * u[:2]
        ang = 2 * math.pi * u[2]
        speed = 0.04 + 0.05 * u[3]
        raw = start[None, :] - lo + t[:, None] * speed * torch.stack([torch.cos(ang), torch.sin(ang)])[None, :]
        span = hi - lo
        pos = lo + span - (raw % (2 * span) - span).abs()  # reflect off the walls (triangle wave)
        spin = (0.05 + 0.1 * u[4]) * (1 if u[5] > 0.5 else -1)
    elif motion == "orbit":
        orbit_r = 0.12 + 0.1 * u[0]
        centre = 0.5 + (u[1:3] - 0.5) * 0.1
        phase = 2 * math.pi * u[3] + t * (0.25 + 0.2 * u[4]) * (1 if u[5] > 0.5 else -1)
        pos = centre[None, :] + orbit_r * torch.stack([torch.cos(phase), torch.sin(phase)], dim=1)
        spin = 0.3 * (1 if u[5] > 0.5 else -1)
    else:
        raise ValueError(f"motion must be one of {list(MOTIONS)}, got {motion!r}")
    return pos, spin


def _texture(xx: torch.Tensor, yy: torch.Tensor, g: torch.Generator, frames: int) -> torch.Tensor:
    """Blend weight in [0, 1], ``[T, H, W]``: sinusoids of random orientation, wavelength (1/16 to
    1/4 of the frame) and phase, shifted by a pan of 0.5-1.5% of the frame per frame."""
    u = torch.rand(5, _TEXTURE_WAVES, generator=g)
    theta = 2 * math.pi * u[0]
    freq = 2 * math.pi * (4.0 + 12.0 * u[1])  # cycles per frame width: 4 to 16
    phase, amp = 2 * math.pi * u[2], 0.5 + u[3]
    pan_dir = 2 * math.pi * float(u[4, 0])
    speed = 0.005 + 0.01 * float(u[4, 1])
    t = torch.arange(frames, dtype=torch.float32)[:, None, None]
    px, py = xx[None] + t * speed * math.cos(pan_dir), yy[None] + t * speed * math.sin(pan_dir)
    field = sum(amp[i] * torch.sin(freq[i] * (px * torch.cos(theta[i]) + py * torch.sin(theta[i])) + phase[i])
                for i in range(_TEXTURE_WAVES))
    return torch.sigmoid(2.0 * field / float(amp.sum()) * math.sqrt(_TEXTURE_WAVES))


def _check_background(background: str) -> None:
    if background not in BACKGROUNDS:
        raise ValueError(f"background must be one of {list(BACKGROUNDS)}, got {background!r}")


def render_video(label: int, frames: int, height: int, width: int, g: torch.Generator,
                 background: str = "gradient") -> torch.Tensor:
    """RGB + mask video ``[4, T, H, W]`` in [0, 1] for class ``label``, randomness from ``g``."""
    _check_background(background)
    shape, motion = SHAPES[label % len(SHAPES)], MOTIONS[label // len(SHAPES)]
    H, W = height * _SUPERSAMPLE, width * _SUPERSAMPLE
    radius = 0.14 + 0.08 * float(torch.rand((), generator=g))
    hue, bg_hue, angle0 = (float(x) for x in torch.rand(3, generator=g))
    fg = _hsv_to_rgb(hue, 0.85, 0.95)
    bg0, bg1 = _hsv_to_rgb(bg_hue, 0.5, 0.25), _hsv_to_rgb((bg_hue + 0.3) % 1.0, 0.5, 0.4)
    pos, spin = _trajectory(motion, g, frames, radius)
    ys = (torch.arange(H, dtype=torch.float32) + 0.5) / H
    xs = (torch.arange(W, dtype=torch.float32) + 0.5) / W
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    if background == "texture":
        blend = _texture(xx, yy, g, frames)[None]  # [1, T, H, W]
    else:
        blend = ((xx + yy) / 2)[None, None].expand(1, frames, H, W)  # diagonal gradient
    back = bg0[:, None, None, None] * (1 - blend) + bg1[:, None, None, None] * blend  # [3, T, H, W]
    out = torch.empty(4, frames, H, W)
    for f in range(frames):
        a = 2 * math.pi * angle0 + spin * f
        dx, dy = xx - pos[f, 0], yy - pos[f, 1]
        u = dx * math.cos(a) + dy * math.sin(a)  # rotate the frame into shape coordinates
        v = -dx * math.sin(a) + dy * math.cos(a)
        mask = _inside(shape, u, v, radius).float()
        out[:3, f] = back[:, f] * (1 - mask) + fg[:, None, None] * mask
        out[3, f] = mask
    return F.avg_pool3d(out, kernel_size=(1, _SUPERSAMPLE, _SUPERSAMPLE))


def _to_channels(rgbm: torch.Tensor, channels: int) -> torch.Tensor:
    lum = (0.299 * rgbm[0] + 0.587 * rgbm[1] + 0.114 * rgbm[2])[None]
    if channels == 1:
        return lum
    if channels == 2:
        return torch.cat([lum, rgbm[3:4]])
    if channels == 3:
        return rgbm[:3]
    if channels == 4:
        return rgbm
    # Fixed mixing matrix (not seed-dependent): extra channels are the same function of the video everywhere.
    mix = torch.rand(channels - 4, 4, generator=torch.Generator().manual_seed(12345))
    mix = mix / mix.sum(dim=1, keepdim=True)
    return torch.cat([rgbm, torch.einsum("kc,cthw->kthw", mix, rgbm)])


class SyntheticVideoDataset(Dataset):
    """Procedural shape videos; ``ds[i] = {"latents": float32 [C, T, H, W] in [-1, 1], "label": int64 []}``."""

    def __init__(self, num_samples: int, channels: int = 4, frames: int = 8, height: int = 16, width: int = 16,
                 num_classes: int = 4, seed: int = 0, background: str = "gradient"):
        for name, value, low in (("num_samples", num_samples, 1), ("channels", channels, 1), ("frames", frames, 1),
                                 ("height", height, 4), ("width", width, 4)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        max_classes = len(SHAPES) * len(MOTIONS)
        if not isinstance(num_classes, int) or not 1 <= num_classes <= max_classes:
            raise ValueError(f"num_classes must be an int in [1, {max_classes}] (shape x motion), got {num_classes!r}")
        _check_background(background)  # at construction, not at the first sample
        self.num_samples, self.channels, self.num_classes, self.seed = num_samples, channels, num_classes, int(seed)
        self.background = background
        self.frames, self.height, self.width = frames, height, width

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        # Per-sample generator: the sample does not depend on which worker or in what order it is drawn.
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2 ** 63))
        label = int(torch.randint(self.num_classes, (), generator=g))
        rgbm = render_video(label, self.frames, self.height, self.width, g, self.background)
        latents = _to_channels(rgbm, self.channels) * 2.0 - 1.0
        return {"latents": latents.contiguous(), "label": torch.tensor(label, dtype=torch.long)}

"""Sampling from a trained VideoDiT: Euler integration of the flow, and GIF / PNG grid writers.

The model predicts ``v = noise - x0`` along ``x_t = (1 - t) x0 + t noise``
(:func:`megatron_dsv.models.video_dit.flow_matching_loss`), so sampling starts from noise
at t = 1 and steps ``x <- x + (t_next - t) * v`` down to t = 0. With ``cfg_scale != 1``
each step also runs the null class and uses ``v_null + cfg_scale * (v_cond - v_null)``.
DSV attention runs as it was trained (its stage and predictors live in the model state).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["sample_videos", "write_gif_and_grid", "latents_to_uint8"]


@torch.no_grad()
def sample_videos(model, labels: torch.Tensor, grid: Optional[Sequence[int]] = None, steps: int = 25,
                  generator: Optional[torch.Generator] = None, text: Optional[torch.Tensor] = None,
                  text_mask: Optional[torch.Tensor] = None, cfg_scale: float = 1.0) -> torch.Tensor:
    """Generate latents ``[B, C, T, H, W]`` (float32) for ``labels`` ``[B]`` with an Euler flow sampler.

    Args:
        model: a VideoDiT (or a Megatron wrapper of one); put in eval mode for the call.
        labels: ``[B]`` long class labels (the null class ``num_classes`` is allowed).
        grid: latent grid (T, H, W); default the model's ``VideoDiTConfig.latent_grid``.
        steps: Euler steps (>= 1).
        generator: source of the initial noise (on its own device).
        text, text_mask: text conditioning for models with cross-attention.
        cfg_scale: classifier-free guidance scale (1 = off; needs class conditioning).
    """
    from megatron_dsv.models.video_dit import unwrap_video_dit

    dit = unwrap_video_dit(model)
    dc = dit.dit_config
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if labels.dim() != 1 or labels.dtype != torch.long:
        raise ValueError(f"labels must be a long tensor [B], got {labels.dtype} {tuple(labels.shape)}")
    if cfg_scale != 1.0 and dc.num_classes == 0:
        raise ValueError("cfg_scale != 1 needs class conditioning (VideoDiTConfig.num_classes > 0)")
    grid = dc.latent_grid if grid is None else tuple(int(g) for g in grid)
    dc.token_grid(grid)  # ValueError when the grid does not fit the patch
    device = next(dit.parameters()).device
    dtype = next(dit.parameters()).dtype
    B = labels.shape[0]
    gdev = generator.device if generator is not None else device
    x = torch.randn((B, dc.in_channels, *grid), generator=generator, device=gdev, dtype=torch.float32).to(device)
    labels = labels.to(device)
    null = torch.full_like(labels, dc.num_classes)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=device)
    was_training = model.training
    model.eval()
    try:
        for i in range(steps):
            t = ts[i].expand(B)
            v = model(x.to(dtype), t, labels, text=text, text_mask=text_mask).float()
            if cfg_scale != 1.0:
                v_null = model(x.to(dtype), t, null, text=text, text_mask=text_mask).float()
                v = v_null + cfg_scale * (v - v_null)
            x = x + (ts[i + 1] - ts[i]) * v
    finally:
        model.train(was_training)
    return x


def latents_to_uint8(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, T, H, W]`` in ~[-1, 1] -> uint8 ``[B, T, H, W, 3]``: channels 0-2 as RGB (C >= 3), else grey."""
    if latents.dim() != 5:
        raise ValueError(f"latents must be [B, C, T, H, W], got {tuple(latents.shape)}")
    x = latents.detach().float().cpu()
    rgb = x[:, :3] if x.shape[1] >= 3 else x[:, :1].expand(-1, 3, -1, -1, -1)
    rgb = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return rgb.permute(0, 2, 3, 4, 1).contiguous()


def _upscale(frames: torch.Tensor, min_side: int) -> torch.Tensor:
    # Nearest-neighbour enlargement so 16x16 latents are visible; integer factor keeps pixels square.
    h, w = frames.shape[-3], frames.shape[-2]
    k = max(1, -(-min_side // min(h, w)))
    return frames.repeat_interleave(k, dim=-3).repeat_interleave(k, dim=-2)


def write_gif_and_grid(latents: torch.Tensor, path_prefix: str, fps: int = 8, min_side: int = 64,
                       pad: int = 2) -> Tuple[str, str]:
    """Write ``<prefix>.gif`` (the B videos side by side, animated) and ``<prefix>.png``
    (grid: one row per video, one column per frame). Returns the two paths."""
    from PIL import Image

    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    videos = _upscale(latents_to_uint8(latents), min_side)  # [B, T, H, W, 3]
    B, T, H, W, _ = videos.shape
    parent = os.path.dirname(os.path.abspath(path_prefix))
    os.makedirs(parent, exist_ok=True)

    strip = torch.zeros(T, H, B * (W + pad) - pad, 3, dtype=torch.uint8)
    for b in range(B):
        strip[:, :, b * (W + pad):b * (W + pad) + W] = videos[b]
    images = [Image.fromarray(strip[t].numpy()) for t in range(T)]
    gif_path = f"{path_prefix}.gif"
    images[0].save(gif_path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)

    grid = torch.zeros(B * (H + pad) - pad, T * (W + pad) - pad, 3, dtype=torch.uint8)
    for b in range(B):
        for t in range(T):
            grid[b * (H + pad):b * (H + pad) + H, t * (W + pad):t * (W + pad) + W] = videos[b, t]
    png_path = f"{path_prefix}.png"
    Image.fromarray(grid.numpy()).save(png_path)
    return gif_path, png_path

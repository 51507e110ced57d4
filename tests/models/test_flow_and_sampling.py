"""Flow-matching training on the tiny preset, and the Euler sampler + GIF/PNG writer."""

import os

import pytest
import torch

from megatron_dsv.data import SyntheticVideoDataset
from megatron_dsv.models.sampling import sample_videos, write_gif_and_grid
from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit, flow_matching_loss


def _eval_loss(model, x, y, seed=123):
    # Same noise and t every time: a fixed yardstick for the same model before/after training.
    model.eval()
    with torch.no_grad():
        loss = flow_matching_loss(model, x, y, generator=torch.Generator().manual_seed(seed))
    model.train()
    return float(loss)


def test_tiny_loss_decreases_with_adam(megatron_cpu):
    torch.manual_seed(0)
    cfg = VideoDiTConfig.from_preset("tiny")
    # on the CPU wherever it runs (the builders put the model on the GPU where there is one), since the noise
    # comes from a CPU generator
    model = build_video_dit(cfg, use_te=False).cpu()
    ds = SyntheticVideoDataset(4, channels=cfg.in_channels, frames=cfg.latent_frames, height=cfg.latent_height,
                               width=cfg.latent_width, num_classes=cfg.num_classes, seed=0)
    x = torch.stack([ds[i]["latents"] for i in range(4)])
    y = torch.stack([ds[i]["label"] for i in range(4)])
    before = _eval_loss(model, x, y)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        loss = flow_matching_loss(model, x, y, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    after = _eval_loss(model, x, y)
    assert after < 0.8 * before, (before, after)


def test_flow_matching_loss_deterministic_and_target(megatron_cpu):
    cfg = VideoDiTConfig.from_preset("tiny", layers=1, latent_frames=2, latent_height=8, latent_width=8)
    model = build_video_dit(cfg, use_te=False, use_cpu_initialization=True)  # CPU test, on a GPU host too
    x = torch.randn(3, 4, 2, 8, 8)
    y = torch.tensor([0, 1, 2])
    a = flow_matching_loss(model, x, y, generator=torch.Generator().manual_seed(5))
    b = flow_matching_loss(model, x, y, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    # adaLN-Zero init predicts v = 0, so the loss is E|noise - x0|^2 = 1 + E x0^2 (uniform or logit-normal t)
    big = torch.zeros(64, 4, 2, 8, 8)
    loss = flow_matching_loss(model, big, torch.zeros(64, dtype=torch.long), generator=torch.Generator().manual_seed(0),
                              timestep_sampling="uniform")
    assert abs(loss.item() - 1.0) < 0.02


def test_sampler_shapes_and_files(megatron_cpu, tmp_path):
    cfg = VideoDiTConfig.from_preset("tiny", layers=1, latent_frames=4, latent_height=8, latent_width=8)
    model = build_video_dit(cfg, use_te=False)
    with torch.no_grad():
        model.final_linear.weight.normal_(std=0.05)
    labels = torch.tensor([0, 1, 3])
    out = sample_videos(model, labels, grid=(2, 8, 12), steps=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 4, 2, 8, 12) and out.dtype == torch.float32 and torch.isfinite(out).all()
    again = sample_videos(model, labels, grid=(2, 8, 12), steps=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    guided = sample_videos(model, labels, steps=2, generator=torch.Generator().manual_seed(0), cfg_scale=3.0)
    assert guided.shape == (3, 4, 4, 8, 8)
    assert model.training  # the sampler restores the mode it found
    gif, png = write_gif_and_grid(out, str(tmp_path / "sub" / "samples"))
    from PIL import Image

    with Image.open(gif) as im:
        assert im.n_frames == 2 and im.size[1] >= 64
    with Image.open(png) as im:
        # columns = 2 frames, rows = 3 videos; 8x12 latents upscaled x8 to 64x96, 2-pixel gaps
        assert im.size == (2 * 96 + 2, 3 * 64 + 2 * 2)
    with pytest.raises(ValueError, match="steps"):
        sample_videos(model, labels, steps=0)
    with pytest.raises(ValueError, match="latent grid"):
        sample_videos(model, labels, grid=(2, 7, 8), steps=1)
    with pytest.raises(ValueError, match="labels"):
        sample_videos(model, labels.float(), steps=1)
    assert os.path.getsize(gif) > 0 and os.path.getsize(png) > 0


def test_gif_grid_channel_counts(tmp_path):
    for c in (1, 2, 3, 4):
        gif, png = write_gif_and_grid(torch.rand(2, c, 3, 16, 16) * 2 - 1, str(tmp_path / f"c{c}"))
        assert os.path.exists(gif) and os.path.exists(png)
    with pytest.raises(ValueError, match="latents"):
        write_gif_and_grid(torch.rand(2, 3, 16, 16), str(tmp_path / "bad"))

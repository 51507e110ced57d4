"""Rendered game videos (ViZDoom, ALE): determinism, the DCT downsampler, shards, clear errors.

The renderers come with the ``[test]`` / ``[video]`` extras; without them these tests skip, saying so.
"""

import builtins
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_dsv.data import LatentShardDataset
from megatron_dsv.data.rendered import (SOURCES, RenderedVideoDataset, decode_video, encode_video, render_clip,
                                        write_rendered_shards)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


RENDERERS = [pytest.param("vizdoom", marks=pytest.mark.skipif(not _have("vizdoom"), reason="vizdoom not installed "
                                                                "(pip install -e '.[video]')")),
             pytest.param("ale", marks=pytest.mark.skipif(not _have("ale_py"), reason="ale-py not installed "
                                                          "(pip install -e '.[video]')"))]


@pytest.mark.parametrize("source", RENDERERS)
def test_clips_are_deterministic_real_footage(source):
    a = render_clip(source, 3, frames=6, height=48, width=64, seed=1)
    assert a.shape == (6, 48, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, render_clip(source, 3, frames=6, height=48, width=64, seed=1))
    other = render_clip(source, 3, frames=6, height=48, width=64, seed=2)  # same scenario, another seed
    assert not np.array_equal(a, other)
    assert a.std() > 5.0  # not a blank screen


@pytest.mark.parametrize("source", RENDERERS)
def test_dataset_labels_and_normalisation(source):
    ds = RenderedVideoDataset(source, 9, frames=4, height=32, width=32, channels=16)
    item = ds[8]
    assert item["latents"].shape == (16, 4, 8, 8) and int(item["label"]) == 8 % len(SOURCES[source])
    calib = torch.stack([ds[i]["latents"] for i in range(8)])  # the calibration clips: unit variance
    assert torch.allclose(calib.std(dim=(0, 2, 3, 4)), torch.ones(16), atol=1e-3)
    fresh = RenderedVideoDataset(source, 9, frames=4, height=32, width=32, channels=16)
    assert torch.equal(fresh[8]["latents"], item["latents"])
    with pytest.raises(IndexError):
        ds[9]


def test_dct_downsampler_is_exact_on_block_constant_frames_and_close_on_texture():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 6, 3), generator=g, dtype=torch.uint8)
    frames = blocks.repeat_interleave(4, 1).repeat_interleave(4, 2).numpy()  # constant 4x4 blocks: DC only
    lat = encode_video(frames, channels=16, factor=4)
    assert lat.shape == (16, 3, 5, 6)
    back = decode_video(lat, factor=4)
    assert np.abs(back.astype(int) - frames.astype(int)).max() <= 1  # colour transform rounding only
    assert lat[1:10].abs().max() < 1e-4  # luma AC channels of a block-constant frame are zero
    smooth = (127 + 100 * np.sin(np.arange(32)[:, None, None] / 5.0 + np.arange(32)[None, :, None] / 7.0))
    smooth = np.broadcast_to(smooth, (32, 32, 3)).astype(np.uint8)[None].repeat(2, 0)
    err = decode_video(encode_video(smooth)).astype(float) - smooth
    assert 10 * np.log10(255 ** 2 / (err ** 2).mean()) > 35.0  # low frequencies are kept


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="frames must be uint8"):
        encode_video(np.zeros((2, 8, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="multiples of factor"):
        encode_video(np.zeros((2, 10, 8, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="channels must be"):
        encode_video(np.zeros((2, 8, 8, 3), dtype=np.uint8), channels=64)
    with pytest.raises(ValueError, match="source must be one of"):
        render_clip("atari2600", 0)


def test_missing_renderer_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_vizdoom(name, *args, **kwargs):
        if name == "vizdoom":
            raise ImportError("No module named 'vizdoom'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vizdoom)
    with pytest.raises(ImportError, match=r"\.\[video\]"):
        render_clip("vizdoom", 0)


@pytest.mark.parametrize("source", RENDERERS[:1])
def test_shards_round_trip_and_truncated_shard(source, tmp_path):
    ds = RenderedVideoDataset(source, 5, frames=4, height=32, width=32, channels=4)
    paths = write_rendered_shards(str(tmp_path), ds, shard_size=2, raw_frames=True, progress=False)
    assert [os.path.basename(p) for p in paths] == [f"shard_{i:05d}.safetensors" for i in range(3)]
    read = LatentShardDataset(str(tmp_path))
    assert len(read) == 5 and read.sample_shape == (4, 4, 8, 8)
    for i in range(5):
        assert torch.allclose(read[i]["latents"], ds[i]["latents"], atol=2e-3, rtol=1e-3)  # fp16 on disk
        assert int(read[i]["label"]) == int(ds[i]["label"])
    frames = np.load(tmp_path / "frames" / "shard_00002.npy", allow_pickle=False)
    assert frames.shape == (1, 4, 32, 32, 3) and np.array_equal(frames[0], ds.frames(4))
    data = (tmp_path / "shard_00001.safetensors").read_bytes()
    (tmp_path / "shard_00001.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="shard_00001.safetensors"):
        LatentShardDataset(str(tmp_path))


@pytest.mark.skipif(not _have("ale_py"), reason="ale-py not installed (pip install -e '.[video]')")
@pytest.mark.timeout(300)
def test_render_tool_writes_shards_the_trainer_reads(tmp_path):
    out = tmp_path / "ale"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "render_videos.py"), "--source", "ale", "--samples", "3",
           "--frames", "4", "--size", "32", "--channels", "4", "--workers", "2", "--gif", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "preview.gif").stat().st_size > 0 and (out / "render_info.json").exists()
    ds = LatentShardDataset(str(out))
    assert len(ds) == 3 and ds.sample_shape == (4, 4, 8, 8)

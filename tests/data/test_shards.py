"""LatentShardDataset round trips (safetensors, npy), corrupt / inconsistent shards, the shard tool."""

import os

import numpy as np
import pytest
import torch

from megatron_dsv.data import LatentShardDataset, SyntheticVideoDataset, write_shard


def test_safetensors_roundtrip(tmp_path):
    a, b = torch.randn(3, 4, 2, 8, 8), torch.randn(2, 4, 2, 8, 8)
    write_shard(str(tmp_path / "s0.safetensors"), a, labels=torch.tensor([1, 2, 3]))
    write_shard(str(tmp_path / "s1.safetensors"), b, labels=torch.tensor([4, 5]))
    ds = LatentShardDataset(str(tmp_path))
    assert len(ds) == 5 and ds.sample_shape == (4, 2, 8, 8) and not ds.has_text
    for i, (x, y) in enumerate([(a[0], 1), (a[1], 2), (a[2], 3), (b[0], 4), (b[1], 5)]):
        item = ds[i]
        assert torch.equal(item["latents"], x) and int(item["label"]) == y and item["label"].dtype == torch.int64
    assert not list(tmp_path.glob("*.tmp"))


def test_text_and_npy_shards(tmp_path):
    lat, text = np.random.rand(2, 3, 1, 4, 4).astype(np.float16), np.random.rand(2, 5, 7).astype(np.float32)
    np.save(tmp_path / "v.npy", lat)
    np.save(tmp_path / "v.text.npy", text)
    np.save(tmp_path / "v.text_mask.npy", np.array([[1, 1, 0, 0, 0], [1] * 5], dtype=bool))
    ds = LatentShardDataset(str(tmp_path))
    assert len(ds) == 2 and ds.has_text
    item = ds[1]
    assert item["latents"].dtype == torch.float32 and torch.equal(item["latents"], torch.from_numpy(lat[1]).float())
    assert torch.equal(item["text"], torch.from_numpy(text[1])) and item["text_mask"].all()
    assert int(item["label"]) == 0  # no labels -> 0


def test_corrupt_shard_clear_error(tmp_path):
    write_shard(str(tmp_path / "a.safetensors"), torch.randn(2, 4, 1, 4, 4))
    (tmp_path / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="b.safetensors.*corrupt"):
        LatentShardDataset(str(tmp_path))
    os.remove(tmp_path / "b.safetensors")
    (tmp_path / "c.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="c.npy"):
        LatentShardDataset(str(tmp_path))


def test_inconsistent_and_bad_shards(tmp_path):
    write_shard(str(tmp_path / "a.safetensors"), torch.randn(2, 4, 1, 4, 4))
    write_shard(str(tmp_path / "b.safetensors"), torch.randn(2, 3, 1, 4, 4))
    with pytest.raises(ValueError, match="disagree on 'latents'"):
        LatentShardDataset(str(tmp_path))
    with pytest.raises(ValueError, match="rows"):
        write_shard(str(tmp_path / "c.safetensors"), torch.randn(2, 4, 1, 4, 4), labels=torch.tensor([1]))
    from safetensors.torch import save_file

    other = tmp_path / "other"
    other.mkdir()
    save_file({"latents": torch.randn(2, 4, 4)}, str(other / "x.safetensors"))
    with pytest.raises(ValueError, match=r"\[N, C, T, H, W\]"):
        LatentShardDataset(str(other))
    with pytest.raises(ValueError, match="no .safetensors"):
        LatentShardDataset(str(_empty(tmp_path)))
    with pytest.raises(ValueError, match="folder"):
        LatentShardDataset(str(tmp_path / "missing"))


def _empty(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    return path


def test_make_latent_shards_tool(tmp_path, capsys):
    from PIL import Image

    from tools.make_latent_shards import main

    src = tmp_path / "videos"
    src.mkdir()
    synth = SyntheticVideoDataset(3, channels=3, frames=5, height=16, width=16, seed=0)
    for i in range(2):  # two PNG-sequence videos
        d = src / f"vid{i}"
        d.mkdir()
        frames = ((synth[i]["latents"] + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()
        for t, frame in enumerate(frames):
            Image.fromarray(frame).save(d / f"{t:03d}.png")
    np.save(src / "vid2.npy", ((synth[2]["latents"] + 1) / 2).permute(1, 2, 3, 0).numpy())
    np.save(src / "short.npy", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    (tmp_path / "labels.csv").write_text("vid0,3\nvid2,1\n")
    out = tmp_path / "shards"
    assert main(["--input", str(src), "--out", str(out), "--frames", "4", "--height", "8", "--width", "8",
                 "--shard-size", "2", "--labels", str(tmp_path / "labels.csv")]) == 0
    err = capsys.readouterr().err
    assert "4/4" in err and "skipped" in err and "short.npy" in err
    ds = LatentShardDataset(str(out))
    assert len(ds) == 3 and ds.sample_shape == (4, 4, 8, 8)  # default: RGB + luminance
    assert [int(ds[i]["label"]) for i in range(3)] == [3, 0, 1]
    assert ds[0]["latents"].min() >= -1 and ds[0]["latents"].max() <= 1
    assert sorted(os.listdir(out)) == ["shard-00000.safetensors", "shard-00001.safetensors"]


def _png_videos(folder, n=2, frames=8):
    from PIL import Image

    folder.mkdir()
    synth = SyntheticVideoDataset(n, channels=3, frames=frames, height=20, width=20, seed=1)
    for i in range(n):
        (folder / f"v{i}").mkdir()
        for t, frame in enumerate(((synth[i]["latents"] + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()):
            Image.fromarray(frame).save(folder / f"v{i}" / f"{t:03d}.png")
    return folder


def test_shard_tool_defaults_feed_the_default_model(tmp_path):
    """The shard tool with its defaults writes what the default (tiny) preset trains on; a mismatch names
    both fixes."""
    from megatron_dsv.training.arguments import parse_args
    from megatron_dsv.training.trainer import train
    from tools.make_latent_shards import main

    src = _png_videos(tmp_path / "videos")
    assert main(["--input", str(src), "--out", str(tmp_path / "s4")]) == 0
    common = ["--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "2", "--no-save",
              "--no-sample", "--output-dir", str(tmp_path / "out")]
    result = train(parse_args(["--data-path", str(tmp_path / "s4"), *common]))
    assert result.iteration == 2 and all(x == x for x in result.losses)
    assert main(["--input", str(src), "--out", str(tmp_path / "s3"), "--channels", "3"]) == 0
    with pytest.raises(ValueError, match=r"3-channel latents .* in_channels = 4: train with --model-override "
                                         r"in_channels=3, or rewrite the shards with tools/make_latent_shards\.py "
                                         r"--channels 4"):
        train(parse_args(["--data-path", str(tmp_path / "s3"), *common]))


def test_cycled_dataset_repeats_a_finite_set():
    from megatron_dsv.data import CycledDataset

    ds = CycledDataset([{"i": 0}, {"i": 1}, {"i": 2}], 7)
    assert len(ds) == 7 and [ds[j]["i"] for j in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(IndexError):
        ds[7]
    with pytest.raises(ValueError, match="non-empty"):
        CycledDataset([], 3)

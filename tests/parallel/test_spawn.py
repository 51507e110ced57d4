"""tests/parallel/spawn.py itself: a gloo world that crashed (a rank killed by a signal of its own) runs once more,
with a warning that quotes the rank's stacks; a second crash, a rank's Python exception, or an NCCL world fails at
once."""

import os
import signal
import warnings
from types import SimpleNamespace

import pytest
from torch.multiprocessing.spawn import ProcessException

from tests.parallel.spawn import _crash_report, run_world


def _abort_first_time(rank, world, flag_dir):
    # rank 1 aborts in the first world only (the flag file marks the first world as seen)
    flag = os.path.join(flag_dir, f"seen{rank}")
    if rank == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)
    open(os.path.join(flag_dir, f"done{rank}"), "w").close()


def _abort_always(rank, world):
    os.kill(os.getpid(), signal.SIGABRT)


def _rank0_raises(rank, world):
    if rank == 0:
        raise ValueError("rank 0 fails")


def test_a_crashed_world_runs_once_more_and_the_warning_quotes_the_stacks(tmp_path):
    with pytest.warns(UserWarning) as record:
        run_world(_abort_first_time, 2, tmp_path, args=(str(tmp_path),))
    assert len(record) == 1
    text = str(record[0].message)
    assert "rank 1 died of SIGABRT" in text and "_abort_first_time" in text, text  # faulthandler's stack of rank 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("done")) == ["done0", "done1"]


def test_a_second_crash_fails(tmp_path):
    # a world of one rank: no peer whose own error could be reported first
    with pytest.warns(UserWarning) as record, pytest.raises(ProcessException, match="SIGABRT"):
        run_world(_abort_always, 1, tmp_path)
    assert len(record) == 1 and "rank 0 died of SIGABRT" in str(record[0].message)


def test_a_python_exception_fails_at_once(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rerun's warning would fail this test
        with pytest.raises(ProcessException):
            run_world(_rank0_raises, 2, tmp_path)
    assert "rank 0 fails" in (tmp_path / "store2.raised0").read_text()


def test_only_gloo_worlds_whose_exceptions_are_the_crash_rerun(tmp_path):
    store = str(tmp_path / "store2")
    ctx = SimpleNamespace(processes=[SimpleNamespace(exitcode=-signal.SIGABRT), SimpleNamespace(exitcode=1)])
    (tmp_path / "store2.rank0.log").write_text("Fatal Python error: Aborted\n  File x, line 1 in fn\n")
    (tmp_path / "store2.raised1").write_text("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:7848")
    assert _crash_report(ctx, store, "gloo").startswith("rank 0 died of SIGABRT: 'Fatal Python error")
    assert _crash_report(ctx, store, "nccl") == ""  # NCCL's watchdog aborts on a real hang: never rerun
    (tmp_path / "store2.raised1").write_text("AssertionError: dq differs")
    assert _crash_report(ctx, store, "gloo") == ""  # a real failure beside the crash
    stopped = SimpleNamespace(processes=[SimpleNamespace(exitcode=-signal.SIGTERM), SimpleNamespace(exitcode=0)])
    assert _crash_report(stopped, store, "gloo") == ""  # SIGTERM is how spawn stops the others, not a crash

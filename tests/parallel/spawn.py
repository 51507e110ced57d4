"""Run a function on a fresh gloo world of spawned CPU processes, with a deadline.

The pytest process already holds a 1-process gloo world (tests/conftest.py), so a multi-rank world
needs new processes: ``run_world(fn, world, tmp_path)`` spawns ``world`` workers that join a gloo
group through a file store in ``tmp_path`` and call ``fn(rank, world, *args)``; a worker's exception
fails the test, and workers still running at the deadline are killed. Workers use one thread each
(two cores run four ranks).

A world in which a rank dies of a signal of its own (SIGABRT, SIGSEGV: not a Python exception, not the SIGTERM that
stops the other ranks) runs once more, with a warning: in CI (two
pytest-xdist workers on two cores) a rank once died of SIGABRT inside gloo ("terminate called without an active
exception") in a test that passes alone and beside other worlds. Python's fault handler prints every thread's stack
of a rank that dies so; a second crash, or any Python exception alone, fails the test.
"""

import datetime
import faulthandler
import signal
import sys
import time
import traceback
import warnings

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def _entry(rank, fn, world, store, args, backend):
    import torch

    faulthandler.enable()  # a rank killed by a signal (SIGABRT, SIGSEGV) prints its threads' Python stacks
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        # printed here, first: tearing down a gloo group after a failed collective can abort the process
        # (SIGABRT, "terminate called without an active exception") before spawn reports the exception
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        from megatron_dsv.parallel.cp_attention import CPContext

        CPContext.release()
        dist.destroy_process_group()


def run_world(fn, world: int, tmp_path, deadline_s: float = 120.0, args=(), backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on each rank of a new world (``fn`` must be importable: module level);
    ``backend="nccl"``: rank r on GPU r. A world in which a rank crashed runs once more (the module's doc)."""
    try:
        _run_world_once(fn, world, tmp_path / f"store{world}", deadline_s, args, backend)
    except ProcessException as e:
        crashed = getattr(e, "crashed", [])
        if not crashed:
            raise
        warnings.warn(f"{', '.join(crashed)} of a world of {world} ranks: the world runs once more "
                      f"(tests/parallel/spawn.py)", stacklevel=2)
        _run_world_once(fn, world, tmp_path / f"store{world}-again", deadline_s, args, backend)


def _run_world_once(fn, world, store, deadline_s, args, backend):
    """One world; a failure's exception carries ``crashed``: the ranks that died of a signal of their own (not the
    SIGTERM / SIGKILL with which spawn and this function stop the others), as "rank r died of SIGNAME"."""
    ctx = mp.start_processes(_entry, args=(fn, world, str(store), tuple(args), backend),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"a world of {world} ranks did not finish within {deadline_s} s")
    except ProcessException as e:
        for p in ctx.processes:
            p.join(5)
        stopped = (signal.SIGTERM, signal.SIGKILL)
        e.crashed = [f"rank {r} died of {signal.Signals(-p.exitcode).name}" for r, p in enumerate(ctx.processes)
                     if p.exitcode is not None and p.exitcode < 0 and -p.exitcode not in stopped]
        raise
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)

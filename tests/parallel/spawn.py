"""Run a function on a fresh gloo world of spawned CPU processes, with a deadline.

The pytest process already holds a 1-process gloo world (tests/conftest.py), so a multi-rank world
needs new processes: ``run_world(fn, world, tmp_path)`` spawns ``world`` workers that join a gloo
group through a file store in ``tmp_path`` and call ``fn(rank, world, *args)``; a worker's exception
fails the test, and workers still running at the deadline are killed. Workers use one thread each
(two cores run four ranks).

A gloo world that crashed runs once more, with a warning: in CI (two pytest-xdist workers on two cores) a rank once
died of SIGABRT inside gloo ("terminate called without an active exception", no Python traceback) in a test that
passes alone and beside other worlds. Crashed means: a rank died of a signal of its own (SIGABRT, SIGSEGV; not the
SIGTERM / SIGKILL that stop the other ranks) and no rank raised a Python exception other than gloo's "connection
closed / reset by peer", which is the crash seen from the other side. An assertion or any other exception, a deadline,
a second crash, or an NCCL world (whose watchdog aborts on a real hang) fails at once. Each rank's fault-handler stacks
and traceback go to files beside the store, and the warning quotes them.
"""

import datetime
import faulthandler
import os
import signal
import time
import traceback
import warnings

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# how gloo reports a peer that is gone: the crash itself, seen from a surviving rank
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def _entry(rank, fn, world, store, args, backend):
    import torch

    log = open(f"{store}.rank{rank}.log", "w")  # noqa: SIM115 (open for the process's life: faulthandler writes it)
    faulthandler.enable(file=log)  # a rank killed by a signal (SIGABRT, SIGSEGV) writes its threads' Python stacks
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        # written first: tearing down a gloo group after a failed collective can abort the process (SIGABRT) before
        # spawn reports the exception; the file also tells run_world that this rank raised
        with open(f"{store}.raised{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        from megatron_dsv.parallel.cp_attention import CPContext

        CPContext.release()
        dist.destroy_process_group()


def run_world(fn, world: int, tmp_path, deadline_s: float = 120.0, args=(), backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on each rank of a new world (``fn`` must be importable: module level);
    ``backend="nccl"``: rank r on GPU r. A gloo world that crashed runs once more (the module's doc)."""
    try:
        _run_world_once(fn, world, tmp_path / f"store{world}", deadline_s, args, backend)
    except ProcessException as e:
        crashed = getattr(e, "crashed", "")
        if not crashed:
            raise
        warnings.warn(f"a world of {world} ranks crashed, so it runs once more (tests/parallel/spawn.py): {crashed}",
                      stacklevel=2)
        _run_world_once(fn, world, tmp_path / f"store{world}-again", deadline_s, args, backend)


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _tail(path: str, chars: int = 1500) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def _crash_report(ctx, store, backend) -> str:
    """"" unless the world crashed (the module's doc); else which ranks died of what, with their stacks."""
    stopped = (signal.SIGTERM, signal.SIGKILL)
    dead = [(r, p.exitcode) for r, p in enumerate(ctx.processes)
            if p.exitcode is not None and p.exitcode < 0 and -p.exitcode not in stopped]
    raised = [_tail(f"{store}.raised{r}") for r in range(len(ctx.processes))]
    if backend != "gloo" or not dead or any(t and not any(s in t for s in PEER_GONE) for t in raised):
        return ""
    return "; ".join(f"rank {r} died of {_signal_name(code)}: {_tail(f'{store}.rank{r}.log')!r}" for r, code in dead)


def _run_world_once(fn, world, store, deadline_s, args, backend):
    """One world; a failure's exception carries ``crashed``: :func:`_crash_report`."""
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
        e.crashed = _crash_report(ctx, str(store), backend)
        raise
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)

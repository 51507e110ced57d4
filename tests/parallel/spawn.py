"""Run a function on a fresh gloo world of spawned CPU processes, with a deadline.

The pytest process already holds a 1-process gloo world (tests/conftest.py), so a multi-rank world
needs new processes: ``run_world(fn, world, tmp_path)`` spawns ``world`` workers that join a gloo
group through a file store in ``tmp_path`` and call ``fn(rank, world, *args)``; a worker's exception
fails the test, and workers still running at the deadline are killed. Workers use one thread each
(two cores run four ranks).
"""

import datetime
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world, store, args, backend):
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        from megatron_dsv.parallel.cp_attention import CPContext

        CPContext.release()
        dist.destroy_process_group()


def run_world(fn, world: int, tmp_path, deadline_s: float = 120.0, args=(), backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on each rank of a new world (``fn`` must be importable: module level);
    ``backend="nccl"``: rank r on GPU r."""
    ctx = mp.start_processes(_entry, args=(fn, world, str(tmp_path / f"store{world}"), tuple(args), backend),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"a world of {world} ranks did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)

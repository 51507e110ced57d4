"""The frontier's launcher (``bench_quality.py --launch``): one worker process per (arm, seed) on one GPU, at most
``--max-workers`` at once on the machine (every study's launcher counted, from /proc), and a worker that dies of CUDA
out-of-memory started again from its last save."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List

BENCH_QUALITY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_quality.py")


def running_workers(exclude: int = 0) -> int:
    """Worker processes of any study on this machine (``bench_quality.py ... --worker``), from /proc: a second
    launcher (another data source started beside this one) shares the same GPU and the same cap. ``exclude``: a
    pid not counted (a worker asking how many others share its GPU)."""
    count = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == exclude:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if b"--worker" in argv and any(a.endswith(b"bench_quality.py") for a in argv):
            count += 1
    return count


def wait_for_slot(max_workers: int, poll_s: float = 5.0) -> None:
    """Block until fewer than ``max_workers`` workers run on the machine (0: no cap). A 16K-token worker holds
    8-12 GiB of the GPU and peaks at 13-17 GiB: 18 of them ran out of the H200's 140 GiB (frontier run 6), and 10
    (run 7); 16 GiB a worker fits (tools/gpu_quality_frontier.sh)."""
    if max_workers <= 0:
        return
    announced = False
    while running_workers() >= max_workers:
        if not announced:
            print(f"launch: {max_workers} workers running (--max-workers); the next starts when one ends", flush=True)
            announced = True
        time.sleep(poll_s)


OOM_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "OutOfMemoryError: CUDA")


def died_of_oom(log_path: str, since: int = 0) -> bool:
    """The worker's log ends in a CUDA out-of-memory error (its last 4 KB, and nothing written before byte
    ``since``: the log is appended to by every start of the worker): a run to resume, not a bug."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(since, f.tell() - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(m in tail for m in OOM_MARKERS)


def launch(names: List[str], seeds: List[int], argv: List[str], args, script: str = BENCH_QUALITY) -> None:
    """One worker process per (arm, seed), seed by seed, at most ``--max-workers`` at once on the machine (every
    launcher's workers counted); waits for all, then prints each log's tail. A worker that dies of CUDA
    out-of-memory (other workers' peaks met its own) starts again from its last save when a slot is free, up to
    ``--oom-retries`` times;
    any other failure is reported at the end. ``script``: the worker's program (``bench_quality.py``), run with
    ``argv`` less the phases plus ``--worker NAME --seed N``; the study's clips are rendered before (its caller)."""
    logs = os.path.join(args.save_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    base = [a for a in argv if a not in ("--launch", "--time", "--report")]
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less reserved than held: more fit

    def start(name, seed):
        """``(process, the log's size when it started)``."""
        wait_for_slot(args.max_workers)
        path = os.path.join(logs, f"{name}-s{seed}.log")
        cmd = [sys.executable, script, *base, "--worker", name, "--seed", str(seed)]
        with open(path, "a") as log:  # the child holds its own descriptor
            since = log.tell()  # the end of what earlier starts wrote
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), since

    running = {}
    for seed in seeds:  # seed-major: a seed's arms start together, so a study cut short keeps whole pairs
        for name in names:
            running[(name, seed)] = start(name, seed)
            time.sleep(args.stagger)
    failed, retries = [], {}
    while running:
        time.sleep(1.0)
        for (name, seed), (proc, since) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[(name, seed)]
            if code == 0:
                continue
            log = os.path.join(logs, f"{name}-s{seed}.log")
            if died_of_oom(log, since) and retries.get((name, seed), 0) < args.oom_retries:
                retries[(name, seed)] = retries.get((name, seed), 0) + 1
                print(f"launch: {name}-s{seed} ran out of GPU memory: started again, from its last save if it has "
                      f"one (retry {retries[(name, seed)]} of {args.oom_retries})", flush=True)
                time.sleep(args.stagger)  # not every worker that died together back at once
                running[(name, seed)] = start(name, seed)
            else:
                failed.append(f"{name}-s{seed}")
    for name in names:
        for seed in seeds:
            with open(os.path.join(logs, f"{name}-s{seed}.log")) as f:
                tail = f.read().splitlines()[-2:]
            print(f"[{name} s{seed}] " + " / ".join(tail), flush=True)
    if failed:
        raise SystemExit(f"workers failed: {failed} (logs in {logs})")

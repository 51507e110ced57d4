"""Two gloo processes under torchrun: DP=2 trains, ranks agree on the loss, and the DP=2 run matches
one process accumulating the same two micro batches (losses equal to float tolerance)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.training.helpers import SMALL, run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(out, flags):
    """Run _dp_worker.py on 2 gloo ranks; returns stdout (fails the test on error or timeout)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "training", "_dp_worker.py"), str(out), *flags]
    # Own session: on a timeout the whole process group (torchrun and both workers) is killed.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(out), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("2-process run timed out:\n" + stdout[-3000:] + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def test_two_process_gloo_data_parallel(tmp_path):
    out = tmp_path / "dp2"
    out.mkdir()
    evals = ["--eval-interval", "2", "--eval-iters", "2"]
    stdout = _torchrun(out, [*SMALL, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--output-dir", str(out), "--save", str(out / "ckpt"), "--dsv-stage-switch-steps", "2",
                             *evals])
    ranks = [json.load(open(out / f"losses_rank{r}.json")) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 4
    assert ranks[0]["consumed_samples"] == 16
    assert "world 2 (dp 2, tp 1, cp 1)" in stdout
    assert (out / "ckpt" / "iter_0000004" / "rng" / "rank_00001.json").exists()
    # One process, 2 micro batches of 2 (gradient accumulation): the same global batches and the same noise
    # per micro batch, so the same losses up to summation order.
    single = run(tmp_path, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--no-save",
                 "--dsv-stage-switch-steps", "2", *evals, name="dp1")
    assert single.losses == pytest.approx(ranks[0]["losses"], rel=1e-4)
    # validation: each rank its half of the held-out batches, the mean over DP = one process's mean
    assert ranks[0]["valid_losses"] == ranks[1]["valid_losses"] and [i for i, _ in single.valid_losses] == [2, 4]
    assert [v for _, v in single.valid_losses] == pytest.approx([v for _, v in ranks[0]["valid_losses"]], rel=1e-4)


def test_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    """A DP=2 checkpoint loads into one process (no resharding needed: DP ranks hold full replicas)."""
    out = tmp_path / "dp2"
    out.mkdir()
    _torchrun(out, [*SMALL, "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
                    "--output-dir", str(out), "--save", str(out / "ckpt"), "--no-dsv"])
    resumed = run(tmp_path, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--load", str(out / "ckpt"), "--no-save", "--no-dsv", "--use-checkpoint-opt_param-scheduler",
                  name="dp1")
    assert resumed.start_iteration == 2 and resumed.consumed_samples == 16 and len(resumed.losses) == 2


def test_two_process_context_parallel_matches_one_process(tmp_path):
    """CP=2 (DSV hybrid context parallelism, gloo): each rank trains on half of every video's tokens and
    the losses equal one process training on whole videos, through stage 1 and the sparse stage 2."""
    flags = ["--hidden-size", "128", "--model-override", "head_dim=64", "--model-override", "latent_height=16",
             "--model-override", "latent_width=16", "--train-iters", "6", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--dsv-stage-switch-steps", "3", "--dsv-profile-interval", "1",
             "--dsv-cp-mode", "hybrid", "--dsv-granularity", "token",
             "--dsv-sparsity-threshold", "0.3"]  # these tiny models sit at ~0.36: token lists run them sparse
    out = tmp_path / "cp2"
    out.mkdir()
    # validation after every step: under CP it plans its own layout and leaves the training's alone
    stdout = _torchrun(out, [*SMALL, *flags, "--context-parallel-size", "2", "--output-dir", str(out), "--no-save",
                             "--eval-interval", "1", "--eval-iters", "1"])
    assert "world 2 (dp 1, tp 1, cp 2)" in stdout
    assert "CP plan: hcp" in stdout  # the planner ran and logged its choice
    ranks = [json.load(open(out / f"losses_rank{r}.json")) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 6
    single = run(tmp_path, *flags, "--no-save", "--eval-iters", "0", name="cp1")
    assert single.losses == pytest.approx(ranks[0]["losses"], rel=1e-4)
    assert len(ranks[0]["valid_losses"]) == 6 and ranks[0]["valid_losses"] == ranks[1]["valid_losses"]
    sparse_steps = [line for line in stdout.splitlines() if line.startswith(" dsv layers") and " sparse" in line]
    assert sparse_steps, "stage 2 must run some layers sparse under CP:\n" + stdout[-3000:]


def test_context_parallel_checkpoint_resumes_exactly(tmp_path):
    """A CP=2 run saved at iteration 3 and resumed (CP=2) continues with the uninterrupted run's losses,
    DSV state and CP plan included."""
    flags = [*SMALL, "--hidden-size", "128", "--model-override", "head_dim=64", "--model-override", "latent_height=16",
             "--model-override", "latent_width=16", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--dsv-stage-switch-steps", "2", "--dsv-profile-interval", "1", "--dsv-cp-mode", "hybrid",
             "--dsv-granularity", "token", "--dsv-sparsity-threshold", "0.3", "--context-parallel-size", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    for d in (full, part):
        d.mkdir()
    # the uninterrupted run saves at iteration 3 on its way (saving changes nothing): resume from that folder
    _torchrun(full, [*flags, "--train-iters", "6", "--output-dir", str(full), "--save", str(full / "ckpt"),
                     "--save-interval", "3"])
    stdout = _torchrun(part, [*flags, "--train-iters", "6", "--output-dir", str(part), "--load",
                              str(full / "ckpt" / "iter_0000003"), "--no-save"])
    assert "resumed from" in stdout and "at iteration 3" in stdout
    whole = json.load(open(full / "losses_rank0.json"))["losses"]
    resumed = json.load(open(part / "losses_rank0.json"))["losses"]
    assert resumed == pytest.approx(whole[3:], rel=1e-5)


def test_exit_signal_saves_and_resumes(tmp_path):
    """SIGTERM to torchrun (what Slurm sends before a time limit or on preemption) under
    --exit-signal-handler: the workers finish the iteration, save together and exit 0; --load resumes there."""
    out = tmp_path / "sig"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    flags = [*SMALL, "--train-iters", "100000", "--micro-batch-size", "2", "--global-batch-size", "4", "--no-dsv",
             "--output-dir", str(out), "--save", str(out / "ckpt"), "--save-interval", "100000",
             "--exit-signal-handler"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "tests", "training", "_dp_worker.py"), str(out), *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(out), start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:  # wait until training is under way, then signal torchrun only
            lines.append(line)
            if "iteration        3/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the signalled run did not stop:\n" + "".join(lines)[-3000:])
    stdout = "".join(lines) + rest
    assert "SIGTERM received: exiting at iteration" in stdout, stdout[-3000:]
    stopped = int(stdout.split("SIGTERM received: exiting at iteration ")[1].split()[0])
    assert stopped >= 3 and (out / "ckpt" / f"iter_{stopped:07d}").exists()
    resumed = run(tmp_path, "--train-iters", str(stopped + 1), "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--no-dsv", "--load", str(out / "ckpt"), "--no-save", "--use-checkpoint-opt_param-scheduler",
                  name="after")
    assert resumed.start_iteration == stopped and len(resumed.losses) == 1

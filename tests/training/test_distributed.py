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
    stdout = _torchrun(out, [*SMALL, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
                             "--output-dir", str(out), "--save", str(out / "ckpt"), "--dsv-stage-switch-steps", "2"])
    ranks = [json.load(open(out / f"losses_rank{r}.json")) for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 4
    assert ranks[0]["consumed_samples"] == 16
    assert "world 2 (dp 2, tp 1, cp 1)" in stdout
    assert (out / "ckpt" / "iter_0000004" / "rng" / "rank_00001.json").exists()
    # One process, 2 micro batches of 2 (gradient accumulation): the same global batches and the same noise
    # per micro batch, so the same losses up to summation order.
    single = run(tmp_path, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--no-save",
                 "--dsv-stage-switch-steps", "2", name="dp1")
    assert single.losses == pytest.approx(ranks[0]["losses"], rel=1e-4)


def test_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    """A DP=2 checkpoint loads into one process (no resharding needed: DP ranks hold full replicas)."""
    out = tmp_path / "dp2"
    out.mkdir()
    _torchrun(out, [*SMALL, "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
                    "--output-dir", str(out), "--save", str(out / "ckpt"), "--no-dsv"])
    resumed = run(tmp_path, "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--load", str(out / "ckpt"), "--no-save", "--no-dsv", name="dp1")
    assert resumed.start_iteration == 2 and resumed.consumed_samples == 16 and len(resumed.losses) == 2

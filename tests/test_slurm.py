"""examples/video_dit/train_slurm.sbatch under Slurm.

The dry run needs no Slurm: the script runs with a fake two-node allocation (SLURM_* variables, a stub
``scontrol`` on PATH, DSV_DRY_RUN=1) and the torchrun command it prints is checked.

The real run starts a one-node cluster on localhost (munged, slurmctld -D, slurmd -D, all state in a
temp dir), submits the script with the tiny preset on CPU (2 gloo processes), and checks training,
checkpoints and requeue-resume. It needs the Debian packages slurm-wlm and munge and root; without
them it is skipped with the reason.
"""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

# run with no xdist worker beside them (tools/run_tests.sh's last phase: the marker alone)
pytestmark = pytest.mark.alone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH_SCRIPT = os.path.join(ROOT, "examples", "video_dit", "train_slurm.sbatch")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol")
TRAIN_ARGS = "--train-iters 4 --save-interval 2 --synthetic-samples 16 --log-interval 1"


# ---------------------------------------------------------------------------------------------- dry run
def _dry_run(tmp_path, **env_extra):
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "scontrol"
    # the real `scontrol show hostnames gpu-[07-08]` prints one host per line
    stub.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 9\necho gpu-07\necho gpu-08\n")
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{stub_dir}{os.pathsep}{env['PATH']}", DSV_DRY_RUN="1", PYTHON="/opt/venv/bin/python",
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="dit", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-[07-08]",
               SLURM_NODEID="0", SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_ON_NODE="64")
    env.update(env_extra)
    proc = subprocess.run(["bash", SBATCH_SCRIPT, "--lr", "3e-4"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    nodes = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"node (\d+): (.*)", line)
        if m:
            nodes[int(m.group(1))] = shlex.split(m.group(2))
    return proc.stdout, nodes


def _flag(argv, name):
    """Value of the last occurrence of ``name`` (argparse's rule: the last one wins)."""
    idx = [i for i, a in enumerate(argv) if a == name]
    assert idx, f"{name} missing from {argv}"
    return argv[idx[-1] + 1]


def test_dry_run_two_gpu_nodes(tmp_path):
    out, nodes = _dry_run(tmp_path, DSV_TRAIN_ARGS="--train-iters 4 --save-interval 2")
    assert "srun --nodes 2 --ntasks 2 --ntasks-per-node 1" in out, out
    assert sorted(nodes) == [0, 1], out
    for rank, argv in nodes.items():
        assert argv[:3] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"], argv
        assert _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--node-rank") == str(rank)
        assert _flag(argv, "--nproc-per-node") == "8"
        assert _flag(argv, "--rdzv-backend") == "c10d"
        assert _flag(argv, "--rdzv-endpoint") == f"gpu-07:{20000 + 4242}"
        assert _flag(argv, "--rdzv-id") == "4242"
        assert _flag(argv, "--load") == _flag(argv, "--save") == "runs/dit/checkpoints"
        assert _flag(argv, "--tensorboard-dir") == "runs/dit/tensorboard"
        assert _flag(argv, "--global-batch-size") == "16"  # MBS 1 x 2 nodes x 8 GPUs
        assert _flag(argv, "--train-iters") == "4" and _flag(argv, "--save-interval") == "2"
        assert _flag(argv, "--lr") == "3e-4"  # the script's own arguments come last
        assert _flag(argv, "--recompute-granularity") == "full"
    assert nodes[0][nodes[0].index("-m", 3):] == nodes[1][nodes[1].index("-m", 3):]


def test_dry_run_cpu_nodes_use_the_task_count_and_run_dir(tmp_path):
    run_dir = str(tmp_path / "my run")
    _, nodes = _dry_run(tmp_path, SLURM_GPUS_ON_NODE="0", SLURM_NTASKS_PER_NODE="2(x2)", DSV_RUN_DIR=run_dir,
                        MASTER_PORT="29999", TP="2", PRESET="tiny")
    argv = nodes[1]
    assert _flag(argv, "--nproc-per-node") == "2"
    assert _flag(argv, "--rdzv-endpoint") == "gpu-07:29999"
    assert _flag(argv, "--global-batch-size") == "2"  # MBS 1 x 4 processes / TP 2
    assert _flag(argv, "--preset") == "tiny"
    assert "--recompute-granularity" not in argv  # GPU only
    assert _flag(argv, "--load") == run_dir + "/checkpoints"  # one argument, printed shell-quoted


def test_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", SBATCH_SCRIPT], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "SLURM_JOB_ID" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------- real cluster
def _why_no_slurm():
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found; Debian: apt-get install -y slurm-wlm "
                "munge)")
    if os.geteuid() != 0:
        return "the throwaway cluster runs slurmd/slurmctld/munged as root; the tests do not run as root"
    return None


def _which(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _slurm_conf(d, ctld_port, slurmd_port):
    ncpu = os.cpu_count() or 1
    return "\n".join([
        "ClusterName=dsvtest",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d}/munge/munge.socket",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "JobRequeue=1",
        "ReturnToService=2",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=600",  # keep finished jobs in scontrol for the checks (and for requeue)
        f"NodeName=localhost CPUs={ncpu} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class Cluster:
    """A one-node Slurm cluster on localhost whose every file lives in ``root``."""

    def __init__(self, root):
        self.root = root
        self.procs = []
        self.env = dict(os.environ, SLURM_CONF=os.path.join(root, "slurm.conf"))
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if k != "SLURM_CONF":
                del self.env[k]

    def log(self, name):
        path = os.path.join(self.root, name)
        return open(path).read()[-3000:] if os.path.exists(path) else f"({name} not written)"

    def diagnostics(self):
        return "\n".join(f"--- {n}:\n{self.log(n)}" for n in ("munged.log", "slurmctld.log", "slurmd.log"))

    def cmd(self, *argv, timeout=30, check=True):
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}\n{self.diagnostics()}")
        return proc.stdout

    def start(self):
        d = self.root
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(d, sub), mode=0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = _free_ports(2)
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(_slurm_conf(d, ctld_port, slurmd_port))
        sock = os.path.join(d, "munge", "munge.socket")
        # --force: munged otherwise refuses a key and socket outside its own /etc and /run folders
        self._spawn("munged", _which("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                    f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munged.log",
                    f"--seed-file={d}/munge/munged.seed")
        self._wait(lambda: os.path.exists(sock), 15, "munged's socket")
        self._spawn("slurmctld", _which("slurmctld"), "-D", "-i", "-f", self.env["SLURM_CONF"])
        self._spawn("slurmd", _which("slurmd"), "-D", "-N", "localhost", "-f", self.env["SLURM_CONF"])
        self._wait(self._node_idle, 45, "node localhost idle in sinfo")

    def _spawn(self, name, *argv):
        out = open(os.path.join(self.root, f"{name}.stdout"), "w")
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))

    def _node_idle(self):
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name + '.stdout')}\n"
                                   f"{self.diagnostics()}")
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return "localhost idle" in out

    def _wait(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout}s for {what}\n{self.diagnostics()}")

    def job_state(self, job_id):
        out = self.cmd("scontrol", "show", "job", "-o", job_id, timeout=10)
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        return fields.get("JobState"), int(fields.get("Restarts", "0"))

    def wait_job(self, job_id, timeout, restarts=0):
        """Wait until the job ends (after ``restarts`` requeues); returns its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, count = self.job_state(job_id)
            if count >= restarts and state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                               "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
                return state
            time.sleep(1)
        self.cmd("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} still {state} after {timeout}s\n{self.diagnostics()}")

    def stop(self):
        # slurmd first: it kills the job steps it started
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = _why_no_slurm()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(cluster, workdir, run_dir, train_args):
    env_vars = dict(PYTHON=sys.executable, PRESET="tiny", DSV_RUN_DIR=str(run_dir), DSV_TRAIN_ARGS=train_args,
                    OMP_NUM_THREADS="1")
    cluster.env.update(env_vars)
    out = cluster.cmd("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                      "--gpus-per-node=0", "--time=00:05:00", f"--chdir={workdir}", f"--output={workdir}/%j.out",
                      SBATCH_SCRIPT)
    return out.strip().split(";")[0]


def _job_log(workdir, job_id):
    path = os.path.join(workdir, f"{job_id}.out")
    return open(path).read() if os.path.exists(path) else "(no job output)"


def _tracker(run_dir):
    return open(os.path.join(run_dir, "checkpoints", "latest_checkpointed_iteration.txt")).read().strip()


@pytest.mark.timeout(240)
def test_sbatch_trains_and_checkpoints(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(slurm_cluster, str(tmp_path), run_dir, TRAIN_ARGS)
    state = slurm_cluster.wait_job(job, timeout=60)
    log = _job_log(str(tmp_path), job)
    assert state == "COMPLETED", f"{state}\n{log[-4000:]}\n{slurm_cluster.diagnostics()}"
    assert "WARNING: --load" in log and "starting from iteration 0" in log, log[-4000:]
    assert re.search(r"iteration +4/ +4 \|", log), log[-4000:]
    assert "world 2" in log, log[-4000:]  # 2 gloo processes on the node
    assert _tracker(run_dir) == "4" and (run_dir / "checkpoints" / "iter_0000004").is_dir()
    assert "iteration        4/" in (run_dir / "logs" / f"{job}.log").read_text()


@pytest.mark.timeout(240)
def test_requeued_job_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # each attempt stops after 2 iterations (after saving): attempt 1 ends at 2, the requeued attempt at 4
    job = _submit(slurm_cluster, str(tmp_path), run_dir, TRAIN_ARGS + " --exit-interval 2")
    state = slurm_cluster.wait_job(job, timeout=60)
    log = _job_log(str(tmp_path), job)
    assert state == "COMPLETED" and _tracker(run_dir) == "2", f"{state}\n{log[-4000:]}"
    assert "Requeue=1" in slurm_cluster.cmd("scontrol", "show", "job", job)  # the script's #SBATCH --requeue
    slurm_cluster.cmd("scontrol", "requeue", job)
    # Slurm holds a requeued job for ~2 minutes (Reason=BeginTime); a real cluster may wait, the test waits 2 s.
    # Not less: slurmd revokes the ended job's credential at one-second resolution and refuses a new launch whose
    # credential was issued in the same second ("Job credential revoked": the job FAILS without running).
    time.sleep(2)
    slurm_cluster.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
    state = slurm_cluster.wait_job(job, timeout=60, restarts=1)
    log = _job_log(str(tmp_path), job)
    assert state == "COMPLETED", f"{state}\n{log[-4000:]}\n{slurm_cluster.diagnostics()}"
    assert re.search(r"resumed from \S+ at iteration 2 ", log), log[-4000:]
    assert re.search(r"iteration +4/ +4 \|", log), log[-4000:]
    assert "attempt 2" in log, log[-4000:]
    assert _tracker(run_dir) == "4"


@pytest.mark.timeout(240)
def test_sigterm_saves_before_the_job_ends(slurm_cluster, tmp_path):
    """What Slurm sends before a time limit (--signal=TERM@90) or on preemption: SIGTERM to the job step.
    srun and torchrun forward it; the trainers (--exit-signal-handler) save together and stop."""
    run_dir = tmp_path / "run"
    job = _submit(slurm_cluster, str(tmp_path), run_dir, "--train-iters 100000 --save-interval 100000 --log-interval 1")
    deadline = time.monotonic() + 90
    while not re.search(r"iteration +3/", _job_log(str(tmp_path), job)):
        assert time.monotonic() < deadline, _job_log(str(tmp_path), job)[-4000:] + slurm_cluster.diagnostics()
        time.sleep(0.5)
    slurm_cluster.cmd("scancel", "--signal=TERM", job)
    slurm_cluster.wait_job(job, timeout=90)
    log = _job_log(str(tmp_path), job)
    found = re.search(r"SIGTERM received: exiting at iteration (\d+) after saving", log)
    assert found, log[-4000:]
    stopped = int(found.group(1))
    assert stopped >= 3 and _tracker(run_dir) == str(stopped), log[-4000:]
    assert (run_dir / "checkpoints" / f"iter_{stopped:07d}").is_dir()

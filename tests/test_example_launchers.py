"""The example launchers start from a shell whose virtualenv is not activated: they run torchrun as a
module of $PYTHON, and say what to set when that interpreter lacks megatron_dsv. Every script parses."""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

# starts, counts (frontier_launch.running_workers) or stops processes by name: in tests/conftest.py's PROCESS_FILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.sh"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "examples", "**", "*.sbatch"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "tools", "*.sh")))


def _bare_env(**extra):
    """The environment of a fresh login shell: no virtualenv on PATH or in VIRTUAL_ENV."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH") and not k.startswith("PYTEST")}
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin) or "/usr/bin:/bin"
    env.update(extra)
    return env


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.relpath(s, ROOT) for s in SCRIPTS])
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(600)
def test_torchrun_launcher_two_cpu_processes_without_activation(tmp_path):
    out = tmp_path / "run"
    env = _bare_env(PYTHON=sys.executable, NPROC="2", ITERS="2", SWITCH="1", GBS="4", OUT=str(out),
                    OMP_NUM_THREADS="1")
    script = os.path.join(ROOT, "examples", "video_dit", "train_torchrun.sh")
    proc = subprocess.run(["bash", script, "--no-sample", "--synthetic-samples", "16"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=580)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert re.search(r"iteration +2/ +2 \|", log), log[-3000:]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(out / "tensorboard"))


def test_launcher_names_the_fix_when_python_lacks_the_package(tmp_path):
    env = _bare_env(PYTHON="python3-nonexistent-interpreter")
    script = os.path.join(ROOT, "examples", "video_dit", "train_torchrun.sh")
    proc = subprocess.run(["bash", script], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "set PYTHON to the interpreter" in proc.stderr, proc.stderr


# shellcheck -S error only on these (they carry quoting/`cd` warnings); every other script must be clean
SHELLCHECK_WARNINGS_KNOWN = {"tools/gpu_check.sh", "tools/gpu_sparsity_study.sh"}


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.relpath(s, ROOT) for s in SCRIPTS])
def test_scripts_pass_shellcheck(script):
    rel = os.path.relpath(script, ROOT)
    severity = ["-S", "error"] if rel in SHELLCHECK_WARNINGS_KNOWN else []
    proc = subprocess.run(["shellcheck", "-s", "bash", *severity, script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _torchrun_dry_run(tmp_path, **env):
    script = os.path.join(ROOT, "examples", "video_dit", "train_torchrun.sh")
    proc = subprocess.run(["bash", script, "--seed", "7"], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=60, env=_bare_env(PYTHON=sys.executable, DSV_DRY_RUN="1", **env))
    return proc


def _value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@pytest.mark.parametrize("preset,nproc,tp,gbs,mbs,recompute", [
    ("tiny", "2", "1", "8", "4", False),
    ("0.8b", "8", "1", "8", "1", True),
    ("2.7b", "8", "2", "4", "1", True),
    ("30b", "8", "8", "1", "1", True),
])
def test_torchrun_launcher_preset_defaults(tmp_path, preset, nproc, tp, gbs, mbs, recompute):
    proc = _torchrun_dry_run(tmp_path, PRESET=preset)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()[-1].split()
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"], argv
    assert _value(argv, "--nproc-per-node") == nproc and _value(argv, "--preset") == preset
    assert _value(argv, "--tensor-model-parallel-size") == tp and _value(argv, "--context-parallel-size") == "1"
    assert _value(argv, "--global-batch-size") == gbs and _value(argv, "--micro-batch-size") == mbs
    assert ("--recompute-granularity" in argv) == recompute
    assert "--model-override" not in argv  # the preset's own latent grid
    assert argv[-2:] == ["--seed", "7"]


def test_torchrun_launcher_sequence_length_and_parallel_sizes(tmp_path):
    proc = _torchrun_dry_run(tmp_path, PRESET="2.7b", NPROC="16", TP="2", CP="4", SEQ_LEN="65536")
    assert proc.returncode == 0, proc.stderr
    assert "latents 64x64x64 = 65536 tokens/video" in proc.stdout, proc.stdout
    argv = proc.stdout.splitlines()[-1].split()
    assert _value(argv, "--context-parallel-size") == "4" and _value(argv, "--global-batch-size") == "2"
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--model-override"]
    assert overrides == ["latent_frames=64", "latent_height=64", "latent_width=64"]


@pytest.mark.parametrize("env,message", [
    (dict(SEQ_LEN="1000"), "must be a multiple of (SIZE/2)^2 = 64"),
    (dict(PRESET="7b"), "PRESET must be one of tiny, 0.8b, 2.7b, 30b"),
])
def test_torchrun_launcher_rejects_bad_settings(tmp_path, env, message):
    proc = _torchrun_dry_run(tmp_path, **env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


OFFLINE = os.path.join(ROOT, "tools", "offline_wheels.sh")


def _offline(*args, **env):
    return subprocess.run(["bash", OFFLINE, *args], capture_output=True, text=True, timeout=60,
                          env=_bare_env(PYTHON=sys.executable, **env))


def test_offline_wheels_help():
    proc = _offline("--help")
    assert proc.returncode == 0, proc.stderr
    assert "download DIR" in proc.stdout and "install DIR" in proc.stdout and "--python-version" in proc.stdout


def test_offline_wheels_download_commands(tmp_path):
    wheels = str(tmp_path / "wheels")
    proc = _offline("download", wheels, "--python-version", "3.12", "--platform", "manylinux_2_34_x86_64",
                    "--extras", "video", "--torch-index-url", "https://download.pytorch.org/whl/cu128", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(wheels)  # a dry run downloads nothing
    lines = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(lines) == 3, proc.stdout
    for argv in lines:
        assert argv[:4] == [sys.executable, "-m", "pip", "download"], argv
        assert _value(argv, "--dest") == wheels and "--only-binary=:all:" in argv
        assert _value(argv, "--platform") == "manylinux_2_34_x86_64" and _value(argv, "--python-version") == "3.12"
    assert _value(lines[0], "--index-url") == "https://download.pytorch.org/whl/cu128" and lines[0][-1] == "torch==2.13.0"
    deps = lines[1]
    assert _value(deps, "--find-links") == wheels and "torch==2.13.0" in deps
    for req in ("megatron-core>=0.16.1,<0.20", "safetensors", "vizdoom>=1.2", "ale-py>=0.9"):
        assert req in deps, deps
    assert "pytest>=7" not in deps  # the test extra was not asked for
    assert "setuptools>=64" in lines[2] and "pybind11>=2.10" in lines[2]


def test_offline_wheels_install_commands(tmp_path):
    proc = _offline("install", str(tmp_path), "--extras", "test", "--torch", "torch==2.7.1", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    first, second = (shlex.split(line) for line in proc.stdout.splitlines())
    for argv in (first, second):
        assert argv[:4] == [sys.executable, "-m", "pip", "install"] and "--no-index" in argv
        assert _value(argv, "--find-links") == str(tmp_path)
    assert first[-1] == "torch==2.7.1" and second[-2:] == ["-e", f"{ROOT}[test]"]


@pytest.mark.parametrize("args,message", [
    (("download",), "download needs a folder"),
    (("install", "/nonexistent/wheels"), "does not exist"),
    (("download", "/tmp/w", "--extras", "nope"), "unknown extra 'nope'"),
    (("download", "/tmp/w", "--bogus"), "unknown option '--bogus'"),
    (("upload", "/tmp/w"), "unknown command 'upload'"),
])
def test_offline_wheels_rejects_bad_usage(args, message):
    proc = _offline(*args, DRY_RUN="1" if args[0] == "download" else "0")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_megatron_lm_gpt_launcher_dry_run(tmp_path):
    """The patched-path launcher: Megatron-LM's pretrain_gpt.py with --use-dsv-attention and the given sizes."""
    script = os.path.join(ROOT, "examples", "megatron_lm", "pretrain_gpt_dsv.sh")
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), DSV_DRY_RUN="1", NPROC="2", SEQ_LEN="4096", CP="2")
    out = subprocess.run(["bash", script, "--seed", "7"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.strip()
    assert cmd.startswith(f"cd {tmp_path} && ") and "pretrain_gpt.py --use-dsv-attention" in cmd
    for piece in ("--nproc-per-node 2", "--seq-length 4096", "--context-parallel-size 2", "--attention-dropout 0.0",
                  "--dsv-cp-mode hybrid", "--seed 7"):
        assert piece in cmd, piece
    bad = subprocess.run(["bash", script], env=dict(env, SEQ_LEN="1000"), capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "SEQ_LEN=1000 must be a multiple of 128" in bad.stderr


@pytest.mark.skipif(shutil.which("pgrep") is None or shutil.which("ps") is None, reason="needs pgrep and ps (procps)")
def test_frontier_stop_ends_the_workers_but_not_the_command_that_names_them(tmp_path):
    """The device command that calls `gpu_quality_frontier.sh stop` may itself name the workers' pattern (run 14
    lost a call that way: the old pkill matched the command's own shell); stop must end a matching worker and
    leave the script's callers running."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "bench_quality.py", "--worker",
                               "fake"])
    try:
        caller = ("echo 'bench_quality.py.* --worker ' > /dev/null; "
                  f"bash {shlex.quote(os.path.join(ROOT, 'tools', 'gpu_quality_frontier.sh'))} "
                  f"{shlex.quote(str(tmp_path / 'out'))} stop; echo caller-survived")
        proc = subprocess.run(["bash", "-c", caller], capture_output=True, text=True, timeout=60,
                              env=_bare_env(PATH=os.environ.get("PATH", "/usr/bin:/bin")))
        assert "caller-survived" in proc.stdout, proc.stdout + proc.stderr
        assert "== stopped: 0 launchers and workers left" in proc.stdout, proc.stdout
        assert worker.wait(timeout=10) is not None  # ended by the stop phase's TERM
    finally:
        if worker.poll() is None:
            worker.kill()


@pytest.mark.skipif(shutil.which("pgrep") is None or shutil.which("ps") is None, reason="needs pgrep and ps (procps)")
def test_frontier_wait_reports_each_runs_progress_and_the_end(tmp_path):
    """`wait` (and `start-wait` after its launch) prints the last iteration line of every run's log, not only seed
    0's (run 15 trained seeds 5-9), and says when a launch outlives WAIT_S."""
    runs = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "tools"), runs / "tools")
    logs = runs / "runs" / "frontier-vizdoom" / "logs"
    logs.mkdir(parents=True)
    (logs / "full-s8.log").write_text(" [x] iteration   1250/3000 | ms/step 150.2\n")
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "bench_quality.py", "--launch"])
    try:
        proc = subprocess.run(["bash", str(runs / "tools" / "gpu_quality_frontier.sh"), str(tmp_path / "out"), "wait"],
                              capture_output=True, text=True, timeout=60,
                              env=_bare_env(PATH=os.environ.get("PATH", "/usr/bin:/bin"), WAIT_S="2"))
    finally:
        launcher.kill()
        launcher.wait()
    assert "vizdoom/logs/full-s8.log: it   1250/3000" in proc.stdout, proc.stdout + proc.stderr
    assert "== still training after WAIT_S" in proc.stdout


def _python3_on_path(tmp_path):
    """A bin folder whose `python3` is this interpreter (the device scripts call python3)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    return str(bin_dir) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arms,ok", [("full,default", True), ("no_such_arm", False)], ids=["trains", "fails"])
def test_frontier_preflight_trains_two_steps_or_stops_the_start(tmp_path, arms, ok):
    """`PREFLIGHT=1 ... start` first trains one worker of the first arm for 2 steps (CUDA_LAUNCH_BLOCKING=1 on a GPU):
    it launches the study only when that worked, and otherwise exits 3 with the worker's error, launching nothing
    (2026-12-06: every worker of a study died at its first step, and the study's start could not tell why)."""
    (tmp_path / "wheels").mkdir()
    env = _bare_env(PATH=_python3_on_path(tmp_path), GPU_WHEEL_DIRS=str(tmp_path / "wheels"), DATA="synthetic",
                    ARMS=arms, ARM_KEYS="frames=2,res=32,stage1=700,qk_lr=10,lr=3e-4", PREFLIGHT="1",
                    PREFLIGHT_DIR=str(tmp_path / "pf"), WIDTH="--heads 2 --head-dim 16 --layers 1", OMP_NUM_THREADS="1")
    phase = "preflight" if ok else "start"  # a passing start would launch a real study: the phase alone here
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_quality_frontier.sh"), str(tmp_path / "out"), phase],
                          capture_output=True, text=True, timeout=560, env=env)
    if ok:
        assert proc.returncode == 0 and "preflight: synthetic full trained 2 steps" in proc.stdout, \
            proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "preflight: synthetic no_such_arm FAILED" in proc.stdout and "unknown arm 'no_such_arm'" in proc.stdout
        assert "launched detached" not in proc.stdout and not (tmp_path / "out" / "synthetic").exists()


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("pgrep") is None or shutil.which("ps") is None, reason="needs pgrep and ps (procps)")
def test_frontier_start_runs_its_workers_from_a_copy_of_the_code(tmp_path):
    """A detached `start` launches its workers from a copy of the code made at the start: the next device call
    re-copies the working tree under running workers, and in run 20 a worker that started then died of
    ModuleNotFoundError. Here the repository's code is removed as soon as the start returns; the study still trains.
    The arm is DSV's default, whose worker reads video_runs.py's --speedup-table default, a JSON under
    benchmarks/results: run 21's default worker died of a copy without it. BATCH, INIT_SEED and ORDER_SEED reach the
    worker: its curve records the harness it trained in."""
    repo = tmp_path / "repo"
    for part in ("tools", "benchmarks", "megatron_dsv"):
        shutil.copytree(os.path.join(ROOT, part), repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "wheels").mkdir()
    env = _bare_env(PATH=_python3_on_path(tmp_path), GPU_WHEEL_DIRS=str(tmp_path / "wheels"), DATA="synthetic",
                    ARMS="default", SEEDS="0", STEPS="2", MAX_WORKERS="1", SKIP_GPU_TESTS="1",
                    BATCH="2", INIT_SEED="3", ORDER_SEED="1",
                    ARM_KEYS="frames=2,res=32,stage1=700,qk_lr=10,lr=3e-4", SAMPLES="8",
                    WIDTH="--heads 2 --head-dim 16 --layers 1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(repo / "tools" / "gpu_quality_frontier.sh"), str(tmp_path / "out"), "start"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=repo)
    assert proc.returncode == 0 and "launched detached" in proc.stdout, proc.stdout + proc.stderr
    shutil.rmtree(repo / "megatron_dsv")
    shutil.rmtree(repo / "benchmarks")
    pid = int(next((repo / "runs").glob("launch-synthetic-*.pid")).read_text())
    deadline = time.time() + 500
    try:
        while time.time() < deadline:
            try:
                if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                    break
            except OSError:  # ended
                break
            time.sleep(1)
    finally:
        if os.path.exists(f"/proc/{pid}"):  # past the deadline: its session (launcher and workers) ends here
            subprocess.run(["pkill", "-s", str(pid)], check=False)
    log_path = repo / "runs" / "frontier-synthetic" / "logs" / "default-s0.log"
    log = log_path.read_text() if log_path.exists() else ""
    launch_log = next((repo / "runs").glob("launch-synthetic-*.log")).read_text()
    assert "== default seed 0: 2 steps" in log, launch_log[-3000:] + log[-3000:]
    curve = json.loads((repo / "runs" / "frontier-synthetic" / "curves" / "default-s0.json").read_text())
    assert (curve["batch"], curve["init_seed"], curve["order_seed"]) == (2, 3, 1)

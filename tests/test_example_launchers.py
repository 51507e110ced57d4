"""The example launchers start from a shell whose virtualenv is not activated: they run torchrun as a
module of $PYTHON, and say what to set when that interpreter lacks megatron_dsv. Every script parses."""

import glob
import os
import re
import subprocess
import sys

import pytest

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

"""tools/run_tests.sh installs once: a second call in the same environment does not reinstall (so does
not recompile csrc/ where nvcc exists) unless setup.py, pyproject.toml, csrc/ or the DSV_* build
variables changed."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _install_only(env):
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "run_tests.sh"), "--install-only"], env=env,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, time.perf_counter() - t0


@pytest.mark.timeout(1800)
def test_second_call_does_not_reinstall():
    env = dict(os.environ)
    env.setdefault("VIRTUAL_ENV", os.path.dirname(os.path.dirname(sys.executable)))  # the venv running pytest
    _install_only(env)  # installs only if this environment has never been installed by the script
    out, seconds = _install_only(env)
    assert "install up to date" in out and "not reinstalled" in out, out
    assert seconds < 60, seconds

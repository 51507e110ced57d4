"""tools/run_tests.sh installs once: a second call in the same environment does not reinstall (so does
not recompile csrc/ where nvcc exists) unless setup.py, pyproject.toml, csrc/ or the DSV_* build
variables changed."""

import os
import subprocess
import sys
import time

import pytest

# may reinstall into the venv every test imports from: in tests/conftest.py's PROCESS_FILES

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


FAKE_TOOL = """#!/bin/sh
# logs each call; writes the -o target like a compiler would
echo "$(basename "$0") $*" >> "$DSV_FAKE_LOG"
[ "$1" = "--version" ] && { echo "fake nvcc 1.0"; exit 0; }
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && { echo built > "$2"; exit 0; }; shift; done
"""


def _fake_toolchain(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "lib64").mkdir()
    (cuda / "lib64" / "libcudart.so").write_bytes(b"")
    for tool in (cuda / "bin" / "nvcc", tmp_path / "cxx"):
        tool.write_text(FAKE_TOOL)
        tool.chmod(0o755)
    return cuda


def _build(tmp_path, cuda, **extra):
    env = {**os.environ, "CUDA_HOME": str(cuda), "CXX": str(tmp_path / "cxx"), "DSV_FORCE_CUDA_BUILD": "1",
           "DSV_CUDA_CACHE": str(tmp_path / "cache"), "DSV_FAKE_LOG": str(tmp_path / "log"), **extra}
    env.pop("DSV_SKIP_CUDA_BUILD", None)
    (tmp_path / "log").write_text("")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    built = list((tmp_path / "lib" / "megatron_dsv").glob("_C*"))
    assert len(built) == 1 and built[0].read_text() == "built\n"
    return [line for line in (tmp_path / "log").read_text().splitlines() if "--version" not in line]


def test_a_second_install_reuses_the_cuda_build(tmp_path):
    """`pip install -e .` then tools/run_tests.sh (which reinstalls with the test extras) compile csrc/ once:
    the extension is kept under a hash of csrc/, the commands and nvcc's version."""
    cuda = _fake_toolchain(tmp_path)
    first = _build(tmp_path, cuda)
    sources = [p for p in os.listdir(os.path.join(ROOT, "csrc")) if p.endswith((".cu", ".cpp"))]
    assert len(first) == len(sources) + 1  # every translation unit, then the link
    assert _build(tmp_path, cuda) == []  # nothing compiled: the cached build was copied
    assert len(_build(tmp_path, cuda, DSV_CUDA_ARCHS="80")) == len(first)  # other flags: built again
    assert len(_build(tmp_path, cuda, DSV_CUDA_CACHE="0")) == len(first)  # no cache: always built


STUB_PYTHON = """#!/bin/sh
echo "skip=${DSV_SKIP_CUDA_BUILD:-unset} $*" >> "$STUB_LOG"
"""


@pytest.mark.parametrize("skip", [None, "0"], ids=["default", "DSV_SKIP_CUDA_BUILD=0"])
def test_the_test_install_skips_the_cuda_build_without_a_gpu(tmp_path, skip):
    """A stub environment records what tools/run_tests.sh asks pip for: no CUDA build on a machine without a
    GPU (the kernels cannot run; tests/ops compiles csrc/), a build on one with a GPU or when told."""
    import torch

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(STUB_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "DSV_SKIP_CUDA_BUILD"}
    env.update(VIRTUAL_ENV=str(venv), STUB_LOG=str(tmp_path / "log"), DSV_NO_APT="1", DSV_FORCE_REINSTALL="1")
    if skip is not None:
        env["DSV_SKIP_CUDA_BUILD"] = skip
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "run_tests.sh"), "--install-only"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    install = [line for line in (tmp_path / "log").read_text().splitlines() if "install -q -e .[test]" in line]
    assert len(install) == 1, (tmp_path / "log").read_text()
    expected = skip if skip is not None else ("unset" if torch.cuda.is_available() else "1")
    assert install[0].startswith(f"skip={expected} "), install
    assert ("no GPU here" in proc.stdout) == (expected == "1"), proc.stdout

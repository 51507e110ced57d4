#!/usr/bin/env bash
# Run the test suite; on a fresh machine this also does all the set-up.
#
# Uses the active virtualenv if there is one, else creates ./.venv. Installs
# torch==2.13.0 first (the CPU wheel on machines without a GPU; never a
# multi-GB CUDA build pulled in as a dependency), then megatron_dsv with its
# test extras, then runs pytest. "No tests collected" (pytest exit 5) is a failure.
#
# The install (which compiles csrc/ when nvcc exists) is skipped when nothing it depends on
# changed since the last one in this environment: a stamp in the environment holds a hash of
# setup.py, pyproject.toml, csrc/ and the DSV_* build variables. DSV_FORCE_REINSTALL=1 reinstalls
# anyway. A reinstall reuses an extension built from the same csrc/ and flags (setup.py keeps it in
# build/cuda-ext-cache), so `pip install -e .` then this script compile csrc/ once. On a machine
# without a GPU the CUDA build is skipped (DSV_SKIP_CUDA_BUILD=1 unless set; 0 builds it): the kernels
# cannot run here and tests/ops/test_csrc_compiles.py compiles every source under csrc/ anyway. As root on Debian/Ubuntu it also installs the
# system packages of the real-Slurm and shellcheck tests (slurm-wlm, munge, shellcheck; ~15 s, once);
# elsewhere, or with DSV_NO_APT=1, those tests skip and say why.
#   bash tools/run_tests.sh [pytest args]      bash tools/run_tests.sh --install-only
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
py="$VIRTUAL_ENV/bin/python"  # the environment's own interpreter, even when VIRTUAL_ENV is set without activation

has_gpu() {
  { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } || ls /dev/nvidia[0-9]* >/dev/null 2>&1
}
if [ -z "${DSV_SKIP_CUDA_BUILD+x}" ] && ! has_gpu; then
  export DSV_SKIP_CUDA_BUILD=1
  echo "no GPU here: megatron_dsv installs without the CUDA extension (tests/ops/test_csrc_compiles.py still" \
       "compiles csrc/; DSV_SKIP_CUDA_BUILD=0 builds it)"
fi

install_key() {
  {
    cat setup.py pyproject.toml
    find csrc -type f | LC_ALL=C sort | xargs cat
    env | grep -E '^DSV_(SKIP|FORCE|CUDA)_[A-Z_]*=' | grep -v '^DSV_FORCE_REINSTALL=' | LC_ALL=C sort || true
  } | sha256sum | cut -d' ' -f1
}

stamp="$VIRTUAL_ENV/.megatron_dsv_install"
key=$(install_key)
if [ "${DSV_FORCE_REINSTALL:-0}" != "1" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] &&
   "$py" -c "import megatron_dsv, pytest" 2>/dev/null; then
  echo "megatron_dsv install up to date in $VIRTUAL_ENV (setup.py, csrc/ unchanged): not reinstalled"
else
  rm -f "$stamp"
  "$py" -m pip install -q --upgrade pip
  "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "torch==2.13.0"
  "$py" -m pip install -q -e ".[test]"
  echo "$key" > "$stamp"
fi
system_packages() {
  if [ "${DSV_NO_APT:-0}" = "1" ] || { command -v slurmctld && command -v munged && command -v shellcheck; } >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "installing slurm-wlm, munge, shellcheck (the real-Slurm and shellcheck tests)"
    { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq \
        slurm-wlm munge shellcheck; } >/dev/null 2>&1 ||
      echo "apt-get install slurm-wlm munge shellcheck failed: the real-Slurm tests will skip"
  fi
}
system_packages
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

# The tests run on DSV_TEST_WORKERS pytest-xdist workers (default: 2 where the machine has 2 cores or more, else 1; at
# most 4). A file's tests run on one worker (its module fixtures are made once), and the files that start, count or stop
# processes by name share one worker (tests/conftest.py's scheduler and PROCESS_FILES; until 2026-12-06 --dist
# loadgroup, which pytest 9 broke: every test was its own group). Tests marked "alone" (the real
# Slurm jobs: on 2 workers one's torchrun lost its c10d rendezvous store at the start, in 2 of 3 runs, never in one
# process) run afterwards in one process. The workers take the groups longest first, by the seconds in
# tests/durations.json (tools/test_durations.py writes it from a --durations=0 run). Arguments are pytest's, added to
# both runs (e.g. --durations=50).
# On CI's 2 cores, 2026-12-06: 1245 s on 2 workers, every test its own group, in xdist's order (it put one-test files
# of minutes last, on one worker), then 69 s alone (CI, ca1477b); 1000 + 72 s with the groups held, longest first
# and -G csrc compiles (.ci/run here, 2 cores).
cores=$(nproc 2>/dev/null || echo 1)
workers=${DSV_TEST_WORKERS:-$(( cores >= 2 ? 2 : 1 ))}
[ "$workers" -gt 4 ] && workers=4
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)  # tests/conftest.py's groups, longest first
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread a worker: two of torch's default 2 oversubscribe 2 cores
fi
run_pytest() {  # called as `run_pytest ... || rc=$?`: set -e does not apply inside; pytest's status is kept
  "$py" -m pytest -q --timeout=900 "$@"
}
rc=0
if [ "$workers" -gt 1 ]; then
  echo "== tests on $workers xdist workers (all but the tests marked alone)"
  run_pytest "${parallel[@]}" -m "not alone" tests "$@" || rc=$?
  echo "== the tests marked alone, in one process"
  alone_rc=0
  run_pytest -m alone tests "$@" || alone_rc=$?
  [ "$alone_rc" -ne 0 ] && [ "$alone_rc" -ne 5 ] && [ "$rc" -eq 0 ] && rc=$alone_rc
else
  run_pytest tests "$@" || rc=$?
fi
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

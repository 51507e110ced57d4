#!/usr/bin/env bash
# Run the test suite; on a fresh machine this also does all the set-up.
#
# Uses the active virtualenv if there is one, else creates ./.venv. Installs
# torch==2.13.0 first (the CPU wheel on machines without a GPU; never a
# multi-GB CUDA build pulled in as a dependency), then megatron_dsv with its
# test extras, then runs pytest. "No tests collected" (pytest exit 5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"

set +e
python -m pytest -q --timeout=900 tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"

# Sourced by the GPU scripts (tools/gpu_*.sh), from the repository root: installs the wheels carried in
# .whl/ (megatron-core and friends for the GPU machine's Python) into /tmp/site, if any, and puts them
# and the repository on PYTHONPATH; unbuffered output for the logs.
# shellcheck shell=bash
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

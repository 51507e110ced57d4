# Sourced by the GPU scripts (tools/gpu_*.sh), from the repository root: installs the wheels carried in
# .whl/ and .whl-*/ (megatron-core and friends for the GPU machine's Python; a call carries only the folders
# it needs, e.g. .whl-vizdoom/ for the ViZDoom arms, since a call's carry is capped at 64 MiB) into
# /tmp/site, if any, and puts them and the repository on PYTHONPATH; the carried footage (.footage/, from
# tools/fetch_footage.py) becomes DSV_FOOTAGE_DIR; unbuffered output for the logs.
# The folders are made once on a machine with PyPI (cp312 wheels for the GPU machine's Python 3.12):
#   w="pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64"
#   $w -d .whl megatron-core==0.16.1 ale-py==0.12.1; $w -d .whl-vizdoom vizdoom==1.3.2
#   python tools/fetch_footage.py --out .footage
#   $w -d .whl-mc019 megatron-core==0.19.2          # the PyPI 0.19.2 check (GPU_WHEEL_DIRS, never with .whl)
#   $w -d .whl-wan diffusers==0.42.1 importlib-metadata==10.2.0 lazy-importer==0.1.0 zipp==4.1.2
#     (no more: the image's huggingface_hub 1.33, safetensors, requests, regex, numpy, pillow serve diffusers. Its
#     resolved deps include huggingface_hub 2.x, which, first on PYTHONPATH, breaks the image's transformers 5.17
#     (needs < 2.0) that diffusers imports through peft, so no diffusers model imports: the Wan tests there)
# shellcheck shell=bash
# GPU_WHEEL_DIRS="DIR ..." picks the folders (default: every .whl*/ here; a warm machine keeps the folders of
# earlier calls, so name them when two folders hold different versions of one package, e.g. .whl-mc019/);
# GPU_SITE the install folder (default /tmp/site).
export PYTHONUNBUFFERED=1
if [ -n "${GPU_WHEEL_DIRS:-}" ]; then
  read -r -a _wheel_dirs <<< "$GPU_WHEEL_DIRS"
else
  _wheel_dirs=(.whl*/)
fi
_wheels=()
for _d in "${_wheel_dirs[@]}"; do
  for _w in "${_d%/}"/*.whl; do [ -e "$_w" ] && _wheels+=("$_w"); done
done
if [ "${#_wheels[@]}" -gt 0 ]; then
  if [ "$(printf '%s\n' "${_wheels[@]##*/}" | cut -d- -f1 | sort | uniq -d)" != "" ]; then
    echo "gpu_env.sh: two wheels of one package in ${_wheel_dirs[*]}; set GPU_WHEEL_DIRS to the folders to install" >&2
    exit 2
  fi
  _site=${GPU_SITE:-/tmp/site}  # another folder for a second set beside running jobs (e.g. /tmp/site019)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$_site" "${_wheels[@]}"
  export PYTHONPATH=$_site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -d .footage ]; then
  export DSV_FOOTAGE_DIR=$PWD/.footage
fi

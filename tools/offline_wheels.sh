#!/usr/bin/env bash
# Install megatron_dsv on an air-gapped cluster: download every wheel it needs on a machine with
# network, carry the folder over, install from it with no index.
#
#   bash tools/offline_wheels.sh download DIR [--python-version 3.11] [--platform manylinux_2_28_x86_64]
#                                             [--extras test,video] [--torch torch==2.13.0]
#                                             [--torch-index-url https://download.pytorch.org/whl/cu128]
#   bash tools/offline_wheels.sh install DIR [--extras test,video] [--torch torch==2.13.0]
#
# download: the dependencies are read from setup.py (install_requires plus the chosen extras), torch
# is fetched first (by default from PyPI: the CUDA build for Linux x86_64; --torch-index-url for another
# CUDA), then the build requirements of pyproject.toml, so the install can build megatron_dsv (and its
# CUDA kernels, where the cluster has nvcc) without network. Wheels only (--only-binary=:all:): they
# are picked for --python-version / --platform, not for the machine that downloads them.
# install: run from this checkout on the cluster; pip never touches an index (--no-index).
#
# Environment: PYTHON [python3] (the interpreter whose pip runs; for install, the target environment),
# DRY_RUN=1 prints the pip commands instead of running them.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEFAULT_TORCH="torch==2.13.0"

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
    echo "error: $*" >&2
    echo "run: bash tools/offline_wheels.sh --help" >&2
    exit 2
}

run() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q' "$1"
        shift
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# install_requires + extras_require[each extra] of setup.py, one requirement a line, without importing it
# (setup.py's top level would build the CUDA extension list)
requirements() {
    "$PYTHON" - "$ROOT/setup.py" "$1" <<'PY'
import ast
import sys

path, extras = sys.argv[1], [e for e in sys.argv[2].split(",") if e]
call = next(n for n in ast.walk(ast.parse(open(path).read()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
kw = {k.arg: k.value for k in call.keywords}
reqs = ast.literal_eval(kw["install_requires"])
known = ast.literal_eval(kw.get("extras_require", ast.Constant({})))
for extra in extras:
    if extra not in known:
        sys.exit(f"error: unknown extra {extra!r}; setup.py defines {sorted(known)}")
    reqs += known[extra]
seen = set()
for req in reqs:
    if not req.split(";")[0].strip().startswith("torch") and req not in seen:  # torch comes separately
        seen.add(req)
        print(req)
PY
}

# pyproject.toml's [build-system] requires: what pip's isolated build of megatron_dsv needs offline
build_requirements() {
    "$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import re
import sys

text = open(sys.argv[1]).read()
block = re.search(r"^\[build-system\](.*?)(^\[|\Z)", text, re.S | re.M).group(1)
for req in re.findall(r'"([^"]+)"', re.search(r"requires\s*=\s*\[(.*?)\]", block, re.S).group(1)):
    print(req)
PY
}

cmd_download() {
    local dir=$1
    shift
    local pyver=3.11 platform=manylinux_2_28_x86_64 extras="" torch=$DEFAULT_TORCH torch_index=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --python-version) pyver=${2:?--python-version needs a value}; shift 2 ;;
            --platform) platform=${2:?--platform needs a value}; shift 2 ;;
            --extras) extras=${2?--extras needs a value}; shift 2 ;;
            --torch) torch=${2:?--torch needs a value}; shift 2 ;;
            --torch-index-url) torch_index=${2:?--torch-index-url needs a value}; shift 2 ;;
            *) die "download: unknown option '$1'" ;;
        esac
    done
    [[ "$pyver" =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.11, got '$pyver'"
    local text reqs build_reqs
    text=$(requirements "$extras")  # a bad --extras stops here (set -e)
    mapfile -t reqs <<< "$text"
    text=$(build_requirements)
    mapfile -t build_reqs <<< "$text"
    [[ ${#reqs[@]} -gt 0 ]] || die "no requirements read from $ROOT/setup.py"
    local target=(--dest "$dir" --only-binary=:all: --platform "$platform" --python-version "$pyver"
                  --implementation cp)
    local index=()
    [[ -z "$torch_index" ]] || index=(--index-url "$torch_index")
    [[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$dir"
    run "$PYTHON" -m pip download "${target[@]}" "${index[@]}" "$torch"
    # --find-links DIR: the torch just fetched (maybe a +cuXXX build) satisfies megatron-core's torch requirement
    run "$PYTHON" -m pip download "${target[@]}" --find-links "$dir" "$torch" "${reqs[@]}"
    run "$PYTHON" -m pip download "${target[@]}" "${build_reqs[@]}" pip
    echo "wheels for Python $pyver on $platform in $dir; on the cluster: bash tools/offline_wheels.sh install $dir" \
         "${extras:+--extras $extras}" >&2
}

cmd_install() {
    local dir=$1
    shift
    local extras="" torch=$DEFAULT_TORCH
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --extras) extras=${2?--extras needs a value}; shift 2 ;;
            --torch) torch=${2:?--torch needs a value}; shift 2 ;;
            *) die "install: unknown option '$1'" ;;
        esac
    done
    [[ "${DRY_RUN:-0}" == 1 || -d "$dir" ]] || die "install: wheel folder '$dir' does not exist"
    local offline=(--no-index --find-links "$dir")
    # torch first, alone: a resolver that met it only as a dependency could never pick another build
    run "$PYTHON" -m pip install "${offline[@]}" "$torch"
    run "$PYTHON" -m pip install "${offline[@]}" -e "$ROOT${extras:+[$extras]}"
}

case "${1:-}" in
    -h|--help|help) usage ;;
    download|install)
        sub=$1
        [[ $# -ge 2 && "$2" != -* ]] || die "$sub needs a folder: bash tools/offline_wheels.sh $sub DIR"
        shift
        "cmd_$sub" "$@"
        ;;
    "") usage >&2; exit 2 ;;
    *) die "unknown command '$1' (download or install)" ;;
esac

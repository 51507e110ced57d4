#!/usr/bin/env bash
# The quality-speed frontier on one GPU (benchmarks/bench_quality.py), over back-to-back device calls.
# Usage: bash tools/gpu_quality_frontier.sh OUT_DIR PHASE
#   train   GPU tests of the local + predicted path beside (unless SKIP_GPU_TESTS=1) every (arm, seed) as
#           concurrent processes for MINUTES [7.0], saved under runs/frontier/ and resumed from there by the
#           next call (call back to back: the device machine keeps runs/ only while warm); with MEGATRON_CHECK=1
#           tools/gpu_megatron_lm_check.sh runs beside the arms (its JSON lands in OUT_DIR)
#   finish  TRAIN_MINUTES [3] more training, then each arm's step time alone (--time) and the report:
#           quality-frontier-<gpu>-<date>.json + PNGs in OUT_DIR
#   report  the report alone (curves and timing already under runs/frontier/)
# Settings (environment): ARM [ViZDoom 16K: frames=16,res=256,steps=4000,stage1=700,qk_lr=10], ARMS
# (bench_quality's default frontier), SEEDS [0,1], WIDTH ["--heads 8 --head-dim 64 --layers 4": hidden 512, the
# attention-dominated regime at 16K tokens], TIME_LENGTHS [32768]. Training uses the naive top-k (exact,
# backend-independent lists); the timing phase uses the library's auto backends, as a user runs them.
# Carry [".whl", ".whl-vizdoom"] (and ".whl-mlm", ".mlm" for MEGATRON_CHECK=1).
set -u
out=${1:?usage: gpu_quality_frontier.sh OUT_DIR PHASE}; phase=${2:?phase: train, finish or report}
mkdir -p "$out/logs"
cd "$(dirname "$0")/.." || exit 2
# shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
. tools/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
arm=${ARM:-data=vizdoom,frames=16,res=256,steps=4000,stage1=700,qk_lr=10,lr=3e-4}
read -r -a width <<< "${WIDTH:---heads 8 --head-dim 64 --layers 4}"
common=(--arm "$arm" --seeds "${SEEDS:-0,1}" --save-dir runs/frontier --out-dir "$out" --samples 256
        --val-samples 64 --val-every 250 --val-batch 8 --workers 15 "${width[@]}")
[ -n "${ARMS:-}" ] && common+=(--arms "$ARMS")
bench=(python3 benchmarks/bench_quality.py "${common[@]}")

train() {  # $1: minutes per arm
  DSV_TOPK_BACKEND=naive "${bench[@]}" --launch --arm "$arm,minutes=$1" > "$out/logs/launch.log" 2>&1
  echo "launch exit $?"
  tail -n 14 "$out/logs/launch.log"
}
case "$phase" in
  train)
    if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then  # beside the arms (small): a failure shows in the log's tail
      (timeout 240 python3 -m pytest -q tests/ops/test_topk_forced.py tests/attention/test_local_lists.py \
        tests/ops/test_topk_keys.py > "$out/logs/gpu_tests.log" 2>&1; echo "gpu tests exit $?" >> "$out/logs/gpu_tests.log") &
    fi
    if [ "${MEGATRON_CHECK:-0}" = 1 ]; then
      read -r -a tags <<< "${MEGATRON_TAGS:-}"
      (timeout 420 bash tools/gpu_megatron_lm_check.sh "$out" "${tags[@]}" > "$out/logs/megatron_lm_check.log" 2>&1;
       echo "megatron-lm check exit $?" >> "$out/logs/megatron_lm_check.log") &
    fi
    train "${MINUTES:-7.0}"
    wait
    tail -n 4 "$out/logs/gpu_tests.log" "$out/logs/megatron_lm_check.log" 2>/dev/null
    ;;
  finish)
    train "${TRAIN_MINUTES:-3}"
    timeout 240 "${bench[@]}" --time --time-lengths "${TIME_LENGTHS:-32768}" > "$out/logs/time.log" 2>&1
    echo "time exit $?"; tail -n 20 "$out/logs/time.log"
    "${bench[@]}" --report 2>&1 | tail -n 14
    ;;
  report)
    "${bench[@]}" --report 2>&1 | tail -n 14
    ;;
  *) echo "unknown phase $phase (train, finish, report)" >&2; exit 2 ;;
esac
# at most 8 files come back from a device call: the results JSON/PNGs stay, the rest goes in one tarball
cp -r runs/frontier/curves runs/frontier/logs "$out/logs/" 2>/dev/null
cp runs/frontier/timing.json "$out/logs/" 2>/dev/null
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
ls "$out"

#!/usr/bin/env bash
# DSV context parallelism on a machine with 2 or more GPUs (the 2-GPU device kind), in one call:
#   1. tests/parallel/test_cp_gpu.py: NCCL, Triton kernels, every layout vs one GPU;
#   2. benchmarks/bench_cp.py at S = 128K and 256K (H=16, D=128, head sparsity 80-98%, mean 90%);
#   3. a short CP=N video DiT training run (0.8b layer shape, 2 layers, 64K tokens, DSV hybrid CP)
#      beside the same run on one GPU: the loss lines of both are printed.
# Usage: bash tools/gpu_cp_check.sh OUT_DIR [stage ...]   stages: tests bench train (default: all)
set -u
out=${1:?usage: gpu_cp_check.sh OUT_DIR [stage ...]}; shift
stages=${*:-tests bench train}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
# shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
. tools/gpu_env.sh
ngpu=$(nvidia-smi -L | wc -l)
echo "GPUs: $ngpu"
run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -v -i "warn" "$out/$name.log" | tail -n 14
}
train_flags=(--use-dsv-attention --preset 0.8b --num-layers 2 --model-override latent_frames=64
             --model-override latent_height=64 --model-override latent_width=64 --micro-batch-size 1
             --global-batch-size 1 --train-iters 40 --dsv-stage-switch-steps 20 --log-interval 5 --no-sample
             --no-save --bf16 --dsv-cp-mode hybrid)
for s in $stages; do
  case $s in
    tests) run cp_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/parallel/test_cp_gpu.py ;;
    bench) run cp_bench 420 python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
             benchmarks/bench_cp.py --seq-lens 131072 262144 --out-dir "$out" ;;
    train) run cp_train 300 python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" -m megatron_dsv.train \
             "${train_flags[@]}" --context-parallel-size "$ngpu" --output-dir /tmp/cp_train
           run one_gpu_train 300 python3 -m megatron_dsv.train "${train_flags[@]}" --output-dir /tmp/one_train ;;
    *) echo "unknown stage $s (tests bench train)"; exit 2 ;;
  esac
done

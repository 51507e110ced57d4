#!/usr/bin/env bash
# Where a training step's time goes at the quality frontier's width (head dim 64), alone on the GPU:
#   0. the block-list top-k with the triton backend's methods "gemm" and "keys" beside the CUDA kernel;
#   1. the sparse kernels at D=64, H=8, G=128 block lists, S 16K/32K, vs same-run cuDNN and FlexAttention
#      (benchmarks/bench_sparse_attention.py -> sparse_attention-d64-<gpu>-<date>.json);
#   2. one training step per arm with its breakdown (attention, selection, predictor, profiler, rest) at the
#      frontier's model (8 heads x 64, 4 layers) at 16K and 32K tokens (benchmarks/bench_e2e.py ->
#      e2e-w512-*.json + PNG), DSV stage 2 (library defaults: local 1,1,1 + predicted) with synthetic budgets
#      around the trained density (0.18), and again with predicted lists alone (the paper's).
# Usage: bash tools/gpu_kernel_probe.sh OUT_DIR   (run it alone on the GPU: its figures are speed figures)
#   SKIP_KERNELS=1 leaves step 1 out, TOPK_ONLY=1 stops after step 0
set -u
out=${1:?usage: gpu_kernel_probe.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
# shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
. tools/gpu_env.sh
width=(--preset 0.8b --heads 8 --head-dim 64 --layers 4 --res 256 --frames 16 32
       --sparsity-min 0.74 --sparsity-max 0.9 --sparsity-mean 0.82)
# 0. the block-list selection with forced items (the default's local + predicted lists run on the triton
#    backend; the CUDA kernel takes no forced items): its methods "gemm" (auto since 2026-12-02) and "keys" beside the
#    CUDA kernel, G=128 / 128-key blocks, without forced items (their masked fill is one elementwise pass;
#    bench_topk_estimation.py: H=16, r=16, 90% sparsity)
for m in gemm keys; do
  timeout 100 python3 benchmarks/bench_topk_estimation.py --backends cuda,triton --triton-method $m --group-size 128 \
    --block-size 128 --granularity block --sizes 16384,32768,65536,131072 --triton-max-s 131072 --out "$out" \
    > "$out/probe_topk_$m.log" 2>&1
  echo "topk $m exit $?"; grep -E "^ +[0-9]+ +block" "$out/probe_topk_$m.log"
  for f in "$out"/topk_estimation-*.json; do [ -e "$f" ] && mv "$f" "${f/topk_estimation-/topk_method_$m-}"; done
done
[ "${TOPK_ONLY:-0}" = 1 ] && exit 0  # TOPK_ONLY=1: step 0 alone
if [ "${SKIP_KERNELS:-0}" != 1 ]; then  # the D=64 kernels (measured 2026-12-01; SKIP_KERNELS=1 leaves them out)
  timeout 130 python3 benchmarks/bench_sparse_attention.py --head-dim 64 --heads 8 --group-size 128 \
    --granularity block --seq-lens 16K,32K --sparsities 0.7,0.8,0.9 --out "$out" > "$out/probe_kernels.log" 2>&1
  echo "kernels exit $?"; grep -v -i warn "$out/probe_kernels.log" | tail -n 12
  for f in "$out"/sparse_attention-*.json; do [ -e "$f" ] && mv "$f" "${f/sparse_attention-/sparse_attention-d64-}"; done
fi
timeout 110 python3 benchmarks/bench_e2e.py "${width[@]}" --arms full dsv_stage2 dsv_stage1 window \
  --out-dir "$out" --tag=-w512 > "$out/probe_e2e.log" 2>&1
echo "e2e exit $?"; grep "ms/step" "$out/probe_e2e.log"
timeout 60 python3 benchmarks/bench_e2e.py "${width[@]}" --arms full dsv_stage2 --local-radius 0 0 0 \
  --out-dir "$out" --tag=-w512-predicted > "$out/probe_e2e_local.log" 2>&1
echo "e2e local exit $?"; grep "ms/step" "$out/probe_e2e_local.log"

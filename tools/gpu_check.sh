#!/usr/bin/env bash
# One GPU session: install megatron-core from carried wheels (if any), build the CUDA extension,
# run the GPU tests, the embedded-default training job and the end-to-end benchmarks.
# Usage: bash tools/gpu_check.sh OUT_DIR [stage ...]
#   stages: build tests train recall predictor topk (the default: all six), e2e (bench_e2e.py, 2.7b shape,
#   2 layers, 16K-128K tokens), topksample (the Triton top-k's "sample" method: its GPU tests, then the
#   selection benchmark beside the CUDA kernel, "search" at 16K in the same run, then its tests on the GPU),
#   sweep (bench_sparse_attention.py --sweep: D x G x granularity x S x sparsity against cuDNN and Flex, ~5 min),
#   e2etok (bench_e2e's full and stage-2 arms with token lists, as e2e otherwise),
#   topkkeys (the Triton top-k's method "keys", its "auto" for block lists: its tests on the GPU, then beside the
#   CUDA kernel at every S, G=32 / block 64 and G=128 / block 128, and "search" at 16K in the same run)
#   smallg (the G = 32 / 64 kernel variants waiting for a decision, ~3 min: their GPU tests, then the token sweep at
#   D = 128, 64K, 90%, G = 32 / 64 on video and random lists and G = 32 over 64- and 128-key blocks (--candidates:
#   ms_fwd_kt* beside ms_fwd_rowmajor, ms_pack_atomic beside ms_pack)), d256tune (bench_sparse_attention.py --tune
#   at D = 256, G = 128, then its 64K point), d256 (the same 64K point, block and token lists, on the defaults and
#   against FlexAttention: issue 26's 1.15x), g128 (that point at D = 128, G = 128: issue 26's token 5.5x and
#   block 1.15x Flex), artifact (bench_artifact.py: our token
#   lists against the DSV artifact's kernel at G = 32 / 64 / 128, 64K, 90%; ARTIFACT_DIR [.artifact] = the root of
#   a checkout of NetX-lab/DSV at branch ae, carried in an ignored folder, never committed; ARTIFACT_ARGS: other
#   bench_artifact.py arguments, e.g. "--groups 32 --seq-lens 16K,32K,128K"), tok32 (the token
#   forward's and dq kernel's tiles at G = 32 on video lists, 64K, 90% (--tune), then that point on the winners:
#   run 24's artifact forward was 10-12% faster than ours there),
#   topk3x (the Triton top-k against the CUDA kernel as issue 26's 3x target reads, ~3 min: the GPU tests of
#   "sample" and the selection kernel, then token lists (G = 32, "sample", with its kernels timed apart) at
#   16K-128K, its candidates (bench_topk_estimation.TRITON_CANDIDATES, each with how many list entries differ
#   from the CUDA kernel's) at 16K and 64K, and the library's block
#   lists (G = 128, blocks of 128, auto = "keys" on tensor cores since run 27) at 16K-128K, each beside the CUDA kernel in the same run)
#   topkprof (~2 min: ncu's sections for the Triton top-k's token-list kernels at 64K, G = 32, second call: where the
#   window and write passes' time goes, NOTES_topk_estimation run 28; needs ncu's counters: Firecracker machines)
#   topkstore (~4 min: the GPU tests of "sample"'s copied searches, sliced fallback and scan_store, then token lists
#   at 16K-128K, the default (keys carried through the scan, inline-PTX store) beside the passes without scan_store
#   and the CUDA kernel)
#   topkblock (~2 min: the Triton top-k's block lists scored on tensor cores, method "keys" with dot="tc": every
#   test of tests/ops/test_topk_keys.py on the GPU (its rc printed), then G = 128 / blocks of 128 at 16K-128K, the
#   default (since run 27 "keys" on tensor cores, 64 x 256-token tiles), "gemm" (the default before) and four
#   tilings of the new scoring beside the CUDA kernel: bench_topk_estimation.TRITON_BLOCK_CANDIDATES)
#   topkpass (~5 min: token lists, G = 32, the passes over every item of "sample" (its window pass) and the write
#   pass on resolve_pass_tile's tiles and others (bench_topk_estimation.PASS_TILES; 16 x 64 the fused kernel's before
#   run 27): every test of tests/ops/test_topk_sample.py on the GPU, then 16K / 32K / 64K / 128K beside the CUDA
#   kernel, each row's kernels timed apart in its "phases")
#   models (every test of tests/models and the local-list tests on the GPU host, not only the gpu-marked ones:
#   with GPU_WHEEL_DIRS=".whl-mc019 .whl-wan" it checks megatron-core 0.19.2 and the Wan bf16 test against
#   diffusers; .whl-mc019 = megatron-core 0.19.2, .whl-wan = diffusers 0.42.1 and its pure-Python deps)
# Each stage logs to OUT_DIR/<stage>.log and a failing stage does not stop the others.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [stage ...]}; shift
stages=${*:-build tests train recall predictor topk}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
. tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 12 "$out/$name.log"
}
for s in $stages; do
  case $s in
    build) run build 300 env DSV_FORCE_CUDA_BUILD=1 python3 setup.py -q build_ext --inplace ;;
    tests) run tests 450 python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention tests/models \
             tests/training tests/ops/test_topk_estimation.py -k "not slow" ;;
    train) run train 240 python3 -m megatron_dsv.train --use-dsv-attention --output-dir /tmp/dsv_default
           cp /tmp/dsv_default/samples/*.gif "$out/" 2>/dev/null ;;
    recall) run recall 420 python3 benchmarks/bench_recall.py --preset 0.8b --layers 12 --grid 16 64 64 --batch 1 \
              --steps 1300 --stage1-steps 1050 --lr 5e-4 --warmup 100 --profile-every 25 --log-every 100 \
              --predictor-input qk --background texture \
              --speedup-table benchmarks/results/sparse_attention-h200-20261130.json --out-dir "$out" ;;
    predictor) run predictor 120 python3 benchmarks/profile_predictor.py ;;
    topk) run topk 300 sh -c "python3 benchmarks/bench_topk_estimation.py --triton-max-s 16384 --out '$out' && \
            python3 benchmarks/bench_topk_estimation.py --group-size 128 --block-size 128 \
              --backends cuda,torch_topk --out '$out'" ;;
    e2e) run e2e 280 python3 benchmarks/bench_e2e.py --preset 2.7b --layers 2 --frames 16 32 64 128 --res 256 \
           --out-dir "$out" ;;
    topksample) run topksample 130 sh -c "python3 benchmarks/bench_topk_estimation.py --backends cuda,triton \
                    --triton-method sample --sizes 16384,65536,131072 --triton-max-s 131072 --out '$out/sample'; \
                  python3 benchmarks/bench_topk_estimation.py --backends triton --triton-method search \
                    --sizes 16384 --out '$out/search'; python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_topk_sample.py" ;;
    e2etok) run e2etok 280 python3 benchmarks/bench_e2e.py --preset 2.7b --layers 2 --frames 16 32 64 128 --res 256 \
              --granularity token --arms full dsv_stage2 --tag=-token --out-dir "$out" ;;
    topkkeys) run topkkeys 300 sh -c "python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_topk_keys.py; \
              python3 benchmarks/bench_topk_estimation.py --backends cuda,triton --triton-method keys \
                --granularity block --sizes 16384,32768,65536,131072 --triton-max-s 131072 --out '$out/g32' && \
              python3 benchmarks/bench_topk_estimation.py --backends triton --triton-method search \
                --granularity block --sizes 16384 --out '$out/search' && \
              python3 benchmarks/bench_topk_estimation.py --backends cuda,triton --group-size 128 --block-size 128 \
                --triton-method keys --granularity block --sizes 16384,32768,65536,131072 --triton-max-s 131072 \
                --out '$out/g128'" ;;
    models) run models 300 python3 -m pytest -q -p no:cacheprovider -rs tests/models tests/attention/test_local_lists.py \
              tests/ops/test_topk_forced.py ;;
    sweep) run sweep 420 python3 benchmarks/bench_sparse_attention.py --sweep --warm-shards 8 --time-budget-s 300 \
             --out "$out" ;;
    smallg) run smallg 240 sh -c "python3 -m pytest -q -p no:cacheprovider tests/ops/test_sparse_attention_gpu.py \
              -k 'keys_as_rows or packing_by_runs'; b='python3 benchmarks/bench_sparse_attention.py --sweep \
              --seq-lens 64K --sparsities 0.9 --no-flex --head-dim 128 --candidates'; for l in video random; do \
              \$b --granularity token --group-size 32,64 --lists \$l --out '$out/smallg-'\$l; done; \
              \$b --granularity block --group-size 32 --block-sizes 64,128 --out '$out/smallg-block'" ;;
    d256) run d256 240 python3 benchmarks/bench_sparse_attention.py --sweep --head-dim 256 --group-size 128 \
            --seq-lens 64K --sparsities 0.9 --out "$out/d256" ;;
    artifact) read -r -a aargs <<< "${ARTIFACT_ARGS:-}"
              run artifact 300 python3 benchmarks/bench_artifact.py --artifact-dir "${ARTIFACT_DIR:-.artifact}" \
                "${aargs[@]}" --out "$out/artifact" ;;
    tok32) run tok32 300 python3 benchmarks/bench_sparse_attention.py --tune --head-dim 128 --group-size 32 \
             --granularity token --lists video --seq-lens 64K --sparsities 0.9 --out "$out/tok32" ;;
    g128) run g128 300 sh -c "b='python3 benchmarks/bench_sparse_attention.py --sweep --head-dim 128 --group-size 128 \
            --seq-lens 64K --sparsities 0.9'; \$b --out '$out/g128'; \$b --lists video --granularity token \
            --out '$out/g128-video'" ;;
    d256tune) run d256tune 540 python3 benchmarks/bench_sparse_attention.py --tune --head-dim 256 --group-size 128 \
                --seq-lens 64K --sparsities 0.9 --no-flex --time-budget-s 480 --out "$out/d256tune" ;;
    topk3x) run topk3x 360 sh -c "python3 -m pytest -q -p no:cacheprovider tests/ops/test_topk_sample.py \
              tests/ops/test_topk_select_kernel.py; b='python3 benchmarks/bench_topk_estimation.py --backends cuda,triton \
              --sizes 16384,32768,65536,131072 --triton-max-s 131072'; \$b --granularity token --triton-method sample \
              --out '$out/topk3x-token'; \$b --granularity token --triton-method sample --sizes 16384,65536 \
              --backends cuda,triton_loop,triton_tc,triton_pack4 \
              --out '$out/topk3x-candidates'; \
              \$b --granularity block --group-size 128 --block-size 128 --out '$out/topk3x-block'" ;;
    topkpass) run topkpass 480 sh -c "python3 -m pytest -q -p no:cacheprovider tests/ops/test_topk_sample.py; \
                 echo pytest rc=\$?; \
                 python3 benchmarks/bench_topk_estimation.py --granularity token --group-size 32 \
                 --backends cuda,triton,triton_pass16x64,triton_pass32x64,triton_pass64x32,triton_pass128x32 \
                 --sizes 16384,32768,65536,131072 --triton-max-s 131072 --out '$out/topkpass'" ;;
    topkprof) run topkprof 300 ncu --clock-control none -k 'regex:_ss_window|_tk_write|_ss_kth|_ss_thresholds' -s 4 -c 4 \
                --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
                --section InstructionStats --section SchedulerStats --section MemoryWorkloadAnalysis \
                python3 benchmarks/profile_topk.py --backend triton --S 65536 ;;
    topkstore) run topkstore 300 sh -c "python3 -m pytest -q -p no:cacheprovider tests/ops/test_topk_sample.py \
               -k 'gpu or sliced or many_tiles or copied or scan_store'; echo pytest rc=\$?; \
               python3 benchmarks/bench_topk_estimation.py --granularity token --group-size 32 \
               --backends cuda,triton,triton_tl_store \
               --sizes 16384,32768,65536,131072 --triton-max-s 131072 --out '$out/topkstore'" ;;
    topkblock) run topkblock 300 sh -c "python3 -m pytest -q -p no:cacheprovider tests/ops/test_topk_keys.py; \
                 echo pytest rc=\$?; \
                 python3 benchmarks/bench_topk_estimation.py --granularity block --group-size 128 --block-size 128 \
                 --backends cuda,triton,triton_gemm,triton_keys_tc,triton_keys_tc_g32,triton_keys_tc_g64,triton_keys_tc_g128 \
                 --sizes 16384,32768,65536,131072 --triton-max-s 131072 --out '$out/topkblock'" ;;
    *) echo "unknown stage $s (build tests train recall predictor topk e2e e2etok topksample topkkeys models sweep" \
            "smallg d256 d256tune g128 artifact tok32 topk3x topkblock topkpass topkprof topkstore)"; exit 2 ;;
  esac
done

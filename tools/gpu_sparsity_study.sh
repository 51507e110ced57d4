#!/usr/bin/env bash
# The sparsity study and the quality comparison on one GPU (issue: make DSV run sparse).
# Usage: bash tools/gpu_sparsity_study.sh OUT_DIR STAGE
#   study    ViZDoom 32K (long arm) + six 8K arms (sources, QK-norm, lr, RoPE base), concurrently
#   quality  full vs DSV vs window on ViZDoom 8K (QUALITY_ARM overrides the data arm)
#   all      study and quality at once (what the 2026-12-01 run did)
#   long     ViZDoom 32K with and without QK-norm, saved under runs/sparsity/ and resumed from there:
#            call it again within the device machine's warm window and the runs continue
#   ablate   the 8K lr and RoPE-base arms the 2026-12-01 run could not reach
#   screen   levers on the rate at which sparsity grows, at 8K (lr 1e-3, RoPE base 1e5, 64 clips, 8 layers,
#            no QK-norm at lr 1e-3), beside a resumable ViZDoom 32K arm on 64 clips and 6 layers (`lead`),
#            and the GPU tests (CUDA extension built first); call `lead` next to continue the 32K arm
#   lead     continue the 32K 64-clip 6-layer arm from runs/sparsity/ (back-to-back calls on a warm machine)
#   long8k   two long 8K arms on 64 ViZDoom clips, alone on the GPU, resumed from runs/sparsity/ by the next
#            call: QK-norm as usual, and QK-norm gains at 10x the learning rate (does the logits' scale
#            limit the rate?); stage 2 from step 3000; sweeps over t every 1000 steps
#   qklr     the follow-up of long8k's finding (QK-norm gains at 10x lr: sparser and a lower loss): the 8K arm
#            at 30x, the 32K 6-layer arm at 10x (both resumable from runs/sparsity/), and full vs DSV vs window
#            at 10x on ViZDoom 8K for quality (bench_quality.py)
#   main32   the arms above trained their bf16 weights in place, so every AdamW step under half a bf16 spacing
#            was lost (norm gains at 1.0 never moved at lr 3e-4); the study now keeps fp32 main weights as
#            Megatron does. Re-measures, resumable from runs/sparsity/: 8K at qk_lr 1 and 10 (against long8k's
#            in-place arms) and 32K with 6 layers at qk_lr 1, beside the CUDA build and the GPU tests
#            (SKIP_GPU_TESTS=1 on the back-to-back second call)
#   lists    after main32: where the kept keys go. The 8K and 32K (6 layers) arms with gains at 10x lr (the
#            sparsest healthy arm, whose plateau comes within ~2000 steps; the 32K arm enters stage 2 at
#            step 1500), both on fp32 main weights and resumable, whose sweeps split the budgets' density
#            into a query's need, 32-query token lists, the cube as tokens and as blocks, and the
#            predictor's own lists; beside them full vs DSV vs window at 8K for quality (bench_quality.py,
#            fp32 main weights, 2000 steps) and the CUDA build + GPU tests; RESUME=1 on the back-to-back
#            second call runs only the two resumable arms
#   lists32k the 32K arm of `lists` alone, resumed (session 5's third call: 1243 -> 2669 steps)
#   tokens   after lists: the 32K 6-layer arm of `lists` (gains at 10x lr, stage 2 from 1500) with token lists
#            (DSV's granularity 'token', the paper's) instead of 128-key blocks, alone on the GPU and resumable
#            from runs/sparsity/ (call it back to back): at 32K the sparsest layer's oracle cube list keeps 0.10 of
#            the keys as tokens and 0.20 as blocks, its predictor budgets 0.33; does the dispatcher (same 0.8
#            threshold, same 0.96 recall, the measured token-list speedups) run it sparse with token lists?
#   footage  the first real camera footage (data=footage: tools/fetch_footage.py's videos, carried in .footage/):
#            the `lists` recipe (gains at 10x lr, fp32 main weights; 72 clips, 12 held out) at 32K with 6 layers
#            (stage 2 from 1500) and at 8K with 4 layers, both resumable from runs/sparsity/, beside full vs DSV
#            vs window at 8K for quality (2000 steps); RESUME=1 on the back-to-back calls runs only the two
#            resumable arms.
#            Carry [".whl", ".footage"] (the ViZDoom wheel in .whl-vizdoom/ is not needed and would overflow
#            the 64 MiB carry with the footage)
# Installs carried wheels (.whl/ and .whl-*/: megatron-core, ale-py; vizdoom in .whl-vizdoom/) if any.
# Arms run as concurrent processes on the one GPU: the small 8K arms are launch-bound and fill the
# gaps the 32K arm leaves. Logs: OUT_DIR/<arm group>.log; JSON + PNG: OUT_DIR.
set -u
out=${1:?usage: gpu_sparsity_study.sh OUT_DIR STAGE}; stage=${2:?stage: study or quality}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export DSV_TOPK_BACKEND=${DSV_TOPK_BACKEND:-naive}
# shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
. tools/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
study="timeout 560 python3 benchmarks/bench_sparsity_emergence.py --out-dir $out --samples 256 --workers 5"
quality="timeout 560 python3 benchmarks/bench_quality.py --out-dir $out --samples 256 --workers 5"
small=data=vizdoom,frames=32,res=128,steps=4000,stage1=3000,minutes=${SMALL_MINUTES:-1.1}
study32k() { $study --tag=-32k --arm data=vizdoom,frames=32,res=256,steps=8000,stage1=5000,minutes=${MINUTES:-7.6} \
  > "$out/study32k.log" 2>&1; }
study8k() { $study --tag=-8k --arm $small --arm ${small/vizdoom/ale} --arm ${small/vizdoom/synthetic} \
  --arm $small,qk_norm=0 --arm $small,lr=1e-3 --arm $small,rope=100000 > "$out/study8k.log" 2>&1; }
quality8k() { $quality --samples-out "$out/samples" \
  --arm "${QUALITY_ARM:-data=vizdoom,frames=32,res=128,steps=1500,stage1=750,minutes=2.2}" > "$out/quality.log" 2>&1; }
long=data=vizdoom,frames=32,res=256,steps=20000,stage1=15000,minutes=${MINUTES:-8.2}
long32k() { $study --tag=-32k-long --save-dir runs/sparsity --arm $long > "$out/long.log" 2>&1 &
  $study --tag=-32k-long-noqknorm --save-dir runs/sparsity --arm $long,qk_norm=0 > "$out/long-noqk.log" 2>&1 &
  wait; }
ablate8k() { $study --tag=-8k-ablate --arm $small,lr=1e-3 --arm $small,rope=100000 --arm $small \
  > "$out/ablate.log" 2>&1; }
lead=data=vizdoom,frames=32,res=256,steps=20000,stage1=15000,label=vizdoom-dsv-S32K-64clips-6layers
lead32k() { $study --tag=-32k-lead --samples 64 --layers 6 --save-dir runs/sparsity \
  --arm $lead,minutes=${MINUTES:-8.2} > "$out/lead.log" 2>&1; }
screen8k() {  # one process per lever: samples and layers are run-level settings
  local m=${SCREEN_MINUTES:-7.8} big=data=vizdoom,frames=32,res=128,steps=20000,stage1=15000
  $study --tag=-8k-lr --arm $big,lr=1e-3,minutes=$m > "$out/screen-lr.log" 2>&1 &
  $study --tag=-8k-rope --arm $big,rope=100000,minutes=$m > "$out/screen-rope.log" 2>&1 &
  $study --tag=-8k-64clips --samples 64 --arm $big,minutes=$m,label=vizdoom-dsv-S8K-64clips \
    > "$out/screen-64clips.log" 2>&1 &
  $study --tag=-8k-8layers --layers 8 --arm $big,minutes=$m,label=vizdoom-dsv-S8K-8layers \
    > "$out/screen-8layers.log" 2>&1 &
  $study --tag=-8k-noqk-lr --arm $big,qk_norm=0,lr=1e-3,minutes=$m > "$out/screen-noqk-lr.log" 2>&1 &
  wait; }
long8k() {
  local arm=data=vizdoom,frames=32,res=128,steps=40000,stage1=3000,minutes=${MINUTES:-8.2}
  local run="timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir $out --samples 64 --workers 7"
  $run --tag=-8k-long --save-dir runs/sparsity --arm $arm,label=vizdoom-dsv-S8K-64clips-long > "$out/long8k.log" 2>&1 &
  $run --tag=-8k-long-qklr10 --save-dir runs/sparsity --arm $arm,qk_lr=10,label=vizdoom-dsv-qklr10-S8K-64clips-long \
    > "$out/long8k-qklr10.log" 2>&1 &
  wait; }
qklr() {
  local run="timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir $out --samples 64 --workers 5"
  $run --tag=-8k-qklr30 --save-dir runs/sparsity \
    --arm data=vizdoom,frames=32,res=128,steps=40000,stage1=3000,qk_lr=30,minutes=${MINUTES:-8.2},label=vizdoom-dsv-qklr30-S8K-64clips \
    > "$out/qklr30.log" 2>&1 &
  $run --tag=-32k-qklr10 --layers 6 --save-dir runs/sparsity \
    --arm data=vizdoom,frames=32,res=256,steps=40000,stage1=3000,qk_lr=10,minutes=${MINUTES:-8.2},label=vizdoom-dsv-qklr10-S32K-64clips-6layers \
    > "$out/qklr10-32k.log" 2>&1 &
  timeout 585 python3 benchmarks/bench_quality.py --out-dir "$out" --samples 64 --workers 5 \
    --arm "data=vizdoom,frames=32,res=128,steps=3000,stage1=1500,qk_lr=10,minutes=2.6" > "$out/quality-qklr10.log" 2>&1 &
  wait; }
main32() {
  local run="timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir $out --samples 64 --workers 4"
  local arm=data=vizdoom,frames=32,steps=40000,stage1=3000,minutes=${MINUTES:-8.2}
  $run --tag=-8k-main32 --save-dir runs/sparsity --arm $arm,res=128,label=vizdoom-dsv-S8K-64clips-main32 \
    > "$out/main32-8k.log" 2>&1 &
  $run --tag=-8k-main32-qklr10 --save-dir runs/sparsity \
    --arm $arm,res=128,qk_lr=10,label=vizdoom-dsv-qklr10-S8K-64clips-main32 > "$out/main32-8k-qklr10.log" 2>&1 &
  $run --tag=-32k-main32 --layers 6 --save-dir runs/sparsity \
    --arm $arm,res=256,label=vizdoom-dsv-S32K-64clips-6layers-main32 > "$out/main32-32k.log" 2>&1 &
  wait; }
lists_arm=data=vizdoom,frames=32,steps=40000,stage1=3000,qk_lr=10
lists32k_arm=$lists_arm,res=256,stage1=1500,label=vizdoom-dsv-qklr10-S32K-64clips-6layers-lists
lists32k() { timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir "$out" --samples 64 --workers 4 \
  --tag=-32k-lists --layers 6 --save-dir runs/sparsity --arm "$lists32k_arm,minutes=${MINUTES:-8.2}" \
  > "$out/lists-32k.log" 2>&1; }
lists() {
  timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir "$out" --samples 64 --workers 4 \
    --tag=-8k-lists --save-dir runs/sparsity \
    --arm "$lists_arm,res=128,minutes=${MINUTES:-8.2},label=vizdoom-dsv-qklr10-S8K-64clips-lists" \
    > "$out/lists-8k.log" 2>&1 &
  lists32k &
  [ -n "${RESUME:-}" ] || timeout 585 python3 benchmarks/bench_quality.py --out-dir "$out" --samples 64 --workers 4 \
    --samples-out "$out/samples" --arm "data=vizdoom,frames=32,res=128,steps=2000,stage1=1000,minutes=3.0" \
    > "$out/quality-main32.log" 2>&1 &
  wait; }
tokens() {  # 7.8 min of training leaves the final sweep (token-list ranking, full rank) and the save inside 585 s
  local label=vizdoom-dsv-qklr10-tokenlists-S32K-64clips-6layers
  timeout 585 python3 benchmarks/bench_sparsity_emergence.py --out-dir "$out" --samples 64 --workers 6 \
    --tag=-32k-tokens --layers 6 --save-dir runs/sparsity \
    --arm "${lists32k_arm%,label=*},gran=token,minutes=${MINUTES:-7.8},label=$label" > "$out/tokens-32k.log" 2>&1; }
footage_arm=data=footage,frames=32,steps=40000,qk_lr=10
footage() {  # 72 training clips and 12 held out: 6 and 1 per video (clip i is of video i % 12)
  [ -n "${DSV_FOOTAGE_DIR:-}" ] || { echo "footage: no .footage/ carried (python tools/fetch_footage.py --out .footage)"; exit 2; }
  # every video checked and counted first (~2 s): this machine's OpenCV must give the pinned frame counts
  python3 -c "from megatron_dsv.data.footage import FOOTAGE, check_video
for n in FOOTAGE: check_video(n)
print(len(FOOTAGE), 'footage videos decode to their pinned frame counts')" || { echo "footage: a video does not decode here"; exit 2; }
  local run="timeout 575 python3 benchmarks/bench_sparsity_emergence.py --out-dir $out --samples 72 --val-samples 12 --workers 4"
  $run --tag=-32k-footage --layers 6 --save-dir runs/sparsity \
    --arm "$footage_arm,res=256,stage1=1500,minutes=${MINUTES:-8.0},label=footage-dsv-qklr10-S32K-72clips-6layers" \
    > "$out/footage-32k.log" 2>&1 &
  $run --tag=-8k-footage --save-dir runs/sparsity \
    --arm "$footage_arm,res=128,stage1=3000,minutes=${MINUTES:-8.0},label=footage-dsv-qklr10-S8K-72clips" \
    > "$out/footage-8k.log" 2>&1 &
  [ -n "${RESUME:-}" ] || timeout 575 python3 benchmarks/bench_quality.py --out-dir "$out" --samples 72 --val-samples 12 \
    --workers 4 --samples-out "$out/samples" \
    --arm "data=footage,frames=32,res=128,steps=2000,stage1=1000,qk_lr=10,minutes=3.0" > "$out/quality-footage.log" 2>&1 &
  wait; }
gputests() {  # build + tests end by 560 s, inside the device's 600 s beside 585 s arms
  local t0; t0=$(date +%s)
  timeout 300 env DSV_FORCE_CUDA_BUILD=1 python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1
  echo "== build rc=$?"; tail -n 5 "$out/build.log"
  timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/attention \
    tests/models tests/training -k "not slow" > "$out/tests.log" 2>&1; echo "== gpu tests rc=$?"; tail -n 15 "$out/tests.log"; }
case $stage in
  study) study32k & study8k & wait ;;
  quality) quality8k ;;
  all) study32k & study8k & quality8k & wait ;;
  long) long32k ;;
  ablate) ablate8k ;;
  screen) lead32k & screen8k & gputests & wait ;;
  lead) lead32k ;;
  long8k) long8k ;;
  qklr) qklr ;;
  lists) lists & { [ -n "${RESUME:-}" ] || gputests; } & wait ;;
  lists32k) lists32k ;;
  tokens) tokens ;;
  footage) footage ;;
  main32) main32 & { [ -n "${SKIP_GPU_TESTS:-}" ] || gputests; } & wait ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
for f in "$out"/*.log; do echo "== $f"; grep -E "^==|^val loss|iteration .*(000|500)/|sweep at|resumed|Error|error:" "$f" | tail -n 25; done
# the device returns at most 8 files: logs, per-call plots and sample grids travel as one archive, the JSONs
# (merge them with bench_sparsity_emergence.py --merge) and the quality plot stay files
tar -czf "$out/extras.tgz" -C "$out" $(cd "$out" && ls -d *.log sparsity_emergence*.png samples 2>/dev/null) \
  && rm -rf "$out"/*.log "$out"/sparsity_emergence*.png "$out/samples"

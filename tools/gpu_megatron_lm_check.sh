#!/usr/bin/env bash
# The user's Megatron-LM path on the GPU machine: for each tag, unpack the carried Megatron-LM tarball,
# apply the patch set, and run examples/megatron_lm/pretrain_gpt_dsv.sh and examples/video_dit/pretrain_video_dit.sh
# (2 layers, hidden 512, 4096 tokens, 20 iterations, DSV stage 2 from iteration 4 with a test-only low
# threshold so that layers run sparse) twice uninterrupted and once stopped at iteration 10 (--exit-interval)
# and resumed (--load); compare the per-iteration losses (tools/megatron_lm_check.py), print one line per
# check and write OUT/megatron_lm-<gpu>-<yyyymmdd>.json (plus OUT/megatron_lm_rows.jsonl and the runs' logs in
# OUT/megatron_lm_logs.tgz).
#   bash tools/gpu_megatron_lm_check.sh OUT [TAG ...]     TAG: core_v0.16.1 core_v0.19.0 (default: both)
# Carried (ignored folders of the checkout): .mlm/Megatron-LM-<tag>.tgz (copies of ../shared/megatron-lm/;
# MLM_TARBALLS names another folder),
# .whl/ (megatron-core 0.16.1 cp312) and .whl-mlm/ (pydantic & co.), installed by tools/gpu_env.sh.
# megatron.core comes from the unpacked tree itself (each script runs from it), so 0.19.0 needs no wheel.
# All runs of a phase go at once (one GPU holds them easily): ~4 minutes in all on one H200 for both tags
# (measured: 12 first-phase runs ~130 s, the 4 resumes ~100 s, start-up bound). Every run has a time
# limit (RUN_LIMIT seconds, default 270; two phases: under the 10-minute call limit in the worst case), so nothing hangs;
# a failing run shows the tail of its log.
# DRY_RUN=1 prints the commands instead of running them. Exit status: 0 when every check is ok.
set -u
out=${1:?usage: gpu_megatron_lm_check.sh OUT [TAG ...]}; shift
tags=${*:-core_v0.16.1 core_v0.19.0}
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
mkdir -p "$out" && out=$(cd "$out" && pwd)
RUN_LIMIT=${RUN_LIMIT:-270}; ITERS=20; EXIT_AT=10
for c in git tar make timeout python3; do
  command -v "$c" > /dev/null || { echo "FAIL: the command '$c' is missing on this machine"; exit 2; }
done
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  # shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
  . tools/gpu_env.sh
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "warning: no nvidia-smi"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
fi
work=$(mktemp -d /tmp/dsv-mlm-check.XXXXXX)
rows=$out/megatron_lm_rows.jsonl
: > "$rows"
echo "== megatron_lm check: tags $tags; logs in $out/logs, trees and checkpoints in $work"
mkdir -p "$out/logs"

# The tiny shared shape and the DSV settings that reach sparse layers within 20 iterations (test only).
dsv_flags=(--dsv-budget-rule sparsity --dsv-sparsity-threshold 0.05 --dsv-theta 0.5 --dsv-profile-interval 3
           --seed 1234)
common_env=(NPROC=1 "ITERS=$ITERS" SWITCH=4 SAVE_INTERVAL=1000 LOG_INTERVAL=1 "EVAL_INTERVAL=$EXIT_AT" EVAL_ITERS=2
            LAYERS=2 HIDDEN=512 HEADS=4 PYTHON=python3)

declare -A pids=() tree=()
launch() {  # launch NAME TAG SCRIPT RUN_DIR EXTRA... : one run in the background, log in $out/logs/NAME.log
  local name=$1 tag=$2 script=$3 dir=$4; shift 4
  local cmd
  case $script in
    gpt) cmd=(env "${common_env[@]}" MEGATRON_LM="${tree[$tag]}" OUT="$dir" SEQ_LEN=4096
              bash "$repo/examples/megatron_lm/pretrain_gpt_dsv.sh" "${dsv_flags[@]}" "$@") ;;
    video) cmd=(env "${common_env[@]}" MEGATRON_LM="${tree[$tag]}" OUT="$dir" PRESET=tiny HEAD_DIM=128 FRAMES=16
                SIZE=32 LR=1e-4 bash "$repo/examples/video_dit/pretrain_video_dit.sh" "${dsv_flags[@]}" "$@") ;;
  esac
  if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "[$name] ${cmd[*]}"; return; fi
  timeout -k 10 "$RUN_LIMIT" "${cmd[@]}" > "$out/logs/$name.log" 2>&1 < /dev/null &
  pids[$name]=$!
}
wait_all() {  # wait for every launched run; report the ones that failed
  local name rc
  for name in "${!pids[@]}"; do
    wait "${pids[$name]}"; rc=$?
    if (( rc != 0 )); then
      echo "-- $name exited with $rc$( ((rc == 124)) && echo " (killed after ${RUN_LIMIT}s)"); its log ends:"
      tail -n 15 "$out/logs/$name.log" | sed 's/^/     /'
    fi
  done
  pids=()
}

ready=()
for tag in $tags; do
  tgz=${MLM_TARBALLS:-$repo/.mlm}/Megatron-LM-$tag.tgz
  if [[ ! -f "$tgz" ]]; then
    echo "FAIL $tag: $tgz is missing (copy ../shared/megatron-lm/Megatron-LM-$tag.tgz to .mlm/ and carry .mlm)"
    continue
  fi
  mkdir -p "$work/$tag"
  if ! tar xzf "$tgz" -C "$work/$tag" || ! python3 tools/apply_patches.py --tag "$tag" "$work/$tag/Megatron-LM" \
      > "$out/logs/apply-$tag.log" 2>&1; then
    echo "FAIL $tag: unpacking or patching failed:"; tail -n 8 "$out/logs/apply-$tag.log" | sed 's/^/     /'
    continue
  fi
  # Megatron compiles its dataset helpers (make) at start-up in the tree: once here, not by six runs at once
  if [[ "${DRY_RUN:-0}" != 1 ]] && ! make -C "$work/$tag/Megatron-LM/megatron/core/datasets" \
      > "$out/logs/make-$tag.log" 2>&1; then
    echo "FAIL $tag: Megatron's dataset helpers do not compile (g++, pybind11?):"
    tail -n 8 "$out/logs/make-$tag.log" | sed 's/^/     /'
    continue
  fi
  tree[$tag]=$work/$tag/Megatron-LM
  ready+=("$tag")
done

t0=$(date +%s)
for tag in "${ready[@]}"; do  # phase 1: both uninterrupted runs and the first part of the interrupted one
  for script in gpt video; do
    launch "$tag-$script-a" "$tag" $script "$work/$tag/$script-a"
    launch "$tag-$script-b" "$tag" $script "$work/$tag/$script-b"
    launch "$tag-$script-first" "$tag" $script "$work/$tag/$script-r" --exit-interval "$EXIT_AT"
  done
done
wait_all
echo "== phase 1 (uninterrupted x2, first part): $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
for tag in "${ready[@]}"; do  # phase 2: resume the interrupted run from its checkpoint (same --load folder)
  for script in gpt video; do
    launch "$tag-$script-resumed" "$tag" $script "$work/$tag/$script-r"
  done
done
wait_all
echo "== phase 2 (resumed): $(( $(date +%s) - t1 )) s"
if [[ "${DRY_RUN:-0}" == 1 ]]; then rm -rf "$work"; exit 0; fi

status=0
for tag in "${ready[@]}"; do
  for script in gpt video; do
    name=$( [[ $script == gpt ]] && echo pretrain_gpt_dsv.sh || echo pretrain_video_dit.py )
    l=$out/logs/$tag-$script
    version=$(python3 -c "import runpy, sys; print(runpy.run_path(sys.argv[1])['__version__'])" \
      "${tree[$tag]}/megatron/core/package_info.py" 2> /dev/null)
    python3 tools/megatron_lm_check.py compare --tag "$tag" --script "$name" --run-a "$l-a.log" --run-b "$l-b.log" \
      --first "$l-first.log" --resumed "$l-resumed.log" --resumed-at "$EXIT_AT" --iterations "$ITERS" \
      --rows "$rows" --megatron-core "${version:-unknown}" || status=1
  done
done
for tag in $tags; do [[ -n "${tree[$tag]:-}" ]] || status=1; done
python3 tools/megatron_lm_check.py write --rows "$rows" --out "$out" || status=1
# one archive of the logs, so that OUT holds three files (a caller that fetches a few files gets the JSON)
tar czf "$out/megatron_lm_logs.tgz" -C "$out" logs && rm -rf "$out/logs"
rm -rf "$work"
echo "== megatron_lm check: $([[ $status == 0 ]] && echo ok || echo FAILED) in $(( $(date +%s) - t0 )) s"
exit $status

#!/usr/bin/env bash
# The quality-speed frontier on one GPU (benchmarks/bench_quality.py), over back-to-back device calls.
# Usage: bash tools/gpu_quality_frontier.sh OUT_DIR PHASE
#   train   GPU tests of the local + predicted path beside (unless SKIP_GPU_TESTS=1) every (data, arm, seed) as
#           concurrent processes for MINUTES [7.0], saved under runs/frontier-<data>/ and resumed from there by
#           the next call (call back to back: the device machine keeps runs/ only while warm); with
#           MEGATRON_CHECK=1 tools/gpu_megatron_lm_check.sh runs beside the arms (its JSON lands in OUT_DIR)
#   finish  TRAIN_MINUTES [3] more training, then each study's arms timed alone, one after the other (--time,
#           with a kernel profile of each arm's stage-2 step at the last length; TIME_TIMEOUT [240] s for all
#           studies), and the reports: OUT_DIR/<data>/quality-frontier-<gpu>-<date>.json + PNGs
#   start   as train, but the studies are launched detached (setsid; each launch logs to
#           runs/launch-<data>-<pid>.log) and the call returns at once: the training
#           outlives the call while the machine stays warm (call back to back), so a study whose data needs its own
#           carry (footage, ViZDoom's wheels: 64 MiB a call) starts in one call and the next starts beside it. A
#           second start beside running workers must install only its own wheels (GPU_WHEEL_DIRS): reinstalling the
#           workers' megatron-core under them broke a worker's import in run 6
#   start-wait  start, then wait in the same call (WAIT_S): a study that ends within one call's limit needs no second
#           call within 30 s of this one (run 15 lost a machine, and its runs, between two calls)
#   wait    until every detached launch has ended, or WAIT_S [540] s after this script started (in start-wait the
#           preflight, install and launch count too: run 20's call passed its limit before its tarball); a progress
#           line a minute (installs nothing)
#   stop    end every detached launcher and worker on the machine now (each keeps its run as saved at its last
#           validation: a later start resumes it). Its matching, like wait's, skips this script and its callers,
#           whose text may name the pattern (run 14 lost a call before it did); never `pkill -f bench_quality.py`
#           in a device command instead, which matches that command's own shell (run 7 lost a call to it)
#   preflight  one worker of the first arm for 2 steps under CUDA_LAUNCH_BLOCKING=1 (~1 min): exit 3 and the failing
#           op if it cannot train; PREFLIGHT=1 runs it before train, start and start-wait, which then stop on failure
#   time    the timing and the reports alone
#   report  the reports alone (curves and timing already under runs/frontier-<data>/; SEEDS: the seeds reported)
# Memory: a 16K-token worker (hidden 512 x 4 layers) holds 8-12 GiB of the GPU and peaks at 13-17 GiB; 18 workers ran out
# of the H200's 140 GiB in run 6 (four died of OOM and were resumed), 10 in run 7 (two died). So at most MAX_WORKERS
# [GPU memory / 16 GiB] train at once on the machine, every study's launcher counted (bench_quality --max-workers):
# the others start as workers end. At 64K one worker fills the GPU (run 20: two did 0.95 of one's work), and
# MAX_WORKERS=1 with SKIP_GPU_TESTS=1 (a worker sees other workers, not tests beside it) has every seed train alone:
# the report's time_to_full_loss_ratio_logged then needs no timing phase.
# Settings (environment): DATA ["vizdoom"; e.g. "vizdoom footage": one study per source, trained side by side],
# ARM_KEYS [frames=16,res=256,stage1=700,qk_lr=10,lr=3e-4: 16K tokens], STEPS [4000: every arm stops there, so
# fast arms free the GPU for the others], EXTRA_STEPS [0: percent more steps for every arm but full, so an arm
# ending a little above full attention's final loss can be timed to it], ARMS (bench_quality's default frontier), SEEDS [0,1],
# SAMPLES [256: distinct training clips, kept on the GPU by every worker, 2-4 MB each at 16K], VAL_EVERY [250: steps
# between validations, each 64 clips x 5 timesteps of forward passes: at 64K run 20's full-attention seed 1 spent ~190
# of its 693 s outside training steps, on its start and 4 validations],
# LR_COOLDOWN [none: a constant rate after the warm-up; f: a linear decay over the last f of STEPS], BATCH [1],
# INIT_SEED [none: each seed its own initial weights; n: every seed starts from seed n's], ORDER_SEED [none: each
# seed its own clip order; n: every seed trains in seed n's order (0: the rendered order)], WIDTH ["--heads 8
# --head-dim 64 --layers 4": hidden 512, the attention-dominated regime at 16K tokens], TIME_LENGTHS [32768].
# Training uses the top-k backend TRAIN_TOPK [naive: exact, backend-independent lists; auto: the library's, as a user
# runs it, much faster on a GPU]; the timing phase uses the library's auto backends, as a user runs them.
# Carry [".whl", ".whl-vizdoom"] (".footage" for data footage: in a call of its own before, the carry cap is
# 64 MiB; ".whl-mlm", ".mlm" for MEGATRON_CHECK=1).
set -u
started=$(date +%s)  # WAIT_S counts from here
out=${1:?usage: gpu_quality_frontier.sh OUT_DIR PHASE}; phase=${2:?phase: preflight, train, start, start-wait, wait, stop, finish, time or report}
mkdir -p "$out/logs"
cd "$(dirname "$0")/.." || exit 2
ours=" $$ "  # this script and the shells above it (a device command's own text may name the patterns below)
p=$PPID
while [ "${p:-1}" -gt 1 ]; do ours+="$p "; p=$(ps -o ppid= -p "$p" 2> /dev/null | tr -d ' '); done
running() {  # $1: a pgrep -f pattern -> the matching pids, never this script or its callers
  local pid
  for pid in $(pgrep -f "$1"); do [[ "$ours" == *" $pid "* ]] || echo "$pid"; done
}

if [[ "$phase" == start* ]] && [ -z "${GPU_WHEEL_DIRS:-}" ] && [ -n "$(running "bench_quality.py.*--launch")" ]; then
  echo "gpu_quality_frontier.sh start: detached workers are running; name this study's own wheels in GPU_WHEEL_DIRS" \
       "(reinstalling every .whl*/ would replace the packages they import)" >&2
  exit 2
fi

if [ "$phase" != wait ] && [ "$phase" != stop ]; then  # never reinstall the packages detached workers import from
  # shellcheck disable=SC1091  # tools/gpu_env.sh, checked on its own
  . tools/gpu_env.sh
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# workers at once on the machine, every study's launcher counted: 16 GiB each (80 GiB H100: 4; 141 GiB H200: 8)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
max_workers=${MAX_WORKERS:-$(( ${gpu_mib:-0} / 1024 / 16 ))}
read -r -a studies <<< "${DATA:-vizdoom}"
keys=${ARM_KEYS:-frames=16,res=256,stage1=700,qk_lr=10,lr=3e-4},steps=${STEPS:-4000}
read -r -a width <<< "${WIDTH:---heads 8 --head-dim 64 --layers 4}"

study() {  # $1: data source -> cmd: the study's bench_quality command (an array: `timeout` takes no function)
  local d=$1
  mkdir -p "$out/$d"
  cmd=(python3 benchmarks/bench_quality.py --arm "data=$d,$keys" --seeds "${SEEDS:-0,1}" --save-dir "runs/frontier-$d"
       --out-dir "$out/$d" --samples "${SAMPLES:-256}" --val-samples 64 --val-every "${VAL_EVERY:-250}" --val-batch 8
       --workers 15 "${width[@]}"
       --extra-steps "${EXTRA_STEPS:-0}" --max-workers "$max_workers")
  [ -n "${ARMS:-}" ] && cmd+=(--arms "$ARMS")
  [ -n "${LR_COOLDOWN:-}" ] && cmd+=(--lr-cooldown "$LR_COOLDOWN")
  [ -n "${BATCH:-}" ] && cmd+=(--batch "$BATCH")
  [ -n "${INIT_SEED:-}" ] && cmd+=(--init-seed "$INIT_SEED")
  [ -n "${ORDER_SEED:-}" ] && cmd+=(--order-seed "$ORDER_SEED")
  return 0
}

train() {  # $1: minutes per arm; the studies side by side ($2 = detach: launched in their own sessions, not waited)
  local pids=() d
  for d in "${studies[@]}"; do
    study "$d"
    if [ "${2:-}" = detach ]; then
      # the launch and its workers run from a copy of the code made now: the next device call re-copies this
      # working tree under them, and a worker that imported a module mid-copy died of ModuleNotFoundError (run 20)
      local src=runs/src-$d-$$
      # with benchmarks/results: video_runs.py's --speedup-table default names a JSON there (run 21's default arm died)
      rm -rf "$src"; mkdir -p "$src/benchmarks/results"
      if ! cp -r megatron_dsv "$src"/ || ! cp benchmarks/*.py "$src/benchmarks"/ ||
        ! cp benchmarks/results/*.json "$src/benchmarks/results"/; then
        echo "cannot copy the code to $src" >&2; exit 2
      fi
      cmd[1]=$src/benchmarks/bench_quality.py
      DSV_TOPK_BACKEND=${TRAIN_TOPK:-naive} setsid nohup "${cmd[@]}" --launch --arm "data=$d,$keys,minutes=$1" \
        > "runs/launch-$d-$$.log" 2>&1 < /dev/null &  # $$: a second start of one study keeps the first's log
      echo "$!" > "runs/launch-$d-$$.pid"
      echo "== $d: launched detached (pid $!, log runs/launch-$d-$$.log)"
      continue
    fi
    DSV_TOPK_BACKEND=${TRAIN_TOPK:-naive} "${cmd[@]}" --launch --arm "data=$d,$keys,minutes=$1" > "$out/logs/launch-$d.log" 2>&1 &
    pids+=($!)
  done
  [ "${2:-}" = detach ] && return 0
  for i in "${!studies[@]}"; do
    wait "${pids[$i]}"; echo "== ${studies[$i]}: launch exit $?"; tail -n 8 "$out/logs/launch-${studies[$i]}.log"
  done
}

time_studies() {  # each study's arms alone, one study after the other, in TIME_TIMEOUT [240] s in all
  local limit=$(( ${TIME_TIMEOUT:-240} / ${#studies[@]} )) d
  for d in "${studies[@]}"; do  # one arm at a time on the GPU: these are speed figures
    study "$d"
    timeout "$limit" "${cmd[@]}" --time --time-lengths "${TIME_LENGTHS:-32768}" --time-profile \
      --time-profile-at "${TIME_PROFILE_AT:-0}" > "$out/logs/time-$d.log" 2>&1
    echo "time $d exit $? (limit ${limit}s)"; grep "^\[time\]" "$out/logs/time-$d.log"
  done
}

report() {
  local d
  for d in "${studies[@]}"; do echo "== $d"; study "$d"; "${cmd[@]}" --report 2>&1 | tail -n 10; done
}

wait_launches() {  # until every detached launch has ended or WAIT_S [540] s from the script's start; a line a minute
  local end left log
  end=$(( started + ${WAIT_S:-540} ))  # never past it: the call's limit must leave time for the tarball
  while [ -n "$(running "bench_quality.py.*--launch")" ] && [ "$(date +%s)" -lt "$end" ]; do
    left=$(( end - $(date +%s) ))
    sleep $(( left < 60 ? left : 60 ))
    for log in runs/frontier-*/logs/*-s*.log; do  # the last iteration line of each run
      [ -e "$log" ] && echo "${log#runs/frontier-}: $(grep -a iteration "$log" | tail -n 1 | sed 's/.*iteration/it/' | cut -c1-150)"
    done
    echo "-- $(date +%T): $(running "bench_quality.py.* --worker " | wc -l) workers running"
  done
  [ -n "$(running "bench_quality.py.*--launch")" ] && echo "== still training after WAIT_S" || echo "== every launch ended"
  for log in runs/launch-*.log; do [ -e "$log" ] && { echo "== $log"; tail -n 12 "$log"; }; done
}

preflight() {  # one worker of the first study's first arm, 2 steps on 8 clips, CUDA_LAUNCH_BLOCKING=1: fails fast and
  # names the failing op (2026-12-06: every worker died at its first step with a cuBLAS handle error after gather
  # asserts, and the asynchronous error named neither); its run in PREFLIGHT_DIR [/tmp], never the study's
  local d=${studies[0]} arm=${ARMS:-full} log=$out/logs/preflight.log
  local dir=${PREFLIGHT_DIR:-/tmp}/preflight-$d
  arm=${arm%%,*}
  rm -rf "$dir"  # never resumed: an earlier preflight's run would skip the steps
  python3 -c "import torch; c = torch.cuda.is_available(); \
    print('preflight: torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if c else 'no GPU')"
  CUDA_LAUNCH_BLOCKING=1 DSV_TOPK_BACKEND=${TRAIN_TOPK:-naive} timeout "${PREFLIGHT_TIMEOUT:-180}" python3 \
    benchmarks/bench_quality.py --arm "data=$d,${keys%,steps=*},steps=2" --arms "$arm" --seeds 0 \
    --save-dir "$dir" --out-dir "$dir/out" --samples 8 --val-samples 4 --val-every 250 \
    --val-batch 4 --workers 8 "${width[@]}" --max-workers 1 --launch > "$log" 2>&1
  local rc=$?
  cat "$dir"/logs/*.log >> "$log" 2> /dev/null
  if [ "$rc" = 0 ] && grep -q "== $arm seed 0: 2 steps" "$log"; then
    echo "preflight: $d $arm trained 2 steps"; return 0
  fi
  echo "preflight: $d $arm FAILED (exit $rc); first assert and the traceback's end ($log):"
  grep -a -m 1 "Assertion" "$log"; grep -a -v -i "Assertion\|warn" "$log" | tail -n 12
  return 3
}

# the GPU tests of the paths the frontier trains, the newest first (beside the workers a phase's limit may end them
# early: the log names the last file reached)
gpu_tests=(tests/attention/test_stage1_window.py tests/attention/test_prefetch_step_end.py
           tests/ops/test_topk_select_kernel.py tests/ops/test_topk_forced.py tests/attention/test_local_lists.py
           tests/ops/test_topk_keys.py tests/ops/test_sparse_attention_gpu.py tests/models/test_video_dit.py)

if [ "${PREFLIGHT:-0}" = 1 ] && [[ "$phase" == train || "$phase" == start* ]]; then
  preflight || exit 3
fi
case "$phase" in
  preflight)
    preflight
    ;;
  train)
    if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then  # beside the arms (small): a failure shows in the log's tail
      (timeout 300 python3 -m pytest -v -rs "${gpu_tests[@]}" \
        -k "not slow" > "$out/logs/gpu_tests.log" 2>&1; echo "gpu tests exit $?" >> "$out/logs/gpu_tests.log") &
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
    time_studies
    report
    ;;
  start|start-wait)
    train "${MINUTES:-7.0}" detach
    if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then  # in the foreground, beside the detached arms
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs "${gpu_tests[@]}" \
        tests/attention/test_dispatch_schedule.py -k "not slow" > "$out/logs/gpu_tests.log" 2>&1
      echo "gpu tests exit $? (limit ${TEST_TIMEOUT:-240}s; 124: not all ran)" | tee -a "$out/logs/gpu_tests.log"
      tail -n 15 "$out/logs/gpu_tests.log"
    fi
    [ "$phase" = start-wait ] && wait_launches
    ;;
  wait)
    wait_launches
    ;;
  stop)  # the launchers first (a launcher retrying an OOM could start a worker meanwhile: ask again each second)
    for i in 1 2 3 4 5 6 7 8 9 10; do
      [ -n "$(running "bench_quality.py.* --(launch|worker) ")" ] || break
      [ "$i" -lt 8 ] && sig=TERM || sig=KILL
      mapfile -t found < <(running "bench_quality.py.* --(launch|worker) ")
      [ "${#found[@]}" -gt 0 ] && kill "-$sig" "${found[@]}" 2> /dev/null
      sleep 1
    done
    echo "== stopped: $(running "bench_quality.py.* --(launch|worker) " | wc -l) launchers and workers left"
    ;;
  time)
    time_studies
    report
    ;;
  report)
    report
    ;;
  *) echo "unknown phase $phase (train, start, wait, stop, finish, time, report)" >&2; exit 2 ;;
esac
# at most 8 files come back from a device call: the results JSON/PNGs stay, the rest goes in one tarball (every
# study on the machine, also those DATA does not name, e.g. a detached one)
for run in runs/frontier-*/; do
  [ -d "$run" ] || continue
  d=${run%/}; d=${d#runs/frontier-}
  mkdir -p "$out/logs/$d"
  cp -r "${run}curves" "${run}logs" "$out/logs/$d/" 2>/dev/null
  cp "${run}timing.json" "$out/logs/$d/" 2>/dev/null
done
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
find "$out" -type f | sort

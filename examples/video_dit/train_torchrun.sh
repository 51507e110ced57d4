#!/usr/bin/env bash
# One node, N processes: GPUs (nccl, bf16) or CPU processes (gloo, fp32); data parallel unless TP/CP are set.
# Each preset has its own defaults (below); every one is an environment variable:
#   PRESET=0.8b bash examples/video_dit/train_torchrun.sh
#   PRESET=2.7b NPROC=8 TP=2 CP=2 SEQ_LEN=65536 bash examples/video_dit/train_torchrun.sh --data-path /shards
# The tiny default reproduces the embedded demo split over NPROC ranks (same global batch of 8 videos).
# torchrun is started as a module of $PYTHON (default: python3 on PATH), so a virtualenv need not be
# activated: PYTHON=.venv/bin/python bash examples/video_dit/train_torchrun.sh
#
#   variable   meaning                               tiny    0.8b    2.7b    30b
#   NPROC      processes = GPUs (CPU: gloo ranks)    2       8       8       8
#   TP         tensor parallel (GPU only)            1       1       2       8
#   CP         context parallel                      1       1       1       1
#   CP_MODE    DSV CP when CP > 1: head|seq|hybrid   hybrid (all presets)
#   FRAMES     latent frames T                       8       16      16      16
#   SIZE       latent height = width                 16      64      64      64
#   SEQ_LEN    tokens per video = FRAMES*(SIZE/2)^2  512     16384   16384   16384
#              (set SEQ_LEN instead of FRAMES to pick the length: FRAMES = SEQ_LEN / (SIZE/2)^2)
#   GBS        global batch (videos)                 8       MBS x NPROC / (TP x CP)
#   MBS        micro batch per rank                  GBS x TP x CP / NPROC   1
#   ITERS      iterations                            300     10000   10000   10000
#   LR         peak learning rate                    1e-3    1e-4    1e-4    1e-4
#   SWITCH     DSV stage 1 -> 2 at this step         ITERS/2 1000    1000    1000
#   RECOMPUTE  full | selective | empty = off        off     full    full    full
#   OUT        run folder                            outputs/torchrun-$PRESET (tiny: outputs/torchrun)
#   DSV_DRY_RUN=1  print the torchrun command instead of running it
set -euo pipefail

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import megatron_dsv" 2>/dev/null; then
    echo "error: $PYTHON cannot import megatron_dsv; set PYTHON to the interpreter of the environment you" \
         "installed it in (e.g. PYTHON=.venv/bin/python)" >&2
    exit 2
fi

PRESET=${PRESET:-tiny}
case "$PRESET" in
    tiny) d_nproc=2 d_tp=1 d_frames=8 d_size=16 d_iters=300 d_lr=1e-3 d_recompute= ;;
    0.8b) d_nproc=8 d_tp=1 d_frames=16 d_size=64 d_iters=10000 d_lr=1e-4 d_recompute=full ;;
    2.7b) d_nproc=8 d_tp=2 d_frames=16 d_size=64 d_iters=10000 d_lr=1e-4 d_recompute=full ;;
    30b)  d_nproc=8 d_tp=8 d_frames=16 d_size=64 d_iters=10000 d_lr=1e-4 d_recompute=full ;;
    *) echo "error: PRESET must be one of tiny, 0.8b, 2.7b, 30b, got '$PRESET'" >&2; exit 2 ;;
esac
NPROC=${NPROC:-$d_nproc}
TP=${TP:-$d_tp}
CP=${CP:-1}
SIZE=${SIZE:-$d_size}
if [[ -n "${SEQ_LEN:-}" ]]; then
    per_frame=$(( (SIZE / 2) * (SIZE / 2) ))  # every preset patches 1x2x2
    if (( SEQ_LEN % per_frame != 0 )); then
        echo "error: SEQ_LEN ($SEQ_LEN) must be a multiple of (SIZE/2)^2 = $per_frame tokens per latent frame" >&2
        exit 2
    fi
    FRAMES=${FRAMES:-$((SEQ_LEN / per_frame))}
fi
FRAMES=${FRAMES:-$d_frames}
if [[ "$PRESET" == tiny ]]; then
    OUT=${OUT:-outputs/torchrun}
    GBS=${GBS:-8}
    MBS=${MBS:-$((GBS * TP * CP / NPROC))}
else
    OUT=${OUT:-outputs/torchrun-$PRESET}
    MBS=${MBS:-1}
    GBS=${GBS:-$((MBS * NPROC / (TP * CP)))}
fi
ITERS=${ITERS:-$d_iters}
LR=${LR:-$d_lr}
if [[ "$PRESET" == tiny ]]; then SWITCH=${SWITCH:-$((ITERS / 2))}; else SWITCH=${SWITCH:-1000}; fi
RECOMPUTE=${RECOMPUTE-$d_recompute}
RECOMPUTE_FLAGS=()
if [[ -n "$RECOMPUTE" ]]; then
    RECOMPUTE_FLAGS=(--recompute-granularity "$RECOMPUTE" --recompute-method uniform --recompute-num-layers 1)
fi
GRID_FLAGS=()
if [[ "$FRAMES" != "$d_frames" || "$SIZE" != "$d_size" ]]; then
    GRID_FLAGS=(--model-override "latent_frames=$FRAMES" --model-override "latent_height=$SIZE"
                --model-override "latent_width=$SIZE")
fi
echo "train_torchrun: preset $PRESET, $NPROC processes, TP $TP, CP $CP, latents ${FRAMES}x${SIZE}x${SIZE}" \
     "= $((FRAMES * (SIZE / 2) * (SIZE / 2))) tokens/video, global batch $GBS (micro $MBS), $ITERS iterations"
if [[ "${DSV_DRY_RUN:-0}" == 1 ]]; then
    run=(echo)
else
    run=()
fi

"${run[@]}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m megatron_dsv.train \
    --preset "$PRESET" "${GRID_FLAGS[@]}" \
    --use-dsv-attention --dsv-stage-switch-steps "$SWITCH" \
    --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --dsv-cp-mode "${CP_MODE:-hybrid}" \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" \
    --train-iters "$ITERS" --lr "$LR" --min-lr 1e-5 --lr-decay-style cosine --clip-grad 1.0 \
    "${RECOMPUTE_FLAGS[@]}" \
    --log-interval 10 --tensorboard-dir "$OUT/tensorboard" \
    --output-dir "$OUT" --save "$OUT/checkpoints" --save-interval 1000 \
    "$@"
# Real data: add  --data-path /path/to/latent_shards ; resume: add  --load "$OUT/checkpoints"

# Megatron-LM entry point instead (GPUs; from a Megatron-LM core_v0.16.1 checkout, megatron_dsv installed):
# cd "$MEGATRON_LM" && torchrun --standalone --nproc-per-node "$NPROC" \
#     "$MEGATRON_DSV/examples/video_dit/pretrain_video_dit.py" \
#     --use-dsv-attention --dsv-stage-switch-steps 1000 --preset 0.8b \
#     --num-layers 28 --hidden-size 1152 --num-attention-heads 12 --kv-channels 96 \
#     --seq-length 16384 --max-position-embeddings 16384 --tokenizer-type NullTokenizer --vocab-size 1 \
#     --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" \
#     --micro-batch-size 1 --global-batch-size "$NPROC" --train-iters 10000 --lr 1e-4 --min-lr 1e-6 \
#     --lr-warmup-iters 500 --lr-decay-style cosine --clip-grad 1.0 --bf16 --mock-data \
#     --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
#     --log-interval 10 --save "$OUT/mlm_checkpoints" --load "$OUT/mlm_checkpoints" --save-interval 1000

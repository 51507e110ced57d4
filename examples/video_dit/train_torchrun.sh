#!/usr/bin/env bash
# One node, N processes: GPUs (nccl, bf16) or CPU processes (gloo, fp32); data parallel unless TP/CP are set.
# Defaults reproduce the embedded demo split over NPROC ranks (same global batch of 8 videos);
# scale up with env vars and flags, e.g.
#   NPROC=8 PRESET=0.8b MBS=1 ITERS=10000 LR=1e-4 RECOMPUTE=full bash examples/video_dit/train_torchrun.sh
# torchrun is started as a module of $PYTHON (default: python3 on PATH), so a virtualenv need not be
# activated: PYTHON=.venv/bin/python bash examples/video_dit/train_torchrun.sh
set -euo pipefail

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import megatron_dsv" 2>/dev/null; then
    echo "error: $PYTHON cannot import megatron_dsv; set PYTHON to the interpreter of the environment you" \
         "installed it in (e.g. PYTHON=.venv/bin/python)" >&2
    exit 2
fi

NPROC=${NPROC:-2}
OUT=${OUT:-outputs/torchrun}
PRESET=${PRESET:-tiny}
TP=${TP:-1}                 # tensor parallel (GPU only)
CP=${CP:-1}                 # context parallel
GBS=${GBS:-8}
MBS=${MBS:-$((GBS * TP * CP / NPROC))}
ITERS=${ITERS:-300}
LR=${LR:-1e-3}
SWITCH=${SWITCH:-$((ITERS / 2))}
RECOMPUTE=${RECOMPUTE:-}    # full | selective (GPU only); empty = off
RECOMPUTE_FLAGS=()
if [[ -n "$RECOMPUTE" ]]; then
    RECOMPUTE_FLAGS=(--recompute-granularity "$RECOMPUTE" --recompute-method uniform --recompute-num-layers 1)
fi

"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m megatron_dsv.train \
    --preset "$PRESET" \
    --use-dsv-attention --dsv-stage-switch-steps "$SWITCH" \
    --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" \
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

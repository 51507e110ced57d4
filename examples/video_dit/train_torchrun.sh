#!/usr/bin/env bash
# One node, N processes (GPUs with nccl, or CPU processes with gloo), data parallel unless TP/CP are set.
# Usage: NPROC=8 PRESET=0.8b bash examples/video_dit/train_torchrun.sh [extra flags]
set -euo pipefail

NPROC=${NPROC:-2}
OUT=${OUT:-outputs/torchrun}
PRESET=${PRESET:-tiny}
TP=${TP:-1}
CP=${CP:-1}
MBS=${MBS:-2}
GBS=${GBS:-$((MBS * NPROC / (TP * CP)))}

torchrun --standalone --nproc-per-node "$NPROC" -m megatron_dsv.train \
    --preset "$PRESET" \
    --use-dsv-attention --dsv-stage-switch-steps 1000 \
    --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" \
    --train-iters 10000 --lr 1e-4 --min-lr 1e-6 --lr-warmup-iters 500 --lr-decay-style cosine --clip-grad 1.0 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --log-interval 10 --tensorboard-dir "$OUT/tensorboard" \
    --output-dir "$OUT" --save "$OUT/checkpoints" --save-interval 1000 \
    "$@"
# Real data: add  --data-path /path/to/latent_shards ; resume: add  --load "$OUT/checkpoints"

# Megatron-LM entry point instead (from a Megatron-LM core_v0.16.1 checkout):
# cd "$MEGATRON_LM" && torchrun --standalone --nproc-per-node "$NPROC" \
#     "$MEGATRON_DSV/examples/video_dit/pretrain_video_dit.py" \
#     --use-dsv-attention --dsv-stage-switch-steps 1000 --preset 0.8b \
#     --num-layers 28 --hidden-size 1152 --num-attention-heads 12 --kv-channels 96 \
#     --seq-length 16384 --max-position-embeddings 16384 --tokenizer-type NullTokenizer --vocab-size 1 \
#     --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" \
#     --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters 10000 --lr 1e-4 --min-lr 1e-6 \
#     --lr-warmup-iters 500 --lr-decay-style cosine --clip-grad 1.0 --bf16 --mock-data \
#     --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
#     --log-interval 10 --save "$OUT/mlm_checkpoints" --load "$OUT/mlm_checkpoints" --save-interval 1000

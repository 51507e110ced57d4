#!/usr/bin/env bash
# One process (CPU or one GPU): the tiny video DiT with DSV attention on synthetic videos.
# fp32 on CPU, bf16 on GPU (automatic). Outputs (checkpoints, sample GIF) go to $OUT.
# Usage: bash examples/video_dit/train_local.sh [extra flags, e.g. --train-iters 500 --no-dsv]
# PYTHON: the interpreter that has megatron_dsv (default python3 on PATH; no venv activation needed).
set -euo pipefail

PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/local}
PRESET=${PRESET:-tiny}

"$PYTHON" -m megatron_dsv.train \
    --preset "$PRESET" \
    --use-dsv-attention --dsv-stage-switch-steps 150 \
    --micro-batch-size 8 --global-batch-size 8 \
    --train-iters 300 --lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 20 --lr-decay-style cosine --clip-grad 1.0 \
    --log-interval 10 --tensorboard-dir "$OUT/tensorboard" \
    --output-dir "$OUT" --save "$OUT/checkpoints" --save-interval 150 \
    "$@"
# Resume: add  --load "$OUT/checkpoints"  (continues with the next batch, same loss sequence).

# Megatron-LM entry point instead (from a Megatron-LM core_v0.16.1 checkout, GPU only):
# cd "$MEGATRON_LM" && torchrun --nproc-per-node 1 "$MEGATRON_DSV/examples/video_dit/pretrain_video_dit.py" \
#     --use-dsv-attention --dsv-stage-switch-steps 150 --preset tiny \
#     --num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 \
#     --seq-length 512 --max-position-embeddings 512 --tokenizer-type NullTokenizer --vocab-size 1 \
#     --micro-batch-size 8 --global-batch-size 8 --train-iters 300 --lr 1e-3 --min-lr 1e-5 \
#     --lr-warmup-iters 20 --lr-decay-style cosine --clip-grad 1.0 --bf16 --mock-data \
#     --log-interval 10 --save "$OUT/mlm_checkpoints" --save-interval 150

#!/usr/bin/env bash
# Megatron-LM's own GPT pretraining with DSV attention: the patched path (patches/megatron-lm).
# A stock Megatron-LM launch plus `--use-dsv-attention` and `--dsv-*` flags; run from anywhere:
#   MEGATRON_LM=/path/to/Megatron-LM NPROC=8 bash examples/megatron_lm/pretrain_gpt_dsv.sh [extra Megatron flags]
# The checkout must be tag core_v0.16.1 or core_v0.19.0, clean or with the patch set applied: the script runs
# tools/apply_patches.py first (it patches a clean tree, does nothing to a patched one, and stops with
# a clear error on another version or a tree with other changes).
# Works with or without Transformer Engine and apex: examples/megatron_lm/fusion_flags.py, run with $PYTHON,
# adds --transformer-impl=local, --no-rope-fusion, --no-gradient-accumulation-fusion and --no-persist-layer-norm
# for what does not import (FUSION_FLAGS=0: add none).
# DSV attention is non-causal (built for video DiTs): the GPT layers attend both ways here. This
# script shows the plumbing (flags, layer spec, after-step hook, checkpoints), not a language model.
# Extra flags come last, so they override the defaults below (argparse keeps the last value).
#
# Environment [defaults]: MEGATRON_LM (required), PYTHON [python3], NPROC [8], TP [1], CP [1],
#   SEQ_LEN [16384: a multiple of the DSV query group, 128 tokens], LAYERS [24], HIDDEN [2048], HEADS [16],
#   ITERS [2000], SWITCH [500: DSV stage 1 -> 2], OUT [runs/gpt-dsv, from the current folder], SAVE_INTERVAL [500], LOG_INTERVAL [10],
#   EVAL_INTERVAL [SAVE_INTERVAL], EVAL_ITERS [10: batches per validation; 0 = none],
#   DSV_DRY_RUN=1 prints the command.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
if [[ "$PYTHON" == */* ]]; then PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON"); fi  # we cd below
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM core_v0.16.1 or core_v0.19.0 checkout (patched or clean)}"
NPROC=${NPROC:-8}; TP=${TP:-1}; CP=${CP:-1}; SEQ_LEN=${SEQ_LEN:-16384}
LAYERS=${LAYERS:-24}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-16}
ITERS=${ITERS:-2000}; SWITCH=${SWITCH:-500}; OUT=${OUT:-runs/gpt-dsv}
[[ "$OUT" == /* ]] || OUT=$PWD/$OUT  # relative to where the script is started, not to MEGATRON_LM
SAVE_INTERVAL=${SAVE_INTERVAL:-500}; LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-$SAVE_INTERVAL}; EVAL_ITERS=${EVAL_ITERS:-10}
if (( SEQ_LEN % 128 )); then
    echo "error: SEQ_LEN=$SEQ_LEN must be a multiple of 128 (the DSV query group of 4x4x8 tokens)" >&2
    exit 2
fi
fusion=()
if [[ "${FUSION_FLAGS:-1}" != 0 ]]; then
    mapfile -t fusion < <("$PYTHON" "$here/examples/megatron_lm/fusion_flags.py" --explain)
fi
cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py
     --use-dsv-attention --dsv-stage-switch-rule steps --dsv-stage-switch-steps "$SWITCH" --dsv-cp-mode hybrid
     --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
     --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" --position-embedding-type rope
     --attention-dropout 0.0 --tensor-model-parallel-size "$TP" --context-parallel-size "$CP"
     --micro-batch-size 1 --global-batch-size "$NPROC" --train-iters "$ITERS" --lr 1e-4 --min-lr 1e-6
     --lr-decay-style cosine --clip-grad 1.0 --bf16
     --tokenizer-type NullTokenizer --vocab-size 4096 --mock-data
     --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
     --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval "$SAVE_INTERVAL"
     --log-interval "$LOG_INTERVAL"
     "${fusion[@]}" "$@")
if [[ "${DSV_DRY_RUN:-0}" == 1 ]]; then
    echo "cd $MEGATRON_LM && ${cmd[*]}"
    exit 0
fi
if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
    echo "error: MEGATRON_LM=$MEGATRON_LM holds no pretrain_gpt.py (a Megatron-LM checkout is needed)" >&2
    exit 2
fi
# shellcheck disable=SC1091  # examples/megatron_lm/require_imports.sh, checked on its own
. "$here/examples/megatron_lm/require_imports.sh"
require_imports "$PYTHON"
"$PYTHON" "$here/tools/apply_patches.py" "$MEGATRON_LM"
cd "$MEGATRON_LM"
exec "${cmd[@]}"

#!/usr/bin/env bash
# The video DiT through Megatron-LM's pretrain() (examples/video_dit/pretrain_video_dit.py), one node:
#   MEGATRON_LM=/path/to/Megatron-LM NPROC=8 bash examples/video_dit/pretrain_video_dit.sh [extra Megatron flags]
# The checkout must be tag core_v0.16.1 or core_v0.19.0; the script patches a clean one first
# (tools/apply_patches.py: the after-step hook then closes each DSV step right after the optimizer step;
# PATCH=0 leaves the tree as it is, and the script closes steps from its forward step instead).
# Works with or without Transformer Engine and apex (examples/megatron_lm/fusion_flags.py adds the flags
# for what does not import; FUSION_FLAGS=0: none). Extra flags come last and override the defaults below.
#
# Environment [defaults]: MEGATRON_LM (required), PYTHON [python3], NPROC [8], TP [1], CP [1], PRESET [0.8b],
#   LAYERS/HIDDEN/HEADS/HEAD_DIM [the preset's], FRAMES [16], SIZE [64] (latents FRAMES x SIZE x SIZE,
#   FRAMES*(SIZE/2)^2 tokens), ITERS [10000], SWITCH [1000: DSV stage 1 -> 2], LR [1e-4],
#   OUT [runs/video-dit-mlm, from the current folder], SAVE_INTERVAL [1000], LOG_INTERVAL [10],
#   EVAL_INTERVAL [SAVE_INTERVAL], EVAL_ITERS [10; 0 = no validation], DSV_DRY_RUN=1 prints the command.
#   PRETRAINED=DIR with DATA_PATH=SHARDS: fine-tune a converted Wan2.1 checkpoint (tools/convert_checkpoint.py
#   to-megatron) on latent shards carrying text, instead of PRESET on synthetic videos; the shape flags come from
#   DIR/wan_config.json, the latent grid from the shards; SEQ_LEN [FRAMES*(SIZE/2)^2] feeds only the FLOP counter.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
if [[ "$PYTHON" == */* ]]; then PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON"); fi  # we cd below
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM core_v0.16.1 or core_v0.19.0 checkout (patched or clean)}"
PRESET=${PRESET:-0.8b}
case "$PRESET" in
    tiny) d=(4 128 2 64) ;; 0.8b) d=(28 1152 12 96) ;; 2.7b) d=(32 2048 16 128) ;; 30b) d=(42 6144 24 256) ;;
    *) echo "error: PRESET must be one of tiny, 0.8b, 2.7b, 30b, got '$PRESET'" >&2; exit 2 ;;
esac
NPROC=${NPROC:-8}; TP=${TP:-1}; CP=${CP:-1}
LAYERS=${LAYERS:-${d[0]}}; HIDDEN=${HIDDEN:-${d[1]}}; HEADS=${HEADS:-${d[2]}}; HEAD_DIM=${HEAD_DIM:-${d[3]}}
FRAMES=${FRAMES:-16}; SIZE=${SIZE:-64}
ITERS=${ITERS:-10000}; SWITCH=${SWITCH:-1000}; LR=${LR:-1e-4}; OUT=${OUT:-runs/video-dit-mlm}
[[ "$OUT" == /* ]] || OUT=$PWD/$OUT  # relative to where the script is started, not to MEGATRON_LM
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}; LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-$SAVE_INTERVAL}; EVAL_ITERS=${EVAL_ITERS:-10}
if (( SIZE % 2 )); then
    echo "error: SIZE=$SIZE must be even (the video DiT patches 1x2x2)" >&2; exit 2
fi
SEQ_LEN=${SEQ_LEN:-$(( FRAMES * (SIZE / 2) * (SIZE / 2) ))}
if [[ -n "${PRETRAINED:-}" ]]; then
    : "${DATA_PATH:?PRETRAINED needs DATA_PATH: a folder of latent shards carrying text embeddings}"
    if [[ ! -f "$PRETRAINED/wan_config.json" ]]; then
        echo "error: PRETRAINED=$PRETRAINED holds no wan_config.json (convert with tools/convert_checkpoint.py to-megatron)" >&2
        exit 2
    fi
    PRETRAINED=$(cd "$PRETRAINED" && pwd); DATA_PATH=$(cd "$DATA_PATH" && pwd)  # we cd below
    read -r LAYERS HIDDEN HEADS HEAD_DIM < <("$PYTHON" -c 'import json, sys
c = json.load(open(sys.argv[1])); h, d = c["num_attention_heads"], c["attention_head_dim"]
print(c["num_layers"], h * d, h, d)' "$PRETRAINED/wan_config.json")
    model=(--pretrained "$PRETRAINED" --data-path "$DATA_PATH" --dataloader-type cyclic)
else
    model=(--preset "$PRESET" --model-override "latent_frames=$FRAMES" --model-override "latent_height=$SIZE"
           --model-override "latent_width=$SIZE" --mock-data)
fi
fusion=()
if [[ "${FUSION_FLAGS:-1}" != 0 ]]; then
    mapfile -t fusion < <("$PYTHON" "$here/examples/megatron_lm/fusion_flags.py" --explain)
fi
cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC"
     "$here/examples/video_dit/pretrain_video_dit.py"
     --use-dsv-attention --dsv-stage-switch-rule steps --dsv-stage-switch-steps "$SWITCH" "${model[@]}"
     --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --kv-channels "$HEAD_DIM"
     --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" --attention-dropout 0.0
     --tokenizer-type NullTokenizer --vocab-size 1
     --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --dsv-cp-mode hybrid
     --micro-batch-size 1 --global-batch-size "$NPROC" --train-iters "$ITERS" --lr "$LR" --min-lr 1e-6
     --lr-decay-style cosine --clip-grad 1.0 --bf16
     --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
     --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval "$SAVE_INTERVAL"
     --log-interval "$LOG_INTERVAL"
     "${fusion[@]}" "$@")
if [[ "${DSV_DRY_RUN:-0}" == 1 ]]; then
    echo "cd $MEGATRON_LM && ${cmd[*]}"
    exit 0
fi
if [[ ! -f "$MEGATRON_LM/megatron/training/training.py" ]]; then
    echo "error: MEGATRON_LM=$MEGATRON_LM holds no megatron/training (a Megatron-LM checkout is needed)" >&2
    exit 2
fi
# shellcheck disable=SC1091  # examples/megatron_lm/require_imports.sh, checked on its own
. "$here/examples/megatron_lm/require_imports.sh"
require_imports "$PYTHON"
if [[ "${PATCH:-1}" != 0 ]]; then
    "$PYTHON" "$here/tools/apply_patches.py" "$MEGATRON_LM"
fi
cd "$MEGATRON_LM"
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"  # megatron.training; the script lives elsewhere
exec "${cmd[@]}"

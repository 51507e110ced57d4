"""Megatron-style command-line flags of the megatron-core trainer (``python -m megatron_dsv.train``).

Flag names follow Megatron-LM (``--micro-batch-size``, ``--train-iters``, ``--lr``, ``--save``...)
so a launch script reads the same under either entry point. With no flags at all, the embedded
default runs: tiny preset, synthetic videos, and with ``--use-dsv-attention`` (the switch, as in Megatron-LM
scripts) DSV with a stage switch by the step rule mid-run.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

from megatron_dsv.arguments import add_dsv_args, dsv_config_from_args

__all__ = ["ArgumentParser", "build_parser", "parse_args", "add_video_dit_args", "add_video_dit_model_args",
           "validate_args",
           "model_overrides_from_args"]

# The embedded default switches to stage 2 at this step so a short run shows both stages.
DEFAULT_STAGE_SWITCH_STEPS = 150
# A 512-token demo video is far less sparse (0.4-0.6 measured) than the 16K+ token videos DSV
# targets (0.8-0.98), and 128-token blocks are a quarter of it. So the embedded default lowers the
# dispatcher's threshold and uses 2x4x4 query cubes with 64-token KV blocks, to show stage 2 running
# sparse, and turns the always-on neighbourhood and the stage-1 window off (their cubes would be most of such a
# video; on longer videos the window was measured with 4x4x8 cubes only).
# With the library's 25% cap on the lists (DSVConfig.max_density) the capped budgets already pass the
# threshold; the lowered threshold is what decides with --dsv-max-density none.
# Pass --dsv-sparsity-threshold 0.7 --dsv-query-group-shape 4 4 8 --dsv-kv-block-size 128
# --dsv-local-radius auto --dsv-stage1-local-radius auto for the library defaults (auto: 1 1 1 on a grid the cube
# tiles; 2 2 1 in stage 1 where that window keeps at most 1 - threshold of the keys).
DEMO_DSV_DEFAULTS = dict(dsv_sparsity_threshold=0.4, dsv_query_group_shape=(2, 4, 4), dsv_kv_block_size=64,
                         dsv_local_radius=(0, 0, 0), dsv_stage1_local_radius=(0, 0, 0))


# Averages the weights over the last ~1/(1 - decay) = 1000 optimizer steps: a fifth to a third of runs of a
# few thousand steps, where the quality comparisons of this project sit (benchmarks/bench_quality.py).
DEFAULT_EMA_DECAY = 0.999


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error: --dsv-theta must be in (0, 1), got 1.5`` instead of the
    80-line usage block first (``--help`` still prints it)."""

    def error(self, message):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def _ema_decay(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (0: no EMA), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def _key_value(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), value.strip()


def add_video_dit_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--preset / --model-override / --synthetic-samples: flags Megatron-LM does not define, so the
    Megatron-LM example entry point adds them through its extra_args_provider too."""
    g = parser.add_argument_group(title="video DiT model")
    g.add_argument("--preset", default="tiny", help="VideoDiT preset (tiny, 0.8b, 2.7b, 30b).")
    g.add_argument("--model-override", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="Override one VideoDiTConfig field (repeatable), e.g. --model-override latent_frames=16.")
    g.add_argument("--synthetic-samples", type=_positive_int, default=4096,
                   help="Number of synthetic videos in the embedded dataset.")
    # the choices are megatron_dsv.data.BACKGROUNDS, spelled out: this module does not import torch
    g.add_argument("--synthetic-background", choices=["gradient", "texture"], default="gradient",
                   help="Synthetic videos' background: a flat gradient, or a panning texture whose patches are "
                        "predicted by their neighbours (sparser attention, closer to real footage).")
    return parser


def add_video_dit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Model and data flags of this trainer."""
    add_video_dit_model_args(parser)
    g = parser.add_argument_group(title="video data")
    g.add_argument("--data-path", default=None,
                   help="Folder of latent shards (.safetensors/.npy); default: synthetic videos.")
    g.add_argument("--valid-data-path", default=None,
                   help="Folder of held-out latent shards for --eval-iters. Default: held-out synthetic videos "
                        "(another seed) when training on synthetic ones; with --data-path and no --valid-data-path "
                        "there is no validation (the training shards are not held out).")
    g.add_argument("--data-seed", type=int, default=None, help="Seed of the synthetic videos (default: --seed).")
    g.add_argument("--num-workers", type=_non_negative_int, default=0,
                   help="DataLoader worker processes that prepare the next batches (0: in the training process).")
    g = parser.add_argument_group(title="pretrained model")
    g.add_argument("--pretrained", default=None, metavar="DIR",
                   help="Fine-tune a converted Wan2.1 checkpoint (a folder written by `python "
                        "tools/convert_checkpoint.py to-megatron`): the model is the Wan transformer of DIR's "
                        "wan_config.json with its weights (DSV attention by --use-dsv-attention, DSV state fresh: "
                        "stage 1), instead of --preset. Needs --data-path shards carrying text embeddings of the "
                        "model's text_dim; no sample GIF. Resuming such a run (--load) needs --pretrained again.")
    return parser


def _add_model_shape_args(parser):
    g = parser.add_argument_group(title="model shape (override the preset)")
    g.add_argument("--num-layers", type=_positive_int, default=None)
    g.add_argument("--hidden-size", type=_positive_int, default=None)
    g.add_argument("--num-attention-heads", type=_positive_int, default=None)


def _add_training_args(parser):
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=_positive_int, default=8,
                   help="Videos per forward pass per rank (default 8: the tiny preset; lower it for big presets).")
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="Samples per optimizer step over all DP ranks (default: micro batch x DP).")
    g.add_argument("--train-iters", type=_positive_int, default=300)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-5)
    g.add_argument("--lr-warmup-iters", type=_non_negative_int, default=None,
                   help="Linear warmup iterations (default: 10%% of --lr-decay-iters, at most 20).")
    g.add_argument("--lr-decay-iters", type=_positive_int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--qk-norm-lr-mult", type=float, default=1.0,
                   help="Learning-rate multiplier of the QK-norm gains and biases (they set the attention logits' "
                        "scale under QK-norm). With fp32 main weights, 10 gave sparser attention early (0.875 vs "
                        "0.76 mean sparsity near step 2000, 0.83 vs 0.82 at 9000) and a 3%% lower validation loss "
                        "at 9000 steps in one run (benchmarks/NOTES_sparsity.md, run 17); default 1 (off).")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient-norm clip (0: off).")
    g.add_argument("--ema-decay", type=_ema_decay, default=DEFAULT_EMA_DECAY,
                   help="Decay of the fp32 exponential moving average of the trainable weights, updated after every "
                        "optimizer step; validation and the sample GIF use it, checkpoints keep it. Default 0.999: an "
                        "average over the last ~1000 steps, for runs of a few thousand steps (raise it for longer "
                        "runs). Early in a run step n uses min(decay, (1 + n) / (10 + n)), so the average never "
                        "reaches back to the random initialisation. DSV state and predictors are not averaged. "
                        "Costs 4 bytes per parameter per rank; 0 turns it off.")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                      help="bf16 parameters with fp32 main weights (default on GPU).")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                      help="fp32 everywhere (default on CPU).")
    g.set_defaults(precision=None)
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="Activation recomputation (TransformerConfig.recompute_granularity).")
    g.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=_positive_int, default=1)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def _add_parallel_args(parser):
    g = parser.add_argument_group(title="parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1,
                   help="Only 1: the video DiT trainer has no pipeline schedule.")
    g.add_argument("--context-parallel-size", type=_positive_int, default=1)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="Default: nccl on GPU, gloo on CPU.")


def _add_logging_checkpoint_args(parser):
    g = parser.add_argument_group(title="logging, checkpoints, samples")
    g.add_argument("--output-dir", default="outputs/default",
                   help="Run folder: checkpoints (unless --save), samples, TensorBoard (unless set).")
    g.add_argument("--log-interval", type=_positive_int, default=10)
    g.add_argument("--eval-interval", type=_positive_int, default=1000,
                   help="Validation loss every N iterations, and after the last one (Megatron-LM's flag).")
    g.add_argument("--eval-iters", type=_non_negative_int, default=2,
                   help="Global batches per validation (the same held-out batches, noise and timesteps every "
                        "time: the values form a curve); 0 turns validation off.")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard event folder (needs tensorboard).")
    g.add_argument("--save", default=None, help="Checkpoint folder (default: <output-dir>/checkpoints).")
    g.add_argument("--no-save", action="store_true", help="Write no checkpoint.")
    g.add_argument("--save-interval", type=_positive_int, default=None,
                   help="Save every N iterations (the last iteration is always saved).")
    g.add_argument("--load", default=None, help="Resume from this checkpoint folder (latest iteration).")
    g.add_argument("--no-checkpoint-checksums", action="store_true",
                   help="Record file sizes only, not sha256, in checkpoints (large models: hashing is slow).")
    g.add_argument("--no-load-optim", action="store_true", help="Load model weights only, not the optimizer.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore RNG states.")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="On --load, take the LR schedule from these flags, not the checkpoint (e.g. a longer "
                        "--train-iters). Without this or --use-checkpoint-opt_param-scheduler a mismatch is an error.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="On --load, keep the checkpoint's LR schedule (--lr, --min-lr, --lr-warmup-iters, "
                        "--lr-decay-iters, --lr-decay-style, --weight-decay) whatever these flags say.")
    g.add_argument("--no-load-dsv-state", action="store_true",
                   help="On --load, take the weights only: a DSV checkpoint's DSV state (predictors, sparsity, stage, "
                        "counters) is dropped (a dense run of it) or restarted (stage 1, fresh predictors), and a "
                        "dense checkpoint can start DSV. Without it, a checkpoint and a run that differ in "
                        "--use-dsv-attention are refused.")
    g.add_argument("--exit-interval", type=_positive_int, default=None,
                   help="Stop (after saving) once the iteration count is a multiple of this.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On --exit-signal (any rank), finish the iteration, save a checkpoint (with --save) and exit "
                        "0: Slurm's preemption / time-limit warning (sbatch --signal=TERM@90) then loses no work.")
    g.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"],
                   help="The signal --exit-signal-handler catches (torchrun forwards SIGTERM to its workers).")
    g.add_argument("--no-sample", dest="sample", action="store_false", help="Skip the sample GIF at the end.")
    g.add_argument("--num-sample-videos", type=_positive_int, default=4)
    g.add_argument("--sample-steps", type=_positive_int, default=20, help="Euler steps of the sampler.")
    g.add_argument("--sample-cfg-scale", type=float, default=1.0, help="Classifier-free guidance scale (1: off).")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m megatron_dsv.train",
        description="Train a video DiT with DSV sparse attention on megatron-core (no Megatron-LM needed). "
                    "With no flags: tiny preset, dense attention, synthetic videos, a few minutes on a CPU; "
                    "--use-dsv-attention turns DSV on, as in Megatron-LM launch scripts.")
    add_video_dit_args(parser)
    _add_model_shape_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_logging_checkpoint_args(parser)
    add_dsv_args(parser)
    # --use-dsv-attention (add_dsv_args) is the switch, as in Megatron-LM scripts; --no-dsv says "dense" explicitly.
    parser.add_argument("--no-dsv", dest="use_dsv_attention", action="store_false",
                        help="Dense attention (the default; cancels an earlier --use-dsv-attention).")
    demo = dict(dsv_stage_switch_steps=DEFAULT_STAGE_SWITCH_STEPS, **DEMO_DSV_DEFAULTS)
    parser.set_defaults(use_dsv_attention=False, **demo)
    _note_library_defaults(parser, demo)
    return parser


def _note_library_defaults(parser, demo: dict) -> None:
    """--help says where this trainer's default (the demo's) differs from the library's (DSVConfig)."""
    import dataclasses

    from megatron_dsv.config import DSVConfig

    library = {"dsv_" + f.name: f.default for f in dataclasses.fields(DSVConfig)}
    for action in parser._actions:
        if action.dest in demo and action.help:
            action.help += f" [the demo's; DSVConfig default: {library[action.dest]}]"


def validate_args(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Cross-flag checks; errors name the flag (through ``parser.error`` when a parser is given)."""
    def fail(message):
        if parser is not None:
            parser.error(message)
        raise ValueError(message)

    if args.pipeline_model_parallel_size != 1:
        fail(f"--pipeline-model-parallel-size must be 1 (no pipeline schedule), got {args.pipeline_model_parallel_size}")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        fail(f"--lr must be > 0 and --min-lr in [0, --lr], got --lr {args.lr} --min-lr {args.min_lr}")
    if args.clip_grad < 0:
        fail(f"--clip-grad must be >= 0, got {args.clip_grad}")
    if not args.qk_norm_lr_mult > 0:
        fail(f"--qk-norm-lr-mult must be > 0, got {args.qk_norm_lr_mult}")
    if args.data_path is not None and not os.path.isdir(args.data_path):
        fail(f"--data-path must be an existing folder of latent shards, got {args.data_path!r}")
    if args.valid_data_path is not None and not os.path.isdir(args.valid_data_path):
        fail(f"--valid-data-path must be an existing folder of latent shards, got {args.valid_data_path!r}")
    if args.load is not None and not os.path.isdir(args.load):
        fail(f"--load must be an existing checkpoint folder, got {args.load!r}")
    if getattr(args, "pretrained", None) is not None:
        _validate_pretrained(args, fail)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        fail("--override-opt-param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: pass one")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(20, args.lr_decay_iters // 10)
    if args.lr_warmup_iters >= args.lr_decay_iters:
        fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < --lr-decay-iters ({args.lr_decay_iters})")
    if args.data_seed is None:
        args.data_seed = args.seed
    if args.save is None and not args.no_save:
        args.save = os.path.join(args.output_dir, "checkpoints")
    if args.no_save:
        args.save = None
    if args.save_interval is None:
        args.save_interval = args.train_iters
    _validate_dsv(args, fail)
    return args


PRETRAINED_CONFIG = "wan_config.json"  # megatron_dsv.models.wan_convert.CONFIG_NAME (this module imports no torch)


def _validate_pretrained(args, fail) -> None:
    """--pretrained DIR: a converted Wan checkpoint, its shape from DIR (no shape flags), text from the shards."""
    path = args.pretrained
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, PRETRAINED_CONFIG)):
        fail(f"--pretrained must be a converted Wan checkpoint folder (written by `python tools/convert_checkpoint.py "
             f"to-megatron`, holding {PRETRAINED_CONFIG}), got {path!r}")
    flags = (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
             ("--num-attention-heads", "num_attention_heads"))
    shape = [flag for flag, dest in flags if getattr(args, dest) is not None]
    shape += ["--model-override"] if args.model_override else []
    if shape:
        fail(f"--pretrained takes the model shape from {PRETRAINED_CONFIG}: drop {' '.join(shape)}")
    if args.data_path is None:
        fail("--pretrained (a text-to-video Wan model) needs text embeddings: pass --data-path with latent shards "
             "carrying text (the synthetic videos of the default have none)")


def _validate_dsv(args, fail) -> None:
    """DSVConfig's checks at parse time, naming the --dsv-* flag (dsv_config_from_args translates)."""
    try:
        dsv_config_from_args(args)
    except ValueError as err:
        fail(str(err))


def model_overrides_from_args(args: argparse.Namespace) -> dict:
    """VideoDiTConfig overrides from --num-layers/--hidden-size/--num-attention-heads/--model-override.

    Values of --model-override are parsed as Python literals when possible (ints, floats, tuples)."""
    import ast

    overrides = {}
    for flag, name in (("num_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads")):
        if getattr(args, flag, None) is not None:
            overrides[name] = getattr(args, flag)
    for key, text in getattr(args, "model_override", []) or []:
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text
    return overrides


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate; a bad flag exits with argparse's usage error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return validate_args(args, parser)

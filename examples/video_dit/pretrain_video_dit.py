"""Pretrain the video DiT (optionally with DSV attention) through Megatron-LM's ``pretrain()``.

Run from a Megatron-LM core_v0.16.1 or core_v0.19.0 checkout with megatron_dsv installed; the launcher
``pretrain_video_dit.sh`` (beside this file) patches the tree and adds the flags a machine without
Transformer Engine or apex needs:

    torchrun --nproc-per-node 8 pretrain_video_dit.py --use-dsv-attention --preset 2.7b \\
        --num-layers 32 --hidden-size 2048 --num-attention-heads 16 --kv-channels 128 \\
        --seq-length 16384 --max-position-embeddings 16384 --tokenizer-type NullTokenizer --vocab-size 1 \\
        --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 --lr 1e-4 --bf16 --mock-data ...

The same model, data and loss as ``python -m megatron_dsv.train``; Megatron-LM owns the loop, DDP,
optimizer, checkpoints (DSV state travels in the model's sharded_state_dict) and logging.
``--num-layers/--hidden-size/--num-attention-heads/--kv-channels`` (Megatron's required shape flags)
override the preset; ``--seq-length`` only feeds Megatron's FLOP counter (tokens per video).
``--mock-data`` or no ``--data-path``: synthetic videos; ``--data-path DIR``: latent shards in DIR
(use ``--dataloader-type cyclic`` to loop over a finite shard set).
``--pretrained DIR`` fine-tunes a converted Wan2.1 checkpoint (``python tools/convert_checkpoint.py to-megatron``)
instead of a --preset VideoDiT: the Wan transformer of DIR's wan_config.json, latent grid from the ``--data-path``
shards (which must carry text embeddings of its text_dim; not ``--mock-data``), DIR's weights loaded in the model
provider by the trainer's code (``megatron_dsv.training.trainer.pretrained_wan_config``,
``wan_convert.load_megatron_checkpoint``), DSV state fresh; Megatron's shape flags must name DIR's shape
(``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--kv-channels``). A checkpoint in ``--load``
then replaces those weights, as Megatron resumes (resume with the same --pretrained: the shape comes from there).
Without ``--eval-interval`` Megatron-LM core_v0.16.1 stops in ``get_train_valid_test_num_samples``
(its default is None): this script defaults it to 1000, Megatron's long-standing default. Megatron's
default ``--transformer-impl transformer_engine`` falls back to local layers, with a note, where
Transformer Engine does not import.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.enums import ModelType
from megatron.training import get_args, pretrain, print_rank_0

from megatron_dsv.arguments import add_dsv_args, dsv_config_from_args
from megatron_dsv.training.arguments import add_video_dit_model_args, model_overrides_from_args

_LAST_DSV_STEP = {"iteration": 0}
_EVAL_GENERATORS = {}


def _eval_generator(device, seed: int) -> torch.Generator:
    """One noise stream per device for Megatron's evaluations, seeded once per process."""
    key = str(device)
    if key not in _EVAL_GENERATORS:
        _EVAL_GENERATORS[key] = torch.Generator(device=device).manual_seed(seed + 1_000_003)
    return _EVAL_GENERATORS[key]


def extra_args_provider(parser):
    """DSV flags (--use-dsv-attention, --dsv-*) and the video DiT flags Megatron-LM does not define."""
    add_dsv_args(parser)
    add_video_dit_model_args(parser)
    g = parser.add_argument_group(title="pretrained model")
    g.add_argument("--pretrained", default=None, metavar="DIR",
                   help="Fine-tune a converted Wan2.1 checkpoint (tools/convert_checkpoint.py to-megatron) instead of "
                        "--preset: needs --data-path latent shards carrying text embeddings, and Megatron's shape "
                        "flags equal to DIR's shape.")
    return parser


def _train_path(args):
    """The training shards' folder (the first --data-path or --train-data-path entry), or None."""
    return (args.data_path or getattr(args, "train_data_path", None) or [None])[0]


def wan_config_from_args(args):
    """--pretrained: the converted checkpoint's WanConfig at the training shards' latent grid; ValueError naming
    the flag when the data has no text or Megatron's shape flags disagree with the checkpoint."""
    from megatron_dsv.training.trainer import pretrained_wan_config

    train_path = _train_path(args)
    if train_path is None or args.mock_data:
        raise ValueError("--pretrained (a text-to-video Wan model) needs text embeddings: pass --data-path with latent "
                         "shards carrying text, not --mock-data")
    cfg = pretrained_wan_config(args.pretrained, train_path)
    shape = (("--num-layers", "num_layers", cfg.num_layers), ("--hidden-size", "hidden_size", cfg.hidden),
             ("--num-attention-heads", "num_attention_heads", cfg.num_attention_heads),
             ("--kv-channels", "kv_channels", cfg.attention_head_dim))
    wrong = [f"{flag} {getattr(args, dest)} (the checkpoint's: {want})" for flag, dest, want in shape
             if getattr(args, dest, None) is not None and getattr(args, dest) != want]
    if wrong:
        raise ValueError(f"--pretrained {args.pretrained}: Megatron's shape flags must be the checkpoint's: "
                         + ", ".join(wrong))
    return cfg


def video_dit_config_from_args(args):
    """VideoDiTConfig of --preset, with Megatron's shape flags and --model-override applied."""
    from megatron_dsv.models.video_dit import VideoDiTConfig

    overrides = model_overrides_from_args(args)
    if getattr(args, "kv_channels", None):
        overrides.setdefault("head_dim", args.kv_channels)
    return VideoDiTConfig.from_preset(args.preset, **overrides)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM model provider (signature of pretrain_gpt's, core_v0.16.1)."""
    from megatron_dsv.models.video_dit import build_video_dit

    args = get_args()
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("--pipeline-model-parallel-size must be 1 for the video DiT (one stage)")
    dsv_config = dsv_config_from_args(args)
    overrides = dict(tensor_model_parallel_size=args.tensor_model_parallel_size,
                     context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel)
    if args.recompute_granularity is not None:
        overrides.update(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if use_te:
        from megatron_dsv.models.specs import have_transformer_engine

        if not have_transformer_engine():
            print_rank_0("> transformer_engine does not import: the video DiT uses megatron.core's local layers "
                         "(pass --transformer-impl local to say so)")
            use_te = False
    if getattr(args, "pretrained", None):
        return _pretrained_wan(args, dsv_config, use_te, pg_collection, overrides)
    cfg = video_dit_config_from_args(args)
    print_rank_0(f"> building VideoDiT {args.preset} ({cfg}) with {'DSV' if dsv_config else 'dense'} attention")
    return build_video_dit(cfg, dsv_config=dsv_config, use_te=use_te, pg_collection=pg_collection,
                           dtype=args.params_dtype, **overrides)


def _pretrained_wan(args, dsv_config, use_te: bool, pg_collection, overrides: dict):
    """--pretrained: the Wan transformer with the converted checkpoint's weights (DSV state fresh)."""
    from megatron_dsv.models.wan import build_wan
    from megatron_dsv.models.wan_convert import load_megatron_checkpoint

    cfg = wan_config_from_args(args)
    print_rank_0(f"> building the Wan transformer of --pretrained {args.pretrained} ({cfg}) with "
                 f"{'DSV' if dsv_config else 'dense'} attention")
    model = build_wan(cfg, dsv_config=dsv_config, use_te=use_te, pg_collection=pg_collection, dtype=args.params_dtype,
                      **overrides)
    load_megatron_checkpoint(model, args.pretrained)  # a checkpoint in --load replaces them afterwards
    print_rank_0(f"> loaded the Wan weights of --pretrained {args.pretrained}"
                 + (" (DSV state fresh: stage 1)" if dsv_config else ""))
    return model


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Synthetic videos (--mock-data or no data path) or latent shards: the first --data-path entry, or
    Megatron's separate paths (--train-data-path, and --valid-data-path for its validation, repeated to the
    samples its evaluations read; Megatron-LM takes one style or the other, not both)."""
    from megatron_dsv.data import CycledDataset, LatentShardDataset, SyntheticVideoDataset

    args = get_args()
    train_path = _train_path(args)
    if getattr(args, "pretrained", None) and (train_path is None or args.mock_data):
        wan_config_from_args(args)  # raises, naming --data-path
    if train_path and not args.mock_data:
        valid_path = (getattr(args, "valid_data_path", None) or [None])[0]
        valid = None
        if valid_path and train_val_test_num_samples[1]:
            valid = CycledDataset(LatentShardDataset(valid_path), train_val_test_num_samples[1])
        print_rank_0(f"> latent shards from {train_path} (validation: {valid_path or 'none'}; test: none)")
        return LatentShardDataset(train_path), valid, None
    cfg = video_dit_config_from_args(args)
    c, (t, h, w) = cfg.in_channels, cfg.latent_grid

    def synthetic(n, seed):
        return SyntheticVideoDataset(max(int(n), 1), channels=c, frames=t, height=h, width=w,
                                     num_classes=max(cfg.num_classes, 1), seed=seed,
                                     background=args.synthetic_background) if n else None

    # Megatron's sequential sampler stops at len(dataset): size the procedural sets to what it asks for.
    train_n = max(train_val_test_num_samples[0], args.synthetic_samples)
    return (synthetic(train_n, args.seed), synthetic(train_val_test_num_samples[1], args.seed + 1),
            synthetic(train_val_test_num_samples[2], args.seed + 2))


def _dsv_step_end(model, args):
    """Unpatched Megatron-LM has no after-optimizer-step hook: the first forward of iteration k closes
    step k. A tree with our patch set (patches/megatron-lm) runs the hook right after the optimizer
    step; the layers' step counter then already shows it, and nothing is done here."""
    from megatron_dsv.attention import dsv_layers
    from megatron_dsv.training.megatron_lm import dsv_train_step_end

    iteration = int(getattr(args, "curr_iteration", 0) or 0)
    layers = dsv_layers(model)
    if layers and layers[0].step_host >= iteration:  # the patched train loop closed this step already
        _LAST_DSV_STEP["iteration"] = max(_LAST_DSV_STEP["iteration"], iteration)
        return
    if iteration > _LAST_DSV_STEP["iteration"]:
        from megatron.core import parallel_state

        dsv_train_step_end(model, iteration, args,
                           dp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        _LAST_DSV_STEP["iteration"] = iteration


def loss_func(output_tensor):
    """(loss, num_samples, report): Megatron divides by the count and reduces the report over DP."""
    loss = output_tensor.float()
    count = torch.ones(1, dtype=torch.int, device=loss.device)
    report = {"flow loss": torch.cat([loss.detach().view(1), count.float()])}
    return loss, count[0], report


def forward_step(data_iterator, model):
    """One micro batch of the rectified-flow loss (Megatron-LM forward_step contract)."""
    from megatron_dsv.models.video_dit import flow_matching_loss

    args = get_args()
    if args.use_dsv_attention:
        _dsv_step_end(model, args)
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    latents = batch["latents"].to(device, non_blocking=True)
    labels = batch["label"].to(device, non_blocking=True)
    text = batch["text"].to(device, non_blocking=True) if "text" in batch else None
    text_mask = batch["text_mask"].to(device, non_blocking=True) if "text_mask" in batch else None
    # Megatron's evaluation (model in eval mode) draws its noise from a stream of its own, so validation
    # leaves the training RNG where it was
    gen = None if model.training else _eval_generator(latents.device, args.seed)
    loss = flow_matching_loss(model, latents, labels, generator=gen, text=text, text_mask=text_mask)
    return loss, partial(loss_func)


def main():
    """Megatron-LM's ``pretrain()`` with this file's providers, for either calling convention: up to
    core_v0.16.x it parses the arguments itself; from core_v0.19 the script parses them and hands a
    config container (``pretrain_cfg_container_from_args``) plus ``model_provider=``."""
    import inspect

    # Every rank builds its own (procedural or sharded) dataset; the sampler picks this rank's part.
    train_valid_test_datasets_provider.is_distributed = True
    defaults = {"tokenizer_type": "NullTokenizer", "vocab_size": 1, "eval_interval": 1000}
    if "cfg_container" in inspect.signature(pretrain).parameters:  # core_v0.19+
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=defaults)
        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    else:
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 extra_args_provider=extra_args_provider, args_defaults=defaults)


if __name__ == "__main__":
    main()

"""The megatron-core training loop behind ``python -m megatron_dsv.train``.

One optimizer step = ``num_micro_batches`` forward/backward passes of the flow-matching loss on
this rank's slice of the global batch, a DP gradient all-reduce, one Adam step with clipping, one
LR-scheduler step, the EMA of the weights (``--ema-decay``), then DSV's end-of-step hook (profiler,
stage switch). Validation and the sample GIF use the EMA weights when it is on. The flow-matching noise of
each micro batch comes from a generator seeded by (seed, global sample position), so the loss
sequence depends only on the seed and the data position: a resumed run reproduces it exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_dsv.arguments import dsv_config_from_args
from megatron_dsv.training import dsv_hooks
from megatron_dsv.training.arguments import model_overrides_from_args
from megatron_dsv.training.checkpointing import TRACKER_FILE, has_checkpoint, load_checkpoint, save_checkpoint
from megatron_dsv.training.data import (GlobalBatchSampler, build_dataset, build_valid_dataset, collate,
                                        latent_shape, step_batches)
from megatron_dsv.training.distributed import DistEnv, initialize_distributed, is_rank0
from megatron_dsv.training.ema import ModelEMA
from megatron_dsv.training.logging_utils import (TensorBoardWriter, format_args_block, format_iteration_line,
                                                 format_layer_lines, format_validation_lines)
from megatron_dsv.training.optim import build_optimizer, build_scheduler, sum_partial_grads_over_tp, unwrap, wrap_model

__all__ = ["TrainResult", "train", "build_model", "pretrained_wan_config", "print_rank0"]


@dataclass
class TrainResult:
    """What a run did: the global-mean loss of every iteration it ran, and where it ended."""

    losses: List[float] = field(default_factory=list)
    start_iteration: int = 0
    iteration: int = 0
    consumed_samples: int = 0
    checkpoint: Optional[str] = None
    samples: Optional[str] = None
    dsv_stages: List[int] = field(default_factory=list)
    signalled: bool = False  # stopped by --exit-signal-handler
    valid_losses: List[Tuple[int, float]] = field(default_factory=list)  # (iteration, validation loss)
    model: Optional[torch.nn.Module] = field(default=None, repr=False)  # the live weights
    ema: Optional[ModelEMA] = field(default=None, repr=False)  # their average (--ema-decay), None when off


def print_rank0(message: str) -> None:
    if is_rank0():
        print(message, flush=True)


def _precision(args, env: DistEnv) -> torch.dtype:
    if args.precision is None:
        args.precision = "bf16" if env.device.type == "cuda" else "fp32"
    if args.precision == "bf16" and env.device.type != "cuda":
        raise ValueError("--bf16 needs a GPU (on CPU use --fp32, the default there)")
    return torch.bfloat16 if args.precision == "bf16" else torch.float32


def _transformer_overrides(args) -> dict:
    """--recompute-* and --tensor-model-parallel-size / --context-parallel-size as TransformerConfig fields."""
    overrides = {"tensor_model_parallel_size": args.tensor_model_parallel_size,
                 "context_parallel_size": args.context_parallel_size}
    if args.recompute_granularity == "full":
        overrides.update(recompute_granularity="full", recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        overrides.update(recompute_granularity="selective")
    return overrides


def build_model(args, env: DistEnv):
    """VideoDiT from --preset and overrides (or --pretrained's Wan transformer with its weights), DSV attention
    when on; returns (model, cfg, dsv_config)."""
    from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit

    if args.recompute_granularity is not None and env.device.type != "cuda":
        # megatron.core.tensor_parallel.checkpoint saves and restores CUDA RNG states unconditionally.
        raise ValueError(f"--recompute-granularity {args.recompute_granularity} needs a GPU (megatron-core's "
                         "activation checkpointing is CUDA-only); leave it unset on CPU")
    dsv_config = dsv_config_from_args(args)
    dtype = _precision(args, env)
    if getattr(args, "pretrained", None) is not None:
        model, cfg = _build_pretrained_wan(args, env, dsv_config, dtype)
        return model, cfg, dsv_config
    cfg = VideoDiTConfig.from_preset(args.preset, **model_overrides_from_args(args))
    model = build_video_dit(cfg, dsv_config=dsv_config, use_te=None, pg_collection=env.pg_collection, dtype=dtype,
                            **_transformer_overrides(args))
    return model.to(env.device), cfg, dsv_config


def pretrained_wan_config(pretrained: str, data_path: str):
    """The WanConfig of a converted checkpoint (``pretrained``: its wan_config.json) with the latent grid of the
    ``data_path`` latent shards, which must carry text embeddings of the model's text_dim (ValueError naming
    both flags otherwise). The trainer's --pretrained and Megatron-LM's example share it."""
    from megatron_dsv.data import LatentShardDataset
    from megatron_dsv.models.wan_convert import read_megatron_config

    cfg, _ = read_megatron_config(pretrained)
    shards = LatentShardDataset(data_path)
    text = shards.shards[0].shapes.get("text")
    if text is None or int(text[-1]) != cfg.text_dim:
        held = "none" if text is None else f"[L, {int(text[-1])}]"
        raise ValueError(f"--pretrained {pretrained!r} needs text embeddings [L, {cfg.text_dim}] in the "
                         f"--data-path shards; {data_path!r} holds {held} (write them with write_shard(text=...))")
    return dataclasses.replace(cfg, latent_grid=tuple(int(g) for g in shards.sample_shape[1:]))


def _build_pretrained_wan(args, env: DistEnv, dsv_config, dtype):
    """--pretrained DIR: the Wan transformer of DIR's wan_config.json (latent grid: the --data-path shards') with
    DIR's weights, loaded before the optimizer and EMA exist; DSV state fresh (stage 1). A run resuming from
    --load takes its weights from there instead."""
    from megatron_dsv.models.wan import build_wan
    from megatron_dsv.models.wan_convert import load_megatron_checkpoint

    cfg = pretrained_wan_config(args.pretrained, args.data_path)
    model = build_wan(cfg, dsv_config=dsv_config, use_te=None, pg_collection=env.pg_collection, dtype=dtype,
                      **_transformer_overrides(args)).to(env.device)
    if args.load is not None and has_checkpoint(args.load):
        print_rank0(f" > --pretrained {args.pretrained}: the Wan model's shape; its weights come from --load")
    else:
        load_megatron_checkpoint(model, args.pretrained)
        print_rank0(f" > loaded the Wan weights of --pretrained {args.pretrained}"
                    + (" (DSV state fresh: stage 1)" if dsv_config is not None else ""))
    return model, cfg


def _noise_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * position + 17)


def train_step(loss_model, ddp_model, optimizer, micro_batches, consumed: int, args, env: DistEnv):
    """Forward/backward over this rank's micro batches, DP grad sync, optimizer step.

    Returns (global mean loss, grad norm, update successful)."""
    from megatron_dsv.models.video_dit import flow_matching_loss

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    rank_start = consumed + env.dp_rank * (args.global_batch_size // env.dp_size)
    total = torch.zeros((), dtype=torch.float32, device=env.device)
    for k, batch in enumerate(micro_batches):
        batch = {key: value.to(env.device, non_blocking=True) for key, value in batch.items()}
        gen = _noise_generator(args.seed, rank_start + k * args.micro_batch_size, env.device)
        loss = flow_matching_loss(loss_model, batch["latents"], batch["label"], generator=gen,
                                  text=batch.get("text"), text_mask=batch.get("text_mask"))
        (loss / len(micro_batches)).backward()
        total += loss.detach().float()
    ddp_model.finish_grad_sync()
    sum_partial_grads_over_tp(ddp_model, env.pg_collection.tp)
    # DSV's step end queued behind the backward, before the optimizer's gradient-norm read (which then covers it);
    # _loop's dsv_hooks.on_step_end completes it, with the same group
    dsv_hooks.prefetch_step_end(unwrap(ddp_model), dp_group=getattr(env.pg_collection, "dp_cp", None))
    ok, grad_norm, _ = optimizer.step()
    mean = total / len(micro_batches)
    if env.dp_size > 1:
        dist.all_reduce(mean, group=env.pg_collection.dp)
        mean /= env.dp_size
    return float(mean), float(grad_norm) if grad_norm is not None else float("nan"), bool(ok)


@torch.no_grad()
def evaluate(loss_model, ddp_model, valid, sampler: GlobalBatchSampler, args, env: DistEnv) -> float:
    """Global-mean flow-matching loss over ``--eval-iters`` held-out global batches.

    The same batches, noise and timesteps every time at a given micro batch size (noise from the negative
    positions of the training noise stream, which training never reaches), the model in eval mode
    (:func:`dsv_hooks.eval_forward`): DSV layers run as they would at inference (stage 2: the
    dispatcher's sparse lists; no predictor statistics, no profile, their own CP plan), and no training
    state, metric, RNG or data position moves, so a run's losses do not depend on its validations."""
    from megatron_dsv.models.video_dit import flow_matching_loss

    total = torch.zeros((), dtype=torch.float32, device=env.device)
    count = 0
    with dsv_hooks.eval_forward(ddp_model):
        for k in range(args.eval_iters):
            rank_start = k * args.global_batch_size + env.dp_rank * (args.global_batch_size // env.dp_size)
            for m, idx in enumerate(sampler.local_micro_batches(k * args.global_batch_size)):
                batch = {key: value.to(env.device) for key, value in collate([valid[i] for i in idx]).items()}
                gen = _noise_generator(args.seed, -(rank_start + m * args.micro_batch_size + 1), env.device)
                total += flow_matching_loss(loss_model, batch["latents"], batch["label"], generator=gen,
                                            text=batch.get("text"), text_mask=batch.get("text_mask")).float()
                count += 1
    mean = total / count
    if env.dp_size > 1:
        dist.all_reduce(mean, group=env.pg_collection.dp)
        mean /= env.dp_size
    return float(mean)


def _train_state(args, cfg, dsv_config, iteration: int, consumed: int) -> dict:
    return {"consumed_samples": consumed, "args": vars(args), "model_config": dataclasses.asdict(cfg),
            "dsv_config": dsv_config.to_dict() if dsv_config is not None else None, "iteration": iteration}


def _log(iteration, args, window, bare_model, tokens_per_sample, consumed, lr, tb, dsv_on):
    n = len(window["loss"])
    ms = 1000.0 * window["time"] / n
    stats = {"consumed_samples": consumed, "ms_per_iter": ms, "lr": lr, "loss": sum(window["loss"]) / n,
             "grad_norm": sum(window["grad_norm"]) / n, "skipped_iters": window["skipped"],
             "tokens_per_s": args.global_batch_size * tokens_per_sample / max(ms / 1000.0, 1e-9)}
    values = dsv_hooks.metrics(bare_model) if dsv_on else {}
    stats["dsv_stage"] = values.get("dsv/stage", dsv_hooks.stage(bare_model)) if dsv_on else None
    stats["dsv_sparsity"] = values.get("dsv/sparsity_mean", 0.0)
    print_rank0(format_iteration_line(iteration, args.train_iters, stats))
    for line in format_layer_lines(values):
        print_rank0(line)
    tb.scalars({"train/loss": stats["loss"], "train/grad_norm": stats["grad_norm"], "train/lr": lr,
                "train/ms_per_iter": ms, "train/tokens_per_s": stats["tokens_per_s"], **values}, iteration)


def _setup(args):
    env = initialize_distributed(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * env.dp_size
    model, cfg, dsv_config = build_model(args, env)
    ddp_model = wrap_model(model, env, args)
    optimizer = build_optimizer(ddp_model, env, args)
    scheduler = build_scheduler(optimizer, args)
    return env, model, cfg, dsv_config, ddp_model, optimizer, scheduler


def _build_ema(args, ddp_model) -> Optional[ModelEMA]:
    decay = getattr(args, "ema_decay", 0.0)
    return ModelEMA(unwrap(ddp_model), decay) if decay > 0 else None


def train(args) -> TrainResult:
    """Run the configured training; returns the per-iteration losses and the final position."""
    env, model, cfg, dsv_config, ddp_model, optimizer, scheduler = _setup(args)
    for line in format_args_block(args):  # Megatron-LM's block: every setting in effect, the --dsv-* ones too
        print_rank0(line)
    result = TrainResult(ema=_build_ema(args, ddp_model))
    if args.load is not None and not has_checkpoint(args.load):
        # Megatron-LM's behaviour, so a requeued job can always pass --load: nothing there yet = fresh start.
        print_rank0(f" > WARNING: --load {args.load} holds no checkpoint yet ({TRACKER_FILE} missing): "
                    "starting from iteration 0")
    elif args.load is not None:
        _check_pretrained_resume(args)
        state = load_checkpoint(args.load, ddp_model, optimizer, scheduler, model_config=cfg,
                                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, args=args,
                                ema=result.ema, load_dsv_state=not args.no_load_dsv_state)
        result.iteration, result.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
        print_rank0(f" > resumed from {args.load} at iteration {result.iteration} "
                    f"(consumed samples {result.consumed_samples})")
        if dsv_config is not None:
            stage = dsv_hooks.stage(unwrap(ddp_model))
            print_rank0(f" > DSV resumes in stage {stage} ({'sparse where the dispatcher says so' if stage == 2 else 'dense; predictors learn'})")
    result.start_iteration = result.iteration
    dataset = build_dataset(args, cfg)
    sampler = GlobalBatchSampler(len(dataset), args.micro_batch_size, args.global_batch_size, env.dp_rank,
                                 env.dp_size, args.seed, consumed_samples=result.consumed_samples)
    _print_banner(args, env, cfg, model, sampler)
    batches = step_batches(dataset, sampler, result.consumed_samples, args.num_workers)
    valid = build_valid_dataset(args, cfg, dataset)
    if valid is None and args.eval_iters and args.data_path is not None:
        print_rank0(" > no --valid-data-path: no validation (the --data-path shards are not held out)")
    validation = None if valid is None else (valid, GlobalBatchSampler(
        len(valid), args.micro_batch_size, args.global_batch_size, env.dp_rank, env.dp_size, args.seed, shuffle=False))
    _loop(args, env, cfg, dsv_config, ddp_model, optimizer, scheduler, batches, result, validation)
    if result.checkpoint is None and args.save and result.iteration > result.start_iteration:
        result.checkpoint = _save(args, cfg, dsv_config, ddp_model, optimizer, scheduler, result)
    result.model = unwrap(ddp_model)
    if args.sample and getattr(args, "pretrained", None) is not None:
        print_rank0(" > no sample GIF for a --pretrained (Wan) run: it needs a text encoder and the Wan VAE")
    elif args.sample and env.dp_rank == 0 and not result.signalled:
        # every tensor-parallel rank of replica 0 runs the forward (TP collectives: rank 0 alone would hang)
        from megatron_dsv.training.samples import write_samples

        with _ema_weights(result.ema, result.model):
            result.samples = write_samples(result.model, cfg, args, env.device, result.iteration, write=is_rank0())
    return result


def _check_pretrained_resume(args) -> None:
    """A --pretrained (Wan) checkpoint resumes only with --pretrained (the model's shape comes from there), and a
    VideoDiT one only without it."""
    from megatron_dsv.training.checkpointing import read_train_state, resolve_checkpoint_dir

    try:
        saved = read_train_state(resolve_checkpoint_dir(args.load)).get("args", {}).get("pretrained")
    except Exception:  # an unreadable checkpoint: load_checkpoint says what is wrong with it
        return
    if (saved is None) != (getattr(args, "pretrained", None) is None):
        raise ValueError(f"--load {args.load} holds a run " + ("without --pretrained (a VideoDiT): resume it without "
                         "--pretrained" if saved is None else f"of --pretrained {saved} (a Wan model): resume it with "
                         f"--pretrained {saved}"))


def _ema_weights(ema: Optional[ModelEMA], model):
    """The EMA weights in ``model`` for the block (when --ema-decay is on), the live ones after."""
    return ema.swap_in(model) if ema is not None else contextlib.nullcontext(model)


def _save(args, cfg, dsv_config, ddp_model, optimizer, scheduler, result) -> str:
    return save_checkpoint(args.save, result.iteration, ddp_model, optimizer, scheduler,
                           _train_state(args, cfg, dsv_config, result.iteration, result.consumed_samples),
                           checksums=not args.no_checkpoint_checksums, ema=result.ema)


def _loop(args, env, cfg, dsv_config, ddp_model, optimizer, scheduler, batches, result, validation=None):
    bare = unwrap(ddp_model)
    loss_model = ddp_model.module  # Float16Module on GPU bf16 (casts inputs), else the bare model
    tokens_per_sample = _tokens_per_sample(cfg)
    tb = TensorBoardWriter(args.tensorboard_dir, enabled=is_rank0())
    window = {"loss": [], "grad_norm": [], "time": 0.0, "skipped": 0}
    exit_signal = ExitSignal(args, env)
    ddp_model.train()
    while result.iteration < args.train_iters:
        start = time.perf_counter()
        loss, grad_norm, ok = train_step(loss_model, ddp_model, optimizer, next(batches),
                                         result.consumed_samples, args, env)
        if ok:
            scheduler.step(increment=1)
            if result.ema is not None:
                result.ema.update(bare)
        else:
            window["skipped"] += 1
        result.iteration += 1
        result.consumed_samples += args.global_batch_size
        if dsv_config is not None:
            dsv_hooks.on_step_end(bare, result.iteration, dp_group=getattr(env.pg_collection, "dp_cp", None))
            result.dsv_stages.append(dsv_hooks.stage(bare))
            if len(result.dsv_stages) > 1 and result.dsv_stages[-1] != result.dsv_stages[-2]:
                print_rank0(f" > DSV stage {result.dsv_stages[-2]} -> {result.dsv_stages[-1]} after iteration "
                            f"{result.iteration}")
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        window["time"] += time.perf_counter() - start
        window["loss"].append(loss)
        window["grad_norm"].append(grad_norm)
        result.losses.append(loss)
        if result.iteration % args.log_interval == 0 or result.iteration == args.train_iters:
            _log(result.iteration, args, window, bare, tokens_per_sample, result.consumed_samples,
                 optimizer.param_groups[0]["lr"], tb, dsv_config is not None)
            window = {"loss": [], "grad_norm": [], "time": 0.0, "skipped": 0}
        if validation is not None and (result.iteration % args.eval_interval == 0
                                       or result.iteration == args.train_iters):
            start = time.perf_counter()
            with _ema_weights(result.ema, bare):
                value = evaluate(loss_model, ddp_model, *validation, args, env)
            result.valid_losses.append((result.iteration, value))
            for line in format_validation_lines(result.iteration, value, args.eval_iters * args.global_batch_size,
                                                1000.0 * (time.perf_counter() - start),
                                                ema_decay=result.ema.decay if result.ema is not None else None):
                print_rank0(line)
            tb.scalars({"validation/loss": value}, result.iteration)
        stop = exit_signal.agreed()
        if _should_save(args, result.iteration) or (stop and args.save):
            result.checkpoint = _save(args, cfg, dsv_config, ddp_model, optimizer, scheduler, result)
            print_rank0(f" > saved checkpoint at iteration {result.iteration} to {result.checkpoint}")
        if stop:
            print_rank0(f" > {exit_signal.name} received: exiting at iteration {result.iteration}"
                        + (f" after saving to {result.checkpoint}" if args.save else " (no --save: nothing saved)"))
            result.signalled = True
            break
        if args.exit_interval and result.iteration % args.exit_interval == 0:
            print_rank0(f" > exiting at iteration {result.iteration} (--exit-interval {args.exit_interval})")
            break
    tb.close()


class ExitSignal:
    """``--exit-signal-handler``: remembers that this rank received ``--exit-signal``; :meth:`agreed`
    tells every rank at the same iteration (one tiny all-reduce per step, only when enabled), so all
    ranks save the same checkpoint together and leave the loop."""

    def __init__(self, args, env: DistEnv):
        self.enabled = bool(args.exit_signal_handler)
        self.received = False
        self.name = args.exit_signal
        self.device = env.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        if self.enabled:
            signal.signal(getattr(signal, self.name), self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = True

    def agreed(self) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([float(self.received)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _should_save(args, iteration: int) -> bool:
    if not args.save:
        return False
    return (iteration % args.save_interval == 0 or iteration == args.train_iters
            or bool(args.exit_interval and iteration % args.exit_interval == 0))


def _tokens_per_sample(cfg) -> int:
    t, h, w = cfg.token_grid()
    return t * h * w


def _print_banner(args, env, cfg, model, sampler):
    from megatron_dsv.models.specs import have_transformer_engine

    n_params = sum(p.numel() for p in model.parameters())
    layers = "transformer-engine" if have_transformer_engine() else "megatron-core local (no transformer-engine)"
    pretrained = getattr(args, "pretrained", None)
    model_name = f"--pretrained {pretrained} (Wan)" if pretrained else f"preset {args.preset}"
    print_rank0(f" > megatron_dsv trainer: {model_name}, {n_params / 1e6:.2f}M parameters, {layers} layers, "
                f"device {env.device}, {args.precision}, world {env.world_size} (dp {env.dp_size}, tp {env.tp_size}, "
                f"cp {env.cp_size}), DSV {'on' if args.use_dsv_attention else 'off'}")
    print_rank0(f" > latents {tuple(latent_shape(cfg))}, {_tokens_per_sample(cfg)} tokens/video, global batch "
                f"{args.global_batch_size} (micro {args.micro_batch_size} x {sampler.num_micro_batches} x dp "
                f"{env.dp_size}), {args.train_iters} iterations, output {os.path.abspath(args.output_dir)}")

"""Megatron-LM's side of DSV: the call the patched train loop makes after each optimizer step.

Patch 0003 (patches/megatron-lm/<tag>/0003-dsv-step-end-hook.patch) calls
:func:`dsv_train_step_end` right after Megatron's ``iteration += 1`` when the step was not skipped, and patch
0005 :func:`dsv_train_step_prefetch` right before the optimizer step (the step end's device work queued early);
``examples/video_dit/pretrain_video_dit.py`` calls it from its forward step on an unpatched tree.
It closes the DSV step (:func:`megatron_dsv.attention.dsv_on_step_end`: predictors, profiler,
stage switch) and, on Megatron's logging iterations (``--log-interval``), prints one line of DSV
state beside Megatron's own iteration line, on global rank 0 (its layers)::

     [dsv] iteration       12 | stage 2 | sparse layers 2/2 | sparsity 0.612 | predictor loss 1.234E-01

Megatron-LM's log shows nothing of DSV otherwise; ``tools/megatron_lm_check.py`` reads these lines.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

__all__ = ["dsv_train_step_end", "dsv_train_step_prefetch", "format_dsv_line"]


def format_dsv_line(iteration: int, metrics: Dict[str, float], num_layers: int) -> str:
    """The ``[dsv]`` log line from :func:`megatron_dsv.attention.dsv_metrics` of ``num_layers`` layers."""
    stage = int(metrics.get("dsv/stage", 1))
    sparse = int(round(metrics.get("dsv/sparse_fraction", 0.0) * num_layers))
    sparsity = metrics.get("dsv/sparsity_mean", float("nan"))
    loss = metrics.get("dsv/predictor_loss", float("nan"))
    loss_text = "nan" if math.isnan(loss) else f"{loss:.3E}"
    return (f" [dsv] iteration {iteration:8d} | stage {stage} | sparse layers {sparse}/{num_layers} | "
            f"sparsity {sparsity:.3f} | predictor loss {loss_text}")


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def dsv_train_step_prefetch(model, args=None, dp_group=None) -> bool:
    """Queue DSV's step end before Megatron's optimizer step (patch 0005, in ``train_step`` right before
    ``optimizer.step()``): :func:`megatron_dsv.attention.dsv_prefetch_step_end`, whose device work and host copy
    the optimizer's gradient-norm sync then covers; the step-end hook after ``iteration += 1`` (patch 0003) reads
    the values from the host. Same values, one stream sync a step instead of two.

    Not with a loss scaler (``--fp16``, or ``--loss-scale`` with bf16): its step can be skipped, and patch 0003
    then calls no step end, which would leave the queued one for the next step. Returns whether it queued.
    ``dp_group`` as :func:`dsv_train_step_end` (the two must agree)."""
    if args is not None and (getattr(args, "fp16", False) or getattr(args, "loss_scale", None)):
        return False
    from megatron_dsv.attention import dsv_prefetch_step_end

    chunks = model if isinstance(model, (list, tuple)) else [model]
    if not chunks:  # a rank without model chunks: its step end joins the collectives on its own
        return False
    dsv_prefetch_step_end(model, dp_group=dp_group)
    return True


def dsv_train_step_end(model, iteration: int, args=None, dp_group=None) -> int:
    """Close DSV step ``iteration`` (optimizer steps completed) and log it every ``args.log_interval``.

    Args:
        model: Megatron's list of model chunks (or one module).
        iteration: Megatron's ``iteration`` after its increment.
        args: Megatron's arguments (``log_interval``); None logs nothing.
        dp_group: as :func:`megatron_dsv.attention.dsv_on_step_end` (None: Megatron's DP x CP group).
    Returns the stage of the next step (1 or 2).
    """
    from megatron_dsv.attention import dsv_layers, dsv_metrics, dsv_on_step_end

    stage = dsv_on_step_end(model, iteration, dp_group=dp_group)
    interval: Optional[int] = getattr(args, "log_interval", None) if args is not None else None
    if interval and iteration % interval == 0 and _rank() == 0:
        layers = dsv_layers(model)
        if layers:
            print(format_dsv_line(iteration, dsv_metrics(model), len(layers)), flush=True)
    return stage


def dsv_gpt_layer_spec(args, spec=None):
    """Megatron-LM core_v0.19+ (patch 0004, ``gpt_config_from_args``): the GPT layer spec as a callable
    ``(model_config, vp_stage=None) -> ModuleSpec`` for ``GPTModelConfig.transformer_layer_spec``.

    ``spec``: what Megatron would use (a ModuleSpec from ``--spec``, a callable, or None for its
    default, ``megatron.training.models.gpt.default_layer_spec``); its core attention becomes
    :class:`~megatron_dsv.attention.DSVCoreAttention` with the ``--dsv-*`` settings, as patch 0002 does
    in ``gpt_builder``.
    """
    import inspect

    from megatron_dsv.arguments import dsv_config_from_args
    from megatron_dsv.models.specs import get_dsv_layer_spec

    dsv_config = dsv_config_from_args(args)

    def layer_spec(model_config, vp_stage=None):
        base = spec
        if base is None:
            from megatron.training.models.gpt import default_layer_spec

            base = default_layer_spec(model_config, vp_stage)
        elif callable(base) and not hasattr(base, "submodules"):
            wants_vp = "vp_stage" in inspect.signature(base).parameters
            base = base(model_config, vp_stage=vp_stage) if wants_vp else base(model_config)
        return get_dsv_layer_spec(base, dsv_config)

    return layer_spec

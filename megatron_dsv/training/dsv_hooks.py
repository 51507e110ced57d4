"""The trainer's calls into the DSV method, tolerant of a dense-only build.

``megatron_dsv.attention`` provides ``dsv_on_step_end(model, iteration, dp_group)`` (with
``dsv_prefetch_step_end(model, dp_group)`` before the optimizer step),
``dsv_metrics(model) -> {name: float}``, ``dsv_stage(model) -> int`` and the context
``dsv_eval_forward(model)`` (validation forwards that leave no trace). When a call is not
provided (a build without the method) the trainer runs dense attention and logs stage 1 and
sparsity 0: the fallbacks below say exactly that instead of failing.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

__all__ = ["on_step_end", "prefetch_step_end", "metrics", "stage", "eval_forward", "per_layer_sparsity"]


def _attention_api(name: str):
    import megatron_dsv.attention as attention

    fn = getattr(attention, name, None)
    if fn is None:
        try:
            from megatron_dsv.attention import hooks
        except ImportError:
            return None
        fn = getattr(hooks, name, None)
    return fn


def on_step_end(model: torch.nn.Module, iteration: int, dp_group=None) -> None:
    fn = _attention_api("dsv_on_step_end")
    if fn is not None:
        fn(model, iteration, dp_group=dp_group)


def prefetch_step_end(model: torch.nn.Module, dp_group=None) -> None:
    """``dsv_prefetch_step_end(model, dp_group)`` when the model has DSV layers (before the optimizer step: the
    step end's device work and host copy issued early, see ``megatron_dsv.attention.hooks``); else nothing."""
    layers = _attention_api("dsv_layers")
    fn = _attention_api("dsv_prefetch_step_end")
    if fn is not None and layers is not None and layers(model):
        fn(model, dp_group=dp_group)


def eval_forward(model: torch.nn.Module):
    """``dsv_eval_forward(model)``; without the method, a block with the model in eval mode."""
    fn = _attention_api("dsv_eval_forward")
    return fn(model) if fn is not None else _eval_mode(model)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    mode = model.training
    model.eval()
    try:
        yield []
    finally:
        model.train(mode)


def metrics(model: torch.nn.Module) -> Dict[str, float]:
    fn = _attention_api("dsv_metrics")
    return {k: float(v) for k, v in fn(model).items()} if fn is not None else {}


def stage(model: torch.nn.Module) -> int:
    fn = _attention_api("dsv_stage")
    return int(fn(model)) if fn is not None else 1


def per_layer_sparsity(values: Dict[str, float]) -> Dict[int, tuple]:
    """{layer: (sparsity, is_sparse)} from the dsv/layer{i}/sparsity and dsv/layer{i}/sparse keys."""
    layers = {}
    for key, value in values.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "dsv" and parts[1].startswith("layer") and parts[1][5:].isdigit():
            entry = layers.setdefault(int(parts[1][5:]), [0.0, False])
            if parts[2] == "sparsity":
                entry[0] = float(value)
            elif parts[2] == "sparse":
                entry[1] = bool(value)
    return {i: tuple(layers[i]) for i in sorted(layers)}

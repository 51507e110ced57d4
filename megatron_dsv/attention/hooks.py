"""The trainer-facing API of the DSV method: four functions, called by any training loop.

* :func:`dsv_layers` — every :class:`DSVCoreAttention` of a (wrapped, chunked) model.
* :func:`dsv_on_step_end` — once after each optimizer step, on every rank.
* :func:`dsv_metrics` — flat ``{name: float}`` for the logger (this rank's layers).
* :func:`dsv_stage` — 1 (dense, predictors learn) or 2 (sparse).

``dsv_on_step_end`` does, in order: (1) one all-reduce (sum) over the data-parallel
group of every layer's step accumulators and predictor gradients, flattened into a
single buffer, so profiled sparsity, losses and predictor weights stay identical on
all data-parallel replicas; (2) one all-reduce over the default (world) group of the
predictor losses and the stage, so every layer on every rank (pipeline and tensor
ranks included) takes the same stage decision from the mean predictor loss over all
layers; (3) the predictors' Adam step (at the rate of the stage the gradients were
computed in); (4) counters, smoothing and the new stage. Every rank must call it,
also a pipeline rank without DSV layers (it joins the world all-reduce).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.attention.schedule import should_switch

__all__ = ["dsv_layers", "dsv_on_step_end", "dsv_metrics", "dsv_stage"]


def dsv_layers(model) -> List[DSVCoreAttention]:
    """DSV core attentions of ``model`` (a module, any wrapper such as DDP/Float16Module, or a
    list of virtual-pipeline chunks), in module order, each once."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    seen, layers = set(), []
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or a list of them, got {type(chunk).__name__}")
        for m in chunk.modules():
            if isinstance(m, DSVCoreAttention) and id(m) not in seen:
                seen.add(id(m))
                layers.append(m)
    return layers


def _default_dp_group():
    if not dist.is_available() or not dist.is_initialized():
        return None
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        # CP ranks see different query shards, so they average like DP replicas (as Megatron DDP does)
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return dist.group.WORLD


def _world_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _dp_sum(layers: List[DSVCoreAttention], group) -> None:
    """Sum every layer's accumulators and predictor gradients over ``group`` (one collective)."""
    tensors = []
    for layer in layers:
        tensors += [layer.pending, layer.predictor.grad_count] + layer.predictor.grad_buffers()
    if _world_size(group) <= 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _agreed_loss_and_stage(layers: List[DSVCoreAttention]):
    """(mean predictor loss over all layers of all ranks or None, any layer already in stage 2)."""
    loss_sum, loss_layers, in_stage2 = 0.0, 0.0, 0.0
    for layer in layers:
        n = float(layer.pending[1])
        if n > 0:
            loss_sum += float(layer.pending[0]) / n
            loss_layers += 1
        in_stage2 += float(layer.stage_host == 2)
    stats = torch.tensor([loss_sum, loss_layers, in_stage2], dtype=torch.float64)
    if _world_size(dist.group.WORLD if dist.is_available() and dist.is_initialized() else None) > 1:
        device = layers[0].pending.device if layers else torch.device("cpu")
        if dist.get_backend() == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        stats = stats.to(device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        stats = stats.cpu()
    loss_sum, loss_layers, in_stage2 = stats.tolist()
    mean = loss_sum / loss_layers if loss_layers > 0 else None
    return mean, in_stage2 > 0


def dsv_on_step_end(model, iteration: Optional[int] = None, dp_group=None) -> int:
    """Advance DSV after an optimizer step; returns the stage for the next step (1 or 2).

    Args:
        model: the model (any wrapper, or a list of chunks).
        iteration: optimizer steps completed so far (Megatron's ``iteration`` after its
            increment); ``None`` counts one more step than the layers' own counter.
        dp_group: the data-parallel group over which predictor gradients and profiler
            statistics are averaged; ``None``: Megatron's data-parallel group with
            context parallelism when initialised, else the world, else none.
    """
    if iteration is not None and (not isinstance(iteration, int) or iteration < 0):
        raise ValueError(f"iteration must be None or an int >= 0, got {iteration!r}")
    layers = dsv_layers(model)
    _dp_sum(layers, dp_group if dp_group is not None else _default_dp_group())
    mean_loss, in_stage2 = _agreed_loss_and_stage(layers)
    if not layers:
        return 1
    step = iteration if iteration is not None else layers[0].step_host + 1
    stage = 2 if in_stage2 or should_switch(layers[0].dsv_config, step, mean_loss) else 1
    for layer in layers:
        layer.predictor.adam_step(layer.predictor_lr())
        layer.finish_step(layer.pending.clone(), step, stage)
    return stage


def dsv_stage(model) -> int:
    """1 (dense; predictors learn) or 2 (sparse where the dispatcher says so); 1 without DSV layers."""
    layers = dsv_layers(model)
    return layers[0].stage_host if layers else 1


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def dsv_metrics(model) -> Dict[str, float]:
    """Flat scalars for logging: totals under ``dsv/`` and per layer/head under ``dsv/layer{n}/``
    (``n`` = Megatron's global layer number). Values describe this rank's layers only."""
    layers = dsv_layers(model)
    if not layers:
        return {}
    out: Dict[str, float] = {"dsv/stage": float(layers[0].stage_host), "dsv/step": float(layers[0].step_host)}
    per_layer = [layer.metrics() for layer in layers]
    for layer, m in zip(layers, per_layer):
        out.update(m)
    keys = {"predictor_loss": "predictor_loss", "sparsity_mean": "sparsity", "recall_mean": "recall",
            "sparse_fraction": "sparse", "k_mean": "k_mean"}
    for total, name in keys.items():
        out[f"dsv/{total}"] = _mean([m[f"dsv/layer{layer.layer_number}/{name}"] for layer, m in zip(layers, per_layer)])
    return out

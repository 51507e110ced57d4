"""The trainer-facing API of the DSV method: six functions, called by any training loop.

* :func:`dsv_layers` — every :class:`DSVCoreAttention` of a (wrapped, chunked) model.
* :func:`dsv_on_step_end` — once after each optimizer step, on every rank.
* :func:`dsv_prefetch_step_end` — optional, before the optimizer step: the step end's device work and host copy
  issued early, so that the trainer's own sync (its gradient-norm read) covers them.
* :func:`dsv_metrics` — flat ``{name: float}`` for the logger (this rank's layers).
* :func:`dsv_stage` — 1 (dense, predictors learn) or 2 (sparse).
* :func:`dsv_eval_forward` — a context for eval forwards (validation, analysis) that leave no trace.

``dsv_on_step_end`` does, in order: (0) the predictors' losses and gradients of the step, all layers
in one batched pass from the statistics their forwards collected; (1) one all-reduce (sum) over the data-parallel
group of every layer's step accumulators and predictor gradients, flattened into a
single buffer, so profiled sparsity, budget densities, losses and predictor weights stay
identical on all data-parallel replicas; (2) one all-reduce over the default (world)
group of the predictor losses and the stage, so every layer on every rank (pipeline and
tensor ranks included) takes the same stage decision (the step rule, or the mean predictor loss over
all layers for the loss rules); (3) **one** device-to-host copy of every layer's step scalars (and of (2)'s result),
the only stream sync of the step end (none of its own when :func:`dsv_prefetch_step_end` issued (0)-(3) before
the trainer's gradient-norm read); (4) the predictors' Adam step (at the rate of the
stage the gradients were computed in); (5) counters, smoothing and the new stage, on host
mirrors that are then written to the device without reading it back. Every rank must call
it, also a pipeline rank without DSV layers (it joins the world all-reduce).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.attention.predictor import adam_step_many, from_host, train_predictors
from megatron_dsv.attention.schedule import should_switch
from megatron_dsv.attention.state import StepScalars

__all__ = ["dsv_layers", "dsv_on_step_end", "dsv_prefetch_step_end", "dsv_metrics", "dsv_stage",
           "dsv_eval_forward", "dsv_set_token_grid"]


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


def dsv_set_token_grid(model, token_grid: Optional[Sequence[int]]) -> None:
    """Give every DSV layer of ``model`` the (T, H, W) token grid of the sequences its next forwards attend.

    The grid is what the 3D neighbourhoods are laid on: the local part of local + predicted lists
    (``DSVConfig.local_radius``) and the windowed stage 1 (``DSVConfig.stage1_local_radius``); with their
    defaults (auto) both apply only where a grid is given. The sequence must be the grid's tokens in 3D-cube-major
    order (:func:`megatron_dsv.attention.grouping.to_cube_order` with ``DSVConfig.query_group_shape``), as DSV's
    query groups are. The grid holds until the next call; a layer whose sequence length is not ``T * H * W``
    ignores it (auto) or refuses it (an explicit radius). None: no grid (text). The video DiT and Wan call it
    on every forward; call it before the forward in a model of your own."""
    if token_grid is not None:
        grid = tuple(token_grid)
        if len(grid) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in grid):
            raise ValueError(f"dsv_set_token_grid: token_grid must be three positive ints (T, H, W) or None, "
                             f"got {token_grid!r}")
        token_grid = grid
    for layer in dsv_layers(model):
        layer.token_grid = token_grid


@contextlib.contextmanager
def dsv_eval_forward(model) -> Iterator[List[DSVCoreAttention]]:
    """Every module of ``model`` in eval mode inside the block (each module's own mode restored after,
    so mixed modes survive), and the DSV layers' metric copies (``last_k``, ``last_sparse``) and
    ``force_dense`` restored: an eval forward (validation, analysis) leaves the training's metrics,
    state and next step as they were. An eval forward samples no queries, profiles nothing, collects no
    predictor statistics and plans its own CP layout (:meth:`DSVCoreAttention._plan_cp`). Yields the
    DSV layers."""
    layers = dsv_layers(model)
    saved = [(layer, layer.last_k.clone(), layer.last_sparse, layer.force_dense) for layer in layers]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield layers
    finally:
        for layer, last_k, last_sparse, dense in saved:
            layer.last_k.copy_(last_k)
            layer.last_sparse, layer.force_dense = last_sparse, dense
        for m, mode in modes:
            m.training = mode


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


class _StepEndRead:
    """The step end's device side, issued: (0) the predictors' losses and gradients, (1)-(2) the collectives, and
    (3)'s copy of the step scalars to pinned host memory without waiting for it (an event marks its end). On a
    GPU the copy lands while the device finishes what was queued before it; :meth:`result` waits for the event (a
    no-op when the trainer has synced since, e.g. by reading its gradient norm) and reads the host values."""

    def __init__(self, layers: List[DSVCoreAttention], dp_group):
        self.layers, self.dp_group = layers, dp_group
        _train_predictors(layers)
        self.scalars = StepScalars(layers)
        self.in_stage2 = any(layer.stage_host == 2 for layer in layers)
        values, self.n_small, self.world = _exchange_device(layers, self.scalars, dp_group, self.in_stage2)
        self.event = None
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # a host tensor already (or another device: a blocking copy)
            self.host = values.cpu()

    def result(self):
        """``(per-layer (pending, grad count) host values, mean predictor loss over all layers of all ranks or
        None, whether any layer anywhere is in stage 2)``."""
        if self.event is not None:
            self.event.synchronize()
        host, scalars, n_small = self.host, self.scalars, self.n_small
        if not self.world:
            loss_sum, loss_layers = 0.0, 0.0
            for l_sum, l_n in zip(scalars.loss_sums(host).tolist(), scalars.loss_counts(host).tolist()):
                if l_n > 0:
                    loss_sum += l_sum / l_n
                    loss_layers += 1
            return scalars.split(host[:n_small]), (loss_sum / loss_layers if loss_layers else None), self.in_stage2
        loss_sum, loss_layers, stage2 = host[n_small:].tolist()
        return (scalars.split(host[:n_small].float()), (loss_sum / loss_layers if loss_layers > 0 else None),
                stage2 > 0)


def _exchange_device(layers: List[DSVCoreAttention], scalars: StepScalars, dp_group, in_stage2: bool):
    """The collectives of the step end, on the device: ``(values, n_small, world)``: ``values`` holds the step
    scalars (``n_small`` of them, summed over ``dp_group``) and, when a world group of several ranks is
    reduced over (``world``), float64 ``[loss sum, layers with a loss, layers in stage 2]`` of all ranks after
    them. The predictor gradients are summed over ``dp_group`` in place."""
    small = scalars.device_flat()
    grads = [g for layer in layers for g in layer.predictor.grad_buffers()]
    n_small = sum(t.numel() for t in small)
    flat = torch.cat([t.reshape(-1).float() for t in small]) if small else torch.zeros(0)
    if _world_size(dp_group) > 1 and layers:
        flat = torch.cat([flat] + [g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
        offset = n_small
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _world_size(world) <= 1:
        return flat[:n_small], n_small, False
    stats = _local_loss_stats(scalars, flat, float(in_stage2))
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return torch.cat([flat[:n_small].to(stats), stats]), n_small, True  # float32 values are exact in float64


def _local_loss_stats(scalars: StepScalars, flat: torch.Tensor, in_stage2: float) -> torch.Tensor:
    """float64 ``[loss sum over layers of mean loss, layers with a loss, layers in stage 2]`` on the
    device the world all-reduce needs (CUDA under NCCL), computed without a host read."""
    device = flat.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    l_sum = scalars.loss_sums(flat).to(device, torch.float64)
    l_n = scalars.loss_counts(flat).to(device, torch.float64)
    has = l_n > 0
    mean = torch.where(has, l_sum / l_n.clamp_min(1.0), torch.zeros_like(l_sum))
    stage2 = torch.full((1,), in_stage2, dtype=torch.float64, device=device)
    return torch.cat([mean.sum().reshape(1), has.sum().to(torch.float64).reshape(1), stage2])


def _train_predictors(layers: List[DSVCoreAttention]) -> None:
    """The step's predictor losses and gradients for all layers in one batched pass (the forwards
    only collected statistics); each layer's loss sum and call count go to its step accumulators."""
    if not layers:
        return
    sums, counts = train_predictors([layer.predictor for layer in layers])
    if not any(counts):
        return
    device = layers[0].pending.device
    totals = torch.stack([sums.to(device), from_host(counts, device, torch.float32)], 1)
    torch._foreach_add_([layer.dsv_state.layout.loss(layer.pending) for layer in layers], list(totals.unbind(0)))


def _owner(model):
    """The module a prefetched step end is kept on: the model, or its first chunk."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if not chunks:  # no chunk on this rank: nothing to keep a prefetched step end on
        return None
    if not isinstance(chunks[0], torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a list of them, got {type(model).__name__}")
    return chunks[0]


def dsv_prefetch_step_end(model, dp_group=None) -> None:
    """Issue the step end's device work and its host copy now, after the step's last backward and before the
    optimizer reads its gradient norm; the next :func:`dsv_on_step_end` completes it.

    A trainer's step syncs the stream once anyway (Megatron's ``get_grad_norm_fp32`` ends in ``.item()``); without
    this call the step end syncs a second time, after the optimizer step, and the device idles through the step
    end's host work. With it the predictors' batched training, the collectives and the copy are queued behind the
    backward, the trainer's sync covers them, and the step end reads values already on the host. Same values,
    same step: nothing moves to a later step. Call it on every rank (the collectives are the step end's), once
    per optimizer step, after the last micro-batch's backward; ``dp_group`` as for :func:`dsv_on_step_end` (which
    must then get the same group, or None)."""
    owner = _owner(model)
    if owner is None:
        raise ValueError("dsv_prefetch_step_end: model is an empty list of chunks; call dsv_on_step_end alone")
    if getattr(owner, "_dsv_step_end_read", None) is not None:
        raise RuntimeError("dsv_prefetch_step_end was called twice before dsv_on_step_end: call it once per "
                           "optimizer step, after the last micro-batch's backward")
    group = dp_group if dp_group is not None else _default_dp_group()
    owner._dsv_step_end_read = _StepEndRead(dsv_layers(model), group)


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
    owner = _owner(model)
    read = getattr(owner, "_dsv_step_end_read", None) if owner is not None else None
    if read is not None:  # issued by dsv_prefetch_step_end
        owner._dsv_step_end_read = None
        if dp_group is not None and dp_group is not read.dp_group:
            raise ValueError("dsv_on_step_end: dp_group differs from the one dsv_prefetch_step_end reduced over; "
                             "pass the same group (or None) to both")
        layers = read.layers
    else:
        layers = dsv_layers(model)
        read = _StepEndRead(layers, dp_group if dp_group is not None else _default_dp_group())
    per_layer, mean_loss, in_stage2 = read.result()
    if not layers:
        return 1
    step = iteration if iteration is not None else layers[0].step_host + 1
    stage = 2 if in_stage2 or should_switch(layers[0].dsv_config, step, mean_loss) else 1
    adam_step_many([layer.predictor for layer in layers], [layer.predictor_lr() for layer in layers],
                   [grad_count for _, grad_count in per_layer])
    for layer, (pending, _) in zip(layers, per_layer):
        layer.finish_step(pending, step, stage)
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
    keys = {"predictor_loss": "predictor_loss", "sparsity_mean": "sparsity",
            "sparsity_measured_mean": "sparsity_measured", "budget_density_mean": "budget_density",
            "budget_density_measured_mean": "budget_density_measured",
            "recall_mean": "recall", "sparse_fraction": "sparse", "k_mean": "k_mean"}
    for total, name in keys.items():
        out[f"dsv/{total}"] = _mean([m[f"dsv/layer{layer.layer_number}/{name}"] for layer, m in zip(layers, per_layer)])
    return out

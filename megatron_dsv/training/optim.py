"""Data parallelism, optimizer and LR schedule.

On GPU: Megatron-Core's ``DistributedDataParallel`` (contiguous fp32 grad buffers, bucketed
all-reduce) and ``get_megatron_optimizer`` (Adam; bf16 params with fp32 main weights; clipping by the
global grad norm over model-parallel ranks). Both allocate on ``torch.cuda.current_device()``
unconditionally, so on CPU the same contract is met by two small classes here: ``LocalDataParallel``
(averages grads over the DP group once per step) and ``LocalAdam`` (torch Adam, same grad-norm rule
and the same ``sharded_state_dict`` layout through ``megatron.core.dist_checkpointing.optimizer``).
The LR schedule is Megatron-Core's ``OptimizerParamScheduler`` in both cases.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["wrap_model", "build_optimizer", "build_scheduler", "unwrap", "LocalDataParallel", "LocalAdam",
           "is_qk_norm_param", "qk_norm_overrides"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare VideoDiT under DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class LocalDataParallel(torch.nn.Module):
    """CPU counterpart of Megatron-Core DDP: same ``module`` / ``zero_grad_buffer`` / ``finish_grad_sync``."""

    def __init__(self, module: torch.nn.Module, dp_group):
        super().__init__()
        self.module = module
        self.dp_group = dp_group

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.grad = None

    @torch.no_grad()
    def finish_grad_sync(self):
        size = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        if size == 1:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)


QK_NORM_PARAMS = ("*.q_layernorm.*", "*.k_layernorm.*")
"""Name patterns (fnmatch, as Megatron-Core's ``ParamKey``) of the QK-norm gains and biases."""


def is_qk_norm_param(name: str) -> bool:
    """Whether parameter ``name`` is a QK-norm gain or bias (``--qk-norm-lr-mult`` applies to it)."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in QK_NORM_PARAMS)


@torch.no_grad()
def sum_partial_grads_over_tp(model: torch.nn.Module, tp_group) -> None:
    """Sum over the TP group the gradients of the QK-norm parameters replicated over TP ranks: each rank's
    q/k norms see only its own heads, so each holds part of the gradient (Megatron-LM's
    ``finalize_model_grads`` does the same for ``qk_layernorm``). Megatron DDP's ``main_grad`` where present."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = []
    for name, p in model.named_parameters():
        if is_qk_norm_param(name) and not getattr(p, "tensor_model_parallel", False):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _param_groups(model: torch.nn.Module, args):
    """Megatron's rule: no weight decay on biases and 1-D (norm) parameters; with ``--qk-norm-lr-mult``
    != 1, the QK-norm parameters in a group of their own whose ``max_lr`` / ``min_lr`` (what
    ``OptimizerParamScheduler`` reads per group) are the multiple of ``--lr`` / ``--min-lr``."""
    mult = getattr(args, "qk_norm_lr_mult", 1.0)
    decay, no_decay, qk = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if mult != 1.0 and is_qk_norm_param(name):
            qk.append(p)
        else:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0},
              {"params": qk, "wd_mult": 0.0, "lr_mult": mult, "max_lr": args.lr * mult,
               "min_lr": args.min_lr * mult}]
    return [g for g in groups if g["params"]], args.weight_decay


def qk_norm_overrides(args, config) -> Optional[dict]:
    """Megatron-Core's ``config_overrides`` for ``get_megatron_optimizer``: its standard ones (no weight
    decay on biases and 1-D parameters, which an explicit dict would otherwise drop) plus the QK-norm
    parameters at ``--qk-norm-lr-mult`` times the learning rate. None (the standard rule) when the
    multiplier is 1."""
    mult = getattr(args, "qk_norm_lr_mult", 1.0)
    if mult == 1.0:
        return None
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    overrides = dict(get_standard_config_overrides(config=config) or {})
    overrides[ParamKey(name=QK_NORM_PARAMS)] = ParamGroupOverride(max_lr=args.lr * mult, min_lr=args.min_lr * mult)
    return overrides


def grad_norm_fp32(params, mp_group) -> float:
    """Global L2 grad norm; parameters replicated over TP ranks are counted once."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    # the squares are summed where the gradients live and read once: a read per parameter synced the stream
    # once per parameter
    squares = [p.grad.detach().float().pow(2).sum() for p in params
               if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32)
    if mp_group is not None and dist.get_world_size(mp_group) > 1:
        if dist.get_backend(mp_group) != "nccl":  # gloo reduces host tensors
            total = total.cpu()
        elif total.device.type != "cuda":  # a rank without gradients joins with a zero on its GPU
            total = total.cuda()
        dist.all_reduce(total, group=mp_group)
    return float(total.sqrt())


class LocalAdam:
    """torch Adam behind the MegatronOptimizer calls the trainer and checkpointing use."""

    def __init__(self, model: torch.nn.Module, args, mp_group):
        groups, wd = _param_groups(model, args)
        self.optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps, weight_decay=wd)
        self.clip_grad = args.clip_grad
        self.mp_group = mp_group

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> Tuple[bool, float, None]:
        params = self.parameters()
        norm = grad_norm_fp32(params, self.mp_group)
        if not math.isfinite(norm):
            return False, norm, None
        if self.clip_grad > 0 and norm > self.clip_grad:
            coeff = self.clip_grad / (norm + 1.0e-6)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        self.optimizer.step()
        return True, norm, None

    def _init_state(self):
        for p in self.parameters():
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **_):
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                 optim_state_to_sharding_state)

        if is_loading:
            self._init_state()
        state_dict = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.parameters())
        steps = {float(s["step"]) for s in state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer step differs per parameter ({sorted(steps)}); expected one shared step")
        optim_state_to_sharding_state(state_dict, id_map, exclude_keys=("step",))
        state_dict["state"]["common_step"] = torch.tensor(steps.pop() if steps else 0.0)
        return state_dict

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        state = dict(state_dict["state"])
        step = state.pop("common_step", torch.tensor(0.0))
        for param_state in state.values():
            param_state["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        state_dict["state"] = state
        self.optimizer.load_state_dict(state_dict)


def wrap_model(model: torch.nn.Module, env, args) -> torch.nn.Module:
    """Megatron-Core DDP on GPU, LocalDataParallel on CPU."""
    if env.device.type != "cuda":
        # Grads are averaged over data-parallel x context-parallel ranks, as Megatron's DDP does.
        return LocalDataParallel(model, getattr(env.pg_collection, "dp_cp", env.pg_collection.dp))
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if args.precision == "bf16":
        # As Megatron-LM's get_model: cast float inputs to bf16 on the way in, outputs to fp32 on the way out.
        model = Float16Module(unwrap(model).config, model)

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False, check_for_nan_in_grad=True)
    return DistributedDataParallel(config=unwrap(model).config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: torch.nn.Module, env, args):
    """Adam with gradient clipping: Megatron-Core's on GPU, LocalAdam on CPU."""
    if env.device.type != "cuda":
        from megatron.core import parallel_state

        return LocalAdam(unwrap(ddp_model), args, parallel_state.get_model_parallel_group())
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = args.precision == "bf16"
    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             clip_grad=args.clip_grad, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             use_distributed_optimizer=False)
    # Like Megatron-LM's setup_model_and_optimizer: the optimizer finds its groups in parallel_state.
    return get_megatron_optimizer(config, [ddp_model], config_overrides=qk_norm_overrides(args, config))


def build_scheduler(optimizer, args):
    """Linear warmup then cosine (or --lr-decay-style) decay, stepped once per iteration.

    On --load the schedule is the checkpoint's (--use-checkpoint-opt_param-scheduler, or equal flags) or
    this run's flags (--override-opt-param-scheduler)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    override = bool(getattr(args, "override_opt_param_scheduler", False))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant", override_opt_param_scheduler=override,
        # without either flag checkpointing.check_scheduler has already refused a mismatch of the fields that
        # matter (Megatron-LM's rule), so the checkpoint's values are the run's
        use_checkpoint_opt_param_scheduler=not override)

"""Pure schedule rules: when the profiler runs, when stage 2 starts, which queries are sampled.

Kept free of process groups and modules so they are trivially testable; the
hooks (``hooks.py``) feed them values that are already identical on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dsv.config import DSVConfig

__all__ = ["is_profile_step", "trains_predictor", "should_switch", "sampled_queries", "profile_thinning", "smooth"]


def is_profile_step(step: int, cfg: DSVConfig) -> bool:
    """Profile on step 0, then every ``profile_interval`` steps during warm-up, then every
    ``profile_interval_after_warmup`` (counted from the end of warm-up)."""
    if step < cfg.profile_warmup_steps:
        return step % cfg.profile_interval == 0
    return (step - cfg.profile_warmup_steps) % cfg.profile_interval_after_warmup == 0


def trains_predictor(step: int, stage: int, cfg: DSVConfig) -> bool:
    """Stage 1 trains the predictors every step; stage 2 every ``predictor_train_interval`` steps
    (0: never)."""
    if stage == 1:
        return True
    n = cfg.predictor_train_interval
    return n > 0 and step % n == 0


def should_switch(cfg: DSVConfig, step: int, mean_loss: Optional[float]) -> bool:
    """Stage-1 -> stage-2 decision after ``step`` completed steps.

    ``mean_loss`` is the mean predictor loss over all layers (None when no layer
    trained this step: the loss rule then cannot fire).
    """
    loss_ok = mean_loss is not None and mean_loss < cfg.stage_switch_loss
    steps_ok = cfg.stage_switch_steps is not None and step >= cfg.stage_switch_steps
    match cfg.stage_switch_rule:
        case "loss":
            return loss_ok
        case "steps":
            return steps_ok
        case "loss_or_steps":
            return loss_ok or steps_ok
        case "loss_and_steps":
            return loss_ok and steps_ok
    raise ValueError(f"DSVConfig.stage_switch_rule must be one of loss, steps, loss_or_steps, loss_and_steps; "
                     f"got {cfg.stage_switch_rule!r}")


def sampled_queries(S: int, stride: int, step: int, device) -> torch.Tensor:
    """One query in ``stride``; the offset rotates with the step so every query is seen over time."""
    stride = max(1, min(stride, S))
    return torch.arange(step % stride, S, stride, device=device)


def profile_thinning(num_sampled: int, cap: int) -> int:
    """Keep one in this many of ``num_sampled`` sampled queries so at most ``cap`` are profiled (0: no cap)."""
    return 1 if cap <= 0 or num_sampled <= cap else -(-num_sampled // cap)


def smooth(old: torch.Tensor, measured: torch.Tensor, momentum: float, first: bool) -> torch.Tensor:
    """Momentum smoothing; the first measurement is taken as is (no bias towards the zero init)."""
    return measured.clone() if first else momentum * old + (1.0 - momentum) * measured

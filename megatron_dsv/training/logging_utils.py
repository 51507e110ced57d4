"""Megatron-style log lines and TensorBoard scalars (TensorBoard is optional)."""

from __future__ import annotations

import datetime
from typing import Dict, Optional

from megatron_dsv.training.dsv_hooks import per_layer_sparsity

__all__ = ["format_args_block", "format_iteration_line", "format_layer_lines", "format_validation_lines",
           "TensorBoardWriter"]


def format_args_block(args, title: str = "arguments") -> list:
    """Megatron-LM's block of every argument in effect, sorted case-insensitively, dots to column 50::

        ------------------------ arguments ------------------------
          dsv_theta ....................................... 0.9
        -------------------- end of arguments ---------------------"""
    rows = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()),
                  key=str.lower)
    return [f"------------------------ {title} ------------------------", *rows,
            f"-------------------- end of {title} ---------------------"]


def format_iteration_line(iteration: int, train_iters: int, stats: Dict[str, float],
                          now: Optional[datetime.datetime] = None) -> str:
    """One line in Megatron-LM's layout, e.g.

    `` [2026-11-30 12:00:00] iteration       10/     200 | consumed samples: 40 | elapsed time per
    iteration (ms): 123.4 | tokens/s: 12345 | learning rate: 1.000E-04 | loss: 1.234E+00 | grad norm:
    0.123 | dsv stage: 1 | dsv sparsity: 0.00 |``"""
    now = now or datetime.datetime.now()
    parts = [f" [{now.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d}",
             f"consumed samples: {int(stats['consumed_samples'])}",
             f"elapsed time per iteration (ms): {stats['ms_per_iter']:.1f}",
             f"tokens/s: {stats['tokens_per_s']:.0f}",
             f"learning rate: {stats['lr']:.3E}",
             f"loss: {stats['loss']:.6E}",
             f"grad norm: {stats['grad_norm']:.3f}"]
    if stats.get("skipped_iters", 0):
        parts.append(f"number of skipped iterations: {int(stats['skipped_iters'])}")
    if stats.get("dsv_stage") is None:
        parts.append("dsv: off")
    else:
        parts.append(f"dsv stage: {int(stats['dsv_stage'])}")
        parts.append(f"dsv sparsity: {stats.get('dsv_sparsity', 0.0):.2f}")
    return " | ".join(parts) + " |"


def format_validation_lines(iteration: int, loss: float, samples: int, ms: float,
                            ema_decay: Optional[float] = None) -> list:
    """Megatron-LM's validation block: the line between two rules, e.g.

    `` validation loss at iteration 300 | loss: 1.234567E+00 | samples: 16 | weights: EMA (decay 0.999) |
    elapsed time (ms): 12.3 |`` (``weights: live`` without an EMA)."""
    weights = f"EMA (decay {ema_decay})" if ema_decay else "live"
    line = (f" validation loss at iteration {iteration} | loss: {loss:.6E} | samples: {samples} | "
            f"weights: {weights} | elapsed time (ms): {ms:.1f} |")
    rule = "-" * len(line)
    return [rule, line, rule]


def format_layer_lines(dsv_values: Dict[str, float], per_line: int = 8) -> list:
    """`` dsv layers | L0: 0.83 sparse | L1: 0.41 dense | ...`` (several lines for deep models)."""
    layers = per_layer_sparsity(dsv_values)
    if not layers:
        return []
    cells = [f"L{i}: {s:.2f} {'sparse' if sp else 'dense'}" for i, (s, sp) in layers.items()]
    return [" dsv layers | " + " | ".join(cells[i:i + per_line]) + " |" for i in range(0, len(cells), per_line)]


class TensorBoardWriter:
    """SummaryWriter on rank 0 when --tensorboard-dir is set and tensorboard imports; otherwise no-op."""

    def __init__(self, log_dir: Optional[str], enabled: bool):
        self.writer = None
        if not (log_dir and enabled):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            print(f" > --tensorboard-dir given but tensorboard is not installed ({err}); no TensorBoard scalars",
                  flush=True)
            return
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

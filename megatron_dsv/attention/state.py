"""One DSV layer's state: the checkpointed buffers, their host mirrors, the packed per-step
accumulator, the step-end update and the metrics.

The tensors stay buffers of :class:`~megatron_dsv.attention.core_attention.DSVCoreAttention`
(state dicts and checkpoints see exactly those names); :class:`LayerState` registers them, reads
them into host mirrors at construction and after a load (:meth:`LayerState.sync`) and writes them
at the step end (:meth:`LayerState.finish_step`). It never keeps a reference to one: a device move
replaces the module's buffers. :class:`PendingLayout` names the offsets of the packed accumulator
that the forward (the profiler) fills and the step-end hooks exchange (:class:`StepScalars`).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_dsv.attention.schedule import smooth

__all__ = ["PER_HEAD_STATE", "CP_PLAN_COLUMNS", "PendingLayout", "StepScalars", "LayerState"]

# Buffers with one entry per local head: TP-sharded along dim 0 in sharded_state_dict.
PER_HEAD_STATE = ("sparsity", "budget_density", "recall", "cp_plan_state")
# cp_plan_state: the context-parallel plan in use, one row per head (parallel/cp_attention.encode_plan);
# all zeros = no plan yet (and always without context parallelism)
CP_PLAN_COLUMNS = 5


class PendingLayout:
    """A layer's per-step accumulator, one float32 buffer summed over data-parallel ranks at the
    step end: ``[loss sum, loss n, profile n, recall n, sparsity sum (H), recall sum (H), budget
    density sum (H)]``. Accessors return views, so ``+=`` on them writes the buffer."""

    LOSS_SUM, LOSS_N, PROFILE_N, RECALL_N = range(4)
    SCALARS = 4  # entries before the per-head sums

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    @property
    def numel(self) -> int:
        return self.SCALARS + 3 * self.num_heads

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32)

    def _heads(self, pending: torch.Tensor, i: int) -> torch.Tensor:
        start = self.SCALARS + i * self.num_heads
        return pending[start:start + self.num_heads]

    def loss(self, pending: torch.Tensor) -> torch.Tensor:
        """``[loss sum, loss n]``."""
        return pending[self.LOSS_SUM:self.LOSS_N + 1]

    def loss_sum(self, pending: torch.Tensor) -> torch.Tensor:
        return pending[self.LOSS_SUM:self.LOSS_SUM + 1]

    def loss_n(self, pending: torch.Tensor) -> torch.Tensor:
        return pending[self.LOSS_N:self.LOSS_N + 1]

    def after_loss(self, pending: torch.Tensor) -> torch.Tensor:
        """Everything after the two loss entries (the step end moves the loss columns apart)."""
        return pending[self.LOSS_N + 1:]

    def sparsity(self, pending: torch.Tensor) -> torch.Tensor:
        return self._heads(pending, 0)

    def recall(self, pending: torch.Tensor) -> torch.Tensor:
        return self._heads(pending, 1)

    def density(self, pending: torch.Tensor) -> torch.Tensor:
        return self._heads(pending, 2)

    def counts(self, pending: torch.Tensor) -> Tuple[float, float, float, float]:
        """Host floats ``(loss sum, loss n, profile n, recall n)`` of a host copy."""
        return tuple(float(x) for x in pending[:self.SCALARS])

    def add_profile(self, pending: torch.Tensor, sparsity: torch.Tensor, recall: torch.Tensor,
                    density: torch.Tensor) -> None:
        """One profiled forward's per-head measurements (``[H]`` each, any device)."""
        dev = pending.device
        pending[self.PROFILE_N] += 1
        pending[self.RECALL_N] += 1
        self.sparsity(pending).add_(sparsity.to(dev))
        self.recall(pending).add_(recall.to(dev))
        self.density(pending).add_(density.to(dev))


class StepScalars:
    """Every layer's step scalars in one flat buffer: ``[loss sums (L) | loss counts (L) | per layer:
    pending after the loss entries, grad_count]``; the loss columns come first so the world
    all-reduce reads them as two contiguous slices."""

    def __init__(self, layers):
        self.layers = layers
        self.rest = [layer.pending.numel() - 2 + 1 for layer in layers]

    def device_flat(self) -> List[torch.Tensor]:
        loss, count, rest = [], [], []
        for layer in self.layers:
            layout, pending = layer.dsv_state.layout, layer.pending
            loss.append(layout.loss_sum(pending))
            count.append(layout.loss_n(pending))
            rest += [layout.after_loss(pending), layer.predictor.grad_count]
        return loss + count + rest

    def loss_sums(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[:len(self.layers)]

    def loss_counts(self, flat: torch.Tensor) -> torch.Tensor:
        L = len(self.layers)
        return flat[L:2 * L]

    def split(self, host: torch.Tensor):
        """Per layer ``(pending [4 + 3H] float32, grad count float)`` from the host copy."""
        L = len(self.layers)
        out, offset = [], 2 * L
        for i, n in enumerate(self.rest):
            part = host[offset:offset + n]
            out.append((torch.cat([host[i:i + 1], host[L + i:L + i + 1], part[:-1]]), float(part[-1])))
            offset += n
        return out


class LayerState:
    """Host mirrors of one layer's checkpointed DSV state, read once from the device (at
    construction and after a load) and kept current by :meth:`finish_step`, so neither the forward
    nor the metrics ever sync the stream."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.layout = PendingLayout(num_heads)

    def register_buffers(self, module: torch.nn.Module) -> None:
        H = self.num_heads
        persistent = {  # the checkpointed state: a resumed run behaves exactly like an uninterrupted one
            "stage": torch.ones(1, dtype=torch.int64),
            "step": torch.zeros(1, dtype=torch.int64),
            "profiles": torch.zeros(1, dtype=torch.int64),
            "sparsity": torch.zeros(H, dtype=torch.float32),
            # K_h / S the budget rule asks for, smoothed like sparsity ('sparsity' rule: 1 - s_h)
            "budget_density": torch.ones(H, dtype=torch.float32),
            "recall": torch.zeros(H, dtype=torch.float32),
            "predictor_loss": torch.full((1,), float("nan"), dtype=torch.float32),
            "cp_plan_state": torch.zeros(H, CP_PLAN_COLUMNS, dtype=torch.int64),
        }
        for name, t in persistent.items():
            module.register_buffer(name, t)
        # summed over data-parallel ranks at the step end (hooks.py); not checkpointed
        module.register_buffer("pending", self.layout.zeros(), persistent=False)

    @staticmethod
    def fill_missing_state(state_dict, prefix, *args):
        """Older checkpoints: without budget_density (before the 'recall' budget rule) start from the
        sparsity rule's density 1 - s_h (the next profile replaces it); without cp_plan_state
        (before context parallelism) from no plan."""
        if prefix + "budget_density" not in state_dict and prefix + "sparsity" in state_dict:
            state_dict[prefix + "budget_density"] = 1.0 - state_dict[prefix + "sparsity"]
        if prefix + "cp_plan_state" not in state_dict and prefix + "sparsity" in state_dict:  # before CP: no plan
            heads = state_dict[prefix + "sparsity"].shape[0]
            state_dict[prefix + "cp_plan_state"] = torch.zeros(heads, CP_PLAN_COLUMNS, dtype=torch.int64)

    def sync(self, module: torch.nn.Module) -> None:
        """Read the host mirrors from the module's buffers (one device read per buffer)."""
        self.stage = int(module.stage[0])
        self.step = int(module.step[0])
        self.profiled = int(module.profiles[0]) > 0
        self.sparsity = module.sparsity.detach().float().cpu()
        self.measured = self.sparsity.clone()  # the last profile's unsmoothed sparsity
        self.density = module.budget_density.detach().float().cpu()
        # the last profile's unsmoothed recall-rule density; not in checkpoints (as ``measured``): after a
        # load it reads the smoothed budget until the next profile
        self.density_measured = self.density.clone()
        self.recall = module.recall.detach().float().cpu()
        self.loss = float(module.predictor_loss[0])

    def finish_step(self, module: torch.nn.Module, pending: torch.Tensor, step: int, stage: int,
                    momentum: float) -> bool:
        """Apply one step's DP-summed accumulators (a host copy) to the mirrors, write the module's
        buffers from them without reading the device, and clear the module's accumulator. Returns whether
        what the dispatcher decides from changed (a profile's sparsity and budget density, or the stage)."""
        pending = pending.detach().float()
        if pending.device.type != "cpu":  # callers other than the hooks may hand device state
            pending = pending.cpu()
        lay = self.layout
        loss_sum, loss_n, sp_n, rec_n = lay.counts(pending)
        if loss_n > 0:
            self.loss = loss_sum / loss_n
            module.predictor_loss.fill_(self.loss)
        if sp_n > 0:
            first = not self.profiled
            self.measured = lay.sparsity(pending) / sp_n
            self.sparsity = smooth(self.sparsity, self.measured, momentum, first)
            # the budget rises at once and falls with the momentum: a smoothed value that lags a
            # growing need would undershoot the recall target until it catches up
            needed = lay.density(pending) / sp_n
            self.density = torch.maximum(smooth(self.density, needed, momentum, first), needed)
            self.density_measured = needed
            _write(module.sparsity, self.sparsity)
            _write(module.budget_density, self.density)
            module.profiles += 1
            self.profiled = True
        if rec_n > 0:
            self.recall = lay.recall(pending) / rec_n
            _write(module.recall, self.recall)
        changed = sp_n > 0 or int(stage) != self.stage
        module.step.fill_(step)
        module.stage.fill_(stage)
        self.step, self.stage = int(step), int(stage)
        module.pending.zero_()
        return changed

    def metrics(self, prefix: str, last_sparse: bool, last_k: torch.Tensor, kernel_ok: bool) -> dict:
        """Flat per-layer and per-head host floats under ``prefix`` (from the mirrors: no sync)."""
        p, sp, dens, rec = prefix, self.sparsity, self.density, self.recall
        out = {p + "sparsity": float(sp.mean()), p + "sparsity_measured": float(self.measured.mean()),
               p + "budget_density": float(dens.mean()),
               p + "budget_density_measured": float(self.density_measured.mean()),
               p + "sparse": float(last_sparse), p + "recall": float(rec.mean()),
               p + "k_mean": float(last_k.mean()), p + "predictor_loss": self.loss,
               p + "kernel_ok": float(kernel_ok)}
        for h in range(self.num_heads):
            out[f"{p}head{h}/sparsity"] = float(sp[h])
            out[f"{p}head{h}/budget_density"] = float(dens[h])
            out[f"{p}head{h}/recall"] = float(rec[h])
            out[f"{p}head{h}/k"] = float(last_k[h])
        return out


def _write(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into device state without a stream sync (pinned, non-blocking on CUDA)."""
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.is_cuda)

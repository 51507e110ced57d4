"""Exponential moving average (EMA) of a model's trainable weights, kept in fp32.

Diffusion models are evaluated and sampled with an EMA of their weights: the raw weights of one step
carry the noise of the last few updates, which makes single evaluations jump by several percent.
Usage::

    ema = ModelEMA(model, decay=0.999)       # fp32 copies of the trainable parameters, on their devices
    for batch in data:
        ...; optimizer.step()
        ema.update(model)                    # after every successful optimizer step
    with ema.swap_in(model):                 # the model holds the EMA weights inside the block
        validate(model)                      # the live weights are restored bit for bit after it
    state = ema.state_dict()                 # {"decay", "warmup", "num_updates", "shadow": {name: tensor}}
    ema.load_state_dict(state)

What is averaged: the parameters with ``requires_grad`` (what the optimizer trains), matched by name
(``model.named_parameters()``), so ``update`` / ``swap_in`` take the same module (or one with the same
parameter names). Buffers are not averaged, and neither are DSV's predictor weights
(``requires_grad=False``, trained by their own rule): inside ``swap_in`` the DSV state and predictors
are the live model's, which is what the sparse lists of the averaged model should come from.

Decay: update ``n`` (0 for the first) uses ``min(decay, (1 + n) / (10 + n))``, as diffusers' EMAModel,
so early averages never reach back to the random initialisation (step 300: 0.97; ``decay`` from step
~9000 at 0.999). ``warmup=False`` uses ``decay`` from the first update.

Checkpoints: :meth:`sharded_state_dict` gives ``megatron.core.dist_checkpointing`` tensors that reuse
the model's sharding (key ``ema.<model key>``), so an EMA is saved and resharded as the weights are;
``num_updates`` travels beside it (:meth:`state_dict` without tensors: :meth:`meta`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import torch

__all__ = ["ModelEMA"]


class ModelEMA:
    """fp32 EMA of ``model``'s trainable parameters; starts as a copy of them."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ModelEMA decay must be in (0, 1), got {decay!r}")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.num_updates = 0
        self.names: List[str] = [name for name, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise ValueError("ModelEMA: the model has no trainable parameters (requires_grad) to average")
        self.shadow: Dict[str, torch.Tensor] = {}
        self.reset(model)

    # ------------------------------------------------------------ averaging
    def _live(self, model: torch.nn.Module) -> List[torch.Tensor]:
        params = dict(model.named_parameters())
        missing = [name for name in self.names if name not in params]
        if missing:
            raise ValueError(f"ModelEMA: the model has no parameter {missing[0]!r} ({len(missing)} missing): "
                             "pass the module the EMA was built from (not a wrapper of it)")
        return [params[name] for name in self.names]

    @torch.no_grad()
    def reset(self, model: torch.nn.Module) -> None:
        """Restart the average at ``model``'s current weights (``num_updates`` back to 0)."""
        self.shadow = {name: p.detach().float().clone() for name, p in zip(self.names, self._live(model))}
        self.num_updates = 0

    def current_decay(self) -> float:
        """The decay the next :meth:`update` applies."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1.0 + self.num_updates) / (10.0 + self.num_updates))

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """ema <- d * ema + (1 - d) * weights, for every trainable parameter (call after optimizer.step)."""
        weight = 1.0 - self.current_decay()
        shadow = [self.shadow[name] for name in self.names]
        live = [p.detach().float() for p in self._live(model)]
        torch._foreach_lerp_(shadow, live, weight)
        self.num_updates += 1

    @contextlib.contextmanager
    def swap_in(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Inside the block ``model``'s trainable parameters hold the EMA (cast to their dtype); on exit
        the live values come back exactly (a copy of them is held meanwhile)."""
        params = self._live(model)
        with torch.no_grad():
            backup = [p.detach().clone() for p in params]
            for p, name in zip(params, self.names):
                p.copy_(self.shadow[name])
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, saved in zip(params, backup):
                    p.copy_(saved)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Write the EMA into ``model``'s trainable parameters for good (e.g. a model kept for inference)."""
        for p, name in zip(self._live(model), self.names):
            p.copy_(self.shadow[name])

    # ------------------------------------------------------------ state
    def meta(self) -> dict:
        """The JSON-able part of the state: decay, warmup, num_updates."""
        return {"decay": self.decay, "warmup": self.warmup, "num_updates": self.num_updates}

    def state_dict(self) -> dict:
        return {**self.meta(), "shadow": {name: t.clone() for name, t in self.shadow.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict, strict_decay: bool = False) -> None:
        """Restore averages and ``num_updates``; ``decay`` stays this object's unless ``strict_decay``
        (a resumed run may change it)."""
        self._load_shadow(state["shadow"])
        self.num_updates = int(state["num_updates"])
        self.warmup = bool(state.get("warmup", self.warmup))
        if strict_decay and float(state["decay"]) != self.decay:
            raise ValueError(f"ModelEMA decay is {self.decay} but the state has {state['decay']}")

    def _load_shadow(self, tensors: Dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.names) - set(tensors))
        extra = sorted(set(tensors) - set(self.names))
        if missing or extra:
            raise ValueError(f"ModelEMA state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for name in self.names:
            if tuple(tensors[name].shape) != tuple(self.shadow[name].shape):
                raise ValueError(f"ModelEMA state {name!r} has shape {tuple(tensors[name].shape)}, "
                                 f"the model {tuple(self.shadow[name].shape)}")
            self.shadow[name].copy_(tensors[name])

    def sharded_state_dict(self, model_sharded_state_dict: dict, prefix: str = "ema") -> dict:
        """``{name: ShardedTensor}`` for ``dist_checkpointing.save`` / ``load``, each laid out as the
        model's tensor of that name (``model.sharded_state_dict()``) under the key ``<prefix>.<key>``."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        missing = [name for name in self.names if name not in model_sharded_state_dict]
        if missing:
            raise ValueError(f"ModelEMA: {missing[0]!r} is not in the model's sharded state dict")
        return {name: make_sharded_optimizer_tensor(model_sharded_state_dict[name], self.shadow[name], prefix)
                for name in self.names}

    @torch.no_grad()
    def load_sharded(self, loaded: dict, meta: dict) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict` plus
        :meth:`meta` as saved."""
        self._load_shadow({name: loaded[name] for name in loaded})
        self.num_updates = int(meta["num_updates"])
        self.warmup = bool(meta.get("warmup", self.warmup))

"""Dispatcher: per layer, sparse or dense, and the per-head KV budgets.

Two budget rules (``DSVConfig.budget_rule``):

* ``'sparsity'`` (the paper): a layer runs sparse when its smoothed mean sparsity is at least
  ``sparsity_threshold`` *and* the speedup of sparse over dense attention at that density and
  sequence length is > 1. Budgets: ``K_h = max(ceil((1 - s_h) * S), k_min)`` tokens.
* ``'recall'``: ``K_h = max(ceil(d_h * S), k_min)`` tokens from the smoothed per-head budget
  density ``d_h`` (the profiler's measured list length reaching ``recall_target``); the layer
  runs sparse when the effective sparsity ``1 - mean(K_h) / S`` is at least
  ``sparsity_threshold`` and the speedup at that effective sparsity is > 1.

Either way budgets are rounded up to the kernel block; at block granularity they are handed to
the ops in key-block units.

``DSVConfig.max_density`` caps every budget at that fraction of S (never under ``k_min`` or the
neighbourhood floor), and the layer then runs sparse when the *capped* budgets' effective sparsity is
at least ``sparsity_threshold`` and faster, whatever the measured sparsity (:func:`choose_sparse_budgets`).

The speedup comes from a :class:`SpeedupTable`: measured rows of a
``benchmarks/results/sparse_attention-*.json`` file (``DSVConfig.speedup_table``),
or, when no file is given, a FLOP model (sparse kernel at 75% of dense throughput
on the FLOPs it keeps, plus the low-rank estimation). The FLOP model ignores launch
overheads, so it is optimistic at short sequences; on-GPU calibration at start-up
is not implemented: point ``speedup_table`` at a benchmark file for measured figures.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Tuple

import torch

from megatron_dsv.config import DSVConfig

__all__ = ["SpeedupTable", "head_budgets", "density_budgets", "choose_sparse", "choose_sparse_density",
           "choose_sparse_budgets", "plan_layer",
           "FLOP_MODEL_EFFICIENCY", "BWD_FLOP_RATIO"]

FLOP_MODEL_EFFICIENCY = 0.75  # sparse kernel throughput / dense throughput on kept FLOPs (DESIGN.md section 2)
BWD_FLOP_RATIO = 2.5  # attention backward costs ~2.5x the forward FLOPs


def _combined(fwd: float, bwd: float) -> float:
    """fwd+bwd speedup from the two speedups, weighting by dense time (bwd ~2.5x fwd)."""
    return (1.0 + BWD_FLOP_RATIO) / (1.0 / fwd + BWD_FLOP_RATIO / bwd)


class SpeedupTable:
    """Speedup of sparse over dense attention as a function of (S, sparsity, training).

    Args:
        rows: benchmark rows (``S``, ``sparsity``, ``granularity``, ``speedup_fwd``,
            optional ``speedup_bwd`` / ``speedup_total``); ``None`` selects the FLOP model.
        granularity: ``'token'`` or ``'block'``; only matching rows are used.
    """

    def __init__(self, rows: Optional[List[dict]] = None, granularity: str = "block",
                 head_dim: int = 128, rank: int = 16, group_size: int = 64):
        self.granularity = granularity
        self.head_dim, self.rank, self.group_size = head_dim, rank, group_size
        self.curves: Dict[int, Tuple[List[float], List[float], List[float]]] = {}
        if rows is not None:
            self._build(rows)

    @property
    def source(self) -> str:
        return "measured" if self.curves else "flop_model"

    @classmethod
    def from_config(cls, cfg: DSVConfig, head_dim: int) -> "SpeedupTable":
        kw = dict(granularity=cfg.granularity, head_dim=head_dim, rank=cfg.predictor_rank, group_size=cfg.group_size)
        if cfg.speedup_table is None:
            return cls(None, **kw)
        try:
            with open(cfg.speedup_table) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"DSVConfig.speedup_table must be a readable benchmark JSON file, "
                             f"got {cfg.speedup_table!r}: {e}") from e
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ValueError(f"DSVConfig.speedup_table {cfg.speedup_table!r} must hold {{'meta': ..., 'rows': [...]}}")
        return cls(rows, **kw)

    def _build(self, rows: List[dict]) -> None:
        by_s: Dict[int, List[Tuple[float, float, float]]] = {}
        for row in rows:
            if row.get("granularity", self.granularity) != self.granularity:
                continue
            if not all(key in row for key in ("S", "sparsity", "speedup_fwd")):
                continue
            fwd = float(row["speedup_fwd"])
            train = row.get("speedup_total")
            if train is None:
                train = _combined(fwd, float(row["speedup_bwd"])) if "speedup_bwd" in row else fwd
            by_s.setdefault(int(row["S"]), []).append((float(row["sparsity"]), fwd, float(train)))
        if not by_s:
            raise ValueError(f"DSVConfig.speedup_table has no rows with granularity={self.granularity!r} and the "
                             f"fields S, sparsity, speedup_fwd; allowed granularities: 'token', 'block'")
        for S, pts in by_s.items():
            pts.sort()
            self.curves[S] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])

    def speedup(self, S: int, sparsity: float, training: bool = True) -> float:
        """Speedup at sequence length S and sparsity (nearest measured S in log scale; linear in sparsity)."""
        if not self.curves:
            return self._flop_model(S, sparsity)
        near = min(self.curves, key=lambda s: abs(math.log(s) - math.log(max(S, 1))))
        xs, fwd, train = self.curves[near]
        ys = train if training else fwd
        return _interp(sparsity, xs, ys)

    def _flop_model(self, S: int, sparsity: float) -> float:
        density = max(1.0 - sparsity, 1.0 / max(S, 1))
        # estimation: (S/G) x S x r multiply-adds against S x S x D for QK^T and PV (fwd+bwd ~ 3.5x fwd)
        estimate = self.rank / (self.group_size * self.head_dim * 2 * (1 + BWD_FLOP_RATIO))
        return 1.0 / (density / FLOP_MODEL_EFFICIENCY + estimate)


def _interp(x: float, xs: List[float], ys: List[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-12)
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def head_budgets(sparsity: torch.Tensor, S: int, cfg: DSVConfig, min_tokens: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head budgets from per-head sparsity ``[H]``.

    Returns ``(budgets, tokens)``: ``budgets`` int64 ``[H]`` in the ops' units (tokens, or key
    blocks at block granularity) and ``tokens`` int64 ``[H]`` = keys each query attends.
    ``min_tokens``: a floor beside ``k_min`` (local + predicted lists: the largest neighbourhood).
    """
    return _budgets(1.0 - sparsity.double().clamp(0.0, 1.0), S, cfg, min_tokens)


def density_budgets(density: torch.Tensor, S: int, cfg: DSVConfig, min_tokens: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head budgets from per-head budget densities ``[H]`` (``K_h / S``); as :func:`head_budgets`."""
    return _budgets(density.double().clamp(0.0, 1.0), S, cfg, min_tokens)


def _budgets(dens: torch.Tensor, S: int, cfg: DSVConfig, min_tokens: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    # -1e-6*S absorbs fp32 sparsity error (0.9f gives density 0.100000024: one more token at S=1000)
    floor = float(max(cfg.k_min, min_tokens))
    k = torch.ceil(dens * S - 1e-6 * S)
    if cfg.max_density is not None:  # the cap yields to the floor: the neighbourhood always fits
        k = torch.minimum(k, torch.full_like(k, math.ceil(cfg.max_density * S - 1e-6 * S)))
    k = torch.maximum(k, torch.full_like(dens, floor)).clamp(max=S).long()
    if cfg.block_size > 0:
        blocks = (k + cfg.block_size - 1) // cfg.block_size
        n_blocks = -(-S // cfg.block_size)
        blocks = blocks.clamp(1, n_blocks)
        return blocks, (blocks * cfg.block_size).clamp(max=S)
    return k, k


def choose_sparse(sparsity: torch.Tensor, S: int, cfg: DSVConfig, table: SpeedupTable,
                  training: bool = True, min_tokens: int = 0) -> bool:
    """The dispatcher's rule for one layer under budget_rule 'sparsity', given its smoothed
    per-head sparsity ``[H]`` (under ``max_density``: :func:`choose_sparse_budgets` on its capped budgets)."""
    _, tokens = head_budgets(sparsity, S, cfg, min_tokens)
    if cfg.max_density is not None:
        return choose_sparse_budgets(tokens, S, cfg, table, training)
    if float(sparsity.float().mean()) < cfg.sparsity_threshold:
        return False
    effective = 1.0 - float(tokens.double().mean()) / S  # after k_min and block rounding
    return table.speedup(S, effective, training) > 1.0


def choose_sparse_density(density: torch.Tensor, S: int, cfg: DSVConfig, table: SpeedupTable,
                          training: bool = True, min_tokens: int = 0) -> bool:
    """The dispatcher's rule for one layer under budget_rule 'recall', given its smoothed
    per-head budget density ``[H]``: the budgets themselves must be sparse enough and faster."""
    _, tokens = density_budgets(density, S, cfg, min_tokens)
    return choose_sparse_budgets(tokens, S, cfg, table, training)


def choose_sparse_budgets(tokens: torch.Tensor, S: int, cfg: DSVConfig, table: SpeedupTable,
                         training: bool = True) -> bool:
    """The budgets decide (rule 'recall', and either rule under ``DSVConfig.max_density``): the lists
    (``tokens [H]``, keys per query) are sparse enough and faster; the measured sparsity does not gate."""
    effective = 1.0 - float(tokens.double().mean()) / S
    return effective >= cfg.sparsity_threshold and table.speedup(S, effective, training) > 1.0


def plan_layer(sparsity: torch.Tensor, density: torch.Tensor, S: int, cfg: DSVConfig, table: SpeedupTable,
               training: bool = True, min_tokens: int = 0) -> Tuple[bool, torch.Tensor, torch.Tensor]:
    """``(sparse, budgets, tokens)`` of one layer under ``cfg.budget_rule`` (host tensors ``[H]``);
    ``min_tokens`` floors every budget (local + predicted lists: the neighbourhood always fits)."""
    match cfg.budget_rule:
        case "recall":
            budgets, tokens = density_budgets(density, S, cfg, min_tokens)
        case "sparsity":
            budgets, tokens = head_budgets(sparsity, S, cfg, min_tokens)
        case _:
            raise ValueError(f"DSVConfig.budget_rule must be one of recall, sparsity; got {cfg.budget_rule!r}")
    if cfg.max_density is not None or cfg.budget_rule == "recall":  # the budgets themselves decide
        return choose_sparse_budgets(tokens, S, cfg, table, training), budgets, tokens
    return choose_sparse(sparsity, S, cfg, table, training, min_tokens), budgets, tokens

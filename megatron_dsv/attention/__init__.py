"""The DSV method: core attention, per-layer state (``state.py``), grouping, predictor, profiler
(``profiler.py``), dispatcher, schedule.

Trainer-facing API (see ``hooks.py``): :func:`dsv_layers`, :func:`dsv_on_step_end` (and, before the optimizer
step, :func:`dsv_prefetch_step_end`), :func:`dsv_metrics`, :func:`dsv_stage`; a video model's forward:
:func:`dsv_set_token_grid` (its tokens in :func:`to_cube_order`).
"""

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.attention.grouping import cube_order_coords, cube_order_permutation, from_cube_order, to_cube_order
from megatron_dsv.attention.hooks import (dsv_eval_forward, dsv_layers, dsv_metrics, dsv_on_step_end,
                                         dsv_prefetch_step_end, dsv_set_token_grid, dsv_stage)

__all__ = ["DSVCoreAttention", "dsv_layers", "dsv_on_step_end", "dsv_prefetch_step_end", "dsv_metrics", "dsv_stage",
           "dsv_eval_forward", "dsv_set_token_grid", "cube_order_permutation", "cube_order_coords", "to_cube_order",
           "from_cube_order"]

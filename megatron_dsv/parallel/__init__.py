"""DSV context parallelism (CP): hybrid head-wise (HCP) and sequence-wise (SCP) CP per layer.

Modules:

* :mod:`~megatron_dsv.parallel.groups` -- :class:`CPLayout` (hcp x scp = cp, intra-node placement),
  the pure rank layout :func:`layout_groups`, and :class:`DSVCPGroups`, every HCP/SCP subgroup of
  every CP group created once at start-up.
* :mod:`~megatron_dsv.parallel.placement` -- heads to HCP ranks: even split or
  Longest-Processing-Time on per-head cost.
* :mod:`~megatron_dsv.parallel.planner` -- the per-layer planner: a communication model and the
  (layout, placement) that minimises max over ranks of compute + communication under a memory cap.
* :mod:`~megatron_dsv.parallel.collectives` -- autograd collectives (head <-> sequence all-to-all,
  sequence gather, selective KV gather). Imported from its module, not re-exported here.
* ``cp_attention`` (later) -- the CP core attention that applies a :class:`LayerPlan`.
"""

from megatron_dsv.parallel.groups import CPLayout, DSVCPGroups, cp_layouts, layout_groups
from megatron_dsv.parallel.placement import even_placement, head_costs, head_order_and_counts, lpt_placement, makespan
from megatron_dsv.parallel.planner import CommModel, LayerPlan, measure_bandwidth, plan_layer, plan_layers

__all__ = [
    "CPLayout", "DSVCPGroups", "cp_layouts", "layout_groups",
    "even_placement", "lpt_placement", "makespan", "head_order_and_counts", "head_costs",
    "CommModel", "LayerPlan", "measure_bandwidth", "plan_layer", "plan_layers",
]

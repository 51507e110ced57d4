"""Every (layout, head placement) a CP equality test goes through, as LayerPlans built by hand."""

from megatron_dsv.parallel.groups import cp_layouts
from megatron_dsv.parallel.placement import even_placement, head_costs, lpt_placement
from megatron_dsv.parallel.planner import LayerPlan


def every_plan(world: int, heads: int, density):
    """Yield a LayerPlan per layout of ``world`` ranks and placement (even; LPT on the sparse heads'
    ``density``), without the planner's cost estimates."""
    for layout in cp_layouts(world):
        for placement in ("even", "lpt"):
            placed = (even_placement(heads, layout.hcp) if placement == "even"
                      else lpt_placement(head_costs(density, True), layout.hcp))
            yield LayerPlan(layout=layout, placement=placement, heads=placed, est_ms=0.0, compute_ms=0.0,
                            comm_ms=0.0, peak_bytes=0)

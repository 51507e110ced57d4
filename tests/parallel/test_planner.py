"""Head placement and the per-layer CP planner, on cost tables solved by hand."""

import json
import math

import pytest

from megatron_dsv.parallel import (CommModel, CPLayout, LayerPlan, even_placement, head_costs, head_order_and_counts,
                                   lpt_placement, makespan, plan_layer, plan_layers)

S, D, B = 8192, 128, 2  # tokens, head dim, bytes per element


# ---------------------------------------------------------------------------- placement
def test_lpt_known_example_and_its_gap_to_the_optimum():
    # 5->r0, 4->r1, 3->r1 (4<5), 3->r0 (5<7), 3->r1 (7<8): makespan 10, the optimum {5,4}{3,3,3} is 9
    placement = lpt_placement([5, 4, 3, 3, 3], 2)
    assert placement == [[0, 3], [1, 2, 4]]
    assert makespan([5, 4, 3, 3, 3], placement) == 10.0


def test_lpt_ties_and_zero_costs():
    assert lpt_placement([1, 1, 1, 1, 1, 1], 3) == [[0, 3], [1, 4], [2, 5]]
    assert lpt_placement([0, 0, 0, 0], 2) == [[0, 2], [1, 3]]  # fewer heads first on equal load
    assert lpt_placement([2.0, 7.0, 1.0], 2) == [[1], [0, 2]]


def test_lpt_beats_even_on_heterogeneous_and_ties_on_uniform():
    costs = [0.75, 0.5, 0.25, 0.125]
    assert even_placement(4, 2) == [[0, 1], [2, 3]]
    assert lpt_placement(costs, 2) == [[0, 3], [1, 2]]
    assert makespan(costs, even_placement(4, 2)) == 1.25
    assert makespan(costs, lpt_placement(costs, 2)) == 0.875
    skewed = [8, 7, 6, 5, 1, 1, 1, 1]
    assert makespan(skewed, lpt_placement(skewed, 4)) == 8.0
    assert makespan(skewed, even_placement(8, 4)) == 15.0
    uniform = [0.3] * 8
    assert makespan(uniform, lpt_placement(uniform, 4)) == makespan(uniform, even_placement(8, 4))


def test_head_order_and_counts_and_even():
    assert head_order_and_counts([[0, 3], [1, 2, 4]]) == ([0, 3, 1, 2, 4], [2, 3])
    assert even_placement(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="num_heads must be a positive multiple of ranks"):
        even_placement(6, 4)
    with pytest.raises(ValueError, match="placement must hold every head"):
        head_order_and_counts([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="ranks must be a positive int"):
        lpt_placement([1.0], 0)
    with pytest.raises(ValueError, match="costs must be finite"):
        lpt_placement([1.0, -1.0], 2)


def test_head_costs():
    assert head_costs([0.1, 0.5], sparse=False) == [1.0, 1.0]
    assert head_costs([0.1, 0.5], sparse=True) == [0.1, 0.5]
    assert head_costs([0.1, 0.5], sparse=True, speedup=lambda d: 0.5 / d) == pytest.approx([0.2, 1.0], rel=1e-12)
    with pytest.raises(ValueError, match=r"density must lie in \(0, 1\]"):
        head_costs([0.0], sparse=True)
    with pytest.raises(ValueError, match="speedup must return"):
        head_costs([0.5], sparse=True, speedup=lambda d: 0.0)


# ---------------------------------------------------------------------------- planner
def test_dense_slow_inter_node_keeps_the_heavier_group_inside_a_node():
    # cp=8 on 2 nodes of 4, 8 dense heads; U = S*n*D*b. Bytes per rank (fwd+bwd):
    #   hcp8: 7/8 U inter | hcp4-scp2: HCP 3/4 U + SCP 1/2 U | hcp2-scp4: HCP 1/2 U + SCP 3/2 U | scp8: 7/2 U inter.
    # hcp4-scp2-hcp_inner keeps the 3/4 U all-to-alls on NVLink and sends only 1/2 U across nodes.
    comm = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=4, latency_s=0.0)
    plan = plan_layer([1.0] * 8, False, S, D, 8, 1.0, comm)
    U = S * 8 * D * B
    assert plan.layout == CPLayout(4, 2, True) and plan.layout.name == "hcp4-scp2-hcp_inner"
    assert plan.placement == "even" and plan.heads == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.compute_ms == pytest.approx(1.0, rel=1e-12)  # 2 heads x 1 ms / scp 2
    assert plan.comm_ms == pytest.approx(1e3 * (0.75 * U / 100e9 + 0.5 * U / 10e9), rel=1e-12)
    assert plan.est_ms == pytest.approx(plan.compute_ms + plan.comm_ms, rel=1e-12)
    assert plan.comm_bytes == int(1.25 * U)
    # the same CP group inside one node: the fewest bytes win, pure head-wise CP (7/8 U)
    intra = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=8, latency_s=0.0)
    assert plan_layer([1.0] * 8, False, S, D, 8, 1.0, intra).layout == CPLayout(8, 1)
    # CP ranks strided by tp=2 ([0, 2, ..., 14]): a node of 4 holds only 2 consecutive CP ranks, so no
    # group of 4 fits in a node. Best: hcp4-scp2-scp_inner, HCP 3/4 U across nodes and SCP 1/2 U inside
    # (0.8 U/1e10 s), ahead of hcp8 (7/8 U across) and hcp4-scp2-hcp_inner (5/4 U across).
    strided = plan_layer([1.0] * 8, False, S, D, 8, 1.0, comm, cp_ranks=list(range(0, 16, 2)))
    assert strided.layout == CPLayout(4, 2, False)
    assert strided.comm_ms == pytest.approx(1e3 * (0.75 * U / 10e9 + 0.5 * U / 100e9), rel=1e-12)


def test_heterogeneous_sparse_heads_lpt_beats_even():
    comm = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=8, latency_s=1e-5)
    density = [0.75, 0.5, 0.25, 0.125]
    plan = plan_layer(density, True, S, D, 2, 4.0, comm, layouts=[CPLayout(2, 1)])
    a2a_ms = 1e3 * 8 * (1e-5 + (S / 2) * D * B * 2 / 100e9)  # 8 all-to-alls of 2 heads x S/2 rows
    assert plan.placement == "lpt" and plan.heads == [[0, 3], [1, 2]]
    assert plan.compute_ms == pytest.approx(4.0 * 0.875, rel=1e-12)
    assert plan.comm_ms == pytest.approx(a2a_ms, rel=1e-12)
    # LPT is a heuristic: where the contiguous split happens to be better, the planner keeps it
    skew = [0.5, 0.4, 0.01, 0.3, 0.3, 0.3]  # even: 0.91 | LPT: {0.5,0.3,0.01}=0.81, {0.4,0.3,0.3}=1.0
    plan = plan_layer(skew, True, S, D, 2, 1.0, comm, layouts=[CPLayout(2, 1)])
    assert plan.placement == "even" and plan.compute_ms == pytest.approx(0.91, rel=1e-12)
    # the measured speedup curve replaces density as the cost
    plan = plan_layer(density, True, S, D, 2, 4.0, comm, layouts=[CPLayout(2, 1)], speedup=lambda d: 0.5 / d)
    assert plan.compute_ms == pytest.approx(4.0 * 0.875 * 2, rel=1e-12)


def test_very_sparse_heads_favour_sequence_cp_and_dense_heads_head_cp():
    comm = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=8, latency_s=0.0)
    # density 0.05, cp=4, 8 heads: hcp4 moves 3/2 U, hcp2-scp2 U + U/20, scp4 only 3/20 U
    plan = plan_layer([0.05] * 8, True, S, D, 4, 1.0, comm)
    U = S * 8 * D * B
    assert plan.layout == CPLayout(1, 4) and plan.heads == [list(range(8))]
    assert plan.compute_ms == pytest.approx(8 * 0.05 / 4, rel=1e-12)
    assert plan.comm_ms == pytest.approx(1e3 * 0.15 * U / 100e9, rel=1e-9)
    # dense heads: scp4 all-gathers 3 U, hcp4 moves 3/2 U
    assert plan_layer([0.05] * 8, False, S, D, 4, 1.0, comm).layout == CPLayout(4, 1)


def test_memory_cap_excludes_layouts():
    comm = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=8, latency_s=0.0)
    unit = S * D * B  # peaks: scp4 8.6 units, hcp2-scp2 8.2, hcp4 8.0
    assert plan_layer([0.05] * 8, True, S, D, 4, 1.0, comm).peak_bytes == math.ceil(8.6 * unit)
    plan = plan_layer([0.05] * 8, True, S, D, 4, 1.0, comm, memory_cap_bytes=int(8.4 * unit))
    assert plan.layout == CPLayout(2, 2, True)  # both placements on one node: tie -> hcp_inner
    assert plan.placement == "even" and plan.heads == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.peak_bytes == math.ceil(8.2 * unit)
    with pytest.raises(ValueError, match="memory_cap_bytes"):
        plan_layer([0.05] * 8, True, S, D, 4, 1.0, comm, memory_cap_bytes=int(7.9 * unit))


def test_plan_round_trip_describe_and_plan_layers():
    comm = CommModel(bandwidth_intra=100e9, bandwidth_inter=10e9, gpus_per_node=4, latency_s=0.0)
    # layer 2 at density 0.05: SCP bytes shrink 20x, hcp4-scp2-hcp_inner still wins (3/4 U intra +
    # U/40 inter against scp8's 7/40 U inter)
    plans = plan_layers([[1.0] * 8, [0.05] * 8], [False, True], S, D, 8, 1.0, comm)
    assert [p.layout.name for p in plans] == ["hcp4-scp2-hcp_inner", "hcp4-scp2-hcp_inner"]
    assert plans[1].compute_ms == pytest.approx(0.05, rel=1e-12) and plans[1].comm_ms < plans[0].comm_ms
    for plan in plans:
        data = json.loads(json.dumps(plan.to_dict()))
        assert LayerPlan.from_dict(data) == plan
    assert plans[0].describe().startswith("hcp4-scp2-hcp_inner even heads=[[0, 1], [2, 3], [4, 5], [6, 7]] est 1.965 ms")
    with pytest.raises(ValueError, match="one entry per layer"):
        plan_layers([[1.0] * 8], [False, True], S, D, 8, 1.0, comm)
    with pytest.raises(ValueError, match="data must be a dict"):
        LayerPlan.from_dict({"layout": {}})


def test_planner_input_errors():
    comm = CommModel()
    with pytest.raises(ValueError, match="S must be divisible by cp"):
        plan_layer([1.0] * 4, False, 1001, D, 4, 1.0, comm)
    with pytest.raises(ValueError, match="comm must be a CommModel"):
        plan_layer([1.0] * 4, False, S, D, 4, 1.0, {"bandwidth_intra": 1})
    with pytest.raises(ValueError, match=r"layouts must hold CPLayouts with hcp\*scp == cp"):
        plan_layer([1.0] * 4, False, S, D, 4, 1.0, comm, layouts=[CPLayout(2, 1)])
    with pytest.raises(ValueError, match="cp_ranks must be 4 distinct"):
        plan_layer([1.0] * 4, False, S, D, 4, 1.0, comm, cp_ranks=[0, 1, 1, 2])
    with pytest.raises(ValueError, match="CommModel.gpus_per_node must be a positive int"):
        CommModel(gpus_per_node=0)

"""CP layouts, their rank groups, and DSVCPGroups over real gloo process groups (spawned workers)."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_dsv.parallel import CPLayout, DSVCPGroups, cp_layouts, layout_groups
from tests.parallel.spawn import run_world

WORLD = 4
DEADLINE_S = 120.0


# ---------------------------------------------------------------------------- pure layout logic
def test_cp_layouts_counts_order_and_names():
    assert [l.name for l in cp_layouts(2)] == ["hcp1-scp2", "hcp2-scp1"]
    assert [l.name for l in cp_layouts(4)] == ["hcp1-scp4", "hcp2-scp2-hcp_inner", "hcp2-scp2-scp_inner", "hcp4-scp1"]
    assert [l.name for l in cp_layouts(8)] == ["hcp1-scp8", "hcp2-scp4-hcp_inner", "hcp2-scp4-scp_inner",
                                               "hcp4-scp2-hcp_inner", "hcp4-scp2-scp_inner", "hcp8-scp1"]
    assert len(cp_layouts(12)) == 2 + 2 * 4  # divisors 1, 2, 3, 4, 6, 12
    assert CPLayout(1, 4, False) == CPLayout(1, 4, True)  # placement is moot for pure layouts
    with pytest.raises(ValueError, match="cp must be a positive int"):
        cp_layouts(0)
    with pytest.raises(ValueError, match="CPLayout.scp must be a positive int"):
        CPLayout(2, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_layout_groups_membership(cp):
    cp_ranks = [10 + 3 * i for i in range(cp)]  # arbitrary global ranks in CP rank order
    for layout in cp_layouts(cp):
        hcp_groups, scp_groups = layout_groups(cp_ranks, layout)
        assert len(hcp_groups) == layout.scp and all(len(g) == layout.hcp for g in hcp_groups)
        assert len(scp_groups) == layout.hcp and all(len(g) == layout.scp for g in scp_groups)
        assert sorted(r for g in hcp_groups for r in g) == cp_ranks
        assert sorted(r for g in scp_groups for r in g) == cp_ranks
        for g in hcp_groups + scp_groups:
            assert g == sorted(g)  # CP rank order inside every group
        for h in hcp_groups:
            for s in scp_groups:
                assert len(set(h) & set(s)) == 1
        inner = hcp_groups if layout.hcp_inner else scp_groups
        assert all(g == cp_ranks[cp_ranks.index(g[0]):cp_ranks.index(g[0]) + len(g)] for g in inner)


def test_layout_groups_on_ranks_4_to_7():
    ranks = [4, 5, 6, 7]
    assert layout_groups(ranks, CPLayout(2, 2, True)) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])
    assert layout_groups(ranks, CPLayout(2, 2, False)) == ([[4, 6], [5, 7]], [[4, 5], [6, 7]])
    assert layout_groups(ranks, CPLayout(4, 1)) == ([[4, 5, 6, 7]], [[4], [5], [6], [7]])
    assert layout_groups(ranks, CPLayout(1, 4)) == ([[4], [5], [6], [7]], [[4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"needs hcp\*scp == len\(cp_ranks\) \(4\)"):
        layout_groups(ranks, CPLayout(2, 1))
    with pytest.raises(ValueError, match="cp_ranks must be distinct"):
        layout_groups([4, 4, 6, 7], CPLayout(2, 2))


def test_cp_size_one_is_rejected(megatron_cpu):
    with pytest.raises(ValueError, match="DSV context parallelism needs context_parallel_size > 1"):
        DSVCPGroups.from_megatron(4, pg_collection=megatron_cpu)


# ---------------------------------------------------------------------------- process groups
def _check_groups(groups: DSVCPGroups, cp_ranks):
    """This rank's groups for every layout: ranks, ranks inside the group, and an all_reduce."""
    me = dist.get_rank()
    out = {}
    for layout in groups.layouts:
        hcp_g, scp_g, hcp_rank, scp_rank = groups.groups(layout)
        hcp_ranks, scp_ranks = groups.group_ranks(layout)
        sums = []
        for group, ranks, rank_in in ((hcp_g, hcp_ranks, hcp_rank), (scp_g, scp_ranks, scp_rank)):
            assert ranks.index(me) == rank_in
            if len(ranks) == 1:
                assert group is None
                sums.append(2 ** me)
                continue
            assert dist.get_process_group_ranks(group) == ranks and dist.get_rank(group) == rank_in
            t = torch.tensor([2 ** me], dtype=torch.int64)
            dist.all_reduce(t, group=group)
            sums.append(int(t.item()))
        out[layout.name] = {"hcp": hcp_ranks, "scp": scp_ranks, "ranks": [hcp_rank, scp_rank], "sums": sums}
    return out


def _expect_error(fn, match):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"no ValueError matching {match!r}")


def _worker(rank, world, out_dir):
    from megatron_dsv.parallel import measure_bandwidth

    result = {}
    # 1. the world is one CP group of 4
    world_group = dist.new_group(list(range(WORLD)))
    result["one"] = _check_groups(DSVCPGroups(world_group, num_heads=8), list(range(WORLD)))
    # 2. two CP groups of 2: CP ranks [0, 2] and [1, 3] (every rank creates both)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    result["two"] = _check_groups(DSVCPGroups(mine, num_heads=2), [rank % 2, rank % 2 + 2])
    # 3. argument errors, raised before any collective
    result["errors"] = [
        _expect_error(lambda: DSVCPGroups(world_group, num_heads=6), "context_parallel_size (4)"),
        _expect_error(lambda: DSVCPGroups(world_group, 8, layouts=[CPLayout(2, 1)]), "hcp*scp == context_parallel_size"),
    ]
    # 4. bandwidth of an all-to-all over the CP group: one positive figure shared by all ranks
    result["bandwidth"] = measure_bandwidth(world_group, nbytes=1 << 16, iters=2)
    # 5. Megatron's CP groups (tp=1, cp=2, dp=2: [0, 1] and [2, 3]) and a foreign group
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    groups = DSVCPGroups.from_megatron(4)
    result["megatron"] = groups.cp_ranks
    result["errors"].append(_expect_error(lambda: DSVCPGroups.from_megatron(4, SimpleNamespace(cp=mine)),
                                          "groups do not match Megatron's"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _expected(cp_ranks, layout, me):
    hcp_groups, scp_groups = layout_groups(cp_ranks, layout)
    h = next(g for g in hcp_groups if me in g)
    s = next(g for g in scp_groups if me in g)
    return {"hcp": h, "scp": s, "ranks": [h.index(me), s.index(me)], "sums": [sum(2 ** r for r in h), sum(2 ** r for r in s)]}


def test_dsv_cp_groups_on_four_gloo_processes(tmp_path):
    run_world(_worker, WORLD, tmp_path, deadline_s=DEADLINE_S, args=(str(tmp_path),))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for me, res in enumerate(results):
        assert list(res["one"]) == [l.name for l in cp_layouts(4)]
        for layout in cp_layouts(4):
            assert res["one"][layout.name] == _expected([0, 1, 2, 3], layout, me)
        mine = [me % 2, me % 2 + 2]
        assert list(res["two"]) == ["hcp1-scp2", "hcp2-scp1"]
        for layout in cp_layouts(2):
            assert res["two"][layout.name] == _expected(mine, layout, me)
        assert res["megatron"] == ([0, 1] if me < 2 else [2, 3])
        assert len(res["errors"]) == 3
        assert "num_attention_heads" in res["errors"][0] and "tensor-parallel size" in res["errors"][0]
        assert res["bandwidth"] > 0 and res["bandwidth"] == results[0]["bandwidth"]
    # spot checks written out by hand: rank 1 in hcp2-scp2-scp_inner of [0..3]; rank 3 with CP ranks [1, 3]
    assert results[1]["one"]["hcp2-scp2-scp_inner"] == {"hcp": [1, 3], "scp": [0, 1], "ranks": [0, 1], "sums": [10, 3]}
    assert results[3]["two"]["hcp1-scp2"] == {"hcp": [3], "scp": [1, 3], "ranks": [0, 1], "sums": [8, 10]}

"""Tests of megatron_dsv.parallel.collectives: sharded gloo runs against single-process references.

The pytest process already holds a 1-process gloo world (conftest), so each multi-rank world runs
in freshly spawned workers with a file:// store in tmp_path. Every worker builds the full tensors
with fixed seeds, so it can compute the single-process reference of all ranks by itself. One spawn
per world size runs every check; a deadline kills the workers if anything hangs.
"""

import pytest
import torch
import torch.distributed as dist

from tests.parallel.spawn import run_world
from megatron_dsv.parallel.collectives import (
    KVGatherPlan,
    _distinct_items,
    gather_seq,
    head_to_seq,
    selective_kv_gather,
    seq_to_head,
)

B, H, D = 2, 4, 2
S_LOC = 3
WORLD_DEADLINE_S = 75

# Uneven placements (one with a rank holding no head) and custom head orders, per world size.
HEAD_PLACEMENTS = {
    1: [([4], None), ([4], [2, 0, 3, 1])],
    2: [([3, 1], [2, 0, 3, 1]), ([4, 0], None)],
    4: [([2, 0, 1, 1], [3, 1, 0, 2]), ([1, 1, 1, 1], None)],
}


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- head-wise CP


def _heads_of(rank, counts, order):
    order = list(range(sum(counts))) if order is None else list(order)
    start = sum(counts[:rank])
    return order[start : start + counts[rank]]


def _check_heads(rank, world, group):
    for case, (counts, order) in enumerate(HEAD_PLACEMENTS[world]):
        shard = slice(rank * S_LOC, (rank + 1) * S_LOC)
        full = _randn(10 + case, B, H, world * S_LOC, D)
        weights = [_randn(100 * q + case, B, counts[q], world * S_LOC, D) for q in range(world)]
        mine = _heads_of(rank, counts, order)

        # seq_to_head: values, round trip, gradient of sum_q (out_q^2 * W_q).
        x = full[:, :, shard].clone().requires_grad_(True)
        out = seq_to_head(x, group, counts, order)
        assert out.shape == (B, counts[rank], world * S_LOC, D)
        assert torch.equal(out, full[:, mine])
        assert torch.equal(head_to_seq(out.detach(), group, counts, order), x.detach())
        (out.square() * weights[rank]).sum().backward()
        ref = full.clone().requires_grad_(True)
        sum((ref[:, _heads_of(q, counts, order)].square() * weights[q]).sum() for q in range(world)).backward()
        torch.testing.assert_close(x.grad, ref.grad[:, :, shard])

        # head_to_seq: values and gradient of sum_q (out_q^2 * W_q) with W_q [B, H, S_loc, D].
        y = full[:, mine].clone().requires_grad_(True)
        back = head_to_seq(y, group, counts, order)
        assert torch.equal(back, full[:, :, shard])
        seq_w = [_randn(200 * q + case, B, H, S_LOC, D) for q in range(world)]
        (back.square() * seq_w[rank]).sum().backward()
        ref = full.clone().requires_grad_(True)
        sum(
            (ref[:, :, q * S_LOC : (q + 1) * S_LOC].square() * seq_w[q]).sum() for q in range(world)
        ).backward()
        torch.testing.assert_close(y.grad, ref.grad[:, mine])


def _check_gather_seq(rank, world, group):
    r = 3
    full = _randn(7, B, H, world * S_LOC, r)
    x = full[:, :, rank * S_LOC : (rank + 1) * S_LOC].clone().requires_grad_(True)
    out = gather_seq(x, group)
    assert torch.equal(out, full)
    weights = [_randn(300 + q, B, H, world * S_LOC, r) for q in range(world)]
    (out.square() * weights[rank]).sum().backward()
    ref = full.clone().requires_grad_(True)
    sum((ref.square() * w).sum() for w in weights).backward()
    torch.testing.assert_close(x.grad, ref.grad[:, :, rank * S_LOC : (rank + 1) * S_LOC])


# ----------------------------------------------------------------------------- selective KV gather

HKV, NG, KMAX = 2, 3, 5


def _make_lists(kind, q, world, n_loc):
    """Rank q's lists: int32 [B, Hkv, NG, Kmax] ascending global item ids (garbage padding), counts [B, Hkv]."""
    g = torch.Generator().manual_seed(1000 + 17 * q + len(kind))
    total = world * n_loc
    pool = {
        "random": range(total),
        "local": range(q * n_loc, (q + 1) * n_loc),  # only items q owns
        "shared": range(0, min(total, n_loc + 2)),  # every rank hits rank 0's (and 1's) items
        "empty": range(total),
    }[kind]
    counts = torch.randint(0, min(KMAX, len(pool)) + 1, (B, HKV), generator=g, dtype=torch.int32)
    if kind == "random":
        counts[0, 1] = 0
    if kind == "empty":
        counts.zero_()
    idx = torch.randint(-5, 10**6, (B, HKV, NG, KMAX), generator=g, dtype=torch.int32)  # garbage padding
    for b in range(B):
        for h in range(HKV):
            for grp in range(NG):
                pick = torch.randperm(len(pool), generator=g)[: counts[b, h]]
                idx[b, h, grp, : counts[b, h]] = torch.tensor(sorted(pool[i] for i in pick.tolist()), dtype=torch.int32)
    return idx, counts


def _distinct(idx, counts, b, h):
    """Sorted distinct valid item ids of (b, h) (python ints), the independent reference."""
    return sorted({int(i) for i in idx[b, h, :, : counts[b, h]].flatten()})


def _ref_buffer(full, idx, counts, rows):
    """Reference buffer [B, Hkv, U * rows, D] built from the full [B, Hkv, P*s_local, D] tensor."""
    per_bh = [[_distinct(idx, counts, b, h) for h in range(HKV)] for b in range(B)]
    u = max(1, max(len(items) for row in per_bh for items in row))
    out = []
    for b in range(B):
        heads = []
        for h in range(HKV):
            tok = [i * rows + t for i in per_bh[b][h] for t in range(rows)]
            got = full[b, h, torch.tensor(tok, dtype=torch.long)]
            heads.append(torch.cat([got, full.new_zeros(u * rows - len(tok), full.shape[-1])]))
        out.append(torch.stack(heads))
    return torch.stack(out)


def _check_selective_case(rank, world, group, kind, block_size, s_local, dv):
    rows = max(block_size, 1)
    n_loc = s_local // rows
    dk = 4
    lists = [_make_lists(kind, q, world, n_loc) for q in range(world)]
    idx, counts = lists[rank]
    kfull = _randn(21, B, HKV, world * s_local, dk)
    vfull = _randn(22, B, HKV, world * s_local, dv)
    shard = slice(rank * s_local, (rank + 1) * s_local)

    plan = KVGatherPlan.build(idx, counts, group, s_local, block_size)
    # Exact bookkeeping, counted independently.
    distinct = [[_distinct(idx, counts, b, h) for h in range(HKV)] for b in range(B)]
    u = max(1, max(len(d) for row in distinct for d in row))
    assert plan.buffer_items == u and plan.buffer_len == u * rows
    owner = lambda i: i // n_loc  # noqa: E731
    assert plan.recv_rows == rows * sum(owner(i) != rank for row in distinct for d in row for i in d)
    sent = 0
    for q in range(world):
        if q != rank:
            qi, qc = lists[q]
            sent += sum(owner(i) == rank for b in range(B) for h in range(HKV) for i in _distinct(qi, qc, b, h))
    assert plan.send_rows == rows * sent
    assert plan.bytes_moved(8) == plan.recv_rows * 8
    if kind in ("local", "empty"):
        assert plan.recv_rows == plan.send_rows == 0
    assert plan.local_indices.dtype == torch.int32 and plan.local_indices.shape == idx.shape
    for b in range(B):
        for h in range(HKV):
            c = int(counts[b, h])
            expect = torch.tensor([[distinct[b][h].index(int(i)) for i in idx[b, h, g, :c]] for g in range(NG)])
            assert torch.equal(plan.local_indices[b, h, :, :c].long(), expect.view(NG, c))
            assert not plan.local_indices[b, h, :, c:].any()

    k = kfull[:, :, shard].clone().requires_grad_(True)
    v = vfull[:, :, shard].clone().requires_grad_(True)
    k_buf, v_buf = selective_kv_gather(k, v, plan, group)
    assert torch.equal(k_buf, _ref_buffer(kfull, idx, counts, rows))
    assert torch.equal(v_buf, _ref_buffer(vfull, idx, counts, rows))
    # The remapped lists address the same rows in the buffer as the global lists in the full K.
    valid = torch.arange(KMAX) < counts.long().unsqueeze(-1)  # [B, Hkv, Kmax]
    for b, h, g, j in valid.unsqueeze(2).expand(B, HKV, NG, KMAX).nonzero().tolist():
        loc, glob = int(plan.local_indices[b, h, g, j]), int(idx[b, h, g, j])
        assert torch.equal(k_buf[b, h, loc * rows : (loc + 1) * rows], kfull[b, h, glob * rows : (glob + 1) * rows])

    # Gradient of sum_q (k_buf_q * Wk_q + v_buf_q^2 * Wv_q) against one process holding K and V.
    def weights(q):
        lq = _ref_buffer(kfull, *lists[q], rows).shape[2]
        return _randn(500 + q, B, HKV, lq, dk), _randn(600 + q, B, HKV, lq, dv)

    wk, wv = weights(rank)
    ((k_buf * wk).sum() + (v_buf.square() * wv).sum()).backward()
    kref, vref = kfull.clone().requires_grad_(True), vfull.clone().requires_grad_(True)
    total = 0
    for q in range(world):
        wkq, wvq = weights(q)
        total = total + (_ref_buffer(kref, *lists[q], rows) * wkq).sum()
        total = total + (_ref_buffer(vref, *lists[q], rows).square() * wvq).sum()
    total.backward()
    torch.testing.assert_close(k.grad, kref.grad[:, :, shard], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.grad, vref.grad[:, :, shard], atol=1e-5, rtol=1e-5)


SELECTIVE_CASES = [
    # (kind, block_size, s_local, Dv)
    ("random", 0, 5, 4),
    ("random", 4, 12, 3),
    ("random", 64, 128, 4),
    ("local", 0, 5, 4),
    ("shared", 4, 8, 4),
    ("empty", 0, 5, 4),
]


def _check_selective(rank, world, group):
    for case in SELECTIVE_CASES:
        try:
            _check_selective_case(rank, world, group, *case)
        except AssertionError as err:
            raise AssertionError(f"selective case {case} on rank {rank}/{world}: {err}") from err


# ----------------------------------------------------------------------------- worlds


def _run_checks(rank, world, group):
    torch.manual_seed(0)
    _check_heads(rank, world, group)
    _check_gather_seq(rank, world, group)
    _check_selective(rank, world, group)


def _world_checks(rank, world):
    _run_checks(rank, world, dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4], ids=["P2", "P4"])
def test_collectives_match_single_process(world, tmp_path):
    run_world(_world_checks, world, tmp_path, deadline_s=WORLD_DEADLINE_S)


def test_one_rank_paths_match_reference():
    """group=None is a one-rank world: the same checks, no communication."""
    _run_checks(0, 1, None)


def test_distinct_items_ignores_padding():
    idx = torch.tensor([[[[3, 1, -9], [1, 2, 99]]]], dtype=torch.int32)  # [1, 1, 2, 3]
    counts = torch.tensor([[2]], dtype=torch.int32)
    present = _distinct_items(idx, counts, num_items=5)
    assert present[0, 0].tolist() == [False, True, True, True, False]


def test_bad_inputs_raise():
    idx = torch.zeros(1, 1, 1, 2, dtype=torch.int32)
    counts = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        KVGatherPlan.build(idx, counts, None, s_local=10, block_size=4)
    with pytest.raises(ValueError, match="kv_indices"):
        KVGatherPlan.build(torch.full((1, 1, 1, 2), 40, dtype=torch.int32), counts, None, 10, 0)
    with pytest.raises(ValueError, match="kv_counts"):
        KVGatherPlan.build(idx, torch.full((1, 1), 3, dtype=torch.int32), None, 10, 0)
    x = torch.zeros(1, 4, 3, 2)
    with pytest.raises(ValueError, match="head_counts"):
        seq_to_head(x, None, [3])
    with pytest.raises(ValueError, match="head_counts"):
        head_to_seq(x, None, [5])
    with pytest.raises(ValueError, match="head_order"):
        seq_to_head(x, None, [4], head_order=[0, 1, 1, 2])
    with pytest.raises(ValueError, match="x must be"):
        gather_seq(torch.zeros(2, 3), None)
    plan = KVGatherPlan.build(idx, counts, None, 10, 0)
    with pytest.raises(ValueError, match="k and v"):
        selective_kv_gather(torch.zeros(1, 1, 9, 2), torch.zeros(1, 1, 9, 2), plan, None)

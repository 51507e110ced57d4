"""Packed token lists (``sparse_attention.packing``): P neighbouring query groups run as one group of P * G
rows over the union of their lists, each entry's bit mask saying which groups list it. The packed lists
against a set union, and the Triton kernels (interpreter) on packed lists against the unpacked kernels and the
PyTorch reference, forward and every backward that packs, over odd shapes: a partial last query group, a
packed group with missing members, groups with empty lists, per-group counts, GQA, padding past the counts."""

import math

import pytest
import torch

from megatron_dsv.ops.sparse_attention import sparse_attention, sparse_attention_naive
from megatron_dsv.ops.sparse_attention.launch import sparse_bwd, sparse_fwd
from megatron_dsv.ops.sparse_attention.packing import (MARK_MODES, pack_token_lists, pack_token_lists_naive,
                                                      token_pack_factor)
from tests.ops.test_sparse_attention import rel_rmse


def _lists(B, H, S, G, density, seed, pad_value=-1):
    """Sorted token lists with one count per group (some groups empty), neighbours sharing keys as a
    video's cubes do: each group draws half of its keys near its own rows and half anywhere."""
    gen = torch.Generator().manual_seed(seed)
    NG = math.ceil(S / G)
    K = max(2, round(density * S))
    idx = torch.full((B, H, NG, K + 2), pad_value, dtype=torch.int32)
    cnt = torch.randint(1, K + 1, (B, H, NG), generator=gen, dtype=torch.int32)
    cnt[:, 0, 1] = 0  # an empty group inside a packed group
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                c = int(cnt[b, h, g])
                near = torch.arange(max(0, g * G - S // 8), min(S, g * G + G + S // 8))
                pool = torch.cat([near[torch.randperm(len(near), generator=gen)[:c // 2]],
                                  torch.randperm(S, generator=gen)[:c]]).unique()
                pick = pool[torch.randperm(len(pool), generator=gen)[:c]]
                cnt[b, h, g] = len(pick)
                idx[b, h, g, :len(pick)] = pick.sort().values.to(torch.int32)
    return idx, cnt


def _check_union(idx, cnt, P, pidx, pbits, pcnt):
    """Each packed group's first count entries: the ascending union of its members' lists, each key with the
    bits of the members listing it."""
    B, H, NG = idx.shape[:3]
    NP = math.ceil(NG / P)
    assert pidx.shape[:3] == (B, H, NP) and pbits.shape == pidx.shape and pcnt.shape == (B, H, NP)
    assert pidx.dtype == torch.int32 and pbits.dtype == torch.int8 and pcnt.dtype == torch.int32
    for b in range(B):
        for h in range(H):
            for i in range(NP):
                want = {}
                for g in range(i * P, min(NG, (i + 1) * P)):
                    for key in idx[b, h, g, :cnt[b, h, g]].tolist():
                        want[key] = want.get(key, 0) | (1 << (g - i * P))
                n = int(pcnt[b, h, i])
                keys = pidx[b, h, i, :n].tolist()
                assert keys == sorted(want), (b, h, i)
                masks = [int(x) & 0xFF for x in pbits[b, h, i, :n].tolist()]  # int8: bit 7 is the sign
                assert masks == [want[key] for key in keys], (b, h, i)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_naive_packed_lists_are_the_union_with_each_groups_bit(P):
    B, H, S, G = 2, 3, 150, 8
    idx, cnt = _lists(B, H, S, G, 0.2, seed=P)
    pidx, pbits, pcnt = pack_token_lists_naive(idx, cnt, G, P, S)
    _check_union(idx, cnt, P, pidx, pbits, pcnt)
    n = pcnt[..., None]
    assert (pbits[torch.arange(pidx.shape[3]) >= n] == 0).all()  # padding: no bits
    assert int(pcnt.max()) == pidx.shape[3]  # the twin's width is the largest union


@pytest.mark.interpreter
@pytest.mark.parametrize("mark", MARK_MODES)
@pytest.mark.parametrize("P,S,G,density", [(2, 150, 8, 0.2), (4, 200, 16, 0.3), (8, 100, 12, 0.25), (4, 70, 8, 0.9),
                                           (2, 1000, 32, 0.05), (2, 1500, 64, 0.6)])
def test_packing_kernels_match_the_twin(P, S, G, density, mark):
    """The two Triton passes (the bitmap by one atomic_or per entry, or one atomic add per run of entries in a
    word; compaction by prefix sums over 2048 keys: S <= 1500 crosses none, S > 2048 below) against the union and
    against the PyTorch twin's counts; width min(TK, P * Kmax), with no host sync. Keys 31 mod 32 set the bitmap
    word's sign bit; lists of up to 900 keys cross the marking's 256-entry blocks inside runs."""
    B, H = 2, 3
    idx, cnt = _lists(B, H, S, G, density, seed=P + S)
    pidx, pbits, pcnt = pack_token_lists(idx, cnt, G, P, S, mark=mark)
    _check_union(idx, cnt, P, pidx, pbits, pcnt)
    assert torch.equal(pcnt, pack_token_lists_naive(idx, cnt, G, P, S)[2])
    assert pidx.shape[3] == min(S, P * idx.shape[3])
    assert any(k % 32 == 31 for k in idx[cnt[..., None] > torch.arange(idx.shape[3])].tolist())


@pytest.mark.interpreter
@pytest.mark.parametrize("mark", MARK_MODES)
def test_packing_kernels_over_several_compaction_steps_and_head_chunks(mark):
    """4100 keys: three 2048-key compaction steps, the last partial; a one-head bitmap budget packs head by
    head with the same result; per-head counts ([B, H]) as the op takes them."""
    idx, cnt = _lists(1, 2, 4100, 128, 0.02, seed=5)
    full = pack_token_lists(idx, cnt, 128, 2, 4100, mark=mark)
    _check_union(idx, cnt, 2, *full)
    chunked = pack_token_lists(idx, cnt, 128, 2, 4100, max_bytes=1, mark=mark)
    for a, b in zip(full, chunked):
        n = full[2][..., None] > torch.arange(full[0].shape[3])
        assert torch.equal(a[n], b[n]) if a.dim() == 4 else torch.equal(a, b)
    per_head = cnt.amin(-1)  # every group's first entries are real keys
    _check_union(idx, per_head[..., None].expand(1, 2, idx.shape[2]).contiguous(), 2,
                 *pack_token_lists(idx, per_head, 128, 2, 4100, mark=mark))


@pytest.mark.interpreter
@pytest.mark.parametrize("mark", MARK_MODES)
def test_packing_kernels_drop_keys_out_of_range(mark):
    """Lists that were never checked (DSV_SKIP_CHECKS, or the estimator's own lists) with a key outside [0, TK):
    the marking pass sets no bit for it (before, it wrote past the bitmap), and the union holds the other keys."""
    idx, cnt = _lists(1, 2, 96, 8, 0.2, seed=5)
    bad = idx.clone()
    bad[0, 0, 0, 0], bad[0, 1, 3, 1], bad[0, 1, 5, 0] = 96, -7, 1 << 20
    kept = cnt.clone()
    ref = idx.clone()  # the same lists with the bad entries left out (moved past the count)
    for h, g, j in ((0, 0, 0), (1, 3, 1), (1, 5, 0)):
        row = [x for i, x in enumerate(idx[0, h, g, :cnt[0, h, g]].tolist()) if i != j]
        ref[0, h, g, :len(row)] = torch.tensor(row, dtype=torch.int32)
        kept[0, h, g] = len(row)
    got = pack_token_lists(bad, cnt, 8, 4, 96, mark=mark)
    _check_union(ref, kept, 4, *got)


def test_pack_factor_and_bad_arguments(monkeypatch):
    monkeypatch.delenv("DSV_TOKEN_PACK", raising=False)
    assert [token_pack_factor(G, 0) for G in (16, 32, 64, 128)] == [8, 4, 2, 1]  # on by default
    monkeypatch.setenv("DSV_TOKEN_PACK", "off")
    assert token_pack_factor(32, 0) == 1
    monkeypatch.setenv("DSV_TOKEN_PACK", "on")
    assert token_pack_factor(32, 64) == 1  # block lists never pack
    monkeypatch.setenv("DSV_TOKEN_PACK", "4")
    with pytest.raises(ValueError, match="DSV_TOKEN_PACK must be one of"):
        token_pack_factor(32, 0)
    idx, cnt = _lists(1, 1, 40, 8, 0.2, seed=0)
    with pytest.raises(ValueError, match="P must be in"):
        pack_token_lists(idx, cnt, 8, 16, 40)
    with pytest.raises(ValueError, match="mark must be one of"):
        pack_token_lists(idx, cnt, 8, 4, 40, mark="scan")


CASES = [  # B, H, Hkv, S, D, G, P, dtype
    (1, 2, 1, 200, 64, 16, 4, torch.float32),  # GQA; 13 groups: the last packed group has one member
    (2, 2, 2, 130, 96, 32, 2, torch.float32),  # padded head dim, partial last group
    (1, 3, 3, 100, 64, 16, 8, torch.float16),  # eight groups a pack: bit 7 is the int8 sign
]


def _case_id(c):
    B, H, Hkv, S, D, G, P, dt = c
    return f"B{B}-H{H}-kv{Hkv}-S{S}-D{D}-G{G}-P{P}-{str(dt).split('.')[-1]}"


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_packed_kernels_match_unpacked_and_reference(case):
    B, H, Hkv, S, D, G, P, dt = case
    tol = 1e-5 if dt == torch.float32 else 5e-3
    torch.manual_seed(7)
    q = torch.randn(B, H, S, D, dtype=dt)
    k, v = (torch.randn(B, Hkv, S, D, dtype=dt) for _ in range(2))
    idx, cnt = _lists(B, H, S, G, 0.25, seed=S)
    scale = 1 / math.sqrt(D)
    o0, lse0 = sparse_fwd(q, k, v, idx, cnt, G, 0, scale, pack=1)
    o1, lse1 = sparse_fwd(q, k, v, idx, cnt, G, 0, scale, pack=P)
    ref = sparse_attention_naive(q.float(), k.float(), v.float(), idx, cnt, G, 0, scale)
    assert not torch.isnan(o1).any() and not torch.isnan(lse1).any()
    assert rel_rmse(o1, o0) < tol and rel_rmse(o1, ref) < max(tol, 2 * rel_rmse(o0, ref))
    rows = torch.arange(S) // G
    empty = (cnt[:, :, rows] == 0)  # [B, H, S]: rows of an empty group
    assert empty.any() and (o1[empty] == 0).all()
    assert torch.allclose(lse1[~empty], lse0[~empty], rtol=1e-5, atol=1e-5)
    do = torch.randn_like(o0)
    for mode in ("atomic", "fixed"):
        kw = dict(atomic_kv=True) if mode == "atomic" else dict(atomic_kv=False, token_kv="fixed")
        g0 = sparse_bwd(do, q, k, v, o0, lse0, idx, cnt, G, 0, scale, pack=1, **kw)
        g1 = sparse_bwd(do, q, k, v, o1, lse1, idx, cnt, G, 0, scale, pack=P, **kw)
        for name, a, b in zip(("dq", "dk", "dv"), g1, g0):
            assert not torch.isnan(a).any(), (mode, name)
            assert rel_rmse(a, b) < tol, (mode, name, rel_rmse(a, b))
    # the inverse walk takes the lists as given: the same gradients with pack asked for
    inv = sparse_bwd(do, q, k, v, o0, lse0, idx, cnt, G, 0, scale, atomic_kv=False, token_kv="inverse", pack=P)
    for a, b in zip(inv, g0):
        assert rel_rmse(a, b) < tol


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,per_head", [(1, False), (3, True)], ids=["1-row-chunks", "3-row-chunks-head-counts"])
def test_packed_backward_in_row_chunks(monkeypatch, rows, per_head):
    """The backward packs a few (batch, head) rows at a time (``PACKED_LISTS_BYTES``): with a budget of one row per
    chunk (per-group counts), or three (chunk edges inside a batch; one count per head), GQA and two batches, dq is
    bit-identical to one chunk (no atomics), and dk / dv (fp32 atomics, other order) and the fixed-point dk / dv
    (order-free integer sums: bit-identical) agree."""
    from megatron_dsv.ops.sparse_attention import packing

    B, H, Hkv, S, D, G, P = 2, 4, 2, 96, 64, 16, 4
    torch.manual_seed(3)
    q = torch.randn(B, H, S, D)
    k, v = (torch.randn(B, Hkv, S, D) for _ in range(2))
    idx, cnt = _lists(B, H, S, G, 0.3, seed=9)
    if per_head:  # [B, H]: every group of a head lists its head's smallest count of keys
        cnt = cnt.amin(-1)
    scale = 1 / math.sqrt(D)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, 0, scale)
    do = torch.randn_like(o)
    NG, KM = idx.shape[2:]
    per_row = math.ceil(NG / P) * (min(S, P * KM) * 5 + 4)  # bytes of one row's packed lists
    assert len(packing.packed_row_chunks(B * H, NG, P, KM, S)) == 1
    assert packing.packed_row_chunks(B * H, NG, P, KM, S, max_bytes=rows * per_row) == \
        [(r, min(B * H, r + rows)) for r in range(0, B * H, rows)]
    out = {}
    for budget in (packing.PACKED_LISTS_BYTES, rows * per_row):
        monkeypatch.setattr(packing, "PACKED_LISTS_BYTES", budget)
        out[budget] = [sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, scale, pack=P, atomic_kv=True),
                       sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, scale, pack=P, atomic_kv=False,
                                  token_kv="fixed")]
    (one_atomic, one_fixed), (rows_atomic, rows_fixed) = out.values()
    assert torch.equal(rows_atomic[0], one_atomic[0]) and torch.equal(rows_fixed[0], one_fixed[0])
    for a, b in zip(rows_atomic[1:], one_atomic[1:]):
        assert rel_rmse(a, b) < 1e-6
    for a, b in zip(rows_fixed[1:], one_fixed[1:]):
        assert torch.equal(a, b)
    ref = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, scale, pack=1, atomic_kv=True)
    for a, b in zip(rows_atomic, ref):
        assert rel_rmse(a, b) < 1e-5


@pytest.mark.interpreter
def test_packing_through_the_public_op(monkeypatch):
    """DSV_TOKEN_PACK=on reaches sparse_attention's backward (autograd): the lists are packed once, there (the
    forward runs them unpacked), with the same values as off."""
    from megatron_dsv.ops.sparse_attention import launch

    B, H, S, D, G = 1, 2, 96, 64, 32
    torch.manual_seed(2)
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    idx, cnt = _lists(B, H, S, G, 0.3, seed=1)
    packs, pack = [], launch.pack_token_lists
    monkeypatch.setattr(launch, "pack_token_lists", lambda *a, **kw: packs.append(a[3]) or pack(*a, **kw))
    out = []
    for flag in ("off", "on"):
        monkeypatch.setenv("DSV_TOKEN_PACK", flag)
        o = sparse_attention(q, k, v, idx, cnt, G, 0, backend="triton")
        assert packs == []  # the forward never packs
        grads = torch.autograd.grad(o.square().sum(), (q, k, v))
        assert packs == ([4] if flag == "on" else [])
        out.append((o.detach(), *grads))
    for a, b in zip(*out):
        assert rel_rmse(a, b) < 1e-5


@pytest.mark.interpreter
def test_packing_edge_cases():
    """No query at all packs to no packed group; every list empty gives zero counts; the twin packs a few heads at
    a time with the same lists; a pack that is not a power of two, or more than 128 rows, is refused by the launcher
    with the rule."""
    from megatron_dsv.ops.sparse_attention.launch import _packed

    for pack in (pack_token_lists, pack_token_lists_naive):
        empty = torch.zeros(1, 2, 0, 3, dtype=torch.int32)
        pidx, pbits, pcnt = pack(empty, torch.zeros(1, 2, dtype=torch.int32), 16, 4, 10)
        assert pidx.shape[:3] == (1, 2, 0) and pcnt.shape == (1, 2, 0)
        idx, _ = _lists(1, 2, 40, 8, 0.2, seed=3)
        pidx, pbits, pcnt = pack(idx, torch.zeros(1, 2, dtype=torch.int32), 8, 2, 40)
        assert pidx.shape[3] >= 1 and (pcnt == 0).all()
    idx, cnt = _lists(2, 3, 90, 8, 0.2, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(pack_token_lists_naive(idx, cnt, 8, 4, 90),
                                                 pack_token_lists_naive(idx, cnt, 8, 4, 90, max_bytes=1)))
    for bad in (3, 16):
        with pytest.raises(ValueError, match="power of two with pack"):
            _packed(idx, cnt, 16, 0, 90, bad)

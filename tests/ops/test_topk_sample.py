"""Triton top-k, method "sample" (sampled threshold window, one pass into a candidate buffer, exact
selection on the buffer, exact "search" fallback per group): the same lists as naive, exactly.

Exactness needs the scores to be bit-identical: fp16 inputs (exact products; on continuous inputs with the
FMA loop, ``dot=False``, since the default tensor-core scoring sums in the MMA's order), or fp32 inputs with
exact proxies (integer keys and queries, "middle" or a mean over a power-of-two count). The Triton
kernels sum with fma, naive with separate multiply and add, so an fp32 "mean" proxy that is not exact
(a partial last group, G not a power of two) can make either Triton method differ from naive in the
last bit of a near-tie, method "search" as much as "sample".

Runs under the Triton interpreter on this CPU machine (fp32 and fp16; bf16 is broken there) and on
CUDA when a GPU is present. ``sample_size`` is made small so that small problems still sample with a
stride F > 1 (the interesting path); the default sample_size covers the exact-sample case F = 1.
The fallback is forced by a too-small candidate buffer and by inputs built against the sample's
positions (``sample_positions``), and the tests check through ``stats`` that it really ran.
"""

import pytest
import torch

from megatron_dsv.ops.topk_estimation import estimate_topk_naive
from megatron_dsv.ops.topk_estimation.triton_impl import (
    estimate_topk_triton,
    kernel_meta,
    resolve_pass_tile,
    resolve_scoring,
    sample_plan,
    sample_positions,
    scan_store_mode,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]


def _ints(shape, dtype, seed, lo=-3, hi=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(DEV)


def _check(q, k, budgets, G, bs=0, proxy="mean", bscore="max", **kw):
    budgets = torch.as_tensor(budgets)
    ref = estimate_topk_naive(q, k, budgets, G, bs, proxy, bscore)
    st = {}
    got = estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method="sample", stats=st, **kw)
    assert torch.equal(ref[1], got[1])
    assert got[0].shape == ref[0].shape and got[0].dtype == torch.int32
    bad = (ref[0] != got[0]).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} entries differ, first at {bad[:3].tolist()}"
    # the search kernel's share: every flagged group lies in a scanned tile of the pass tile's groups, no other tile
    heads, ng, tg = q.shape[0] * q.shape[1], -(-q.shape[2] // G), st["tile_groups"]
    assert st["groups"] == heads * ng and st["tiles"] == heads * -(-ng // tg)
    assert -(-st["fallback_groups"] // tg) <= st["fallback_tiles"] <= min(st["fallback_groups"], st["tiles"])
    return st["fallback_groups"]


CASES = [  # B, H, Sq, Sk, r, G, block_size, proxy, block_score, budgets, sample_size
    pytest.param(1, 2, 96, 700, 16, 32, 0, "mean", "max", [5, 70], 64, id="tok-Sk700-G32-F11"),
    pytest.param(2, 2, 130, 515, 8, 16, 0, "middle", "max", [[1, 515], [600, 3]], 64, id="tok-G16-middle-all-clip"),
    pytest.param(1, 2, 256, 1030, 32, 128, 0, "mean", "max", [0, 333], 128, id="tok-G128-zero-budget"),
    pytest.param(1, 2, 128, 1900, 16, 64, 64, "mean", "max", [2, 9], 8, id="blk64-max-F4"),
    pytest.param(1, 2, 70, 2000, 16, 32, 128, "middle", "lse", [1, 15], 4, id="blk128-lse-F4"),
    pytest.param(1, 2, 128, 600, 16, 64, 0, "mean", "max", [17, 599], 1024, id="tok-exact-sample-F1"),
]


@pytest.mark.parametrize("B,H,Sq,Sk,r,G,bs,proxy,bscore,budgets,ns", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_sample_equals_naive_integer_ties(B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, ns, dtype):
    """Small-integer inputs: every score exact, heavy ties straddle every threshold."""
    q, k = _ints((B, H, Sq, r), dtype, 21), _ints((B, H, Sk, r), dtype, 22)
    _check(q, k, budgets, G, bs, proxy, bscore, sample_size=ns)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_sample_continuous_planted_ties(dtype):
    torch.manual_seed(23)
    q = torch.randn(1, 2, 128, 16).to(dtype).to(DEV)
    k = torch.randn(1, 2, 1200, 16).to(dtype).to(DEV)
    k[:, :, 600:700] = k[:, :, 11:12]  # 101 equal keys
    nfb = _check(q, k, [40, 250], 32, sample_size=128, dot=False)  # the loop's order: naive's sums, bit for bit
    assert nfb == 0  # a well-behaved input: the window holds everywhere


def test_sample_all_items_and_zero():
    q, k = _ints((1, 3, 64, 8), torch.float32, 24), _ints((1, 3, 900, 8), torch.float32, 25)
    _check(q, k, [900, 0, 899], 32, sample_size=64)
    q2, k2 = _ints((1, 1, 40, 8), torch.float32, 26), _ints((1, 1, 300, 8), torch.float32, 27)
    idx, counts = estimate_topk_triton(q2, k2, 0, 16, method="sample")
    assert idx.shape == (1, 1, 3, 0) and int(counts.sum()) == 0


def test_fallback_capacity_overflow():
    """A buffer smaller than the candidates: every group overflows and is redone by "search"."""
    q, k = _ints((1, 2, 64, 16), torch.float32, 28), _ints((1, 2, 400, 16), torch.float32, 29)
    nfb = _check(q, k, [30, 90], 32, sample_size=64, capacity=95)
    assert nfb > 0
    # the same input with the planned capacity: fewer fallbacks, same lists
    assert _check(q, k, [30, 90], 32, sample_size=64) < nfb


@pytest.mark.parametrize("dtype,slice_items", [(torch.float32, 100), (torch.float16, 256)],
                         ids=["fp32-loop-4-slices", "fp16-tc-pack4-2-slices"])
def test_sliced_fallback_equals_naive(dtype, slice_items):
    """The fallback search spread over slices of the items (``slice_items`` below the 400 items: 4 slices of 128 with
    a partial last one, or 2 of 256; atomics add the slices' counts): every group of head 1 overflows its buffer and
    is redone that way, head 0 (budget 0) flags none and its tiles return at once; the lists equal naive's. fp16
    runs the defaults (tensor cores, 4 probes a reduction), fp32 the FMA loop."""
    q, k = _ints((1, 2, 64, 16), dtype, 28), _ints((1, 2, 400, 16), dtype, 29)
    budgets = torch.as_tensor([0, 45])
    ref = estimate_topk_naive(q, k, budgets, 32)
    st = {}
    got = estimate_topk_triton(q, k, budgets, 32, method="sample", sample_size=64, capacity=64, stats=st,
                               slice_items=slice_items)
    assert st["fallback_groups"] == 2 and st["fallback_slices"] == -(-400 // slice_items)  # head 1's two groups
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    with pytest.raises(ValueError, match="slice_items"):
        estimate_topk_triton(q, k, budgets, 32, slice_items=0)


def test_sliced_fallback_shares_many_tiles_among_few_programs(monkeypatch):
    """The fallback's programs take the (pass, flagged tile, slice) work items by ticket: with 3 programs for 3 heads x
    3 flagged 16-group tiles x 3 slices of 128 items (and groups flagged in some heads only), every flagged group's
    threshold, so naive's lists; the unflagged head's lists untouched. The interpreter runs one program after
    another, so its first program takes every ticket in order (the waits for a tile's previous pass then never
    spin); on a GPU the 3 programs share them, and wait."""
    from megatron_dsv.ops.topk_estimation import triton_impl

    monkeypatch.setattr(triton_impl, "_FALLBACK_PROGRAMS", 3)
    q, k = _ints((1, 4, 40 * 32, 8), torch.float32, 31), _ints((1, 4, 300, 8), torch.float32, 32)
    budgets = torch.as_tensor([60, 0, 45, 100])
    ref = estimate_topk_naive(q, k, budgets, 32)
    st = {}
    got = estimate_topk_triton(q, k, budgets, 32, method="sample", sample_size=64, capacity=64, stats=st,
                               slice_items=128, pass_tile=(16, 64))
    assert st["fallback_groups"] == 3 * 40 and st["fallback_tiles"] == 3 * 3 and st["fallback_slices"] == 3
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", ["high", "low"])
def test_fallback_adversarial_sample(dtype, hidden):
    """Scores built against the sample's positions. "high": every unsampled key scores above every
    sampled one, so the sampled threshold admits all items (overflow). "low": the sampled keys score
    highest, so fewer than K items reach the sampled threshold. Both must fall back, exactly."""
    Sk, ns, r = 1024, 64, 8
    pos = sample_positions(Sk, ns)
    assert pos.numel() == ns and len(set(pos.tolist())) == ns
    sampled = torch.zeros(Sk, dtype=torch.bool)
    sampled[pos] = True
    q = torch.ones(1, 1, 64, r)
    k = _ints((1, 1, Sk, r), torch.float32, 30, lo=0, hi=3)  # scores 0..16
    boost = (~sampled) if hidden == "high" else sampled
    k[0, 0, boost] += 4.0  # +32 for the boosted keys
    q, k = q.to(dtype).to(DEV), k.to(dtype).to(DEV)
    K = 200 if hidden == "high" else 400  # "low": K items > the 64 sampled ones at the top
    F, nsv, cap = sample_plan(Sk, K, ns)
    assert F > 1 and (cap < Sk - ns or hidden == "low")
    nfb = _check(q, k, [K], 32, sample_size=ns)
    assert nfb == 2  # both query groups


@pytest.mark.parametrize("case,pass_tile", [(CASES[0], (16, 64)), (CASES[1], (64, 32)), (CASES[4], (64, 16))],
                         ids=["tok-F11-16x64", "tok-G16-clip-64x32", "blk128-lse-64x16"])
def test_sample_pass_tiles_equal_naive(case, pass_tile):
    """``pass_tile``: the window pass and the write pass on other tiles than resolve_pass_tile's (16 x 64: the fused
    kernel's before run 27): naive's lists exactly on integer fp16 inputs (tensor-core scoring)."""
    B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, ns = case.values
    q, k = _ints((B, H, Sq, r), torch.float16, 21), _ints((B, H, Sk, r), torch.float16, 22)
    _check(q, k, budgets, G, bs, proxy, bscore, sample_size=ns, pass_tile=pass_tile)


@pytest.mark.parametrize("case,dtype,method,kw", [
    (CASES[0], torch.float16, "sample", {}), (CASES[1], torch.float32, "sample", {}),
    (CASES[4], torch.float16, "sample", {}), (CASES[1], torch.float16, "search", dict(pass_tile=(64, 32))),
    (pytest.param(1, 2, 96, 413, 16, 32, 0, "mean", "max", [30, 90], 64), torch.float32, "sample",
     dict(capacity=95))],
    ids=["tok-Sk700-tc", "tok-G16-clip", "blk128-lse-tc", "tok-G16-search-64x32", "tok-Sk413-overflow"])
def test_scan_store_gives_the_same_lists(case, dtype, method, kw):
    """The window and write passes with the keys carried through the scan (``scan_store``, the GPU's default, not
    the interpreter's: :func:`scan_store_mode`) and without: the same lists and counts, naive's, on odd shapes (700
    keys, 130 queries in groups of 16 in two batches, 2000 keys in blocks of 128 with a partial last one, budgets of
    every item), a buffer small enough to overflow (its groups redone by the search), another pass tile. Under the
    interpreter the carried keys' code runs with ``tl.store`` (mode 1), not the inline PTX store (mode 2, the GPU's:
    test_scan_store_gives_the_same_lists_on_the_gpu and tests/ops/test_triton_sm90_compile.py)."""
    B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, ns = case.values
    q, k = _ints((B, H, Sq, r), dtype, 51), _ints((B, H, Sk, r), dtype, 52)
    budgets = torch.as_tensor(budgets)
    ref = estimate_topk_naive(q, k, budgets, G, bs, proxy, bscore)
    st = {}
    new = estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method=method, sample_size=ns, stats=st,
                               scan_store=True, **kw)
    old = estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method=method, sample_size=ns,
                               scan_store=False, **kw)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])
    assert st["fallback_groups"] > 0 or not ("capacity" in kw or method == "search")


def test_scan_store_mode(monkeypatch):
    """The passes' ``SCAN_STORE``: 0 without ``scan_store``; else the inline PTX store (2), but ``tl.store`` (1)
    under the interpreter, which runs no PTX; by default (None) on a GPU only (the carried scan is slower to
    interpret)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert (scan_store_mode(False), scan_store_mode(True), scan_store_mode()) == (0, 1, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # Triton's own reading of the variable, not only "1"
    assert scan_store_mode(True) == 1
    monkeypatch.delenv("TRITON_INTERPRET")
    assert (scan_store_mode(False), scan_store_mode(True), scan_store_mode()) == (0, 2, 2)


@pytest.mark.parametrize("small", [1, 16])
@pytest.mark.parametrize("case", [0, 1, 3], ids=["tok-F11", "tok-G16-clip", "blk64-F4"])
def test_sample_searches_finish_on_copied_keys(case, small, monkeypatch):
    """The searches in the buffer (the sample's two ranks, the window's K-th) read it until a row's range holds at most
    ``SMALL_KEYS`` keys (the window's: ``window_slots``), then go on over those keys copied out (``_kth_compacting``);
    a limit of 1 or 16 keys forces several narrowing passes over the buffer before the copy (the defaults hold these
    small windows whole at once): naive's lists exactly, on fp32 and on tensor-core-scored fp16 integer inputs,
    overflowing buffers too."""
    from megatron_dsv.ops.topk_estimation import sample_impl
    monkeypatch.setattr(sample_impl, "SMALL_KEYS", small)
    monkeypatch.setattr(sample_impl, "window_slots", lambda cap: small)
    B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, ns = CASES[case].values
    for dtype, seed in [(torch.float32, 41), (torch.float16, 43)]:
        q, k = _ints((B, H, Sq, r), dtype, seed), _ints((B, H, Sk, r), dtype, seed + 1)
        _check(q, k, budgets, G, bs, proxy, bscore, sample_size=ns)
    q, k = _ints((1, 2, 64, 16), torch.float32, 28), _ints((1, 2, 400, 16), torch.float32, 29)
    assert _check(q, k, [30, 90], 32, sample_size=64, capacity=95) > 0


def test_sample_fallbacks_do_not_depend_on_the_pass_tile():
    """Overflowing buffers (capacity 95) and the adversarial sample (test_fallback_adversarial_sample's "low": the
    sampled keys score highest), K = 0 and K = every item, on a 16 x 128 pass tile: the same groups flagged as on
    the default tile, naive's lists; a bad ``pass_tile`` names the argument."""
    pass_tile = (16, 128)  # 128 items a row: the pass tile's counts unpacked (pack_counts 1)
    q, k = _ints((1, 2, 64, 16), torch.float32, 28), _ints((1, 2, 400, 16), torch.float32, 29)
    nfb = _check(q, k, [30, 90], 32, sample_size=64, capacity=95, pass_tile=pass_tile)
    assert nfb > 0 and nfb == _check(q, k, [30, 90], 32, sample_size=64, capacity=95)
    q, k = _ints((1, 3, 64, 8), torch.float32, 24), _ints((1, 3, 900, 8), torch.float32, 25)
    _check(q, k, [900, 0, 899], 32, sample_size=64, pass_tile=pass_tile)
    Sk, ns = 1024, 64
    sampled = torch.zeros(Sk, dtype=torch.bool)
    sampled[sample_positions(Sk, ns)] = True
    kk = _ints((1, 1, Sk, 8), torch.float32, 30, lo=0, hi=3)
    kk[0, 0, sampled] += 4.0
    assert _check(torch.ones(1, 1, 64, 8, device=DEV), kk, [400], 32, sample_size=ns, pass_tile=pass_tile) == 2
    for bad in [(48, 64), (32,), (0, 64), (True, 64)]:
        with pytest.raises(ValueError, match="pass_tile"):
            estimate_topk_triton(q, k, 20, 32, method="sample", pass_tile=bad)
    q16, k16 = q.half(), k.half()  # r = 8: no tensor cores; r = 16 scores on them, on tiles of >= 16 groups
    estimate_topk_triton(q16, k16, 20, 32, method="sample", pass_tile=(8, 64))
    q16, k16 = _ints((1, 1, 64, 16), torch.float16, 24), _ints((1, 1, 300, 16), torch.float16, 25)
    with pytest.raises(ValueError, match=r"`pass_tile` \(8, 64\).*dot='tc'"):
        estimate_topk_triton(q16, k16, 20, 32, method="sample", pass_tile=(8, 64))
    with pytest.raises(ValueError, match="pass_tile"):
        estimate_topk_triton(q, k, 20, 32, method="keys", pass_tile=(32, 64))


def test_window_slots():
    """The window search's copied slots: SMALL_KEYS up to 32K tokens (G = 32, 90%), then about cap / 8, a power of
    two, at most 4096."""
    from megatron_dsv.ops.topk_estimation.sample_impl import SMALL_KEYS, window_slots
    caps = {n: sample_plan(n, n // 10)[2] for n in (16384, 32768, 65536, 131072, 1 << 20)}
    assert [window_slots(c) for c in caps.values()] == [SMALL_KEYS, SMALL_KEYS, 1024, 2048, 4096]
    assert window_slots(1) == SMALL_KEYS


def test_resolve_pass_tile():
    """Run 28's tile for token lists (32 x 64 at every length), the call's tile for blocks; explicit tiles pass
    through."""
    assert resolve_pass_tile((), 0, 16, 64) == (32, 64) and resolve_pass_tile((), 0, 16, 16) == (32, 64)
    assert resolve_pass_tile((), 128, 16, 4) == (16, 4)
    assert resolve_pass_tile((64, 32), 0, 16, 64) == (64, 32)


def test_methods_agree_and_validate():
    q, k = _ints((1, 1, 64, 16), torch.float32, 31), _ints((1, 1, 300, 16), torch.float32, 32)
    a = estimate_topk_triton(q, k, 20, 32, method="search")
    b = estimate_topk_triton(q, k, 20, 32, method="auto")
    c = estimate_topk_triton(q, k, 20, 32, method="sample", sample_size=32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="method"):
        estimate_topk_triton(q, k, 20, 32, method="radix")


def test_sample_plan():
    F, nsv, cap = sample_plan(65536, 6656)
    assert (F, nsv) == (64, 1024) and 1024 < cap < 1.25 * 6656  # the window around the K-th key
    assert sample_plan(500, 50) == (1, 500, 500)  # exact sample: the buffer holds the sample
    assert sample_plan(100, 100)[2] == 100  # never more than the items
    # one buffer serves every head of a call, whose budgets go up to kmax: the capacity is the widest window of any
    # budget up to kmax, so it never shrinks as kmax grows (m_lo capped at the sample made kmax's narrower)
    caps = [sample_plan(65536, k)[2] for k in range(1024, 65537, 1024)]
    assert caps == sorted(caps) and caps[-1] > sample_plan(65536, 32768)[2]


def test_estimate_topk_logs_its_backend_once(caplog, monkeypatch):
    import logging

    import megatron_dsv.ops.topk_estimation as te

    monkeypatch.setattr(te, "_LOGGED", set())
    monkeypatch.delenv("DSV_TOPK_BACKEND", raising=False)
    q, k = _ints((1, 2, 64, 16), torch.float32, 33), _ints((1, 2, 64, 16), torch.float32, 34)
    with caplog.at_level(logging.INFO, logger=te.__name__):
        for _ in range(3):
            te.estimate_topk(q.cpu(), k.cpu(), 8, 32)
        te.estimate_topk(q.cpu(), k.cpu(), 8, 32, backend="naive")
    lines = [r.getMessage() for r in caplog.records if r.name == te.__name__]
    assert lines == ["estimate_topk uses the naive backend (auto: tensors not on CUDA)",
                     "estimate_topk uses the naive backend (asked for by backend argument)"]


@pytest.mark.parametrize("method,r,capacity,dot,pack,bs", [
    ("sample", 16, 0, True, 1, 0), ("sample", 32, 95, True, 4, 0), ("search", 16, 0, True, 4, 0),
    ("keys", 16, 0, True, 1, 0), ("sample", 16, 95, False, 4, 0), ("search", 8, 0, False, 2, 0),
    ("search", 8, 0, False, 4, 64)])
def test_candidates_equal_naive_on_integer_inputs(method, r, capacity, dot, pack, bs):
    """The top-k's candidates, the tl.dot scoring (``dot``) and the counts of several probes per reduction
    (``pack_counts``), in every kernel they change: the sample pass, the search it falls back to (a small buffer
    forces it), the write pass, "keys", block lists' search. Integer inputs make every sum exact in any order and
    tie heavily, so the lists equal naive's bit for bit (on continuous inputs the dot's order is the compiler's)."""
    q, k = _ints((1, 2, 64, r), torch.float32, 33), _ints((1, 2, 400, r), torch.float32, 34)
    budgets = torch.as_tensor([30, 90] if bs == 0 else [2, 5])
    ref = estimate_topk_naive(q, k, budgets, 32, bs)
    st = {}
    got = estimate_topk_triton(q, k, budgets, 32, bs, method=method, sample_size=64, capacity=capacity, stats=st,
                               dot=dot, pack_counts=pack)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert (st["fallback_groups"] > 0) == (capacity > 0 or method == "search")


@pytest.mark.parametrize("method,capacity,pack", [("sample", 0, 1), ("sample", 95, 4), ("search", 0, 1),
                                                   ("keys", 0, 1)])
def test_tensor_core_scoring_equals_naive_on_integer_fp16_inputs(method, capacity, pack):
    """``dot="tc"`` (the tile product in the inputs' fp16 on tensor cores, fp32 accumulation) in the sample pass,
    its fallback search (a small buffer forces it), the write pass and "keys": integer inputs and their group means
    (multiples of 1/32) make every product and sum exact, so the lists equal naive's bit for bit."""
    q, k = _ints((1, 2, 64, 16), torch.float16, 43), _ints((1, 2, 400, 16), torch.float16, 44)
    budgets = torch.as_tensor([30, 90])
    ref = estimate_topk_naive(q, k, budgets, 32)
    st = {}
    got = estimate_topk_triton(q, k, budgets, 32, method=method, sample_size=64, capacity=capacity, stats=st,
                               dot="tc", pack_counts=pack)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert (st["fallback_groups"] > 0) == (capacity > 0 or method == "search")
    assert kernel_meta(16, 0, dot="tc", pack_counts=pack)["DOT"] == 2  # the tensor-core branch, not the FMA dot's


def test_default_scoring_is_tensor_cores_where_they_apply(monkeypatch):
    """The defaults (``dot="auto"``, ``pack_counts=0``; run 21's timing): tensor cores for fp16/bf16 token lists with
    r a power of two >= 16, the FMA loop elsewhere; 4 probes a reduction below 128 items a tile row. A default call
    on fp16 token lists launches its kernels with ("tc", 4), and its lists equal naive's (integer inputs)."""
    assert resolve_scoring("auto", 0, torch.bfloat16, 16, 0) == ("tc", 4)
    assert resolve_scoring("auto", 0, torch.float16, 32, 0) == ("tc", 4)
    assert resolve_scoring("auto", 0, torch.float32, 16, 0) == (False, 4)  # tensor cores would round to TF32
    assert resolve_scoring("auto", 0, torch.bfloat16, 8, 0) == (False, 4)  # r below one MMA's k
    assert resolve_scoring("auto", 0, torch.bfloat16, 16, 64) == ("tc", 4)  # block items: tensor cores (run 27)
    assert resolve_scoring("auto", 0, torch.bfloat16, 16, 128, BG=64, BN=2) == ("tc", 4)  # "keys"'s default tile
    assert resolve_scoring("auto", 0, torch.float32, 16, 128) == (False, 4)
    assert resolve_scoring("auto", 0, torch.bfloat16, 16, 0, BG=8) == (False, 4)  # below one MMA's 16 rows
    assert resolve_scoring("auto", 0, torch.bfloat16, 16, 0, BN=128) == ("tc", 1)  # 8-bit fields hold < 128
    assert resolve_scoring(True, 2, torch.bfloat16, 16, 0) == (True, 2)  # explicit values pass through
    from megatron_dsv.ops.topk_estimation import triton_impl

    seen = []

    def spy(*args, **kw):
        seen.append(args[5:7])  # (dot, pack_counts) as estimate_topk_triton passes them
        return kernel_meta(*args, **kw)

    monkeypatch.setattr(triton_impl, "kernel_meta", spy)
    q, k = _ints((1, 2, 96, 16), torch.float16, 45), _ints((1, 2, 800, 16), torch.float16, 46)
    budgets = torch.as_tensor([30, 90])
    got = estimate_topk_triton(q, k, budgets, 32, method="sample", sample_size=64)
    ref = estimate_topk_naive(q, k, budgets, 32)
    assert seen == [("tc", 4), ("tc", 4)]  # the call's tile, then the window and write passes' (32 x 64)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_dot_scoring_rejects_what_it_cannot_score():
    q, k = _ints((1, 1, 64, 8), torch.float32, 35), _ints((1, 1, 256, 8), torch.float32, 36)
    with pytest.raises(ValueError, match="dot=True .* r=8"):
        estimate_topk_triton(q, k, 20, 32, method="sample", dot=True)
    q, k = _ints((1, 1, 64, 16), torch.float32, 35), _ints((1, 1, 256, 16), torch.float32, 36)
    with pytest.raises(ValueError, match="BG=8"):
        estimate_topk_triton(q, k, 2, 32, 64, method="search", dot=True, BG=8)
    for budget in (20, 0):  # refused before the early return of empty lists too
        with pytest.raises(ValueError, match="dot='tc' scores fp16/bf16 inputs .* torch.float32"):
            estimate_topk_triton(q, k, budget, 32, method="sample", dot="tc")
    with pytest.raises(ValueError, match="dot must be False, True .* or 'tc'"):
        estimate_topk_triton(q, k, 20, 32, method="sample", dot="mma")
    with pytest.raises(ValueError, match="pack_counts"):
        estimate_topk_triton(q, k, 20, 32, method="search", pack_counts=3)
    with pytest.raises(ValueError, match="BN=128"):
        estimate_topk_triton(q, k, 20, 32, method="search", BN=128, pack_counts=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the waits of concurrent programs: needs a CUDA GPU (the "
                    "interpreter runs one program after another, so its first program takes every ticket)")
def test_sliced_fallback_waits_across_more_work_than_programs_on_the_gpu():
    """The fallback's one launch with more work than programs: 16 heads x 2 flagged 32-group tiles x 64 slices is
    2,048 work items a pass (18,432 in all) for the 1,024 programs, far more than an H100 / H200 holds at once (one
    program an SM), so programs of pass p + 1 wait on tiles that programs not yet started narrow in pass p: naive's
    lists exactly (exact fp16 integer scores)."""
    from megatron_dsv.ops.topk_estimation import triton_impl

    q, k = _ints((1, 16, 2048, 16), torch.float16, 43), _ints((1, 16, 4096, 16), torch.float16, 44)
    budgets = torch.arange(16) * 37 + 200
    ref = estimate_topk_naive(q, k, budgets, 32)
    st = {}
    got = estimate_topk_triton(q, k, budgets, 32, method="sample", sample_size=64, capacity=64, stats=st,
                               slice_items=64)
    assert st["fallback_slices"] == 64 and st["fallback_tiles"] == 32, st  # every group overflows its buffer
    assert st["fallback_tiles"] * st["fallback_slices"] > triton_impl._FALLBACK_PROGRAMS
    assert torch.equal(ref[1], got[1])
    bad = (ref[0] != got[0]).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} entries differ, first at {bad[:3].tolist()}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares compiled kernels: needs a CUDA GPU")
def test_dot_scoring_keeps_the_loops_order_on_the_gpu():
    """On continuous bf16 inputs the tl.dot scoring gives the same lists as the column loop (and so as the CUDA
    kernel) only if the compiler sums the r products in the loop's order: this says whether it does."""
    torch.manual_seed(37)
    q = torch.randn(1, 4, 16384, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 16384, 16, device="cuda", dtype=torch.bfloat16)
    a = estimate_topk_triton(q, k, 1664, 32, method="sample", dot=False)
    b = estimate_topk_triton(q, k, 1664, 32, method="sample", dot=True)
    assert torch.equal(a[1], b[1])
    diff = (a[0] != b[0]).sum().item()
    assert diff == 0, f"{diff} of {a[0].numel()} entries differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares compiled kernels: needs a CUDA GPU")
def test_tensor_core_scoring_gives_naives_lists_up_to_near_ties_on_the_gpu():
    """On continuous bf16 inputs ``dot="tc"`` sums the 16 exact products on tensor cores: its lists must equal
    naive's except items within a few ulps of a group's threshold (the rule the CUDA kernel, which scores the same
    way, is held to), and every list must hold exactly its count of ascending items."""
    from tests.ops.test_topk_estimation import _near_tie_equal

    torch.manual_seed(41)
    q = torch.randn(1, 4, 16384, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 16384, 16, device="cuda", dtype=torch.bfloat16)
    k[:, :, 9000:9300] = k[:, :, 5:6]  # planted ties
    budgets = torch.tensor([1664, 820, 1664, 3000], device="cuda")
    ref = estimate_topk_naive(q, k, budgets, 32)
    for method in ("sample", "search"):
        got = estimate_topk_triton(q, k, budgets, 32, method=method, dot="tc")
        assert torch.equal(ref[1], got[1])
        _near_tie_equal(q, k, ref[0], got[0], ref[1], 32, 0, "mean", "max", who=f"triton {method} tc")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares compiled kernels: needs a CUDA GPU")
def test_scan_store_gives_the_same_lists_on_the_gpu():
    """The inline PTX store of the window and write passes (``scan_store``, the default: :func:`scan_store_mode` 2,
    which the interpreter never runs) against ``scan_store=False``: the same lists bit for bit (both score each tile
    with the same product), continuous bf16 inputs on tensor cores, "sample" and "search", 16K keys and an odd 9999,
    budgets from one item to nearly all."""
    torch.manual_seed(47)
    for S in (16384, 9999):
        q = torch.randn(1, 4, S, 16, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 4, S, 16, device="cuda", dtype=torch.bfloat16)
        k[:, :, 900:1200] = k[:, :, 5:6]  # planted ties
        budgets = torch.tensor([S // 10, 820, 1, S - 3], device="cuda")
        for method in ("sample", "search"):
            new = estimate_topk_triton(q, k, budgets, 32, method=method)  # the default on a GPU: scan_store
            old = estimate_topk_triton(q, k, budgets, 32, method=method, scan_store=False)
            assert torch.equal(new[1], old[1])
            diff = (new[0] != old[0]).sum().item()
            assert diff == 0, f"{method}, S={S}: {diff} of {new[0].numel()} entries differ"

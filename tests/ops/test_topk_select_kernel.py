"""The selection kernel of methods "keys" and "gemm" (``select_kernel._select_rows``): bit for bit the torch
selection it replaced (``_select_from_keys``, the block max of ``_block_scores``, forced items, ``forced_union``),
over odd item counts, zero and full counts, heavy ties (int32 extremes included), negative scores, -0.0, partial
last blocks; and ``estimate_topk_triton`` giving the lists of the torch path (``MAX_ITEMS`` 0 forces it) with
far fewer host ops. Runs under the Triton interpreter on a CPU (``tests/conftest.py`` sets it)."""

import os

import pytest
import torch

from megatron_dsv.ops.topk_estimation import select_kernel
from megatron_dsv.ops.topk_estimation.select_kernel import select_from_keys_triton, select_rows_into
from megatron_dsv.ops.topk_estimation.keys_impl import (_block_scores, _ordered_keys, _select_chunk_torch,
                                                        _select_from_keys)
from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
I32 = torch.iinfo(torch.int32)


def _tied_keys(BH, n, n_items, seed):
    """int32 keys with heavy ties: small integers, a run of INT32_MAX, a row of INT32_MIN, the extremes mixed."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-3, 4, (BH, n, n_items), generator=g, dtype=torch.int32)
    keys[0, 0, : n_items // 2] = I32.max
    if BH > 1:
        keys[1, 0] = I32.min
    if n > 1:
        pick = torch.randint(0, 4, (n_items,), generator=g)
        keys[0, 1] = torch.where(pick == 0, I32.max, torch.where(pick == 1, I32.min, keys[0, 1]))
    return keys.to(DEV)


def _counts(BH, n_items, seed):
    """Per-bh counts: 0, all items, and random ones between."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, n_items + 1, (BH,), generator=g)
    c[0], c[-1] = 0, n_items
    return c.to(torch.int32).to(DEV)


@pytest.mark.parametrize("n_items", [1, 7, 33, 130, 1030], ids=lambda n: f"items{n}")
def test_select_equals_torch_on_tied_keys(n_items):
    BH, n = 4, 3
    keys, counts = _tied_keys(BH, n, n_items, n_items), _counts(BH, n_items, n_items + 1)
    kmax = int(counts.max())
    assert torch.equal(select_from_keys_triton(keys, counts, kmax), _select_from_keys(keys, counts, kmax))


def test_select_pads_a_wide_output_and_writes_only_its_rows():
    """Rows [g0, g0 + n) of a wider output (W > kmax) get the list then -1; other rows are left alone."""
    keys, counts = _tied_keys(2, 3, 33, 5), torch.tensor([4, 9], dtype=torch.int32, device=DEV)
    out = torch.full((2, 7, 12), 77, dtype=torch.int32, device=DEV)
    select_rows_into(out, keys, counts, 2, 33)
    ref = _select_from_keys(keys, counts, 9)
    assert torch.equal(out[:, 2:5, :9], ref) and bool((out[:, 2:5, 9:] == -1).all())
    assert bool((out[:, :2] == 77).all()) and bool((out[:, 5:] == 77).all())


def _tied_scores(BH, n, Sk, dtype, seed):
    """Scores with ties within and across blocks: halves in [-4, 0] (mostly negative), -0.0 and +0.0 maxima."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-8, 1, (BH, n, Sk), generator=g).to(dtype) * 0.5
    s[s == 0] = -0.0  # every zero a negative zero ...
    s[..., ::3] = s[..., ::3].abs()  # ... but some positive: blocks whose max is -0.0 tie those at +0.0
    return s.to(DEV)


@pytest.mark.parametrize("Sk,bs", [(1, 64), (63, 64), (7 * 64 + 5, 64), (128 * 3, 128), (128 * 70 + 3, 128),
                                   (64 * 600 - 1, 64), (130, 1), (1, 1)],
                         ids=["Sk1-bs64", "Sk63-partial", "Sk453-bs64", "Sk384-bs128", "Sk8963-bs128-4-tiles",
                              "Sk38399-bs64-16-tiles", "Sk130-tokens", "Sk1-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_block_max_keys_equal_torch(Sk, bs, dtype):
    """Fused block max + ordered key + selection == torch's reduction, key and selection."""
    BH, n = 3, 2
    n_items = -(-Sk // bs)
    s = _tied_scores(BH, n, Sk, dtype, Sk + bs)
    counts = _counts(BH, n_items, Sk)
    kmax = int(counts.max())
    out = torch.empty(BH, n, kmax, dtype=torch.int32, device=DEV)
    select_rows_into(out, s, counts, 0, n_items, bs)
    keys = _ordered_keys(_block_scores(s.float(), 0 if bs == 1 else bs, False, n_items))
    assert torch.equal(out, _select_from_keys(keys, counts, kmax))


@pytest.mark.parametrize("extra", [False, True], ids=["forced-first", "forced-extra"])
@pytest.mark.parametrize("n_items", [7, 130])
def test_forced_items_equal_torch(extra, n_items):
    """Forced items (-1 padded, a repeated id, rows shared through a stride-0 expand or not) rank first, or last
    then joined to the list with per-group counts; the chunk's rows from g0 on."""
    BH, n, F, NG, g0 = 3, 4, 5, 6, 2
    keys, counts = _tied_keys(BH, n, n_items, 9), _counts(BH, n_items, 10)
    kmax = int(counts.max())
    g = torch.Generator().manual_seed(11)
    forced = torch.randint(-1, n_items, (n, F), generator=g)
    forced[0] = -1
    forced[1, :2] = torch.tensor([n_items - 1, n_items - 1])
    for rows in (forced.to(DEV), forced[2:3].to(DEV).expand(n, F)):
        ref, ref_counts = _select_chunk_torch(keys.clone(), counts, kmax, rows, extra, n_items)
        W = kmax + (F if extra else 0)
        out = torch.full((BH, NG, W), 55, dtype=torch.int32, device=DEV)
        group_counts = torch.full((BH, NG), 55, dtype=torch.int32, device=DEV)
        select_rows_into(out, keys, counts, g0, n_items, 1, rows, extra, group_counts if extra else None)
        assert torch.equal(out[:, g0:g0 + n], ref)
        if extra:
            assert torch.equal(group_counts[:, g0:g0 + n], ref_counts)


def test_bad_arguments_name_the_argument():
    keys, counts = _tied_keys(2, 1, 7, 0), torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    out = torch.empty(2, 1, 2, dtype=torch.int32, device=DEV)
    for kwargs, msg in [(dict(n_items=8), "`src`"), (dict(n_items=0), "`n_items`"),
                        (dict(src=keys.double(), block_size=2), "`src`"), (dict(src=keys.half()), "`src`"),
                        (dict(out=out.long()), "`out`"), (dict(g0=1), "`out`"),
                        (dict(forced=torch.zeros(1, 2, dtype=torch.int32, device=DEV)), "`forced`"),
                        (dict(forced_extra=True), "`forced_extra`")]:
        args = dict(out=out, src=keys, counts=counts, g0=0, n_items=7) | kwargs
        with pytest.raises(ValueError, match=msg):
            select_rows_into(**args)


def _ints(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype).to(DEV)


def _torch_path(monkeypatch, *args, **kwargs):
    """``estimate_topk_triton`` on the torch selection (the path before the kernel; rows past MAX_ITEMS)."""
    with monkeypatch.context() as m:
        m.setattr(select_kernel, "MAX_ITEMS", 0)
        return estimate_topk_triton(*args, **kwargs)


CASES = [  # B, H, Sq, Sk, r, G, block_size, block_score, budgets, forced width (0: none), forced_extra
    pytest.param(1, 2, 130, 453, 16, 32, 64, "max", [0, 8], 0, False, id="blk64-Sk453-zero-all"),
    pytest.param(1, 2, 96, 300, 16, 32, 128, "lse", [1, 3], 0, False, id="blk128-lse-partial"),
    pytest.param(2, 1, 64, 260, 8, 32, 64, "max", [[2], [5]], 3, False, id="blk64-forced"),
    pytest.param(1, 2, 64, 320, 16, 16, 64, "max", [0, 3], 3, True, id="blk64-forced-extra"),
    pytest.param(1, 2, 96, 75, 8, 32, 0, "max", [5, 75], 4, False, id="tok-Sk75-forced"),
]


@pytest.mark.parametrize("B,H,Sq,Sk,r,G,bs,bscore,budgets,width,extra", CASES)
@pytest.mark.parametrize("method,dtype", [("gemm", torch.float32), ("gemm", torch.float16), ("keys", torch.float16)],
                         ids=["gemm-fp32", "gemm-fp16", "keys-fp16"])
def test_estimate_equals_the_torch_path(monkeypatch, B, H, Sq, Sk, r, G, bs, bscore, budgets, width, extra,
                                        dtype, method):
    """Same lists and counts as the torch selection, bit for bit, on continuous inputs (negative scores, no
    help from integer ties) and in chunks of 2 groups."""
    g = torch.Generator().manual_seed(Sq + Sk)
    q = torch.randn(B, H, Sq, r, generator=g).to(dtype).to(DEV)
    k = torch.randn(B, H, Sk, r, generator=g).to(dtype).to(DEV)
    n_items, NG = (Sk if bs == 0 else -(-Sk // bs)), -(-Sq // G)
    kw = dict(method=method, block_score=bscore)
    if width:
        forced = torch.randint(-1, n_items, (NG, width), generator=g)
        kw.update(forced=forced, forced_extra=extra)
    for chunk in (1 << 25, 2 * B * H * max(n_items, Sk // 2) + 1):
        got = estimate_topk_triton(q, k, torch.tensor(budgets), G, bs, chunk_elems=chunk, **kw)
        ref = _torch_path(monkeypatch, q, k, torch.tensor(budgets), G, bs, chunk_elems=chunk, **kw)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_estimate_on_integer_ties_with_forced(monkeypatch):
    """Small-integer inputs (exact scores, ties at every threshold) with forced items ranked first."""
    q, k = _ints((1, 2, 128, 16), torch.float32, 1), _ints((1, 2, 1000, 16), torch.float32, 2)
    forced = torch.tensor([[0, 15, -1], [3, -1, -1], [15, 14, 13], [-1, -1, -1]])
    for extra in (False, True):
        got = estimate_topk_triton(q, k, torch.tensor([2, 6]), 32, 64, method="gemm", forced=forced,
                                   forced_extra=extra)
        ref = _torch_path(monkeypatch, q, k, torch.tensor([2, 6]), 32, 64, method="gemm", forced=forced,
                          forced_extra=extra)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_gemm_host_ops_go_down(monkeypatch):
    """One "gemm" call in 4 chunks with forced_extra items (DSV's 'window' lists) asks the host for far fewer
    torch ops: per chunk one product and one launch instead of the block reduction, keys, forced masking,
    selection and union (~50 ops)."""
    from benchmarks.host_ops import LaunchCounter, OpCounter

    q, k = _ints((1, 2, 128, 16), torch.float16, 3), _ints((1, 2, 512, 16), torch.float16, 4)
    kw = dict(method="gemm", chunk_elems=2 * 128, forced=torch.tensor([[0, 1, -1]]), forced_extra=True)

    def count():  # one group of 32 queries a chunk: 4 chunks
        estimate_topk_triton(q, k, 3, 32, 64, **kw)
        with LaunchCounter() as lc, OpCounter() as oc:
            estimate_topk_triton(q, k, 3, 32, 64, **kw)
        return sum(oc.ops.values()), sum(lc.launches.values())

    ops, launches = count()
    with monkeypatch.context() as m:
        m.setattr(select_kernel, "MAX_ITEMS", 0)
        ops_torch, launches_torch = count()
    assert launches == launches_torch + 4  # one selection launch per chunk
    assert ops_torch - ops >= 4 * 40, (ops, ops_torch)

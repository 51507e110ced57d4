"""CPU tests for megatron_dsv.ops.sparse_attention (Triton under TRITON_INTERPRET=1).

Odd sizes catch masking bugs: S = 63, 200, 1000, groups not dividing S, per-head
budgets, empty and full lists, both granularities, GQA, head dim 96 (padded).
"""

import math
import os

import pytest
import torch

from megatron_dsv.ops.dense import dense_attention
from megatron_dsv.ops.sparse_attention import launch, sparse_attention, sparse_attention_naive
from megatron_dsv.ops.sparse_attention.launch import build_inverse_map, sparse_bwd, sparse_fwd


def make_lists(B, H, S, G, BS, density, seed=0, pad_value=-1, empty_head=None, full_head=None):
    """Random sorted lists, a different budget per head (density + 3% * h)."""
    gen = torch.Generator().manual_seed(seed)
    NG = math.ceil(S / G)
    nk = S if BS == 0 else math.ceil(S / BS)
    counts = torch.zeros(B, H, dtype=torch.int32)
    for h in range(H):
        counts[:, h] = min(nk, max(1, round((density + 0.03 * h) * nk)))
    if empty_head is not None:
        counts[:, empty_head] = 0
    if full_head is not None:
        counts[:, full_head] = nk
    return random_sorted_lists(counts, NG, nk, gen, pad_value, spare=3), counts


def random_sorted_lists(counts, NG, nk, gen, pad_value=-1, spare=2):
    """int32 ``[B, H, NG, max(counts) + spare]``: per (b, h, group), ``counts[b, h]`` distinct items of
    ``nk`` drawn from ``gen``, ascending, then ``pad_value`` (``spare`` columns never to be read)."""
    B, H = counts.shape
    idx = torch.full((B, H, NG, int(counts.max()) + spare), pad_value, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            c = int(counts[b, h])
            for g in range(NG):
                idx[b, h, g, :c] = torch.randperm(nk, generator=gen)[:c].sort().values
    return idx


def rel_rmse(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def run_both(B, H, Hkv, S, D, G, BS, dtype, density=0.3, seed=0, **kw):
    torch.manual_seed(seed)
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, dtype=dtype)
    idx, cnt = make_lists(B, H, S, G, BS, density, seed=seed, **kw)
    do = torch.randn(B, H, S, D, dtype=dtype)
    return fwd_bwd_both(q, k, v, idx, cnt, G, BS, do), cnt


def fwd_bwd_both(q, k, v, idx, cnt, G, BS, do):
    """(o, dq, dk, dv) of the op and of its naive twin on the same inputs."""
    outs = []
    for fn in (sparse_attention, sparse_attention_naive):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        o = fn(qi, ki, vi, idx, cnt, G, BS)
        o.backward(do)
        outs.append((o, qi.grad, ki.grad, vi.grad))
    return outs


CASES = [
    # B, H, Hkv, S, D, G, BS, dtype
    (1, 4, 4, 63, 96, 16, 0, torch.float32),
    (1, 4, 2, 63, 64, 32, 64, torch.float16),
    (2, 2, 1, 200, 128, 64, 0, torch.float16),
    (1, 4, 2, 200, 96, 16, 128, torch.float32),
    (1, 2, 2, 200, 64, 128, 64, torch.float32),
    (1, 2, 2, 200, 128, 32, 128, torch.float16),
    (1, 2, 1, 1000, 64, 128, 128, torch.float16),
    (1, 2, 2, 1000, 128, 64, 0, torch.float32),
    (1, 2, 1, 300, 128, 32, 0, torch.float16),  # G = 32 token forward's 128-key steps (pick_config), last one partial
    (1, 2, 1, 150, 256, 32, 0, torch.float32),  # D=256's half-size tiles: a packed group of 128 rows in two programs
]


def case_id(c):
    B, H, Hkv, S, D, G, BS, dt = c
    gran = "tok" if BS == 0 else f"blk{BS}"
    gqa = f"-Hkv{Hkv}" if Hkv != H else ""
    return f"B{B}-T{S}-H{H}{gqa}-D{D}-G{G}-{gran}-{str(dt)[6:]}"


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in CASES] +
                         [pytest.param(c + ("off",), id=case_id(c) + "-unpacked") for c in CASES if c[6] == 0])
def test_fwd_bwd_matches_naive(case, monkeypatch):
    """Token lists run packed in the backward by default (G < 128, ``DSV_TOKEN_PACK``); the unpacked kernels too."""
    if len(case) == 9:
        monkeypatch.setenv("DSV_TOKEN_PACK", case[8])
        case = case[:8]
    B, H, Hkv, S, D, G, BS, dt = case
    tol = 1e-4 if dt == torch.float32 else 5e-3
    (ours, ref), cnt = run_both(B, H, Hkv, S, D, G, BS, dt, empty_head=0, full_head=H - 1)
    for name, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert not torch.isnan(x).any(), name
        assert x.dtype == r.dtype and x.shape == r.shape, name
        assert rel_rmse(x, r) < tol, (name, rel_rmse(x, r))
    # head 0 has an empty list: zero output, zero dq
    assert ours[0][:, 0].abs().max() == 0 and ours[1][:, 0].abs().max() == 0


@pytest.mark.parametrize("BS", [pytest.param(0, id="tok"), pytest.param(64, id="blk64")])
def test_full_lists_equal_dense(BS):
    B, H, S, D, G = 1, 2, 200, 64, 32
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    nk = S if BS == 0 else math.ceil(S / BS)
    idx = torch.arange(nk, dtype=torch.int32).expand(B, H, math.ceil(S / G), nk).contiguous()
    cnt = torch.full((B, H), nk, dtype=torch.int32)
    assert rel_rmse(sparse_attention(q, k, v, idx, cnt, G, BS), dense_attention(q, k, v)) < 1e-5


def test_padding_never_read():
    """Padding holding garbage (huge, negative) changes nothing."""
    B, H, S, D, G = 1, 2, 130, 64, 64
    torch.manual_seed(2)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    a_idx, cnt = make_lists(B, H, S, G, 64, 0.4, pad_value=-1)
    b_idx, _ = make_lists(B, H, S, G, 64, 0.4, pad_value=2**30)
    assert torch.equal(sparse_attention(q, k, v, a_idx, cnt, G, 64), sparse_attention(q, k, v, b_idx, cnt, G, 64))


@pytest.mark.interpreter
def test_block_atomic_bwd_matches_inverse_map():
    B, H, Hkv, S, D, G, BS = 1, 4, 2, 200, 64, 32, 64
    torch.manual_seed(3)
    q = torch.randn(B, H, S, D)
    k, v = (torch.randn(B, Hkv, S, D) for _ in range(2))
    idx, cnt = make_lists(B, H, S, G, BS, 0.5)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, 0.125)
    do = torch.randn_like(o)
    inv = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, atomic_kv=False)
    atom = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, atomic_kv=True)
    for a, b in zip(inv, atom):
        assert rel_rmse(a, b) < 1e-5


FUSED_CASES = [
    # block lists only: the fused backward walks the inverse map; odd S, GQA, padded D, partial last block
    (1, 4, 2, 200, 96, 32, 64, torch.float32),
    (1, 2, 1, 300, 64, 128, 128, torch.float16),
    (2, 2, 2, 130, 64, 64, 64, torch.float16),
    (1, 2, 2, 200, 128, 64, 128, torch.float16),  # auto picks fused here: its 128-row key tiles
]


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in FUSED_CASES])
def test_fused_bwd_matches_naive(case, monkeypatch):
    """DSV_SPARSE_BWD=fused (dq by fp32 atomics inside the dk/dv kernel) against the reference."""
    monkeypatch.setenv("DSV_SPARSE_BWD", "fused")
    B, H, Hkv, S, D, G, BS, dt = case
    tol = 1e-4 if dt == torch.float32 else 5e-3
    (ours, ref), _ = run_both(B, H, Hkv, S, D, G, BS, dt, empty_head=0, full_head=H - 1)
    for name, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert not torch.isnan(x).any(), name
        assert x.dtype == r.dtype and x.shape == r.shape, name
        assert rel_rmse(x, r) < tol, (name, rel_rmse(x, r))
    assert ours[1][:, 0].abs().max() == 0  # empty list: dq never touched by an atomic


@pytest.mark.interpreter
@pytest.mark.parametrize("dq", [pytest.param(1, id="atomics"), pytest.param(2, id="tma-falls-back-on-cpu")])
def test_fused_equals_split_with_big_key_tiles(dq):
    """Fused with 128-row key tiles (half the atomics per FLOP) == split, GQA, padded D."""
    B, H, Hkv, S, D, G, BS = 1, 4, 2, 250, 96, 64, 128
    torch.manual_seed(4)
    q = torch.randn(B, H, S, D)
    k, v = (torch.randn(B, Hkv, S, D) for _ in range(2))
    idx, cnt = make_lists(B, H, S, G, BS, 0.5)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, 0.1)
    do = torch.randn_like(o)
    split = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.1, mode="split")
    cfg = dict(BM=64, BN=128, num_warps=8, num_stages=2, DQ=dq)
    fused = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.1, mode="fused", cfg_kv=cfg)
    for a, b in zip(split, fused):
        assert rel_rmse(b, a) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("B,H,Hkv,S,D,G,BS,BN,dtype", [
    pytest.param(1, 3, 3, 200, 96, 32, 0, 64, torch.float32, id="T200-D96-G32-tok"),
    pytest.param(2, 4, 2, 163, 64, 32, 0, 128, torch.float16, id="B2-T163-Hkv2-D64-G32-tok-BN128"),
    pytest.param(1, 3, 1, 300, 128, 16, 0, 64, torch.float32, id="T300-D128-G16-tok"),
    pytest.param(1, 3, 3, 300, 64, 32, 128, 64, torch.float32, id="T300-D64-G32-blk128"),
    pytest.param(1, 3, 3, 300, 64, 32, 64, 128, torch.float16, id="T300-D64-G32-blk64-BN128"),
])
@pytest.mark.parametrize("lazy", [0, 1], ids=["sum-each-step", "sum-at-end"])
def test_keys_as_rows_forward_matches_naive(B, H, Hkv, S, D, G, BS, BN, dtype, lazy):
    """The forward with keys as the MMA's rows (cfg KT=1, for query tiles under 64 rows): the naive twin's output
    and the row-major kernel's log-sum-exp, which the backward reads, over odd lengths (partial last group and
    key block), padded D = 96, GQA, an empty and a full list; the softmax's sum reduced each step or once (LAZY_L)."""
    torch.manual_seed(7)
    q = torch.randn(B, H, S, D, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, D, dtype=dtype) for _ in range(2))
    idx, cnt = make_lists(B, H, S, G, BS, 0.3, seed=3, empty_head=0, full_head=H - 1)
    cfg = dict(BM=G, BN=BN, num_warps=4, num_stages=2, KT=1, LAZY_L=lazy)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, D ** -0.5, cfg=cfg)
    o_rm, lse_rm = sparse_fwd(q, k, v, idx, cnt, G, BS, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_rmse(o, sparse_attention_naive(q, k, v, idx, cnt, G, BS)) < tol
    assert o[:, 0].abs().max() == 0  # an empty list: zero output
    assert torch.allclose(lse[:, 1:], lse_rm[:, 1:], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="KT=1"):
        sparse_fwd(q, k, v, idx, cnt, G, 0, D ** -0.5, cfg=dict(cfg, BM=128), pack=4)


@pytest.mark.interpreter
def test_paired_blocks_per_step():
    """BN = 2 x block size: one inner step covers two listed 64-blocks (odd counts, partial last block)."""
    B, H, Hkv, S, D, G, BS = 1, 2, 1, 300, 64, 64, 64
    torch.manual_seed(5)
    q = torch.randn(B, H, S, D)
    k, v = (torch.randn(B, Hkv, S, D) for _ in range(2))
    idx, cnt = make_lists(B, H, S, G, BS, 0.5, empty_head=0)
    cnt[0, 1] = 3  # odd: the last step is half padding
    o_ref = sparse_attention_naive(q, k, v, idx, cnt, G, BS)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, 0.125, cfg=dict(BM=64, BN=128, num_warps=8, num_stages=3))
    assert rel_rmse(o, o_ref) < 1e-5
    do = torch.randn_like(o)
    base = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, mode="split")
    paired = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, mode="split",
                        cfg_q=dict(BM=64, BN=128, num_warps=8, num_stages=2))
    assert rel_rmse(paired[0], base[0]) < 1e-5


def test_forward_configs_follow_the_timed_winners():
    """The forward's defaults are the run-19 winners: keys as the MMA's rows for 32-query groups of block lists at
    D = 128 only (token lists and other head dims stay row-major), and 128-row query tiles at D = 256."""
    for BS in (64, 128):
        kt = launch.pick_config("fwd", 128, 32, BS)
        assert kt["KT"] == 1 and kt["LAZY_L"] == 1 and kt["BM"] == 32
        assert not launch.pick_config("fwd", 128, 32, BS, keys_as_rows=False).get("KT")
    assert not launch.pick_config("fwd", 128, 32, 0).get("KT")  # token lists: slower keys-as-rows
    assert not launch.pick_config("fwd", 64, 32, 64).get("KT")  # not timed at D = 64
    assert not launch.pick_config("fwd", 128, 64, 128).get("KT")  # 64-row tiles already take wgmma
    assert launch.pick_config("fwd", 256, 128, 128)["BM"] == 128 and launch.pick_config("fwd", 256, 128, 0)["BM"] == 128
    assert launch.pick_config("bwd_kv", 256, 128, 128)["BM"] == 64


def test_bwd_mode_env(monkeypatch):
    monkeypatch.delenv("DSV_SPARSE_BWD", raising=False)
    # auto: fused only where it measured faster on the H200 (D=128): small query groups
    assert launch.bwd_mode(64, 128, 128) == "fused" and launch.bwd_mode(32, 64, 128) == "fused"
    assert launch.bwd_mode(128, 128, 128) == "split" and launch.bwd_mode(64, 64, 128) == "split"
    assert launch.bwd_mode(64, 128, 64) == "split"  # not measured at D=64
    assert launch.pick_config("bwd_fused", 128, 64, 128)["BN"] == 128
    monkeypatch.setenv("DSV_SPARSE_BWD", "split")
    assert launch.bwd_mode(64, 128, 128) == "split"
    monkeypatch.setenv("DSV_SPARSE_BWD", "fused")
    assert launch.bwd_mode(128, 128, 128) == "fused"
    assert launch.bwd_mode(128, 0, 128) == "split"  # token lists: no inverse map, always the dq kernel
    monkeypatch.setenv("DSV_SPARSE_BWD", "both")
    with pytest.raises(ValueError, match="DSV_SPARSE_BWD must be one of"):
        launch.bwd_mode(128, 128, 128)


@pytest.fixture
def deterministic():
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn)


@pytest.mark.interpreter
def test_deterministic_mode_takes_the_atomic_free_backward(deterministic, monkeypatch):
    """torch.use_deterministic_algorithms(True) (Megatron's --deterministic-mode): block lists take the split
    backward (no atomics) even where fused is faster, token lists the fixed-point dK/dV; an explicit fused and
    atomic dK/dV, which have no deterministic kernel, raise naming the setting (warn with warn_only); the split
    gradients are bitwise the same on a second run."""
    monkeypatch.delenv("DSV_SPARSE_BWD", raising=False)
    assert launch.bwd_mode(64, 128, 128) == "split" and launch.bwd_mode(32, 64, 128) == "split"
    assert launch.bwd_mode(32, 0, 128) == "split"
    monkeypatch.setenv("DSV_SPARSE_BWD", "fused")
    with pytest.raises(RuntimeError, match="DSV_SPARSE_BWD=fused"):
        launch.bwd_mode(64, 128, 128)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="deterministic"):
        assert launch.bwd_mode(64, 128, 128) == "fused"
    torch.use_deterministic_algorithms(True)
    monkeypatch.delenv("DSV_SPARSE_BWD")
    g = torch.Generator().manual_seed(3)
    B, H, S, D, G, BS = 1, 2, 256, 64, 64, 64
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    idx = torch.tensor([[0, 2], [1, 3], [0, 1], [2, 3]], dtype=torch.int32).expand(B, H, 4, 2).contiguous()
    cnt = torch.full((B, H), 2, dtype=torch.int32)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, 0.125)
    do = torch.randn(B, H, S, D, generator=g)
    first, second = (sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with pytest.raises(RuntimeError, match="atomic_kv=True"):
        sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, atomic_kv=True)
    with pytest.raises(RuntimeError, match="mode='fused'"):
        sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, mode="fused")
    with pytest.raises(RuntimeError, match="atomic_kv=True"):  # token lists asked for the atomics by name
        sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=True)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, 0, 0.125)  # the same lists read as key tokens 0..3
    det = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125)
    fused = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, mode="fused")  # token lists: no fused kernel
    assert all(torch.equal(a, b) for a, b in zip(det, fused))


@pytest.mark.interpreter
@pytest.mark.parametrize("token_kv", ["fixed", "inverse"])
@pytest.mark.parametrize("B,H,Hkv,S,D,G,per_group", [(1, 4, 2, 200, 64, 32, False), (2, 2, 1, 63, 96, 16, True),
                                                     (1, 2, 2, 130, 64, 64, False)])
def test_deterministic_token_backward_matches_naive(deterministic, monkeypatch, B, H, Hkv, S, D, G, per_group,
                                                    token_kv):
    """Token lists under deterministic algorithms: the dq kernel and dk/dv by the token inverse map's kernel
    (inverse, the default) or as int64 fixed-point atomics (fixed, DSV_TOKEN_KV_BWD) give the naive twin's gradients
    (GQA, head dim 96, a partial last key tile and query group, per-group list lengths, an empty head and a full
    one); without deterministic algorithms the fp32 atomic kernels give the same values."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (H, Hkv, Hkv))
    idx, cnt = make_lists(B, H, S, G, 0, 0.3, seed=2, empty_head=0, full_head=1)
    if per_group:  # a prefix of every group's list: 0 to all of its entries
        NG = idx.shape[2]
        cnt = (torch.rand(B, H, NG, generator=gen) * (cnt[..., None] + 1)).long().clamp(max=cnt[..., None])
        cnt = cnt.to(torch.int32)
    do = torch.randn(B, H, S, D, generator=gen)
    if token_kv == "fixed":
        monkeypatch.setenv("DSV_TOKEN_KV_BWD", "fixed")
    else:  # the default
        monkeypatch.delenv("DSV_TOKEN_KV_BWD", raising=False)
    calls, inverse_kv, scales = [], launch._sparse_bwd_token_kv, launch.fixed_point_scales
    monkeypatch.setattr(launch, "_sparse_bwd_token_kv",
                        lambda *a, **kw: calls.append("inverse") or inverse_kv(*a, **kw))
    monkeypatch.setattr(launch, "fixed_point_scales", lambda *a, **kw: calls.append("fixed") or scales(*a, **kw))
    (o, dq, dk, dv), (o_n, dq_n, dk_n, dv_n) = fwd_bwd_both(q, k, v, idx, cnt, G, 0, do)
    assert calls == [token_kv], f"the deterministic token backward must run the {token_kv} dk/dv, ran {calls}"
    for got, want in ((o, o_n), (dq, dq_n), (dk, dk_n), (dv, dv_n)):
        assert rel_rmse(got, want) < 1e-5
    # (the interpreter runs programs one by one, so atomics would repeat too: the GPU test is the determinism check)
    assert all(torch.equal(a, b) for a, b in zip((o, dq, dk, dv), fwd_bwd_both(q, k, v, idx, cnt, G, 0, do)[0]))
    torch.use_deterministic_algorithms(False)  # the atomic kernels: the same values, up to summation order
    atomic = fwd_bwd_both(q, k, v, idx, cnt, G, 0, do)[0]
    assert all(rel_rmse(a, b) < 1e-5 for a, b in zip(atomic, (o, dq, dk, dv)))


@pytest.mark.interpreter
def test_bench_times_the_deterministic_backward(monkeypatch):
    """bench_sparse_attention --deterministic-bwd: our backward runs under deterministic algorithms (token lists:
    the library's default inverse-map dk/dv, and the fixed-point one when asked), and the global setting and
    DSV_TOKEN_KV_BWD are restored after."""
    from benchmarks.bench_sparse_attention import ours_deterministic_bwd_ms, run_once

    monkeypatch.delenv("DSV_TOKEN_KV_BWD", raising=False)
    calls, inverse_kv, scales = [], launch._sparse_bwd_token_kv, launch.fixed_point_scales
    monkeypatch.setattr(launch, "_sparse_bwd_token_kv",
                        lambda *a, **kw: calls.append("inverse") or inverse_kv(*a, **kw))
    monkeypatch.setattr(launch, "fixed_point_scales", lambda *a, **kw: calls.append("fixed") or scales(*a, **kw))
    B, H, S, D, G = 1, 2, 96, 64, 32
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, generator=gen).requires_grad_() for _ in range(3))
    idx, cnt = make_lists(B, H, S, G, 0, 0.3)
    assert not torch.are_deterministic_algorithms_enabled()
    assert ours_deterministic_bwd_ms(q, k, v, idx, cnt, G, 0, timer=run_once) == 0.0
    assert calls == ["inverse"] and not torch.are_deterministic_algorithms_enabled()
    assert ours_deterministic_bwd_ms(q, k, v, idx, cnt, G, 0, timer=run_once, token_kv="fixed") == 0.0
    assert calls == ["inverse", "fixed"] and "DSV_TOKEN_KV_BWD" not in os.environ


@pytest.mark.interpreter
def test_fixed_point_token_backward_at_extreme_scales(monkeypatch):
    """The fixed-point dk/dv keep their precision where the values are far from 1 (q x 300, v x 50, dO x 1e-5:
    against the naive twin, as close as the fp32 atomics), its sums stay below 2^61 in every case (the scales'
    bound), an all-zero dO gives exact zeros, and a non-finite key or value gives NaN dK and dV, not numbers;
    a bad DSV_TOKEN_KV_BWD or token_kv names what is allowed."""
    B, H, Hkv, S, D, G = 1, 2, 1, 96, 64, 32
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(B, h, S, D, generator=gen) for h in (H, Hkv, Hkv, H))
    q, v, do = q * 300, v * 50, do * 1e-5
    idx, cnt = make_lists(B, H, S, G, 0, 0.4, seed=3)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, 0, 0.125)
    fixed = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=False, token_kv="fixed")
    atomic = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=True)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    sparse_attention_naive(*ref, idx, cnt, G, 0, softmax_scale=0.125).backward(do)
    for name, f, a, r in zip("qkv", fixed, atomic, (t.grad for t in ref)):
        assert rel_rmse(f, r) < max(2 * rel_rmse(a, r), 1e-6), (name, rel_rmse(f, r), rel_rmse(a, r))
    scales, _ = launch.fixed_point_scales(q, k, v, do, 0.125)
    for i, g in enumerate((ref[1].grad, ref[2].grad)):  # |sum| * 2^e with room to spare below 2^63
        assert (g.abs().amax((2, 3)) * scales[..., i].double()).max() < 2.0 ** 61
    zero = sparse_bwd(torch.zeros_like(do), q, k, v, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=False)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in zero)
    for i in (1, 2):  # an infinite key or value: NaN, not numbers from an undefined float -> int64 cast
        bad_in = [k.clone(), v.clone()]
        bad_in[i - 1][0, 0, 5, 3] = float("inf")
        bad = sparse_bwd(do, q, *bad_in, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=False, token_kv="fixed")
        assert torch.isnan(bad[1]).all() and torch.isnan(bad[2]).all()
    with pytest.raises(ValueError, match="token_kv must be one of"):
        sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, token_kv="atomic")
    monkeypatch.setenv("DSV_TOKEN_KV_BWD", "sorted")
    with pytest.raises(ValueError, match="DSV_TOKEN_KV_BWD must be one of"):
        sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, 0, 0.125, atomic_kv=False)


def test_token_inverse_map_exact():
    """Key tile -> (group, bit mask of its listed keys in the tile), groups ascending, per (batch, head); padding
    and entries past a group's count are never read."""
    from megatron_dsv.ops.sparse_attention.launch import build_token_inverse_map

    # 1 batch, 2 heads, 2 groups; keys 0..69 in tiles of 32 (the last one partial: 64..69)
    idx = torch.tensor([[[[0, 5, 33, 69], [31, 32, 40, -1]], [[64, -1, -1, -1], [1, 2, 3, 99]]]], dtype=torch.int32)
    cnt = torch.tensor([[[4, 3], [1, 3]]], dtype=torch.int32)
    ptr, grp, bits = build_token_inverse_map(idx, cnt, TK=70, BN=32)
    got = [[(int(grp[e]), int(bits[e])) for e in range(int(ptr[i]), int(ptr[i + 1]))] for i in range(6)]
    assert got == [[(0, 1 | 1 << 5), (1, 1 << 31)], [(0, 1 << 1), (1, 1 | 1 << 8)], [(0, 1 << 5)],
                   [(1, 1 << 1 | 1 << 2 | 1 << 3)], [], [(0, 1)]]
    with pytest.raises(ValueError, match="BN must be in"):
        build_token_inverse_map(idx, cnt, TK=70, BN=64)


def test_inverse_map_exact():
    idx = torch.tensor([[[[0, 2, -1], [1, 2, 5]], [[2, -1, -1], [0, -1, -1]]]], dtype=torch.int32)
    cnt = torch.tensor([[2, 1]], dtype=torch.int32)  # head 0 reads 2 entries, head 1 reads 1
    ptr, grp = build_inverse_map(idx, cnt, nkb=3)
    lists = [grp[ptr[i]:ptr[i + 1]].tolist() for i in range(6)]
    assert lists == [[0], [1], [0, 1], [1], [], [0]]


def test_torch_compile_traces_op():
    B, H, S, D, G = 1, 2, 64, 64, 32
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    idx, cnt = make_lists(B, H, S, G, 64, 1.0)
    eager = sparse_attention(q, k, v, idx, cnt, G, 64)
    compiled = torch.compile(sparse_attention)(q, k, v, idx, cnt, G, 64)
    assert rel_rmse(compiled, eager) < 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("BS", [0, 64])
def test_eager_entry_matches_the_library_op_bitwise(BS):
    """Eager calls take _SparseAttention (no torch.library dispatch on the host); its output and gradients are
    the op's, bit for bit (the same kernels), with o in q's layout and the op left for torch.compile."""
    from megatron_dsv.ops.sparse_attention import op

    B, H, S, D, G = 1, 2, 200, 64, 32
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(S, B, H, D, generator=gen) for _ in range(3)]
    idx, cnt = make_lists(B, H, S, G, BS, 0.4)
    do = torch.randn(B, H, S, D, generator=gen)

    def run(entry):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # Megatron's [S, B, H, D] seen as [B, H, S, D]
        o = entry(qq, kk, vv)
        o.backward(do)
        return o, q.grad, k.grad, v.grad

    eager = run(lambda q, k, v: sparse_attention(q, k, v, idx, cnt, G, BS, check_values=False, backend="triton"))
    strides = op._dense_strides_like(base[0].permute(1, 2, 0, 3))
    lib = run(lambda q, k, v: op.sparse_attn_fwd(q.contiguous(), k.contiguous(), v, idx, cnt, G, BS, 1 / 8.0,
                                                 strides, False)[0])
    for a, b in zip(eager, lib):
        assert torch.equal(a, b)
    assert eager[0].stride() == lib[0].stride() == base[0].permute(1, 2, 0, 3).stride()


@pytest.mark.interpreter
def test_backend_env(monkeypatch):
    B, H, S, D, G = 1, 2, 64, 64, 16
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    idx, cnt = make_lists(B, H, S, G, 0, 0.3)
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "naive")
    naive = sparse_attention(q, k, v, idx, cnt, G)
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "triton")
    assert rel_rmse(sparse_attention(q, k, v, idx, cnt, G), naive) < 1e-5
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DSV_SPARSE_ATTN_BACKEND must be one of"):
        sparse_attention(q, k, v, idx, cnt, G)
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "flex")
    with pytest.raises(ValueError, match="needs block-level lists"):
        sparse_attention(q, k, v, idx, cnt, G)
    bidx, bcnt = make_lists(B, H, S, 64, 64, 0.5)
    with pytest.raises(ValueError, match="group_size 128 and block_size 128"):  # flex can't lower 64-blocks
        sparse_attention(q, k, v, bidx, bcnt, 64, 64)


# ---- bad input: every case raises ValueError naming the argument ----

def _good(S=64, D=64, G=16, BS=0, H=2, Hkv=2, dtype=torch.float16):
    q = torch.randn(1, H, S, D, dtype=dtype)
    k = torch.randn(1, Hkv, S, D, dtype=dtype)
    v = torch.randn(1, Hkv, S, D, dtype=dtype)
    idx, cnt = make_lists(1, H, S, G, BS, 0.25)
    return dict(q=q, k=k, v=v, kv_indices=idx, kv_counts=cnt, group_size=G, block_size=BS)


def _swap01(idx):
    idx = idx.clone()
    idx[..., [0, 1]] = idx[..., [1, 0]]
    return idx


def _dup01(idx):
    idx = idx.clone()
    idx[..., 1] = idx[..., 0]
    return idx


def _bad(**changes):
    a = _good()
    for key, fn in changes.items():
        a[key] = fn(a)
    return a


BAD = [
    ("q-3d", dict(q=lambda a: a["q"][0]), "q must be a 4-D tensor"),
    ("q-int", dict(q=lambda a: a["q"].int()), r"q.dtype must be one of"),
    ("kv-dtype", dict(k=lambda a: a["k"].float(), v=lambda a: a["v"].float()), "share one dtype"),
    ("v-shape", dict(v=lambda a: a["v"][:, :, :32]), "k and v must have the same shape"),
    ("k-empty", dict(k=lambda a: a["k"][:, :, :0], v=lambda a: a["v"][:, :, :0]), r"k/v must be \[B=1"),
    ("gqa", dict(q=lambda a: torch.randn(1, 3, 64, 64, dtype=torch.float16)), "multiple of k/v heads"),
    ("head-dim", dict(q=lambda a: a["q"][..., :48], k=lambda a: a["k"][..., :48], v=lambda a: a["v"][..., :48]),
     "head dim D=48 is not supported"),
    ("group", dict(group_size=lambda a: 8), "group_size must be one of"),
    ("block", dict(block_size=lambda a: 32), "block_size must be one of"),
    ("idx-dtype", dict(kv_indices=lambda a: a["kv_indices"].long()), "kv_indices must be an int32"),
    ("idx-groups", dict(kv_indices=lambda a: a["kv_indices"][:, :, :2]), r"NG=ceil\(S/group_size\)=4"),
    ("cnt-shape", dict(kv_counts=lambda a: a["kv_counts"][:, :1]), "kv_counts must be an int32"),
    ("cnt-over-kmax", dict(kv_counts=lambda a: a["kv_counts"] + a["kv_indices"].shape[-1]), "kv_counts must lie in"),
    ("cnt-negative", dict(kv_counts=lambda a: a["kv_counts"] - 100), "kv_counts must lie in"),
    ("idx-high", dict(kv_indices=lambda a: a["kv_indices"] + 64), r"must lie in \[0, 64\)"),
    ("idx-negative", dict(kv_indices=lambda a: a["kv_indices"] - 1), r"must lie in \[0, 64\)"),
    ("idx-unsorted", dict(kv_indices=lambda a: _swap01(a["kv_indices"])), "sorted ascending"),
    ("idx-duplicate", dict(kv_indices=lambda a: _dup01(a["kv_indices"])), "sorted ascending and unique"),
    ("idx-device", dict(kv_indices=lambda a: a["kv_indices"].to("meta")), "kv_indices is on meta"),
]


@pytest.mark.parametrize("fn", [pytest.param(sparse_attention, id="fast"),
                                pytest.param(sparse_attention_naive, id="naive")])
@pytest.mark.parametrize("changes,msg", [pytest.param(c, m, id=i) for i, c, m in BAD])
def test_bad_input(fn, changes, msg):
    with pytest.raises(ValueError, match=msg):
        fn(**_bad(**changes))


def test_block_index_range_and_count_bound():
    a = _good(S=200, G=32, BS=64)  # 4 key blocks
    a["kv_indices"][0, 0, 0, 0] = 4
    a["kv_indices"][0, 0, 0, 1:] = 5  # keep it sorted so the range check is what fires
    a["kv_counts"][:] = 2
    with pytest.raises(ValueError, match=r"key-block ids\) must lie in \[0, 4\)"):
        sparse_attention(**a)
    b = _good(S=200, G=32, BS=64)
    b["kv_indices"] = torch.zeros(1, 2, 7, 6, dtype=torch.int32)
    b["kv_counts"][:] = 5  # Kmax is 6 but only 4 blocks exist
    with pytest.raises(ValueError, match="number of key-block ids=4"):
        sparse_attention(**b)


def test_skip_checks_env(monkeypatch):
    a = _bad(kv_indices=lambda a: _swap01(a["kv_indices"]))
    monkeypatch.setenv("DSV_SKIP_CHECKS", "1")
    sparse_attention(**a)  # unsorted lists are not detected, by request


def test_auto_never_picks_flex(monkeypatch):
    """auto runs ours on CUDA also where flex's kernels alone were faster (small, very sparse, training):
    a training step through flex was slower end to end (op.py's note); flex only on request."""
    from types import SimpleNamespace

    from megatron_dsv.ops.sparse_attention.op import auto_backend, choose_backend

    monkeypatch.delenv("DSV_SPARSE_ATTN_BACKEND", raising=False)
    for S, kmax in ((16384, 26), (65536, 10), (8192, 7)):  # the cells where flex's kernels won
        q = SimpleNamespace(is_cuda=True, shape=(1, 8, S, 64), requires_grad=True)
        idx = torch.empty(1, 8, math.ceil(S / 128), kmax, dtype=torch.int32)
        assert auto_backend(q) == "triton"
        assert choose_backend(q, idx, 128, 128) == "triton"
        assert choose_backend(q, idx, 128, 128, requested="flex") == "flex"
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "flex")
    assert choose_backend(q, idx, 128, 128) == "flex"


def test_backend_choice_logged_once(monkeypatch, caplog):
    """The backend that runs, and why, is logged once per process and reason, not per call."""
    import logging
    from types import SimpleNamespace

    from megatron_dsv.ops.sparse_attention import op as op_mod

    monkeypatch.setattr(op_mod, "_LOGGED", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu_q = torch.empty(1, 1, 64, 64)
    cuda_q = SimpleNamespace(is_cuda=True, shape=(1, 1, 64, 64))
    with caplog.at_level(logging.INFO, logger=op_mod.__name__):
        for _ in range(3):
            assert op_mod.auto_backend(cpu_q) == "naive"
            assert op_mod.auto_backend(cuda_q) == "triton"
        monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "naive")
        op_mod.requested_backend()
        op_mod.requested_backend()
    lines = [r.getMessage() for r in caplog.records if r.name == op_mod.__name__]
    assert len(lines) == 3, lines
    assert "naive backend (auto: tensors not on CUDA" in lines[0]
    assert "triton backend (auto: tensors on CUDA; FlexAttention only on request" in lines[1]
    assert "naive backend (asked for by DSV_SPARSE_ATTN_BACKEND)" in lines[2]


@pytest.mark.interpreter
def test_check_values_false_skips_the_host_sync(monkeypatch):
    """Callers with lists from our own estimator skip the value check (it syncs the host)."""
    from megatron_dsv.ops.sparse_attention import op as op_mod

    def boom(*args, **kwargs):
        raise AssertionError("value check ran")

    monkeypatch.setattr(op_mod, "check_values", boom)
    monkeypatch.setattr(op_mod, "_check_values", boom)
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "triton")
    torch.manual_seed(0)
    B, H, S, D, G = 1, 2, 40, 64, 16
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    idx = torch.arange(S, dtype=torch.int32).expand(B, H, -(-S // G), S).contiguous()
    counts = torch.full((B, H), S, dtype=torch.int32)
    out = sparse_attention(q, k, v, idx, counts, G, 0, check_values=False)
    torch.testing.assert_close(out, sparse_attention_naive(q, k, v, idx, counts, G, 0), rtol=2e-3, atol=2e-3)
    with pytest.raises(AssertionError, match="value check ran"):
        sparse_attention(q, k, v, idx, counts, G, 0)


@pytest.mark.parametrize("keys", ["int32", "int64"])
@pytest.mark.parametrize("lists", [torch.int32, torch.int64])
def test_inverse_map_matches_a_direct_scan(keys, lists, monkeypatch):
    """Random lists over two batches and three heads (the (batch, head) offsets, padding past each
    head's count, garbage in the padding): each key block's groups, ascending, as a plain scan finds them;
    with int32 and int64 sort keys (the latter past 2^31 keys, forced here) and lists; inputs untouched."""
    from megatron_dsv.ops.sparse_attention import launch

    if keys == "int64":
        monkeypatch.setattr(launch, "INT32_KEYS_BELOW", 1)
    g = torch.Generator().manual_seed(0)
    B, H, NG, KM, nkb = 2, 3, 5, 4, 7
    idx = torch.stack([torch.randperm(nkb, generator=g)[:KM] for _ in range(B * H * NG)]).view(B, H, NG, KM)
    idx = idx.to(torch.int32)
    cnt = torch.randint(0, KM + 1, (B, H), generator=g, dtype=torch.int32)
    idx[(torch.arange(KM) >= cnt[:, :, None, None]).expand(B, H, NG, KM)] = -7  # padding holds anything
    idx = idx.to(lists)
    idx_before, cnt_before = idx.clone(), cnt.clone()
    ptr, grp = build_inverse_map(idx, cnt, nkb)
    assert torch.equal(idx, idx_before) and torch.equal(cnt, cnt_before)
    assert ptr.dtype == grp.dtype == torch.int32 and ptr.shape == (B * H * nkb + 1,)
    for b in range(B):
        for h in range(H):
            for blk in range(nkb):
                want = [gr for gr in range(NG) if blk in idx[b, h, gr, :cnt[b, h]].tolist()]
                i = (b * H + h) * nkb + blk
                assert grp[ptr[i]:ptr[i + 1]].tolist() == want
    assert ptr[-1] == int(cnt.sum()) * NG


@pytest.mark.parametrize("BS,G,D,dtype", [pytest.param(0, 32, 64, torch.float32, id="tok"),
                                          pytest.param(64, 64, 96, torch.float16, id="blk64"),
                                          pytest.param(128, 128, 64, torch.float32, id="blk128-fused")])
def test_per_group_counts_match_naive_and_a_dense_reference(BS, G, D, dtype, monkeypatch):
    """kv_counts [B, H, NG]: each query group reads its own number of entries (a window's edge cubes); the
    Triton kernels (fwd, both backwards) equal the naive twin, which equals dense attention under the mask
    those counts define; empty groups give zeros."""
    if BS == 128:
        monkeypatch.setenv("DSV_SPARSE_BWD", "fused")
    B, H, S = 1, 2, 300  # partial last group and block
    NG, nk = math.ceil(S / G), (S if BS == 0 else math.ceil(S / BS))
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(1, nk + 1, (B, H, NG), generator=gen, dtype=torch.int32)
    counts[0, 1, 0] = 0  # an empty group
    idx = torch.full((B, H, NG, nk + 1), -1, dtype=torch.int32)
    for h in range(H):
        for g in range(NG):
            c = int(counts[0, h, g])
            idx[0, h, g, :c] = torch.randperm(nk, generator=gen)[:c].sort().values
    torch.manual_seed(5)
    q, k, v, do = (torch.randn(B, H, S, D, dtype=dtype) for _ in range(4))
    outs = fwd_bwd_both(q, k, v, idx, counts, G, BS, do)
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), *outs):
        assert rel_rmse(a, b) < tol, (name, rel_rmse(a, b))
    # the naive twin against dense attention masked by hand from the per-group counts
    allowed = torch.zeros(B, H, S, S, dtype=torch.bool)
    for h in range(H):
        for g in range(NG):
            rows = slice(g * G, min((g + 1) * G, S))
            for item in idx[0, h, g, :int(counts[0, h, g])].tolist():
                cols = slice(item, item + 1) if BS == 0 else slice(item * BS, min((item + 1) * BS, S))
                allowed[0, h, rows, cols] = True
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ v.float()
    assert rel_rmse(outs[1][0], ref) < tol
    assert outs[0][0][0, 1, :G].abs().max() == 0  # the empty group
    # per-head counts given as [B, H] or broadcast to [B, H, NG] are the same call
    idx2, cnt2 = make_lists(B, H, S, G, BS, 0.3, seed=6)
    cnt3 = cnt2[:, :, None].expand(B, H, NG).contiguous()
    torch.testing.assert_close(sparse_attention(q, k, v, idx2, cnt3, G, BS),
                               sparse_attention(q, k, v, idx2, cnt2, G, BS), rtol=0, atol=0)

"""Query length != key length (sequence-wise context parallelism): q [B, H, Sq, D] against
k, v [B, Hkv, Sk, D], lists over Sk's tokens or key blocks, query groups over Sq.

- Triton (interpreter, fp32/fp16) vs the naive twin, forward and backward with a random do,
  token lists and 64/128 block lists, G in {16, 64, 128}, odd lengths both ways (Sk > Sq,
  Sk < Sq, Sk below one block), partial last key block, GQA, empty and full lists, split /
  fused / atomic backward; exact zeros where nothing is listed.
- naive vs a dense float64 reference whose mask is built here, entry by entry.
- value checks use the key length; flex refuses Sk != Sq and "auto" never picks it.
- estimate_topk (naive, triton) vs a brute-force selection in exact integer arithmetic.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_dsv.ops.sparse_attention import sparse_attention, sparse_attention_naive
from megatron_dsv.ops.sparse_attention import op as op_mod
from megatron_dsv.ops.sparse_attention.launch import build_inverse_map, sparse_bwd, sparse_fwd
from megatron_dsv.ops.topk_estimation import estimate_topk, estimate_topk_naive
from megatron_dsv.ops.topk_estimation.cuda_impl import estimate_topk_cuda
from tests.ops.test_sparse_attention import random_sorted_lists

D = 64


def n_items(Sk, BS):
    return Sk if BS == 0 else math.ceil(Sk / BS)


def make_lists(B, H, Sq, Sk, G, BS, fracs, seed=0, pad_value=-1):
    """Random sorted lists; head h keeps round(fracs[h] * #items of Sk) entries (1.0 = all)."""
    gen = torch.Generator().manual_seed(seed)
    NG, nk = math.ceil(Sq / G), n_items(Sk, BS)
    counts = torch.tensor([[min(nk, round(f * nk)) for f in fracs]] * B, dtype=torch.int32)
    return random_sorted_lists(counts, NG, nk, gen, pad_value, spare=2), counts


def listed_mask(idx, counts, Sq, Sk, G, BS):
    """Bool [B, H, Sq, Sk] built entry by entry: query row i sees key column j."""
    B, H, NG, _ = idx.shape
    mask = torch.zeros(B, H, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                rows = slice(g * G, min((g + 1) * G, Sq))
                for e in idx[b, h, g, :int(counts[b, h])].tolist():
                    cols = slice(e, e + 1) if BS == 0 else slice(e * BS, min((e + 1) * BS, Sk))
                    mask[b, h, rows, cols] = True
    return mask


def dense_reference(q, k, v, mask, scale):
    """float64 softmax over the listed keys only; rows with no key give zeros."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    s = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)) * mask
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    return p @ vv


def rel_rmse(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def inputs(B, H, Hkv, Sq, Sk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    do = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    return q, k, v, do


def fwd_bwd(fn, q, k, v, do, idx, cnt, G, BS, **kw):
    qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn(qi, ki, vi, idx, cnt, G, BS, **kw)
    o.backward(do)
    return o.detach(), qi.grad, ki.grad, vi.grad


# ---------------------------------------------------------------- Triton vs naive

CASES = [  # Hkv, Sq, Sk, G, BS, dtype, per-head list fractions (H = 2)
    (1, 200, 333, 16, 0, torch.float32, (0.0, 1.0)),
    (2, 256, 100, 64, 0, torch.float16, (0.3, 1.0)),
    (1, 130, 50, 128, 0, torch.float32, (0.5, 0.0)),
    (1, 200, 333, 16, 64, torch.float16, (0.5, 1.0)),
    (1, 200, 333, 32, 64, torch.float32, (0.5, 1.0)),  # forward steps over two 64-blocks (BN=128)
    (2, 256, 100, 64, 64, torch.float32, (0.0, 1.0)),
    (1, 100, 40, 128, 64, torch.float32, (1.0, 0.0)),  # Sk below one block
    (2, 200, 333, 128, 128, torch.float32, (0.4, 1.0)),
    (1, 256, 100, 64, 128, torch.float16, (1.0, 0.0)),  # Sk below one block, GQA
    (2, 64, 300, 16, 128, torch.float16, (0.5, 1.0)),
]


def case_id(c):
    hkv, sq, sk, g, bs, dt, fr = c
    gran = "tok" if bs == 0 else f"blk{bs}"
    return f"Sq{sq}-Sk{sk}-Hkv{hkv}-G{g}-{gran}-{str(dt)[6:]}-c{fr[0]}-{fr[1]}"


PARAMS = [pytest.param(c, mode, id=f"{case_id(c)}-{mode}")
          for c in CASES for mode in (("split",) if c[4] == 0 else ("split", "fused"))]


@pytest.mark.interpreter
@pytest.mark.parametrize("case,mode", PARAMS)
def test_triton_matches_naive(case, mode, monkeypatch):
    Hkv, Sq, Sk, G, BS, dt, fracs = case
    monkeypatch.setenv("DSV_SPARSE_BWD", mode)
    q, k, v, do = inputs(1, 2, Hkv, Sq, Sk, dt, seed=Sq + Sk)
    idx, cnt = make_lists(1, 2, Sq, Sk, G, BS, fracs, seed=G + BS, pad_value=-1 if mode == "split" else 2**30)
    ours = fwd_bwd(sparse_attention, q, k, v, do, idx, cnt, G, BS, backend="triton")
    ref = fwd_bwd(sparse_attention_naive, q, k, v, do, idx, cnt, G, BS)
    tol = 1e-4 if dt == torch.float32 else 5e-3
    for name, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, name
        assert not torch.isnan(x).any(), name
        assert rel_rmse(x, r) < tol, (name, rel_rmse(x, r))
    # exact zeros: o and dq of an empty head, dk/dv of keys no sharing query head lists
    for h in range(2):
        if int(cnt[0, h]) == 0:
            assert ours[0][:, h].abs().max() == 0 and ours[1][:, h].abs().max() == 0
    seen = listed_mask(idx, cnt, Sq, Sk, G, BS).any(2)  # [B, H, Sk]
    seen_kv = seen.view(1, Hkv, 2 // Hkv, Sk).any(2)
    assert bool((ours[2][~seen_kv] == 0).all()) and bool((ours[3][~seen_kv] == 0).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("BS", [64, 128])
def test_block_atomic_backward_matches_split(BS):
    """Block lists through the dq kernel's dk/dv atomics (atomic_kv=True) equal the inverse map."""
    Sq, Sk, G = 130, 333, 64
    q, k, v, do = inputs(1, 2, 1, Sq, Sk, torch.float32, seed=5)
    idx, cnt = make_lists(1, 2, Sq, Sk, G, BS, (0.5, 1.0), seed=6)
    o, lse = sparse_fwd(q, k, v, idx, cnt, G, BS, 0.125)
    split = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, atomic_kv=False, mode="split")
    atom = sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, 0.125, atomic_kv=True)
    for name, x, r in zip(("dq", "dk", "dv"), atom, split):
        assert x.shape == r.shape, name
        assert rel_rmse(x, r) < 1e-5, (name, rel_rmse(x, r))


@pytest.mark.interpreter
@pytest.mark.parametrize("Sq,Sk", [(70, 100), (130, 45)])
def test_token_inverse_map_backward_matches_atomics(Sq, Sk):
    """Token lists through the token inverse map (the deterministic dk/dv kernel with token_kv="inverse", its key
    tiles over Sk) and through the fixed-point atomics equal the dq kernel's dk/dv atomics, GQA, with 2**30 in
    the padding (never read)."""
    q, k, v, do = inputs(1, 2, 1, Sq, Sk, torch.float32, seed=Sq)
    idx, cnt = make_lists(1, 2, Sq, Sk, 16, 0, (0.3, 1.0), seed=Sk, pad_value=2**30)
    o, lse = sparse_fwd(q, k, v, idx, cnt, 16, 0, 0.125)
    atom = sparse_bwd(do, q, k, v, o, lse, idx, cnt, 16, 0, 0.125, atomic_kv=True)
    for token_kv in ("inverse", "fixed"):  # the fixed-point atomics too
        mapped = sparse_bwd(do, q, k, v, o, lse, idx, cnt, 16, 0, 0.125, atomic_kv=False, token_kv=token_kv)
        for name, a, b in zip(("dq", "dk", "dv"), mapped, atom):
            assert rel_rmse(a, b) < 1e-5, (token_kv, name, rel_rmse(a, b))


def test_inverse_map_counts_key_blocks_of_sk():
    """Two query groups over Sq, five key blocks of Sk: the CSR map exactly."""
    idx = torch.tensor([[[[0, 4, -1], [1, 4, 3]]]], dtype=torch.int32)  # [1, 1, NG=2, 3]
    cnt = torch.tensor([[2]], dtype=torch.int32)
    ptr, grp = build_inverse_map(idx, cnt, nkb=5)
    assert ptr.tolist() == [0, 1, 2, 2, 2, 4]
    assert grp[:4].tolist() == [0, 1, 0, 1]


# ---------------------------------------------------------------- naive vs dense reference

REF_CASES = [  # Hkv, Sq, Sk, G, BS, fracs
    pytest.param(1, 200, 333, 32, 0, (0.2, 1.0), id="tok-Sq200-Sk333-gqa"),
    pytest.param(2, 256, 100, 64, 64, (0.0, 0.5), id="blk64-Sq256-Sk100-empty"),
    pytest.param(2, 70, 300, 16, 128, (1.0, 0.4), id="blk128-Sq70-Sk300-full"),
    pytest.param(1, 90, 30, 16, 64, (1.0, 1.0), id="blk64-Sk-below-block"),
]


@pytest.mark.parametrize("Hkv,Sq,Sk,G,BS,fracs", REF_CASES)
def test_naive_matches_dense_reference(Hkv, Sq, Sk, G, BS, fracs):
    q, k, v, do = inputs(1, 2, Hkv, Sq, Sk, torch.float32, seed=11)
    idx, cnt = make_lists(1, 2, Sq, Sk, G, BS, fracs, seed=12)
    ours = fwd_bwd(sparse_attention_naive, q, k, v, do, idx, cnt, G, BS, softmax_scale=0.1)
    ref = fwd_bwd(lambda a, b, c, *_: dense_reference(a, b, c, listed_mask(idx, cnt, Sq, Sk, G, BS), 0.1),
                  q.double(), k.double(), v.double(), do.double(), idx, cnt, G, BS)
    for name, x, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert x.shape == r.shape, name
        assert rel_rmse(x, r) < 1e-5, (name, rel_rmse(x, r))


# ---------------------------------------------------------------- checks and backend choice

@pytest.mark.parametrize("fn", [sparse_attention, sparse_attention_naive], ids=["fast", "naive"])
def test_value_checks_use_key_length(fn):
    q, k, v, _ = inputs(1, 2, 2, 256, 100, torch.float32, seed=0)
    idx, cnt = make_lists(1, 2, 256, 100, 64, 64, (1.0, 1.0))  # 2 key blocks of Sk=100
    assert fn(q, k, v, idx, cnt, 64, 64).shape == q.shape
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        fn(q, k, v, idx + 1, cnt, 64, 64)
    wide = torch.cat([idx, idx[..., :1]], dim=-1)
    with pytest.raises(ValueError, match="number of key-block ids=2"):
        fn(q, k, v, wide, cnt + 1, 64, 64)
    tok, tcnt = make_lists(1, 2, 256, 100, 64, 0, (0.3, 0.3))
    with pytest.raises(ValueError, match=r"key positions\) must lie in \[0, 100\)"):
        fn(q, k, v, tok + 100, tcnt, 64, 0)
    with pytest.raises(ValueError, match=r"k/v must be \[B=1"):
        fn(q, k[..., :0, :], v[..., :0, :], idx, cnt, 64, 64)


def test_flex_refuses_other_key_length(monkeypatch):
    q, k, v, _ = inputs(1, 2, 2, 256, 384, torch.float32, seed=0)
    idx, cnt = make_lists(1, 2, 256, 384, 128, 128, (0.5, 0.5))
    with pytest.raises(ValueError, match="k length Sk=384"):
        sparse_attention(q, k, v, idx, cnt, 128, 128, backend="flex")
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "flex")
    with pytest.raises(ValueError, match="DSV_SPARSE_ATTN_BACKEND=flex needs k's length"):
        sparse_attention(q, k, v, idx, cnt, 128, 128)
    # "auto" on CUDA never sends a call to flex, of either key length
    monkeypatch.delenv("DSV_SPARSE_ATTN_BACKEND")
    fake_q = SimpleNamespace(is_cuda=True, shape=(1, 2, 256, 64))
    assert op_mod.choose_backend(fake_q, idx, 128, 128, k_len=256) == "triton"
    assert op_mod.choose_backend(fake_q, idx, 128, 128, k_len=384) == "triton"


# ---------------------------------------------------------------- top-k estimation

def _ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def brute_topk(q, k, budgets, G, BS, proxy, exact):
    """Lists by (score desc, index asc). exact: integer scores (group sums; dividing by the
    group's size keeps the order); else float64 scores, block 'lse'."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    nk = n_items(Sk, BS)
    lists, counts = [], []
    for b in range(B):
        for h in range(H):
            K = min(int(budgets[h]), nk)
            counts.append(K)
            for g in range(math.ceil(Sq / G)):
                rows = q[b, h, g * G:min((g + 1) * G, Sq)]
                p = rows[len(rows) // 2] if proxy == "middle" else rows.sum(0) if exact else rows.double().mean(0)
                tok = (k[b, h].long() @ p.long()) if exact else (k[b, h].double() @ p.double())
                if BS == 0:
                    score = tok.tolist()
                else:
                    blocks = [tok[j * BS:(j + 1) * BS] for j in range(nk)]
                    score = [(x.max() if exact else torch.logsumexp(x, 0)).item() for x in blocks]
                lists.append(sorted(sorted(range(nk), key=lambda j: (-score[j], j))[:K]))
    return lists, counts


TOPK_CASES = [  # Sq, Sk, G, BS, proxy, exact (max scores on integers) / lse on normals, budgets per head
    pytest.param(200, 333, 16, 0, "mean", True, (5, 1000), id="tok-Sq200-Sk333-clip"),
    pytest.param(72, 40, 64, 0, "middle", True, (40, 7), id="tok-Sq72-Sk40-middle"),
    pytest.param(200, 333, 16, 64, "mean", True, (2, 100), id="blk64-Sk333-partial-clip"),
    pytest.param(96, 100, 32, 128, "mean", True, (0, 5), id="blk128-Sk-below-block"),
    pytest.param(72, 300, 64, 64, "mean", False, (1, 3), id="blk64-lse"),
]


@pytest.mark.parametrize("Sq,Sk,G,BS,proxy,exact,budgets", TOPK_CASES)
def test_estimate_topk_naive_matches_brute_force(Sq, Sk, G, BS, proxy, exact, budgets):
    gen = torch.Generator().manual_seed(Sq + Sk)
    q = _ints((1, 2, Sq, 16), 1) if exact else torch.randn(1, 2, Sq, 16, generator=gen)
    k = _ints((1, 2, Sk, 16), 2) if exact else torch.randn(1, 2, Sk, 16, generator=gen)
    idx, counts = estimate_topk_naive(q, k, torch.tensor(budgets), G, BS, proxy, "max" if exact else "lse")
    want, want_counts = brute_topk(q, k, budgets, G, BS, proxy, exact)
    assert counts.tolist() == [want_counts]
    assert idx.shape == (1, 2, math.ceil(Sq / G), max(want_counts))
    got = [row[:c] for h, c in enumerate(want_counts) for row in idx[0, h].tolist()]
    assert got == want
    for h, c in enumerate(want_counts):
        assert bool((idx[0, h, :, c:] == -1).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("Sq,Sk,BS", [pytest.param(72, 150, 0, id="tok"), pytest.param(100, 200, 64, id="blk64")])
def test_estimate_topk_triton_matches_naive(Sq, Sk, BS):
    q, k = _ints((1, 2, Sq, 16), 3), _ints((1, 2, Sk, 16), 4)
    ref = estimate_topk(q, k, torch.tensor([4, 500]), 32, BS, backend="naive")
    got = estimate_topk(q, k, torch.tensor([4, 500]), 32, BS, backend="triton")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_estimate_topk_cuda_refuses_other_key_length():
    q, k = _ints((1, 2, 64, 16), 0), _ints((1, 2, 65, 16), 1)
    with pytest.raises(ValueError, match="cuda backend needs Sq == Sk"):
        estimate_topk_cuda(q, k, 4, 16)
    with pytest.raises(ValueError, match="k_lr"):
        estimate_topk_naive(q, _ints((1, 3, 65, 16), 1), 4, 16)

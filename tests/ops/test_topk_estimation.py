"""topk_estimation: every backend selects exactly the naive lists; the oracle matches brute force.

Exact-equality cases use small-integer inputs: every product and sum is exact in
float32 whatever the summation order, and the many equal scores exercise the
tie rule (lower index first). Continuous inputs are compared with a tolerance
only for items whose score is within a few ulps of the group's threshold.
"""

import math
import os

import pytest
import torch

from megatron_dsv.ops.topk_estimation import (critical_counts, critical_mass_recall, estimate_topk,
                                              estimate_topk_naive, head_sparsity, topk_backend)
from megatron_dsv.ops.topk_estimation.naive import group_proxies, item_scores

HAS_CUDA = torch.cuda.is_available()


def _ints(shape, dtype, device="cpu", lo=-3, hi=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(device)


def _brute(q, k, counts, G, block_size, proxy, block_score):
    """Dense scores, Python sort by (-score, index): the definition, no tricks."""
    B, H, S, _ = q.shape
    p = group_proxies(q, G, proxy)
    out = []
    for b in range(B):
        for h in range(H):
            s = item_scores(p[b, h], k[b, h], block_size, block_score).tolist()
            K = int(counts[b, h])
            out.append([sorted(sorted(range(len(row)), key=lambda j: (-row[j], j))[:K]) for row in s])
    return out


def _as_lists(idx, counts):
    B, H, NG, _ = idx.shape
    res = []
    for b in range(B):
        for h in range(H):
            K = int(counts[b, h])
            assert bool((idx[b, h, :, K:] == -1).all()), "padding must be -1"
            res.append(idx[b, h, :, :K].tolist())
    return res


CASES = [  # B, H, S, r, G, block_size, proxy, block_score, budgets
    pytest.param(1, 2, 203, 16, 32, 0, "mean", "max", [5, 40], id="tok-S203-G32-mean"),
    pytest.param(2, 2, 130, 8, 7, 0, "middle", "max", [[1, 130], [200, 3]], id="tok-S130-G7-middle-clip"),
    pytest.param(1, 3, 300, 32, 16, 64, "mean", "max", [1, 2, 5], id="blk64-S300-max"),
    pytest.param(1, 2, 301, 16, 32, 128, "middle", "lse", [1, 3], id="blk128-S301-lse"),
    pytest.param(1, 2, 97, 16, 32, 0, "mean", "max", [0, 9], id="tok-zero-budget"),
]


@pytest.mark.parametrize("B,H,S,r,G,bs,proxy,bscore,budgets", CASES)
def test_naive_matches_bruteforce(B, H, S, r, G, bs, proxy, bscore, budgets):
    q, k = _ints((B, H, S, r), torch.float32, seed=1), _ints((B, H, S, r), torch.float32, seed=2)
    idx, counts = estimate_topk_naive(q, k, torch.tensor(budgets), G, bs, proxy, bscore, chunk_elems=512)
    assert idx.dtype == torch.int32 and counts.dtype == torch.int32
    assert idx.shape[:3] == (B, H, math.ceil(S / G))
    assert _as_lists(idx, counts) == _brute(q, k, counts, G, bs, proxy, bscore)


def test_naive_continuous_and_planted_ties():
    torch.manual_seed(3)
    B, H, S, r, G = 1, 2, 150, 16, 10
    q, k = torch.randn(B, H, S, r), torch.randn(B, H, S, r)
    k[:, :, 100:140] = k[:, :, 7:8]  # 41 identical keys: exact ties straddle the threshold
    idx, counts = estimate_topk_naive(q, k, torch.tensor([20, 60]), G)
    assert _as_lists(idx, counts) == _brute(q, k, counts, G, 0, "mean", "max")


@pytest.mark.parametrize("B,H,S,r,G,bs,proxy,bscore,budgets", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_interpreter_equals_naive(B, H, S, r, G, bs, proxy, bscore, budgets, dtype):
    if HAS_CUDA:
        pytest.skip("interpreter case; the GPU tests cover Triton on CUDA")
    from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton

    q, k = _ints((B, H, S, r), dtype, seed=4), _ints((B, H, S, r), dtype, seed=5)
    ref = estimate_topk_naive(q, k, torch.tensor(budgets), G, bs, proxy, bscore)
    got = estimate_topk_triton(q, k, torch.tensor(budgets), G, bs, proxy, bscore)
    assert torch.equal(ref[1], got[1])
    assert torch.equal(ref[0], got[0])


def test_triton_interpreter_continuous():
    if HAS_CUDA:
        pytest.skip("interpreter case")
    from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton

    torch.manual_seed(6)
    q, k = torch.randn(1, 2, 160, 16), torch.randn(1, 2, 160, 16)
    k[:, :, 120:150] = k[:, :, 3:4]
    for budgets in ([17, 90], [160, 1]):
        ref = estimate_topk_naive(q, k, torch.tensor(budgets), 32)
        got = estimate_topk_triton(q, k, torch.tensor(budgets), 32)
        assert torch.equal(ref[0], got[0])


def test_budget_forms_and_clipping():
    q, k = _ints((2, 3, 70, 8), torch.float32), _ints((2, 3, 70, 8), torch.float32, seed=9)
    i1, c1 = estimate_topk(q, k, 5, 16)
    i2, c2 = estimate_topk(q, k, torch.tensor([5, 5, 5]), 16)
    assert torch.equal(i1, i2) and torch.equal(c1, c2) and c1.shape == (2, 3)
    _, c3 = estimate_topk(q, k, torch.tensor([1000, 0, 3]), 16, block_size=64)
    assert c3.tolist() == [[2, 0, 2]] * 2  # 70 tokens = 2 blocks of 64


# ---------------------------------------------------------------- oracle

def _brute_critical(q, k, theta, scale):
    B, H, S, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(B, H, S, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            logits = (q[b, h].double() @ k[b, h // rep].double().T) * scale
            p = torch.softmax(logits, -1)
            for i in range(S):
                acc, n = 0.0, 0
                for v in sorted(p[i].tolist(), reverse=True):
                    if acc >= theta:
                        break
                    acc += v
                    n += 1
                out[b, h, i] = n
    return out


def test_critical_counts_bruteforce_gqa():
    torch.manual_seed(7)
    q, k = torch.randn(1, 4, 37, 16) * 2, torch.randn(1, 2, 37, 16)
    ref = _brute_critical(q, k, 0.9, 0.25)
    got = critical_counts(q, k, 0.9, chunk_elems=300)
    assert (got - ref).abs().max() <= 1  # float32 vs float64 only at the theta boundary
    assert (got == ref).float().mean() > 0.95
    qi = torch.tensor([0, 5, 36])
    assert torch.equal(critical_counts(q, k, 0.9, query_index=qi), got[..., qi])
    sp = head_sparsity(q, k, 0.9)
    assert torch.allclose(sp, 1 - got.float().mean(-1) / 37)


def test_recall_one_for_exact_lists():
    torch.manual_seed(8)
    S, D = 96, 16
    q, k = torch.randn(1, 2, S, D) * 3, torch.randn(1, 2, S, D)
    c = critical_counts(q, k, 0.9, softmax_scale=1.0)
    budgets = c.amax(-1)
    idx, counts = estimate_topk_naive(q, k, budgets, 1)  # full-rank q.k, group of one query
    rec = critical_mass_recall(q, k, idx, counts, 1, theta=0.9, softmax_scale=1.0)
    assert torch.allclose(rec, torch.ones_like(rec), atol=1e-5)
    # blocks: all blocks -> 1; no blocks -> 0
    all_blocks = torch.arange(2).int().expand(1, 2, S // 8, 2).contiguous()
    rec = critical_mass_recall(q, k, all_blocks, torch.tensor([2, 2]), 8, block_size=64)
    assert torch.allclose(rec, torch.ones_like(rec))
    rec = critical_mass_recall(q, k, all_blocks, torch.tensor([0, 0]), 8, block_size=64)
    assert torch.allclose(rec, torch.zeros_like(rec))


# ---------------------------------------------------------------- errors

def _qk(shape=(1, 2, 64, 16), dtype=torch.float32):
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(q_lr=torch.randn(2, 64, 16)), "q_lr"),
    (dict(q_lr=torch.randn(1, 2, 64, 12), k_lr=torch.randn(1, 2, 64, 12)), "q_lr"),
    (dict(k_lr=torch.randn(1, 3, 64, 16)), "k_lr"),
    (dict(k_lr=torch.randn(1, 2, 64, 16, dtype=torch.float64)), "k_lr"),
    (dict(q_lr=torch.randint(0, 3, (1, 2, 64, 16)), k_lr=torch.randint(0, 3, (1, 2, 64, 16))), "q_lr"),
    (dict(k_lr=torch.randn(1, 2, 64, 16).half()), "k_lr"),
    (dict(budgets=-1), "budgets"),
    (dict(budgets=torch.tensor([3, -2])), "budgets"),
    (dict(budgets=torch.tensor([3, 2, 1])), "budgets"),
    (dict(budgets=torch.tensor([3.0, 2.0])), "budgets"),
    (dict(budgets="4"), "budgets"),
    (dict(group_size=0), "group_size"),
    (dict(group_size=2.0), "group_size"),
    (dict(block_size=32), "block_size"),
    (dict(proxy="first"), "proxy"),
    (dict(block_score="mean"), "block_score"),
])
@pytest.mark.parametrize("fn", [estimate_topk, estimate_topk_naive], ids=["dispatch", "naive"])
def test_bad_input(fn, kwargs, arg):
    q, k = _qk()
    args = dict(q_lr=q, k_lr=k, budgets=4, group_size=16, block_size=0, proxy="mean", block_score="max")
    args.update(kwargs)
    with pytest.raises(ValueError, match=arg):
        fn(**args)


def test_backend_env(monkeypatch):
    q, k = _qk()
    monkeypatch.setenv("DSV_TOPK_BACKEND", "fastest")
    with pytest.raises(ValueError, match="DSV_TOPK_BACKEND"):
        estimate_topk(q, k, 4, 16)
    monkeypatch.setenv("DSV_TOPK_BACKEND", "auto")
    assert topk_backend(q.device) == "naive"
    monkeypatch.setenv("DSV_TOPK_BACKEND", "cuda")
    with pytest.raises(ValueError, match="CUDA tensors"):
        estimate_topk(q, k, 4, 16)


def test_auto_takes_triton_where_it_measured_faster(monkeypatch, caplog):
    """With the CUDA extension built, "auto" keeps the CUDA kernel except in TRITON_FASTER_UP_TO's cells (block
    lists of G = 128 over 128-key blocks: at any length where the inputs score on tensor cores, run 27; up to 32K
    keys in "gemm", run 19), and says why once, as information, not a warning."""
    import megatron_dsv.ops.topk_estimation as te
    from megatron_dsv.ops.topk_estimation import cuda_impl

    cuda = torch.device("cuda")
    monkeypatch.delenv("DSV_TOPK_BACKEND", raising=False)
    monkeypatch.setattr(cuda_impl, "cuda_extension", lambda: object())
    assert te.auto_topk_backend(cuda, 128, 128, 16384) == "triton"
    assert te.auto_topk_backend(cuda, 128, 128, 32768) == "triton"
    assert te.auto_topk_backend(cuda, 128, 128, 32769) == "cuda"  # "gemm" at 64K: 3.53 ms against CUDA's 1.98
    for S in (16384, 131072, 1 << 20):  # "keys" on tensor cores: 1.48 against 6.67 ms at 128K
        assert te.auto_topk_backend(cuda, 128, 128, S, tensor_cores=True) == "triton"
    assert te.auto_topk_backend(cuda, 32, 0, 16384) == "cuda"  # token lists: Triton 8x slower
    assert te.auto_topk_backend(cuda, 32, 0, 16384, tensor_cores=True) == "cuda"
    assert te.auto_topk_backend(cuda, 64, 128, 16384, tensor_cores=True) == "cuda"  # not measured: the CUDA kernel
    assert te.topk_backend(cuda, "cuda", 128, 128, 16384) == "cuda"  # asked for by name
    backend, reason = te._backend_and_reason(cuda, None, 128, 128, 16384)
    assert backend == "triton" and "'gemm' method measured faster" in reason
    backend, reason = te._backend_and_reason(cuda, None, 128, 128, 65536, tensor_cores=True)
    assert backend == "triton" and "'keys' method measured faster" in reason and "any number of" in reason
    # estimate_topk's inputs decide ``tensor_cores``: bf16 / fp16 with r a power of two >= 16
    assert te._tensor_cores(torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16))
    assert not te._tensor_cores(torch.zeros(1, 1, 4, 16)) and not te._tensor_cores(torch.zeros(1, 1, 4, 8).half())
    monkeypatch.setattr(cuda_impl, "cuda_extension", lambda: None)
    backend, reason = te._backend_and_reason(cuda, None, 128, 128, 16384)
    assert backend == "triton" and "not built" in reason
    assert te.auto_topk_backend(torch.device("cpu"), 128, 128, 16384) == "naive"


def test_oracle_bad_input():
    q, k = _qk()
    with pytest.raises(ValueError, match="theta"):
        critical_counts(q, k, theta=1.5)
    with pytest.raises(ValueError, match="k"):
        critical_counts(q, torch.randn(1, 3, 64, 16))
    with pytest.raises(ValueError, match="query_index"):
        critical_counts(q, k, query_index=torch.tensor([64]))
    with pytest.raises(ValueError, match="kv_indices"):
        critical_mass_recall(q, k, torch.zeros(1, 2, 3, 4, dtype=torch.int32), torch.tensor([1, 1]), 16)


def test_binding_validates():
    try:
        from megatron_dsv import _C
    except ImportError:
        pytest.skip("megatron_dsv._C not built here")
    base = dict(q=256, k=256, counts=256, out=256, bits=256, B=1, H=1, S=64, r=16, group_size=8,
                block_size=0, kmax=4, dtype="bfloat16", proxy="mean", block_score="max", stream=0)
    for key, bad in [("r", 12), ("block_size", 32), ("dtype", "float64"), ("proxy", "x"), ("block_score", "x"),
                     ("S", 0), ("group_size", 0), ("kmax", 65), ("q", 0), ("k", 258), ("bits", 0),
                     ("sample_stride", -1), ("flags", 8)]:
        with pytest.raises(ValueError, match=key.split("_")[0]):
            _C.topk_estimation(**{**base, key: bad})


# ---------------------------------------------------------------- GPU

def _near_tie_equal(q, k, ref, got, counts, G, bs, proxy, bscore, groups=64, rtol=2e-5, who=""):
    """Lists equal, except items whose score is within rtol*scale of the group's threshold."""
    B, H, NG, _ = ref.shape
    p = group_proxies(q, G, proxy)
    sel = torch.linspace(0, NG - 1, min(groups, NG)).long().unique()
    for b in range(B):
        for h in range(H):
            K = int(counts[b, h])
            if K == 0:
                continue
            s = item_scores(p[b, h, sel], k[b, h], bs, bscore)
            t = torch.topk(s, K, -1).values[:, -1:]
            scale = s.abs().amax(-1, keepdim=True)
            for i, g in enumerate(sel.tolist()):
                assert bool((got[b, h, g, :K] >= 0).all()), (who, "fewer than K items", b, h, g)
                a, c = set(ref[b, h, g, :K].tolist()), set(got[b, h, g, :K].tolist())
                diff = torch.tensor(sorted(a ^ c), dtype=torch.long, device=s.device)
                if diff.numel():
                    assert bool(((s[i, diff] - t[i]).abs() <= rtol * scale[i]).all()), (who, b, h, g)
                assert bool((got[b, h, g, :K].diff() > 0).all())
    assert bool((got[..., :] >= -1).all())


def _gpu_backends():
    from megatron_dsv.ops.topk_estimation.cuda_impl import cuda_extension

    out = ["triton"]
    if cuda_extension() is not None:
        out.append("cuda")
    only = os.environ.get("DSV_TOPK_TEST_BACKENDS")  # e.g. "cuda" to save device time
    return [b for b in out if not only or b in only.split(",")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("S,G,bs,proxy,bscore,r", [(1000, 32, 0, "mean", "max", 16), (4099, 16, 0, "middle", "max", 8),
                                                    (3001, 32, 64, "mean", "max", 32), (5000, 32, 128, "mean", "lse", 16)])
def test_gpu_exact_integer_inputs(dtype, S, G, bs, proxy, bscore, r, monkeypatch):
    q, k = _ints((2, 3, S, r), dtype, "cuda", seed=11), _ints((2, 3, S, r), dtype, "cuda", seed=12)
    nit = S if bs == 0 else -(-S // bs)
    budgets = torch.tensor([[1, nit // 10, nit], [nit // 3, 0, 7]], device="cuda")
    ref = estimate_topk_naive(q, k, budgets, G, bs, proxy, bscore)
    for backend in _gpu_backends():
        monkeypatch.setenv("DSV_TOPK_BACKEND", backend)
        got = estimate_topk(q, k, budgets, G, bs, proxy, bscore)
        assert torch.equal(ref[1], got[1]), backend
        if bscore == "lse":  # exp/log rounding differs between libraries
            _near_tie_equal(q, k, ref[0], got[0], ref[1], G, bs, proxy, bscore, rtol=1e-5, who=backend)
        else:
            assert torch.equal(ref[0], got[0]), backend


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("S,bs", [(4096, 0), (65536, 0), (65536, 64)])
def test_gpu_continuous(dtype, S, bs, monkeypatch):
    torch.manual_seed(13)
    H = 2 if S > 10000 else 4
    q = torch.randn(1, H, S, 16, device="cuda").to(dtype)
    k = torch.randn(1, H, S, 16, device="cuda").to(dtype)
    k[:, :, S // 2: S // 2 + 300] = k[:, :, 5:6]  # planted ties
    nit = S if bs == 0 else S // bs
    budgets = torch.tensor([nit // 10] + [nit // 20] * (H - 1), device="cuda")
    ref = estimate_topk_naive(q, k, budgets, 32, bs)
    for backend in _gpu_backends():
        monkeypatch.setenv("DSV_TOPK_BACKEND", backend)
        got = estimate_topk(q, k, budgets, 32, bs)
        assert torch.equal(ref[1], got[1])
        _near_tie_equal(q, k, ref[0], got[0], ref[1], 32, bs, "mean", "max", who=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["zero_keys", "two_values"])
def test_gpu_massive_ties_take_radix_fallback(dtype, kind, monkeypatch):
    """> 512 items in the boundary bin (a zero-initialised predictor, or few distinct scores)
    sends the CUDA kernel down its exact radix fallback: it must still match naive."""
    S = 6000
    q = _ints((1, 2, S, 16), dtype, "cuda", seed=21)
    if kind == "zero_keys":
        k = torch.zeros(1, 2, S, 16, device="cuda", dtype=dtype)
    else:
        k = _ints((1, 2, S, 1), dtype, "cuda", lo=0, hi=2, seed=23).expand(1, 2, S, 16).contiguous()  # 2 scores
    budgets = torch.tensor([700, 3001], device="cuda")
    ref = estimate_topk_naive(q, k, budgets, 32)
    for backend in _gpu_backends():
        monkeypatch.setenv("DSV_TOPK_BACKEND", backend)
        got = estimate_topk(q, k, budgets, 32)
        assert torch.equal(ref[0], got[0]), backend


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["sampled-window", "forced-fallback"])
@pytest.mark.parametrize("S,bs", [(9001, 0), (4099, 64)])
def test_gpu_kernel_paths(dtype, path, S, bs):
    """The CUDA kernel's sampled-window path (forced at small S) and its exact fallback (forced for
    every row) select exactly what naive selects, on continuous and on heavily tied inputs."""
    from megatron_dsv.ops.topk_estimation.cuda_impl import cuda_extension, estimate_topk_cuda

    if cuda_extension() is None:
        pytest.skip("megatron_dsv._C is not built")
    kw = dict(sample_stride=8) if path == "sampled-window" else dict(force_fallback=True)
    nit = S if bs == 0 else -(-S // bs)
    budgets = torch.tensor([[nit // 10, max(1, nit // 50), nit // 3, nit - 1]], device="cuda")
    torch.manual_seed(5)
    cont = (torch.randn(1, 4, S, 16, device="cuda").to(dtype), torch.randn(1, 4, S, 16, device="cuda").to(dtype))
    ints = (_ints((1, 4, S, 16), dtype, "cuda", seed=31), _ints((1, 4, S, 16), dtype, "cuda", lo=-1, hi=2, seed=32))
    for q, k in (cont, ints):
        ref = estimate_topk_naive(q, k, budgets, 32, bs)
        got = estimate_topk_cuda(q, k, budgets, 32, bs, **kw)
        assert torch.equal(ref[1], got[1])
        if q is ints[0]:
            assert torch.equal(ref[0], got[0])  # exact scores: identical lists
        else:
            _near_tie_equal(q, k, ref[0], got[0], ref[1], 32, bs, "mean", "max", who=path)


@pytest.mark.gpu
def test_gpu_scratch_chunking_and_bad_stride():
    """Many heads with a tiny budget: the bitmask scratch is chunked over (batch, head) and the
    result still equals naive; a bad sample_stride is a clear error."""
    from megatron_dsv.ops.topk_estimation.cuda_impl import _SCRATCH_FLOOR, cuda_extension, estimate_topk_cuda

    if cuda_extension() is None:
        pytest.skip("megatron_dsv._C is not built")
    S, H = 16384, 32
    per_bh = -(-S // 32) * -(-S // 32) * 4
    assert per_bh * H > _SCRATCH_FLOOR  # otherwise no chunking happens
    q = _ints((1, H, S, 8), torch.float16, "cuda", seed=41)
    k = _ints((1, H, S, 8), torch.float16, "cuda", seed=42)
    ref = estimate_topk_naive(q, k, 3, 32)
    got = estimate_topk_cuda(q, k, 3, 32)
    assert torch.equal(ref[0], got[0])
    with pytest.raises(ValueError, match="sample_stride"):
        estimate_topk_cuda(q, k, 3, 32, sample_stride=65)


def test_blocked_prefix_sum_equals_cumsum():
    """The oracle's deterministic prefix sum (used on CUDA under torch.use_deterministic_algorithms, where
    torch's float cumsum raises) against torch.cumsum: odd lengths, partial and whole blocks, leading dims."""
    from megatron_dsv.ops.topk_estimation.oracle import blocked_prefix_sum, prefix_sum

    g = torch.Generator().manual_seed(0)
    for n, block in [(1, 256), (255, 256), (256, 256), (257, 256), (1000, 64), (3, 2)]:
        x = torch.rand(2, 3, n, generator=g, dtype=torch.float64)
        torch.testing.assert_close(blocked_prefix_sum(x, block), torch.cumsum(x, -1), rtol=1e-12, atol=1e-12)
        x32 = x.float()
        torch.testing.assert_close(blocked_prefix_sum(x32, block), torch.cumsum(x32, -1), rtol=1e-5, atol=1e-5)
        assert blocked_prefix_sum(x32, block).dtype == torch.float32
    assert blocked_prefix_sum(torch.zeros(2, 0)).shape == (2, 0)
    x = torch.rand(4, 300, generator=g)
    assert torch.equal(prefix_sum(x), torch.cumsum(x, -1))  # off CUDA (or without the flag): torch's own

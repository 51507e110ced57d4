"""GPU tests: bf16 kernels vs an fp32 reference, held to 2x the error of
PyTorch's own bf16 attention on the same inputs (3x for gradients).

The reference works group by group: a query group attends a dense set of
gathered keys, so fp32 and bf16 SDPA on that gathered set give the reference
and PyTorch's bf16 error without an S x S mask (64K tokens fit).
"""

import math

import pytest
import torch

from megatron_dsv.ops.sparse_attention import sparse_attention

pytestmark = pytest.mark.gpu


def gpu_lists(B, H, S, G, BS, density, seed=0, Sk=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    Sk = S if Sk is None else Sk
    NG, nk = math.ceil(S / G), (Sk if BS == 0 else math.ceil(Sk / BS))
    K = max(1, round(density * nk))
    idx = torch.full((B, H, NG, K + 2), -1, device="cuda", dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            perm = torch.rand(NG, nk, device="cuda", generator=gen).argsort(-1)[:, :K]
            idx[b, h, :, :K] = perm.sort(-1).values.to(torch.int32)
    return idx, torch.full((B, H), K, device="cuda", dtype=torch.int32)


def grouped_attention(q, k, v, idx, cnt, G, BS, dtype, chunk=64):
    """Attention of each query group over its gathered keys, SDPA in `dtype`; differentiable."""
    B, H, S, D = q.shape
    rep, Sk = H // k.shape[1], k.shape[2]
    heads = []
    for b in range(B):
        for h in range(H):
            c = int(cnt[b, h])
            ent = idx[b, h, :, :c].long()
            cols = ent if BS == 0 else (ent[..., None] * BS + torch.arange(BS, device=q.device)).flatten(1)
            valid = cols < Sk  # the partial last key block
            cols = cols.clamp_max(Sk - 1)
            qh = q[b, h].to(dtype)
            qh = torch.nn.functional.pad(qh, (0, 0, 0, cols.shape[0] * G - S)).view(-1, G, D)
            kh, vh = k[b, h // rep].to(dtype), v[b, h // rep].to(dtype)
            chunks = []
            for g0 in range(0, cols.shape[0], chunk):
                sl = slice(g0, g0 + chunk)
                mask = valid[sl, None, :].expand(-1, G, -1)
                chunks.append(torch.nn.functional.scaled_dot_product_attention(
                    qh[sl], kh[cols[sl]], vh[cols[sl]], attn_mask=mask))
            heads.append(torch.cat(chunks).reshape(-1, D)[:S])
    return torch.stack(heads).view(B, H, S, D)


def err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_against_torch(B, H, Hkv, S, D, G, BS, density, seed=0, Sk=None):
    """bf16 kernel vs an fp32 reference, within 2x (o) / 3x (grads) of torch's own bf16 error;
    ``Sk``: a key length other than the query length S (sequence-wise context parallelism)."""
    torch.manual_seed(seed)
    Sk = S if Sk is None else Sk
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx, cnt = gpu_lists(B, H, S, G, BS, density, seed, Sk)
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    results = []
    for fn, leaves in ((lambda: sparse_attention(q, k, v, idx, cnt, G, BS), (q, k, v)),
                       (lambda: grouped_attention(q32, k32, v32, idx, cnt, G, BS, torch.float32), (q32, k32, v32)),
                       (lambda: grouped_attention(q, k, v, idx, cnt, G, BS, torch.bfloat16), (q, k, v))):
        o = fn()
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
        results.append((o, *grads))
    ours, ref, torch_bf16 = results
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        bound = (2 if i == 0 else 3) * err(torch_bf16[i], ref[i]) + 1e-4
        assert not torch.isnan(ours[i]).any(), name
        assert err(ours[i], ref[i]) <= bound, (name, err(ours[i], ref[i]), bound)


@pytest.mark.parametrize("B,H,Hkv,S,D,G,BS,density", [
    pytest.param(1, 2, 2, 1000, 128, 128, 128, 0.3, id="B1-T1000-H2-D128-G128-blk128"),
    pytest.param(2, 4, 2, 1000, 64, 64, 64, 0.2, id="B2-T1000-H4-Hkv2-D64-G64-blk64"),
    pytest.param(1, 2, 1, 1000, 96, 16, 0, 0.1, id="B1-T1000-H2-Hkv1-D96-G16-tok"),
    pytest.param(1, 2, 2, 777, 256, 32, 128, 0.4, id="B1-T777-H2-D256-G32-blk128"),
    pytest.param(1, 2, 2, 777, 256, 64, 0, 0.2, id="B1-T777-H2-D256-G64-tok"),
    pytest.param(1, 2, 2, 4100, 128, 128, 0, 0.1, id="B1-T4100-H2-D128-G128-tok"),
])
def test_bf16_matches_reference(B, H, Hkv, S, D, G, BS, density):
    check_against_torch(B, H, Hkv, S, D, G, BS, density)


@pytest.mark.parametrize("Sq,Sk,D,G,BS,density", [
    pytest.param(1000, 2304, 128, 128, 128, 0.3, id="Tq1000-Tk2304-D128-G128-blk128"),
    pytest.param(4100, 1000, 128, 128, 0, 0.2, id="Tq4100-Tk1000-D128-G128-tok"),
    pytest.param(700, 1500, 64, 64, 64, 0.25, id="Tq700-Tk1500-D64-G64-blk64"),
])
def test_bf16_key_length_differs(Sq, Sk, D, G, BS, density):
    check_against_torch(1, 2, 1, Sq, D, G, BS, density, Sk=Sk)


@pytest.mark.parametrize("BS,density", [pytest.param(128, 0.1, id="T65536-blk128"),
                                        pytest.param(0, 0.05, id="T65536-tok")])
def test_bf16_64k(BS, density):
    check_against_torch(1, 2, 1, 65536, 128, 128, BS, density)


@pytest.mark.parametrize("pack", ["on", "off", "on-row-chunks"])
@pytest.mark.parametrize("B,H,Hkv,S,D,G,density", [
    pytest.param(1, 2, 2, 1000, 128, 32, 0.2, id="B1-T1000-H2-D128-G32-P4"),
    pytest.param(2, 4, 2, 777, 64, 64, 0.15, id="B2-T777-H4-Hkv2-D64-G64-P2"),
    pytest.param(1, 2, 1, 65536, 128, 32, 0.05, id="T65536-D128-G32-P4"),
])
def test_bf16_packed_token_lists(monkeypatch, pack, B, H, Hkv, S, D, G, density):
    """DSV_TOKEN_PACK=on (the default: P = 128 // G groups as one 128-row group over their union, per-row bit
    masks) and off, the compiled sm_90 kernels under the same bound (random lists: the union is ~P lists); and
    packed one (batch, head) row per chunk (the dq kernel's row offset BH0)."""
    if pack == "on-row-chunks":
        from megatron_dsv.ops.sparse_attention import packing

        monkeypatch.setattr(packing, "PACKED_LISTS_BYTES", 1)
        pack = "on"
    monkeypatch.setenv("DSV_TOKEN_PACK", pack)
    check_against_torch(B, H, Hkv, S, D, G, 0, density)


@pytest.mark.parametrize("S,density", [(65536, 0.1), (65536, 0.5), (3001, 0.3)])
def test_packing_by_runs_equals_packing_by_atomic_or(S, density):
    """The marking pass with one atomic add per run of entries in a bitmap word (mark="runs", the default) builds
    the same packed lists as one atomic_or per entry, compiled and run concurrently on the GPU (dense lists: long
    runs)."""
    from megatron_dsv.ops.sparse_attention.packing import pack_token_lists

    idx, cnt = gpu_lists(1, 4, S, 32, 0, density, seed=3)
    a_idx, a_bits, a_cnt = pack_token_lists(idx, cnt, 32, 4, S, mark="atomic")
    r_idx, r_bits, r_cnt = pack_token_lists(idx, cnt, 32, 4, S, mark="runs")
    assert torch.equal(a_cnt, r_cnt)
    used = torch.arange(a_idx.shape[-1], device="cuda") < a_cnt[..., None]
    assert torch.equal(a_idx[used], r_idx[used]) and torch.equal(a_bits[used], r_bits[used])


@pytest.mark.parametrize("BN,warps", [(64, 4), (128, 8)])
@pytest.mark.parametrize("B,H,Hkv,S,D,G,BS,density", [
    pytest.param(1, 2, 2, 1000, 128, 32, 0, 0.2, id="B1-T1000-H2-D128-G32-tok"),
    pytest.param(2, 4, 2, 777, 96, 32, 128, 0.3, id="B2-T777-H4-Hkv2-D96-G32-blk128"),
    pytest.param(1, 2, 1, 65536, 128, 32, 0, 0.05, id="T65536-D128-G32-tok"),
])
def test_bf16_keys_as_rows_forward(monkeypatch, BN, warps, B, H, Hkv, S, D, G, BS, density):
    """The forward with keys as the MMA's rows (cfg KT=1: wgmma for 32-row query tiles), compiled for sm_90, as the
    op's forward, with the default backward reading its o and lse."""
    from megatron_dsv.ops.sparse_attention import launch

    monkeypatch.setitem(launch.CONFIG_OVERRIDES, ("fwd", D, G, BS), dict(BM=G, BN=BN, num_warps=warps,
                                                                         num_stages=2, KT=1))
    check_against_torch(B, H, Hkv, S, D, G, BS, density)


@pytest.mark.parametrize("dq", [pytest.param(1, id="atomics"), pytest.param(2, id="tma")])
@pytest.mark.parametrize("B,H,Hkv,S,D,G,BS,BN,density", [
    pytest.param(1, 2, 2, 1000, 128, 128, 128, 128, 0.3, id="B1-T1000-H2-D128-G128-blk128-BN128"),
    pytest.param(2, 4, 2, 1000, 64, 64, 64, 64, 0.2, id="B2-T1000-H4-Hkv2-D64-G64-blk64"),
    pytest.param(1, 2, 1, 65536, 128, 128, 128, 64, 0.1, id="T65536-blk128"),
])
def test_bf16_fused_bwd(monkeypatch, dq, B, H, Hkv, S, D, G, BS, BN, density):
    """The fused backward (dq by fp32 atomics or TMA reduce-add) under the same bound."""
    from megatron_dsv.ops.sparse_attention import launch

    monkeypatch.setenv("DSV_SPARSE_BWD", "fused")
    monkeypatch.setitem(launch.CONFIG_OVERRIDES, ("bwd_fused", D, G, BS),
                        dict(BM=64, BN=BN, num_warps=8 if BN == 128 else 4, num_stages=2, DQ=dq))
    check_against_torch(B, H, Hkv, S, D, G, BS, density)


@pytest.mark.parametrize("G,BS,token_kv", [(128, 128, None), (64, 128, None), (32, 0, "fixed"), (32, 0, "inverse")],
                         ids=["G128-blk128", "G64-blk128-fused-cell", "G32-token", "G32-token-inverse"])
def test_deterministic_mode_gives_the_same_bits(monkeypatch, G, BS, token_kv):
    """torch.use_deterministic_algorithms(True): our block-list backward (split, atomic-free; the Triton
    backend, which the dispatcher could otherwise hand to FlexAttention at this size) gives bitwise the same dq,
    dk, dv on two runs, also at a shape where the fused (atomic dq) backward is otherwise chosen; token lists
    (dk/dv as int64 fixed-point atomics, and through the token inverse map) too, and within the bf16 bound of the
    fp32 atomic kernels' gradients."""
    from megatron_dsv.ops.sparse_attention import launch

    if token_kv:
        monkeypatch.setenv("DSV_TOKEN_KV_BWD", token_kv)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert launch.bwd_mode(G, BS, 128) == "split"
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, 8, 16384, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for _ in range(4))
        idx, cnt = gpu_lists(1, 8, 16384, G, BS, 0.2)
        grads = []
        for _ in range(2):
            qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
            sparse_attention(qi, ki, vi, idx, cnt, G, BS, backend="triton").backward(do)
            grads.append((qi.grad, ki.grad, vi.grad))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        if BS == 0:  # the same values as the atomic kernels, up to summation order
            torch.use_deterministic_algorithms(False)
            qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
            sparse_attention(qi, ki, vi, idx, cnt, G, BS, backend="triton").backward(do)
            for a, b in zip(grads[0], (qi.grad, ki.grad, vi.grad)):
                assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2
    finally:
        torch.use_deterministic_algorithms(before)

"""Block lists' backward on Hopper's copy engine: ``bwd_desc_kernel``, a candidate beside ``bwd_kv_kernel``.

The same math as the split backward (triton_bwd.py: fp32 accumulators, log2-domain lse, scores times
qk_scale = softmax_scale * log2(e), delta = rowsum(o * do) from a pre-pass), with three changes a tuning sweep
can switch on one at a time (``launch.sparse_bwd``'s ``cfg_kv`` keys, :data:`launch.DESC_KEYS`):

- ``DESC`` = 1: every q / do / k / v tile is a contiguous run of rows of one head (a query tile is BM rows of a
  128-row group, a key tile BN rows of a block), so it is one bulk tensor copy (TMA) through a host-made tensor
  descriptor over ``[B * heads, length, D]`` instead of BM x D pointer loads: no address registers, and the
  copy engine zero-fills the rows past the length (the partial last group or key block) as the masked loads do.
  DESC = 0 takes plain pointer loads (the same kernel's math on any Triton, e.g. under the interpreter).
- ``WS`` = 1: the inner walk is ``tl.range(..., warp_specialize=True)``: Triton may split it into a producer
  (copies) and consumer (MMA) warp groups; where the compiler does not specialise the loop this is a no-op.
- ``DQ_ROLE`` = 1: dq programs run in the same launch as the dk/dv programs (FlexAttention's scheme): grid axis
  0 holds the ``N_KV`` key tiles of a kv head, then HR x the dq tiles of its query heads, so the two roles share
  the machine instead of running one after the other, and the dq programs fill the dk/dv programs' tail. The dq
  tile is its own shape (BMQ queries x BNQ keys; Flex's 128 x 64), the dk/dv tile BN keys x BM queries.

Block lists only (BS > 0), with BN <= BS and BNQ <= BS (a key tile never crosses a block). GQA (HR > 1): a dk/dv
program walks the inverse maps of its kv head's HR query heads (sums in registers); dq programs are per query
head.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(x, i_head, row0, L, K: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, DESC: tl.constexpr):
    """[ROWS, BD] rows row0 .. row0 + ROWS of head i_head of a contiguous [heads, L, K] tensor; rows past L and
    columns past K read as 0. DESC: x is a tensor descriptor with block [1, ROWS, BD] (a TMA copy, zero fill out
    of bounds); else a pointer (masked loads)."""
    if DESC:
        return x.load([i_head, row0, 0]).reshape(ROWS, BD)
    else:
        o_r = row0 + tl.arange(0, ROWS)
        o_d = tl.arange(0, BD)
        m = (o_r[:, None] < L) & (o_d[None, :] < K)
        return tl.load(x + i_head.to(tl.int64) * L * K + o_r[:, None] * K + o_d[None, :], mask=m, other=0.)


@triton.jit
def _store_rows(x, val, i_head, row0, L, K: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    """Store [ROWS, BD] into rows row0 .. of head i_head of a contiguous [heads, L, K] tensor (masked: once a
    program, so pointers suffice)."""
    o_r = row0 + tl.arange(0, ROWS)
    o_d = tl.arange(0, BD)
    m = (o_r[:, None] < L) & (o_d[None, :] < K)
    tl.store(x + i_head.to(tl.int64) * L * K + o_r[:, None] * K + o_d[None, :], val.to(x.dtype.element_ty), mask=m)


@triton.jit
def _query_tile(q, do, lse, delta, i_bh, m0, T, K: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                DESC: tl.constexpr):
    """Query rows m0 .. m0 + BM of head i_bh: q, do [BM, BD] and lse, delta [BM]. Rows past T read 0, and their
    lse +inf makes their p exactly 0."""
    o_m = m0 + tl.arange(0, BM)
    m_m = o_m < T
    b_lse = tl.load(lse + i_bh.to(tl.int64) * T + o_m, mask=m_m, other=float("inf"))
    b_delta = tl.load(delta + i_bh.to(tl.int64) * T + o_m, mask=m_m, other=0.)
    return _rows(q, i_bh, m0, T, K, BD, BM, DESC), _rows(do, i_bh, m0, T, K, BD, BM, DESC), b_lse, b_delta


@triton.jit
def _dkdv_tile(q, k, v, do, lse, delta, dk, dv, inv_ptr, inv_grp, i_n, i_bhkv, T, TK, NKB, qk_scale, sm_scale,
               H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, G: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, DESC: tl.constexpr, WS: tl.constexpr):
    """dk, dv of key tile i_n (BN keys of block i_n // (BS // BN)) of kv head i_bhkv: the inverse map's query
    groups of each of the HR query heads, BM rows at a time (bwd_kv_kernel's walk with DQ = 0)."""
    HKV: tl.constexpr = H // HR
    i_b, i_hkv = i_bhkv // HKV, i_bhkv % HKV
    i_kb = i_n // (BS // BN)
    n0 = i_kb * BS + (i_n % (BS // BN)) * BN
    # [BN, BD]; rows past TK read 0: their dk/dv rows are never stored, and no other row depends on them
    b_k = _rows(k, i_bhkv, n0, TK, K, BD, BN, DESC)
    b_v = _rows(v, i_bhkv, n0, TK, K, BD, BN, DESC)
    b_dk = tl.zeros([BN, BD], tl.float32)
    b_dv = tl.zeros([BN, BD], tl.float32)
    for i_hr in range(HR):
        i_bh = i_b * H + i_hkv * HR + i_hr
        p_inv = inv_ptr + i_bh.to(tl.int64) * NKB + i_kb
        e_lo = tl.load(p_inv)
        n_e = (tl.load(p_inv + 1) - e_lo) * (G // BM)  # (listed group, query tile of the group) pairs
        for i_j in tl.range(n_e, warp_specialize=WS):
            i_e = e_lo * (G // BM) + i_j
            i_g = tl.load(inv_grp + i_e // (G // BM))
            m0 = i_g * G + (i_e % (G // BM)) * BM
            b_q, b_do, b_lse, b_delta = _query_tile(q, do, lse, delta, i_bh, m0, T, K, BD, BM, DESC)
            # [BN, BM]: transposed scores, so dk/dv accumulate without transposing them
            b_pt = tl.exp2(tl.dot(b_k, tl.trans(b_q)) * qk_scale - b_lse[None, :])
            b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
            b_dpt = tl.dot(b_v, tl.trans(b_do))
            b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(b_q.dtype)
            b_dk += tl.dot(b_dst, b_q)
    _store_rows(dk, b_dk * sm_scale, i_bhkv, n0, TK, K, BD, BN)
    _store_rows(dv, b_dv, i_bhkv, n0, TK, K, BD, BN)


@triton.jit
def _dq_tile(q, k, v, do, lse, delta, dq, idx, cnt_ptr, i_m, i_bh, T, TK, NG, KMAX, qk_scale, sm_scale,
             H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, G: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, EVEN_T: tl.constexpr, DESC: tl.constexpr):
    """dq of query tile i_m (BM rows of group i_m // (G // BM)) of query head i_bh over its group's listed blocks,
    BN keys a step (bwd_q_kernel's block-list walk with delta read, not computed, and no dK/dV scatter)."""
    i_bhkv = (i_bh // H) * (H // HR) + (i_bh % H) // HR
    i_g = i_m // (G // BM)
    m0 = i_g * G + (i_m % (G // BM)) * BM
    b_q, b_do, b_lse, b_delta = _query_tile(q, do, lse, delta, i_bh, m0, T, K, BD, BM, DESC)
    cnt = tl.load(cnt_ptr + i_bh.to(tl.int64) * NG + i_g)  # [B, H, NG] counts
    p_idx = idx + (i_bh.to(tl.int64) * NG + i_g) * KMAX
    b_dq = tl.zeros([BM, BD], tl.float32)
    for i_it in range(cnt * (BS // BN)):
        n0 = tl.load(p_idx + i_it // (BS // BN)) * BS + (i_it % (BS // BN)) * BN
        # [BN, BD]
        b_k = _rows(k, i_bhkv, n0, TK, K, BD, BN, DESC)
        b_v = _rows(v, i_bhkv, n0, TK, K, BD, BN, DESC)
        # [BM, BN]
        b_p = tl.exp2(tl.dot(b_q, tl.trans(b_k)) * qk_scale - b_lse[:, None])
        if not EVEN_T:  # the partial last block: keys past TK get p = 0, as in bwd_q_kernel (their zero k rows
            # would add nothing to dq anyway; the mask keeps dS itself the reference's)
            b_p = tl.where((n0 + tl.arange(0, BN))[None, :] < TK, b_p, 0.)
        b_dp = tl.dot(b_do, tl.trans(b_v))
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
    _store_rows(dq, b_dq * sm_scale, i_bh, m0, T, K, BD, BM)


@triton.jit
def bwd_desc_kernel(
    q, k, v, do, q2, k2, v2, do2, lse, delta, dq, dk, dv, inv_ptr, inv_grp, idx, cnt_ptr,
    T, TK, NKB, NG, KMAX, N_KV, qk_scale, sm_scale,
    H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BMQ: tl.constexpr, BNQ: tl.constexpr, EVEN_T: tl.constexpr,
    DESC: tl.constexpr, WS: tl.constexpr, DQ_ROLE: tl.constexpr,
):
    """Program (i, kv head): i < N_KV the dk/dv of key tile i (q, k, v, do: [1, BM | BN, BD] descriptors or
    pointers); with DQ_ROLE, i >= N_KV the dq of query tile (i - N_KV) % (NG * G // BMQ) of query head
    (i - N_KV) // (NG * G // BMQ) of this kv head (q2, k2, v2, do2: the dq tiles' [1, BMQ | BNQ, BD] descriptors,
    or the same pointers). inv_ptr / inv_grp: the inverse map (``launch.build_inverse_map``); idx / cnt_ptr the
    lists and their [B, H, NG] counts (dq programs only)."""
    i_p, i_bhkv = tl.program_id(0), tl.program_id(1)
    if DQ_ROLE:
        if i_p < N_KV:
            _dkdv_tile(q, k, v, do, lse, delta, dk, dv, inv_ptr, inv_grp, i_p, i_bhkv, T, TK, NKB, qk_scale,
                       sm_scale, H, HR, K, BD, G, BM, BN, BS, DESC, WS)
        else:
            n_dq = NG * (G // BMQ)
            i_hr = (i_p - N_KV) // n_dq
            HKV: tl.constexpr = H // HR
            i_bh = (i_bhkv // HKV) * H + (i_bhkv % HKV) * HR + i_hr
            _dq_tile(q2, k2, v2, do2, lse, delta, dq, idx, cnt_ptr, (i_p - N_KV) % n_dq, i_bh, T, TK, NG, KMAX,
                     qk_scale, sm_scale, H, HR, K, BD, G, BMQ, BNQ, BS, EVEN_T, DESC)
    else:
        _dkdv_tile(q, k, v, do, lse, delta, dk, dv, inv_ptr, inv_grp, i_p, i_bhkv, T, TK, NKB, qk_scale, sm_scale,
                   H, HR, K, BD, G, BM, BN, BS, DESC, WS)

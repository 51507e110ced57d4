"""Triton forward: one program per (query tile of a group, batch*head).

Shapes: B batch, H query heads, HR = H // Hkv query heads per kv head (GQA by
index arithmetic), T query length, TK key length (TK != T for a context-parallel
rank's queries against its gathered keys), G group size, BM query rows per program
(divides G), BN keys per inner step, BS key-block size (0 = token lists), K/BD
head dim (BD = K rounded up to a power of two; 96 runs padded to 128 with a
mask). q, o are contiguous [B, H, T, K], k, v [B, Hkv, TK, K]; lse is [B, H, T] fp32 in
log2 units of the scaled scores, kept for backward. EVEN_T: no partial key
block (TK % BS == 0, or token lists), so key rows need no TK mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(i_it, cnt, p_idx, TK, K: tl.constexpr, BD: tl.constexpr,
                  BN: tl.constexpr, BS: tl.constexpr, EVEN_T: tl.constexpr):
    """Key rows of inner step i_it and their validity (TK: the key length).

    Token lists gather BN rows by index. Block lists with BN <= BS read BN
    consecutive rows of block idx[i_it // (BS // BN)] (a block takes BS // BN
    steps); with BN > BS one step covers BN // BS listed blocks, so 64-row
    blocks still feed 128-wide MMA tiles (the last step may be half empty).
    """
    o_d = tl.arange(0, BD)
    if BS == 0:
        o_j = i_it * BN + tl.arange(0, BN)
        m_n = o_j < cnt
        o_n = tl.load(p_idx + o_j, mask=m_n, other=0)
    elif BN > BS:
        o_j = i_it * (BN // BS) + tl.arange(0, BN) // BS
        m_n = o_j < cnt
        o_n = tl.load(p_idx + o_j, mask=m_n, other=0) * BS + tl.arange(0, BN) % BS
        if not EVEN_T:
            m_n = m_n & (o_n < TK)
    else:
        i_blk = tl.load(p_idx + i_it // (BS // BN))
        o_n = i_blk * BS + (i_it % (BS // BN)) * BN + tl.arange(0, BN)
        if EVEN_T:
            m_n = tl.full([BN], 1, tl.int1)
        else:
            m_n = o_n < TK
    m_ld = m_n[:, None]
    if BD != K:
        m_ld = m_ld & (o_d[None, :] < K)
    return o_n, m_n, m_ld


@triton.jit
def _load_kv(k, v, p_kv_base, i_it, cnt, p_idx, TK, K: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
             BS: tl.constexpr, EVEN_T: tl.constexpr):
    """The forwards' K and V rows [BN, BD] of inner step i_it (:func:`_load_kv_tile`) and their validity [BN]."""
    o_n, m_n, m_ld = _load_kv_tile(i_it, cnt, p_idx, TK, K, BD, BN, BS, EVEN_T)
    p_rows = p_kv_base + o_n[:, None] * K + tl.arange(0, BD)[None, :]
    return tl.load(k + p_rows, mask=m_ld, other=0.), tl.load(v + p_rows, mask=m_ld, other=0.), m_n


@triton.jit
def _num_steps(cnt, BN: tl.constexpr, BS: tl.constexpr):
    """Inner steps over a list of cnt entries (tokens or blocks)."""
    if BS == 0:
        n_it = tl.cdiv(cnt, BN)
    elif BN > BS:
        n_it = tl.cdiv(cnt, BN // BS)
    else:
        n_it = cnt * (BS // BN)
    return n_it


@triton.jit
def _group_tile(idx, cnt_ptr, T, TK, NG, KMAX, H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr,
                G: tl.constexpr, BM: tl.constexpr):
    """This program's query tile (program ids: tile of a group, batch*head): the int64 bases of its head's q/o
    and k/v rows (B*H*T*K overflows int32 past ~2^31 elements), its query rows and their mask, its group's
    index and list (count, first entry)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_m // (G // BM)
    p_kv_base = (i_b * (H // HR) + i_h // HR).to(tl.int64) * TK * K
    p_q_base = i_bh.to(tl.int64) * T * K
    o_m = i_g * G + (i_m % (G // BM)) * BM + tl.arange(0, BM)
    cnt = tl.load(cnt_ptr + i_bh.to(tl.int64) * NG + i_g)  # [B, H, NG] counts
    p_idx = idx + (i_bh.to(tl.int64) * NG + i_g) * KMAX
    return i_bh, i_g, p_kv_base, p_q_base, o_m, o_m < T, cnt, p_idx


@triton.jit
def sparse_attn_fwd_kernel(
    q, k, v, o, lse, idx, bits, cnt_ptr,
    T, TK, NG, KMAX, qk_scale,
    H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    EVEN_T: tl.constexpr, GB: tl.constexpr = 0,
):
    """GB > 0: packed token lists (``packing.py``): a group of G rows is G // GB groups of GB rows, and
    bits[entry] says which of them list the entry's key (the others give it zero probability)."""
    i_bh, i_g, p_kv_base, p_q_base, o_m, m_m, cnt, p_idx = _group_tile(idx, cnt_ptr, T, TK, NG, KMAX, H, HR, K, G, BM)
    o_d = tl.arange(0, BD)
    m_q = m_m[:, None] & (o_d[None, :] < K)
    # [BM, BD]
    b_q = tl.load(q + p_q_base + o_m[:, None] * K + o_d[None, :], mask=m_q, other=0.)
    n_it = _num_steps(cnt, BN, BS)

    if GB > 0:  # [BM]: each row's group within the packed group (its bit in an entry's mask)
        p_bits = bits + (i_bh.to(tl.int64) * NG + i_g) * KMAX
        o_sub = (o_m - i_g * G) // GB
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_acc = tl.zeros([BM, BD], tl.float32)
    for i_it in range(n_it):
        # [BN, BD]
        b_k, b_v, m_n = _load_kv(k, v, p_kv_base, i_it, cnt, p_idx, TK, K, BD, BN, BS, EVEN_T)
        # [BM, BN] raw scores; scaled into log2 units inside one FMA below (exp2 is native)
        b_s = tl.dot(b_q, tl.trans(b_k))
        if BS == 0 or BN > BS or not EVEN_T:
            b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        if GB > 0:
            # a row may have no key in this step: its max stays -inf, and 0 stands in for it below (no NaN)
            b_bits = tl.load(p_bits + i_it * BN + tl.arange(0, BN), mask=m_n, other=0).to(tl.int32)
            b_s = tl.where(((b_bits[None, :] >> o_sub[:, None]) & 1) != 0, b_s, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
            b_m_use = tl.where(b_m_new == float("-inf"), 0., b_m_new)
        else:
            # every step has >= 1 valid key, so b_m_new is finite and no NaN appears
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * qk_scale)
            b_m_use = b_m_new
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s * qk_scale - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None])
        b_m = b_m_new

    # an empty list leaves l == 0: output zeros, lse unused by backward
    b_has = b_l > 0
    b_o = b_acc / tl.where(b_has, b_l, 1.)[:, None]
    b_lse = tl.where(b_has, b_m + tl.log2(tl.where(b_has, b_l, 1.)), 0.)
    tl.store(o + p_q_base + o_m[:, None] * K + o_d[None, :], b_o.to(o.dtype.element_ty), mask=m_q)
    tl.store(lse + i_bh.to(tl.int64) * T + o_m, b_lse, mask=m_m)


@triton.jit
def sparse_attn_fwd_kt_kernel(
    q, k, v, o, lse, idx, cnt_ptr,
    T, TK, NG, KMAX, qk_scale,
    H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    EVEN_T: tl.constexpr, LAZY_L: tl.constexpr = 0,
):
    """The forward with keys as the MMA's rows, for query tiles of fewer than 64 rows (G = 32).

    Hopper's wgmma takes 64 rows a warpgroup: ``sparse_attn_fwd_kernel`` on a 32-row query tile runs the
    older mma.sync instead. Here both matmuls put a 64- or 128-row operand first: scores transposed,
    ``S^T = K Q^T`` [BN, BM] (keys x queries), and ``O^T += V^T P^T`` [BD, BM], so the query tile is the
    MMA's narrow N side (wgmma takes N = 8..256). The online softmax runs down the columns, so its max and sum
    reduce across warps each step; LAZY_L = 1 keeps the sum as a [BN, BM] tile instead, rescaled with the output
    and reduced once at the end (one cross-warp reduction a step instead of two). Same inputs, outputs and masks as
    ``sparse_attn_fwd_kernel`` (no packed lists).
    """
    i_bh, _, p_kv_base, p_q_base, o_m, m_m, cnt, p_idx = _group_tile(idx, cnt_ptr, T, TK, NG, KMAX, H, HR, K, G, BM)
    o_d = tl.arange(0, BD)
    m_qt = (o_d[:, None] < K) & m_m[None, :]
    p_qt = p_q_base + o_m[None, :] * K + o_d[:, None]
    # [BD, BM]: the query tile transposed
    b_qt = tl.load(q + p_qt, mask=m_qt, other=0.)
    n_it = _num_steps(cnt, BN, BS)

    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    if LAZY_L:
        b_l2 = tl.zeros([BN, BM], tl.float32)
    b_acc = tl.zeros([BD, BM], tl.float32)
    for i_it in range(n_it):
        # [BN, BD]
        b_k, b_v, m_n = _load_kv(k, v, p_kv_base, i_it, cnt, p_idx, TK, K, BD, BN, BS, EVEN_T)
        # [BN, BM] raw scores, keys down the rows
        b_st = tl.dot(b_k, b_qt)
        if BS == 0 or BN > BS or not EVEN_T:
            b_st = tl.where(m_n[:, None], b_st, float("-inf"))
        # every step has >= 1 valid key, so b_m_new is finite and no NaN appears
        b_m_new = tl.maximum(b_m, tl.max(b_st, 0) * qk_scale)
        b_alpha = tl.exp2(b_m - b_m_new)
        b_pt = tl.exp2(b_st * qk_scale - b_m_new[None, :])
        if LAZY_L:
            b_l2 = b_l2 * b_alpha[None, :] + b_pt
        else:
            b_l = b_l * b_alpha + tl.sum(b_pt, 0)
        b_acc = tl.dot(tl.trans(b_v), b_pt.to(b_v.dtype), b_acc * b_alpha[None, :])
        b_m = b_m_new

    if LAZY_L:
        b_l = tl.sum(b_l2, 0)
    b_has = b_l > 0
    b_ot = b_acc / tl.where(b_has, b_l, 1.)[None, :]
    b_lse = tl.where(b_has, b_m + tl.log2(tl.where(b_has, b_l, 1.)), 0.)
    tl.store(o + p_qt, b_ot.to(o.dtype.element_ty), mask=m_qt)
    tl.store(lse + i_bh.to(tl.int64) * T + o_m, b_lse, mask=m_m)

"""Triton backward kernels.

- ``bwd_q_kernel``: one program per query tile (the forward's grid); computes
  and stores delta = rowsum(o * do) for its rows, then walks the
  group's list again and accumulates dq in registers. With ATOMIC_KV = 1 it also
  scatters dk/dv into fp32 buffers with atomics: the token-level path, where a
  key's query groups are scattered and an inverse-map kernel would waste work.
  ATOMIC_KV = 2 scatters them as int64 fixed point instead (each term times a
  power of two from ``launch.fixed_point_scales``, rounded): integer addition
  is associative, so the sums are the same bits whatever order the atomics
  land in (the token lists' deterministic backward).
- ``bwd_kv_kernel``: block-level dk/dv without atomics: one program per key
  tile and kv head, walking the inverse map (key block -> query groups, CSR)
  of every query head that shares this kv head, so GQA sums in registers.
  Split backward: this after ``bwd_q_kernel`` (7 matmuls). Fused backward
  (``DQ`` > 0, FA2/FA3's scheme): after ``bwd_delta_kernel``, this kernel alone
  also adds dS k into an fp32 dq buffer with atomics (5 matmuls, no recompute
  of P and dP for dq), and a cast finishes dq.
  With BS = 0 (token lists; the deterministic backward) a program takes a tile of
  BN consecutive keys, and the inverse map gives each listed group a bit mask of
  which of the tile's keys it lists (``launch.build_token_inverse_map``).

Shape letters as in triton_fwd.py (T query length, TK key length; query-row
masks use T, key-row masks TK); lse is log2-domain, scores are multiplied
by qk_scale = softmax_scale * log2(e).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_fwd import _load_kv_tile, _num_steps


@triton.jit(do_not_specialize=["BH0"])  # a row offset: 0, then multiples of a chunk's rows (one compile for all)
def bwd_q_kernel(
    q, k, v, o, do, lse, delta, dq, dk32, dv32, idx, bits, cnt_ptr, fx_scale,
    T, TK, NG, KMAX, BH0, qk_scale, sm_scale,
    H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    EVEN_T: tl.constexpr, ATOMIC_KV: tl.constexpr, GB: tl.constexpr = 0,
):
    """GB > 0: packed token lists, as in the forward (rows an entry's mask leaves out get p = 0).
    BH0: the launch covers (batch, head) rows BH0 + program_id(1) of q, k, v, o, do, lse, delta, dq, dk32,
    dv32, while idx, bits and cnt_ptr hold only this launch's rows (row program_id(1)): the packed lists are
    built and consumed a few heads at a time."""
    i_m, i_bhl = tl.program_id(0), tl.program_id(1)
    i_bh = i_bhl + BH0
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_m // (G // BM)
    p_kv_base = (i_b * (H // HR) + i_h // HR).to(tl.int64) * TK * K
    p_q_base = i_bh.to(tl.int64) * T * K

    o_m = i_g * G + (i_m % (G // BM)) * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_m = o_m < T
    m_q = m_m[:, None] & (o_d[None, :] < K)
    p_qrows = p_q_base + o_m[:, None] * K + o_d[None, :]
    # [BM, BD]
    b_q = tl.load(q + p_qrows, mask=m_q, other=0.)
    b_do = tl.load(do + p_qrows, mask=m_q, other=0.)
    # [BM]; padded rows get lse=+inf so their p is exactly 0
    b_lse = tl.load(lse + i_bh.to(tl.int64) * T + o_m, mask=m_m, other=float("inf"))
    # delta = rowsum(o * do), computed here and stored for the dk/dv kernel launched after us
    b_o = tl.load(o + p_qrows, mask=m_q, other=0.).to(tl.float32)
    b_delta = tl.sum(b_o * b_do.to(tl.float32), 1)
    tl.store(delta + i_bh.to(tl.int64) * T + o_m, b_delta, mask=m_m)

    cnt = tl.load(cnt_ptr + i_bhl.to(tl.int64) * NG + i_g)  # [rows, NG] counts
    p_idx = idx + (i_bhl.to(tl.int64) * NG + i_g) * KMAX
    n_it = _num_steps(cnt, BN, BS)

    if ATOMIC_KV == 2:  # [B * Hkv, 2]: 2^e of dk (softmax scale folded in) and of dv
        p_fx = fx_scale + (i_b * (H // HR) + i_h // HR) * 2
        s_k = tl.load(p_fx) * sm_scale
        s_v = tl.load(p_fx + 1)
    if GB > 0:  # [BM]: each row's group within the packed group
        p_bits = bits + (i_bhl.to(tl.int64) * NG + i_g) * KMAX
        o_sub = (o_m - i_g * G) // GB
    b_dq = tl.zeros([BM, BD], tl.float32)
    for i_it in range(n_it):
        o_n, m_n, m_ld = _load_kv_tile(i_it, cnt, p_idx, TK, K, BD, BN, BS, EVEN_T)
        p_rows = p_kv_base + o_n[:, None] * K + o_d[None, :]
        # [BN, BD]
        b_k = tl.load(k + p_rows, mask=m_ld, other=0.)
        b_v = tl.load(v + p_rows, mask=m_ld, other=0.)
        # [BM, BN]
        b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale
        b_p = tl.exp2(b_s - b_lse[:, None])
        if BS == 0 or BN > BS or not EVEN_T:
            b_p = tl.where(m_n[None, :], b_p, 0.)
        if GB > 0:
            b_bits = tl.load(p_bits + i_it * BN + tl.arange(0, BN), mask=m_n, other=0).to(tl.int32)
            b_p = tl.where(((b_bits[None, :] >> o_sub[:, None]) & 1) != 0, b_p, 0.)
        b_dp = tl.dot(b_do, tl.trans(b_v))
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
        if ATOMIC_KV == 1:
            # [BN, BD]; fp32 scatter-add: several groups and GQA heads hit one key row
            b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
            b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q)
            tl.atomic_add(dv32 + p_rows, b_dv, mask=m_ld, sem="relaxed")
            tl.atomic_add(dk32 + p_rows, b_dk * sm_scale, mask=m_ld, sem="relaxed")
        if ATOMIC_KV == 2:
            # the same terms as fixed-point int64 (x * 2^e rounded): integer sums do not depend on their order
            b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
            b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q)
            tl.atomic_add(dv32 + p_rows, tl.floor(b_dv * s_v + 0.5).to(tl.int64), mask=m_ld, sem="relaxed")
            tl.atomic_add(dk32 + p_rows, tl.floor(b_dk * s_k + 0.5).to(tl.int64), mask=m_ld, sem="relaxed")
    tl.store(dq + p_qrows, (b_dq * sm_scale).to(dq.dtype.element_ty), mask=m_q)


@triton.jit
def bwd_delta_kernel(o, do, delta, T, K: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    """delta = rowsum(o * do) [B, H, T] fp32: the fused backward's only pre-pass."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_m = o_m < T
    m_q = m_m[:, None] & (o_d[None, :] < K)
    p_rows = i_bh.to(tl.int64) * T * K + o_m[:, None] * K + o_d[None, :]
    # [BM, BD]
    b_o = tl.load(o + p_rows, mask=m_q, other=0.).to(tl.float32)
    b_do = tl.load(do + p_rows, mask=m_q, other=0.).to(tl.float32)
    tl.store(delta + i_bh.to(tl.int64) * T + o_m, tl.sum(b_o * b_do, 1), mask=m_m)


@triton.jit
def bwd_kv_kernel(
    q, k, v, do, lse, delta, dk, dv, dq32, inv_ptr, inv_grp, inv_bits,
    T, TK, NKB, qk_scale, sm_scale,
    H: tl.constexpr, HR: tl.constexpr, K: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    DQ: tl.constexpr,
):
    """dk, dv of one key tile; with DQ > 0 also dq (the fused, 5-matmul backward).

    DQ = 0: dk/dv only (dq comes from bwd_q_kernel: 7 matmuls in all).
    DQ = 1: dq += dS k for every visited query tile, fp32 atomics into dq32.
    DQ = 2: the same through a TMA reduce-add (dq32 is a [B*H, T, K] descriptor).
    With DQ > 0 each program starts its walk at a rotated entry, so programs
    running side by side (neighbouring key tiles) add into different dq rows.
    BS = 0 (token lists, DQ = 0): NKB counts key tiles of BN tokens, and p is 0
    on the tile's keys an entry's bit mask (inv_bits) leaves out.
    """
    i_n, i_bhkv = tl.program_id(0), tl.program_id(1)
    HKV: tl.constexpr = H // HR
    i_b, i_hkv = i_bhkv // HKV, i_bhkv % HKV
    p_kv_base = i_bhkv.to(tl.int64) * TK * K
    if BS == 0:  # the inverse map is over tiles of BN keys
        i_kb = i_n
        o_n = i_n * BN + tl.arange(0, BN)
    else:
        i_kb = i_n // (BS // BN)
        o_n = i_kb * BS + (i_n % (BS // BN)) * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_n = o_n < TK
    m_kv = m_n[:, None] & (o_d[None, :] < K)
    p_rows = p_kv_base + o_n[:, None] * K + o_d[None, :]
    # [BN, BD]
    b_k = tl.load(k + p_rows, mask=m_kv, other=0.)
    b_v = tl.load(v + p_rows, mask=m_kv, other=0.)
    b_dk = tl.zeros([BN, BD], tl.float32)
    b_dv = tl.zeros([BN, BD], tl.float32)
    for i_hr in range(HR):
        i_bh = i_b * H + i_hkv * HR + i_hr
        p_q_base = i_bh.to(tl.int64) * T * K
        p_inv = inv_ptr + i_bh.to(tl.int64) * NKB + i_kb
        e_lo = tl.load(p_inv)
        e_hi = tl.load(p_inv + 1)
        # flat loop over (query group in the inverse list, query tile in the group)
        n_e = (e_hi - e_lo) * (G // BM)
        for i_j in range(n_e):
            if DQ > 0:
                i_e = e_lo * (G // BM) + (i_j + i_n) % n_e
            else:
                i_e = e_lo * (G // BM) + i_j
            i_g = tl.load(inv_grp + i_e // (G // BM))
            o_m = i_g * G + (i_e % (G // BM)) * BM + tl.arange(0, BM)
            m_m = o_m < T
            m_q = m_m[:, None] & (o_d[None, :] < K)
            p_qrows = p_q_base + o_m[:, None] * K + o_d[None, :]
            # [BM, BD]
            b_q = tl.load(q + p_qrows, mask=m_q, other=0.)
            b_do = tl.load(do + p_qrows, mask=m_q, other=0.)
            b_lse = tl.load(lse + i_bh.to(tl.int64) * T + o_m, mask=m_m, other=float("inf"))
            b_delta = tl.load(delta + i_bh.to(tl.int64) * T + o_m, mask=m_m, other=0.)
            # [BN, BM]: transposed scores, so dk/dv accumulate without transposing them
            b_st = tl.dot(b_k, tl.trans(b_q)) * qk_scale
            b_pt = tl.exp2(b_st - b_lse[None, :])
            if BS == 0:  # [BN]: the tile's keys on this group's list; the others get p = 0 (and so dS = 0)
                bits = tl.load(inv_bits + i_e // (G // BM))
                m_key = ((bits >> tl.arange(0, BN).to(tl.int64)) & 1) != 0
                b_pt = tl.where(m_key[:, None], b_pt, 0.)
            b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
            b_dpt = tl.dot(b_v, tl.trans(b_do))
            b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(b_q.dtype)
            b_dk += tl.dot(b_dst, b_q)
            if DQ > 0:
                # [BM, BD]; every key tile of the group's list adds here
                b_dq = tl.dot(tl.trans(b_dst), b_k) * sm_scale
                if DQ == 1:
                    tl.atomic_add(dq32 + p_qrows, b_dq, mask=m_q, sem="relaxed")
                else:
                    dq32.atomic_add([i_bh, i_g * G + (i_e % (G // BM)) * BM, 0], b_dq[None, :, :])
    tl.store(dk + p_rows, (b_dk * sm_scale).to(dk.dtype.element_ty), mask=m_kv)
    tl.store(dv + p_rows, b_dv.to(dv.dtype.element_ty), mask=m_kv)


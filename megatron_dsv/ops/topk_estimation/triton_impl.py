"""Triton backend: two kernels, same score definition and order as ``naive.py``.

``_tk_threshold``: per query group, the K-th best item's ordered score key by a
16-way search over the 32-bit key space (8 passes over the keys, each counting
items at or above 16 probes), plus the number of items strictly above it.
``_tk_write``: one ordered pass writing items above the threshold and the first
(K - above) items equal to it, lower index first; lists come out ascending.
Scores are recomputed in every pass (r is tiny), so memory is the output alone.
The kernels' ``S`` is the KEY length (k_lr's Sk, may differ from q_lr's Sq):
proxies are precomputed per query group, so the kernels never see Sq.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_problem
from .naive import group_proxies

__all__ = ["estimate_topk_triton"]

_NPROBE = 16
_NPASS = 9  # (17-way split) 8 passes shrink 2^32 to 1; one spare


@triton.jit
def _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items,
                 R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr):
    items = it0 + tl.arange(0, BN)
    valid = items < n_items
    if BS == 0:
        # [BG, BN]; sums in order d = 0..R-1 as the reference, with explicit fma: exact for
    # bf16/fp16 (products are exact), and the same instructions in both kernels for fp32
    # (left to itself the compiler may fuse mul+add differently in the two kernels)
        p0 = tl.load(Pb + offs_g * R, mask=mask_g, other=0.0).to(tl.float32)
        k0 = tl.load(Kb + items * R, mask=valid, other=0.0).to(tl.float32)
        s = p0[:, None] * k0[None, :]
        for d in tl.static_range(1, R):
            pd = tl.load(Pb + offs_g * R + d, mask=mask_g, other=0.0).to(tl.float32)
            kd = tl.load(Kb + items * R + d, mask=valid, other=0.0).to(tl.float32)
            s = tl.fma(tl.broadcast_to(pd[:, None], (BG, BN)), tl.broadcast_to(kd[None, :], (BG, BN)), s)
    else:
        toks = items[:, None] * BS + tl.arange(0, BS)[None, :]  # [BN, BS]
        tval = toks < S
        p0 = tl.load(Pb + offs_g * R, mask=mask_g, other=0.0).to(tl.float32)
        k0 = tl.load(Kb + toks * R, mask=tval, other=0.0).to(tl.float32)
        s3 = p0[:, None, None] * k0[None, :, :]  # [BG, BN, BS]
        for d in tl.static_range(1, R):
            pd = tl.load(Pb + offs_g * R + d, mask=mask_g, other=0.0).to(tl.float32)
            kd = tl.load(Kb + toks * R + d, mask=tval, other=0.0).to(tl.float32)
            s3 = tl.fma(tl.broadcast_to(pd[:, None, None], (BG, BN, BS)), tl.broadcast_to(kd[None, :, :], (BG, BN, BS)), s3)
        s3 = tl.where(tval[None, :, :], s3, float("-inf"))
        m = tl.max(s3, axis=2)
        if LSE:
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            s = m_safe + tl.log(tl.sum(tl.exp(s3 - m_safe[:, :, None]), axis=2))
        else:
            s = m
    s = s + 0.0  # -0.0 -> +0.0
    key = s.to(tl.int32, bitcast=True)
    key = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)  # monotone int32 key of the float
    return key, items, valid


@triton.jit
def _tk_threshold(P, Kp, Counts, Tout, GTout, S, n_items, NG,
                  R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                  NPROBE: tl.constexpr, NPASS: tl.constexpr):
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    Pb = P + bh.to(tl.int64) * NG * R
    Kb = Kp + bh.to(tl.int64) * S * R
    # invariant: count(key >= lo) >= K > count(key >= hi) = c_hi
    lo = tl.full([BG], -2147483648, tl.int64)
    hi = tl.full([BG], 2147483648, tl.int64)
    c_hi = tl.zeros([BG], tl.int32)
    m = (tl.arange(0, NPROBE) + 1).to(tl.int64)
    for _ in range(NPASS):
        probes = lo[:, None] + ((hi - lo)[:, None] * m[None, :]) // (NPROBE + 1)  # [BG, NPROBE]
        cnt = tl.zeros([BG, NPROBE], tl.int32)
        for it0 in range(0, n_items, BN):
            key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE)
            ge = (key.to(tl.int64)[:, :, None] >= probes[:, None, :]) & valid[None, :, None]  # [BG, BN, NPROBE]
            cnt += tl.sum(ge.to(tl.int32), axis=1)
        ok = cnt >= K
        new_lo = tl.max(tl.where(ok, probes, lo[:, None]), axis=1)
        new_hi = tl.min(tl.where(ok, hi[:, None], probes), axis=1)
        c_new = tl.max(tl.where(ok, -1, cnt), axis=1)
        c_hi = tl.where(new_hi < hi, c_new, c_hi)
        lo = new_lo
        hi = new_hi
    tl.store(Tout + bh * NG + offs_g, lo.to(tl.int32), mask=mask_g)
    tl.store(GTout + bh * NG + offs_g, c_hi, mask=mask_g)


@triton.jit
def _tk_write(P, Kp, Counts, Tin, GTin, Out, S, n_items, NG, KMAX,
              R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr):
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    Pb = P + bh.to(tl.int64) * NG * R
    Kb = Kp + bh.to(tl.int64) * S * R
    t = tl.load(Tin + bh * NG + offs_g, mask=mask_g, other=0)
    need_eq = K - tl.load(GTin + bh * NG + offs_g, mask=mask_g, other=0)
    o_rows = Out + (bh.to(tl.int64) * NG + offs_g) * KMAX  # [BG]
    run_sel = tl.zeros([BG], tl.int32)
    run_eq = tl.zeros([BG], tl.int32)
    for it0 in range(0, n_items, BN):
        key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE)
        ok = valid[None, :] & mask_g[:, None]
        gt = (key > t[:, None]) & ok
        eq = (key == t[:, None]) & ok
        eq_rank = run_eq[:, None] + tl.cumsum(eq.to(tl.int32), axis=1)
        sel = gt | (eq & (eq_rank <= need_eq[:, None]))
        pos = run_sel[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
        tl.store(o_rows[:, None] + pos, items[None, :], mask=sel)
        run_sel += tl.sum(sel.to(tl.int32), axis=1)
        run_eq += tl.sum(eq.to(tl.int32), axis=1)


def estimate_topk_triton(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max",
                         BG: int = 16, BN: int = 0):
    """Same contract as :func:`estimate_topk`, on Triton (GPU, or CPU under TRITON_INTERPRET=1).
    q_lr [B, H, Sq, r], k_lr [B, H, Sk, r]: Sk may differ from Sq."""
    P = check_problem(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)
    out = torch.full((P.B, P.H, P.num_groups, P.kmax), -1, dtype=torch.int32, device=q_lr.device)
    if P.kmax == 0:
        return out, P.counts
    proxies = group_proxies(q_lr.contiguous(), group_size, proxy).contiguous()  # [B, H, NG, r]
    k = k_lr.contiguous()
    counts = P.counts.contiguous()
    thr = torch.empty(P.B, P.H, P.num_groups, dtype=torch.int32, device=q_lr.device)
    above = torch.empty_like(thr)
    BN = BN or (64 if block_size == 0 else 16)
    grid = (triton.cdiv(P.num_groups, BG), P.B * P.H)
    meta = dict(R=P.r, BG=BG, BN=BN, BS=block_size, LSE=block_score == "lse")
    _tk_threshold[grid](proxies, k, counts, thr, above, P.Sk, P.num_items, P.num_groups,
                        NPROBE=_NPROBE, NPASS=_NPASS, **meta)
    _tk_write[grid](proxies, k, counts, thr, above, out, P.Sk, P.num_items, P.num_groups, P.kmax, **meta)
    return out, counts

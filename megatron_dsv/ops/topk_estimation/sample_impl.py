"""Method "sample" of the Triton top-k: each group's threshold from a sampled window, in three kernels.

1. :func:`_ss_thresholds` (16-group tiles): a sample of the items (one per stratum of F) into the group's buffer row,
   and from it the sampled keys of ranks m_lo and m_hi, a window [t_lo, t_hi] expected to hold the K-th best key;
2. :func:`_ss_window` (``pass_tile``'s tile, few registers): ONE pass over all items, the exact count a_hi of keys
   above t_hi and the window's keys appended to the buffer row (``Run`` of them);
3. :func:`_ss_kth` (16-group tiles): the K-th best key overall, the (K - a_hi)-th best of the window, and its count
   above; the groups whose window missed are flagged for the exact search (``triton_impl._sliced_fallback`` over
   more than ``slice_items`` items, else ``triton_impl._tk_threshold``).
The searches in the buffer (steps 1 and 3) finish on the keys left in range, copied out
(``triton_impl._kth_compacting``; ``SMALL_KEYS`` slots a group for the sample's, :func:`window_slots` for the
window's).
``triton_impl._tk_write``'s ordered pass then writes the lists (on ``pass_tile``'s tile too).

Until run 27 one fused kernel ran the three steps: the searches' ``[BG, NPROBE]`` counts took 236 registers a thread
(16 groups x 64 tokens, sm_90a), one 8-warp program an SM, and its pass over every item was stuck on 16-group tiles
(wider ones spilled). Split, the pass takes 79-177 registers on tiles of 32-128 groups: run 27 (H100, G = 32, token
lists, 90%, bf16) timed the call 0.87 / 0.75 / 0.65 / 0.64x the fused kernel's at 16K / 32K / 64K / 128K
(``NOTES_topk_estimation.md``), the same lists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scoring import _item_scores, _scores_at
from .triton_impl import _kth_compacting, _last_column, _scan_carrying, _store_i32

__all__ = ["run_sample", "SMALL_KEYS", "window_slots"]

# the sample's two searches copy a row's keys out once its range holds at most this many (``_kth_compacting``)
SMALL_KEYS = 512


def window_slots(cap: int) -> int:
    """The copied slots of the search in the window (``_kth_compacting``'s SMALL in ``_ss_kth``): at least
    ``SMALL_KEYS``, about an eighth of the buffer's ``cap`` (a power of two, at most 4096), so that one narrowing
    pass over a window's ~cap / 1.5 keys (17 ranges) leaves few enough in every row of a tile. Run 28 (H100, G = 32):
    with 512 at 128K (windows of ~10.4K keys, ~610 a range after one pass) the search took three passes over the
    buffer, 8.6 ms, against two and 1.9 ms at 64K. Memory: 4 bytes a slot a group (128K tokens, G = 32, H = 16: 2048
    slots, 512 MB beside the buffer's 4.1 GB)."""
    return min(4096, max(SMALL_KEYS, 1 << max(0, cap // 8 - 1).bit_length()))


@triton.jit
def _sample_thresholds(Pb, Kb, K, offs_g, mask_g, b_rows, Buf, Small, s_rows, S, n_items, CAP, F, NSV, Z,
                       R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                       NPROBE: tl.constexpr, DOT: tl.constexpr, PACK: tl.constexpr, SMALL: tl.constexpr):
    """Step 1 of method "sample" (0 < K < n_items): the keys of item j*F + hash(j) % F of each stratum j (NSV
    strata) into the group's buffer row, then on them (no rescoring) the sampled keys of rank m_lo ~ Texp + Z
    sqrt(Texp) (``t_lo``) and m_hi ~ Texp - Z sqrt(Texp) (``t_hi``), Texp = K * NSV / n_items sampled items expected
    at or above the K-th best (16-probe searches on the buffered keys). Returns int32 ``(t_lo, t_hi)`` [BG]."""
    for j0 in range(0, NSV, BN):
        js = j0 + tl.arange(0, BN)
        jv = js < NSV
        start = js.to(tl.int64) * F
        ln = tl.maximum(tl.minimum(n_items - start, F), 1)
        hsh = ((js.to(tl.int64) * 1779033703) & 0x7FFFFFFF) >> 7  # scatter within the stratum
        items = tl.where(jv, start + hsh % ln, 0)
        key = _scores_at(Pb, Kb, offs_g, mask_g, items, jv, S, R, BG, BN, BS, LSE, DOT)
        tl.store(Buf + b_rows[:, None] + js[None, :], key, mask=mask_g[:, None] & (jv & (js < CAP))[None, :])
    tl.debug_barrier()  # the buffer rows written above are read back by other threads below
    texp = K.to(tl.float32) * NSV / n_items
    marg = Z * tl.sqrt(texp)
    if F == 1:  # the sample is every item: exact ranks
        m_lo = K
        m_hi = K - 1
    else:
        m_lo = tl.minimum((texp + marg).to(tl.int32) + 2, NSV)
        m_hi = tl.maximum((texp - marg).to(tl.int32) - 1, 0)
    n_s = tl.where(mask_g, NSV, 0)
    full_lo = tl.full([BG], -2147483648, tl.int64)
    full_hi = tl.full([BG], 2147483648, tl.int64)
    none = tl.zeros([BG], tl.int32)
    lo_l, _ = _kth_compacting(Buf, b_rows, n_s, full_lo, full_hi, n_s, none, none[:, None] + m_lo, Small, s_rows,
                              SMALL, BN, NPROBE, PACK)
    lo_h, _ = _kth_compacting(Buf, b_rows, n_s, full_lo, full_hi, n_s, none, none[:, None] + m_hi, Small, s_rows,
                              SMALL, BN, NPROBE, PACK)
    return lo_l.to(tl.int32), lo_h.to(tl.int32)  # t_hi: 2^31 - 1 when m_hi == 0


@triton.jit
def _window_pass(Pb, Kb, offs_g, mask_g, b_rows, Buf, t_lo, t_hi, S, n_items, CAP,
                 R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                 DOT: tl.constexpr, SCAN_STORE: tl.constexpr = 0):
    """Step 2 of method "sample", the one pass over all items: the exact count of keys above ``t_hi`` and the keys of
    the window [``t_lo``, ``t_hi``] appended to the group's buffer row (those past ``CAP`` counted, not stored).
    ``SCAN_STORE`` as ``triton_impl._tk_write``'s. Returns int32 ``(a_hi, run)`` [BG], ``run`` the window's keys."""
    run = tl.zeros([BG], tl.int32)
    a_hi = tl.zeros([BG], tl.int32)
    for it0 in range(0, n_items, BN):
        key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE, DOT)
        ok = valid[None, :] & mask_g[:, None]
        # one scan and one sum count both: the window's keys in the low 16 bits, those above it in the high ones
        # (a tile row holds BN < 2^15 items)
        both = (((key >= t_lo[:, None]) & (key <= t_hi[:, None]) & ok).to(tl.int32)
                + (((key > t_hi[:, None]) & ok).to(tl.int32) << 16))
        if SCAN_STORE:
            pre, key = _scan_carrying(both, key)
            ok = ((it0 + tl.arange(0, BN)) < n_items)[None, :] & mask_g[:, None]  # anew, in the scan's layout
        else:
            pre = tl.cumsum(both, axis=1)
        pos = run[:, None] + (pre & 0xFFFF) - 1
        cand = (key >= t_lo[:, None]) & (key <= t_hi[:, None]) & ok
        _store_i32(Buf + b_rows[:, None] + pos, key, cand & (pos < CAP), SCAN_STORE == 2)
        if SCAN_STORE:
            tot = _last_column(pre, BN)
        else:
            tot = tl.sum(both, axis=1)
        run += tot & 0xFFFF
        a_hi += tot >> 16
    return a_hi, run


@triton.jit
def _window_kth(K, mask_g, b_rows, Buf, Small, s_rows, t_lo, t_hi, a_hi, run, CAP, BG: tl.constexpr,
                BN: tl.constexpr, NPROBE: tl.constexpr, PACK: tl.constexpr, SMALL: tl.constexpr):
    """Step 3 of method "sample": the K-th best key overall is the (K - a_hi)-th best of the window, a 16-probe
    search on the buffer between ``t_lo`` and ``t_hi`` + 1; groups whose window missed (a_hi >= K, fewer than K
    items at or above t_lo, or more than CAP in the window) are ``bad``. Returns ``(t_out, gt_out, bad)`` [BG]: the
    threshold and the count above it for :func:`_tk_write`."""
    good = mask_g & (a_hi < K) & (a_hi + run >= K) & (run <= CAP)
    lo = t_lo.to(tl.int64)
    hi = tl.where(good, t_hi.to(tl.int64) + 1, lo + 1)  # failed groups: nothing to search
    n_w = tl.where(good, run, 0)
    lo, c_hi = _kth_compacting(Buf, b_rows, n_w, lo, hi, n_w, tl.zeros([BG], tl.int32), (K - a_hi)[:, None], Small,
                               s_rows, SMALL, BN, NPROBE, PACK)
    return lo.to(tl.int32), a_hi + c_hi, mask_g & ~good


@triton.jit
def _tile_rows(Counts, NG, BG: tl.constexpr):
    """A program's (b, h) ``bh`` (grid axis 1), its budget ``K`` and its BG groups (grid axis 0): ``offs_g``, the
    ``mask_g`` of those that exist, their ``rows`` in the [B * H * NG] outputs."""
    bh = tl.program_id(1)
    offs_g = tl.program_id(0) * BG + tl.arange(0, BG)
    return bh, tl.load(Counts + bh), offs_g, offs_g < NG, bh.to(tl.int64) * NG + offs_g


@triton.jit
def _head_inputs(P, Kp, bh, NG, S, R: tl.constexpr):
    """The (b, h) head's proxies ``[NG, R]`` and keys ``[S, R]``."""
    return P + bh.to(tl.int64) * NG * R, Kp + bh.to(tl.int64) * S * R


@triton.jit
def _ss_thresholds(P, Kp, Counts, Tlo, Thi, Buf, Small, S, n_items, NG, CAP, F, NSV, Z,
                   R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                   NPROBE: tl.constexpr, SMALL: tl.constexpr, DOT: tl.constexpr = False, PACK: tl.constexpr = 1):
    """Step 1 (groups with 0 < K < n_items): :func:`_sample_thresholds`' window into ``Tlo``, ``Thi`` (``Small``:
    SMALL slots a group for its searches' last steps)."""
    bh, K, offs_g, mask_g, rows = _tile_rows(Counts, NG, BG)
    if (K > 0) & (K < n_items):
        Pb, Kb = _head_inputs(P, Kp, bh, NG, S, R)
        t_lo, t_hi = _sample_thresholds(Pb, Kb, K, offs_g, mask_g, rows * CAP, Buf, Small, rows * SMALL, S, n_items,
                                        CAP, F, NSV, Z, R, BG, BN, BS, LSE, NPROBE, DOT, PACK, SMALL)
        tl.store(Tlo + rows, t_lo, mask=mask_g)
        tl.store(Thi + rows, t_hi, mask=mask_g)


@triton.jit
def _ss_window(P, Kp, Counts, Tlo, Thi, Buf, Ahi, Run, S, n_items, NG, CAP,
               R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
               DOT: tl.constexpr = False, PACK: tl.constexpr = 1, SCAN_STORE: tl.constexpr = 0):
    """Step 2 (groups with 0 < K < n_items): :func:`_window_pass` over every item, its counts into ``Ahi``
    and ``Run``. ``PACK`` is unused (the launch's shared settings)."""
    bh, K, offs_g, mask_g, rows = _tile_rows(Counts, NG, BG)
    if (K > 0) & (K < n_items):
        Pb, Kb = _head_inputs(P, Kp, bh, NG, S, R)
        t_lo = tl.load(Tlo + rows, mask=mask_g, other=0)
        t_hi = tl.load(Thi + rows, mask=mask_g, other=0)
        a_hi, run = _window_pass(Pb, Kb, offs_g, mask_g, rows * CAP, Buf, t_lo, t_hi, S, n_items, CAP, R, BG, BN,
                                 BS, LSE, DOT, SCAN_STORE)
        tl.store(Ahi + rows, a_hi, mask=mask_g)
        tl.store(Run + rows, run, mask=mask_g)


@triton.jit
def _ss_kth(Counts, Tlo, Thi, Ahi, Run, Buf, Small, Tout, GTout, Flags, n_items, NG, CAP,
            BG: tl.constexpr, BN: tl.constexpr, NPROBE: tl.constexpr, SMALL: tl.constexpr, PACK: tl.constexpr = 1):
    """Step 3: :func:`_window_kth`'s threshold ``Tout`` and count above it ``GTout`` for ``_tk_write``, or ``Flags``
    = 1 where the window missed; groups with K = 0 or K >= n_items get thresholds that select nothing (``Tout``
    2^31 - 1) or everything (``Tout`` -2^31, all above)."""
    bh, K, offs_g, mask_g, rows = _tile_rows(Counts, NG, BG)
    t_out = tl.full([BG], 2147483647, tl.int32)  # K = 0: nothing is above or equal
    gt_out = tl.zeros([BG], tl.int32)
    bad = offs_g < 0
    if K >= n_items:  # every item: nothing equals the lowest key, all are above it
        t_out = tl.full([BG], -2147483648, tl.int32)
    elif K > 0:
        t_lo = tl.load(Tlo + rows, mask=mask_g, other=0)
        t_hi = tl.load(Thi + rows, mask=mask_g, other=0)
        a_hi = tl.load(Ahi + rows, mask=mask_g, other=0)
        run = tl.load(Run + rows, mask=mask_g, other=0)
        t_out, gt_out, bad = _window_kth(K, mask_g, rows * CAP, Buf, Small, rows * SMALL, t_lo, t_hi, a_hi, run,
                                         CAP, BG, BN, NPROBE, PACK, SMALL)
    tl.store(Tout + rows, t_out, mask=mask_g & ~bad)
    tl.store(GTout + rows, gt_out, mask=mask_g & ~bad)
    tl.store(Flags + rows, bad.to(tl.int32), mask=mask_g)


def run_sample(P, proxies, k, counts, thr, above, flags, buf, cap: int, F: int, nsv: int, z: float,
               meta: dict, pass_meta: dict, nprobe: int, phase, store_mode: int = 0) -> None:
    """Steps 1-3 on ``P`` (``common.check_problem``'s problem): ``meta`` the launch settings of steps 1 and 3 (the
    sample's tile), ``pass_meta`` those of step 2; ``thr``, ``above``, ``flags`` ``[B, H, NG]`` int32 receive the
    thresholds, the counts above them and the flags (what ``_tk_write`` and the fallback read); ``buf`` the groups'
    rows of ``cap`` keys; ``phase(name)`` a context that times a step (``triton_impl._phase``: ``ms_sample``,
    ``ms_window``, ``ms_window_kth``); ``store_mode``: the window pass's ``SCAN_STORE``
    (``triton_impl.scan_store_mode``)."""
    rows = P.B * P.H * P.num_groups
    t_lo, t_hi, a_hi, run = (torch.empty(rows, dtype=torch.int32, device=proxies.device) for _ in range(4))
    w_slots = window_slots(cap)
    small = torch.empty(rows * max(SMALL_KEYS, w_slots), dtype=torch.int32, device=proxies.device)
    grid = (triton.cdiv(P.num_groups, meta["BG"]), P.B * P.H)
    with phase("sample"):
        _ss_thresholds[grid](proxies, k, counts, t_lo, t_hi, buf, small, P.Sk, P.num_items, P.num_groups, cap, F, nsv,
                             float(z), NPROBE=nprobe, SMALL=SMALL_KEYS, **meta)
    with phase("window"):
        _ss_window[(triton.cdiv(P.num_groups, pass_meta["BG"]), P.B * P.H)](
            proxies, k, counts, t_lo, t_hi, buf, a_hi, run, P.Sk, P.num_items, P.num_groups, cap,
            SCAN_STORE=store_mode, **pass_meta)
    narrow = {n: meta[n] for n in ("BG", "BN", "PACK", "num_warps")}
    with phase("window_kth"):
        _ss_kth[grid](counts, t_lo, t_hi, a_hi, run, buf, small, thr, above, flags, P.num_items, P.num_groups, cap,
                      NPROBE=nprobe, SMALL=w_slots, **narrow)

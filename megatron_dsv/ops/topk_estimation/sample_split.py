"""Method "sample" as three kernels, so that its pass over every item runs on a tile of its own.

The fused ``triton_impl._tk_sample`` holds the sampling, the searches on the buffer and the pass over all items in one
program: the searches' ``[BG, NPROBE]`` counts take its registers (236 a thread at 16 groups x 64 tokens on sm_90a,
Triton 3.9; 32 groups already spill), so its pass over all items, the one that scores every key, is stuck on 16-group
tiles. Split at the same three steps, the same jit functions (the same thresholds, windows and lists bit for bit):

1. :func:`_ss_thresholds` (the sample's tile): the sampled keys into the group's buffer row, then the sampled
   keys of ranks m_lo and m_hi (``Tlo``, ``Thi``);
2. :func:`_ss_window` (``pass_tile``'s tile, few registers): ONE pass over all items counting the keys above
   ``Thi`` (``Ahi``) and appending the window ``[Tlo, Thi]`` to the buffer row (``Run`` of them);
3. :func:`_ss_kth` (the sample's tile): the groups whose window missed are flagged for the search kernel, the
   others get their threshold (``Tout``) and the count above it (``GTout``) from a search on the window.

:func:`run_sample_split` launches them; ``estimate_topk_triton(..., pass_tile=(BG, BN))`` takes this path (the write
pass then runs on that tile too). Not the default: timing first (``NOTES_topk_estimation.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_impl import _sample_thresholds, _window_kth, _window_pass

__all__ = ["run_sample_split"]


@triton.jit
def _ss_thresholds(P, Kp, Counts, Tlo, Thi, Buf, S, n_items, NG, CAP, F, NSV, Z,
                   R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                   NPROBE: tl.constexpr, DOT: tl.constexpr = False, PACK: tl.constexpr = 1):
    """Step 1 (groups with 0 < K < n_items): ``triton_impl._sample_thresholds``' window into ``Tlo``, ``Thi``."""
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    rows = bh.to(tl.int64) * NG + offs_g
    if (K > 0) & (K < n_items):
        Pb = P + bh.to(tl.int64) * NG * R
        Kb = Kp + bh.to(tl.int64) * S * R
        t_lo, t_hi = _sample_thresholds(Pb, Kb, K, offs_g, mask_g, rows * CAP, Buf, S, n_items, CAP, F, NSV, Z, R,
                                        BG, BN, BS, LSE, NPROBE, DOT, PACK)
        tl.store(Tlo + rows, t_lo, mask=mask_g)
        tl.store(Thi + rows, t_hi, mask=mask_g)


@triton.jit
def _ss_window(P, Kp, Counts, Tlo, Thi, Buf, Ahi, Run, S, n_items, NG, CAP,
               R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
               DOT: tl.constexpr = False, PACK: tl.constexpr = 1):
    """Step 2 (groups with 0 < K < n_items): ``triton_impl._window_pass`` over every item, its counts into ``Ahi``
    and ``Run``. ``PACK`` is unused (the launch's shared settings)."""
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    rows = bh.to(tl.int64) * NG + offs_g
    if (K > 0) & (K < n_items):
        Pb = P + bh.to(tl.int64) * NG * R
        Kb = Kp + bh.to(tl.int64) * S * R
        t_lo = tl.load(Tlo + rows, mask=mask_g, other=0)
        t_hi = tl.load(Thi + rows, mask=mask_g, other=0)
        a_hi, run = _window_pass(Pb, Kb, offs_g, mask_g, rows * CAP, Buf, t_lo, t_hi, S, n_items, CAP, R, BG, BN,
                                 BS, LSE, DOT)
        tl.store(Ahi + rows, a_hi, mask=mask_g)
        tl.store(Run + rows, run, mask=mask_g)


@triton.jit
def _ss_kth(Counts, Tlo, Thi, Ahi, Run, Buf, Tout, GTout, Flags, n_items, NG, CAP,
            BG: tl.constexpr, BN: tl.constexpr, NPROBE: tl.constexpr, PACK: tl.constexpr = 1):
    """Step 3: ``triton_impl._window_kth``'s threshold ``Tout`` and count above it ``GTout``, or ``Flags`` = 1 where
    the window missed; groups with K = 0 or K >= n_items get thresholds that select nothing or everything, as
    ``_tk_sample``'s."""
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    rows = bh.to(tl.int64) * NG + offs_g
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
        t_out, gt_out, bad = _window_kth(K, mask_g, rows * CAP, Buf, t_lo, t_hi, a_hi, run, CAP, BG, BN, NPROBE,
                                         PACK)
    tl.store(Tout + rows, t_out, mask=mask_g & ~bad)
    tl.store(GTout + rows, gt_out, mask=mask_g & ~bad)
    tl.store(Flags + rows, bad.to(tl.int32), mask=mask_g)


def run_sample_split(P, proxies, k, counts, thr, above, flags, buf, cap: int, F: int, nsv: int, z: float,
                     meta: dict, pass_meta: dict, nprobe: int, phase) -> None:
    """Steps 1-3 on ``P`` (``common.check_problem``'s problem): ``meta`` the launch settings of steps 1 and 3 (the
    sample's tile), ``pass_meta`` those of step 2; ``thr``, ``above``, ``flags`` ``[B, H, NG]`` int32 receive what
    ``_tk_sample`` writes; ``buf`` the groups' rows of ``cap`` keys; ``phase(name)`` a context that times a step
    (``triton_impl._phase``: ``ms_sample``, ``ms_window``, ``ms_window_kth``)."""
    rows = P.B * P.H * P.num_groups
    t_lo, t_hi, a_hi, run = (torch.empty(rows, dtype=torch.int32, device=proxies.device) for _ in range(4))
    grid = (triton.cdiv(P.num_groups, meta["BG"]), P.B * P.H)
    with phase("sample"):
        _ss_thresholds[grid](proxies, k, counts, t_lo, t_hi, buf, P.Sk, P.num_items, P.num_groups, cap, F, nsv,
                             float(z), NPROBE=nprobe, **meta)
    with phase("window"):
        _ss_window[(triton.cdiv(P.num_groups, pass_meta["BG"]), P.B * P.H)](
            proxies, k, counts, t_lo, t_hi, buf, a_hi, run, P.Sk, P.num_items, P.num_groups, cap, **pass_meta)
    narrow = {n: meta[n] for n in ("BG", "BN", "PACK", "num_warps")}
    with phase("window_kth"):
        _ss_kth[grid](counts, t_lo, t_hi, a_hi, run, buf, thr, above, flags, P.num_items, P.num_groups, cap,
                      NPROBE=nprobe, **narrow)

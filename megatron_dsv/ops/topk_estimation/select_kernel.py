"""The selection of methods "keys" and "gemm" in ONE Triton launch per chunk of query groups.

:func:`select_rows_into` writes, for every row (bh, g) of a chunk, the ``counts[bh]`` items of highest
ordered int32 key (ties: lower index first), ascending, then -1 up to the output's width: the lists of
:func:`keys_impl._select_from_keys` (its torch twin, the reference), bit for bit. Its source is either the
int32 keys of method "keys" or the float scores of method "gemm" (the batched product's float32 or float64
output, ``[BH, n, Sk]``): the kernel then takes each block's max of the scores (float64 rounded to float32
first, as torch's ``.float()``; the partial last block holds the tokens left), reads -0.0 as +0.0 and turns
the float into its ordered key, so the chunk's post-product work is this one launch instead of ~30 torch ops
(the host-bound H200 step spent ~1.3 ms a layer on them). Forced items get the top key (or the bottom key
with ``forced_extra``, whose lists are then the union of the forced and the chosen items, with their counts,
as :func:`common.forced_union`).

Per row (one program): the row's keys stay in registers (``NB = next_pow2(n_items)`` of them, at most
:data:`MAX_ITEMS`; longer rows keep the torch path); the ``count``-th best key ``t`` by a 32-step bisection
of the int32 range (each step one count of the keys at or above the midpoint); the chosen items are those
above ``t`` and the first ``count - above`` equal to it by ascending index (a prefix sum), compacted in
ascending order by a second prefix sum and a scattered store.

Bitwise caveat: NaN scores (none from finite inputs) may order differently from torch's ``amax``, which
propagates them. Log-sum-exp blocks are not reduced here: Triton's ``exp``/``log`` and summation order differ
from torch's in the last bits, so method "gemm" with ``block_score="lse"`` reduces in torch and hands the
block scores to this kernel (``block_size`` 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ITEMS", "fits", "select_rows_into", "select_from_keys_triton"]

MAX_ITEMS = 8192  # items of one row held in registers by one program; longer rows keep the torch selection
_TILE = 4096  # elements of one [items, tokens] tile of the block reduction (registers per program)


def fits(n_items: int) -> bool:
    """Whether a row of ``n_items`` items is selected by the kernel (else the torch path)."""
    return 1 <= n_items <= MAX_ITEMS


@triton.jit
def _block_keys(p_row, o_i, m_i, Sk, NB: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr):
    """Ordered int32 keys [NB] of the items ``o_i``: each block's max over its tokens ``[i * BS, i * BS + BS)``
    below ``Sk`` (float64 scores rounded to float32 first), -0.0 read as +0.0."""
    b_max = tl.full([NB], float("-inf"), tl.float32)
    for t0 in range(0, BS, TB):
        o_t = o_i[:, None] * BS + t0 + tl.arange(0, TB)[None, :]  # [NB, TB]
        b_s = tl.load(p_row + o_t, mask=m_i[:, None] & (o_t < Sk), other=float("-inf")).to(tl.float32)
        b_max = tl.maximum(b_max, tl.max(b_s, axis=1))
    bits = b_max.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> +0.0 on the bits (no `x + 0.0` to be folded)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone int32 key of the float


@triton.jit
def _forced_items(p_f, stride_ff, o_i, F, NB: tl.constexpr, FB: tl.constexpr):
    """Bool [NB]: whether item ``o_i`` is one of the row's ``F`` forced ids (int64, -1 padded)."""
    b_hit = o_i < 0
    for f0 in range(0, F, FB):
        o_f = f0 + tl.arange(0, FB)
        b_f = tl.load(p_f + o_f * stride_ff, mask=o_f < F, other=-1)
        b_hit = b_hit | (tl.max((o_i[:, None] == b_f[None, :]).to(tl.int32), axis=1) > 0)  # [NB, FB] -> [NB]
    return b_hit


@triton.jit
def _top_count(b_key, m_i, K, LOG_P: tl.constexpr):
    """Bool [NB]: the ``K`` valid items of highest key, ties by lower index (K may be 0). The K-th best key by
    a radix search of the int32 range, LOG_P bits a pass: P - 1 probes ``lo + j * step`` (j = 1..P-1), counted
    at once; the counts fall with j, so the probes with count >= K are j = 1..J and lo moves J steps."""
    P: tl.constexpr = 1 << LOG_P
    o_p = tl.arange(0, P) + 1
    m_p = o_p < P
    # invariant: count(key >= lo) >= K and count(key >= lo + P * step) < K (K >= 1); the last pass has step 1,
    # which leaves lo the K-th best key (2^31 - 1 when K is 0: no item above it)
    lo = tl.full([], -2147483648, tl.int64)
    step = tl.full([], 1 << (32 - LOG_P), tl.int64)
    for _ in range(32 // LOG_P):
        b_pr = (lo + o_p.to(tl.int64) * step).to(tl.int32)  # [P] inside (lo, lo + P * step): int32s
        b_c = tl.sum((m_i[:, None] & (b_key[:, None] >= b_pr[None, :])).to(tl.int32), axis=0)  # [NB, P] -> [P]
        lo = lo + tl.sum(((b_c >= K) & m_p).to(tl.int64), axis=0) * step
        step = step >> LOG_P
    t = lo.to(tl.int32)
    gt = m_i & (b_key > t)
    eq = m_i & (b_key == t)
    need = K - tl.sum(gt.to(tl.int32), axis=0)
    return gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))


@triton.jit(do_not_specialize=["g0"])  # one compile for every chunk of the loop
def _select_rows(Src, Counts, Forced, Out, GroupCounts, n_items, Sk, NG, g0, F, W,
                 stride_sb, stride_sg, stride_fg, stride_ff,
                 NB: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr, FB: tl.constexpr,
                 LOG_P: tl.constexpr, FROM_SCORES: tl.constexpr, FORCED: tl.constexpr):
    """One program = row (g, bh) of the chunk: Src's row (int32 keys [n_items], or scores [Sk] reduced over
    blocks of BS tokens), the forced items (FORCED 1: top key; 2: bottom key, then joined to the list), the
    Counts[bh] best items written ascending to Out's row g0 + g of width W, then -1 (FORCED 2: the list's
    length to GroupCounts)."""
    i_g = tl.program_id(0)
    i_bh = tl.program_id(1)
    K = tl.load(Counts + i_bh)
    o_i = tl.arange(0, NB)
    m_i = o_i < n_items
    p_row = Src + i_bh.to(tl.int64) * stride_sb + i_g.to(tl.int64) * stride_sg
    if FROM_SCORES:
        b_key = _block_keys(p_row, o_i, m_i, Sk, NB, BS, TB)
    else:
        b_key = tl.load(p_row + o_i, mask=m_i, other=0)
    m_forced = o_i < 0
    if FORCED != 0:
        m_forced = _forced_items(Forced + i_g.to(tl.int64) * stride_fg, stride_ff, o_i, F, NB, FB)
        b_key = tl.where(m_forced, 2147483647 if FORCED == 1 else -2147483648, b_key)
    m_sel = _top_count(b_key, m_i, K, LOG_P)
    if FORCED == 2:
        m_sel = m_sel | m_forced
    n_sel = tl.sum(m_sel.to(tl.int32), axis=0)
    row = i_bh.to(tl.int64) * NG + g0 + i_g
    p_out = Out + row * W
    tl.store(p_out + tl.cumsum(m_sel.to(tl.int32), axis=0) - 1, o_i, mask=m_sel)
    for w0 in range(0, W, NB):
        o_w = w0 + o_i
        tl.store(p_out + o_w, tl.full([NB], -1, tl.int32), mask=(o_w >= n_sel) & (o_w < W))
    if FORCED == 2:
        tl.store(GroupCounts + row, n_sel)


def _num_warps(NB: int) -> int:
    """Warps of a program holding NB keys: about 8 keys a thread, 4 to 16 warps."""
    return max(4, min(16, NB // 256))


def _log_probes(NB: int) -> int:
    """Bits of the search a pass (2^bits - 1 probes, 32 / bits passes): fewer passes (each ends in a block-wide
    reduction) while the [NB, probes] compare tile stays about 32 elements a thread."""
    return 4 if NB <= 256 else 2 if NB <= 2048 else 1


def select_rows_into(out: torch.Tensor, src: torch.Tensor, counts: torch.Tensor, g0: int, n_items: int,
                     block_size: int = 1, forced: torch.Tensor | None = None, forced_extra: bool = False,
                     group_counts: torch.Tensor | None = None) -> None:
    """Rows ``[g0, g0 + n)`` of ``out`` (int32 ``[BH, NG, W]``, contiguous) from one launch.

    ``src``: int32 ordered keys ``[BH, n, n_items]``, or float32/float64 scores ``[BH, n, Sk]`` whose items are
    blocks of ``block_size`` tokens (1: a score per item; the last block holds what is left: n_items =
    ceil(Sk / block_size)); its last dim contiguous. ``counts`` int32 ``[BH]`` (each at most n_items, and at
    most W). ``forced`` int64 ``[n, F]`` (-1 padded, shared by every bh; any strides): ranked first, or with
    ``forced_extra`` ranked last then joined to each list, the list lengths going to ``group_counts`` (int32
    ``[BH, NG]``, contiguous). W must hold every list (kmax, or F + kmax with ``forced_extra``).
    """
    BH, n, L = src.shape
    if not fits(n_items):
        raise ValueError(f"select_rows_into: `n_items` must be in [1, {MAX_ITEMS}], got {n_items}")
    if src.dtype == torch.int32:
        if L != n_items or block_size != 1:
            raise ValueError(f"select_rows_into: int32 keys `src` must be [BH, n, n_items={n_items}] with "
                             f"block_size 1, got {tuple(src.shape)}, block_size {block_size}")
    elif src.dtype in (torch.float32, torch.float64):
        if -(-L // block_size) != n_items:
            raise ValueError(f"select_rows_into: scores `src` {tuple(src.shape)} in blocks of {block_size} give "
                             f"{-(-L // block_size)} items, not n_items={n_items}")
    else:
        raise ValueError(f"select_rows_into: `src` must be int32 keys or float32/float64 scores, got {src.dtype}")
    if src.stride(-1) != 1:
        raise ValueError("select_rows_into: `src` needs a contiguous last dim")
    if out.dtype != torch.int32 or out.dim() != 3 or out.shape[0] != BH or not out.is_contiguous() \
            or g0 + n > out.shape[1]:
        raise ValueError(f"select_rows_into: `out` must be contiguous int32 [BH={BH}, >= {g0 + n}, W], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if forced_extra and (forced is None or group_counts is None):
        raise ValueError("select_rows_into: `forced_extra` needs `forced` and `group_counts`")
    if forced is not None and (forced.dtype != torch.int64 or forced.dim() != 2 or forced.shape[0] != n):
        raise ValueError(f"select_rows_into: `forced` must be int64 [n={n}, F], got {forced.dtype} "
                         f"{tuple(forced.shape)}")
    if n == 0:
        return
    NB = triton.next_power_of_2(n_items)
    bs = block_size if src.dtype != torch.int32 else 1
    F = 0 if forced is None else forced.shape[1]
    fr = forced if forced is not None else counts  # a placeholder pointer when nothing is forced
    gc = group_counts if group_counts is not None else counts
    _select_rows[(n, BH)](
        src, counts, fr, out, gc, n_items, L, out.shape[1], g0, F, out.shape[2],
        src.stride(0), src.stride(1), fr.stride(0) if forced is not None else 0,
        fr.stride(1) if forced is not None else 0,
        NB=NB, BS=bs, TB=max(1, min(bs, _TILE // NB)), FB=max(1, min(triton.next_power_of_2(max(F, 1)), _TILE // NB)),
        LOG_P=_log_probes(NB),
        FROM_SCORES=src.dtype != torch.int32, FORCED=0 if forced is None else (2 if forced_extra else 1),
        num_warps=_num_warps(NB))


def select_from_keys_triton(keys: torch.Tensor, counts: torch.Tensor, kmax: int) -> torch.Tensor:
    """:func:`keys_impl._select_from_keys`'s signature and lists, from the kernel: int32 keys
    ``[BH, n, n_items]``, counts ``[BH]`` -> int32 ``[BH, n, kmax]``."""
    BH, n, n_items = keys.shape
    out = torch.empty(BH, n, kmax, dtype=torch.int32, device=keys.device)
    select_rows_into(out, keys.contiguous(), counts.to(device=keys.device, dtype=torch.int32).contiguous(), 0,
                     n_items)
    return out

"""Triton backend: search kernels and method "sample"'s, same score definition and order as ``naive.py``.

``_tk_threshold``: per query group, the K-th best item's ordered score key by a
16-way search over the 32-bit key space (8 passes over the keys, each counting
items at or above 16 probes), plus the number of items strictly above it.
``_tk_write``: one ordered pass writing items above the threshold and the first
(K - above) items equal to it, lower index first; lists come out ascending.
Scores are recomputed in every pass (r is tiny), so memory is the output alone.
Method "sample" (:mod:`.sample_impl`, three kernels): each group's threshold from a sampled window, one
scoring pass over all items that counts the items above the window and keeps the window's keys, and an
exact search on those; groups whose window missed are redone by ``_tk_threshold`` (flagged groups only, no
host sync; over more than ``slice_items`` items its passes are spread over slices of them,
``_sliced_fallback``); then ``_tk_write``'s ordered pass, as "search". Methods "keys" and "gemm" (every
item's key or score, then the selection kernel) live in :mod:`.keys_impl`, the scoring all kernels share in
:mod:`.scoring`. "auto" (:func:`resolve_method`): "sample" for token lists ("gemm" with forced items), "keys" on
tensor cores for fp16/bf16 block lists, else "gemm".
The kernels' ``S`` is the KEY length (k_lr's Sk, may differ from q_lr's Sq):
proxies are precomputed per query group, so the kernels never see Sq.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from .common import check_forced, check_problem, forced_union, tensor_core_scorable
from .keys_impl import _lists_by_keys
from .naive import group_proxies
from .scoring import _item_scores

__all__ = ["estimate_topk_triton", "kernel_meta", "resolve_method", "resolve_pass_tile", "resolve_scoring",
           "resolve_tile", "sample_plan", "sample_positions", "scan_store_mode", "METHODS"]

_NPROBE = 16
_NPASS = 9  # (17-way split) 8 passes shrink 2^32 to 1; one spare


@triton.jit
def _group_sum_kernel(Q, OUT, S, r, NG, stride_b, stride_s, G: tl.constexpr, BR: tl.constexpr):
    """One query group of one (batch x head) row (a 1-D grid of NG x rows programs): its tokens added in token
    order in float32, the first token first (``acc = q_0``), positions past S adding +0.0, exactly as
    :func:`naive.group_sums_loop`."""
    pid = tl.program_id(0).to(tl.int64)
    g = pid % NG
    bh = pid // NG
    cols = tl.arange(0, BR)
    cmask = cols < r
    base = Q + bh * stride_b
    t0 = g * G
    acc = tl.load(base + t0 * stride_s + cols, mask=cmask, other=0.0).to(tl.float32)
    for i in range(1, G):
        t = t0 + i
        inside = (cols * 0 + t) < S  # as a block: the interpreter takes no scalar-and-block mask
        x = tl.load(base + t * stride_s + cols, mask=cmask & inside, other=0.0).to(tl.float32)
        acc = acc + x
    tl.store(OUT + pid * r + cols, acc, mask=cmask)


def group_sums(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., S, r] -> float32 [..., NG, r]: the group sums of :func:`naive.group_sums_loop`, bit for bit, from one
    Triton kernel (one program per group and leading row, the group's tokens in order); CUDA, or CPU under
    ``TRITON_INTERPRET=1``. No gradient flows through it (the proxies feed the selection only)."""
    *lead, S, r = q.shape
    NG = -(-S // group_size)
    out = torch.zeros(*lead, NG, r, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    q3 = q.reshape(-1, S, r)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    _group_sum_kernel[(NG * q3.shape[0],)](q3, out, S, r, NG, q3.stride(0), q3.stride(1), G=group_size,
                                           BR=triton.next_power_of_2(r))
    return out


@triton.jit
def _probe_counts(key, ok, lo, hi, cnt, NPROBE: tl.constexpr, PACK: tl.constexpr = 1):
    """``cnt`` [BG, NPROBE] plus, per row, the ``ok`` keys (int32 [BG, BN]) at or above each probe of
    :func:`_probes` (lo, hi int64 [BG]); one probe at a time, so no [BG, BN, NPROBE] tensor (that one spilled:
    Triton 3.6, sm_90a, 4.6 KB of spill loads a thread). A probe lies in [lo, hi) with lo >= -2^31 and
    hi <= 2^31, so it fits int32 and the compares run on int32. PACK (1, 2 or 4; 4 the default, run 21):
    the indicators of PACK probes share one int32 as 8-bit fields (a row of a tile counts at most BN < 128 keys,
    so no field carries into the next), and one row sum counts them all: NPROBE / PACK cross-thread reductions a
    tile instead of NPROBE."""
    pcol = tl.arange(0, NPROBE)[None, :]
    for g in tl.static_range(NPROBE // PACK):
        packed = tl.zeros(key.shape, tl.int32)
        for j in tl.static_range(PACK):
            pr = _probe(lo, hi, g * PACK + j + 1, NPROBE).to(tl.int32)
            packed += ((key >= pr[:, None]) & ok).to(tl.int32) << (8 * j)
        total = tl.sum(packed, axis=1)
        for j in tl.static_range(PACK):
            c = total  # PACK 1: the whole sum (a tile may hold 256 items or more)
            if PACK > 1:
                c = (total >> (8 * j)) & 255
            cnt += tl.where(pcol == g * PACK + j, c[:, None], 0)
    return cnt


@triton.jit
def _probe(lo, hi, m, NPROBE: tl.constexpr):
    """Probe m (1..NPROBE) of the search step between lo and hi (int64; any broadcastable shapes): the one
    formula :func:`_probe_counts` counts at and :func:`_narrow` moves to."""
    return lo + ((hi - lo) * m) // (NPROBE + 1)


@triton.jit
def _probes(lo, hi, NPROBE: tl.constexpr):
    """The NPROBE probes [BG, NPROBE] (int64) of the search step between lo and hi [BG]."""
    return _probe(lo[:, None], hi[:, None], (tl.arange(0, NPROBE) + 1).to(tl.int64)[None, :], NPROBE)


@triton.jit
def _narrow(lo, hi, c_hi, cnt, K, NPROBE: tl.constexpr):
    """One step of the K-th search: keep count(key >= lo) >= K > count(key >= hi) = c_hi (K [BG, 1] or a
    scalar); cnt [BG, NPROBE]: the counts at :func:`_probes` (lo, hi)."""
    probes = _probes(lo, hi, NPROBE)
    ok = cnt >= K
    new_lo = tl.max(tl.where(ok, probes, lo[:, None]), axis=1)
    new_hi = tl.min(tl.where(ok, hi[:, None], probes), axis=1)
    c_new = tl.max(tl.where(ok, -1, cnt), axis=1)
    c_hi = tl.where(new_hi < hi, c_new, c_hi)
    return new_lo, new_hi, c_hi


@triton.jit
def _kth_in_buffer(Buf, b_rows, n_c, lo, hi, c_hi, rank, BN: tl.constexpr, NPROBE: tl.constexpr,
                   PACK: tl.constexpr = 1):
    """The ``rank``-th best key (int64 [BG]) among each row's first ``n_c`` [BG] keys in the buffer
    (row r at ``Buf + b_rows[r]``), and the count of keys above it, by 16-probe steps that keep
    count(key >= lo) >= rank > count(key >= hi) = c_hi (``rank`` [BG, 1]) until hi = lo + 1; a row starts
    from any (lo, hi, c_hi) that holds it, or with hi = lo + 1 to be left alone."""
    n_max = tl.max(n_c, axis=0)
    while tl.max(hi - lo, axis=0) > 1:
        _, lo, hi, c_hi = _buffer_step(Buf, b_rows, n_c, n_max, lo, hi, c_hi, rank, BN, NPROBE, PACK)
    return lo, c_hi


@triton.jit
def _buffer_step(Buf, b_rows, n_c, n_max, lo, hi, c_hi, rank, BN: tl.constexpr, NPROBE: tl.constexpr,
                 PACK: tl.constexpr = 1):
    """One step of the searches in the buffer: the counts ``cnt`` [BG, NPROBE] of each row's first ``n_c`` keys
    at the probes of (lo, hi) (``n_max``: the longest row), and (lo, hi, c_hi) narrowed by them in the rows still
    searching (hi - lo > 1). Returns ``(cnt, lo, hi, c_hi)``."""
    cnt = tl.zeros([lo.shape[0], NPROBE], tl.int32)
    for c0 in range(0, n_max, BN):
        cp = c0 + tl.arange(0, BN)
        cv = cp[None, :] < n_c[:, None]
        key = tl.load(Buf + b_rows[:, None] + cp[None, :], mask=cv, other=0)
        cnt = _probe_counts(key, cv, lo, hi, cnt, NPROBE, PACK)
    live = (hi - lo) > 1
    n_lo, n_hi, n_ch = _narrow(lo, hi, c_hi, cnt, rank, NPROBE)
    return cnt, tl.where(live, n_lo, lo), tl.where(live, n_hi, hi), tl.where(live, n_ch, c_hi)


@triton.jit
def _kth_compacting(Buf, b_rows, n_c, lo, hi, c_lo, c_hi, rank, Small, s_rows, SMALL: tl.constexpr,
                    BN: tl.constexpr, NPROBE: tl.constexpr, PACK: tl.constexpr = 1):
    """:func:`_kth_in_buffer`'s result (the ``rank``-th best key among each row's first ``n_c`` buffered keys, and
    the count above it), reading the buffer only until each row's range [lo, hi) holds at most SMALL keys: those
    keys are then copied to the row's ``Small`` slots (at ``Small + s_rows``, SMALL a row) and the search ends
    there, on a few hundred keys instead of thousands: narrowing passes over the buffer until at most SMALL keys
    remain in range (often one from a sampled window's range, several from the full int32 range, whose first
    probes split it where float keys are not), then one to copy, against 5-8 narrowing passes over the buffer.
    Starts from (lo, hi, c_lo = count(key >= lo), c_hi = count(key >= hi)) as :func:`_kth_in_buffer` does
    (hi = lo + 1: a row left alone); ``rank`` [BG, 1]."""
    n_max = tl.max(n_c, axis=0)
    while tl.max((((hi - lo) > 1) & (c_lo - c_hi > SMALL)).to(tl.int32), axis=0) > 0:
        live = (hi - lo) > 1
        cnt, lo, hi, c_hi = _buffer_step(Buf, b_rows, n_c, n_max, lo, hi, c_hi, rank, BN, NPROBE, PACK)
        c_lo = tl.where(live, tl.min(tl.where(cnt >= rank, cnt, c_lo[:, None]), axis=1), c_lo)
    live = (hi - lo) > 1
    n_s = tl.where(live, c_lo - c_hi, 0)
    tl.debug_barrier()  # a previous search in this program may still be reading the Small slots
    run = tl.zeros_like(n_s)
    for c0 in range(0, tl.max(tl.where(live, n_c, 0), axis=0), BN):
        cp = c0 + tl.arange(0, BN)
        key = tl.load(Buf + b_rows[:, None] + cp[None, :], mask=cp[None, :] < n_c[:, None], other=0)
        inr = (cp[None, :] < n_c[:, None]) & (key >= lo[:, None]) & (key < hi[:, None]) & live[:, None]
        pos = run[:, None] + tl.cumsum(inr.to(tl.int32), axis=1) - 1
        tl.store(Small + s_rows[:, None] + pos, key, mask=inr & (pos < SMALL))  # < SMALL: holds by the counts
        run += tl.sum(inr.to(tl.int32), axis=1)
    tl.debug_barrier()  # the Small slots written above are read back by other threads below
    lo, c_s = _kth_in_buffer(Small, s_rows, n_s, lo, tl.where(live, hi, lo + 1), tl.zeros_like(n_s),
                             rank - c_hi[:, None], BN, NPROBE, PACK)
    return lo, c_hi + c_s


@triton.jit
def _tk_threshold(P, Kp, Counts, Tout, GTout, Flags, S, n_items, NG,
                  R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                  NPROBE: tl.constexpr, NPASS: tl.constexpr, HAS_FLAGS: tl.constexpr, DOT: tl.constexpr = False,
                  PACK: tl.constexpr = 1):
    """Per query group: the K-th best key (``Tout``) and the count of keys above it (``GTout``), by a
    16-probe search over the int32 key range, NPASS passes over every item (scores recomputed in each).
    With HAS_FLAGS only the groups flagged by method "sample" (a tile without any skips the passes)."""
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    n_loop = n_items
    if HAS_FLAGS:
        fl = tl.load(Flags + bh * NG + offs_g, mask=mask_g, other=0)
        mask_g = mask_g & (fl != 0)
        n_loop = tl.where(tl.max(fl, axis=0) != 0, n_items, 0)
    Pb = P + bh.to(tl.int64) * NG * R
    Kb = Kp + bh.to(tl.int64) * S * R
    # invariant: count(key >= lo) >= K > count(key >= hi) = c_hi
    lo = tl.full([BG], -2147483648, tl.int64)
    hi = tl.full([BG], 2147483648, tl.int64)
    c_hi = tl.zeros([BG], tl.int32)
    for _ in range(NPASS):
        cnt = tl.zeros([BG, NPROBE], tl.int32)
        for it0 in range(0, n_loop, BN):
            key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE, DOT)
            cnt = _probe_counts(key, valid[None, :], lo, hi, cnt, NPROBE, PACK)
        lo, hi, c_hi = _narrow(lo, hi, c_hi, cnt, K, NPROBE)
    tl.store(Tout + bh * NG + offs_g, lo.to(tl.int32), mask=mask_g)
    tl.store(GTout + bh * NG + offs_g, c_hi, mask=mask_g)


@triton.jit
def _flagged_tiles(Flags, TileIds, NFlagged, Lo, Hi, Chi, Cnt, NG, BG: tl.constexpr, NPROBE: tl.constexpr):
    """Program (tile, b * H + h): if a group of its tile of BG groups is flagged by "sample", its number
    ``bh * n_tiles + tile`` into ``TileIds`` at a slot taken from ``NFlagged`` (an atomic counter): the tiles the
    fallback's search visits, in any order (each tile's search is its own); and the tile's search state set up
    (``Lo`` = -2^31, ``Hi`` = 2^31, ``Chi`` and the counts ``Cnt`` 0), here rather than by fills of every row."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    offs_g = tile * BG + tl.arange(0, BG)
    rows = bh.to(tl.int64) * NG + offs_g
    inside = offs_g < NG
    fl = tl.load(Flags + rows, mask=inside, other=0)
    if tl.max(fl, axis=0) != 0:
        slot = tl.atomic_add(NFlagged, 1)
        tl.store(TileIds + slot, bh * tl.num_programs(0) + tile)
        tl.store(Lo + rows, tl.full([BG], -2147483648, tl.int64), mask=inside)
        tl.store(Hi + rows, tl.full([BG], 2147483648, tl.int64), mask=inside)
        tl.store(Chi + rows, tl.zeros([BG], tl.int32), mask=inside)
        cells = rows[:, None] * NPROBE + tl.arange(0, NPROBE)[None, :]
        tl.store(Cnt + cells, tl.zeros([BG, NPROBE], tl.int32), mask=inside[:, None])


@triton.jit
def _flagged_tile(TileIds, j, Flags, NG, n_tiles, BG: tl.constexpr):
    """The j-th flagged tile: its (b, h) ``bh``, its groups ``offs_g``, the ``mask_g`` of its flagged ones, their
    ``rows`` in the [B * H * NG] outputs."""
    t = tl.load(TileIds + j)
    bh = t // n_tiles
    offs_g = (t % n_tiles) * BG + tl.arange(0, BG)
    rows = bh.to(tl.int64) * NG + offs_g
    fl = tl.load(Flags + rows, mask=offs_g < NG, other=0)
    return bh, offs_g, (offs_g < NG) & (fl != 0), rows


@triton.jit
def _tk_sliced_search(P, Kp, Counts, Flags, TileIds, NFlagged, Next, TileDone, PassDone, Lo, Hi, Chi, Cnt, Tout,
                      GTout, S, n_items, NG, n_tiles, L, n_slices, R: tl.constexpr, BG: tl.constexpr,
                      BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr, NPROBE: tl.constexpr,
                      NPASS: tl.constexpr, DOT: tl.constexpr = False, PACK: tl.constexpr = 1):
    """:func:`_tk_threshold`'s NPASS-pass search for the groups flagged by "sample", in ONE launch, each pass's counts
    spread over slices of L items (a multiple of BN). The work items (pass, flagged tile, slice), pass first,
    ``NPASS * NFlagged * n_slices`` of them, are taken in order from the ticket counter ``Next`` by the programs of
    this 1-D grid; each adds its slice's counts at the probes of each flagged group's (``Lo``, ``Hi``) to ``Cnt``
    [B * H * NG, NPROBE] (atomics), and the program that adds a tile's last slice of a pass (``TileDone``, a counter
    a tile) narrows the tile (:func:`_narrow_flagged`) and then releases the tile's next pass (``PassDone``, its
    passes narrowed). A work item of pass p waits until its tile's pass p - 1 is narrowed: that work was given out on
    lower tickets, to programs already running, which wait only on lower tickets still, so the lowest ticket held
    never waits and the launch cannot deadlock whether or not its programs are resident together (and under the
    interpreter, which runs one program after another, the first program takes every ticket in order). With no
    flagged tile every program takes one ticket and returns."""
    pcol = tl.arange(0, NPROBE)
    per_pass = tl.load(NFlagged) * n_slices
    w = tl.atomic_add(Next, 1)
    while w < per_pass * NPASS:
        p = w // per_pass
        j = (w % per_pass) // n_slices
        while tl.atomic_add(PassDone + j, 0, sem="acquire") < p:  # the tile's pass p - 1 narrowed
            pass
        bh, offs_g, mask_g, rows = _flagged_tile(TileIds, j, Flags, NG, n_tiles, BG)
        it_lo = (w % n_slices) * L
        Pb = P + bh.to(tl.int64) * NG * R
        Kb = Kp + bh.to(tl.int64) * S * R
        # volatile (past the L1 cache): this program may hold a line of an earlier pass's values
        lo = tl.load(Lo + rows, mask=mask_g, other=0, volatile=True)
        hi = tl.load(Hi + rows, mask=mask_g, other=1, volatile=True)
        cnt = tl.zeros([BG, NPROBE], tl.int32)
        for it0 in range(it_lo, tl.minimum(it_lo + L, n_items), BN):
            key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE, DOT)
            cnt = _probe_counts(key, valid[None, :], lo, hi, cnt, NPROBE, PACK)
        tl.atomic_add(Cnt + rows[:, None] * NPROBE + pcol[None, :], cnt, mask=mask_g[:, None])
        tl.debug_barrier()  # every thread's counts added before the tile's done count
        if tl.atomic_add(TileDone + j, 1) == n_slices - 1:  # acq_rel: the other slices' counts are visible
            tl.store(TileDone + j, 0)  # for the next pass (whose work waits on PassDone, released below)
            _narrow_flagged(Counts, bh, mask_g, rows, Lo, Hi, Chi, Cnt, Tout, GTout, BG, NPROBE)
            tl.debug_barrier()  # every thread's stores made before the release
            tl.atomic_xchg(PassDone + j, p + 1, sem="release")
        w = tl.atomic_add(Next, 1)


@triton.jit
def _narrow_flagged(Counts, bh, mask_g, rows, Lo, Hi, Chi, Cnt, Tout, GTout, BG: tl.constexpr, NPROBE: tl.constexpr):
    """The narrowing step of a flagged tile once every slice's counts are in ``Cnt`` (read past the L1 cache, which
    other programs' atomics bypassed, as are ``Lo``, ``Hi``, ``Chi``, which other programs narrowed in earlier
    passes): its flagged groups' (``Lo``, ``Hi``, ``Chi``), the counts cleared for the next pass, and the threshold
    and the count above it so far (``Tout``, ``GTout``, as :func:`_tk_threshold` stores them; the last pass's
    stand)."""
    K = tl.load(Counts + bh)
    cells = rows[:, None] * NPROBE + tl.arange(0, NPROBE)[None, :]
    cnt = tl.load(Cnt + cells, mask=mask_g[:, None], other=0, volatile=True)
    lo = tl.load(Lo + rows, mask=mask_g, other=0, volatile=True)
    hi = tl.load(Hi + rows, mask=mask_g, other=1, volatile=True)
    c_hi = tl.load(Chi + rows, mask=mask_g, other=0, volatile=True)
    lo, hi, c_hi = _narrow(lo, hi, c_hi, cnt, K, NPROBE)
    tl.store(Lo + rows, lo, mask=mask_g)
    tl.store(Hi + rows, hi, mask=mask_g)
    tl.store(Chi + rows, c_hi, mask=mask_g)
    tl.store(Cnt + cells, tl.zeros([BG, NPROBE], tl.int32), mask=mask_g[:, None])
    tl.store(Tout + rows, lo.to(tl.int32), mask=mask_g)
    tl.store(GTout + rows, c_hi, mask=mask_g)


# programs of the fallback's launch: enough to spread a few flagged tiles' slices over every SM, few enough that a
# call finding no flagged tile (the common case) costs a launch, not a wave of programs a tile
_FALLBACK_PROGRAMS = 1024


def _slice_plan(n_items: int, slice_items: int, BN: int):
    """``(length, n_slices)`` of the fallback's slices: about ``slice_items`` items each, rounded up to whole tiles of
    BN items (a slice of the last tile may be partial)."""
    n = triton.cdiv(n_items, slice_items)
    length = triton.cdiv(triton.cdiv(n_items, n), BN) * BN
    return length, triton.cdiv(n_items, length)


def _sliced_fallback(P, proxies, k, counts, flags, thr, above, length: int, n_slices: int,
                     meta: dict) -> None:
    """:func:`_tk_threshold`'s search on the groups "sample" flagged, each pass's counts spread over ``n_slices``
    slices of ``length`` items (:func:`_slice_plan`) and each tile narrowed by its last slice's program, every pass
    in one launch (:func:`_tk_sliced_search`), on the tiles listed on the device by :func:`_flagged_tiles` (no host sync), which
    also sets up their search: one fill (the counters) and two launches, the second of at most
    ``_FALLBACK_PROGRAMS`` programs. Run 21 (H100): 1-4 flagged groups of 32K-64K took 12-25 ms in one program each,
    so the slices; run 28: with every tile of every head in the grids of 18 launches (counts, then narrowing), the
    fallback cost 0.5-0.7 ms at 16K-64K with NO group flagged and 3.7-7.8 ms for 2 flagged groups at 128K, hence the
    list of tiles (4 flagged groups at 128K: 1.2 ms); then 0.8-1.0 ms with none flagged at 16K-32K: the launches'
    host cost, hence one launch a pass; run 30 (H200): its 15 launches (five fills, the list, nine passes) still
    0.6-1.0 ms at 16K whatever the work, hence the passes in one launch and the fills in the list's."""
    rows = P.B * P.H * P.num_groups
    dev = proxies.device
    lo = torch.empty(rows, dtype=torch.int64, device=dev)  # set for the flagged tiles by _flagged_tiles, as are
    hi = torch.empty_like(lo)  # the next three; no other row is read
    c_hi = torch.empty(rows, dtype=torch.int32, device=dev)
    cnt = torch.empty(rows, _NPROBE, dtype=torch.int32, device=dev)
    n_tiles = triton.cdiv(P.num_groups, meta["BG"])
    tiles = P.B * P.H * n_tiles
    tile_ids = torch.empty(tiles, dtype=torch.int32, device=dev)
    # the counters, one fill: each listed tile's slices added in its pass (TileDone) and passes narrowed (PassDone),
    # then the flagged tiles' count and the next ticket
    ctr = torch.zeros(2 * tiles + 2, dtype=torch.int32, device=dev)
    tile_done, pass_done, n_flagged, ticket = ctr[:tiles], ctr[tiles:2 * tiles], ctr[-2:-1], ctr[-1:]
    _flagged_tiles[(n_tiles, P.B * P.H)](flags, tile_ids, n_flagged, lo, hi, c_hi, cnt, P.num_groups, BG=meta["BG"],
                                         NPROBE=_NPROBE)
    grid = (min(_FALLBACK_PROGRAMS, tiles * n_slices),)
    _tk_sliced_search[grid](proxies, k, counts, flags, tile_ids, n_flagged, ticket, tile_done, pass_done, lo, hi, c_hi,
                            cnt, thr, above, P.Sk, P.num_items, P.num_groups, n_tiles, length, n_slices,
                            NPROBE=_NPROBE, NPASS=_NPASS, **meta)


@triton.jit
def _add_carry(s_a, k_a, s_b, k_b):
    """:func:`_scan_carrying`'s combine: the counts summed, the later element's key kept."""
    return s_a + s_b, k_b


@triton.jit
def _scan_carrying(both, key):
    """The inclusive row prefix sums of ``both`` and ``key`` itself ([BG, BN] int32), out of ONE scan, so that both
    leave it in the scan's (blocked) layout and what a pass computes after it (masks, positions, the store) stays
    there: one layout conversion a tile, the key's out of the tensor-core product's layout (Triton scans no MMA
    layout), where a scan of ``both`` alone left the keys, masks and positions to 5-6 conversions (Triton 3.6,
    sm_90a; ``SCAN_STORE`` of :func:`_tk_write` and ``sample_impl._window_pass``)."""
    return tl.associative_scan((both, key), 1, _add_carry)


@triton.jit
def _last_column(pre, BN: tl.constexpr):
    """Each row's last entry of ``pre`` [BG, BN], an inclusive scan's (the row total), reduced in ``pre``'s layout,
    within a warp (a ``tl.sum`` of the scan's input ran in the product's layout, across warps)."""
    return tl.sum(tl.where(tl.arange(0, BN)[None, :] == BN - 1, pre, 0), axis=1)


@triton.jit
def _store_i32(ptr, val, mask, PTX: tl.constexpr):
    """``tl.store(ptr, val, mask=mask)`` of int32 values; PTX: one inline ``st.global.b32`` an element, which takes
    its operands in their own layout, where ``tl.store`` takes the one Triton's Coalesce pass gives a scatter
    (threads down the rows, from the pointers' axis info: 3-4 conversions through shared memory a tile). Not under
    the interpreter (no inline PTX there: :func:`scan_store_mode`)."""
    if PTX:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                                  "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _tk_write(P, Kp, Counts, Tin, GTin, Out, S, n_items, NG, KMAX,
              R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
              DOT: tl.constexpr = False, PACK: tl.constexpr = 1, SCAN_STORE: tl.constexpr = 0):
    """One ordered pass per query group: the items above the threshold ``Tin`` and the first
    (K - ``GTin``) equal to it, lower index first, so the lists come out ascending. ``SCAN_STORE``
    (:func:`scan_store_mode`): 1 or 2, the keys ride the scan and the masks, positions and store follow in its
    layout (2: the store as inline PTX), the same lists."""
    pid_g = tl.program_id(0)
    bh = tl.program_id(1)
    K = tl.load(Counts + bh)
    offs_g = pid_g * BG + tl.arange(0, BG)
    mask_g = offs_g < NG
    Pb = P + bh.to(tl.int64) * NG * R
    Kb = Kp + bh.to(tl.int64) * S * R
    t = tl.load(Tin + bh * NG + offs_g, mask=mask_g, other=0)
    # >= 0: a threshold that disagreed with these keys could never write before the group's row
    need_eq = tl.maximum(K - tl.load(GTin + bh * NG + offs_g, mask=mask_g, other=0), 0)
    o_rows = Out + (bh.to(tl.int64) * NG + offs_g) * KMAX  # [BG]
    run_gt = tl.zeros([BG], tl.int32)
    run_eq = tl.zeros([BG], tl.int32)
    n_loop = tl.where(K > 0, n_items, 0)
    for it0 in range(0, n_loop, BN):
        key, items, valid = _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items, R, BG, BN, BS, LSE, DOT)
        ok = valid[None, :] & mask_g[:, None]
        # one scan counts both, those above in the low 16 bits, those equal in the high ones (BN < 2^15): item j is
        # selected if above, or equal within the first need_eq equal ones; selected up to j: the row's keys above
        # up to j, plus min(its equal ones up to j, need_eq)
        both = ((key > t[:, None]) & ok).to(tl.int32) + (((key == t[:, None]) & ok).to(tl.int32) << 16)
        if SCAN_STORE:
            pre, key = _scan_carrying(both, key)
            items = it0 + tl.arange(0, BN)  # the items and masks anew, in the scan's layout
            ok = (items < n_items)[None, :] & mask_g[:, None]
        else:
            pre = tl.cumsum(both, axis=1)
        eq_rank = run_eq[:, None] + (pre >> 16)
        sel = ((key > t[:, None]) & ok) | ((key == t[:, None]) & ok & (eq_rank <= need_eq[:, None]))
        pos = run_gt[:, None] + (pre & 0xFFFF) + tl.minimum(eq_rank, need_eq[:, None]) - 1
        # pos < K: a threshold that disagreed with these keys could never write past the group's row
        _store_i32(o_rows[:, None] + pos, items[None, :], sel & (pos < K), SCAN_STORE == 2)
        if SCAN_STORE:
            tot = _last_column(pre, BN)
        else:
            tot = tl.sum(both, axis=1)
        run_gt += tot & 0xFFFF
        run_eq += tot >> 16


METHODS = ("auto", "search", "sample", "keys", "gemm")


def resolve_method(method: str, block_size: int, tensor_cores: bool = False, forced: bool = False) -> str:
    """The method :func:`estimate_topk_triton` runs: ``method`` itself, or for "auto": with block lists (``block_size``
    > 0) "keys" where the inputs score on tensor cores (``tensor_cores``, :func:`~.common.tensor_core_scorable`),
    else "gemm"; with token lists "gemm" for ``forced`` items, else "sample"."""
    if method not in METHODS:
        raise ValueError(f"estimate_topk_triton: `method` must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    if block_size:
        return "keys" if tensor_cores else "gemm"
    return "gemm" if forced else "sample"


def resolve_tile(method: str, dot, block_size: int, BG: int = 0, BN: int = 0):
    """``(BG, BN)``, a tile's groups and items; 0 takes the default: 64 groups x 256 tokens of blocks for method
    "keys" scoring block lists on tensor cores (run 27, H100, G = 128, 128-key blocks, bf16, 90%: 0.18 / 0.21 /
    0.51 / 1.48 ms at 16K / 32K / 64K / 128K against 0.21 / 0.22 / 0.58 / 1.86 ms at 16 x 4; the best or within
    0.03 ms of it at every length), else 16 groups and :func:`kernel_meta`'s items."""
    big = method == "keys" and dot == "tc" and block_size > 0
    return BG or (64 if big else 16), BN or (max(1, 256 // block_size) if big else 0)


@contextlib.contextmanager
def _phase(stats: dict | None, name: str, device: torch.device):
    """``stats["ms_" + name]``: the GPU time of the launches inside (CUDA events, then a host sync), when ``stats``
    is given and the inputs are on a GPU; otherwise nothing is timed."""
    if stats is None or device.type != "cuda":
        yield
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    yield
    end.record()
    end.synchronize()
    stats["ms_" + name] = start.elapsed_time(end)


@functools.lru_cache(maxsize=256)
def sample_plan(n_items: int, kmax: int, sample_size: int = 1024, z: float = 4.0):
    """(F, NSV, CAP) of method "sample": stratum length F, strata (sampled items) NSV, buffer capacity per
    group CAP: the sample itself, or the widest window between the sampled ranks m_hi and m_lo of a budget up
    to kmax (their sampled items times F, plus z standard deviations), whichever is larger."""
    F = max(1, -(-n_items // sample_size))
    nsv = -(-n_items // F)
    cap = nsv
    if F > 1:  # the widest window of any budget up to kmax (m_lo is capped at NSV: not always kmax's)
        t_max = kmax * nsv / n_items
        for texp in [t_max] + list(range(int(t_max) + 1)):
            m_lo = min(nsv, int(texp + z * math.sqrt(texp)) + 2)
            m_hi = max(0, int(texp - z * math.sqrt(texp)) - 1)
            w = m_lo - m_hi + 1
            cap = max(cap, int((w + z * math.sqrt(w) + 2) * F))
    return F, nsv, min(n_items, -(-cap // 16) * 16)


def sample_positions(n_items: int, sample_size: int = 1024) -> torch.Tensor:
    """The items method "sample" scores to place its window (the kernel's stratified hash), int64;
    for tests that build inputs the sample cannot see."""
    F = max(1, -(-n_items // sample_size))
    js = torch.arange(-(-n_items // F), dtype=torch.int64)
    start = js * F
    ln = torch.clamp(torch.clamp(n_items - start, max=F), min=1)
    return start + (((js * 1779033703) & 0x7FFFFFFF) >> 7) % ln


def resolve_pass_tile(pass_tile: tuple, block_size: int, BG: int, BN: int):
    """``(BG, BN)`` of the passes that decide the lists ("sample"'s window pass, the exact search, the write pass):
    ``pass_tile`` when given, else for token lists 32 groups x 64 tokens (run 28, H100, G = 32, bf16, 90%, one scan a
    tile: the call 1.60 / 5.02 / 17.86 / 71.35 ms at 16K / 32K / 64K / 128K; 128 x 32, run 27b's choice from 32K
    items, 2.76 / 5.30 / 17.68 / 75.59, 64 x 32 1.92 / 5.06 / 18.19 / 75.73; the exact search of a flagged group also
    costs less on 32 groups than on 128), for block lists the call's own tile ``(BG, BN)``."""
    if pass_tile:
        return tuple(pass_tile)
    if block_size:
        return BG, BN
    return 32, 64


def resolve_scoring(dot, pack_counts: int, dtype: torch.dtype, r: int, block_size: int, BG: int = 16,
                    BN: int = 0):
    """The defaults of ``dot`` ("auto") and ``pack_counts`` (0): ``dot="tc"`` where the inputs score on tensor cores
    (:func:`~.common.tensor_core_scorable`: fp16/bf16, r a power of two >= 16) on tiles of at least 16 groups
    (:func:`kernel_meta`'s limits), else False (the exact FMA loop). Measured on token lists (run 21, H100, G = 32,
    90%, bf16: "sample" with tensor-core scoring and 4 probes a reduction took 2.72 / 45.7 ms at 16K / 64K against
    3.74-3.98 / 53-73 ms scoring in the loop, its lists equal to the CUDA kernel's; NOTES_topk_estimation run 21)
    and on block lists in "keys" (run 27, H100, G = 128, 128-key blocks: 0.18-1.48 ms at 16K-128K against "gemm"'s
    0.24-22.4 ms, lists equal to the CUDA kernel's). ``pack_counts`` 4 where a tile row counts fewer than 128 items,
    else 1 (block lists too: exact, untimed there). Explicit values pass through."""
    if dot == "auto":
        tile_ok = BG >= 16 and (BN or 64) * max(1, block_size) >= 16
        dot = "tc" if tensor_core_scorable(dtype, r) and tile_ok else False
    if pack_counts == 0:
        n = BN or (64 if block_size == 0 else 1 << (max(1, 512 // block_size).bit_length() - 1))
        pack_counts = 4 if n < 128 else 1
    return dot, pack_counts


def scan_store_mode(scan_store: bool | None = None) -> int:
    """``SCAN_STORE`` of the window and write passes (:func:`_tk_write`, ``sample_impl._window_pass``) for token lists
    (the default since run 29: 12.2 against 18.3 ms at 64K, H100, the same lists). 0 (False; block lists) a
    scan of the counts alone, then the keys, masks and positions converted to ``tl.store``'s layout (Triton 3.6,
    sm_90a, token lists' tensor-core scores: 6 / 5 conversions, 15 / 13 barriers, 411 / 482 instructions a tile in
    the window / write pass's loop, 108 / 80 registers); 2 the keys ride the scan (:func:`_scan_carrying`), the masks,
    positions, row totals and an inline-PTX store follow in its layout (1 conversion, 2 barriers, 309 / 340
    instructions, 48 / 61 registers); 1 the same code with ``tl.store``, under the interpreter, which runs no PTX
    (compiled, Coalesce would give that store its own layout again: 9 / 7 barriers, 635 / 487 instructions).
    ``None`` (the default): 2 on a GPU, 0 under the interpreter, where the carried scan runs 2-3x slower than the
    plain one and gives the same lists (``True`` runs it there: ``test_scan_store_gives_the_same_lists``)."""
    from triton import knobs  # TRITON_INTERPRET as Triton reads it (1 / true / on / yes)

    interpret = knobs.runtime.interpret
    if scan_store is None:
        scan_store = not interpret
    if not scan_store:
        return 0
    return 1 if interpret else 2


def kernel_meta(r: int, block_size: int, block_score: str = "max", BG: int = 16, BN: int = 0,
                dot: bool | str = False, pack_counts: int = 1) -> dict:
    """The launch settings of the search, sample, write and keys kernels (constexprs and ``num_warps``): tiles
    of BG groups x BN items (BN 0: 64 tokens, or blocks of 512 tokens in all) that 8 warps hold without
    spilling (Triton 3.6 and 3.9, sm_90a, ``tools/kernel_resources.py --topk``; 4 warps spilled in the fused
    "sample" kernel of before run 27, 16 x 16 x 128 block tiles in every kernel). ``dot``: a tile's scores as one
    ``tl.dot`` (:func:`.scoring._scores_at`; r a power of two >= 16, BG >= 16 and BN items of at least 16 tokens in
    all; block items: the product over their tokens, then each block's max or log-sum-exp). ``pack_counts`` (1, 2
    or 4): probes counted per cross-thread reduction in the searches (:func:`_probe_counts`; tiles of fewer than 128
    items). ``dot="tc"``: the same product on tensor cores in the inputs' fp16/bf16 (fp32 accumulation; not for
    fp32 inputs)."""
    if dot not in (False, True, "tc"):
        raise ValueError(f"dot must be False, True (fp32 FMA) or 'tc' (tensor cores), got {dot!r}")
    BN = BN or (64 if block_size == 0 else 1 << (max(1, 512 // block_size).bit_length() - 1))
    if dot and (r < 16 or r & (r - 1) or BG < 16 or BN * max(1, block_size) < 16):
        raise ValueError(f"dot={dot!r} scores with r a power of two >= 16 on tiles of at least 16 groups x 16 tokens; "
                         f"got r={r}, BG={BG}, BN={BN} items of block_size={block_size}")
    if BN >= 1 << 15:
        raise ValueError(f"a tile holds fewer than 32768 items (the passes count two things in one int32); got BN={BN}")
    if pack_counts not in (1, 2, 4) or (pack_counts > 1 and BN >= 128):
        raise ValueError(f"pack_counts must be 1, 2 or 4, and 1 for tiles of 128 items or more (8-bit counts); "
                         f"got pack_counts={pack_counts} with BN={BN}")
    return dict(R=r, BG=BG, BN=BN, BS=block_size, LSE=block_score == "lse", DOT=2 if dot == "tc" else int(dot),
                PACK=pack_counts, num_warps=8)


def estimate_topk_triton(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max",
                         BG: int = 0, BN: int = 0, method: str = "auto", *, sample_size: int = 1024,
                         z: float = 4.0, capacity: int = 0, stats: dict | None = None, chunk_elems: int = 1 << 25,
                         forced=None, forced_extra: bool = False, dot: bool | str = "auto", pack_counts: int = 0,
                         slice_items: int = 1024, pass_tile: tuple = (), scan_store: bool | None = None):
    """Same contract as :func:`estimate_topk`, on Triton (GPU, or CPU under TRITON_INTERPRET=1).
    q_lr [B, H, Sq, r], k_lr [B, H, Sk, r]: Sk may differ from Sq.

    ``method``: "search" (two kernels: 16-probe search, 9 passes over all items, then the ordered
    write pass), "sample" (:mod:`.sample_impl`: a sampled threshold window, one pass over all items that
    counts those above the window and keeps the window's keys in a per-group buffer, the exact threshold
    from the buffer; groups whose window missed fall back to the search kernel, on those groups only,
    without a host sync; then the ordered write pass of "search"), "keys" (:func:`keys_impl._tk_keys`:
    ONE scoring pass writing every item's ordered key, ``chunk_elems`` keys at a time (but at least one
    group of every batch and head), then one selection launch per chunk (:func:`select_kernel.select_rows_into`;
    rows past ``select_kernel.MAX_ITEMS`` items: one int64 ``torch.topk``, :func:`keys_impl._select_from_keys`, about 12
    bytes per key of a chunk), so meant for block lists, whose n_items is S / block_size, or
    "gemm" (:func:`keys_impl._gemm_scores`: the scores of "keys" from one batched matrix product per chunk, on cuBLAS,
    then ONE launch taking the block max, the forced items and the selection (log-sum-exp blocks reduced in
    torch first; ~3 host ops a chunk against ~34 in torch); the chunk's scores take ``4 * chunk_elems`` float32
    elements (float64 for float32 inputs: ``2 * chunk_elems``); the same lists up to items tied within a few
    units in the last place of their score), or
    "auto" (:func:`resolve_method`): "sample" for token lists (H200, 2026-12-01, S=16K, G=32, 90%
    sparsity: 58.7 ms vs "search" 149.6 ms; "gemm" where items are forced); for block lists "keys" where the inputs
    score on tensor cores (fp16/bf16, r a power of two >= 16: run 27, H100, S=16K-128K, H=16, G=128, 128-key
    blocks, 90%: 0.18 / 0.21 / 0.51 / 1.48 ms against "gemm"'s 0.24 / 0.73 / 3.53 / 22.4 and the CUDA kernel's
    0.39 / 0.94 / 2.02 / 6.67, on :func:`resolve_tile`'s 64 x 256-token tiles), else "gemm" (on CUDA cores
    "keys" took 11.3 ms against "gemm"'s 2.1 at S=32K, H=16, H200, 2026-12-02). All give the naive lists
    ("gemm" and tensor-core scoring up to near-exact ties).
    "sample" knobs: ``sample_size`` (items scored to place the window), ``z`` (window half-width in
    standard deviations), ``capacity`` (candidate buffer per group; 0 = :func:`sample_plan`'s, a
    smaller value forces overflow in tests; at least the sample). Extra memory of "sample":
    B*H*NG*capacity*4 bytes (64K tokens, G=32, H=16, 90% sparse: capacity 7936, 1.0 GB), plus
    B*H*NG*4 bytes a slot for the searches' copied keys (``sample_impl.window_slots``: 1024 slots there, 128 MB).
    ``stats``: a dict that receives, for "search" and "sample", ``fallback_groups`` and ``fallback_tiles`` (the
    groups "sample" left to the search kernel, and the tiles of ``tile_groups`` groups (the pass tile's) that search
    had to scan: its cost) of ``groups`` and ``tiles``, and on a GPU each step's time (``ms_sample``,
    ``ms_window``, ``ms_window_kth``: the three kernels of "sample"; ``ms_threshold``, ``ms_write``); host syncs,
    for tests and benchmarks.
    ``slice_items``: "sample"'s fallback search spreads each flagged group's passes over slices of about this many
    items (:func:`_sliced_fallback`, its programs taking the (pass, tile, slice) work items by ticket; one program
    scans all items where they are fewer); ``stats`` gets ``fallback_slices``, the slices of a pass (1: one program).
    ``forced`` [NG, F] (local + predicted lists): items ranked first in their group; methods "keys" and
    "gemm" (their keys buffer takes the top key); "auto" then picks "gemm" for token lists. ``forced_extra``
    (the budgets count only the other items; :func:`~.common.forced_union`): the forced items take the lowest key
    for the selection, then join each group's list: idx ``[B, H, NG, F + Kmax]``, counts ``[B, H, NG]``.
    ``BG``, ``BN``: a tile's groups and items (0: :func:`resolve_tile`'s defaults).
    ``pass_tile`` ``(BG, BN)``, powers of two: the tile of the passes that decide the lists, "sample"'s window pass,
    the exact search ("search", and "sample"'s fallback) and the write pass, so that every key they compare is
    computed on one tile; ``()``: :func:`resolve_pass_tile`'s. ``BG`` x ``BN`` then tiles "sample"'s sampling and
    its search in the window.
    ``dot``: the kernels score a tile with one ``tl.dot`` (block items: over their tokens, then the block score; True:
    fp32 on FMA units; "tc": fp16/bf16 on tensor cores; False: a loop over r on FMA units); ``pack_counts``: probes
    per cross-thread reduction in the searches (:func:`kernel_meta`); "auto" and 0: :func:`resolve_scoring`'s
    defaults. With "tc" the lists equal naive's up to near-exact ties (the CUDA kernel's rule), and so may those of
    ``dot=True`` (its summation order is the compiler's); the loop (False) gives naive's bit for bit. Method "gemm"
    scores through cuBLAS and ignores ``dot``.
    ``scan_store``: the window pass and the write pass carry each tile's keys through the scan of its counts and
    store in the scan's layout (:func:`scan_store_mode`; None: on a GPU, not under the interpreter), the same lists
    (run 29, H100, bf16 token lists, G = 32, 90%: 1.39 / 3.93 / 12.2 / 43.2 ms at 16K / 32K / 64K / 128K against
    1.62 / 5.38 / 18.3 / 68.4 with ``False``, the CUDA kernel's 0.50 / 1.52 / 4.80 / 18.3; every list entry equal).
    Token lists only: block lists' pass tiles (16 x 4 on 8 warps) hold each element in several threads, and the
    inline store, unlike ``tl.store``, would write it from each of them. ``False`` keeps the tiles' ``tl.store`` path
    (the block lists') for token lists too.
    """
    P = check_problem(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)
    tc = tensor_core_scorable(q_lr.dtype, P.r) and dot in ("auto", "tc") and (BG == 0 or BG >= 16)
    method = resolve_method(method, block_size, tc, forced is not None)
    BG, BN = resolve_tile(method, "tc" if tc else dot, block_size, BG, BN)
    store_mode = scan_store_mode(scan_store if not P.block_size else False)  # the window and write passes' SCAN_STORE
    if forced is not None and method not in ("keys", "gemm"):
        raise ValueError(f"estimate_topk_triton: `forced` items need method 'keys', 'gemm' (or 'auto'), "
                         f"got {method!r}")
    if slice_items < 1:
        raise ValueError(f"estimate_topk_triton: `slice_items` must be >= 1, got {slice_items}")
    if chunk_elems < 1:
        raise ValueError(f"estimate_topk_triton: `chunk_elems` must be >= 1, got {chunk_elems}")
    if pass_tile and (len(pass_tile) != 2 or any(type(v) is not int or v < 1 or v & (v - 1) for v in pass_tile)
                      or method not in ("sample", "search")):
        raise ValueError(f"estimate_topk_triton: `pass_tile` must be (BG, BN), powers of two, with method 'sample' or "
                         f"'search'; got {pass_tile!r} with method {method!r}")
    dot, pack_counts = resolve_scoring(dot, pack_counts, q_lr.dtype, P.r, block_size, BG, BN)
    if dot == "tc" and q_lr.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"estimate_topk_triton: dot='tc' scores fp16/bf16 inputs on tensor cores, got {q_lr.dtype} "
                         "(fp32 inputs: dot=True)")
    if forced_extra and forced is None:
        raise ValueError("estimate_topk_triton: `forced_extra` needs `forced` items")
    if forced is not None:
        forced = check_forced(forced, P.num_groups, P.num_items, q_lr.device)
    if forced_extra:
        out = torch.full((P.B, P.H, P.num_groups, forced.shape[1] + P.kmax), -1, dtype=torch.int32,
                         device=q_lr.device)
        group_counts = torch.zeros(P.B, P.H, P.num_groups, dtype=torch.int32, device=q_lr.device)
        if P.kmax == 0:  # every group keeps its forced items alone
            none = torch.empty(P.B, P.H, P.num_groups, 0, dtype=torch.int32, device=q_lr.device)
            out[:], group_counts[:] = forced_union(none, forced, P.num_items)
            return out, group_counts
    else:
        out = torch.full((P.B, P.H, P.num_groups, P.kmax), -1, dtype=torch.int32, device=q_lr.device)
    meta = kernel_meta(P.r, block_size, block_score, BG, BN, dot, pack_counts)
    # the passes that decide the lists (the window pass, the exact search, the write pass) score on one tile, so that
    # every key they compare is computed the same way (a tensor-core product's rounding may depend on the tile)
    pBG, pBN = resolve_pass_tile(pass_tile, block_size, BG, meta["BN"])
    try:
        pass_meta = kernel_meta(P.r, block_size, block_score, pBG, pBN, dot, 1 if pBN >= 128 else pack_counts)
    except ValueError as e:
        raise ValueError(f"estimate_topk_triton: `pass_tile` {(pBG, pBN)}: {e}") from None
    if stats is not None:
        stats.update(fallback_groups=0, fallback_tiles=0, groups=P.B * P.H * P.num_groups, tile_groups=pBG,
                     tiles=P.B * P.H * triton.cdiv(P.num_groups, pBG))
    if P.kmax == 0:
        return out, P.counts
    proxies = group_proxies(q_lr, group_size, proxy, kernel=True).contiguous()  # [B, H, NG, r]
    k = k_lr.contiguous()
    counts = P.counts.contiguous()
    if method in ("keys", "gemm"):
        _lists_by_keys(method, P, proxies, k, out, group_counts if forced_extra else None, forced, chunk_elems, meta)
        return out, (group_counts if forced_extra else counts)
    grid = (triton.cdiv(P.num_groups, pBG), P.B * P.H)  # the search's and the write pass's
    thr = torch.empty(P.B, P.H, P.num_groups, dtype=torch.int32, device=q_lr.device)
    above = torch.empty_like(thr)
    fb = method == "sample"
    flags = thr  # unused by "search"
    if fb:
        F, nsv, cap = sample_plan(P.num_items, P.kmax, sample_size, z)
        cap = max(capacity or cap, nsv)  # the buffer holds the sample first
        flags = torch.empty(P.B, P.H, P.num_groups, dtype=torch.int32, device=q_lr.device)  # _ss_kth sets every one
        buf = torch.empty(P.B * P.H * P.num_groups * cap, dtype=torch.int32, device=q_lr.device)
        from .sample_impl import run_sample  # imports this module's search functions

        run_sample(P, proxies, k, counts, thr, above, flags, buf, cap, F, nsv, z, meta, pass_meta, _NPROBE,
                   lambda name: _phase(stats, name, q_lr.device), store_mode)
        del buf
        if stats is not None:
            padded = torch.nn.functional.pad(flags.view(P.B * P.H, P.num_groups), (0, (-P.num_groups) % pBG))
            stats.update(fallback_groups=int(flags.sum()),
                         fallback_tiles=int(padded.view(P.B * P.H, -1, pBG).amax(dim=2).sum()))
    elif stats is not None:  # "search" scans every tile
        stats.update(fallback_groups=stats["groups"], fallback_tiles=stats["tiles"])
    length, n_slices = _slice_plan(P.num_items, slice_items, pass_meta["BN"]) if fb else (P.num_items, 1)
    if stats is not None:
        stats["fallback_slices"] = n_slices
    with _phase(stats, "threshold", q_lr.device):
        if n_slices > 1:
            _sliced_fallback(P, proxies, k, counts, flags, thr, above, length, n_slices, pass_meta)
        else:
            _tk_threshold[grid](proxies, k, counts, thr, above, flags, P.Sk, P.num_items, P.num_groups,
                                NPROBE=_NPROBE, NPASS=_NPASS, HAS_FLAGS=fb, **pass_meta)
    with _phase(stats, "write", q_lr.device):
        _tk_write[grid](proxies, k, counts, thr, above, out, P.Sk, P.num_items, P.num_groups, P.kmax,
                        SCAN_STORE=store_mode, **pass_meta)
    return out, counts

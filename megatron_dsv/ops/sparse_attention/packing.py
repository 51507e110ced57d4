"""Packed token lists: P neighbouring query groups run as one group of P * G rows, in the backward.

Token lists at G = 32 / 64 run their kernels on 32- or 64-row tiles, and the dq kernel's dK/dV atomics are
paid once per (group, listed key): at 64K tokens and 90% sparsity the backward is atomics-bound and scales
as 1 / G (H100, 2026-12-05: 110 / 61 / 33 ms at G = 32 / 64 / 128). Neighbouring query cubes of a video
keep mostly the same keys (``benchmarks/list_shapes.video_lists`` at 64K, 90%: the union of 4 groups of 32
holds 1.41x one group's keys, of 2 groups of 64 1.16x), so packing P = 128 // G groups into one list of
their union runs 128-row tiles over 1.2-1.4x the keys and scatters each listed key's dK/dV once per packed
group instead of once per group. Each entry of a packed list carries a P-bit mask of the groups that list
it (bit p: group ``P * i + p``); the kernels give every other row of the tile zero probability there, so
the result is the unpacked one up to summation order.

Measured on an H100 (D=128, 64K, 90% sparse, fwd + bwd against same-run cuDNN; run 16,
``sparse_attention-sweep-token-run16-*-h100-80gb-hbm3-20261205.json``), packing on against off, the packer's own
time included:

- video-shaped lists (each cube's neighbourhood plus keys its neighbours keep, as DSV's lists): the backward
  54 / 43 ms against 109 / 61 ms at G = 32 / 64, so **2.81x / 3.90x cuDNN against 1.65x / 3.00x**;
- uniformly random lists (the union ~P times a list): 131 / 72 ms against 118 / 62 ms, 1.41x / 2.57x against
  1.56x / 2.94x, 10-13% slower.

DSV's lists are video-shaped, so token lists of G < 128 pack by default (``DSV_TOKEN_PACK``, ``on``; ``off``
for lists without locality). The packed forward gained nothing in run 15 (19 / 16 ms against 20 / 11 ms): only
the backward packs. A row's zero probability still multiplies the packed group's values, so a non-finite key
or value row (a diverged run) turns into NaN in every group of its pack, where unpacked it reaches only the
groups that list it.

The union is built on the device by two Triton kernels, with no host sync: each group's keys set bits in its
own row of a key bitmap (``atomic_or``), then each packed group ORs its members' rows and compacts the set keys
in key order (a prefix sum over 2048 keys at a time), each with the mask of the members listing it. The packed
lists are ``min(TK, P * Kmax)`` wide (no sync for the largest union; entries past a packed group's count are
never read). The same two passes in PyTorch, :func:`pack_token_lists_naive`, are the kernels' twin (the first
measured version: 40-50 ms a call at 64K, as long as the backward it shortens).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .checks import group_counts

PACK_ROWS = 128  # rows of a packed group: the kernels' widest query tile
PACK_MODES = ("on", "off")


def packing_on() -> bool:
    """``DSV_TOKEN_PACK`` in {on, off} (default on), validated."""
    name = os.environ.get("DSV_TOKEN_PACK", "on").strip().lower() or "on"
    if name not in PACK_MODES:
        raise ValueError(f"DSV_TOKEN_PACK must be one of {PACK_MODES}; got {name!r}")
    return name == "on"


def token_pack_factor(G: int, BS: int) -> int:
    """How many query groups one packed group holds: with :func:`packing_on`, token lists (``BS == 0``) of
    G < 128 pack into groups of 128 rows (P = 128 // G); 1 = no packing."""
    if not packing_on() or BS != 0 or G >= PACK_ROWS:
        return 1
    return PACK_ROWS // G


def pack_token_lists_naive(kv_indices: torch.Tensor, kv_counts: torch.Tensor, G: int, P: int, TK: int,
                           max_bytes: int = 512 << 20) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices int32 [B, H, NP, U], bits int8 [B, H, NP, U], counts int32 [B, H, NP])`` with
    ``NP = ceil(NG / P)``: packed group i lists, ascending, every key some group ``P * i + p`` lists (the
    first ``counts`` entries; the rest is padding, index 0 and no bits), and bit p of its mask says which of
    them do. ``U`` is the largest union (at least 1).

    kv_indices int32 ``[B, H, NG, Kmax]`` token ids in ``[0, TK)``, unique within a group (as ``sparse_attention``
    requires: a key listed twice would carry into the next group's bit), kv_counts ``[B, H]`` or ``[B, H, NG]``
    (entries past a group's count are never read). ``max_bytes`` bounds the temporaries: heads are packed a few
    at a time (one head at least)."""
    if not 2 <= P <= 8:
        raise ValueError(f"pack_token_lists: P must be in [2, 8] (one int8 mask per entry), got {P}")
    B, H, NG, KM = kv_indices.shape  # (PyTorch twin of pack_token_lists; its width is the largest union)
    dev = kv_indices.device
    NP = math.ceil(NG / P)
    counts = group_counts(kv_counts, NG).reshape(B * H, NG)
    lists = kv_indices.reshape(B * H, NG, KM)
    bit = torch.bitwise_left_shift(torch.ones(NG, dtype=torch.int32, device=dev),
                                   torch.arange(NG, device=dev, dtype=torch.int32) % P)
    # bytes per head: its marks and compaction temporaries (~24 per (packed group, key)), its keys and bits (~24
    # per list entry)
    per_head = NP * TK * 24 + NG * KM * 24
    heads = max(1, max_bytes // max(1, per_head))

    def chunk_marks(h0: int, h1: int) -> torch.Tensor:
        """int32 ``[(h1 - h0) * NP, TK]``: per packed group and key, the bits of the groups listing it."""
        valid = torch.arange(KM, device=dev) < counts[h0:h1, :, None]
        keys = torch.where(valid, lists[h0:h1], 0).to(torch.int64)
        bits = torch.where(valid, bit[:, None], 0)
        del valid
        pad = NP * P - NG  # the last packed group's missing members list nothing
        if pad:
            keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
            bits = torch.nn.functional.pad(bits, (0, 0, 0, pad))
        n = (h1 - h0) * NP
        m = torch.zeros(n, TK, dtype=torch.int32, device=dev)
        return m.scatter_add_(1, keys.reshape(n, P * KM), bits.reshape(n, P * KM))

    union = torch.zeros(B * H, NP, dtype=torch.int32, device=dev)
    for h0 in range(0, B * H, heads):
        h1 = min(B * H, h0 + heads)
        union[h0:h1] = (chunk_marks(h0, h1) != 0).sum(1, dtype=torch.int32).view(h1 - h0, NP)
    U = max(1, int(union.max())) if union.numel() else 1  # the one host sync: the packed lists' width
    out_idx = torch.zeros(B * H * NP, U + 1, dtype=torch.int32, device=dev)  # column U: where unmarked keys go
    out_bits = torch.zeros(B * H * NP, U + 1, dtype=torch.int8, device=dev)
    for h0 in range(0, B * H, heads):
        h1 = min(B * H, h0 + heads)
        r0, r1 = h0 * NP, h1 * NP
        m = chunk_marks(h0, h1)
        nz = m != 0
        pos = torch.cumsum(nz, 1).sub_(1).masked_fill_(~nz, U)
        ids = torch.arange(TK, device=dev, dtype=torch.int32).expand(r1 - r0, TK)
        out_idx[r0:r1].scatter_(1, pos, torch.where(nz, ids, 0))
        out_bits[r0:r1].scatter_(1, pos, torch.where(m >= 128, m - 256, m).to(torch.int8))  # bit 7: the sign
        del m, nz, pos
    return (out_idx[:, :U].reshape(B, H, NP, U).contiguous(), out_bits[:, :U].reshape(B, H, NP, U).contiguous(),
            union.reshape(B, H, NP))


# the packed lists of one backward are built and consumed this many bytes at a time (a few (batch, head) rows per
# chunk): their sync-free width makes them about as large as the unpacked lists (at 128K tokens, G = 32, 10% of the
# keys and 16 heads, 4.3 GB against the lists' 3.4 GB), which the backward already holds
PACKED_LISTS_BYTES = 512 << 20


def packed_row_chunks(rows: int, NG: int, P: int, KM: int, TK: int, max_bytes: Optional[int] = None):
    """``[(r0, r1), ...]``: consecutive ranges of the ``rows`` (batch * head) rows of ``[rows, NG, KM]`` lists whose
    packed lists (:func:`pack_token_lists`: int32 keys, int8 masks, an int32 count per packed group) take at most
    ``max_bytes`` (None: :data:`PACKED_LISTS_BYTES`) each; one row at least."""
    budget = PACKED_LISTS_BYTES if max_bytes is None else max_bytes
    NP, W = math.ceil(NG / P), max(1, min(TK, P * KM))
    step = max(1, budget // max(1, NP * (W * 5 + 4)))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


MARK_BLOCK = 256  # list entries per program of the marking pass
COMPACT_WORDS = 64  # bitmap words (32 keys each) per step of the compaction: a 2048-key prefix sum


@triton.jit
def _mark_kernel(idx, cnt, bitmap, KM, NG, NW, NGP, TK, BLOCK: tl.constexpr):
    """Program (row, chunk): list entries [chunk * BLOCK, +BLOCK) of group row = bh * NG + g set their keys'
    bits in the bitmap's row bh * NGP + g (NGP = NP * P: a missing member of the last pack keeps a zero row).
    A key outside [0, TK) sets nothing: unchecked lists (DSV_SKIP_CHECKS) never write outside the bitmap."""
    row = tl.program_id(0)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < tl.load(cnt + row)
    key = tl.load(idx + row.to(tl.int64) * KM + o, mask=m, other=0)
    m = m & (key >= 0) & (key < TK)
    out = (row // NG).to(tl.int64) * NGP + row % NG
    bit = tl.full([BLOCK], 1, tl.int32) << (key & 31)  # bit 31 is the int32 sign: an OR does not mind
    tl.atomic_or(bitmap + out * NW + (key >> 5), bit, mask=m, sem="relaxed")


@triton.jit
def _mark_runs_kernel(idx, cnt, bitmap, KM, NG, NW, NGP, TK, BLOCK: tl.constexpr):
    """:func:`_mark_kernel`'s bitmap with one atomic per run of entries in one 32-key word instead of one per
    entry. A group's keys ascend and are distinct, so the OR of a word's bits is their sum, and a run's sum is the
    difference of two inclusive prefix sums (int32, wrapping: bit 31 is the sign, and differences mod 2^32 stay
    exact): the run's last entry adds the prefix at its place, its first entry subtracts the prefix before it (one
    lane does both for a run of one). A run cut by the block's edge or by a key outside [0, TK) adds in pieces whose
    sum is the same. Lists that are not ascending and distinct (unchecked: DSV_SKIP_CHECKS) get wrong masks here
    but never a write outside the bitmap."""
    row = tl.program_id(0)
    o0 = tl.program_id(1) * BLOCK
    o = o0 + tl.arange(0, BLOCK)
    n = tl.load(cnt + row)
    p_row = idx + row.to(tl.int64) * KM
    key = tl.load(p_row + o, mask=o < n, other=0)
    m = (o < n) & (key >= 0) & (key < TK)
    word = key >> 5
    # the neighbours in this block: a run ends at the block's edges (loads past the block are masked off)
    prv = tl.load(p_row + o - 1, mask=(o > o0) & (o - 1 < n), other=-1)
    nxt = tl.load(p_row + o + 1, mask=(o + 1 < o0 + BLOCK) & (o + 1 < n), other=-1)
    first = m & ~((prv >= 0) & (prv < TK) & ((prv >> 5) == word))
    last = m & ~((nxt >= 0) & (nxt < TK) & ((nxt >> 5) == word))
    bit = tl.where(m, tl.full([BLOCK], 1, tl.int32) << (key & 31), 0)
    incl = tl.cumsum(bit, axis=0)
    add = tl.where(last, incl, 0) - tl.where(first, incl - bit, 0)
    out = (row // NG).to(tl.int64) * NGP + row % NG
    tl.atomic_add(bitmap + out * NW + word, add, mask=first | last, sem="relaxed")


MARK_MODES = ("atomic", "runs")  # pack_token_lists' marking pass: _mark_kernel, _mark_runs_kernel


@triton.jit
def _compact_kernel(bitmap, out_idx, out_bits, out_cnt, NW, W, P: tl.constexpr, WB: tl.constexpr):
    """Program pg (packed group bh * NP + i): the OR of its P members' bitmap rows, compacted in key order into
    out_idx[pg, :count] with each key's member mask in out_bits; count into out_cnt[pg]."""
    pg = tl.program_id(0)
    rows = bitmap + pg.to(tl.int64) * P * NW
    o_b = tl.arange(0, 32)
    keys_in_step = tl.reshape(tl.arange(0, WB)[:, None] * 32 + o_b[None, :], [WB * 32])
    base = pg.to(tl.int64) * W
    n = pg * 0  # keys written so far (int32)
    for w0 in range(0, NW, WB):
        o_w = w0 + tl.arange(0, WB)
        masks = tl.zeros([WB, 32], dtype=tl.int32)
        for p in tl.static_range(P):
            word = tl.load(rows + p * NW + o_w, mask=o_w < NW, other=0)
            masks |= ((word[:, None] >> o_b[None, :]) & 1) << p
        masks = tl.reshape(masks, [WB * 32])
        hit = masks != 0
        pos = n + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(out_idx + base + pos, w0 * 32 + keys_in_step, mask=hit)
        tl.store(out_bits + base + pos, masks.to(tl.int8), mask=hit)
        n += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(out_cnt + pg, n)


def pack_token_lists(kv_indices: torch.Tensor, kv_counts: torch.Tensor, G: int, P: int, TK: int,
                     max_bytes: int = 512 << 20,
                     mark: str = "runs") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices int32 [B, H, NP, W], bits int8 [B, H, NP, W], counts int32 [B, H, NP])`` with
    ``NP = ceil(NG / P)`` and ``W = max(1, min(TK, P * Kmax))``: packed group i lists, ascending, every key
    some group ``P * i + p`` lists (its first ``counts`` entries; the rest is unspecified and never read), and
    bit p of its mask says which of them do. Two Triton launches, no host sync (:func:`pack_token_lists_naive`
    is the twin).

    kv_indices int32 ``[B, H, NG, Kmax]`` token ids in ``[0, TK)``, unique within a group (as
    ``sparse_attention`` requires), kv_counts ``[B, H]`` or ``[B, H, NG]`` (entries past a group's count are
    never read). The width is a bound, not the largest union (that would take a host sync): the packed lists
    take about as much memory as the unpacked ones (``NP * W`` against ``NG * Kmax`` entries), where a width of
    the largest union would take ~1.2-1.4 / P of it on video lists. ``max_bytes`` bounds the key bitmap
    (``NP * P * ceil(TK / 32)`` int32 words a head): heads are packed a few at a time (one head at least).
    ``mark``: the marking pass, one atomic add per run of entries in one bitmap word (``runs``, the default: 2.58
    against 4.39 ms on video-shaped lists and 2.66 against 2.87 on random ones at 64K, G = 32, H100, run 19) or one
    ``atomic_or`` per entry (``atomic``)."""
    if mark not in MARK_MODES:
        raise ValueError(f"pack_token_lists: mark must be one of {MARK_MODES}, got {mark!r}")
    if not 2 <= P <= 8:
        raise ValueError(f"pack_token_lists: P must be in [2, 8] (one int8 mask per entry), got {P}")
    B, H, NG, KM = kv_indices.shape
    dev = kv_indices.device
    NP, NW, BH = math.ceil(NG / P), math.ceil(TK / 32), B * H
    W = max(1, min(TK, P * KM))
    out_idx = torch.empty(BH * NP, W, dtype=torch.int32, device=dev)
    out_bits = torch.empty(BH * NP, W, dtype=torch.int8, device=dev)
    out_cnt = torch.zeros(BH * NP, dtype=torch.int32, device=dev)
    if BH * NP and NW:
        lists = kv_indices.reshape(BH, NG, KM).to(torch.int32).contiguous()
        counts = group_counts(kv_counts, NG).reshape(BH, NG).to(torch.int32).contiguous()
        heads = max(1, min(BH, max_bytes // (NP * P * NW * 4)))
        bitmap = torch.empty(heads * NP * P * NW, dtype=torch.int32, device=dev)
        for h0 in range(0, BH, heads):
            h1 = min(BH, h0 + heads)
            marks = bitmap[:(h1 - h0) * NP * P * NW].zero_()
            if KM:
                marker = _mark_kernel if mark == "atomic" else _mark_runs_kernel
                marker[((h1 - h0) * NG, triton.cdiv(KM, MARK_BLOCK))](
                    lists[h0:h1], counts[h0:h1], marks, KM, NG, NW, NP * P, TK, BLOCK=MARK_BLOCK)
            _compact_kernel[((h1 - h0) * NP,)](marks, out_idx[h0 * NP:h1 * NP], out_bits[h0 * NP:h1 * NP],
                                                out_cnt[h0 * NP:h1 * NP], NW, W, P=P, WB=COMPACT_WORDS)
    return out_idx.view(B, H, NP, W), out_bits.view(B, H, NP, W), out_cnt.view(B, H, NP)

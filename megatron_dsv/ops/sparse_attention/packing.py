"""Packed token lists: P neighbouring query groups run as one group of P * G rows.

Token lists at G = 32 / 64 run their kernels on 32- or 64-row tiles, and the dq kernel's dK/dV atomics are
paid once per (group, listed key): at 64K tokens and 90% sparsity the backward is atomics-bound and scales
as 1 / G (H200, 2026-12-05: 114 / 62 / 34 ms at G = 32 / 64 / 128). Neighbouring query cubes of a video
keep mostly the same keys (``benchmarks/list_shapes.video_lists`` at 64K, 90%: the union of 4 groups of 32
holds 1.41x one group's keys, of 2 groups of 64 1.16x), so packing P = 128 // G groups into one list of
their union runs 128-row tiles over 1.2-1.4x the keys and scatters each listed key's dK/dV once per packed
group instead of once per group. Each entry of a packed list carries a P-bit mask of the groups that list
it (bit p: group ``P * i + p``); the kernels give every other row of the tile zero probability there, so
the result is the unpacked one up to summation order. Uniformly random lists share few keys (the union is
~P times a list), where packing only adds work: it is off unless asked for (``DSV_TOKEN_PACK``). A row's
zero probability still multiplies the packed group's values, so a non-finite key or value row (a diverged run)
turns into NaN in every group of its pack, where unpacked it reaches only the groups that list it.

The union is built on the device per packed group: each group's keys add its bit into a row of ``TK``
int32 marks (distinct bits, so the sum is their OR), then the marked keys are compacted in key order. Its
width, the largest union, is read on the host once per call (one sync), so the packed lists take
``max union`` entries per packed group rather than ``P * Kmax``.
"""

from __future__ import annotations

import math
import os
from typing import Tuple

import torch

from .checks import group_counts

PACK_ROWS = 128  # rows of a packed group: the kernels' widest query tile
PACK_MODES = ("off", "on")


def packing_on() -> bool:
    """``DSV_TOKEN_PACK`` in {off, on} (default off), validated."""
    name = os.environ.get("DSV_TOKEN_PACK", "off").strip().lower() or "off"
    if name not in PACK_MODES:
        raise ValueError(f"DSV_TOKEN_PACK must be one of {PACK_MODES}; got {name!r}")
    return name == "on"


def token_pack_factor(G: int, BS: int) -> int:
    """How many query groups one packed group holds: with :func:`packing_on`, token lists (``BS == 0``) of
    G < 128 pack into groups of 128 rows (P = 128 // G); 1 = no packing."""
    if not packing_on() or BS != 0 or G >= PACK_ROWS:
        return 1
    return PACK_ROWS // G


def pack_token_lists(kv_indices: torch.Tensor, kv_counts: torch.Tensor, G: int, P: int, TK: int,
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
    B, H, NG, KM = kv_indices.shape
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

"""The Triton top-k's methods "keys" and "gemm" (see :mod:`.triton_impl` for the others and the entry point):
every item's ordered int32 key in one pass (``_tk_keys``) or the token scores from one batched matrix product
(``_gemm_scores``, cuBLAS), then the selection kernel (:func:`select_kernel.select_rows_into`: block max, forced
items, the best ``counts`` items per row), one launch per chunk of groups. Rows longer than
:data:`select_kernel.MAX_ITEMS` take the torch twin (``_gemm_keys``, ``_select_chunk_torch``, whose
``_select_from_keys`` is the selection kernel's reference, bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import forced_mask, forced_union
from .scoring import _item_scores
from .select_kernel import fits, select_rows_into


@triton.jit(do_not_specialize=["g0", "n_g"])  # one compile for every chunk of the loop
def _tk_keys(P, Kp, Keys, S, n_items, NG, g0, n_g,
             R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
             DOT: tl.constexpr = False, PACK: tl.constexpr = 1):
    """Method "keys", one program = (BG groups of the chunk [g0, g0 + n_g), BN items, b * h): the ordered
    int32 key of each item, in one scoring pass, into ``Keys`` [B * H, n_g, n_items]; the selection is
    :func:`select_kernel.select_rows_into` (:func:`_select_from_keys` past its ``MAX_ITEMS``)."""
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    offs = pid_g * BG + tl.arange(0, BG)  # rows of the chunk
    mask_g = offs < n_g
    Pb = P + bh.to(tl.int64) * NG * R
    Kb = Kp + bh.to(tl.int64) * S * R
    key, items, valid = _item_scores(Pb, Kb, g0 + offs, mask_g, pid_n * BN, S, n_items, R, BG, BN, BS, LSE, DOT)
    rows = bh.to(tl.int64) * n_g + offs
    tl.store(Keys + rows[:, None] * n_items + items[None, :], key, mask=mask_g[:, None] & valid[None, :])


def _select_from_keys(keys: torch.Tensor, counts: torch.Tensor, kmax: int) -> torch.Tensor:
    """The lists of method "keys" from the ordered int32 keys ``[BH, n, n_items]``: per row the
    ``counts[bh]`` best items (higher key, then lower index), ascending, then -1 padding; int32
    ``[BH, n, kmax]``. One int64 ``torch.topk``: key in the high word, ``n_items - 1 - index`` in the low
    word, so the order of the packed values is the tie rule itself; the best ``kmax`` come sorted, and a
    row keeps the first ``counts[bh]`` of them."""
    n_items = keys.shape[-1]
    low = n_items - 1 - torch.arange(n_items, device=keys.device, dtype=torch.int64)
    packed = keys.to(torch.int64)
    packed.mul_(1 << 32).add_(low)  # in place: 12 bytes per key with the int32 keys, not 20
    top = torch.topk(packed, kmax, dim=-1, sorted=True).values
    idx = (n_items - 1) - (top & 0xFFFFFFFF)
    keep = torch.arange(kmax, device=keys.device) < counts.reshape(-1, 1, 1).to(keys.device)
    idx = torch.sort(torch.where(keep, idx, n_items), dim=-1).values  # dropped slots sort last
    return torch.where(idx == n_items, -1, idx).to(torch.int32)


def _reduce_block(s3: torch.Tensor, lse: bool) -> torch.Tensor:
    """[..., blocks, tokens] -> [..., blocks]: the max, or the log-sum-exp as ``_scores_at`` computes it (in
    place on ``s3``, whose scores are not needed after)."""
    m = s3.amax(dim=-1)
    if not lse:
        return m
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return m_safe + torch.log(s3.sub_(m_safe.unsqueeze(-1)).exp_().sum(dim=-1))


def _gemm_operand(x: torch.Tensor) -> torch.Tensor:
    """The dtype "gemm" multiplies in: float32 for bf16/fp16 inputs (their values and products are exact in it,
    and in TF32, so torch's matmul precision setting changes nothing), float64 for float32 inputs (no global
    setting touched; the scores are rounded to float32 after the sum)."""
    return x.double() if x.dtype == torch.float32 else x.float()


def _gemm_scores(pg: torch.Tensor, kg: torch.Tensor, g0: int, n: int) -> torch.Tensor:
    """The token scores ``[B * H, n, Sk]`` of groups ``[g0, g0 + n)`` from ONE batched matrix product (cuBLAS on a
    GPU) of their proxies (``pg`` [B * H, NG, r]) with every key (``kg`` [B * H, Sk, r]), both in
    :func:`_gemm_operand`'s dtype, which the scores keep (float64 for float32 inputs). The sum over r runs in the
    library's order, not the reference's (d = 0..r-1): a score may differ from it by a few units in its last
    place where terms cancel (about r * eps * max |p_d k_d|), so only items tied within that can swap, as on the
    CUDA kernel's tensor-core path; integer-valued inputs are exact."""
    return torch.bmm(pg[:, g0:g0 + n], kg.transpose(1, 2))


def _block_scores(s: torch.Tensor, block_size: int, lse: bool, n_items: int) -> torch.Tensor:
    """float32 ``[..., Sk]`` token scores -> ``[..., n_items]``: the max (or log-sum-exp) of each block of
    ``block_size`` tokens (0: the tokens themselves), in torch; may overwrite ``s``."""
    if not block_size:
        return s
    Sk = s.shape[-1]
    whole = Sk // block_size  # whole blocks as a view, the partial last block (if any) apart: no padded copy
    parts = [s[..., :whole * block_size].unflatten(-1, (whole, block_size))] if whole else []
    if whole < n_items:
        parts.append(s[..., whole * block_size:].unsqueeze(-2))
    if len(parts) == 1:
        return _reduce_block(parts[0], lse)
    return torch.cat([_reduce_block(x, lse) for x in parts], dim=-1)


def _ordered_keys(s: torch.Tensor) -> torch.Tensor:
    """float32 scores -> their monotone int32 keys (-0.0 read as +0.0)."""
    key = (s + 0.0).view(torch.int32)
    return torch.where(key >= 0, key, key ^ 0x7FFFFFFF)


def _gemm_keys(proxies: torch.Tensor, kg: torch.Tensor, g0: int, n: int, block_size: int, lse: bool,
               n_items: int) -> torch.Tensor:
    """Method "gemm" in torch: the ordered int32 keys ``[B * H, n, n_items]`` of groups ``[g0, g0 + n)``
    (:func:`_gemm_scores`, rounded to float32, then :func:`_block_scores`); the reference of the kernel's
    fused block max, and the path of rows longer than :data:`select_kernel.MAX_ITEMS`."""
    BH, NG, r = proxies.shape[0] * proxies.shape[1], proxies.shape[2], proxies.shape[3]
    s = _gemm_scores(proxies.reshape(BH, NG, r).to(kg.dtype), kg, g0, n)
    return _ordered_keys(_block_scores(s.float(), block_size, lse, n_items))


def _select_chunk_torch(keys: torch.Tensor, counts: torch.Tensor, kmax: int, forced_rows, forced_extra: bool,
                        n_items: int):
    """The torch selection of one chunk (the kernel's twin, kept for rows past
    :data:`select_kernel.MAX_ITEMS`): forced items (``forced_rows`` [n, F] or None) take the top key (the
    bottom one with ``forced_extra``), :func:`_select_from_keys`, then with ``forced_extra`` the union with the
    forced items. Returns (lists ``[BH, n, W]``, per-group counts ``[BH, n]`` or None)."""
    if forced_rows is not None:  # the top ordered key (below every score with forced_extra), ties by lower index
        info = torch.iinfo(torch.int32)
        keys.masked_fill_(forced_mask(forced_rows, n_items), info.min if forced_extra else info.max)
    chosen = _select_from_keys(keys, counts, kmax)
    if forced_extra:
        return forced_union(chosen, forced_rows, n_items)
    return chosen, None


def _lists_by_keys(method: str, P, proxies, k, out, group_counts, forced, chunk_elems: int, meta: dict) -> None:
    """Methods "keys" and "gemm": ``out`` ``[B, H, NG, W]`` (and ``group_counts`` ``[B, H, NG]``, given with
    ``forced_extra``) filled chunk by chunk of groups (``chunk_elems``, see :func:`estimate_topk_triton`): per
    chunk the keys (:func:`_tk_keys`) or the scores (:func:`_gemm_scores`), then ONE selection launch
    (:func:`select_kernel.select_rows_into`: block max, forced items, selection), or for rows past its
    ``MAX_ITEMS`` items the torch path (:func:`_gemm_keys`, :func:`_select_chunk_torch`)."""
    BH, bs, lse, extra = P.B * P.H, P.block_size, meta["LSE"], group_counts is not None
    # keys: int32 keys (and their int64 packing) per group; gemm: its scores, 4x as many allowed in float32
    # (2x in float64, the product's dtype for float32 inputs)
    per_group = BH * P.num_items
    if method == "gemm":
        kg = _gemm_operand(k).reshape(BH, P.Sk, P.r)
        pg = proxies.reshape(BH, P.num_groups, P.r).to(kg.dtype)
        per_group = BH * max(P.num_items, -(-P.Sk // (2 if kg.dtype == torch.float64 else 4)))
    n_g = max(1, min(P.num_groups, chunk_elems // max(1, per_group)))
    rows = out.view(BH, P.num_groups, out.shape[-1])
    row_counts = group_counts.view(BH, P.num_groups) if extra else None
    counts = P.counts.view(BH)
    fused = fits(P.num_items)  # a row's keys fit one program
    for g0 in range(0, P.num_groups, n_g):
        n = min(n_g, P.num_groups - g0)
        f_rows = None if forced is None else forced[g0:g0 + n]
        src_bs = 1
        if method == "gemm" and fused:
            src, src_bs = _gemm_scores(pg, kg, g0, n), max(1, bs)
            if lse and bs:  # torch's exp/log bits: reduced in torch, selected in the kernel
                src, src_bs = _block_scores(src.float(), bs, True, P.num_items), 1
        elif method == "gemm":
            src = _gemm_keys(proxies, kg, g0, n, bs, lse, P.num_items)
        else:
            src = torch.empty(BH, n, P.num_items, dtype=torch.int32, device=out.device)
            _tk_keys[(triton.cdiv(n, meta["BG"]), triton.cdiv(P.num_items, meta["BN"]), BH)](
                proxies, k, src, P.Sk, P.num_items, P.num_groups, g0, n, **meta)
        if fused:
            select_rows_into(rows, src, counts, g0, P.num_items, src_bs, f_rows, extra, row_counts)
            continue
        chosen, chunk_counts = _select_chunk_torch(src, counts, P.kmax, f_rows, extra, P.num_items)
        rows[:, g0:g0 + n] = chosen
        if extra:
            row_counts[:, g0:g0 + n] = chunk_counts

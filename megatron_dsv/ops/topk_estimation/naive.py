"""Reference top-k estimation: chunked scores + exact tie-aware selection (the spec; the CPU path).

Scores follow the bit-exact definition in ``common.py``. Memory: one chunk of
groups x items scores at a time (``chunk_elems`` elements), never all heads.
Query and key lengths may differ: groups tile q_lr's Sq, items are k_lr's Sk
tokens or key blocks.
"""

from __future__ import annotations

import functools

import torch

from .common import check_forced, check_problem, forced_mask, forced_union

__all__ = ["estimate_topk_naive", "group_proxies", "item_scores"]


def group_proxies(q: torch.Tensor, group_size: int, proxy: str, kernel: bool | None = None) -> torch.Tensor:
    """[..., S, r] -> [..., NG, r] proxies in q's dtype (sum in token order, float32).

    "mean": the group's tokens added one after another in float32 (``acc = q_0``, then ``acc = acc + q_i``, a
    partial last group's missing tokens adding +0.0), divided by the group's length. On CUDA the sums come from
    one Triton kernel doing the same additions in the same order (:func:`triton_impl.group_sums`: the same
    bits; the loop here is G - 1 kernel launches a call, 127 at G=128, which left the GPU step host-bound).
    ``kernel``: force the kernel (True: the Triton backend, also under the interpreter) or the loop (False);
    None: the kernel on CUDA."""
    S = q.shape[-2]
    NG = -(-S // group_size)
    if proxy == "middle":
        start = torch.arange(NG, device=q.device) * group_size
        n = torch.clamp(S - start, max=group_size)
        return q[..., start + n // 2, :]
    acc = None
    if q.is_cuda if kernel is None else kernel:
        try:
            from .triton_impl import group_sums
        except ImportError:  # no Triton on this platform (kernel=True asks for it: raise)
            if kernel:
                raise
        else:
            acc = group_sums(q, group_size)
    if acc is None:
        acc = group_sums_loop(q, group_size)
    return (acc / group_lengths(S, group_size, q.device)[:, None]).to(q.dtype)


@functools.lru_cache(maxsize=64)
def group_lengths(S: int, group_size: int, device: torch.device) -> torch.Tensor:
    """float32 ``[NG]``: the tokens of each query group (``group_size``, the last one what is left), made once per
    (S, G, device) and cached (read-only): built on the device every call, writing its last entry from the host
    was a blocking copy, one stream sync a layer."""
    NG = -(-S // group_size)
    n = torch.full((NG,), float(group_size), dtype=torch.float32)
    n[-1] = S - (NG - 1) * group_size
    return n.to(device)


def group_sums_loop(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., S, r] -> float32 [..., NG, r]: each group's tokens added in token order (the reference order)."""
    S = q.shape[-2]
    NG = -(-S // group_size)
    pad = NG * group_size - S
    qf = q.float()
    if pad:
        qf = torch.cat([qf, qf.new_zeros(*qf.shape[:-2], pad, qf.shape[-1])], dim=-2)
    qf = qf.reshape(*qf.shape[:-2], NG, group_size, qf.shape[-1])
    acc = qf[..., 0, :].clone()
    for i in range(1, group_size):  # fixed order: every backend adds tokens in this order
        acc = acc + qf[..., i, :]
    return acc


def token_scores(p: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """p [..., n, r], k [..., Sk, r] -> float32 [..., n, Sk], summed in order d = 0..r-1."""
    pf, kf = p.float(), k.float()
    s = pf[..., :, None, 0] * kf[..., None, :, 0]
    for d in range(1, p.shape[-1]):
        s = s + pf[..., :, None, d] * kf[..., None, :, d]
    return s + 0.0  # -0.0 -> +0.0


def block_view(x: torch.Tensor, block_size: int, fill: float) -> torch.Tensor:
    """``x [..., S]`` as ``[..., ceil(S / block_size), block_size]``, the last block padded with ``fill``."""
    S = x.shape[-1]
    nb = -(-S // block_size)
    pad = nb * block_size - S
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:-1], pad), fill)], dim=-1)
    return x.reshape(*x.shape[:-1], nb, block_size)


def item_scores(p, k, block_size: int, block_score: str) -> torch.Tensor:
    """Scores of tokens (block_size 0) or key blocks: float32 [..., n, num_items]."""
    return reduce_blocks(token_scores(p, k), block_size, block_score)


def reduce_blocks(s: torch.Tensor, block_size: int, block_score: str) -> torch.Tensor:
    """Token scores ``[..., S]`` -> item scores: themselves (block_size 0) or per key block its max or
    logsumexp (the last block padded with -inf)."""
    if block_size == 0:
        return s + 0.0  # -0.0 -> +0.0
    s = block_view(s, block_size, float("-inf"))
    out = s.amax(-1) if block_score == "max" else torch.logsumexp(s, dim=-1)
    return out + 0.0


def select_topk_sorted(s: torch.Tensor, K: int) -> torch.Tensor:
    """Indices of the K best items per row (higher score, then lower index), ascending. int32 [..., K]."""
    n = s.shape[-1]
    if K == 0:
        return torch.empty(*s.shape[:-1], 0, dtype=torch.int32, device=s.device)
    t = torch.topk(s, K, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    gt = s > t
    eq = s == t
    need = K - gt.sum(-1, keepdim=True)
    sel = gt | (eq & (torch.cumsum(eq.to(torch.int32), -1) <= need))
    pos = torch.arange(n, device=s.device, dtype=torch.int64).expand_as(s)
    key = torch.where(sel, pos, torch.full_like(pos, n))
    return torch.sort(key, dim=-1).values[..., :K].to(torch.int32)


def estimate_topk_naive(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean",
                        block_score="max", chunk_elems: int = 1 << 24, forced=None, forced_extra: bool = False):
    """Same contract as :func:`estimate_topk`; chunked over groups, one (b, h) at a time.

    q_lr [B, H, Sq, r], k_lr [B, H, Sk, r] -> idx int32 [B, H, ceil(Sq / G), Kmax], counts int32 [B, H].
    ``forced`` [NG, F]: items ranked first in every group (their score read as +inf). ``forced_extra``: the
    budgets count only the other items; every group keeps its forced ones besides (their score read as -inf
    for the selection): idx [B, H, NG, F + Kmax], counts int32 [B, H, NG].
    """
    P = check_problem(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)
    if forced_extra and forced is None:
        raise ValueError("estimate_topk: `forced_extra` needs `forced` items")
    if forced is not None:
        forced = check_forced(forced, P.num_groups, P.num_items, q_lr.device)
    width = P.kmax + (forced.shape[1] if forced_extra else 0)
    idx = torch.full((P.B, P.H, P.num_groups, width), -1, dtype=torch.int32, device=q_lr.device)
    counts = P.counts
    if forced_extra:
        counts = torch.zeros(P.B, P.H, P.num_groups, dtype=torch.int32, device=q_lr.device)
    counts_cpu = P.counts.cpu()
    proxies = group_proxies(q_lr, group_size, proxy)  # [B, H, NG, r]
    chunk = max(1, chunk_elems // max(1, P.Sk))
    for b in range(P.B):
        for h in range(P.H):
            K = int(counts_cpu[b, h])
            if K == 0 and not forced_extra:
                continue
            for g0 in range(0, P.num_groups, chunk):
                g1 = min(P.num_groups, g0 + chunk)
                s = item_scores(proxies[b, h, g0:g1], k_lr[b, h], block_size, block_score)
                if forced is not None:
                    fill = float("-inf") if forced_extra else float("inf")
                    s.masked_fill_(forced_mask(forced[g0:g1], P.num_items), fill)
                if forced_extra:
                    rows, counts[b, h, g0:g1] = forced_union(select_topk_sorted(s, K), forced[g0:g1], P.num_items)
                    idx[b, h, g0:g1, :rows.shape[-1]] = rows
                else:
                    idx[b, h, g0:g1, :K] = select_topk_sorted(s, K)
    return idx, counts

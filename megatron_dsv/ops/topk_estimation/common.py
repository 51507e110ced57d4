"""Argument checking and the score definition shared by every backend.

The score of item j for query group g is defined bit for bit, so that every
backend can be compared exactly with ``naive.py``:

- proxy ("mean"): the group's ``q_lr`` rows summed in float32 in token order,
  divided by the group's token count, rounded to the input dtype;
  proxy ("middle"): the row of token ``start + n // 2`` (``n`` = tokens in the group).
- token score: ``sum_d proxy[d] * k[j, d]`` accumulated in float32 (products of
  bf16/fp16 operands are exact in float32); ``-0.0`` is read as ``+0.0``.
  The naive path and the CUDA fp32 path add in order d = 0..r-1; the CUDA
  bf16/fp16 path uses tensor cores, whose float32 accumulation may round the
  last bit differently, so only exact ties at that level can break differently.
- block score: max (default) or log-sum-exp of the block's token scores.
- order: higher score first, equal scores broken by the lower index.
- forced items (``forced``, DSV's local + predicted lists): a group's listed items rank above every
  other item (as if their score were +inf), lower index first among them; the budget counts them.
  With ``forced_extra`` the budget counts only the others: a group keeps all its forced items plus the
  budget's best other items (by the order above), so list lengths differ by group (``counts [B, H, NG]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

PROXIES = ("mean", "middle")
BLOCK_SCORES = ("max", "lse")
BLOCK_SIZES = (0, 64, 128)
RANKS = (8, 16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TopkProblem:
    """Validated sizes of one estimation call."""

    B: int
    H: int
    S: int  # query length Sq
    Sk: int  # key length (may differ from S: a context-parallel rank's queries vs its gathered keys)
    r: int
    group_size: int
    block_size: int
    num_groups: int  # NG = ceil(S / G), groups of the queries
    num_items: int  # keys of Sk (token granularity) or key blocks of Sk
    counts: torch.Tensor  # int32 [B, H] on the inputs' device, clipped budgets
    kmax: int
    proxy: str
    block_score: str


def _fail(name: str, msg: str):
    raise ValueError(f"estimate_topk: `{name}` {msg}")


def check_problem(q_lr, k_lr, budgets: Union[int, torch.Tensor], group_size, block_size=0,
                  proxy="mean", block_score="max") -> TopkProblem:
    """Validate every argument; return sizes and the clipped per-(batch, head) counts.

    q_lr ``[B, H, Sq, r]``, k_lr ``[B, H, Sk, r]`` (any ``Sk >= 1``): items range over Sk's
    tokens or key blocks, groups over Sq, budgets are clipped to the items of Sk.
    """
    for name, t in (("q_lr", q_lr), ("k_lr", k_lr)):
        if not isinstance(t, torch.Tensor):
            _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            _fail(name, f"must be [B, H, S, r], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            _fail(name, f"dtype must be one of float32/float16/bfloat16, got {t.dtype}")
    if (k_lr.shape[0], k_lr.shape[1], k_lr.shape[3]) != (q_lr.shape[0], q_lr.shape[1], q_lr.shape[3]) \
            or k_lr.shape[2] < 1:
        _fail("k_lr", f"shape {tuple(k_lr.shape)} must be [B, H, Sk >= 1, r] with q_lr's B, H, r "
                      f"{tuple(q_lr.shape)} (no GQA here)")
    if q_lr.dtype != k_lr.dtype:
        _fail("k_lr", f"dtype {k_lr.dtype} must equal q_lr's {q_lr.dtype}")
    if q_lr.device != k_lr.device:
        _fail("k_lr", f"device {k_lr.device} must equal q_lr's {q_lr.device}")
    B, H, S, r = q_lr.shape
    if B < 1 or H < 1 or S < 1:
        _fail("q_lr", f"needs B, H, S >= 1, got {tuple(q_lr.shape)}")
    if r not in RANKS:
        _fail("q_lr", f"rank r (last dim) must be one of {RANKS}, got {r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        _fail("group_size", f"must be an int >= 1, got {group_size!r}")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        _fail("block_size", f"must be one of {BLOCK_SIZES} (0 = token granularity), got {block_size!r}")
    if proxy not in PROXIES:
        _fail("proxy", f"must be one of {PROXIES}, got {proxy!r}")
    if block_score not in BLOCK_SCORES:
        _fail("block_score", f"must be one of {BLOCK_SCORES}, got {block_score!r}")
    Sk = k_lr.shape[2]
    num_items = Sk if block_size == 0 else -(-Sk // block_size)
    counts = _budget_counts(budgets, B, H, num_items, q_lr.device)
    kmax = int(counts.max().item())  # counts live on the host: no device sync
    if q_lr.is_cuda:  # pinned + non_blocking: a plain .to() of pageable memory syncs the stream
        device_counts = counts.pin_memory().to(q_lr.device, non_blocking=True)
    else:
        device_counts = counts.to(q_lr.device)
    return TopkProblem(B, H, S, Sk, r, group_size, block_size, -(-S // group_size), num_items,
                       device_counts, kmax, proxy, block_score)


def _budget_counts(budgets, B, H, num_items, device) -> torch.Tensor:
    if isinstance(budgets, bool):
        _fail("budgets", "must be an int or an integer tensor [H] or [B, H], got a bool")
    if isinstance(budgets, int):
        budgets = torch.full((B, H), budgets, dtype=torch.int64)
    if not isinstance(budgets, torch.Tensor):
        _fail("budgets", f"must be an int or an integer tensor [H] or [B, H], got {type(budgets).__name__}")
    if budgets.dtype.is_floating_point or budgets.dtype == torch.bool or budgets.is_complex():
        _fail("budgets", f"must have an integer dtype, got {budgets.dtype}")
    if budgets.dim() == 1 and budgets.shape[0] == H:
        budgets = budgets.unsqueeze(0).expand(B, H)
    elif not (budgets.dim() == 2 and tuple(budgets.shape) == (B, H)):
        _fail("budgets", f"must have shape [H]={[H]} or [B, H]={[B, H]}, got {tuple(budgets.shape)}")
    b = budgets.detach().to("cpu", torch.int64)
    if bool((b < 0).any()):
        _fail("budgets", f"entries must be >= 0, got min {int(b.min())}")
    return b.clamp(max=num_items).to(torch.int32).contiguous()


def check_forced(forced, num_groups: int, num_items: int, device) -> torch.Tensor:
    """Validated forced items: int64 ``[num_groups, F]`` on ``device`` (entries in [0, num_items), or -1
    padding), from an integer tensor of that shape shared by every batch and head (or ``[1, F]`` for all
    groups). Every backend ranks a group's forced items first (see the module docstring). The entries are
    checked when ``forced`` is a CPU tensor (before its copy to ``device``): on a GPU the check would sync
    the stream on every call, and the lists DSV passes (``attention/neighbourhood.py``) are valid by
    construction."""
    if not isinstance(forced, torch.Tensor) or forced.dim() != 2:
        _fail("forced", f"must be an integer tensor [num_groups, F] (-1 padded), got "
                        f"{tuple(getattr(forced, 'shape', ())) or type(forced).__name__}")
    if forced.dtype.is_floating_point or forced.dtype == torch.bool or forced.is_complex():
        _fail("forced", f"must have an integer dtype, got {forced.dtype}")
    if forced.shape[0] not in (1, num_groups):
        _fail("forced", f"must have one row per query group ({num_groups}) or one row for all, got "
                        f"{tuple(forced.shape)}")
    # checked where the given tensor lives on the host (before any copy to the GPU): no stream sync
    if forced.device.type == "cpu" and forced.numel() and bool(((forced < -1) | (forced >= num_items)).any()):
        _fail("forced", f"entries must be item ids in [0, {num_items}) or -1 padding, got min {int(forced.min())}, "
                        f"max {int(forced.max())}")
    return forced.to(device=device, dtype=torch.int64).expand(num_groups, -1)


def tensor_core_scorable(dtype: torch.dtype, r: int) -> bool:
    """Whether the Triton kernels can score inputs of ``dtype`` with ``r`` ranks on tensor cores (``dot="tc"``):
    fp16/bf16 (fp32 would round to TF32) and r a power of two >= 16 (one MMA's k)."""
    return dtype in (torch.float16, torch.bfloat16) and r >= 16 and not r & (r - 1)


def forced_mask(rows: torch.Tensor, num_items: int) -> torch.Tensor:
    """Bool ``[n, num_items]``: True at the forced items of ``rows`` (int64 ``[n, F]``, -1 padded)."""
    mask = torch.zeros(rows.shape[0], num_items + 1, dtype=torch.bool, device=rows.device)
    mask.scatter_(1, torch.where(rows >= 0, rows, num_items), True)  # padding -> spare column, dropped
    return mask[:, :num_items]


def forced_union(selected: torch.Tensor, forced: torch.Tensor, num_items: int):
    """The lists of ``forced_extra``: per group its forced items and its ``selected`` ones, ascending, each once.

    ``selected`` int32 ``[..., n, K]`` (item ids, -1 padding; may repeat a forced item when a group has fewer
    other items than the budget), ``forced`` int64 ``[n, F]`` (-1 padded, shared by the leading dims). Returns
    ``(idx int32 [..., n, F + K], counts int32 [..., n])``: the union ascending, then -1 padding."""
    lead, n, K = selected.shape[:-2], selected.shape[-2], selected.shape[-1]
    F = forced.shape[-1]
    mark = torch.zeros(*lead, n, num_items + 1, dtype=torch.bool, device=selected.device)
    if F:  # padding -> the spare column, dropped
        rows = torch.where(forced >= 0, forced, num_items).to(selected.device)
        mark.scatter_(-1, rows.expand(*lead, n, F), True)
    if K:
        mark.scatter_(-1, torch.where(selected >= 0, selected.long(), num_items), True)
    mark = mark[..., :num_items]
    counts = mark.sum(-1, dtype=torch.int32)
    width = min(num_items, F + K)
    pos = torch.arange(num_items, device=selected.device)
    idx = torch.sort(torch.where(mark, pos, num_items), dim=-1).values[..., :width]
    idx = torch.where(idx == num_items, -1, idx).to(torch.int32)
    if width < F + K:  # at most every item: pad to the documented width
        idx = torch.cat([idx, idx.new_full((*lead, n, F + K - width), -1)], dim=-1)
    return idx, counts

"""Forced items (DSV's local + predicted lists): every backend ranks a group's forced items first,
then the rest by low-rank score; the budget counts both. Checked against a brute-force sort per group,
with heavy ties (small-integer inputs), -1 padding, budgets below the forced count, token and block
granularity, and the triton backend's "keys" (under the interpreter) and "gemm" methods (fp32, fp16)."""

import os

import pytest
import torch

from megatron_dsv.ops.topk_estimation import estimate_topk, estimate_topk_naive
from megatron_dsv.ops.topk_estimation.naive import group_proxies, item_scores

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ints(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype).to(DEV)


def _forced(num_groups, num_items, width, seed):
    """Random forced rows: distinct ascending ids, a random number of them, then -1 padding."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((num_groups, width), -1, dtype=torch.int32)
    for i in range(num_groups):
        n = int(torch.randint(0, width + 1, (1,), generator=g))
        rows[i, :n] = torch.randperm(num_items, generator=g)[:n].sort().values.to(torch.int32)
    return rows


def _brute(q, k, budgets, G, bs, proxy, forced):
    """Per (b, h, group): sort items by (forced first, by index among them; then score desc, index asc),
    keep the count, ascending."""
    B, H = q.shape[:2]
    scores = item_scores(group_proxies(q, G, proxy), k, bs, "max")  # [B, H, NG, n]
    NG, n = scores.shape[2:]
    counts = torch.as_tensor(budgets).expand(B, H).clamp(max=n)
    out = torch.full((B, H, NG, int(counts.max())), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            K = int(counts[b, h])
            for g in range(NG):
                f = set(int(x) for x in forced[g] if x >= 0)
                order = sorted(range(n), key=lambda j: (j not in f, 0.0 if j in f else -float(scores[b, h, g, j]), j))
                out[b, h, g, :K] = torch.tensor(sorted(order[:K]), dtype=torch.int32)
    return out


CASES = [  # B, H, S, r, G, block_size, proxy, budgets, forced width
    pytest.param(1, 2, 640, 16, 64, 64, "mean", [3, 6], 4, id="blk64-S640"),
    pytest.param(2, 1, 520, 8, 32, 128, "middle", [[1], [5]], 3, id="blk128-S520-partial-below-forced"),
    pytest.param(1, 2, 96, 16, 32, 0, "mean", [10, 40], 12, id="tok-S96"),
]


@pytest.mark.parametrize("B,H,S,r,G,bs,proxy,budgets,width", CASES)
def test_naive_forced_equals_brute_force(B, H, S, r, G, bs, proxy, budgets, width):
    q, k = _ints((B, H, S, r), torch.float32, 1), _ints((B, H, S, r), torch.float32, 2)
    n_items = S if bs == 0 else -(-S // bs)
    forced = _forced(-(-S // G), n_items, width, 3)
    idx, counts = estimate_topk_naive(q, k, torch.tensor(budgets), G, bs, proxy, forced=forced)
    ref = _brute(q.cpu(), k.cpu(), torch.tensor(budgets), G, bs, proxy, forced)
    assert torch.equal(idx.cpu(), ref)
    # wherever the budget holds the forced items, all of them are in the list
    for g in range(forced.shape[0]):
        f = set(int(x) for x in forced[g] if x >= 0)
        for b in range(B):
            for h in range(H):
                K = int(counts[b, h])
                if K >= len(f):
                    assert f <= set(idx[b, h, g, :K].tolist())


@pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU needs TRITON_INTERPRET=1 (set by tests/conftest.py)")
@pytest.mark.parametrize("B,H,S,r,G,bs,proxy,budgets,width", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("method", ["keys", "gemm"])
def test_triton_forced_equals_naive(B, H, S, r, G, bs, proxy, budgets, width, dtype, method):
    from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton

    q, k = _ints((B, H, S, r), dtype, 4), _ints((B, H, S, r), dtype, 5)
    n_items = S if bs == 0 else -(-S // bs)
    forced = _forced(-(-S // G), n_items, width, 6).to(DEV)
    ref = estimate_topk_naive(q, k, torch.tensor(budgets), G, bs, proxy, forced=forced)
    # "gemm" chunks by its scores: float32 ones (4 per chunk element) for fp16, float64 (2) for fp32 inputs
    per_group = n_items if method == "keys" else max(n_items, -(-S // (2 if dtype == torch.float32 else 4)))
    for chunk in (1 << 25, 2 * per_group * B * H + 1):  # one chunk; two groups per chunk
        got = estimate_topk_triton(q, k, torch.tensor(budgets), G, bs, proxy, forced=forced, chunk_elems=chunk,
                                   method=method)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_forced_one_row_broadcasts_and_errors():
    q = _ints((1, 1, 256, 16), torch.float32, 7)
    row = torch.tensor([[0, 3, -1]])
    a = estimate_topk_naive(q, q, 2, 64, 64, forced=row)[0]
    assert a[0, 0].cpu().tolist() == [[0, 3]] * 4
    for bad, msg in [(torch.tensor([[0, 4]]), "item ids in"), (torch.zeros(3, 2, dtype=torch.long), "one row per"),
                     (torch.zeros(4, 1), "integer dtype"), (torch.zeros(4), r"\[num_groups, F\]")]:
        with pytest.raises(ValueError, match=msg):
            estimate_topk_naive(q, q, 2, 64, 64, forced=bad)
    with pytest.raises(ValueError, match="not supported by the cuda backend"):
        estimate_topk(q, q, 2, 64, 64, backend="cuda", forced=row)


def _brute_extra(q, k, budgets, G, bs, proxy, forced):
    """forced_extra: per (b, h, group) the forced items plus the budget's best others (score desc, index asc),
    ascending; counts per group."""
    B, H = q.shape[:2]
    scores = item_scores(group_proxies(q, G, proxy), k, bs, "max")
    NG, n = scores.shape[2:]
    budgets = torch.as_tensor(budgets).expand(B, H).clamp(max=n)
    width = forced.shape[1] + int(budgets.max())
    out = torch.full((B, H, NG, width), -1, dtype=torch.int32)
    counts = torch.zeros(B, H, NG, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(NG):
                f = set(int(x) for x in forced[g] if x >= 0)
                rest = sorted((j for j in range(n) if j not in f), key=lambda j: (-float(scores[b, h, g, j]), j))
                keep = sorted(f | set(rest[:int(budgets[b, h])]))
                out[b, h, g, :len(keep)] = torch.tensor(keep, dtype=torch.int32)
                counts[b, h, g] = len(keep)
    return out, counts


EXTRA_CASES = CASES + [  # a budget past the other items: the group keeps every item once
    pytest.param(1, 2, 256, 8, 64, 64, "mean", [0, 4], 3, id="blk64-S256-zero-and-all"),
]


@pytest.mark.parametrize("B,H,S,r,G,bs,proxy,budgets,width", EXTRA_CASES)
def test_forced_extra_keeps_every_forced_item_plus_the_budget(B, H, S, r, G, bs, proxy, budgets, width):
    """local_mode 'window': each group's whole neighbourhood plus the head's budget of predicted items, so list
    lengths differ by group; naive and triton ("keys" under the interpreter, "gemm") against brute force."""
    q, k = _ints((B, H, S, r), torch.float32, 11), _ints((B, H, S, r), torch.float32, 12)
    n_items = S if bs == 0 else -(-S // bs)
    forced = _forced(-(-S // G), n_items, width, 13)
    ref_idx, ref_counts = _brute_extra(q.cpu(), k.cpu(), torch.tensor(budgets), G, bs, proxy, forced)
    idx, counts = estimate_topk_naive(q, k, torch.tensor(budgets), G, bs, proxy, forced=forced.to(DEV),
                                      forced_extra=True)
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(counts.cpu(), ref_counts)
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return
    from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton

    for method in ("keys", "gemm"):
        for chunk in (1 << 25, 2 * max(n_items, S) * B * H + 1):  # one chunk; a few groups per chunk
            got = estimate_topk_triton(q, k, torch.tensor(budgets), G, bs, proxy, forced=forced.to(DEV),
                                       forced_extra=True, chunk_elems=chunk, method=method)
            assert torch.equal(got[0].cpu(), ref_idx) and torch.equal(got[1].cpu(), ref_counts), (method, chunk)


def test_forced_extra_needs_forced_items():
    q = _ints((1, 1, 256, 16), torch.float32, 7)
    with pytest.raises(ValueError, match="forced_extra"):
        estimate_topk(q, q, 2, 64, 64, backend="naive", forced_extra=True)

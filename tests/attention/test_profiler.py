"""budget_for_recall: the smallest list length whose estimated lists reach a recall target.

Checked against the ops themselves: lists from ``estimate_topk_naive`` scored with
``critical_mass_recall`` must reach the target at the returned budget and miss it one item below.
"""

import pytest
import torch

from megatron_dsv.attention.profiler import budget_for_recall, recall_curve, smallest_k_reaching
from megatron_dsv.ops.topk_estimation import critical_counts, critical_mass_recall, estimate_topk_naive


def _planted(B=2, H=2, hkv=2, S=640, D=32, r=16, clusters=6, seed=0):
    """q, k with clustered keys (critical keys are a random, non-local subset) and noisy rank-r
    low-rank features, so the low-rank ranking is good but not perfect."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(hkv, clusters, D, generator=g) * 1.5
    kc = torch.randint(0, clusters, (B, hkv, S), generator=g)
    k = torch.gather(centers.expand(B, -1, -1, -1), 2, kc[..., None].expand(-1, -1, -1, D))
    k = k + 0.4 * torch.randn(B, hkv, S, D, generator=g)
    qc = torch.randint(0, clusters, (B, H, S // 16), generator=g).repeat_interleave(16, -1)
    kv_of_q = torch.arange(H) // (H // hkv)
    q = torch.gather(centers[kv_of_q].expand(B, -1, -1, -1), 2, qc[..., None].expand(-1, -1, -1, D))
    q = q + 0.4 * torch.randn(B, H, S, D, generator=g)
    proj = torch.randn(D, r, generator=g) / r ** 0.5
    k_full = k.repeat_interleave(H // hkv, dim=1)
    q_lr = q @ proj + 0.3 * torch.randn(B, H, S, r, generator=g)
    k_lr = k_full @ proj
    return q, k, q_lr, k_lr


def _recall_at(q, k, q_lr, k_lr, budgets, G, block, qidx, proxy="mean", block_score="max"):
    idx, counts = estimate_topk_naive(q_lr, k_lr, budgets, G, block, proxy, block_score)
    return critical_mass_recall(q, k, idx, counts, G, block, 0.9, None, qidx)


_CASES = [(16, 0, "mean", "max"), (16, 64, "mean", "max"), (32, 64, "middle", "lse")]


@pytest.mark.parametrize("G,block,proxy,block_score,target",
                         [c + (t,) for c in _CASES for t in (0.5, 0.9, 0.97)] + [(1, 0, "mean", "max", 0.9)],
                         ids=[f"{n}-{t}" for n in ("G16-token", "G16-block64", "G32-block64-middle-lse")
                              for t in (0.5, 0.9, 0.97)] + ["G1-token-0.9"])
def test_budget_is_smallest_reaching_target(G, block, proxy, block_score, target):
    q, k, q_lr, k_lr = _planted(hkv=1)  # GQA: 2 query heads share one key head
    qidx = torch.arange(3, 640, 7)
    budget, curve = budget_for_recall(q, k, q_lr, k_lr, G, block, 0.9, None, qidx, target, proxy, block_score)
    assert budget.dtype == torch.int64 and budget.shape == (2, 2)
    n_items = 640 if block == 0 else 10
    assert curve.shape == (2, 2, n_items) and torch.all(curve[..., -1] == 1.0)
    assert torch.all(curve[..., 1:] >= curve[..., :-1])
    got = _recall_at(q, k, q_lr, k_lr, budget, G, block, qidx, proxy, block_score)
    assert torch.all(got >= target - 1e-6), (budget, got)
    below = (budget - 1).clamp(min=0)
    missed = _recall_at(q, k, q_lr, k_lr, below, G, block, qidx, proxy, block_score)
    assert torch.all((missed < target + 1e-6) | (budget == 1)), (budget, missed)
    if target <= 0.9:  # the planted structure leaves every head sparse enough to matter
        assert budget.max() < n_items


def test_curve_equals_recall_of_estimated_lists_at_every_k():
    q, k, q_lr, k_lr = _planted(S=256)
    qidx = torch.arange(0, 256, 5)
    curve = recall_curve(q, k, q_lr, k_lr, 16, 64, 0.9, None, qidx)  # 4 blocks: check each length
    for kk in range(1, 5):
        got = _recall_at(q, k, q_lr, k_lr, kk, 16, 64, qidx)
        torch.testing.assert_close(curve[..., kk - 1].float(), got, atol=1e-5, rtol=0)
    curve_t = recall_curve(q, k, q_lr, k_lr, 16, 0, 0.9, None, qidx)
    for kk in (1, 17, 64, 200):
        torch.testing.assert_close(curve_t[..., kk - 1].float(), _recall_at(q, k, q_lr, k_lr, kk, 16, 0, qidx),
                                   atol=1e-5, rtol=0)


def test_exact_scores_per_query_need_the_largest_critical_set():
    """G = 1 and q_lr = q (exact ranking): full recall for every query needs exactly the largest critical set."""
    q, k, _, _ = _planted(B=1, H=2, hkv=2, S=384, D=16)
    qidx = torch.arange(1, 384, 9)
    budget, _ = budget_for_recall(q, k, q, k, 1, 0, 0.9, None, qidx, 1.0)
    assert torch.equal(budget, critical_counts(q, k, 0.9, None, qidx).amax(-1).long())


def test_min_items_and_bad_arguments():
    curve = torch.tensor([[0.2, 0.6, 0.9, 1.0]], dtype=torch.float64)
    assert smallest_k_reaching(curve, 0.6).tolist() == [2]
    assert smallest_k_reaching(curve, 0.61).tolist() == [3]
    assert smallest_k_reaching(curve, 0.1, min_items=3).tolist() == [3]
    assert smallest_k_reaching(curve, 1.0, min_items=9).tolist() == [4]
    with pytest.raises(ValueError, match="target"):
        smallest_k_reaching(curve, 0.0)
    q, k, q_lr, k_lr = _planted(S=128)
    with pytest.raises(ValueError, match="q_lr"):
        recall_curve(q, k, q_lr[:, :, :64], k_lr, 16, 0)
    with pytest.raises(ValueError, match="block_size"):
        recall_curve(q, k, q_lr, k_lr, 16, 32)
    with pytest.raises(ValueError, match="proxy"):
        recall_curve(q, k, q_lr, k_lr, 16, 0, proxy="first")


@pytest.mark.parametrize("block", [0, 64], ids=["token", "block64"])
def test_profile_stats_one_pass_equals_the_three_functions(block):
    """The profiler's single pass gives exactly what head_sparsity, recall_curve and
    critical_mass_recall give separately (small chunks: several chunks per call)."""
    from megatron_dsv.attention.profiler import profile_stats
    from megatron_dsv.ops.topk_estimation import head_sparsity

    q, k, q_lr, k_lr = _planted(hkv=1)
    k_full = k.repeat_interleave(2, dim=1)
    qidx = torch.arange(1, 640, 5)
    G, chunk = 16, 640 * 4 * 7
    idx, counts = estimate_topk_naive(q_lr, k_lr, torch.tensor([3, 5]) if block else torch.tensor([90, 200]), G, block)
    curve_args = dict(q_lr=q_lr, k_lr=k_lr, group_size=G, block_size=block, proxy="mean", block_score="max")
    sp, curve, rec = profile_stats(q, k_full, 0.9, None, qidx, curve=curve_args, lists=(idx, counts, G, block),
                                   chunk_elems=chunk)
    assert torch.equal(sp, head_sparsity(q, k_full, 0.9, None, qidx, chunk))
    assert torch.equal(curve, recall_curve(q, k_full, q_lr, k_lr, G, block, 0.9, None, qidx, chunk_elems=chunk))
    assert torch.equal(rec, critical_mass_recall(q, k_full, idx, counts, G, block, 0.9, None, qidx, chunk))
    only = profile_stats(q, k_full, 0.9, None, qidx, chunk_elems=chunk)
    assert torch.equal(only[0], sp) and only[1] is None and only[2] is None
    with pytest.raises(ValueError, match="kv_indices"):
        profile_stats(q, k_full, 0.9, None, qidx, lists=(idx[:, :, :3], counts, G, block))

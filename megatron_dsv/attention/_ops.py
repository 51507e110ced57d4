"""The ops DSV attention calls, imported in one place.

``DSVConfig.kernel_backend`` / ``DSVConfig.topk_backend`` pick the backend:
``auto`` lets the ops choose their fastest backend themselves (``DSV_SPARSE_ATTN_BACKEND`` /
``DSV_TOPK_BACKEND``); any other value forces that backend (:func:`run_sparse_attention`,
:func:`run_estimate_topk`).
"""

from megatron_dsv.ops.sparse_attention import SUPPORTED_HEAD_DIMS, sparse_attention, sparse_attention_naive
from megatron_dsv.ops.topk_estimation import critical_mass_recall, estimate_topk, estimate_topk_naive, head_sparsity

__all__ = ["sparse_attention", "sparse_attention_naive", "estimate_topk", "estimate_topk_naive", "head_sparsity",
           "critical_mass_recall", "SUPPORTED_HEAD_DIMS", "run_sparse_attention", "run_estimate_topk"]


def run_sparse_attention(backend: str, q, k, v, kv_indices, kv_counts, group_size: int, block_size: int,
                         softmax_scale: float):
    """Sparse attention on the backend named by ``DSVConfig.kernel_backend`` (the op decides, in
    one place). The lists come from our own estimator, valid by construction: no host-syncing
    value check."""
    if backend == "naive":
        return sparse_attention_naive(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale)
    return sparse_attention(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale,
                            check_values=False, backend=backend)


def run_estimate_topk(backend: str, q_lr, k_lr, budgets, group_size: int, block_size: int, proxy: str,
                      block_score: str):
    """Top-k estimation on the backend named by ``DSVConfig.topk_backend`` (the op decides)."""
    return estimate_topk(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score, backend=backend)

"""The ops DSV attention calls, imported in one place.

Backends are resolved once, when a layer is built (:func:`resolve_backends`):
``DSVConfig.kernel_backend`` / ``DSVConfig.topk_backend`` when not ``auto``, else the
``DSV_SPARSE_ATTN_BACKEND`` / ``DSV_TOPK_BACKEND`` environment variable (read then, not per call).
A name that is still ``auto`` takes the ops' own rule from the call's shapes and device, without
reading the environment; every op call gets an explicit backend (:func:`run_sparse_attention`,
:func:`run_estimate_topk`).
"""

from typing import Tuple

from megatron_dsv.config import DSVConfig
from megatron_dsv.ops.sparse_attention import SUPPORTED_HEAD_DIMS, sparse_attention, sparse_attention_naive
from megatron_dsv.ops.sparse_attention.op import auto_backend, requested_backend
from megatron_dsv.ops.topk_estimation import (auto_topk_choice, critical_mass_recall, estimate_topk,
                                              estimate_topk_naive, head_sparsity, log_topk_choice,
                                              requested_topk_backend, tensor_core_scorable)

__all__ = ["sparse_attention", "sparse_attention_naive", "estimate_topk", "estimate_topk_naive", "head_sparsity",
           "critical_mass_recall", "SUPPORTED_HEAD_DIMS", "resolve_backends", "run_sparse_attention",
           "run_estimate_topk"]


def resolve_backends(cfg: DSVConfig) -> Tuple[str, str]:
    """``(kernel backend, top-k backend)`` for a layer built now: each is a forced backend or "auto"."""
    return requested_backend(cfg.kernel_backend), requested_topk_backend(cfg.topk_backend)


def run_sparse_attention(backend: str, q, k, v, kv_indices, kv_counts, group_size: int, block_size: int,
                         softmax_scale: float):
    """Sparse attention on a backend from :func:`resolve_backends` ("auto": the op's shape rule).
    The lists come from our own estimator, valid by construction: no host-syncing value check."""
    if backend == "naive":
        return sparse_attention_naive(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale)
    if backend == "auto":
        backend = auto_backend(q)
    return sparse_attention(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale,
                            check_values=False, backend=backend)


def run_estimate_topk(backend: str, q_lr, k_lr, budgets, group_size: int, block_size: int, proxy: str,
                      block_score: str, forced=None, forced_extra: bool = False):
    """Top-k estimation on a backend from :func:`resolve_backends` ("auto": the op's device and shape rule; ``forced``
    items, local + predicted lists, go to Triton where that rule says CUDA: the CUDA kernel lacks them)."""
    if backend == "auto":
        backend, reason = auto_topk_choice(q_lr.device, group_size, block_size, k_lr.shape[-2], forced is not None,
                                           tensor_core_scorable(q_lr.dtype, q_lr.shape[-1]))
        log_topk_choice(backend, reason)
    return estimate_topk(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score, backend=backend,
                         forced=forced, forced_extra=forced_extra)

"""The ops DSV attention calls, imported in one place.

``kernel_backend='naive'`` / ``topk_backend='naive'`` in DSVConfig pick the
naive twins (the readable references); otherwise the ops choose their fastest
backend themselves (``DSV_SPARSE_ATTN_BACKEND`` / ``DSV_TOPK_BACKEND``).
"""

from megatron_dsv.ops.sparse_attention import SUPPORTED_HEAD_DIMS, sparse_attention, sparse_attention_naive
from megatron_dsv.ops.topk_estimation import critical_mass_recall, estimate_topk, estimate_topk_naive, head_sparsity

__all__ = ["sparse_attention", "sparse_attention_naive", "estimate_topk", "estimate_topk_naive", "head_sparsity",
           "critical_mass_recall", "SUPPORTED_HEAD_DIMS"]

"""Sparse attention over per-query-group KV lists (token- or block-level).

``sparse_attention`` is the fast path (Triton on CUDA, FlexAttention where it
measured faster, the reference elsewhere); ``sparse_attention_naive`` is the
readable spec with the same signature. q is ``[B, H, Sq, D]``, k and v
``[B, Hkv, Sk, D]`` with any Sk (a context-parallel rank's queries against its
gathered keys): lists index Sk's tokens or key blocks, query groups tile Sq.
"""

from .checks import SUPPORTED_HEAD_DIMS
from .naive import sparse_attention_naive
from .op import sparse_attention

__all__ = ["sparse_attention", "sparse_attention_naive", "SUPPORTED_HEAD_DIMS"]

"""Dense attention: the one place the project runs full attention.

On CUDA it asks torch SDPA for cuDNN first (``set_priority=True``), then
FlashAttention, then the efficient and math kernels, so neither our dense path
(stage 1, dense layers) nor a benchmark baseline depends on SDPA's default
choice. On CPU it uses SDPA's math path.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["dense_attention", "dense_backend_context", "DENSE_BACKEND_ORDER"]

DENSE_BACKEND_ORDER = ("cudnn", "flash", "efficient", "math")


def dense_backend_context(device: torch.device, order=DENSE_BACKEND_ORDER):
    """Context manager that makes SDPA try the backends in ``order`` (CUDA only)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    backends = [table[name] for name in order]
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # torch < 2.6 has no set_priority: order is SDPA's own
        return sdpa_kernel(backends)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Full non-causal attention.

    Args:
        q: ``[B, H, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``H % Hkv == 0`` (GQA: each kv head serves
            ``H // Hkv`` consecutive query heads).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        attn_mask: optional boolean mask broadcastable to ``[B, H, Sq, Sk]``
            (True = attend).
    Returns:
        ``[B, H, Sq, D]`` in q's dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    with dense_backend_context(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=softmax_scale)

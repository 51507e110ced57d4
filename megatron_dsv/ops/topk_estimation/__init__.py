"""Fused low-rank QK^T + per-group top-k estimation, and the exact critical-set oracle.

``estimate_topk(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max")``
  q_lr: (batch, heads, seqlen, r), k_lr: (batch, heads, seqlen_k, r), r in {8, 16, 32},
    float32/float16/bfloat16; seqlen_k may differ from seqlen (a context-parallel rank's queries
    against its gathered keys; naive and triton backends only, cuda raises ValueError).
  budgets: int, or int tensor (heads,) or (batch, heads): items per query group (tokens when
    block_size == 0, key blocks of block_size in {64, 128} otherwise, of seqlen_k), clipped to what
    exists.
  forced: optional int tensor (num_groups, F), -1 padded, shared by every batch and head: items each
    group keeps before any other (DSV's local + predicted lists: the always-on neighbourhood); the
    budget counts them. Naive and triton backends ("auto" on CUDA then takes triton).
  forced_extra: with ``forced``, the budgets count only the other items: every group keeps all its forced
    items plus the budget's best others, so list lengths differ by group (a 3D window plus predicted items,
    ``DSVConfig.local_mode='window'``); then idx is (batch, heads, groups, F + Kmax) and counts
    (batch, heads, groups).
  Returns idx int32 (batch, heads, ceil(seqlen / group_size), Kmax): for each query group, the
    counts[b, h] best items by proxy . key (ties: lower index), ascending, then -1 padding;
    and counts int32 (batch, heads).

Backend: ``DSV_TOPK_BACKEND`` in {auto, cuda, triton, naive}; auto = the CUDA extension when
``megatron_dsv._C`` is built and the tensors are on CUDA, except in the cells where Triton measured faster
(:data:`TRITON_FASTER_UP_TO`: 128-query groups over 128-key blocks, at any length where the inputs score on tensor
cores, fp16/bf16 with r a power of two >= 16, else up to 32K keys), else Triton on CUDA, else naive (CPU).
Every backend selects the same lists (see ``common.py`` for the exact score definition).
:func:`estimate_topk` logs (``logging``, once per backend and reason) which backend it uses and why:
on a GPU without the extension the Triton fallback is 5-8x slower than the CUDA kernel on token lists
(H100, run 22: ``benchmarks/NOTES_topk_estimation.md``), which a user should see (a warning).
"""

from __future__ import annotations

import logging
import math
import os

from .common import tensor_core_scorable
from .naive import estimate_topk_naive
from .oracle import critical_counts, critical_mass_recall, head_sparsity

__all__ = ["estimate_topk", "estimate_topk_naive", "critical_counts", "head_sparsity",
           "critical_mass_recall", "topk_backend", "requested_topk_backend", "auto_topk_backend", "auto_topk_choice",
           "log_topk_choice", "tensor_core_scorable"]

BACKENDS = ("auto", "cuda", "triton", "naive")
# Triton's method ("gemm", or "keys" on tensor cores: fp16/bf16 inputs, r a power of two >= 16) -> (group size,
# block size) -> the longest key length at which "auto" takes Triton over the built CUDA kernel: where it measured
# faster (H100 80GB, H = 16, 90% sparse). "gemm", run 19: 0.236 against 0.383 ms at 16K, 0.730 against 0.957 at
# 32K; 3.53 against 1.98 at 64K (results/topk_estimation-g128-b128-run19-*.json). "keys" on tensor cores, run 27:
# 0.18 / 0.21 / 0.51 / 1.48 ms against 0.39 / 0.94 / 2.02 / 6.67 at 16K / 32K / 64K / 128K, its lead growing with
# the length (2.2x to 4.5x), so no limit (results/topk_estimation-g128-b128-run27-*.json).
TRITON_FASTER_UP_TO = {"gemm": {(128, 128): 32768}, "keys": {(128, 128): math.inf}}
_log = logging.getLogger(__name__)
_LOGGED: set = set()


def requested_topk_backend(requested=None) -> str:
    """The backend asked for, validated: ``requested`` (e.g. ``DSVConfig.topk_backend``) unless None or
    "auto", else ``DSV_TOPK_BACKEND``. May be "auto" (then :func:`auto_topk_backend` picks per device)."""
    if requested not in (None, "auto"):
        want, source = str(requested).strip().lower(), "backend"
    else:
        want, source = os.environ.get("DSV_TOPK_BACKEND", "auto").strip().lower() or "auto", "DSV_TOPK_BACKEND"
    if want not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {want!r}")
    return want


def auto_topk_backend(device, group_size: int = 0, block_size: int = 0, seqlen_k: int = 0,
                      forced: bool = False, tensor_cores: bool = False) -> str:
    """The "auto" rule: the CUDA extension when built and the tensors are on CUDA, except for lists of
    ``(group_size, block_size)`` over at most :data:`TRITON_FASTER_UP_TO` keys (Triton measured faster there; its
    "keys" cells where the inputs score on ``tensor_cores``, :func:`~.common.tensor_core_scorable`, else "gemm"'s)
    and for ``forced`` items (the CUDA kernel takes none), else Triton on CUDA, else naive."""
    return auto_topk_choice(device, group_size, block_size, seqlen_k, forced, tensor_cores)[0]


def auto_topk_choice(device, group_size: int = 0, block_size: int = 0, seqlen_k: int = 0, forced: bool = False,
                     tensor_cores: bool = False):
    """``(backend, reason)`` of :func:`auto_topk_backend`: what a log line says (:func:`log_topk_choice`)."""
    backend, reason = _auto_by_device(device, group_size, block_size, seqlen_k, tensor_cores)
    if forced and backend == "cuda":
        return "triton", ("auto: forced items (local + predicted lists) run on the triton backend (the CUDA kernel "
                          "takes none)")
    return backend, reason


def _auto_by_device(device, group_size: int, block_size: int, seqlen_k: int, tensor_cores: bool = False):
    if getattr(device, "type", str(device)) != "cuda":
        return "naive", "auto: tensors not on CUDA"
    from .cuda_impl import cuda_extension

    if cuda_extension() is None:
        return "triton", ("auto: tensors on CUDA but the CUDA extension megatron_dsv._C is not built (pip install "
                          "with nvcc present); the Triton fallback is slower (benchmarks/NOTES_topk_estimation.md)")
    method = "keys" if tensor_cores and block_size else "gemm"
    limit = TRITON_FASTER_UP_TO[method].get((group_size, block_size), 0)
    if 0 < seqlen_k <= limit:
        upto = "any number of" if math.isinf(limit) else f"at most {limit}"
        return "triton", (f"auto: lists of {group_size}-query groups over {block_size}-key blocks of {upto} keys, "
                          f"where Triton's '{method}' method measured faster than the CUDA kernel "
                          f"(TRITON_FASTER_UP_TO)")
    return "cuda", "auto: the CUDA extension megatron_dsv._C is built and the tensors are on CUDA"


def topk_backend(device, requested=None, group_size: int = 0, block_size: int = 0, seqlen_k: int = 0,
                 forced: bool = False, tensor_cores: bool = False) -> str:
    """The backend estimate_topk uses for tensors on ``device`` and lists of that shape (the one place this is
    decided): :func:`requested_topk_backend`, then :func:`auto_topk_backend` for "auto"."""
    return _backend_and_reason(device, requested, group_size, block_size, seqlen_k, forced, tensor_cores)[0]


def _backend_and_reason(device, requested=None, group_size: int = 0, block_size: int = 0, seqlen_k: int = 0,
                        forced: bool = False, tensor_cores: bool = False):
    want = requested_topk_backend(requested)
    if want != "auto":
        source = "backend argument" if requested not in (None, "auto") else "DSV_TOPK_BACKEND"
        return want, f"asked for by {source}"
    return auto_topk_choice(device, group_size, block_size, seqlen_k, forced, tensor_cores)


def log_topk_choice(backend: str, reason: str) -> None:
    """Log which top-k backend runs and why, once per (backend, reason): a warning where Triton runs because
    the CUDA extension is missing, else information."""
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        (_log.warning if backend == "triton" and "not built" in reason else _log.info)(
            "estimate_topk uses the %s backend (%s)", backend, reason)


def _tensor_cores(q_lr) -> bool:
    """Whether ``q_lr`` (``[B, H, S, r]``) scores on tensor cores in Triton (:func:`~.common.tensor_core_scorable`)."""
    return hasattr(q_lr, "shape") and q_lr.dim() == 4 and tensor_core_scorable(q_lr.dtype, q_lr.shape[-1])


def estimate_topk(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max", *,
                  backend=None, forced=None, forced_extra: bool = False):
    """Per query group, the top-k keys (or key blocks) by low-rank score; see the module docstring.
    ``backend`` forces one of {cuda, triton, naive} (None or "auto": the module's rule)."""
    backend, reason = _backend_and_reason(getattr(q_lr, "device", "cpu"), backend, group_size, block_size,
                                          k_lr.shape[-2] if hasattr(k_lr, "shape") and k_lr.dim() == 4 else 0,
                                          forced is not None, _tensor_cores(q_lr))
    if forced is not None and backend == "cuda":  # asked for by name ("auto" takes triton for forced items)
        raise ValueError("estimate_topk: `forced` items (DSVConfig.local_radius) are not supported by the "
                         "cuda backend; use backend 'triton' or 'naive' (or 'auto')")
    log_topk_choice(backend, reason)
    match backend:
        case "cuda":
            from .cuda_impl import estimate_topk_cuda as fn
        case "triton":
            from .triton_impl import estimate_topk_triton as fn
        case "naive":
            fn = estimate_topk_naive
        case _:  # pragma: no cover - topk_backend validates
            raise ValueError(f"unknown topk backend {backend!r}")
    if forced_extra and forced is None:
        raise ValueError("estimate_topk: `forced_extra` needs `forced` items (the neighbourhood every group keeps)")
    if forced is not None:
        return fn(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score, forced=forced,
                  forced_extra=forced_extra)
    return fn(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)

"""CUDA backend: the pybind11 kernel in ``csrc/topk_estimation.cu`` (module ``megatron_dsv._C``)."""

from __future__ import annotations

import torch

from .common import check_problem

__all__ = ["estimate_topk_cuda", "cuda_extension"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_EXT = None
_EXT_ERR = None


def cuda_extension():
    """The compiled module, or None when it was not built (the reason is kept in ``_EXT_ERR``)."""
    global _EXT, _EXT_ERR
    if _EXT is None and _EXT_ERR is None:
        try:
            from megatron_dsv import _C  # type: ignore[attr-defined]

            _EXT = _C
        except ImportError as err:
            _EXT_ERR = err
    return _EXT


def estimate_topk_cuda(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max"):
    """Same contract as :func:`estimate_topk`, on the CUDA kernel. One launch per call (plus a
    tiny key-norm kernel); extra memory: the output lists and B*H floats."""
    P = check_problem(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)
    if not q_lr.is_cuda:
        raise ValueError(f"estimate_topk: the cuda backend needs CUDA tensors, got `q_lr` on {q_lr.device}")
    ext = cuda_extension()
    if ext is None:
        raise RuntimeError(f"estimate_topk: megatron_dsv._C is not built ({_EXT_ERR}); build with setup.py")
    if P.B * P.H > 65535:
        raise ValueError(f"estimate_topk: the cuda backend needs B*H <= 65535, got {P.B * P.H}")
    q = q_lr.contiguous()
    k = k_lr.contiguous()
    out = torch.empty(P.B, P.H, P.num_groups, P.kmax, dtype=torch.int32, device=q.device)
    if P.kmax == 0:
        return out, P.counts
    keynorm2 = torch.zeros(P.B, P.H, dtype=torch.float32, device=q.device)
    counts = P.counts.contiguous()
    with torch.cuda.device(q.device):
        ext.topk_estimation(q.data_ptr(), k.data_ptr(), counts.data_ptr(), out.data_ptr(), keynorm2.data_ptr(),
                            P.B, P.H, P.S, P.r, P.group_size, P.block_size, P.kmax, _DTYPE_NAMES[q.dtype],
                            P.proxy, P.block_score, torch.cuda.current_stream(q.device).cuda_stream)
    return out, counts

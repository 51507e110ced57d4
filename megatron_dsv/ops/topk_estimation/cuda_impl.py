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


_SCRATCH_FLOOR = 16 << 20  # bytes of bitmask scratch always allowed per launch


def estimate_topk_cuda(q_lr, k_lr, budgets, group_size, block_size=0, proxy="mean", block_score="max", *,
                       sample_stride=0, force_fallback=False, debug_flags=0):
    """Same contract as :func:`estimate_topk`, on the CUDA kernel.

    Extra memory: the output lists plus a selection bitmask of ``ceil(n_items / 32)`` words per
    query group. (Batch, head) pairs are launched in chunks so that the bitmask never exceeds the
    output's size (or 16 MiB): peak extra memory <= 2x the lists. ``sample_stride`` (0 = the
    kernel's choice) and ``force_fallback`` exist for tests of the kernel's internal paths;
    ``debug_flags`` 2 / 4 stop the kernel after its main pass / before its compaction (stage
    timing only: the lists are then incomplete). Needs Sq == Sk: the kernel takes one length.
    """
    P = check_problem(q_lr, k_lr, budgets, group_size, block_size, proxy, block_score)
    if P.Sk != P.S:
        raise ValueError(f"estimate_topk: the cuda backend needs Sq == Sk (the kernel takes one length); got "
                         f"q_lr length Sq={P.S}, k_lr length Sk={P.Sk}; use backend triton or naive")
    if not q_lr.is_cuda:
        raise ValueError(f"estimate_topk: the cuda backend needs CUDA tensors, got `q_lr` on {q_lr.device}")
    ext = cuda_extension()
    if ext is None:
        raise RuntimeError(f"estimate_topk: megatron_dsv._C is not built ({_EXT_ERR}); build with setup.py")
    if P.B * P.H > 65535:
        raise ValueError(f"estimate_topk: the cuda backend needs B*H <= 65535, got {P.B * P.H}")
    if isinstance(sample_stride, bool) or not isinstance(sample_stride, int) or not 0 <= sample_stride <= 64:
        raise ValueError(f"estimate_topk_cuda: `sample_stride` must be an int in [0, 64] (0 = automatic), "
                         f"got {sample_stride!r}")
    q = q_lr.contiguous()
    k = k_lr.contiguous()
    out = torch.empty(P.B, P.H, P.num_groups, P.kmax, dtype=torch.int32, device=q.device)
    if P.kmax == 0:
        return out, P.counts
    BH, nw = P.B * P.H, -(-P.num_items // 32)
    per_bh = P.num_groups * nw * 4
    chunk = max(1, min(BH, max(out.numel() * 4, _SCRATCH_FLOOR) // per_bh))
    bits = torch.empty(chunk * P.num_groups * nw, dtype=torch.int32, device=q.device)
    qf, kf, of = q.view(BH, P.S, P.r), k.view(BH, P.S, P.r), out.view(BH, P.num_groups, P.kmax)
    counts = P.counts.contiguous()
    cf = counts.view(BH)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        for i0 in range(0, BH, chunk):
            i1 = min(BH, i0 + chunk)
            ext.topk_estimation(qf[i0].data_ptr(), kf[i0].data_ptr(), cf[i0:i1].data_ptr(), of[i0].data_ptr(),
                                bits.data_ptr(), 1, i1 - i0, P.S, P.r, P.group_size, P.block_size, P.kmax,
                                _DTYPE_NAMES[q.dtype], P.proxy, P.block_score, stream, sample_stride,
                                int(bool(force_fallback)) | int(debug_flags))
    return out, counts

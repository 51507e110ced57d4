"""Public entry point: validation, backend choice, torch.library op, autograd.

Layers, as in flash-attention: ``sparse_attn_fwd``/``sparse_attn_bwd`` raw
custom ops (with fake impls, so torch.compile traces through them), autograd
registered on the forward op, and the public ``sparse_attention``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import List, Optional, Tuple

import torch

from .checks import check_shapes, check_values
from .checks import check_values as _check_values
from .flex import flex_supported, sparse_attention_flex
from .naive import sparse_attention_naive

BACKENDS = ("auto", "triton", "flex", "naive")
_log = logging.getLogger(__name__)
_LOGGED: set = set()


def _log_once(backend: str, reason: str) -> None:
    """One log line per (backend, reason) and process: which sparse attention backend runs, and why."""
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        _log.info("sparse_attention uses the %s backend (%s)", backend, reason)

# FlexAttention is never picked by "auto", only on request (DSV_SPARSE_ATTN_BACKEND=flex,
# DSVConfig.kernel_backend). Its kernels alone beat ours on small or very sparse block problems
# (sparse_attention-h200-20261130.json; -sweep-h200-20261203.json: 0.90x ours at 16K, D=64), but
# a training step pays its per-call BlockMask build and compiled-graph guards on the host: the
# trained 16K stage-2 step (hidden 512 x 4 layers, D=64, 22% kept; quality-frontier run 10)
# took 51.3 ms through flex against 31.1 ms through ours (ViZDoom), 49.4 against 36.7 (footage).


def requested_backend(requested: Optional[str] = None) -> str:
    """The backend asked for, validated: ``requested`` (e.g. ``DSVConfig.kernel_backend``) when it is
    not None or "auto", else ``DSV_SPARSE_ATTN_BACKEND`` in {auto, triton, flex, naive}, default auto.
    May be "auto" (then :func:`auto_backend` picks per call, from shapes)."""
    if requested not in (None, "auto"):
        name, source = str(requested).strip().lower(), "backend"
    else:
        name, source = os.environ.get("DSV_SPARSE_ATTN_BACKEND", "auto").strip().lower() or "auto", \
            "DSV_SPARSE_ATTN_BACKEND"
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}; got {name!r}")
    if name != "auto" and source == "DSV_SPARSE_ATTN_BACKEND":
        _log_once(name, "asked for by DSV_SPARSE_ATTN_BACKEND")
    return name


def auto_backend(q: torch.Tensor) -> str:
    """The "auto" rule, from q's device alone: Triton on CUDA (never flex: see above), the reference
    on CPU (Triton there only under its interpreter, i.e. in tests)."""
    if q.is_cuda:
        _log_once("triton", "auto: tensors on CUDA; FlexAttention only on request, its per-call host cost made "
                            "training steps slower (benchmarks/NOTES_sparse_attention.md, 2026-12-03)")
        return "triton"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        _log_once("triton", "auto: TRITON_INTERPRET=1, the Triton kernels under the interpreter")
        return "triton"
    _log_once("naive", "auto: tensors not on CUDA, the PyTorch reference")
    return "naive"


def choose_backend(q: torch.Tensor, kv_indices: torch.Tensor, group_size: int, block_size: int,
                   requested: Optional[str] = None, k_len: Optional[int] = None) -> str:
    """The one place a backend is chosen: :func:`requested_backend`, then :func:`auto_backend` for "auto".
    ``k_len``: the key length (None: q's length)."""
    name = requested_backend(requested)
    if name == "auto":
        return auto_backend(q)
    source = "backend" if requested not in (None, "auto") else "DSV_SPARSE_ATTN_BACKEND"
    if name == "flex" and k_len is not None and k_len != q.shape[2]:
        raise ValueError(f"{source}=flex needs k's length to equal q's; got k length Sk={k_len}, "
                         f"q length Sq={q.shape[2]} (use triton or naive for Sk != Sq)")
    if name == "flex" and not flex_supported(q.shape[2], group_size, block_size):
        raise ValueError(f"{source}=flex needs block-level lists with group_size 128 and "
                         f"block_size 128 (the only shape flex lowers); got group_size={group_size}, "
                         f"block_size={block_size}")
    return name


def _fwd_impl(q, k, v, kv_indices, kv_counts, group_size: int, block_size: int, softmax_scale: float,
              o_strides: Optional[List[int]], validate: bool):
    """The forward of both entry points (:func:`sparse_attn_fwd` under torch.compile, :class:`_SparseAttention`
    in eager): q, k contiguous; v any strides (read through a transient contiguous copy). o has ``o_strides``
    (None: contiguous), lse ``[B, H, T]`` fp32."""
    from .launch import sparse_fwd

    # value checks live inside the op: they need real data, which torch.compile never traces
    if validate:
        check_values(kv_indices, kv_counts, k.shape[2], block_size)
    o, lse = sparse_fwd(q, k, v.contiguous(), kv_indices, kv_counts, group_size, block_size, softmax_scale)
    if o_strides is not None and tuple(o_strides) != o.stride():
        o = torch.empty_strided(o.shape, o_strides, dtype=o.dtype, device=o.device).copy_(o)
    return o, lse


def _bwd_impl(do, q, k, v, o, lse, kv_indices, kv_counts, group_size: int, block_size: int, softmax_scale: float):
    """The backward of both entry points: ``(dq, dk, dv)``, contiguous."""
    from .launch import sparse_bwd

    return sparse_bwd(do, q, k, v, o, lse, kv_indices, kv_counts, group_size, block_size, softmax_scale)


@torch.library.custom_op("megatron_dsv::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indices: torch.Tensor,
                    kv_counts: torch.Tensor, group_size: int, block_size: int,
                    softmax_scale: float, o_strides: Optional[List[int]] = None,
                    validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_fwd_impl` as a torch.library op (with a fake impl), what torch.compile traces."""
    return _fwd_impl(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale, o_strides, validate)


@sparse_attn_fwd.register_fake
def _(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale, o_strides=None, validate=True):
    B, H, S, D = q.shape
    o = q.new_empty(B, H, S, D) if o_strides is None else q.new_empty_strided((B, H, S, D), o_strides)
    return o, q.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("megatron_dsv::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, kv_indices: torch.Tensor,
                    kv_counts: torch.Tensor, group_size: int, block_size: int,
                    softmax_scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(do, q, k, v, o, lse, kv_indices, kv_counts, group_size, block_size, softmax_scale)


@sparse_attn_bwd.register_fake
def _(do, q, k, v, o, lse, kv_indices, kv_counts, group_size, block_size, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as sparse_bwd's


def _setup_context(ctx, inputs, output):
    # saved as they are: the contiguous q and k the kernels read, v as the caller passed it (a view keeps
    # its base alive, as in torch SDPA), o in the caller's layout (shared with whoever consumes it)
    q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale, _o_strides, _validate = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, kv_indices, kv_counts)
    ctx.cfg = (group_size, block_size, softmax_scale)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, kv_indices, kv_counts = ctx.saved_tensors
    dq, dk, dv = sparse_attn_bwd(do, q, k, v, o, lse, kv_indices, kv_counts, *ctx.cfg)
    return dq, dk, dv, None, None, None, None, None, None, None


sparse_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _SparseAttention(torch.autograd.Function):
    """The eager entry point: the same forward and backward as the torch.library ops, without their dispatch.

    A torch.library custom op costs the host its dispatcher round trips, a Python autograd wrapper and an
    aliasing check on every call; in the study model's stage-2 step at 32K tokens (H200, frontier run 8) the ops'
    own Python took 5.7 ms of a 60.6 ms host step under cProfile (8 calls: 4 layers, forward and backward), on a
    step whose 46 ms of kernels waited for the host. The ops stay what torch.compile traces."""

    @staticmethod
    def forward(ctx, q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale, o_strides, validate):
        o, lse = _fwd_impl(q, k, v, kv_indices, kv_counts, group_size, block_size, softmax_scale, o_strides,
                           validate)
        # saved as the op saves them (see _setup_context)
        ctx.save_for_backward(q, k, v, o, lse, kv_indices, kv_counts)
        ctx.cfg = (group_size, block_size, softmax_scale)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, kv_indices, kv_counts = ctx.saved_tensors
        dq, dk, dv = _bwd_impl(do, q, k, v, o, lse, kv_indices, kv_counts, *ctx.cfg)
        return dq, dk, dv, None, None, None, None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_indices: torch.Tensor,
                     kv_counts: torch.Tensor, group_size: int, block_size: int = 0,
                     softmax_scale: Optional[float] = None, *, check_values: bool = True,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Non-causal attention where each query group attends only its listed keys.

    Args:
        q: ``[B, H, Sq, D]``, float16 / bfloat16 (float32 accepted).
        k, v: ``[B, Hkv, Sk, D]``, same dtype and device as q, ``H % Hkv == 0``
            (GQA: kv head j serves query heads ``j*H/Hkv .. (j+1)*H/Hkv - 1``).
            Any ``Sk >= 1``: Sk != Sq is a context-parallel rank's query shard
            against its gathered keys (not the flex backend).
        kv_indices: int32 ``[B, H, NG, Kmax]``, ``NG = ceil(Sq / group_size)``.
            Query group g is tokens ``[g*G, min((g+1)*G, Sq))``. For each (b, h, g)
            the first ``kv_counts[b, h]`` (or ``kv_counts[b, h, g]``) entries are sorted ascending and unique;
            later entries are padding and are never read (any value, e.g. -1).
            ``block_size == 0``: entries are key token positions in ``[0, Sk)``.
            ``block_size in {64, 128}``: entries are key-block ids in
            ``[0, ceil(Sk / block_size))``; the last block may be partial.
        kv_counts: int32 ``[B, H]`` (one length per head) or ``[B, H, NG]`` (one per query group, e.g.
            a window's edge cubes), each in ``[0, min(Kmax, #keys or #blocks)]``. A count of 0 gives
            zero output and zero gradients for that head (or group).
        group_size: G in {16, 32, 64, 128}.
        block_size: 0 (token-level lists) or 64 / 128 (block-level lists).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        check_values: verify counts and indices (one reduction and one host sync); callers
            whose lists come from our own estimator pass False. ``DSV_SKIP_CHECKS=1`` also skips.
        backend: force one of {triton, flex, naive} (None or "auto": the rule below).
    Head dims D: 64, 96 (padded to 128 inside the kernel), 128, 256.
    Returns:
        o ``[B, H, Sq, D]`` in q's dtype; differentiable w.r.t. q, k, v.
    Memory (Triton backend; as torch SDPA's cuDNN path): o has q's memory layout, so for Megatron's
    q (a permuted ``[S, B, H, D]`` tensor) the caller's ``[S, B, H*D]`` reshape is a view and o is kept
    once, shared with what ``linear_proj`` saves. Saved for backward: the contiguous q and k copies the
    kernels read, v as passed (a view keeps its base alive; pass ``v.contiguous()`` when nothing else
    keeps that base), o, lse and the lists. The backward re-copies a strided v or o into transient
    contiguous rows (o only for the delta pass).
    Raises:
        ValueError naming the argument for a bad shape, dtype, device, head dim,
        group/block size, count, or index (the value checks cost one reduction
        and one host sync; ``DSV_SKIP_CHECKS=1`` skips them).
    Backend: ``DSV_SPARSE_ATTN_BACKEND`` in {auto, triton, flex, naive}; auto is
    Triton on CUDA (FlexAttention for block-level shapes where it measured
    faster) and the fp32 reference on CPU unless ``TRITON_INTERPRET=1``.
    Block-level backward: ``DSV_SPARSE_BWD`` in {auto, split, fused} (see
    ``launch.bwd_mode``; auto takes the fused 5-matmul kernel only where it measured faster).
    """
    check_shapes(q, k, v, kv_indices, kv_counts, group_size, block_size)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = choose_backend(q, kv_indices, group_size, block_size, backend, k_len=k.shape[2])
    if backend == "naive":
        return sparse_attention_naive(q, k, v, kv_indices, kv_counts, group_size, block_size, scale)
    if backend == "flex":
        if check_values:
            _check_values(kv_indices, kv_counts, k.shape[2], block_size)
        return sparse_attention_flex(q, k, v, kv_indices, kv_counts, group_size, block_size, scale)
    o_strides = _dense_strides_like(q)
    # torch.compile traces the op; eager takes the same kernels without the op's dispatch (_SparseAttention)
    fwd = sparse_attn_fwd if torch.compiler.is_compiling() else _SparseAttention.apply
    o, _ = fwd(q.contiguous(), k.contiguous(), v, kv_indices.contiguous(), kv_counts.contiguous(),
               int(group_size), int(block_size), scale, o_strides, bool(check_values))
    return o


def _dense_strides_like(t: torch.Tensor) -> Optional[List[int]]:
    """Strides of a dense tensor of ``t``'s shape with ``t``'s dim order (outermost = largest stride,
    ties: larger size first); None when that is the contiguous order."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    if order == list(range(t.dim())):
        return None
    strides, step = [0] * t.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= t.shape[d]
    return strides

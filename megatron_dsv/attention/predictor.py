"""Low-rank attention-score predictor of one DSV layer, with its own Adam.

Two inputs (``DSVConfig.predictor_input``):

* ``'qk'``: per head, ``q_lr = q @ Wq[h]`` and ``k_lr = k @ Wk[h]`` (``D -> r``) on the
  post-RoPE q and k, so the predictor sees positions. Cost per token: ``4*H*D*r`` FLOPs.
* ``'hidden'`` (the paper): ``[q_lr, k_lr] = x @ W[h]`` (``hidden -> 2r`` per head) on the
  layer's input hidden states. Cost per token: ``4*H*hidden*r`` FLOPs, i.e. ``hidden/D`` (= H)
  times the ``'qk'`` cost, and it has to learn RoPE's effect from scratch.

Default input: ``'qk'``. Measured with ``benchmarks/bench_recall.py --quick`` on CPU (tiny
video DiT, 4 layers, hidden 128, 2 heads x D 64, S = 512, r = 16, 30 steps): recall of the
theta-critical mass 0.72-0.78 for 'qk' vs 0.74-0.77 for 'hidden' (equal within noise), at
16 vs 32 kFLOP per token per layer: 'qk' gives about 2x the recall per FLOP here, and the
gap grows with model width (``hidden / D`` = H: 16x on the 2.7B preset). 'qk' also sees
RoPE positions directly. The H200 run of the same benchmark is the one that counts.

How the predictor trains (the design choice, stated once):
its loss depends only on *detached* inputs and its own weights, so its gradient is
computed right where the loss is, inside the attention forward, with a local
``torch.autograd.grad`` (chunked over sampled queries so memory stays bounded), and
accumulated into a private buffer. The weights are ``requires_grad=False``
parameters: Megatron's DDP and the main optimizer skip them (both ignore parameters
that do not require grad), yet they live in ``state_dict``/``sharded_state_dict``.
``dsv_on_step_end`` all-reduces the accumulated gradient over the data-parallel group
and steps this module's own Adam (state in buffers, so checkpoints resume it exactly),
at ``predictor_lr``, times ``predictor_lr_stage2_scale`` in stage 2. Why not the main
optimizer: Adam is invariant to gradient scale, so a lower stage-2 rate could not be
expressed as a gradient scale, and Megatron's Float16Module would cast the weights to
bf16 (this module keeps them fp32 through ``_apply``).
Training work runs only when grad mode is on, so Megatron's reentrant activation
recomputation (first pass under ``no_grad``, recompute with grad) trains once per micro-batch.

Loss on sampled query rows: ``cos_w * (1 - cos) + mse_w * MSE`` of the L2-normalised
rows of low-rank vs. true pre-softmax scores over all keys. On unit rows
``MSE = 2 * (1 - cos) / S``, so the loss is ``(cos_w + 2 mse_w / S) * (1 - cos)``, and the
cosine is computed through the ``r x r`` Gram matrix of ``k_lr`` (:func:`_row_cosines`),
never forming the ``rows x S`` low-rank scores: the first H200 measurement (0.8B preset,
S = 8K) found the explicit form costing ~29 ms per layer per step. :func:`predictor_loss` is
the explicit definition, kept as the reference the tests compare against. The true score rows
are one matmul of the sampled q rows with the keys *in the model dtype* (fp32 accumulation;
GQA heads stacked, keys never repeated or widened to fp32), which for bf16 inputs moves the
loss by ~1e-5 relative and its gradient by ~1e-3 (tested).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from megatron_dsv.config import DSVConfig

__all__ = ["LowRankPredictor", "adam_step_many", "predictor_loss", "predictor_flops_per_token"]

_CHUNK_ELEMS = 1 << 24  # true-score elements per chunk of the predictor loss (64 MB fp32)
_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8


def predictor_flops_per_token(mode: str, heads: int, head_dim: int, hidden: int, rank: int) -> int:
    """Projection FLOPs per token (q_lr and k_lr) for one layer."""
    width = head_dim if mode == "qk" else hidden
    return 2 * 2 * heads * width * rank


def predictor_loss(lr_scores: torch.Tensor, true_scores: torch.Tensor, cos_weight: float,
                   mse_weight: float) -> torch.Tensor:
    """Per-row loss ``[..., rows]`` between low-rank and true score rows ``[..., rows, S]``."""
    a = torch.nn.functional.normalize(lr_scores, dim=-1, eps=1e-12)
    b = torch.nn.functional.normalize(true_scores, dim=-1, eps=1e-12)
    cos = (a * b).sum(-1)
    mse = (a - b).pow(2).mean(-1)
    return cos_weight * (1.0 - cos) + mse_weight * mse


def _scores_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t`` in float32: fp32 operands as they are; bf16/fp16 operands on the tensor cores with
    fp32 accumulation and an fp32 result where torch offers it (``bmm(out_dtype=)`` on CUDA), else
    the model-dtype product widened (CPU, older torch)."""
    if a.dtype == torch.float32:
        return torch.matmul(a, b_t.float())
    if a.is_cuda and _FP32_OUT_BMM[0]:
        try:
            *lead, m, d = a.shape
            out = torch.bmm(a.reshape(-1, m, d), b_t.reshape(-1, d, b_t.shape[-1]), out_dtype=torch.float32)
            return out.view(*lead, m, b_t.shape[-1])
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_BMM[0] = False  # this torch has no fp32-output bmm: widen from now on
    return torch.matmul(a, b_t).float()


_FP32_OUT_BMM = [True]


def _true_rows(q_rows: torch.Tensor, k: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """True score rows ``[B, H, stop-start, S]`` in fp32 (no grad) from q rows ``[B, H, rows, D]`` and
    keys ``[B, Hkv, S, D]`` in the model dtype. GQA: the ``H / Hkv`` query heads of one key head are
    stacked into one matmul, so keys are never repeated or widened to fp32."""
    B, H, _, D = q_rows.shape
    hkv, S = k.shape[1], k.shape[2]
    part = q_rows[:, :, start:stop]
    n = part.shape[2]
    grouped = part.reshape(B, hkv, (H // hkv) * n, D)  # head h = g * rep + j, as repeat_interleave
    return _scores_fp32(grouped, k.transpose(-1, -2)).view(B, H, n, S)


def _row_norms(true: torch.Tensor) -> torch.Tensor:
    """``max(||row||, eps)`` ``[..., rows, 1]``: F.normalize's denominator."""
    return torch.linalg.vector_norm(true, dim=-1, keepdim=True).clamp_min(1e-12)


class _ProjectUnitRows(torch.autograd.Function):
    """``M = unit(q_rows k^T) @ k_lr`` (``[B, H, rows, r]``), chunked over rows.

    Computed as ``(true @ k_lr) / |true|``: the rows x S block is read once by the norm and once by
    the matmul, never divided elementwise. The true score rows are recomputed in backward instead of
    stored when there is more than one chunk, so memory stays at one ``[B, H, chunk, S]`` block
    however long the sequence.
    """

    @staticmethod
    def forward(ctx, k_lr, q_rows, k):
        B, H, S, _ = k_lr.shape
        chunk = max(1, _CHUNK_ELEMS // max(1, B * H * S))
        rows = q_rows.shape[2]
        ctx.chunk, ctx.one_block = chunk, rows <= chunk
        if rows <= chunk:  # one block: keep it for backward rather than recompute it
            true = _true_rows(q_rows, k, 0, rows)
            norm = _row_norms(true)
            ctx.save_for_backward(true, norm)
            return torch.matmul(true, k_lr) / norm
        out = []
        for i in range(0, rows, chunk):
            true = _true_rows(q_rows, k, i, i + chunk)
            out.append(torch.matmul(true, k_lr) / _row_norms(true))
        ctx.save_for_backward(q_rows, k)
        return torch.cat(out, dim=2)

    @staticmethod
    def backward(ctx, d_m):
        if ctx.one_block:
            true, norm = ctx.saved_tensors
            return torch.matmul(true.transpose(-1, -2), d_m / norm), None, None
        q_rows, k = ctx.saved_tensors
        d_k = None
        for i in range(0, q_rows.shape[2], ctx.chunk):
            true = _true_rows(q_rows, k, i, i + ctx.chunk)
            part = torch.matmul(true.transpose(-1, -2), d_m[:, :, i:i + ctx.chunk] / _row_norms(true))
            d_k = part if d_k is None else d_k + part
        return d_k, None, None


def _row_cosines(q_lr: torch.Tensor, k_lr: torch.Tensor, q_rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Cosine between each sampled query's low-rank score row ``q_lr k_lr^T`` and its true row.

    With ``b`` the unit true row: ``lr . b = q_lr . (b k_lr)`` and
    ``|lr|^2 = q_lr^T (k_lr^T k_lr) q_lr``, so only ``[rows, r]`` and ``[r, r]`` tensors carry
    gradients; the ``rows x S`` low-rank scores are never formed. Equals the row cosine of
    :func:`predictor_loss` (tested). ``q_rows`` / ``k`` (``[B, Hkv, S, D]``) in the model dtype.
    """
    m = _ProjectUnitRows.apply(k_lr, q_rows, k)  # [B, H, rows, r]
    gram = torch.matmul(k_lr.transpose(-1, -2), k_lr)  # [B, H, r, r]
    num = (q_lr * m).sum(-1)
    den_sq = (torch.matmul(q_lr, gram) * q_lr).sum(-1)
    return num / den_sq.clamp_min(1e-24).sqrt()


def _unit_rows_times_keys(q_rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``U = unit(q_rows k^T) @ k`` (``[B, H, rows, D]``, fp32, no grad), chunked over rows.

    With ``k_lr = k Wk``, ``unit(true) @ k_lr = U Wk``: the qk predictor's loss needs only ``U`` and
    ``k^T k``, both tensor-core products in the model dtype with fp32 accumulation, and autograd
    then sees only ``[rows, D]``-sized tensors (no fp32 GEMM over the sequence).
    """
    B, H, rows, D = q_rows.shape
    hkv, S = k.shape[1], k.shape[2]
    chunk = max(1, _CHUNK_ELEMS // max(1, B * H * S))
    out = []
    for i in range(0, rows, chunk):
        true = _true_rows(q_rows, k, i, i + chunk)  # [B, H, n, S] fp32
        n = true.shape[2]
        grouped = true.to(k.dtype).reshape(B, hkv, (H // hkv) * n, S)  # heads as in _true_rows
        out.append(_scores_fp32(grouped, k).view(B, H, n, D) / _row_norms(true))
    return torch.cat(out, dim=2)


def _qk_row_cosines(q_rows: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """:func:`_row_cosines` for the qk predictor (``q_lr = q Wq``, ``k_lr = k Wk`` per head), by
    associativity: ``lr . b = q_lr . (U Wk)`` and ``|lr|^2 = q_lr^T Wk^T (k^T k) Wk q_lr`` (tested
    equal). ``q_rows`` ``[B, H, rows, D]``, ``k`` ``[B, Hkv, S, D]`` in the model dtype."""
    H, hkv = q_rows.shape[1], k.shape[1]
    with torch.no_grad():
        u = _unit_rows_times_keys(q_rows, k)  # [B, H, rows, D]
        gk = _scores_fp32(k.transpose(-1, -2), k)  # k^T k [B, Hkv, D, D]
        if hkv != H:
            gk = gk.repeat_interleave(H // hkv, dim=1)  # D x D per head: small
    q_lr = torch.einsum("bhsd,hdr->bhsr", q_rows.float(), wq)
    m = torch.einsum("bhsd,hdr->bhsr", u, wk)
    gram = torch.einsum("hdr,bhde,hes->bhrs", wk, gk, wk)  # k_lr^T k_lr
    num = (q_lr * m).sum(-1)
    den_sq = (torch.matmul(q_lr, gram) * q_lr).sum(-1)
    return num / den_sq.clamp_min(1e-24).sqrt()


class LowRankPredictor(nn.Module):
    """fp32 low-rank predictor for ``heads`` local query heads (TP-sharded along dim 0)."""

    def __init__(self, cfg: DSVConfig, heads: int, head_dim: int, hidden: int, layer_number: int,
                 head_offset: int = 0, total_heads: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        self.mode = cfg.predictor_input
        self.heads, self.head_dim, self.hidden, self.rank = heads, head_dim, hidden, cfg.predictor_rank
        total_heads = heads if total_heads is None else total_heads
        # A private generator seeded by the layer makes init identical on every DP rank and
        # independent of the model's RNG stream; TP ranks slice their heads from the full draw.
        gen = torch.Generator().manual_seed(9_973 * layer_number + 17)
        r = self.rank
        if self.mode == "qk":
            # Wq = Wk = a Gaussian projection: q_lr k_lr^T starts as a Johnson-Lindenstrauss
            # sketch of q k^T (positive cosine from step 0) instead of noise.
            w = torch.randn(total_heads, head_dim, r, generator=gen) / math.sqrt(r)
            w = w[head_offset:head_offset + heads]
            self.wq = nn.Parameter(w.clone(), requires_grad=False)
            self.wk = nn.Parameter(w.clone(), requires_grad=False)
        else:
            w = torch.randn(total_heads, hidden, 2 * r, generator=gen) / math.sqrt(hidden)
            self.w = nn.Parameter(w[head_offset:head_offset + heads].clone(), requires_grad=False)
        for name, p in self._weights():
            self.register_buffer(f"{name}_exp_avg", torch.zeros_like(p))
            self.register_buffer(f"{name}_exp_avg_sq", torch.zeros_like(p))
            self.register_buffer(f"{name}_grad", torch.zeros_like(p), persistent=False)
        self.register_buffer("adam_steps", torch.zeros(1, dtype=torch.float32))
        self.register_buffer("grad_count", torch.zeros(1, dtype=torch.float32), persistent=False)
        self._adam_t: Optional[float] = 0.0  # host mirror of adam_steps (None: read it once from the device)
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "_adam_t", None))

    def _weights(self):
        return [(n, p) for n, p in self.named_parameters(recurse=False)]

    def _apply(self, fn, recurse=True):
        """Device moves apply; dtype casts (Float16Module's ``.bfloat16()``) do not: weights stay fp32."""
        def keep_fp32(t):
            out = fn(t)
            if t.is_floating_point() and t.dtype == torch.float32 and out.dtype != torch.float32:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, recurse)

    # ---- projections ---------------------------------------------------------
    def project(self, q: torch.Tensor, k: torch.Tensor, hidden: Optional[torch.Tensor],
                weights: Optional[dict] = None, dtype: Optional[torch.dtype] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(q_lr, k_lr)``, each ``[B, H, S, r]``, from q ``[B,H,S,D]``, k ``[B,Hkv,S,D]``
        or hidden ``[S, B, hidden]``. ``weights`` overrides the parameters (for the local grad)."""
        w = dict(self._weights()) if weights is None else weights
        dtype = torch.float32 if dtype is None else dtype
        if self.mode == "qk":
            B, hkv, S, D = k.shape
            q_lr = torch.einsum("bhsd,hdr->bhsr", q.to(dtype), w["wq"].to(dtype))
            wk = w["wk"].to(dtype).view(hkv, self.heads // hkv, D, self.rank)
            k_lr = torch.einsum("bgsd,gjdr->bgjsr", k.to(dtype), wk).reshape(B, self.heads, S, self.rank)
            return q_lr, k_lr
        self._need_hidden(hidden)
        both = torch.einsum("sbk,hkr->bhsr", hidden.to(dtype), w["w"].to(dtype))
        return both[..., :self.rank], both[..., self.rank:]

    def _need_hidden(self, hidden):
        if self.mode == "hidden" and hidden is None:
            raise ValueError("predictor_input='hidden' needs the layer's hidden states: build the layer with "
                             "megatron_dsv.models.specs.get_dsv_layer_spec (it installs DSVSelfAttention)")

    # ---- training --------------------------------------------------------------
    def accumulate_grad(self, q, k, hidden, query_index: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """Predictor loss on the sampled queries; adds its gradient to the private buffers.

        Inputs are detached here, so the main model's gradients never see the predictor.
        The loss never builds the ``rows x S`` low-rank score matrix (see :func:`_row_cosines`):
        autograd holds only ``[S, r]`` and ``[rows, r]`` tensors. ``softmax_scale`` does not
        matter: both score rows are L2-normalised. Returns the mean loss as a 0-dim tensor
        (no host sync).
        """
        del softmax_scale  # rows are normalised: the loss is scale-free
        self._need_hidden(hidden)
        q, k = q.detach(), k.detach()
        hidden = hidden.detach() if hidden is not None else None
        B, H, S, _ = q.shape
        rows = query_index.numel()
        # True scores in the model dtype (fp32 accumulation): no fp32 or GQA-repeated copy of the keys.
        q_rows = q.index_select(2, query_index)
        cfg = self.cfg
        # On unit rows MSE = 2 (1 - cos) / S, so the paper's loss is one weight times (1 - cos).
        weight = cfg.predictor_loss_cos_weight + 2.0 * cfg.predictor_loss_mse_weight / S
        with torch.enable_grad():
            leaves = {n: p.detach().requires_grad_(True) for n, p in self._weights()}
            if self.mode == "qk":  # no projection of the keys at all (see _qk_row_cosines)
                cos = _qk_row_cosines(q_rows, k, leaves["wq"], leaves["wk"])
            else:  # project only the half each side needs: q_lr of the sampled rows, k_lr of all tokens
                w, r = leaves["w"], self.rank
                q_lr = torch.einsum("sbk,hkr->bhsr", hidden.index_select(0, query_index).float(), w[..., :r])
                k_lr = torch.einsum("sbk,hkr->bhsr", hidden.float(), w[..., r:])
                cos = _row_cosines(q_lr, k_lr, q_rows, k)
            loss = weight * (1.0 - cos).sum() / (B * H * rows)
            grads = torch.autograd.grad(loss, list(leaves.values()))
        for (name, _), g in zip(self._weights(), grads):
            getattr(self, f"{name}_grad").add_(g)
        self.grad_count += 1
        return loss.detach()

    def grad_buffers(self):
        return [getattr(self, f"{n}_grad") for n, _ in self._weights()]

    @torch.no_grad()
    def adam_step(self, lr: float, grad_count: Optional[float] = None) -> None:
        """One Adam step on the accumulated (already DP-summed) gradient, then clear it.

        ``grad_count``: the host value of the ``grad_count`` buffer when the caller has it (the step
        end fetches every layer's in one copy); ``None`` reads it from the device.
        """
        adam_step_many([self], [lr], [grad_count])


@torch.no_grad()
def adam_step_many(predictors: Sequence["LowRankPredictor"], lrs: Sequence[float],
                   grad_counts: Sequence[Optional[float]]) -> None:
    """One Adam step for each predictor (mean of its accumulated gradient over ``grad_count``
    micro-batches; skipped when 0), then clear the gradients. All layers' tensors go through
    multi-tensor (``torch._foreach_*``) kernels: ~10 launches per step for the whole model instead
    of ~10 per weight. ``grad_counts`` entries: host values, or ``None`` to read the buffer."""
    b1, b2 = _ADAM_BETAS
    params, grads, ms, vs, scales, bc2, steps = [], [], [], [], [], [], []
    active = []
    for pred, lr, count in zip(predictors, lrs, grad_counts):
        count = float(pred.grad_count[0]) if count is None else float(count)
        if count == 0:
            continue
        if pred._adam_t is None:  # after a checkpoint load: one read, then the mirror is kept
            pred._adam_t = float(pred.adam_steps[0])
        pred._adam_t += 1.0
        t = pred._adam_t
        active.append(pred)
        for name, p in pred._weights():
            params.append(p)
            grads.append(getattr(pred, f"{name}_grad"))
            ms.append(getattr(pred, f"{name}_exp_avg"))
            vs.append(getattr(pred, f"{name}_exp_avg_sq"))
            scales.append(1.0 / count)
            bc2.append(1 - b2 ** t)
            steps.append(-lr / (1 - b1 ** t))
    if not active:
        return
    g = torch._foreach_mul(grads, scales)
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, g, alpha=1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, g, g, value=1 - b2)
    denom = torch._foreach_div(vs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, _ADAM_EPS)
    torch._foreach_addcdiv_(params, ms, denom, steps)
    torch._foreach_zero_(grads)
    torch._foreach_add_([pred.adam_steps for pred in active], 1.0)
    torch._foreach_zero_([pred.grad_count for pred in active])

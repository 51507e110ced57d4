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
computed right where the loss is, inside the attention forward, in closed form (no autograd),
and accumulated into a private buffer. The weights are ``requires_grad=False``
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
``MSE = 2 * (1 - cos) / S``, so the loss is ``(cos_w + 2 mse_w / S) * (1 - cos)``. Both score
rows are linear in the keys, so every cosine follows from second moments over the sequence
(:func:`_cosine_loss_and_grads`): ``k^T k`` (``D x D`` per key head) for 'qk', plus ``X^T X``
and ``X^T k`` of the hidden states for 'hidden'. One ``S x D x D`` product per key head
replaces the ``rows x S`` true and low-rank score matrices, so the cost no longer grows with
the number of sampled rows times S (H200, 0.8B layer at S = 16K: the explicit form cost
~29 ms per layer, the Gram-of-``k_lr`` form 4 ms, mostly launch-bound autograd).
:func:`predictor_loss` is the explicit definition, kept as the reference the tests compare
against (value and gradient, fp64). The moments are taken from the model-dtype values with
fp32 accumulation (tensor cores for bf16).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron_dsv.config import DSVConfig

__all__ = ["LowRankPredictor", "adam_step_many", "train_predictors", "predictor_loss", "predictor_flops_per_token"]

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


def _gram_fp32(x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x^T y`` summed over the sequence (``x`` ``[..., S, F]``, ``y`` ``[..., S, E]``, default ``x``;
    same leading dims) in fp32: bf16/fp16 CUDA operands on the tensor cores with fp32 accumulation
    and output (``bmm(out_dtype=)``), anything else widened to fp32 first (exact products)."""
    y = x if y is None else y
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _FP32_OUT_BMM[0]:
        try:
            *lead, S, F = x.shape
            out = torch.bmm(x.reshape(-1, S, F).transpose(1, 2), y.reshape(-1, S, y.shape[-1]),
                            out_dtype=torch.float32)
            return out.view(*lead, F, y.shape[-1])
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_BMM[0] = False  # this torch has no fp32-output bmm: widen from now on
    return torch.matmul(x.float().transpose(-1, -2), y.float())


_FP32_OUT_BMM = [True]


def _group_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[..., H, n, X]`` -> ``[..., Hkv, (H / Hkv) n, X]``: the query heads of one key head stacked
    (head h = g * rep + j, as ``repeat_interleave``), so per-key-head matrices need no repeat."""
    *lead, H, n, X = t.shape
    return t.reshape(*lead, hkv, (H // hkv) * n, X)


def _cosine_loss_and_grads(xq: torch.Tensor, q_rows: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                           gk: torch.Tensor, gx: torch.Tensor, c: torch.Tensor, weight):
    """The predictor loss ``weight * mean(1 - cos)`` over sampled rows and its weight gradients,
    in closed form from second moments over the sequence (no ``rows x S`` matrix, no autograd).

    A sampled query's true score row is ``t = q k^T`` and its low-rank row ``l = a Wk^T X^T``
    (``a = xq Wq``; ``X`` the key-side features: ``k`` for 'qk', the hidden states for 'hidden').
    By associativity ``l . t = a Wk^T (X^T k) q^T``, ``|l|^2 = a Wk^T (X^T X) Wk a^T`` and
    ``|t|^2 = q (k^T k) q^T``, so the loss needs only ``gk = k^T k`` ``[..., B, Hkv, D, D]``,
    ``gx = X^T X`` (``[..., B, H or 1, F, F]``) and ``c = X^T k`` (``[..., B, Hkv, F, D]``).
    ``xq`` ``[..., B, H or 1, n, Fq]`` and ``q_rows`` ``[..., B, H, n, D]`` (fp32); ``wq`` ``[..., 1, H, Fq, r]``,
    ``wk`` ``[..., 1, H, F, r]`` (or without the leading dims); ``weight``: a float or a tensor
    broadcastable to ``[..., 1, 1, 1]``. Leading dims ``...`` batch independent problems (layers,
    micro-batches). Returns ``(loss [...], d_wq [..., H, Fq, r], d_wk [..., H, F, r])``, gradients
    summed over B; equal to autograd through :func:`predictor_loss` of the explicit rows (tested, fp64).
    """
    *lead, B, H, n, _ = q_rows.shape
    hkv = gk.shape[-3]
    qg = _group_heads(q_rows, hkv)
    t_sq = (qg * torch.matmul(qg, gk)).sum(-1).view(*lead, B, H, n)  # |t|^2
    u = torch.matmul(qg, c.transpose(-1, -2)).view(*lead, B, H, n, -1)  # t X = q k^T X  [..., n, F]
    u = u / t_sq.clamp_min(1e-24).sqrt().unsqueeze(-1)  # unit(t) X  (F.normalize's eps)
    a = torch.matmul(xq, wq)  # [..., B, H, n, r]
    m = torch.matmul(u, wk)  # unit(t) . l = a . m
    gw = torch.matmul(gx, wk)  # X^T X Wk  [..., B, H, F, r]
    gram = torch.matmul(wk.transpose(-1, -2), gw)  # |l|^2 = a gram a^T
    ag = torch.matmul(a, gram)
    num = (a * m).sum(-1)
    den = (a * ag).sum(-1).clamp_min(1e-24).sqrt()
    cos = num / den
    scale = weight / (B * H * n)  # d loss / d (1 - cos)
    loss = (scale * (1.0 - cos)).sum((-3, -2, -1))
    # through cos = num / sqrt(den_sq)
    g_num = -scale / den
    g_den_sq = -0.5 * g_num * cos / den
    d_a = g_num.unsqueeze(-1) * m + (2.0 * g_den_sq).unsqueeze(-1) * ag
    d_m = g_num.unsqueeze(-1) * a
    d_gram = torch.matmul(a.transpose(-1, -2), g_den_sq.unsqueeze(-1) * a)  # symmetric
    d_wq = torch.matmul(xq.transpose(-1, -2), d_a).sum(-4)
    d_wk = (torch.matmul(u.transpose(-1, -2), d_m) + 2.0 * torch.matmul(gw, d_gram)).sum(-4)
    return loss, d_wq, d_wk


class _Moments(NamedTuple):
    """One training call's sufficient statistics (see :func:`_cosine_loss_and_grads`)."""

    xq: torch.Tensor
    q_rows: torch.Tensor
    gk: torch.Tensor
    gx: torch.Tensor
    c: torch.Tensor
    weight: float

    def signature(self):
        return tuple(tuple(t.shape) for t in self[:5]) + (self.xq.device,)


_MAX_STASH = 64  # calls kept per predictor before it trains on its own (a caller that never ends a step)


def train_predictors(predictors: Sequence["LowRankPredictor"]) -> Tuple[torch.Tensor, List[int]]:
    """Turn every predictor's collected calls into gradients (added to its buffers), batched.

    All calls with the same shapes, across predictors (layers) and micro-batches, go through
    :func:`_cosine_loss_and_grads` together: ~40 kernels for the whole model instead of ~30 per
    layer, and no stream sync. Returns ``(loss sums [P] (device), calls per predictor)``: per
    predictor, the sum of its calls' mean losses and how many calls it had.
    """
    counts = [len(p._stash) + p._trained_early[1] for p in predictors]
    if not any(counts):
        return torch.zeros(len(predictors)), counts
    device = predictors[0].adam_steps.device
    sums = torch.zeros(len(predictors), device=device)
    groups = {}
    for i, pred in enumerate(predictors):
        if pred._trained_early[1]:
            sums[i] += pred._trained_early[0]
            pred._trained_early = (0.0, 0)
        for st in pred._stash:
            groups.setdefault((pred.mode, st.weight, st.signature()), []).append((i, st))
        pred._stash = []
    for (mode, weight, _), calls in groups.items():
        owners = [predictors[i] for i, _ in calls]  # one per call: a layer's micro-batches repeat it
        stats = [torch.stack(ts).float() for ts in zip(*(st[:5] for _, st in calls))]  # xq, q_rows, gk, gx, c
        if mode == "qk":
            wq = torch.stack([p.wq for p in owners]).unsqueeze(1)
            wk = torch.stack([p.wk for p in owners]).unsqueeze(1)
        else:
            w = torch.stack([p.w for p in owners]).unsqueeze(1)
            wq, wk = w[..., :owners[0].rank], w[..., owners[0].rank:]
        loss, d_wq, d_wk = _cosine_loss_and_grads(*stats[:2], wq, wk, *stats[2:], weight)
        ids = [i for i, _ in calls]
        sums.index_add_(0, from_host(ids, device, torch.long), loss)
        d_w = (d_wq, d_wk) if mode == "qk" else (torch.cat([d_wq, d_wk], dim=-1),)
        unique = list(dict.fromkeys(ids))
        if len(unique) < len(ids):  # micro-batches of one layer: sum first (one foreach must not see a buffer twice)
            slot = from_host([unique.index(i) for i in ids], device, torch.long)
            d_w = tuple(torch.zeros(len(unique), *d.shape[1:], device=device).index_add_(0, slot, d) for d in d_w)
        names = ("wq_grad", "wk_grad") if mode == "qk" else ("w_grad",)
        torch._foreach_add_([getattr(predictors[i], n) for i in unique for n in names],
                            [d[j] for j in range(len(unique)) for d in d_w])
    return sums, counts


def all_reduce_many(tensors: Sequence[torch.Tensor], group) -> None:
    """Sum ``tensors`` (one dtype) over ``group`` in place, in one all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def from_host(values: Sequence, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor of host values on ``device`` without a stream sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


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
        self._stash: List[_Moments] = []  # calls collected since the last train_predictors
        self._trained_early = (0.0, 0)  # (loss sum, calls) of stashes trained before the step end
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
        or hidden ``[S, B, hidden]``. ``weights`` overrides the parameters (the tests' autograd reference)."""
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
    def collect(self, q, k, hidden, query_index: torch.Tensor, seq_group=None) -> None:
        """Record one training call on the sampled queries: its loss's sufficient statistics.

        A few kernels in the attention forward (the sampled q rows and ``k^T k``, plus ``X^T X`` and
        ``X^T k`` for 'hidden'); the loss and gradient are computed for all layers at once by
        :func:`train_predictors` at the step end. Runs under ``no_grad``: the main model's gradients
        never see the predictor. Counts one gradient contribution (``grad_count``).

        ``seq_group``: under context parallelism q, k (and hidden) are this rank's sequence shard and
        ``query_index`` indexes the shard; the second moments are sums over the sequence, so one
        all-reduce (sum) over the CP group makes them the full sequence's, and each rank's rows
        are its share of the sampled queries (the step end averages the ranks' gradients).
        """
        self._need_hidden(hidden)
        B, H, S, _ = q.shape
        cp = 1 if seq_group is None else torch.distributed.get_world_size(seq_group)
        S = S * cp
        cfg = self.cfg
        # On unit rows MSE = 2 (1 - cos) / S, so the paper's loss is one weight times (1 - cos).
        weight = cfg.predictor_loss_cos_weight + 2.0 * cfg.predictor_loss_mse_weight / S
        with torch.no_grad():
            # the sampled rows stay in the model's dtype until the step end (half the stash in bf16, and
            # exact: train_predictors upcasts them to fp32, which is what an fp32 copy here held)
            q_rows = q.index_select(2, query_index)
            gk = _gram_fp32(k)  # k^T k in fp32 (tensor cores for bf16 keys)
            if self.mode == "qk":
                if cp > 1:
                    all_reduce_many([gk], seq_group)
                gk_h = gk.repeat_interleave(H // gk.shape[1], dim=1) if gk.shape[1] != H else gk  # D x D: small
                stats = _Moments(q_rows, q_rows, gk, gk_h, gk, weight)
            else:
                x = hidden.transpose(0, 1)  # [B, s, F]
                hkv, D = k.shape[1], k.shape[3]
                # X^T k for every key head in one product: keys laid out [B, s, Hkv * D]
                c = _gram_fp32(x, k.permute(0, 2, 1, 3).reshape(B, k.shape[2], hkv * D))
                c = c.view(B, -1, hkv, D).permute(0, 2, 1, 3).contiguous()  # [B, Hkv, F, D]
                gx = _gram_fp32(x).unsqueeze(1)
                if cp > 1:
                    all_reduce_many([gk, gx, c], seq_group)
                xq = hidden.index_select(0, query_index).transpose(0, 1).unsqueeze(1)
                stats = _Moments(xq, q_rows, gk, gx, c, weight)  # xq shared by heads
            self._stash.append(stats)
            self.grad_count += 1
        if len(self._stash) >= _MAX_STASH:  # bounded memory for a caller that never ends a step
            (loss_sum,), (n,) = train_predictors([self])  # folds in earlier early trainings
            self._trained_early = (loss_sum, n)

    def accumulate_grad(self, q, k, hidden, query_index: torch.Tensor, softmax_scale: float = None) -> torch.Tensor:
        """One call's loss (0-dim, no host sync), its gradient added to the buffers right away:
        :meth:`collect` then :func:`train_predictors` for this predictor alone. ``softmax_scale``
        does not matter (both score rows are L2-normalised)."""
        del softmax_scale
        self.collect(q, k, hidden, query_index)
        (loss_sum,), (n,) = train_predictors([self])
        return loss_sum / n

    def grad_buffers(self):
        return [getattr(self, f"{n}_grad") for n, _ in self._weights()]


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

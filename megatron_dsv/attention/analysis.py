"""Attention-sparsity analysis of a video DiT with DSV attention (the figures of DESIGN.md section 1).

For one batch, :func:`capture_qk` records every DSV layer's post-RoPE q, k; then per layer and head:

* exact sparsity at ``theta`` (the oracle's :func:`head_sparsity`);
* :func:`mass_curve`: softmax mass held by the top-n keys, on a fixed grid of n / S;
* :func:`critical_distance_histogram`: 3D distances from queries to their critical keys
  (are critical keys local?) and the share within a small radius;
* :func:`cube_overlap`: how much the critical sets of the queries of one query group agree;
* :func:`oracle_list_density`: the kept fraction one list per query group needs at a recall target
  when the attention itself picks it, per list shape (:func:`list_shapes`: one query, 32-query token
  lists, the layer's group as tokens and as blocks);
* :func:`predictor_list_density`: the same kept fraction when the layer's own predictor ranks the
  items (the profiler's recall curve), on the same queries: the predictor's cost over the oracle;
* :func:`predictor_recall`: critical-mass recall of the lists the layer's predictor builds at the
  layer's current budgets (``DSVCoreAttention._estimate``, the lists a sparse forward would use);
* :func:`logit_spread`: the standard deviation of a query's scaled logits over the keys, and
  :func:`gaussian_sparsity`, the exact sparsity that spread would give if logits were Gaussian
  (what part of the sparsity is the logits' scale, what part the shape of their tail).

:func:`analyze` runs them all and returns a JSON-able dict (``tools/analyze_sparsity.py`` plots it).
Tensors are ``[B, H, S, D]`` (k: ``[B, Hkv, S, D]``, GQA: Hkv divides H); queries are sampled
(``query_index``) and the softmax rows are computed in chunks of ``chunk_elems`` probabilities by
the oracle, never S x S. Pure torch: CPU or GPU.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.attention.dispatcher import head_budgets
from megatron_dsv.attention.grouping import cube_order_coords
from megatron_dsv.attention.hooks import dsv_eval_forward, dsv_layers
from megatron_dsv.attention.profiler import _RecallCurve, profile_stats, smallest_k_reaching
from megatron_dsv.config import DSVConfig
# The oracle's validation and chunked softmax / critical-set pass: the same definition of a
# critical set as the profiler's, not a second copy of it.
from megatron_dsv.ops.topk_estimation.naive import block_view
from megatron_dsv.ops.topk_estimation.oracle import _check, _logit_chunks, _one_pass, _prob_chunks, head_sparsity

__all__ = ["capture_qk", "sample_queries", "key_fractions", "mass_curve", "critical_distance_histogram",
           "cube_overlap", "oracle_list_density", "list_shapes", "predictor_list_density", "layer_list_densities",
           "ranked_label",
           "predictor_recall", "logit_spread", "gaussian_sparsity", "analyze"]

_CHUNK = 1 << 24


# ---------------------------------------------------------------- capture
@torch.no_grad()
def _capture(model, latents, timesteps, labels, text=None, text_mask=None, force_dense=True) -> dict:
    """``{layer_number: (q, k, hidden or None)}``; see :func:`capture_qk`."""
    layers = dsv_layers(model)
    if not layers:
        raise ValueError("model has no DSVCoreAttention layers: build it with a DSVConfig "
                         "(build_video_dit(cfg, dsv_config=...)) or load a checkpoint trained with DSV")
    captured = {}

    def hook(module, args, kwargs):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        # [s, b, heads, hn] -> [b, heads, s, hn], copied: the forward may reuse its buffers
        q, k = (t.detach().permute(1, 2, 0, 3).clone(memory_format=torch.contiguous_format) for t in (query, key))
        hidden = module._hidden.detach().clone() if module._hidden is not None else None
        captured[module.layer_number] = (q, k, hidden)

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        with dsv_eval_forward(model):
            for layer in layers:
                layer.force_dense = layer.force_dense or force_dense
            model(latents, timesteps, labels, text=text, text_mask=text_mask)
    finally:
        for h in handles:
            h.remove()
    return captured


def capture_qk(model, latents: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor], *,
               text=None, text_mask=None, force_dense: bool = True, with_hidden: bool = False) -> Dict[int, tuple]:
    """One eval, no-grad forward of ``model``; returns ``{layer_number: (q, k)}`` for every DSV layer:
    post-RoPE q ``[B, H, S, D]`` and k ``[B, Hkv, S, D]`` in the model's token (cube-major) order.
    ``with_hidden``: ``(q, k, hidden)`` instead, the layer's input hidden states ``[S, B, hidden]``
    where its predictor reads them (``predictor_input='hidden'``), else None.

    The arguments are the model's forward inputs. ``force_dense`` (default) runs every DSV layer
    dense during the capture, so each layer sees the activations of exact attention. DSV state
    (buffers, counters, metrics' host copies), the model's train/eval mode and ``force_dense``
    are as before afterwards; the hooks are removed. Holds every layer's q, k at once.
    """
    out = _capture(model, latents, timesteps, labels, text, text_mask, force_dense)
    return out if with_hidden else {n: (q, k) for n, (q, k, _) in out.items()}


# ---------------------------------------------------------------- sampling and grids
def sample_queries(S: int, stride: int = 8, max_queries: Optional[int] = None, device=None) -> torch.Tensor:
    """int64 query positions: one in ``stride`` (from stride // 2, off the group edges), then at most
    ``max_queries`` of them, evenly spread."""
    if stride < 1 or S < 1:
        raise ValueError(f"sample_queries: `stride` and `S` must be >= 1, got stride={stride}, S={S}")
    idx = torch.arange(min(stride // 2, S - 1), S, stride)
    if max_queries is not None and idx.numel() > max_queries:
        if max_queries < 1:
            raise ValueError(f"sample_queries: `max_queries` must be >= 1 or None, got {max_queries}")
        idx = idx[torch.linspace(0, idx.numel() - 1, max_queries).round().long().unique()]
    return idx.to(device)


def key_fractions(S: int, points: int = 100, spacing: str = "log") -> torch.Tensor:
    """float64 ``[points]`` grid of key fractions n / S in [1/S, 1]: log- or linearly spaced."""
    if points < 2:
        raise ValueError(f"key_fractions: `points` must be >= 2, got {points}")
    match spacing:
        case "log":
            return torch.logspace(-math.log10(S), 0.0, points, dtype=torch.float64)
        case "linear":
            return torch.linspace(1.0 / S, 1.0, points, dtype=torch.float64)
    raise ValueError(f"key_fractions: `spacing` must be one of ('log', 'linear'), got {spacing!r}")


def _top_n(fractions: torch.Tensor, S: int) -> torch.Tensor:
    """Keys n = ceil(f * S) per fraction (the 1e-9 keeps f = n / S, rounded up in fp, at n)."""
    return torch.ceil(fractions.double() * S - 1e-9).long().clamp(1, S)


# ---------------------------------------------------------------- the measurements
def mass_curve(q: torch.Tensor, k: torch.Tensor, query_index: Optional[torch.Tensor] = None,
               softmax_scale: Optional[float] = None, fractions: Optional[torch.Tensor] = None,
               chunk_elems: int = _CHUNK) -> torch.Tensor:
    """float64 ``[B, H, P]``: mean over the sampled queries of the softmax mass held by the query's
    top-n keys, n = ceil(f * S), for each key fraction f of ``fractions`` (default
    :func:`key_fractions` (S), log-spaced). Non-decreasing; 1 at f = 1."""
    qi = _check(q, k, 1.0, query_index)
    S = q.shape[2]
    fr = key_fractions(S) if fractions is None else torch.as_tensor(fractions, dtype=torch.float64)
    if fr.dim() != 1 or fr.numel() == 0 or float(fr.min()) <= 0 or float(fr.max()) > 1:
        raise ValueError("mass_curve: `fractions` must be a non-empty 1-D tensor of values in (0, 1]")
    n = _top_n(fr, S).to(q.device) - 1
    total = torch.zeros(q.shape[0], q.shape[1], fr.numel(), dtype=torch.float64, device=q.device)
    for _, probs, _ in _prob_chunks(q, k, 1.0, softmax_scale, qi, chunk_elems):
        cum = torch.cumsum(torch.sort(probs, dim=-1, descending=True).values.double(), dim=-1)
        total += cum.index_select(-1, n).sum(2)
    return total / max(1, qi.numel())


def logit_spread(q: torch.Tensor, k: torch.Tensor, query_index: Optional[torch.Tensor] = None,
                 softmax_scale: Optional[float] = None, chunk_elems: int = _CHUNK) -> torch.Tensor:
    """float64 ``[B, H]``: mean over the sampled queries of the standard deviation, over all keys, of
    the query's scaled logits ``q . k * softmax_scale`` (default ``1 / sqrt(D)``). Chunked over queries
    like the oracle (``chunk_elems`` logits resident at once)."""
    qi = _check(q, k, 1.0, query_index)
    total = torch.zeros(q.shape[:2], dtype=torch.float64, device=q.device)
    for _, logits in _logit_chunks(q, k, softmax_scale, qi, chunk_elems):
        total += logits.std(dim=-1, correction=0).double().sum(-1)
    return total / max(1, qi.numel())


def gaussian_sparsity(sigma, theta: float = 0.9):
    """Exact theta-sparsity of a query whose logits over many keys are i.i.d. ``N(mu, sigma^2)``:
    ``Phi(sigma - Phi^-1(theta))`` (the keys above a logit cut hold the lognormal mass share
    ``Phi(sigma - cut)``). ``sigma`` a float or tensor; the same type back. sigma = 1 gives 0.389 at
    theta = 0.9, sigma = 2.32 gives 0.85."""
    if not (0.0 < float(theta) < 1.0):
        raise ValueError(f"gaussian_sparsity: `theta` must be in (0, 1), got {theta}")
    normal = torch.distributions.Normal(0.0, 1.0)
    s = torch.as_tensor(sigma, dtype=torch.float64)
    out = normal.cdf(s - normal.icdf(torch.tensor(float(theta), dtype=torch.float64)))
    return out if isinstance(sigma, torch.Tensor) else float(out)


def _distance_edges(coords: torch.Tensor, bins) -> torch.Tensor:
    if isinstance(bins, int):
        if bins < 1:
            raise ValueError(f"critical_distance_histogram: `bins` must be >= 1 or a 1-D tensor of edges, got {bins}")
        span = (coords.max(0).values - coords.min(0).values).double().norm()
        return torch.linspace(0.0, max(float(span), 1.0), bins + 1, dtype=torch.float64)
    edges = torch.as_tensor(bins, dtype=torch.float64).cpu()
    if edges.dim() != 1 or edges.numel() < 2 or bool((edges[1:] <= edges[:-1]).any()):
        raise ValueError("critical_distance_histogram: `bins` edges must be a 1-D increasing tensor of >= 2 values")
    return edges


def critical_distance_histogram(q: torch.Tensor, k: torch.Tensor, coords: torch.Tensor,
                                query_index: Optional[torch.Tensor] = None, theta: float = 0.9, bins=32,
                                softmax_scale: Optional[float] = None, radius: float = 5.0,
                                chunk_elems: int = _CHUNK) -> dict:
    """Distances from sampled queries to their theta-critical keys, Euclidean in token units.

    ``coords``: int ``[S, 3]`` (t, h, w) of every token in the tensors' order
    (:func:`~megatron_dsv.attention.grouping.cube_order_coords`). ``bins``: a number of equal bins
    from 0 to the grid's diagonal, or a 1-D tensor of edges (bins are ``[e_i, e_i+1)``, the last one
    closed; distances outside fall into the first / last bin). Returns float64 tensors:

    * ``edges`` ``[nbins + 1]`` (CPU);
    * ``critical`` ``[B, H, nbins]``: number of (query, critical key) pairs per bin;
    * ``all_keys`` ``[nbins]``: number of (query, key) pairs per bin, every key (the reference:
      what a uniform choice of keys would give);
    * ``within_radius`` ``[B, H]``: share of the (query, critical key) pairs at distance <= ``radius``.
    """
    qi = _check(q, k, theta, query_index)
    S = q.shape[2]
    if not isinstance(coords, torch.Tensor) or tuple(coords.shape) != (S, 3):
        raise ValueError(f"critical_distance_histogram: `coords` must be a [S, 3] = [{S}, 3] tensor of (t, h, w)")
    coords = coords.to(q.device).double()
    edges = _distance_edges(coords, bins)
    nb = edges.numel() - 1
    B, H = q.shape[:2]
    crit_hist = torch.zeros(B, H, nb, dtype=torch.float64, device=q.device)
    all_hist = torch.zeros(nb, dtype=torch.float64, device=q.device)
    near = torch.zeros(B, H, dtype=torch.float64, device=q.device)
    for pos, _, crit in _prob_chunks(q, k, theta, softmax_scale, qi, chunk_elems):
        dist = torch.cdist(coords[pos], coords)  # [n, S]
        slot = (torch.bucketize(dist, edges.to(q.device), right=True) - 1).clamp(0, nb - 1)
        all_hist += torch.bincount(slot.flatten(), minlength=nb).double()
        c = crit.double()
        crit_hist += torch.zeros(B, H, pos.numel(), nb, dtype=torch.float64, device=q.device).scatter_add_(
            -1, slot.expand_as(crit), c).sum(2)
        near += (c * (dist <= radius)).sum((2, 3))
    pairs = crit_hist.sum(-1)
    return {"edges": edges, "critical": crit_hist, "all_keys": all_hist,
            "within_radius": near / pairs.clamp_min(1.0)}


def _group_ids(group_index, NG: int, max_groups: int, device, fn: str) -> torch.Tensor:
    """The query groups to measure: ``group_index`` checked against ``[0, NG)``, or by default
    ``max_groups`` ids evenly spread over the NG groups."""
    if group_index is None:
        group_index = torch.linspace(0, NG - 1, min(NG, max(1, max_groups))).round().long().unique()
    gi = torch.as_tensor(group_index, device=device).long()
    if gi.dim() != 1 or gi.numel() == 0 or int(gi.min()) < 0 or int(gi.max()) >= NG:
        raise ValueError(f"{fn}: `group_index` must be a non-empty 1-D tensor of group ids in [0, {NG})")
    return gi


def _group_positions(group_index: torch.Tensor, group_size: int, S: int) -> torch.Tensor:
    pos = group_index.view(-1, 1) * group_size + torch.arange(group_size, device=group_index.device)
    return pos.flatten()[pos.flatten() < S]


def cube_overlap(q: torch.Tensor, k: torch.Tensor, group_size: int, theta: float = 0.9,
                 softmax_scale: Optional[float] = None, group_index: Optional[torch.Tensor] = None,
                 max_groups: int = 64, chunk_elems: int = _CHUNK) -> dict:
    """Agreement of the theta-critical sets of the queries of one query group (G = ``group_size``
    consecutive tokens: one cube of the latent grid in cube-major order).

    For sampled groups (``group_index``; default ``max_groups`` evenly spread over the
    ceil(S / G) groups), over every ordered pair (i, j), i != j, of queries in a group:
    ``jaccard`` = mean |A_i & A_j| / |A_i | A_j| and ``containment`` = mean |A_i & A_j| / |A_i|
    (the share of i's critical keys that j needs too). Returns ``{"jaccard": [B, H],
    "containment": [B, H]}`` float64 (NaN where no sampled group has two queries) and
    ``"groups"``, the number of groups measured.
    """
    _check(q, k, theta, None)
    B, H, S, _ = q.shape
    if group_size < 1:
        raise ValueError(f"cube_overlap: `group_size` must be >= 1, got {group_size}")
    gi = _group_ids(group_index, -(-S // group_size), max_groups, q.device, "cube_overlap")
    sums = torch.zeros(2, B, H, dtype=torch.float64, device=q.device)
    pairs = 0
    # whole groups per softmax pass: a group is never split between chunks
    per_pass = max(1, chunk_elems // (B * H * S * group_size))
    for g0 in range(0, gi.numel(), per_pass):
        pos = _group_positions(gi[g0:g0 + per_pass], group_size, S)
        for p, _, crit in _prob_chunks(q, k, theta, softmax_scale, pos, max(chunk_elems, B * H * S * pos.numel())):
            for group in torch.unique(p // group_size):
                rows = crit[:, :, p // group_size == group].double()  # [B, H, n, S]
                n = rows.shape[2]
                if n < 2:
                    continue
                inter = rows @ rows.transpose(-1, -2)  # [B, H, n, n]
                size = inter.diagonal(dim1=-2, dim2=-1)
                off = ~torch.eye(n, dtype=torch.bool, device=q.device)
                union = size[..., :, None] + size[..., None, :] - inter
                sums[0] += (inter / union.clamp_min(1.0))[..., off].sum(-1)
                sums[1] += (inter / size[..., :, None].clamp_min(1.0))[..., off].sum(-1)
                pairs += n * (n - 1)
    mean = sums / pairs if pairs else torch.full_like(sums, float("nan"))
    return {"jaccard": mean[0], "containment": mean[1], "groups": int(gi.numel())}


def _group_shapes(cfg) -> list:
    """The layer's query group as token lists and as lists of whole ``kv_block_size`` key blocks
    (whatever the layer's granularity): ``[(f"g{G}_tokens", G, 0), (f"g{G}_blocks{bs}", G, bs)]``."""
    G, bs = cfg.group_size, cfg.kv_block_size
    return [(f"g{G}_tokens", G, 0), (f"g{G}_blocks{bs}", G, bs)]


def list_shapes(cfg) -> list:
    """The list shapes of a layer's decomposition (:func:`oracle_list_density`): one query, the paper's
    32-query token lists (where 32 divides the layer's group), the layer's own group as token lists, and
    (block granularity) as whole key blocks: what each step from a query's own need to the layer's
    lists costs."""
    G = cfg.group_size
    tokens, blocks = _group_shapes(cfg)
    shapes = [("query", 1, 0)]
    if G > 32 and G % 32 == 0:
        shapes.append(("g32_tokens", 32, 0))
    if G > 1:
        shapes.append(tokens)
    if cfg.block_size:
        shapes.append(blocks)
    return shapes


def _checked_shapes(shapes, fn: str) -> list:
    """``shapes`` as ``[(name, group_size, block_size)]``: non-empty, group sizes >= 1 forming a chain
    of divisors (each divides the next larger: whole groups of the largest size hold whole groups of
    every other), block sizes >= 0."""
    shapes = [(str(n), int(g), int(b)) for n, g, b in shapes]
    if not shapes:
        raise ValueError(f"{fn}: `shapes` is empty")
    sizes = sorted({g for _, g, _ in shapes})
    for name, g, b in shapes:
        if g < 1 or b < 0 or any(max(g, h) % min(g, h) for h in sizes):
            raise ValueError(f"{fn}: shape {name!r} needs a group_size >= 1 in a chain of divisors "
                             f"with the others ({sizes}) and block_size >= 0, got group_size={g}, block_size={b}")
    return shapes


@torch.no_grad()
def oracle_list_density(q: torch.Tensor, k: torch.Tensor, shapes=None, theta: float = 0.9,
                        target: float = 0.95, softmax_scale: Optional[float] = None,
                        group_index: Optional[torch.Tensor] = None, max_groups: int = 16,
                        chunk_elems: int = _CHUNK) -> Dict[str, torch.Tensor]:
    """The smallest kept fraction of keys with which one key list per query group could reach
    ``target`` mean recall of the theta-critical mass, if the lists were chosen by the attention
    itself (an oracle, not a predictor), per (batch, head) and per list shape.

    For each ``(name, group_size, block_size)`` in ``shapes`` (default: :func:`list_shapes` of the
    library's default configuration, 4x4x8 cubes of 128 queries and 128-key blocks): the queries of a
    group share one list of tokens (``block_size`` 0) or of whole key blocks; the oracle keeps the
    items with the largest mean share of the group's queries' critical mass, which maximises the mean
    recall at every list length. As the profiler's recall rule, one length per head: the smallest at
    which the mean over the measured queries reaches ``target``. Sizes the two costs between a query's
    exact sparsity and a layer's kept fraction: sharing a list among a group's queries, and keeping
    blocks whole (the predictor's own cost: :func:`predictor_list_density`).

    Queries: every query of ``max_groups`` whole groups of the *largest* group size, evenly spread
    (``group_index`` ids in those units), so every shape is measured on the same queries. The group
    sizes must form a chain of divisors (each divides the next larger, e.g. 1, 32, 128). Softmax rows
    are computed ``chunk_elems`` probabilities at a time, as elsewhere in this module: a group larger
    than a chunk sums its shares over chunks. Returns ``{name: float64 [B, H] kept fraction}`` (list
    tokens / S).
    """
    _check(q, k, theta, None)
    if not (0.0 < float(target) <= 1.0):
        raise ValueError(f"oracle_list_density: `target` must be in (0, 1], got {target}")
    shapes = _checked_shapes(list_shapes(DSVConfig()) if shapes is None else shapes, "oracle_list_density")
    sizes = sorted({g for _, g, _ in shapes})
    B, H, S, _ = q.shape
    big = sizes[-1]
    gi = _group_ids(group_index, -(-S // big), max_groups, q.device, "oracle_list_density")
    # queries per softmax pass: the most that fit chunk_elems with every group either inside a pass or
    # made of whole passes (a divisor of big, a multiple of the smaller sizes, dividing the larger ones)
    fits = [c for c in range(big, 0, -1) if big % c == 0 and all(c % g == 0 if g <= c else g % c == 0 for g in sizes)]
    c = next((c for c in fits if c * B * H * S <= chunk_elems), 1)
    n_items = {name: S if b == 0 else -(-S // b) for name, _, b in shapes}
    curves = {name: torch.zeros(B, H, n_items[name], dtype=torch.float64, device=q.device) for name in n_items}
    open_sums = {}  # name -> the summed shares of a group larger than a pass, while its passes come in
    n_queries = 0
    for group in gi.tolist():
        positions = _group_positions(torch.tensor([group], device=q.device), big, S)
        for c0 in range(0, positions.numel(), c):
            pos = positions[c0:c0 + c]
            (_, probs, crit), = _prob_chunks(q, k, theta, softmax_scale, pos, B * H * S * pos.numel())
            cmass = (probs * crit).double()
            share = cmass / cmass.sum(-1, keepdim=True).clamp_min(1e-300)  # each query's critical mass sums to 1
            n = pos.numel()
            n_queries += n
            last = c0 + n >= positions.numel()
            for name, g, b in shapes:
                item = block_view(share, b, 0.0).sum(-1) if b else share  # [B, H, n, n_items]
                if g <= c:  # whole groups (the last one maybe partial) inside this pass
                    full = n // g * g
                    sums = item[:, :, :full].reshape(B, H, full // g, g, item.shape[-1]).sum(3)
                    if full < n:  # the partial last group at the end of the sequence
                        sums = torch.cat([sums, item[:, :, full:].sum(2, keepdim=True)], dim=2)
                    best = torch.sort(sums, dim=-1, descending=True).values
                    curves[name] += torch.cumsum(best, dim=-1).sum(2)
                    continue
                open_sums[name] = open_sums.get(name, 0.0) + item.sum(2)
                if last or (c0 + n) % g == 0:  # the group is complete
                    best = torch.sort(open_sums.pop(name), dim=-1, descending=True).values
                    curves[name] += torch.cumsum(best, dim=-1)
    out = {}
    for name, _, b in shapes:
        curve = curves[name] / max(1, n_queries)
        items = smallest_k_reaching(curve, target)
        out[name] = (items * (b or 1)).clamp(max=S).double() / S
    return out


@torch.no_grad()
def predictor_list_density(layer: DSVCoreAttention, q: torch.Tensor, k: torch.Tensor, hidden=None, shapes=None,
                           target: Optional[float] = None, group_index: Optional[torch.Tensor] = None,
                           max_groups: int = 16, chunk_elems: int = _CHUNK, *,
                           theta: Optional[float] = None, full_rank: bool = False) -> Dict[str, torch.Tensor]:
    """:func:`oracle_list_density` with the layer's predictor choosing the lists: the smallest kept
    fraction of keys with which the lists ``layer``'s low-rank predictor ranks reach ``target``
    (default ``recall_target`` of the layer's config) mean recall of the theta-critical mass (default
    the config's ``theta``), per (batch, head) and per list shape.

    The ranking is the profiler's (:func:`~megatron_dsv.attention.profiler.recall_curve` on
    ``layer.predictor.project(q, k, hidden)`` in q's dtype, with the config's ``group_proxy`` and
    ``block_score``; the estimator's lists at every length), read per (batch, head) like the oracle,
    without the profiler's batch mean and ``k_min`` floor. Shapes ``(name, group_size, block_size)``
    (default: the layer's group G as token lists and as whole ``kv_block_size`` blocks, at either
    granularity, named as :func:`list_shapes` names them); group sizes a chain of divisors, block
    sizes 0, 64 or 128 (the estimator's). Queries: every query of ``max_groups`` whole groups of the
    largest group size, evenly spread (or ``group_index``), as :func:`oracle_list_density` picks them,
    so with the same arguments the two are measured on the same queries and, the oracle's lists being
    the best at every length, the predictor's kept fraction is never below the oracle's (up to
    rounding at the target). ``hidden`` ``[S, B, hidden]``: for ``predictor_input='hidden'``.
    ``full_rank``: also ``exact_<name>`` per shape, the same ranking rule (group proxy, block score) on
    the exact scaled ``q . k`` instead of the rank-r projections: splits the predictor's cost over the
    oracle into what the low rank loses (``<name>`` over ``exact_<name>``) and what ranking a group's
    items by one proxy query's scores loses (``exact_<name>`` over the oracle). One softmax pass of
    ``chunk_elems`` probabilities at a time for all shapes. Returns ``{name: float64 [B, H] kept
    fraction}`` (list tokens / S, at most 1).
    """
    fn = "predictor_list_density"
    if not isinstance(layer, DSVCoreAttention):
        raise ValueError(f"{fn}: `layer` must be a DSVCoreAttention, got {type(layer).__name__}")
    cfg = layer.dsv_config
    theta = cfg.theta if theta is None else theta
    target = cfg.recall_target if target is None else target
    _check(q, k, theta, None)
    B, H, S, D = q.shape
    if not (0.0 < float(target) <= 1.0):
        raise ValueError(f"{fn}: `target` must be in (0, 1], got {target}")
    if H != layer.predictor.heads or (cfg.predictor_input == "qk" and D != layer.predictor.head_dim):
        raise ValueError(f"{fn}: `q` must have the layer's {layer.predictor.heads} heads of "
                         f"{layer.predictor.head_dim} channels, got {tuple(q.shape)}")
    if cfg.predictor_input == "hidden" and (not isinstance(hidden, torch.Tensor)
                                            or tuple(hidden.shape) != (S, B, layer.predictor.hidden)):
        raise ValueError(f"{fn}: `hidden` must be the layer's [S, B, hidden] = [{S}, {B}, {layer.predictor.hidden}] "
                         f"input (predictor_input='hidden'), got {tuple(getattr(hidden, 'shape', ())) or hidden}")
    if max_groups < 1 or chunk_elems < 1:
        raise ValueError(f"{fn}: `max_groups` and `chunk_elems` must be >= 1, got {max_groups}, {chunk_elems}")
    shapes = _checked_shapes(_group_shapes(cfg) if shapes is None else shapes, fn)
    for name, _, b in shapes:
        if b not in (0, 64, 128):
            raise ValueError(f"{fn}: shape {name!r} needs a block_size in (0, 64, 128) (the estimator's), got {b}")
    big = max(g for _, g, _ in shapes)
    pos = _group_positions(_group_ids(group_index, -(-S // big), max_groups, q.device, fn), big, S)
    rankings = [("", layer.predictor.project(q, k, hidden, dtype=q.dtype))]
    if full_rank:  # the exact logits' ranking: q scaled (lse block scores see the softmax's scale), k per q head
        rankings.append(("exact_", (q.float() * layer.softmax_scale, k.float().repeat_interleave(H // k.shape[1], 1))))
    accs = [_RecallCurve(q, q_lr, k_lr, g, b, cfg.group_proxy, cfg.block_score)
            for _, (q_lr, k_lr) in rankings for _, g, b in shapes]
    curves = iter(_one_pass(q, k, theta, layer.softmax_scale, pos, chunk_elems, accs))
    return {prefix + name: (smallest_k_reaching(next(curves), target) * (b or 1)).clamp(max=S).double() / S
            for prefix, _ in rankings for name, _, b in shapes}


def layer_list_densities(layer: DSVCoreAttention, q: torch.Tensor, k: torch.Tensor, hidden=None,
                         theta: float = 0.9, max_groups: int = 16):
    """``(oracle, predicted)``: :func:`oracle_list_density` over the layer's :func:`list_shapes` and
    :func:`predictor_list_density` with its exact-logit twins (``full_rank``), both at the layer's recall
    target, softmax scale and ``theta``, on the same ``max_groups`` groups: one layer's decomposition."""
    cfg = layer.dsv_config
    oracle = oracle_list_density(q, k, list_shapes(cfg), theta, cfg.recall_target, layer.softmax_scale,
                                 max_groups=max_groups)
    predicted = predictor_list_density(layer, q, k, hidden, max_groups=max_groups, theta=theta, full_rank=True)
    return oracle, predicted


def ranked_label(name: str) -> str:
    """Plot label of a :func:`predictor_list_density` key: ``exact_<shape>`` is ranked by the exact
    logits (``full-rank <shape>``), ``<shape>`` by the predictor (``pred <shape>``)."""
    return f"full-rank {name.removeprefix('exact_')}" if name.startswith("exact_") else f"pred {name}"


@torch.no_grad()
def predictor_recall(layer: DSVCoreAttention, q: torch.Tensor, k: torch.Tensor, hidden=None, theta: float = 0.9,
                     query_index: Optional[torch.Tensor] = None, chunk_elems: int = _CHUNK) -> dict:
    """Exact sparsity and the recall of the layer predictor's lists, per (batch, head).

    The lists are the ones ``layer`` builds (``DSVCoreAttention._estimate``: low-rank projection,
    then the top-k estimator) at the budgets of its state, by its budget rule
    (``budget_source='layer_state'``); a layer never profiled has no budgets of its own, so it gets
    the 'sparsity' rule's budgets at the sparsity measured here (``'measured_sparsity'``).
    ``hidden`` ``[S, B, hidden]`` is needed for ``predictor_input='hidden'``. Returns
    ``{"sparsity": [B, H], "recall": [B, H], "tokens": [H] (keys per query), "budget_source"}``.
    """
    cfg, S = layer.dsv_config, k.shape[2]
    stats = dict(theta=theta, softmax_scale=layer.softmax_scale, query_index=query_index, chunk_elems=chunk_elems)
    if layer.profiled_host:
        rule = layer.rule_budgets(S)
        (idx, counts), source = layer._estimate(q, k, hidden, rule[0]), "layer_state"
        sparsity, _, recall = profile_stats(q, k, **stats, lists=(idx, counts, cfg.group_size, cfg.block_size))
    else:
        sparsity = head_sparsity(q, k, **stats)
        rule, source = head_budgets(sparsity.mean(0).cpu(), S, cfg, layer._local_tokens(S)), "measured_sparsity"
        idx, counts = layer._estimate(q, k, hidden, rule[0])
        recall = profile_stats(q, k, **stats, lists=(idx, counts, cfg.group_size, cfg.block_size))[2]
    return {"sparsity": sparsity, "recall": recall, "tokens": rule[1], "budget_source": source}


# ---------------------------------------------------------------- everything, as JSON
def _vals(t) -> list:
    """Tensor -> nested lists of floats, NaN as None (strict JSON)."""
    out = torch.as_tensor(t).double().cpu().tolist()

    def clean(x):
        return [clean(v) for v in x] if isinstance(x, list) else (None if math.isnan(x) else round(x, 6))

    return clean(out)


def _layer_report(layer: DSVCoreAttention, q, k, hidden, coords, qi, theta, opts: dict) -> dict:
    S = q.shape[2]
    G = layer.dsv_config.group_size
    pr = predictor_recall(layer, q, k, hidden, theta, qi)
    curve = mass_curve(q, k, qi, layer.softmax_scale, opts["fractions"]).mean(0)
    hist = critical_distance_histogram(q, k, coords, qi, theta, opts["edges"], layer.softmax_scale, opts["radius"])
    over = cube_overlap(q, k, G, theta, layer.softmax_scale, max_groups=opts["max_groups"])
    target = layer.dsv_config.recall_target
    lists, predicted = layer_list_densities(layer, q, k, hidden, theta, opts["max_groups"])
    crit, pairs = hist["critical"].sum((0, 1)), hist["critical"].sum(-1)
    sparsity = pr["sparsity"].mean(0)
    spread = logit_spread(q, k, qi, layer.softmax_scale)
    return {
        "layer": layer.layer_number, "heads": q.shape[1],
        "sparsity": _vals(sparsity), "sparsity_mean": _vals(sparsity.mean()),
        "logit_std": _vals(spread.mean(0)), "gaussian_sparsity": _vals(gaussian_sparsity(spread, theta).mean(0)),
        "mass_curve": _vals(curve), "mass_curve_mean": _vals(curve.mean(0)),
        "distance_critical": _vals(crit / crit.sum().clamp_min(1.0)),
        "distance_all_keys": _vals(hist["all_keys"] / hist["all_keys"].sum().clamp_min(1.0)),
        "within_radius": _vals(hist["within_radius"].mean(0)),
        "within_radius_mean": _vals((hist["within_radius"] * pairs).sum() / pairs.sum().clamp_min(1.0)),  # pooled
        "cube_overlap": {"group_size": G, "groups": over["groups"], "jaccard": _vals(over["jaccard"].mean(0)),
                         "containment": _vals(over["containment"].mean(0)),
                         "jaccard_mean": _vals(over["jaccard"].mean()),
                         "containment_mean": _vals(over["containment"].mean())},
        "list_density": {"target": target, **{name: _vals(d.mean(0)) for name, d in lists.items()}},
        "predictor_list_density": {"target": target, **{name: _vals(d.mean(0)) for name, d in predicted.items()}},
        "predictor": {"recall": _vals(pr["recall"].mean(0)), "recall_mean": _vals(pr["recall"].mean()),
                      "budget_density": _vals(pr["tokens"].double() / S), "budget_source": pr["budget_source"],
                      "sparse": bool(layer.decide(S)[0]), "stage": layer.stage_host,
                      "sparsity_threshold": layer.dsv_config.sparsity_threshold,
                      "state_sparsity": _vals(layer._sparsity_cpu), "state_recall": _vals(layer._recall_cpu)},
    }


def _summary(layers: list) -> dict:
    def col(get):
        vals = [v for rep in layers for v in get(rep) if v is not None]
        return torch.tensor(vals, dtype=torch.float64) if vals else torch.full((1,), float("nan"))

    def per_shape(key):  # {shape: mean over layers and heads} of a list-density dict
        names = [n for n in layers[0][key] if n != "target"] if layers else []
        return {n: _vals(col(lambda r, n=n: r[key][n]).mean()) for n in names}

    heads = col(lambda r: r["sparsity"])
    return {"sparsity_median": _vals(heads.median()), "sparsity_min": _vals(heads.min()),
            "sparsity_max": _vals(heads.max()), "within_radius": _vals(col(lambda r: [r["within_radius_mean"]]).mean()),
            "cube_jaccard": _vals(col(lambda r: [r["cube_overlap"]["jaccard_mean"]]).nanmean()),
            "cube_containment": _vals(col(lambda r: [r["cube_overlap"]["containment_mean"]]).nanmean()),
            "predictor_recall": _vals(col(lambda r: [r["predictor"]["recall_mean"]]).mean()),
            "logit_std": _vals(col(lambda r: r["logit_std"]).mean()),
            "list_density": per_shape("list_density"), "predictor_list_density": per_shape("predictor_list_density"),
            "gaussian_sparsity": _vals(col(lambda r: r["gaussian_sparsity"]).mean())}


def analyze(model, latents: torch.Tensor, timesteps: torch.Tensor, labels: Optional[torch.Tensor],
            theta: float = 0.9, query_stride: int = 8, max_queries: int = 512, *, text=None, text_mask=None,
            coords: Optional[torch.Tensor] = None, bins: int = 32, radius: float = 5.0, points: int = 100,
            max_groups: Optional[int] = None, force_dense: bool = True,
            progress: Optional[Callable[[str], None]] = None) -> dict:
    """Every measurement of this module for every DSV layer of ``model`` on one batch (JSON-able).

    ``latents [B, C, T, H, W]``, ``timesteps [B]``, ``labels [B]`` (and ``text``, ``text_mask``) are
    the model's forward inputs (already noised: the caller picks t). Queries: :func:`sample_queries`
    (``query_stride``, ``max_queries``); cube overlap over ``max_groups`` query groups (default
    ``max_queries // G``). ``coords`` (t, h, w) of the tokens in model order default to the
    VideoDiT's cube-major coordinates. ``progress`` receives one line per layer. The dict:
    ``theta, S, batch, grid, cube, query_stride, num_queries, radius, key_fractions [P],
    distance_edges [nbins + 1], layers`` (one dict per layer: per-head lists ``sparsity``,
    ``mass_curve [H][P]``, ``within_radius``, ``cube_overlap``, ``predictor``, per shape ``list_density``
    (the oracle's) and ``predictor_list_density`` (with their recall ``target``); per-layer
    ``distance_critical`` / ``distance_all_keys`` histograms as shares) and ``summary``.
    """
    grid = cube = None
    if coords is None:
        from megatron_dsv.models.video_dit import unwrap_video_dit  # the model layer, needed only here

        vd = unwrap_video_dit(model)
        grid, cube = vd.dit_config.token_grid(latents.shape[2:]), vd.cube
        coords = cube_order_coords(grid, cube)
    captured = _capture(model, latents, timesteps, labels, text, text_mask, force_dense)
    by_number = {layer.layer_number: layer for layer in dsv_layers(model)}
    S = next(iter(captured.values()))[0].shape[2]
    qi = sample_queries(S, query_stride, max_queries, device=latents.device)
    opts = {"fractions": key_fractions(S, points), "edges": _distance_edges(coords.double(), bins), "radius": radius}
    reports = []
    for n in sorted(captured):
        q, k, hidden = captured.pop(n)  # free each layer's tensors once measured
        G = by_number[n].dsv_config.group_size
        opts["max_groups"] = max_groups if max_groups is not None else max(1, max_queries // G)
        rep = _layer_report(by_number[n], q, k, hidden, coords, qi, theta, opts)
        reports.append(rep)
        if progress is not None:
            progress(f"layer {n}: sparsity {rep['sparsity_mean']:.3f} (heads {min(rep['sparsity']):.3f}.."
                     f"{max(rep['sparsity']):.3f}), critical keys within {radius:g} tokens "
                     f"{rep['within_radius_mean']:.3f}, cube jaccard {_fmt(rep['cube_overlap']['jaccard_mean'])}, "
                     f"predictor recall {rep['predictor']['recall_mean']:.3f}, logit std "
                     f"{sum(rep['logit_std']) / len(rep['logit_std']):.2f} (Gaussian-logit sparsity "
                     f"{sum(rep['gaussian_sparsity']) / len(rep['gaussian_sparsity']):.3f}), oracle kept fraction "
                     + ", ".join(f"{name} {sum(v) / len(v):.3f}" for name, v in rep["list_density"].items()
                                 if name != "target")
                     + "; predictor kept fraction " + ", ".join(
                         f"{name} {sum(v) / len(v):.3f}" for name, v in rep["predictor_list_density"].items()
                         if name != "target"))
    return {"theta": theta, "S": S, "batch": int(latents.shape[0]), "grid": list(grid) if grid else None,
            "cube": list(cube) if cube else None, "query_stride": query_stride, "num_queries": int(qi.numel()),
            "radius": radius, "key_fractions": _vals(opts["fractions"]), "distance_edges": _vals(opts["edges"]),
            "layers": reports, "summary": _summary(reports)}


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"

"""3D local-window attention: the DSV paper's static "window attention" baseline.

Tokens are in 3D-cube-major order (:mod:`megatron_dsv.attention.grouping`): every run of
``G = ct*ch*cw`` tokens is one cube of the token grid, cubes in raster order of the cube
grid. Each query cube attends the KV cubes within ``radius`` cubes of it on every axis
(a Chebyshev neighbourhood in cube units); cubes at the grid's edges have fewer
neighbours. The query cube is also the KV block, so the lists are block-level lists of
the sparse kernel, with ``group_size == block_size == G``.

The sparse op takes one list length per (batch, head), shared by all query groups, while
edge cubes here have shorter lists. :class:`WindowCoreAttention` therefore groups the query
cubes by list length (at most ``(rt+1)(rh+1)(rw+1)`` lengths; e.g. 8 and 12 on a 4x2x2 cube
grid at radius 1): one cached permutation sorts the cubes by length, each class runs the op
on its own query cubes only (``Sq = cubes in the class * G``) against the full keys, and the
concatenated outputs are un-permuted. The result is exact, and the work is the kept
fraction: each query cube attends exactly its own neighbourhood.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dsv.models.dense_core_attention import check_core_attention_args
from megatron_dsv.ops.sparse_attention import SUPPORTED_HEAD_DIMS, sparse_attention, sparse_attention_naive
from megatron_dsv.ops.sparse_attention.op import requested_backend

__all__ = ["WindowConfig", "WindowCoreAttention", "window_block_lists", "kept_fraction", "radius_for_fraction",
           "get_window_layer_spec"]

WINDOW_BLOCK_SIZES = (64, 128)  # the sparse kernel's KV block sizes (also valid query group sizes)
Triple = Tuple[int, int, int]


@dataclass
class WindowConfig:
    """Shape of the local window (all sizes in tokens of the patch-token grid, or in cubes)."""

    cube: Triple = (4, 4, 8)
    """Query cube (t, h, w) in tokens; it is also the KV block, so its volume must equal ``block_size``."""
    radius: Triple = (1, 1, 1)
    """Neighbourhood (rt, rh, rw) in cubes: a query cube attends every KV cube at most r_a cubes away on axis a."""
    block_size: int = 128
    """KV block size of the sparse kernel, 64 or 128 (= cube volume = query group size)."""

    def __post_init__(self):
        self.cube = tuple(int(x) for x in self.cube)
        self.radius = tuple(int(x) for x in self.radius)
        if self.block_size not in WINDOW_BLOCK_SIZES:
            raise ValueError(f"WindowConfig.block_size must be one of {list(WINDOW_BLOCK_SIZES)}, "
                             f"got {self.block_size!r}")
        if len(self.cube) != 3 or min(self.cube) < 1 or math.prod(self.cube) != self.block_size:
            raise ValueError(f"WindowConfig.cube must be three positive ints (t, h, w) with t*h*w == block_size "
                             f"({self.block_size}), got {self.cube}")
        if len(self.radius) != 3 or min(self.radius) < 0:
            raise ValueError(f"WindowConfig.radius must be three ints >= 0 (rt, rh, rw) in cubes, got {self.radius}")


def _geometry(token_grid: Sequence[int], cube: Sequence[int]) -> Tuple[Triple, Triple, Triple]:
    """(grid, cube, cube grid); ValueError unless every grid side is a positive multiple of the cube side."""
    grid, cube = tuple(int(x) for x in token_grid), tuple(int(x) for x in cube)
    if len(cube) != 3 or min(cube) < 1:
        raise ValueError(f"cube must be three positive ints (t, h, w), got {cube}")
    if len(grid) != 3 or min(grid) < 1 or any(g % c for g, c in zip(grid, cube)):
        # a partial edge cube would not be a whole KV block of the kernel
        raise ValueError(f"token_grid must be three positive ints (T, H, W), each a multiple of cube {cube}; "
                         f"got {grid}")
    return grid, cube, tuple(g // c for g, c in zip(grid, cube))


def _radius(radius: Sequence[int]) -> Triple:
    radius = tuple(int(x) for x in radius)
    if len(radius) != 3 or min(radius) < 0:
        raise ValueError(f"radius must be three ints >= 0 (rt, rh, rw) in cubes, got {radius}")
    return radius


@lru_cache(maxsize=32)
def _lists_cpu(ncubes: Triple, radius: Triple) -> Tuple[torch.Tensor, torch.Tensor]:
    # a radius past the grid names the same cubes as n - 1: clamp, so candidates stay few
    radius = tuple(min(r, n - 1) for r, n in zip(radius, ncubes))
    coords = torch.cartesian_prod(*(torch.arange(n) for n in ncubes)).view(-1, 1, 3)  # [nG, 1, 3] raster order
    offsets = torch.cartesian_prod(*(torch.arange(-r, r + 1) for r in radius)).view(1, -1, 3)  # [1, nC, 3]
    nbr = coords + offsets  # offsets are lexicographic, so valid neighbour ids come out ascending
    valid = ((nbr >= 0) & (nbr < torch.tensor(ncubes))).all(-1)
    ids = (nbr[..., 0] * ncubes[1] + nbr[..., 1]) * ncubes[2] + nbr[..., 2]
    counts = valid.sum(-1)
    # move the valid entries to the front, keeping their order; padding is -1 (never read)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[:, :int(counts.max())]
    idx = torch.where(valid.gather(1, order), ids.gather(1, order), -1)
    return idx.to(torch.int32), counts.to(torch.int32)


@lru_cache(maxsize=32)
def _lists_on(ncubes: Triple, radius: Triple, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    idx, counts = _lists_cpu(ncubes, radius)
    return idx.to(device), counts.to(device)


def window_block_lists(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int],
                       device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """KV-cube lists of every query cube.

    Returns ``(kv_indices, kv_counts)``: int32 ``[nG, Kmax]`` and ``[nG]``, ``nG = nT*nH*nW``
    cubes in raster order of the cube grid; row g holds, ascending, the ids of the cubes within
    ``radius`` of cube g on every axis (g itself included), then -1 padding. Cached per
    (grid, cube, radius, device): treat the tensors as read-only.
    """
    _, _, ncubes = _geometry(token_grid, cube)
    return _lists_on(ncubes, _radius(radius), torch.device(device if device is not None else "cpu"))


def _axis_coverage(n: int, r: int) -> float:
    """Mean over the n cubes of one axis of the fraction of that axis inside the window."""
    return sum(min(i + r, n - 1) - max(i - r, 0) + 1 for i in range(n)) / (n * n)


def kept_fraction(token_grid: Sequence[int], cube: Sequence[int], radius: Sequence[int]) -> float:
    """Mean over queries of the fraction of keys attended (1 - sparsity), to match DSV's density.

    The window is a product of per-axis windows over a product grid, so the mean factorises by axis.
    """
    _, _, ncubes = _geometry(token_grid, cube)
    return math.prod(_axis_coverage(n, r) for n, r in zip(ncubes, _radius(radius)))


def radius_for_fraction(token_grid: Sequence[int], cube: Sequence[int], target: float) -> Triple:
    """The first radius on a balanced growth path whose :func:`kept_fraction` is >= ``target``.

    Search: start at (0, 0, 0); while the kept fraction is below ``target``, add one cube of
    radius to the axis whose window side in tokens, ``(2 r_a + 1) * cube_a``, is smallest (the
    earliest of t, h, w on ties), skipping axes the window already spans. Each step keeps
    the window as close to a token-space cube as the cube grid allows and strictly raises
    the fraction, so the path ends at full attention (1.0) and the answer is the smallest
    radius on it (not a search over every (rt, rh, rw)).
    """
    _, cube, ncubes = _geometry(token_grid, cube)
    if not 0.0 < float(target) <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    radius = [0, 0, 0]
    while kept_fraction(token_grid, cube, radius) < target:
        open_axes = [a for a in range(3) if radius[a] < ncubes[a] - 1]
        if not open_axes:  # float round-off at target ~ 1.0: the window is already everything
            break
        axis = min(open_axes, key=lambda a: ((2 * radius[a] + 1) * cube[a], a))
        radius[axis] += 1
    return tuple(radius)


@lru_cache(maxsize=32)
def _size_classes(ncubes: Triple, radius: Triple, group: int, device: torch.device):
    """Query cubes grouped by list length: ``(perm, inv, classes)``.

    ``perm`` int64 ``[S]``: token order with the cubes sorted by list length (stably, so cube ids
    ascend within a class), whole cubes of ``group`` tokens each; ``inv`` its inverse. Both None
    when the order is already sorted (e.g. one class). ``classes``: per distinct length c,
    ``(c, first, n, lists)``: the class's cubes are positions ``first .. first + n - 1`` of the
    sorted order, and ``lists`` int32 ``[n, c]`` their ascending KV-cube ids over the full grid."""
    idx, counts = _lists_cpu(ncubes, radius)
    cubes = torch.argsort(counts, stable=True)
    sorted_counts = counts[cubes]
    classes, first = [], 0
    for c in sorted(set(counts.tolist())):
        n = int((sorted_counts == c).sum())
        lists = idx[cubes[first:first + n], :c].contiguous()
        classes.append((c, first, n, lists.to(device)))
        first += n
    if torch.equal(cubes, torch.arange(cubes.numel())):
        return None, None, tuple(classes)
    perm = (cubes[:, None] * group + torch.arange(group)).reshape(-1)
    inv = torch.argsort(perm)
    return perm.to(device), inv.to(device), tuple(classes)


def _class_backend(n_queries: int, n_keys: int) -> str:
    """The backend of one class's call: "auto", except where ``DSV_SPARSE_ATTN_BACKEND=flex`` would
    meet Sq != Sk, which flex refuses: that class falls back to Triton (auto never picks flex there)."""
    if n_queries != n_keys and requested_backend(None) == "flex":
        return "triton"
    return "auto"


class WindowCoreAttention(MegatronModule):
    """Core attention over a fixed 3D local window, with Megatron's core_attention contract."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 window_config: Optional[WindowConfig] = None, token_grid: Optional[Sequence[int]] = None):
        super().__init__(config=config)
        if not isinstance(window_config, WindowConfig):
            raise ValueError(f"window_config must be a WindowConfig, got {type(window_config).__name__}")
        if token_grid is None:
            raise ValueError("token_grid (T, H, W) of the patch tokens is required")
        check_core_attention_args("WindowCoreAttention", config, attn_mask_type, attention_dropout, pg_collection,
                                  cp_hint="use cp=1")
        if config.kv_channels not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"kv_channels (head dim) must be one of {SUPPORTED_HEAD_DIMS} for the sparse kernel, "
                             f"got {config.kv_channels}")
        self.window_config = window_config
        self.token_grid, _, self._ncubes = _geometry(token_grid, window_config.cube)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` (ng divides np) -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise ValueError("WindowCoreAttention does not support packed_seq_params (THD packing); pass None")
        if attention_bias is not None:
            raise ValueError("WindowCoreAttention does not support attention_bias; pass None")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"attn_mask_type must be no_mask or padding, got {mask_type}")
        if mask_type == AttnMaskType.padding and attention_mask is not None:
            raise ValueError("WindowCoreAttention takes no padding attention_mask (its lists cover a whole, "
                             "unpadded token grid); pass None")
        S = math.prod(self.token_grid)
        if query.dim() != 4 or query.shape[0] != S or key.shape[0] != S:
            raise ValueError(f"query/key must be [sq, b, heads, hn] with sq = sk = T*H*W = {S} of token_grid "
                             f"{self.token_grid}; got query {tuple(query.shape)}, key {tuple(key.shape)}")
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))  # [b, heads, s, hn]
        out = self._attend(q, k, v)
        sq, b, heads, hn = query.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, H, S, D]``; each length class on its own cubes."""
        B, H, S = q.shape[:3]
        G = self.window_config.block_size
        perm, inv, classes = _size_classes(self._ncubes, self.window_config.radius, G, q.device)
        qs = q if perm is None else q.index_select(2, perm)  # cubes sorted by list length
        outs = []
        for count, first, n, lists in classes:
            q_sub = qs[:, :, first * G:(first + n) * G]
            idx = lists.expand(B, H, n, count)
            counts = torch.full((B, H), count, dtype=torch.int32, device=q.device)
            if q.is_cuda:  # lists are valid by construction: skip the host-syncing value check
                o = sparse_attention(q_sub, k, v, idx, counts, G, G, self.softmax_scale, check_values=False,
                                     backend=_class_backend(n * G, S))
            else:
                o = sparse_attention_naive(q_sub, k, v, idx, counts, G, G, self.softmax_scale)
            outs.append(o)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out if inv is None else out.index_select(2, inv)


def _swap(layer_spec: ModuleSpec, window_config: WindowConfig, token_grid: Triple) -> ModuleSpec:
    from megatron_dsv.models.specs import replace_core_attention

    core = ModuleSpec(module=WindowCoreAttention, params={"window_config": window_config, "token_grid": token_grid})
    return replace_core_attention(layer_spec, core, AttnMaskType.no_mask)


def get_window_layer_spec(base_spec, window_config: WindowConfig, token_grid: Sequence[int]):
    """Copy of ``base_spec`` (a layer ``ModuleSpec`` or ``TransformerBlockSubmodules``) whose
    self-attention core is :class:`WindowCoreAttention` with mask type ``no_mask``; the base is untouched."""
    if not isinstance(window_config, WindowConfig):
        raise ValueError(f"window_config must be a WindowConfig, got {type(window_config).__name__}")
    token_grid, _, _ = _geometry(token_grid, window_config.cube)
    if hasattr(base_spec, "layer_specs"):
        block = copy.copy(base_spec)
        block.layer_specs = [_swap(s, window_config, token_grid) for s in base_spec.layer_specs]
        return block
    if not isinstance(base_spec, ModuleSpec):
        raise ValueError("base_spec must be a ModuleSpec or TransformerBlockSubmodules, "
                         f"got {type(base_spec).__name__}")
    return _swap(base_spec, window_config, token_grid)

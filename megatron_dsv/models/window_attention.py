"""3D local-window attention: the DSV paper's static "window attention" baseline.

Tokens are in 3D-cube-major order (:mod:`megatron_dsv.attention.grouping`): every run of
``G = ct*ch*cw`` tokens is one cube of the token grid, cubes in raster order of the cube
grid. Each query cube attends the KV cubes within ``radius`` cubes of it on every axis
(a Chebyshev neighbourhood in cube units); cubes at the grid's edges have fewer
neighbours. The query cube is also the KV block, so the lists are block-level lists of
the sparse kernel, with ``group_size == block_size == G``.

Edge cubes have fewer neighbours, so their lists are shorter: :class:`WindowCoreAttention` makes one
call of the sparse op with one list length per query cube (``kv_counts [B, H, NG]``), over all queries
and keys. The result is exact, and the work is the kept fraction: each query cube attends exactly its
own neighbourhood. (Until 2026-12-01 it ran one call per list-length class on a permuted query order:
up to (rt+1)(rh+1)(rw+1) calls per layer, each paying the backward's fixed cost, which made the window
slower than full attention on the H200 at 16K-32K tokens although it kept 29% of the keys.)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dsv.attention.neighbourhood import (Triple, _geometry, _lists_on, kept_fraction,  # noqa: F401
                                                 radius_for_fraction, window_block_lists)
from megatron_dsv.models.dense_core_attention import check_core_attention_args
from megatron_dsv.ops.sparse_attention import SUPPORTED_HEAD_DIMS, sparse_attention, sparse_attention_naive

__all__ = ["WindowConfig", "WindowCoreAttention", "window_block_lists", "kept_fraction", "radius_for_fraction",
           "get_window_layer_spec"]

WINDOW_BLOCK_SIZES = (64, 128)  # the sparse kernel's KV block sizes (also valid query group sizes)


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
        """q ``[B, H, S, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, H, S, D]``: one sparse call, one list length per cube."""
        B, H = q.shape[:2]
        G = self.window_config.block_size
        lists, counts = _lists_on(self._ncubes, self.window_config.radius, q.device)  # [NG, C] (-1 padded), [NG]
        idx = lists.expand(B, H, *lists.shape)
        cnt = counts.expand(B, H, -1)
        if q.is_cuda:  # lists are valid by construction: skip the host-syncing value check
            return sparse_attention(q, k, v, idx, cnt, G, G, self.softmax_scale, check_values=False)
        return sparse_attention_naive(q, k, v, idx, cnt, G, G, self.softmax_scale)


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

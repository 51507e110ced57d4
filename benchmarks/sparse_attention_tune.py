"""The tile sweep of ``bench_sparse_attention.py --tune``: every pass's candidate configs (BM, BN, warps, stages)
timed at one shape, the winners installed in ``launch.CONFIG_OVERRIDES`` for the points timed after it.
``tools/kernel_resources.py --space tune`` compiles the same candidates offline."""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from benchmarks.bench_sparse_attention import D, H, inputs, make_lists
from benchmarks.common import bench_ms
from megatron_dsv.ops.sparse_attention import launch
from megatron_dsv.ops.sparse_attention.packing import token_pack_factor

TUNE_SPACE = {
    # pass -> candidate (BM, BN, num_warps, num_stages)
    "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2)],
    "bwd_q": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (64, 128, 4, 2),
              (128, 128, 8, 2), (64, 32, 4, 3)],
    "bwd_kv": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2), (64, 64, 8, 2),
               (128, 64, 4, 2), (64, 128, 8, 2)],
    "fwd_tok": [(128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
    # (128, 128, 8, 2) left: 256 KB of shared memory, beyond an SM's 227 (tools/kernel_resources.py)
    "bwd_q_tok": [(128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 2)],
}
# D > 128 (256): a [BM, 256] fp32 accumulator holds 2x the registers of D=128's, and 256-wide K/V tiles 2x the
# shared memory per stage. The candidates are those that fit an SM's shared memory and spill at most a few dozen
# bytes a thread on sm_90 (tools/kernel_resources.py with the GPU's Triton 3.6), pick_config's D=256 values first
# (chosen that way, never timed) and its earlier one-stage values beside them (they spill 72-808 bytes); the 3.7x
# cuDNN of 2026-11-30 is the figure to beat. Token lists' dq kernel takes at most 64 query rows at D=256: 128 rows
# need 288-336 KB of shared memory for its dK/dV scatter
TUNE_SPACE_BIG = {
    "fwd": [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1),
            (64, 128, 8, 1)],
    "bwd_q": [(64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 8, 2), (128, 32, 8, 2), (32, 64, 8, 2), (128, 64, 8, 1)],
    "bwd_kv": [(32, 64, 8, 2), (32, 64, 8, 1), (64, 32, 8, 2), (64, 32, 8, 1), (16, 64, 8, 2), (64, 64, 8, 2)],
    "fwd_tok": [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 3)],
    "bwd_q_tok": [(64, 32, 8, 2), (64, 64, 8, 1), (64, 32, 8, 3), (32, 32, 8, 2)],
}


# token forwards of 32-query groups at D <= 128, added to fwd_tok's candidates: the DSV artifact's shape (4 warps over
# 128- or 256-key steps; its own autotuning takes 3 or 5 stages, but tools/kernel_resources.py reports the same
# shared memory at 2 and 3: the gathered K/V tiles are not multi-buffered) and the 8-warp 128-key step beside it. Its
# G = 32 forward was 10-12% faster than ours in run 24; run 25 took (32, 128, 4, 2) as the default
TUNE_SPACE_SMALL_G_TOK = [(32, 128, 4, 3), (32, 128, 4, 2), (32, 256, 4, 2), (32, 128, 8, 3)]


def tune_space(name: str, dim: int, group_size: int = 128):
    """The (BM, BN, warps, stages) candidates of one pass at head dim ``dim`` and query-group size ``group_size``."""
    space = list((TUNE_SPACE_BIG if dim > 128 else TUNE_SPACE)[name])
    if name == "fwd_tok" and dim <= 128 and group_size <= 32:
        space += TUNE_SPACE_SMALL_G_TOK
    return space


def tune_configs(name: str, dim: int, group_size: int, group_rows: int) -> List[Dict]:
    """The config dicts the sweep times for one pass: :func:`tune_space`'s tiles, query tiles capped at
    ``group_rows`` (the group the pass's config key names)."""
    return [dict(BM=min(BM, group_rows), BN=BN, num_warps=w, num_stages=st)
            for BM, BN, w, st in tune_space(name, dim, group_size)]


def config_group(kind: str, G: int, BS: int) -> int:
    """The group size ``launch.pick_config`` sees for pass ``kind`` (its CONFIG_OVERRIDES key): the token dq kernel
    runs on packed groups of P * G rows (``launch.sparse_bwd``), every other pass on groups of G."""
    return G * token_pack_factor(G, BS) if kind == "bwd_q" else G


def _time_pass(kind, cfg, q, k, v, o, lse, do, idx, cnt, G, BS, scale):
    if kind == "fwd":
        return bench_ms(lambda: launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale, cfg=cfg))
    cq = cfg if kind == "bwd_q" else None
    ckv = cfg if kind == "bwd_kv" else None
    # block-level dq kernel timed alone; the dk/dv kernel as the whole backward
    if kind == "bwd_q" and BS > 0:
        do = do.contiguous()
        return bench_ms(lambda: launch.sparse_bwd_q(do, q, k, v, o, lse, idx, cnt, G, BS, scale, False, cfg_q=cq))
    return bench_ms(lambda: launch.sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, scale, cfg_q=cq, cfg_kv=ckv))


TUNE_PASSES = ("fwd", "bwd_q", "bwd_kv", "fwd_tok", "bwd_q_tok")


def tune(S, G, sparsity=0.9, dim=D, heads=H, lists="random", granularity="both", passes=None):
    """Sweep each pass's configs at one shape; install winners in launch.CONFIG_OVERRIDES. ``lists``: the lists'
    kind (:func:`make_lists`); ``granularity``: block (128-key blocks), token or both; ``passes``: only these of
    :data:`TUNE_PASSES` (None: all, and the block lists' atomic dK/dV variant)."""
    rows = []
    scale = 1 / math.sqrt(dim)
    for BS in {"block": (128,), "token": (0,), "both": (128, 0)}[granularity]:
        q, k, v = (t.detach() for t in inputs(S, dim=dim, heads=heads))
        idx, cnt, _ = make_lists(S, G, BS, sparsity, heads=heads, kind=lists)
        o, lse = launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale)
        do = torch.randn_like(o)
        names = ("fwd", "bwd_q", "bwd_kv") if BS else ("fwd_tok", "bwd_q_tok")
        for name in (n for n in names if passes is None or n in passes):
            kind = name.replace("_tok", "")
            # the token dq kernel's query tile and config key are its packed group's (timing 32-row tiles of a
            # 128-row packed group repeats the dK/dV atomics: 150-169 ms against the packed default's 53 in run 25)
            group_rows = config_group(kind, G, BS)
            best = (float("inf"), None)
            for cfg in tune_configs(name, dim, G, group_rows):
                try:
                    ms = _time_pass(kind, cfg, q, k, v, o, lse, do, idx, cnt, G, BS, scale)
                except Exception as e:  # out of shared memory etc.: not a candidate
                    ms = float("inf")
                    print(f"  {name} {cfg} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                rows.append(dict(pass_=name, S=S, D=dim, H=heads, G=G, block_size=BS, sparsity=sparsity, lists=lists,
                                 ms=ms, **cfg))
                print(f"  tune {name:10s} BM={cfg['BM']:3d} BN={cfg['BN']:3d} w={cfg['num_warps']} "
                      f"s={cfg['num_stages']}: {ms:8.3f} ms", flush=True)
                best = min(best, (ms, cfg), key=lambda t: t[0])
            launch.CONFIG_OVERRIDES[(kind, dim, group_rows, BS)] = best[1]
            print(f"tune {name}: best {best[1]} {best[0]:.3f} ms", flush=True)
        if BS and passes is None:
            cq = dict(BM=128, BN=64, num_warps=8, num_stages=2)  # the atomic variant needs smaller tiles
            try:
                ms = bench_ms(lambda: launch.sparse_bwd(do, q, k, v, o, lse, idx, cnt, G, BS, scale,
                                                        atomic_kv=True, cfg_q=cq))
            except Exception as e:
                ms = float("inf")
                print(f"  atomic variant failed: {type(e).__name__}", flush=True)
            rows.append(dict(pass_="bwd_atomic", S=S, D=dim, H=heads, G=G, block_size=BS, sparsity=sparsity, ms=ms))
            print(f"tune bwd with atomics instead of inverse map: {ms:.3f} ms", flush=True)
    return rows

"""The shape sweep of ``bench_sparse_attention.py --sweep`` (issue #15): which points it runs, how long
they should take, how its warm-up compiles are split, and its heatmap. Pure planning and plotting (no
timing, no GPU): the benchmark script times the points.

Grid: S in {16K, 64K} x sparsity 0.9 for every cell D in {64, 96, 128, 256} x G in {32, 64, 128} x
{token, block 128}, the heatmap's points (S=64K, 90%) first, plus S in {16K, 32K, 64K, 128K} x
sparsity {0.8, 0.9, 0.95} at (D=128, G=128, block 128) and (D=256, G=128, block 128). Points the
library rejects carry ``skipped`` with its own message.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from megatron_dsv.ops.sparse_attention.checks import check_shapes
from megatron_dsv.ops.sparse_attention.flex import flex_supported

H, B = 16, 1  # default query heads and batch of every benchmark point


def flex_skip_reason(G, BS) -> Optional[str]:
    """Why flex is not run for this (G, block), or None where it lowers."""
    if BS == 0:
        return "token lists: no BlockMask"
    if not flex_supported(0, G, BS):
        return "flex lowers only G=128 with block 128 here (flex.flex_supported)"
    return None


SWEEP_DIMS = (64, 96, 128, 256)  # the presets' head dims (tiny, 0.8b, 2.7b, 30b)
SWEEP_GROUPS = (32, 64, 128)
SWEEP_BASE = ((16384, 65536), (0.9,))  # (S, sparsity) for every cell
SWEEP_EXTRA = ((16384, 32768, 65536, 131072), (0.8, 0.9, 0.95))  # ... and for these cells:
SWEEP_EXTRA_CELLS = ((128, 128, 128), (256, 128, 128))  # (D, G, block_size)
HEATMAP_AT = (65536, 0.9)  # (S, sparsity) of the heatmap


def gran_label(BS: int) -> str:
    return "token" if BS == 0 else f"block{BS}"


def unsupported(S, dim, G, BS, heads) -> Optional[str]:
    """The library's own shape check (on meta tensors: no memory, no device): its message, or None."""
    q = torch.empty(B, heads, S, dim, device="meta", dtype=torch.bfloat16)
    idx = torch.empty(B, heads, math.ceil(S / G), 1, device="meta", dtype=torch.int32)
    cnt = torch.empty(B, heads, device="meta", dtype=torch.int32)
    try:
        check_shapes(q, q, q, idx, cnt, G, BS)
    except ValueError as e:
        return f"unsupported by the library: {e}"
    return None


def sweep_cells(dims, groups, granularity="both", block_sizes=(128,)) -> List[Tuple[int, int, int]]:
    """(D, G, block_size) cells; block_size 0 = token lists."""
    sizes = ([0] if granularity in ("token", "both") else []) + \
        (list(block_sizes) if granularity in ("block", "both") else [])
    return [(d, g, bs) for d in dims for g in groups for bs in sizes]


def sweep_grid(dims=SWEEP_DIMS, groups=SWEEP_GROUPS, granularity="both", block_sizes=(128,),
               seq_lens=None, sparsities=None, heads=H) -> List[Dict]:
    """The sweep's points in run order: the heatmap's (S=64K, 90%) first, then the rest of the base
    grid, then the extra (S, sparsity) of SWEEP_EXTRA_CELLS, cheap S first. ``seq_lens`` /
    ``sparsities`` replace the default grid by their product over every cell (a missing one: the
    base's). Points the library rejects carry ``skipped`` (its message)."""
    cells = sweep_cells(dims, groups, granularity, block_sizes)
    custom = seq_lens is not None or sparsities is not None
    base = list(seq_lens or SWEEP_BASE[0]), list(sparsities or SWEEP_BASE[1])
    pts = {}
    for cell in cells:
        combos = [(S, sp) for S in base[0] for sp in base[1]]
        if not custom and cell in SWEEP_EXTRA_CELLS:
            combos += [(S, sp) for S in SWEEP_EXTRA[0] for sp in SWEEP_EXTRA[1] if (S, sp) not in combos]
        for S, sp in combos:
            pts[(cell, S, sp)] = "heatmap" if (S, sp) == HEATMAP_AT else \
                ("base" if S in base[0] and sp in base[1] else "extra")
    order = {"heatmap": 0, "base": 1, "extra": 2}
    out = []
    for ((d, g, bs), S, sp), phase in sorted(pts.items(), key=lambda t: (order[t[1]], t[0][1], t[0][0], t[0][2])):
        p = dict(S=S, H=heads, D=d, B=B, G=g, group_size=g, block_size=bs, sparsity=sp,
                 granularity="token" if bs == 0 else "block", phase=phase)
        why = unsupported(S, d, g, bs, heads)
        if why:
            p["skipped"] = why
        out.append(p)
    return out


# Time model of a point on the H200 (bf16, B=1): per-call ms at S=64K, 90%, D=128, H=16, G=128 from
# sparse_attention-h200-20261130.json, scaled by S^2 (1 - sparsity) H, the head-dim tile width
# (96 runs 128-wide tiles) and the -groups- file's G factors (token lists assumed: bwd x 128/G, its
# atomics scale with the number of groups). Compile times are assumptions, not measurements.
EST_REF_MS = {"block": (7.62, 23.12), "token": (9.31, 33.63), "flex": (8.55, 22.94), "dense": (57.5, 161.3)}
EST_G = {128: (1.0, 1.0), 64: (1.86, 1.11), 32: (2.7, 1.5), 16: (5.4, 2.2)}  # (fwd, bwd) x vs G=128
EST_FLOOR_MS = (0.15, 1.0)  # per call: the backward's ~1 ms floor at 16K
EST_S = dict(start=15.0, cell_cached=0.5, cell_cold=5.0, flex_cached=2.5, flex_cold=30.0, row=0.2,
             cudnn_check=0.5, sort_keys_per_s=1.5e9)


def _est_call_ms(p) -> Dict[str, Tuple[float, float]]:
    """Modelled (fwd, bwd) ms per call of ours, flex (where it runs) and the cuDNN baseline."""
    S, sp, dim, G, BS, h = p["S"], p["sparsity"], p["D"], p["G"], p["block_size"], p["H"]
    scale = (S / 65536) ** 2 * h / 16
    width = (1 << (dim - 1).bit_length()) / 128
    gf, gb = EST_G.get(G, EST_G[16])
    if BS == 0:
        gb = 128 / G
    ref = EST_REF_MS["token" if BS == 0 else "block"]
    keep = scale * width * (1 - sp) / 0.1
    out = dict(ours=(max(EST_FLOOR_MS[0], ref[0] * keep * gf), max(EST_FLOOR_MS[1], ref[1] * keep * gb)),
               dense=tuple(x * scale * dim / 128 for x in EST_REF_MS["dense"]))
    if flex_skip_reason(G, BS) is None:
        out["flex"] = tuple(max(f, x * keep) for f, x in zip(EST_FLOOR_MS, EST_REF_MS["flex"]))
    return out


def _bench_wall_ms(t):
    """Wall ms of one bench_ms (triton do_bench, warmup 25 ms, rep 100 ms) of a t-ms call: 1 + 5
    estimate calls, then >= 25 ms of warmup and >= 100 ms timed."""
    t += 0.1  # do_bench's L2 flush per call
    return 6 * t + max(t, 25) + max(t, 100)


def estimate_s(points, warm_shards=0, with_flex=True) -> Dict[str, float]:
    """Modelled seconds: the timed run (kernels, baselines, loading cached kernels, flex tracing per
    shape), the warm phase (compiles in ``warm_shards`` parallel processes; 0: compiled in the timed
    run) and their total."""
    run = [p for p in points if not p.get("skipped")]
    kernels, dense_s, seen, cells, flexes = 0.0, 0.0, set(), set(), set()
    for p in run:
        ms = _est_call_ms(p)
        f, b = ms["ours"]
        kernels += (_bench_wall_ms(f) + f + _bench_wall_ms(b)) / 1e3
        if with_flex and "flex" in ms:
            f, b = ms["flex"]
            kernels += (_bench_wall_ms(f) + f + _bench_wall_ms(b)) / 1e3
            flexes.add((p["S"], p["D"], p["H"]))
        nk = p["S"] if p["block_size"] == 0 else p["S"] // p["block_size"]
        kernels += EST_S["row"] + p["H"] * math.ceil(p["S"] / p["G"]) * nk / EST_S["sort_keys_per_s"]
        if (p["S"], p["D"], p["H"]) not in seen:
            seen.add((p["S"], p["D"], p["H"]))
            f, b = ms["dense"]
            dense_s += (_bench_wall_ms(f) + f + _bench_wall_ms(b)) / 1e3 + EST_S["cudnn_check"]
        cells.add((p["D"], p["G"], p["block_size"], p["H"]))
    kind = "cached" if warm_shards else "cold"
    compile_s = len(cells) * EST_S[f"cell_{kind}"] + len(flexes) * EST_S[f"flex_{kind}"]
    timed = EST_S["start"] + kernels + dense_s + compile_s
    warm = 0.0
    if warm_shards and run:
        loads = [sum(_warm_cost(u) for u in shard) for shard in warm_shards_of(run, warm_shards, with_flex)]
        warm = EST_S["start"] + max(loads)
    return dict(points=len(run), skipped=len(points) - len(run), kernels_s=kernels + dense_s, dense_s=dense_s,
                compile_s=compile_s, timed_s=timed, warm_s=warm, total_s=timed + warm)


def _warm_units(points, with_flex=True) -> List[Dict]:
    """Warm-phase work units: the points of one (D, G, block, S, H), with their modelled cold cost."""
    units = {}
    for p in points:
        if p.get("skipped"):
            continue
        key = (p["D"], p["G"], p["block_size"], p["S"], p["H"])
        units.setdefault(key, []).append(p)
    return [dict(key=k, points=v, flex=with_flex and flex_skip_reason(k[1], k[2]) is None) for k, v in units.items()]


def _warm_cost(u) -> float:
    s = EST_S["cell_cold"] + (EST_S["flex_cold"] if u["flex"] else 0.0)
    for p in u["points"]:
        ms = _est_call_ms(p)
        s += 3 * sum(ms["ours"]) / 1e3 + (3 * sum(ms["flex"]) / 1e3 if u["flex"] else 0.0) + EST_S["row"]
    return s


def warm_shards_of(points, n, with_flex=True) -> List[List[Dict]]:
    """Units split over n shards, costliest first onto the least loaded (deterministic: every shard
    process computes the same split and takes its own)."""
    shards, loads = [[] for _ in range(n)], [0.0] * n
    for u in sorted(_warm_units(points, with_flex), key=lambda u: (-_warm_cost(u), u["key"])):
        i = loads.index(min(loads))
        shards[i].append(u)
        loads[i] += _warm_cost(u)
    return shards


def print_grid(points, est, warm_shards):
    for p in points:
        what = f"skipped: {p['skipped']}" if p.get("skipped") else p["phase"]
        print(f"  S={p['S']:>6} D={p['D']:>3} H={p['H']:>2} G={p['G']:>3} {gran_label(p['block_size']):9s} "
              f"sparsity={p['sparsity']:<5} {what}")
    print(f"{est['points']} points to run, {est['skipped']} skipped; estimated H200 time: kernels and baselines "
          f"{est['kernels_s']:.0f} s (cuDNN {est['dense_s']:.0f} s), compiles/loads {est['compile_s']:.0f} s, "
          f"timed run {est['timed_s']:.0f} s" + (f", warm phase ({warm_shards} shards) {est['warm_s']:.0f} s"
                                                 if warm_shards else "") + f", total {est['total_s']:.0f} s",
          flush=True)


def heatmap_grid(rows, S=HEATMAP_AT[0], sparsity=HEATMAP_AT[1]):
    """(head dims, column labels, fwd+bwd speedup vs cuDNN, vs flex): rows of the matrices are D,
    columns (G, granularity); NaN where the point was skipped, failed or flex did not run."""
    import numpy as np

    sel = [r for r in rows if r.get("S") == S and abs(r.get("sparsity", -1) - sparsity) < 1e-9]
    dims = sorted({r["D"] for r in sel})
    cols = sorted({(r["G"], r["block_size"]) for r in sel})
    cudnn = np.full((len(dims), len(cols)), np.nan)
    flex = np.full((len(dims), len(cols)), np.nan)
    for r in sel:
        i, j = dims.index(r["D"]), cols.index((r["G"], r["block_size"]))
        if r.get("speedup_fwd_bwd") is not None:
            cudnn[i, j] = r["speedup_fwd_bwd"]
        if r.get("speedup_vs_flex_fwd_bwd") is not None:
            flex[i, j] = r["speedup_vs_flex_fwd_bwd"]
    return dims, [f"G{g}\n{gran_label(bs)}" for g, bs in cols], cudnn, flex


def plot_sweep(rows, path, meta=None, S=HEATMAP_AT[0], sparsity=HEATMAP_AT[1]) -> Path:
    """Heatmap PNG of the sweep at (S, sparsity): fwd+bwd speedup vs the same-run cuDNN and vs flex
    per (D, G, granularity), numbers in the cells, blank cells where nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    dims, cols, cudnn, flex = heatmap_grid(rows, S, sparsity)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * max(1, len(cols)), 1.8 + 0.7 * max(1, len(dims))),
                             squeeze=False)
    for ax, data, what in ((axes[0, 0], cudnn, "vs cuDNN (same run)"), (axes[0, 1], flex, "vs FlexAttention")):
        finite = data[np.isfinite(data)]
        cmap = matplotlib.colormaps["viridis" if data is cudnn else "RdBu"].with_extremes(bad="white")
        norm = None
        if data is flex and finite.size:
            norm = TwoSlopeNorm(vcenter=1.0, vmin=min(0.9, finite.min()), vmax=max(1.1, finite.max()))
        if data.size:
            im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto")
            if finite.size:
                fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        for (i, j), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}x", ha="center", va="center", fontsize=8,
                        color="white" if data is cudnn and v < (finite.min() + finite.max()) / 2 else "black")
        ax.set_xticks(range(len(cols)), cols, fontsize=7)
        ax.set_yticks(range(len(dims)), [str(d) for d in dims])
        ax.set(xlabel="group size G, granularity", ylabel="head dim D")
        ax.set_title(f"fwd+bwd speedup {what}" + ("\n(blank: flex not run or failed)" if data is flex else ""),
                     fontsize=9)
    m = meta or {}
    fig.suptitle(f"sparse attention sweep, S={S // 1024}K, sparsity {sparsity} - {m.get('gpu', '?')}, "
                 f"torch {m.get('torch', '?')}, commit {str(m.get('commit', '?'))[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def print_sweep_table(rows):
    print(f"{'S':>6} {'D':>3} {'G':>3} {'gran':9} {'sp':>4} {'fwd':>7} {'bwd':>7} {'x_f+b':>6} {'vsflex':>6}")
    for r in rows:
        if "speedup_fwd_bwd" not in r:
            continue
        vf = r.get("speedup_vs_flex_fwd_bwd")
        print(f"{r['S']:>6} {r['D']:>3} {r['G']:>3} {gran_label(r['block_size']):9} {r['sparsity']:>4} "
              f"{r['ms_fwd']:7.2f} {r['ms_bwd']:7.2f} {r['speedup_fwd_bwd']:6.2f} "
              f"{'' if vf is None else f'{vf:6.2f}'}")

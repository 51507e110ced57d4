"""Sparse attention kernels vs cuDNN dense and FlexAttention on identical lists.

    PYTHONPATH=. python benchmarks/bench_sparse_attention.py [--quick] [--tune] [--out DIR]
    PYTHONPATH=. python benchmarks/bench_sparse_attention.py --groups-sweep [--warm-only --shard I/N]
    PYTHONPATH=. python benchmarks/bench_sparse_attention.py --sweep --warm-shards 8 --time-budget-s 300
    PYTHONPATH=. python benchmarks/bench_sparse_attention.py --sweep --dry-run   # grid and time estimate, no GPU

Rows (DESIGN.md section 6): S, H, D, B, G, block_size, sparsity, granularity,
ms_fwd/ms_bwd (our Triton path through the public op, value checks skipped),
same-run cuDNN dense ms_dense_*, speedup_*, effective tflops_* on the kept
FLOPs, and for block lists ms_flex_*/speedup_vs_flex_* (FlexAttention, BlockMask
built from the same lists, compiled once per shape). ``--tune`` first sweeps
tile configs at S=64K, 90% sparsity, and uses the winners for the table.
``--head-dim``, ``--heads``, ``--group-size``, ``--granularity``, ``--block-sizes``,
``--seq-lens`` and ``--sparsities`` set the table's shapes (default D=128, H=16, G=128,
token and 128-blocks, S 16K-128K, sparsity 0.8-0.98).

``--sweep`` (issue #15): the shapes of the other presets, D x G x granularity, written to
``sparse_attention-sweep[-video]-<gpu>-<date>.json`` (``-video``: ``--lists video``) after every point, with a
heatmap PNG beside it (fwd+bwd speedup vs cuDNN and vs flex per (D, G, granularity) at S=64K, 90%). Default grid:
S in {16K, 64K} x sparsity 0.9 for every cell D in {64, 96, 128, 256} x G in {32, 64, 128} x
{token, block 128} (48 points, the 24 heatmap points first), plus S in {16K, 32K, 64K, 128K} x
sparsity {0.8, 0.9, 0.95} at (D=128, G=128, block 128) and (D=256, G=128, block 128)
(20 more): 68 points. ``--seq-lens`` / ``--sparsities`` replace it by their product over every
cell. Combinations the library rejects are rows with ``skipped``; the cuDNN baseline is measured
once per (S, D, H) and flex per point only where it lowers (G=128, block 128; its errors go into
``flex_error``). ``--time-budget-s`` stops starting points after that many seconds since the
start (warm phase included); the rest are rows with ``skipped``.

The grid, its time model, the warm-up split and the heatmap live in ``sparse_attention_sweep.py``;
this script times the points. Estimated H200 time of the default grid (``--dry-run`` prints it for
any grid; model in ``sparse_attention_sweep.estimate_s``: per-call ms scaled from
sparse_attention-h200-20261130.json and the -groups- file,
plus do_bench's ~125 ms per timing; compile times are assumptions, not measurements):
kernels and cuDNN baselines ~125 s (cuDNN ~40 s of it), loading cached kernels and tracing flex
per shape ~40 s: ~3 min for the timed run once the caches are warm. Cold, it would add ~2 min of
Triton compiles (24 cells) and ~6 min of flex compiles (12 shapes): ~10 min, over budget. With
``--warm-shards 8`` the compiles run first in 8 parallel processes (~1.7 min): ~4.7 min in all.
``--time-budget-s 300`` bounds it (the warm phase gets at most half; the 128K extras run last and
are the ones dropped if the compiles are slower than assumed).

``--groups-sweep``: (group size, block size) in SWEEP_SHAPES at S=64K and 16K,
90% sparse: our forward (default tiles, and 128-wide steps over two 64-blocks),
split backward, fused backward (each FUSED_SPACE config, checked against split
first), FlexAttention. Writes ``sparse_attention-groups`` (every row) and
``sparse_attention`` (rows in the main table's format, ms_bwd = the faster
backward, named in bwd_mode). ``--warm-only`` runs every kernel once without
timing, so parallel shards fill Triton's and Inductor's on-disk caches before
the timed run (compiling flex per shape dominates otherwise); ``--sweep --warm-shards N``
starts such shards itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_ms, collect_meta, dense_fwd_bwd_ms, write_results  # noqa: E402
from benchmarks.list_shapes import neighbour_overlap, video_lists  # noqa: E402
from benchmarks.sparse_attention_sweep import (  # noqa: E402
    HEATMAP_AT,
    SWEEP_DIMS,
    SWEEP_GROUPS,
    B,
    H,
    estimate_s,
    flex_skip_reason,
    gran_label,
    plot_sweep,
    print_grid,
    print_sweep_table,
    sweep_grid,
    warm_shards_of,
)
from megatron_dsv.ops.sparse_attention import launch  # noqa: E402
from megatron_dsv.ops.sparse_attention.flex import build_block_mask, sparse_attention_flex  # noqa: E402
from megatron_dsv.ops.sparse_attention.op import choose_backend, sparse_attention  # noqa: E402
from megatron_dsv.ops.sparse_attention.packing import pack_token_lists, packing_on, token_pack_factor  # noqa: E402

D = 128  # the main table's head dim (and the groups sweep's); H heads, batch B


def bench_env():
    """Set in main, not at import (a test importing this module must not change the library's checks)."""
    os.environ.setdefault("DSV_SKIP_CHECKS", "1")  # lists are ours and valid; time the kernels
    os.environ.setdefault("DSV_SPARSE_ATTN_BACKEND", "triton")  # rows measure our kernels; flex has its own columns


LIST_KINDS = ("random", "video")


def make_lists(S, G, BS, sparsity, seed=0, heads=H, kind="random"):
    """Sorted lists, the same budget for every head: K = round((1 - s) * #keys). kind "random": uniform draws
    (neighbouring groups share little); "video": ``list_shapes.video_lists``, a video DiT's shape (each cube's
    neighbourhood and keys its neighbours keep too)."""
    if kind == "video":
        return video_lists(S, G, BS, sparsity, heads, batch=B, seed=seed, device="cuda")
    if kind != "random":
        raise ValueError(f"make_lists: kind must be one of {LIST_KINDS}, got {kind!r}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    NG = math.ceil(S / G)
    nk = S if BS == 0 else math.ceil(S / BS)
    K = max(1, round((1 - sparsity) * nk))
    idx = torch.empty(B, heads, NG, K, device="cuda", dtype=torch.int32)
    for h in range(heads):  # one head at a time bounds the sort's memory at 128K tokens
        perm = torch.rand(NG, nk, device="cuda", generator=gen).argsort(-1)[:, :K]
        idx[0, h] = perm.sort(-1).values.to(torch.int32)
    cnt = torch.full((B, heads), K, device="cuda", dtype=torch.int32)
    return idx, cnt, K * (1 if BS == 0 else BS)


def inputs(S, dtype=torch.bfloat16, dim=D, heads=H):
    return [torch.randn(B, heads, S, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]


def run_once(fn):
    """The timer of warm-only runs: compile and run, no timing."""
    fn()
    return 0.0


def fwd_bwd_ms(fn, q, k, v, timer=bench_ms):
    fwd = timer(fn)
    o = fn()
    do = torch.randn_like(o)
    bwd = timer(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return fwd, bwd


def ours_ms(q, k, v, idx, cnt, G, BS, timer=bench_ms):
    return fwd_bwd_ms(lambda: sparse_attention(q, k, v, idx, cnt, G, BS), q, k, v, timer)


def ours_deterministic_bwd_ms(q, k, v, idx, cnt, G, BS, timer=bench_ms, token_kv=None):
    """Our backward under ``torch.use_deterministic_algorithms(True)`` (token lists: dk/dv as ``token_kv``, None:
    the library's ``DSV_TOKEN_KV_BWD`` choice; block lists: the split backward), what a ``--deterministic-mode``
    run pays."""
    before = torch.are_deterministic_algorithms_enabled()
    env = os.environ.get("DSV_TOKEN_KV_BWD")
    torch.use_deterministic_algorithms(True)
    if token_kv is not None:
        os.environ["DSV_TOKEN_KV_BWD"] = token_kv
    try:
        return ours_ms(q, k, v, idx, cnt, G, BS, timer)[1]
    finally:
        torch.use_deterministic_algorithms(before)
        if env is None:
            os.environ.pop("DSV_TOKEN_KV_BWD", None)
        else:
            os.environ["DSV_TOKEN_KV_BWD"] = env


def flex_ms(q, k, v, idx, cnt, G, BS, timer=bench_ms):
    bm = build_block_mask(idx, cnt, q.shape[2], G, BS)
    return fwd_bwd_ms(lambda: sparse_attention_flex(q, k, v, idx, cnt, G, BS, block_mask=bm), q, k, v, timer)


def _error(e: BaseException, width=160) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:width]}"


def add_speedups(row):
    """speedup_* vs the same-run cuDNN, effective tflops_* on the kept FLOPs and speedup_vs_flex_*
    (None where flex did not run), from the row's ms_* fields."""
    fwd, bwd = row["ms_fwd"], row["ms_bwd"]
    flops_fwd = 4.0 * row["B"] * row["H"] * row["S"] * row["keys_per_group"] * row["D"]
    row.update(tflops_fwd=flops_fwd / fwd * 1e-9, tflops_bwd=2.5 * flops_fwd / bwd * 1e-9)
    if "ms_dense_fwd" in row:
        dfwd, dbwd = row["ms_dense_fwd"], row["ms_dense_bwd"]
        row.update(speedup_fwd=dfwd / fwd, speedup_bwd=dbwd / bwd, speedup_fwd_bwd=(dfwd + dbwd) / (fwd + bwd))
    flex = "ms_flex_fwd" in row and "ms_flex_bwd" in row
    row.update(speedup_vs_flex_fwd=row["ms_flex_fwd"] / fwd if flex else None,
               speedup_vs_flex_bwd=row["ms_flex_bwd"] / bwd if flex else None,
               speedup_vs_flex_fwd_bwd=(row["ms_flex_fwd"] + row["ms_flex_bwd"]) / (fwd + bwd) if flex else None)
    return row


# the forward with keys as the MMA's rows (``launch`` cfg ``KT=1``), timed beside the default where query tiles are
# under 128 rows: a 32-row tile runs mma.sync in the row-major kernel, wgmma here (Triton 3.6, sm_90: no spills)
# (and with the softmax's sum reduced once at the end, LAZY_L: one cross-warp reduction a step instead of two)
KT_FWD_CONFIGS = {"kt64": dict(BN=64, num_warps=4, num_stages=2), "kt128": dict(BN=128, num_warps=8, num_stages=2),
                  "kt64l": dict(BN=64, num_warps=4, num_stages=2, LAZY_L=1),
                  "kt128l": dict(BN=128, num_warps=8, num_stages=2, LAZY_L=1)}


def one_row(S, sparsity, BS, G, dense, with_flex, dim=D, heads=H, timer=bench_ms, deterministic=False,
            lists="random", candidates=False):
    """Our op and (where it lowers) flex on the same lists (``lists``: ``make_lists``'s kind; the row records
    it and how much neighbouring groups' lists overlap); ``timer=run_once`` only compiles;
    ``deterministic``: also our backward under deterministic algorithms (``ms_bwd_deterministic``)."""
    q, k, v = inputs(S, dim=dim, heads=heads)
    idx, cnt, kept = make_lists(S, G, BS, sparsity, heads=heads, kind=lists)
    backend = choose_backend(q, idx, G, BS)
    fwd, bwd = ours_ms(q, k, v, idx, cnt, G, BS, timer)
    n_items = S if BS == 0 else math.ceil(S / BS)
    row = dict(S=S, H=heads, D=dim, B=B, G=G, group_size=G, block_size=BS, sparsity=sparsity, lists=lists,
               list_overlap=None if timer is run_once else neighbour_overlap(idx[:, :2], cnt[:, :2], n_items),
               granularity="token" if BS == 0 else "block", keys_per_group=kept, backend=backend,
               bwd_mode=launch.bwd_mode(G, BS, dim) if backend == "triton" else None,
               # P groups a packed group in the backward (DSV_TOKEN_PACK=on; 1: none); the packing's own time is in
               # ms_bwd (the forward never packs, nor the deterministic inverse walk: ms_bwd_deterministic)
               token_pack=token_pack_factor(G, BS) if backend == "triton" else 1,
               ms_fwd=fwd, ms_bwd=bwd, **dense)
    scale = 1 / math.sqrt(dim)
    if row["token_pack"] > 1 and timer is not run_once:  # the packing alone (the backward packs once)
        row["ms_pack"] = timer(lambda: pack_token_lists(idx, cnt, G, row["token_pack"], S))
        if candidates:  # the marking pass with one atomic_or per entry (the default: one atomic add per run)
            row["ms_pack_atomic"] = timer(lambda: pack_token_lists(idx, cnt, G, row["token_pack"], S, mark="atomic"))
        # the packed forward, its packing included (the library's forward runs unpacked: run 15 timed it no faster
        # with the torch packer; this times it again with the Triton one)
        with torch.no_grad():
            row["ms_fwd_packed"] = timer(lambda: launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale,
                                                                   pack=row["token_pack"]))
    if candidates and G < 128 and dim <= 128 and backend == "triton" and timer is not run_once:
        with torch.no_grad():  # the row-major forward timed as the variants are: the launch alone, no autograd
            rm = launch.pick_config("fwd", dim, G, BS, keys_as_rows=False)
            row["ms_fwd_rowmajor"] = timer(lambda: launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale, cfg=rm))
            for name, kt in KT_FWD_CONFIGS.items():  # a variant's failure is recorded, the row kept
                try:
                    row[f"ms_fwd_{name}"] = timer(lambda: launch.sparse_fwd(q, k, v, idx, cnt, G, BS, scale,
                                                                            cfg=dict(kt, BM=G, KT=1)))
                except Exception as e:
                    row[f"fwd_{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"  fwd {name} failed: {row[f'fwd_{name}_error']}", flush=True)
    if deterministic:  # its own failure (e.g. DSV_SPARSE_BWD=fused, which has no deterministic kernel) is recorded
        try:
            row["ms_bwd_deterministic"] = ours_deterministic_bwd_ms(q, k, v, idx, cnt, G, BS, timer)
            if timer is not run_once:
                row["deterministic_bwd_cost"] = row["ms_bwd_deterministic"] / bwd
            if BS == 0:  # token lists: the other deterministic dk/dv beside the library's choice
                other = "inverse" if launch.token_kv_mode() == "fixed" else "fixed"
                row[f"ms_bwd_deterministic_{other}"] = ours_deterministic_bwd_ms(q, k, v, idx, cnt, G, BS, timer,
                                                                                 token_kv=other)
        except Exception as e:
            row["deterministic_error"] = _error(e)
    skip = flex_skip_reason(G, BS) if with_flex else "--no-flex"
    if skip:
        row["flex_skipped"] = skip
    else:
        try:
            row["ms_flex_fwd"], row["ms_flex_bwd"] = flex_ms(q, k, v, idx, cnt, G, BS, timer)
        except Exception as e:  # flex can't lower some shapes: record, don't abort
            row["flex_error"] = _error(e)
            print(f"  flex failed: {row['flex_error']}", flush=True)
    return add_speedups(row) if timer is not run_once else row


SWEEP_SHAPES = ((128, 128), (128, 64), (64, 128), (64, 64), (32, 64))  # (G, block_size)
SWEEP_S = (65536, 16384)


def fused_space(G, BS):
    """(BM, BN, warps, stages, DQ): key tiles of 64 and, for 128-blocks, 128 rows (half the
    atomics per FLOP); DQ 1 = pointer atomics, 2 = TMA reduce-add."""
    space = [(64, 64, 4, 2, 1), (64, 64, 4, 2, 2)]
    if BS == 128:
        space += [(64, 128, 8, 2, 1), (64, 128, 8, 2, 2)]
    return [dict(BM=min(BM, G), BN=BN, num_warps=w, num_stages=st, DQ=dq) for BM, BN, w, st, dq in space]


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_row(S, G, BS, dense, warm):
    """One (S, G, block) point: every forward and backward variant and flex on the same lists."""
    timed = run_once if warm else bench_ms
    q, k, v = inputs(S)
    idx, cnt, kept = make_lists(S, G, BS, 0.9)
    scale = 1 / math.sqrt(D)
    row = dict(S=S, H=H, D=D, B=B, G=G, group_size=G, block_size=BS, sparsity=0.9, granularity="block",
               keys_per_group=kept, **dense)
    fn = lambda: sparse_attention(q, k, v, idx, cnt, G, BS)  # noqa: E731
    row["ms_fwd_default"] = timed(fn)
    row["fwd_cfg_default"] = launch.pick_config("fwd", D, G, BS)
    if BS == 64:  # two 64-blocks per 128-wide step
        pair = dict(BM=min(128, G), BN=128, num_warps=8, num_stages=3)
        launch.CONFIG_OVERRIDES[("fwd", D, G, BS)] = pair
        try:
            row["ms_fwd_pair"] = timed(fn)
        except Exception as e:
            print(f"  paired fwd failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        del launch.CONFIG_OVERRIDES[("fwd", D, G, BS)]
    o = fn()
    do = torch.randn_like(o)
    bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
    os.environ["DSV_SPARSE_BWD"] = "split"
    row["ms_bwd_split"] = timed(bwd)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    od, lse = launch.sparse_fwd(qd, kd, vd, idx, cnt, G, BS, scale)
    ref = launch.sparse_bwd(do, qd, kd, vd, od, lse, idx, cnt, G, BS, scale, mode="split")
    fused = []
    for cfg in fused_space(G, BS):
        tag = "BN{BN}-w{num_warps}-dq{DQ}".format(**cfg)
        try:
            got = launch.sparse_bwd(do, qd, kd, vd, od, lse, idx, cnt, G, BS, scale, mode="fused", cfg_kv=cfg)
            err = max(_rel(a, b) for a, b in zip(got, ref))
            launch.CONFIG_OVERRIDES[("bwd_fused", D, G, BS)] = cfg
            os.environ["DSV_SPARSE_BWD"] = "fused"
            ms = timed(bwd) if err < 2e-2 else float("inf")
        except Exception as e:
            err, ms = float("nan"), float("inf")
            print(f"  fused {tag} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        row[f"ms_bwd_fused_{tag}"] = ms
        row[f"err_fused_{tag}"] = err
        fused.append((ms, tag, cfg))
    launch.CONFIG_OVERRIDES.pop(("bwd_fused", D, G, BS), None)
    os.environ["DSV_SPARSE_BWD"] = "split"
    best = min(fused, key=lambda t: t[0])
    row.update(ms_bwd_fused=best[0], bwd_fused_cfg=best[2])
    row["ms_fwd"] = min(row["ms_fwd_default"], row.get("ms_fwd_pair", float("inf")))
    row["fwd_variant"] = "pair" if row["ms_fwd"] < row["ms_fwd_default"] else "default"
    row["ms_bwd"] = min(row["ms_bwd_split"], row["ms_bwd_fused"])
    row["bwd_mode"] = "fused" if row["ms_bwd_fused"] < row["ms_bwd_split"] else "split"
    if flex_skip_reason(G, BS) is None:
        bm = build_block_mask(idx, cnt, S, G, BS)
        ffn = lambda: sparse_attention_flex(q, k, v, idx, cnt, G, BS, block_mask=bm)  # noqa: E731
        try:
            row["ms_flex_fwd"] = timed(ffn)
            fo = ffn()
            row["ms_flex_bwd"] = timed(lambda: torch.autograd.grad(fo, (q, k, v), do, retain_graph=True))
        except Exception as e:  # flex can't lower some tile/block combinations: record, don't abort
            row.pop("ms_flex_fwd", None)
            row["flex_error"] = _error(e)
            print(f"  flex failed: {row['flex_error']}", flush=True)
    if not warm:
        add_speedups(row)
        row["speedup_bwd_fused_vs_split"] = row["ms_bwd_split"] / row["ms_bwd_fused"]
        if "ms_flex_fwd" in row:
            row.update(speedup_vs_flex_bwd_split=row["ms_flex_bwd"] / row["ms_bwd_split"],
                       speedup_vs_flex_bwd_fused=row["ms_flex_bwd"] / row["ms_bwd_fused"])
    return row


MAIN_KEYS = ("S", "H", "D", "B", "G", "group_size", "block_size", "sparsity", "granularity", "keys_per_group",
             "ms_fwd", "ms_bwd", "bwd_mode", "ms_bwd_split", "ms_bwd_fused", "ms_dense_fwd", "ms_dense_bwd",
             "dense_backend", "speedup_fwd", "speedup_bwd", "speedup_fwd_bwd", "tflops_fwd", "tflops_bwd",
             "ms_flex_fwd", "ms_flex_bwd", "speedup_vs_flex_fwd", "speedup_vs_flex_bwd", "speedup_vs_flex_fwd_bwd")


def groups_sweep(args, meta):
    i_shard, n_shard = (int(x) for x in args.shard.split("/"))
    shapes = [tuple(int(x) for x in t.split("x")) for t in args.shapes.split(",")] if args.shapes else SWEEP_SHAPES
    points = [(S, G, BS) for (G, BS) in shapes for S in SWEEP_S]
    if args.warm_only:  # shard by (G, BS): one process compiles a shape's kernels for both S
        points = [p for p in points if shapes.index(p[1:]) % n_shard == i_shard]
    else:  # the main table's shape first, both S, then the rest: a cut-off run keeps what matters
        points.sort(key=lambda p: (p[1:] != (128, 128), -p[0]))
    rows, dense_by_s = [], {}
    for S, G, BS in points:
        t0 = time.time()
        if S not in dense_by_s:
            dense_by_s[S] = {} if args.warm_only else dense_fwd_bwd_ms(B, H, S, D, rep=100)
        row = sweep_row(S, G, BS, dense_by_s[S], args.warm_only)
        print(f"S={S} G={G} BS={BS} done [{time.time() - t0:.0f}s]", flush=True)
        if args.warm_only:
            continue
        rows.append(row)
        write_results("sparse_attention-groups", rows, args.out, meta)
        write_results("sparse_attention", [{k: r[k] for k in MAIN_KEYS if k in r} for r in rows], args.out, meta)
        print_sweep(rows[-1:], header=len(rows) == 1)
        torch.cuda.empty_cache()
    if rows:
        print_sweep(rows)


def print_sweep(rows, header=True):
    if header:
        print(f"{'S':>6} {'G':>4} {'BS':>4} {'fwd':>6} {'pair':>6} {'flexF':>6} {'split':>6} {'fused':>6} "
              f"{'flexB':>6} {'xF':>5} {'xB':>5} {'vsflexF':>7} {'vsflexB':>7}  fused cfg")
    nan = float("nan")
    for r in rows:
        r = {k: (nan if v is None else v) for k, v in r.items()}
        c = r["bwd_fused_cfg"]
        print(f"{r['S']:>6} {r['G']:>4} {r['block_size']:>4} {r['ms_fwd_default']:6.2f} "
              f"{r.get('ms_fwd_pair', nan):6.2f} "
              f"{r.get('ms_flex_fwd', nan):6.2f} {r['ms_bwd_split']:6.2f} {r['ms_bwd_fused']:6.2f} "
              f"{r.get('ms_flex_bwd', nan):6.2f} {r['speedup_fwd']:5.2f} {r['speedup_bwd']:5.2f} "
              f"{r.get('speedup_vs_flex_fwd', nan):7.2f} {r.get('speedup_vs_flex_bwd', nan):7.2f}  "
              f"BN{c['BN']} w{c['num_warps']} dq{c['DQ']}", flush=True)


# ---------------------------------------------------------------------------------------------------
# --sweep (issue #15): D x G x granularity at the shapes of the other presets

_CUDNN_CHECKED: Dict[Tuple[int, int], Optional[str]] = {}


def cudnn_refusal(dim, heads) -> Optional[str]:
    """Why torch SDPA's cuDNN kernel refuses this head dim (fwd+bwd at a small S), or None: the
    baseline is then the next SDPA backend, named in the row's dense_backend."""
    if (dim, heads) not in _CUDNN_CHECKED:
        from megatron_dsv.ops.dense import dense_backend_context

        q, k, v = inputs(1024, dim=dim, heads=heads)
        try:
            with dense_backend_context(q.device, order=("cudnn",)):
                torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()
            torch.cuda.synchronize()
            _CUDNN_CHECKED[(dim, heads)] = None
        except RuntimeError as e:
            _CUDNN_CHECKED[(dim, heads)] = _error(e)
    return _CUDNN_CHECKED[(dim, heads)]


def dense_baseline(S, dim, heads) -> Dict:
    """The same-run dense figures of one (S, D, H), measured once per run by the caller's cache."""
    try:
        dense = dense_fwd_bwd_ms(B, heads, S, dim, rep=100)
    except Exception as e:
        return dict(dense_error=_error(e))
    why = cudnn_refusal(dim, heads)
    if why:
        dense["dense_backend"] = f"torch SDPA fallback (cuDNN refused: {why})"
    return dense


def _raise_recompile_limit(n=64):
    """Flex is compiled once per (S, D, H) with dynamic=False: past dynamo's recompile limit (8) it
    would silently fall back to eager flex, which attends densely."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), n))


def run_points(points, bench, args, meta, t_start, timer=bench_ms, on_row=None, on_written=None) -> List[Dict]:
    """Time each point (``timer=run_once``: only compile, nothing written); rows are written after
    every point, skipped points and those past ``args.time_budget_s`` as rows with ``skipped``.
    ``on_row(row)`` runs before each write, ``on_written(rows, path)`` after."""
    warm = timer is run_once
    rows, dense_cache = [], {}
    budget = getattr(args, "time_budget_s", None)
    _raise_recompile_limit()
    for p in points:
        keys = dict(p)
        keys.pop("phase", None)
        if not p.get("skipped") and budget is not None and time.time() - t_start > budget:
            keys["skipped"] = f"time budget: {budget:g} s exceeded ({time.time() - t_start:.0f} s since start)"
        if keys.get("skipped"):
            row = keys
        else:
            if not torch.cuda.is_available():
                raise SystemExit("timing needs a CUDA GPU (--dry-run prints the grid and its time estimate)")
            t0 = time.time()
            S, dim, heads = p["S"], p["D"], p["H"]
            if (S, dim, heads) not in dense_cache:
                dense_cache[(S, dim, heads)] = {} if warm else dense_baseline(S, dim, heads)
            try:
                row = one_row(S, p["sparsity"], p["block_size"], p["G"], dense_cache[(S, dim, heads)],
                              not args.no_flex, dim=dim, heads=heads, timer=timer,
                              deterministic=getattr(args, "deterministic_bwd", False),
                              lists=getattr(args, "lists", "random"), candidates=getattr(args, "candidates", False))
            except Exception as e:  # out of memory, out of shared memory, ...: record and go on
                row = dict(keys, error=_error(e, 240))
            torch.cuda.empty_cache()
            row["s_wall"] = time.time() - t0
            print(point_line(row, warm), flush=True)
        if warm:
            continue
        rows.append(row)
        if on_row:
            on_row(row)
        path = write_results(bench, rows, args.out, meta)
        if on_written:
            on_written(rows, path)
    return rows


def point_line(r, warm=False) -> str:
    head = f"S={r['S']:>6} D={r['D']:>3} G={r['G']:>3} {gran_label(r['block_size']):9s} s={r['sparsity']:<5}"
    if r.get("skipped") or r.get("error"):
        return f"{head} {'skipped' if r.get('skipped') else 'error'}: {r.get('skipped') or r.get('error')}"
    flex = " flex failed" if r.get("flex_error") else ""
    if warm:
        return f"{head} ran once{flex} [{r['s_wall']:.0f}s]"
    if r.get("speedup_vs_flex_fwd_bwd") is not None:
        flex = f" vs flex {r['speedup_vs_flex_fwd_bwd']:.2f}x"
    dense = (f"dense {r['ms_dense_fwd']:.1f}/{r['ms_dense_bwd']:.1f}) x{r['speedup_fwd_bwd']:.2f}"
             if "speedup_fwd_bwd" in r else f"no dense: {r.get('dense_error')})")
    extra = (f" packed: pack {r['ms_pack']:.2f} fwd {r['ms_fwd_packed']:.2f} (P={r['token_pack']})"
             if "ms_fwd_packed" in r else "")
    extra += f" pack by atomic_or {r['ms_pack_atomic']:.2f}" if "ms_pack_atomic" in r else ""
    extra += f" fwd alone {r['ms_fwd_rowmajor']:.2f}" if "ms_fwd_rowmajor" in r else ""
    extra += "".join(f" {name} {r['ms_fwd_' + name]:.2f}" for name in KT_FWD_CONFIGS if "ms_fwd_" + name in r)
    return f"{head} fwd {r['ms_fwd']:.2f} bwd {r['ms_bwd']:.2f} ms ({dense}{flex}{extra} [{r['s_wall']:.0f}s]"


def _grid_argv(args) -> List[str]:
    """The options that define the sweep's grid, for the warm shards it starts."""
    out = ["--sweep", "--heads", str(args.heads), "--granularity", args.granularity,
           "--block-sizes", ",".join(map(str, args.block_sizes))]
    for flag, val in (("--head-dim", args.head_dim), ("--group-size", args.group_size),
                      ("--seq-lens", args.seq_lens), ("--sparsities", args.sparsities)):
        if val is not None:
            out += [flag, ",".join(map(str, val))]
    return out + (["--no-flex"] if args.no_flex else [])


def start_warm_shards(args, t_start):
    """Run ``--warm-only --shard i/N`` processes (compile threads 1 each) and wait for them, at most
    half the time budget (then they are stopped and the timed run compiles what is left itself); a
    shard's failure is printed, not fatal (the timed run records errors)."""
    logs = Path(tempfile.mkdtemp(prefix="dsv_sweep_warm_"))
    print(f"warm phase: {args.warm_shards} shards, logs in {logs}", flush=True)
    procs = []
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    for i in range(args.warm_shards):
        cmd = [sys.executable, str(Path(__file__).resolve()), *_grid_argv(args), "--warm-only",
               "--shard", f"{i}/{args.warm_shards}"]
        log = open(logs / f"shard{i}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    for i, (proc, log) in enumerate(procs):
        left = None if args.time_budget_s is None else max(1.0, args.time_budget_s / 2 - (time.time() - t_start))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        if rc != 0:
            tail = (logs / f"shard{i}.log").read_text().splitlines()[-5:]
            print(f"warm shard {i} rc={rc}:\n  " + "\n  ".join(tail), flush=True)
    print(f"warm phase done [{time.time() - t_start:.0f}s since start]", flush=True)


def sweep(args, meta, t_start, argv=None):
    points = sweep_grid(args.head_dim or SWEEP_DIMS, args.group_size or SWEEP_GROUPS, args.granularity,
                        args.block_sizes, args.seq_lens, args.sparsities, args.heads)
    est = estimate_s(points, 0 if args.warm_only else args.warm_shards, not args.no_flex)
    if args.warm_only:
        i_shard, n_shard = (int(x) for x in args.shard.split("/"))
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # the shards are the parallelism
        mine = [p for u in warm_shards_of(points, n_shard, not args.no_flex)[i_shard] for p in u["points"]]
        run_points(mine, None, args, meta, t_start, timer=run_once)
        return
    print_grid(points, est, args.warm_shards)
    if args.dry_run:
        return
    meta = dict(meta, sweep=dict(argv=sys.argv[1:] if argv is None else list(argv), estimate=est,
                                 heatmap_at=HEATMAP_AT))
    if args.warm_shards:
        start_warm_shards(args, t_start)
    n_heat = sum(p["phase"] == "heatmap" for p in points)
    written = {}

    def on_written(rows, path):  # the heatmap as soon as its points are in: a cut-off run still has it
        written["path"] = path
        if len(rows) == n_heat:
            plot_sweep(rows, path.with_suffix(".png"), meta)

    # lists other than random get their own file: a video-lists sweep beside a random one on the same day would
    # otherwise overwrite it (run 13 lost a random-lists table that way)
    name = "sparse_attention-sweep" + ("" if args.lists == "random" else f"-{args.lists}")
    if not packing_on() and args.granularity != "block":  # DSV_TOKEN_PACK=off: unpacked token lists, their own file
        name += "-unpacked"
    rows = run_points(points, name, args, meta, t_start, on_written=on_written)
    print_sweep_table(rows)
    if rows:
        png = plot_sweep(rows, written["path"].with_suffix(".png"), meta)
        print(f"wrote {written['path']} and {png} [{time.time() - t_start:.0f}s since start]")


def _ints(text):
    return [int(x) for x in str(text).split(",") if x]


def _seq_lens(text):
    """'16K,64K' or '16384,65536' -> [16384, 65536]."""
    return [int(x[:-1]) * 1024 if x[-1:] in "kK" else int(x) for x in str(text).split(",") if x]


def _floats(text):
    return [float(x) for x in str(text).split(",") if x]


def main(argv=None):
    # the tile sweep imports this module's inputs and lists: imported here, not at the top
    from benchmarks.sparse_attention_tune import TUNE_PASSES, config_group, tune

    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S in {16K, 64K}, sparsity 0.9 only")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs first (S=64K, 90%%)")
    ap.add_argument("--tune-passes", default=None,
                    help=f"with --tune: only these passes, comma-separated, of {','.join(TUNE_PASSES)} (default all)")
    ap.add_argument("--groups-sweep", action="store_true", help="(G, block) sweep, split vs fused bwd, flex")
    ap.add_argument("--sweep", action="store_true",
                    help="D x G x granularity sweep (issue #15), heatmap PNG; est. ~4.7 min on an H200 with "
                         "--warm-shards 8 (see above)")
    ap.add_argument("--warm-only", action="store_true",
                    help="with --groups-sweep or --sweep: compile and run once, no timing")
    ap.add_argument("--shard", default="0/1", help="with --warm-only: I/N, this process's share of the shapes")
    ap.add_argument("--warm-shards", type=int, default=0,
                    help="with --sweep: first compile every kernel in N parallel --warm-only processes")
    ap.add_argument("--shapes", default=None, help="with --groups-sweep: GxBS list, e.g. 128x64,64x64")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--head-dim", type=_ints, default=None,
                    help="head dims, e.g. 64,96,128,256 (table: 128; sweep: 64,96,128,256)")
    ap.add_argument("--heads", type=int, default=H, help=f"query (= key/value) heads (default {H})")
    ap.add_argument("--group-size", type=_ints, default=None,
                    help="query group sizes, e.g. 32,64,128 (table: 128; sweep: 32,64,128)")
    ap.add_argument("--granularity", choices=("token", "block", "both"), default="both")
    ap.add_argument("--block-sizes", type=_ints, default=[128], help="key block sizes of block lists (default 128)")
    ap.add_argument("--seq-lens", type=_seq_lens, default=None, help="e.g. 16K,64K (overrides the grid's S)")
    ap.add_argument("--sparsities", type=_floats, default=None, help="e.g. 0.8,0.9 (overrides the grid's)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no point after this many seconds since the start (warm phase included); "
                         "the rest become rows with 'skipped'")
    ap.add_argument("--dry-run", action="store_true", help="with --sweep: print the grid and the time estimate")
    ap.add_argument("--plot-only", default=None, metavar="JSON", help="redraw a sweep JSON's heatmap PNG beside it")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--lists", choices=LIST_KINDS, default="random",
                    help="the sweep's lists: random (uniform draws, the default) or video (a video DiT's shape: "
                         "benchmarks/list_shapes.py); rows record it and list_overlap")
    ap.add_argument("--candidates", action="store_true",
                    help="also time the kernel variants waiting for a decision (G < 128, D <= 128): the keys-as-rows "
                         "forward (ms_fwd_kt*, beside ms_fwd_rowmajor: the row-major forward timed the same way) and "
                         "the packer's atomic_or marking (ms_pack_atomic)")
    ap.add_argument("--deterministic-bwd", action="store_true",
                    help="also time our backward under torch.use_deterministic_algorithms(True): ms_bwd_deterministic "
                         "and deterministic_bwd_cost (its ratio to the default backward)")
    args = ap.parse_args(argv)
    if args.plot_only:
        data = json.loads(Path(args.plot_only).read_text())
        print(f"wrote {plot_sweep(data['rows'], Path(args.plot_only).with_suffix('.png'), data.get('meta'))}")
        return
    bench_env()
    if args.deterministic_bwd:  # cuBLAS's deterministic workspace, should anything in the timed ops reach it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    meta = collect_meta()
    if args.groups_sweep:
        groups_sweep(args, meta)
        return
    if args.sweep:
        sweep(args, meta, t_start, argv)
        return
    seqs = args.seq_lens or ((16384, 65536) if args.quick else (16384, 32768, 65536, 131072))
    sparsities = args.sparsities or ((0.9,) if args.quick else (0.8, 0.9, 0.95, 0.98))
    dims, groups = args.head_dim or [D], args.group_size or [128]
    tune_passes = None if args.tune_passes is None else [p for p in args.tune_passes.split(",") if p]
    if tune_passes is not None and (not tune_passes or set(tune_passes) - set(TUNE_PASSES)):
        ap.error(f"--tune-passes: {args.tune_passes!r}; allowed: {TUNE_PASSES}")
    if args.tune:
        t0 = time.time()
        trows = [r for d in dims for g in groups
                 for r in tune(65536, g, dim=d, heads=args.heads, lists=args.lists, granularity=args.granularity,
                               passes=tune_passes)]
        write_results("sparse_attention-tune", trows, args.out, meta)
        configs = json.dumps({str(k): v for k, v in launch.CONFIG_OVERRIDES.items()})
        print(f"tuning took {time.time() - t0:.0f} s; configs: {configs}")
    points = sweep_grid(dims, groups, args.granularity, args.block_sizes, seqs, sparsities, args.heads)
    points.sort(key=lambda p: (p["S"], p["D"], p["G"], -p["block_size"] if p["block_size"] else 0, p["sparsity"]))

    def tuned(row):
        G, BS = row["G"], row["block_size"]
        row["tuned_configs"] = {f"{k[0]}": v for k, v in launch.CONFIG_OVERRIDES.items()
                                if k[1:] == (row["D"], config_group(k[0], G, BS), BS)}

    rows = run_points(points, "sparse_attention", args, meta, t_start, on_row=tuned)
    print_table(rows)


def print_table(rows):
    print(f"{'S':>6} {'gran':5} {'sp':>4} {'fwd':>7} {'bwd':>7} {'x_fwd':>6} {'x_bwd':>6} {'x_f+b':>6} "
          f"{'TF_f':>5} {'TF_b':>5} {'vsflex_f':>8} {'vsflex_b':>8}")
    for r in rows:
        if "speedup_fwd" not in r:
            continue
        vf = f"{r['speedup_vs_flex_fwd']:8.2f} {r['speedup_vs_flex_bwd']:8.2f}" if "ms_flex_fwd" in r else ""
        print(f"{r['S']:>6} {r['granularity']:5} {r['sparsity']:>4} {r['ms_fwd']:7.2f} {r['ms_bwd']:7.2f} "
              f"{r['speedup_fwd']:6.2f} {r['speedup_bwd']:6.2f} {r['speedup_fwd_bwd']:6.2f} "
              f"{r['tflops_fwd']:5.0f} {r['tflops_bwd']:5.0f} {vf}")


if __name__ == "__main__":
    main()

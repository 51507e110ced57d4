#!/usr/bin/env python
"""What the sparse attention kernels ask of a Hopper SM, from a machine without a GPU: registers per thread, bytes
spilled to local memory, and shared memory per program (and whether that fits an H100's / H200's 227 KB).

    python tools/kernel_resources.py                                  # every pass's default config, D x G x lists
    python tools/kernel_resources.py --head-dim 256 --group-size 128 --block-size 128 --space tune
    python tools/kernel_resources.py --head-dim 128 --group-size 32 --block-size 0 --pack 4 --json out.json

Triton compiles each kernel for ``sm_90a``, and the report of its own ``ptxas`` run (its ptxas and options: the GPU
machine's compiler, when this is the GPU's Triton version) gives registers and spills: the cubin the GPU would
build, with the JIT's specialisation (16-byte aligned pointers, lengths divisible by 16). A config whose shared
memory exceeds the SM's fails at launch; one that spills pays local-memory traffic in its inner loop. What it
cannot say is which config is fastest (``benchmarks/bench_sparse_attention.py --tune`` times them); it narrows what
to time. The device machine runs Triton 3.6 while this machine's virtualenv may hold another version, whose code
generation differs (3.9 spills more): for figures that hold on the GPU, put the GPU's Triton on PYTHONPATH, e.g.
``pip download --no-deps --only-binary=:all: triton==3.6.0 -d /tmp/w && pip install --no-deps --target
/tmp/triton36 /tmp/w/triton-*.whl`` and ``PYTHONPATH=/tmp/triton36 python tools/kernel_resources.py``.

Passes (``launch.pick_config``'s kinds): ``fwd``; ``bwd_q``, the dq kernel (token lists: with the dK/dV atomics,
packed as ``DSV_TOKEN_PACK`` packs them, as they run); ``bwd_q_fixed`` (token lists' dq kernel scattering dK/dV as
int64 fixed point: the deterministic backward's ``fixed``); ``bwd_kv`` (block lists' inverse-map dK/dV);
``bwd_kv_token`` (token lists' deterministic inverse walk) and ``bwd_fused`` (pointer atomics; the TMA variant,
``DQ=2``, is not reported). ``--space tune`` takes the candidates of ``sparse_attention_tune.tune_configs`` instead
of the defaults (for forwards of fewer than 128 query rows also the keys-as-rows forward, cfg ``KT=1``, that the
sweep times beside the default); ``--uneven-keys`` adds block lists over key lengths that are not a multiple of the
block (their masked loads take more shared memory); ``--query-heads-per-kv`` compiles for GQA; ``--topk`` reports
the Triton top-k's kernels (``topk_estimation.triton_impl`` and ``keys_impl``) instead. Needs Triton's compiler API
and a ptxas in its build; runs without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import itertools
import json
import os
import re
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOPPER_SMEM_BYTES = 227 * 1024  # the most shared memory one program may opt into on sm_90 (H100, H200)
# bwd_q_fixed: token lists' dq kernel scattering dK/dV as int64 fixed point (the deterministic backward's "fixed")
PASSES = ("fwd", "bwd_q", "bwd_q_fixed", "bwd_kv", "bwd_kv_token", "bwd_fused")
TOKEN_PASSES = ("bwd_q_fixed", "bwd_kv_token")  # token lists only
BLOCK_PASSES = ("bwd_kv", "bwd_fused")  # block lists only
DQ_PASSES = ("bwd_q", "bwd_q_fixed")  # the dq kernel, one config, two dK/dV scatters for token lists
PACKING_PASSES = ("fwd",) + DQ_PASSES  # the kernels that take packed token lists
# the kernels' non-constexpr integer arguments the JIT sees divisible by 16 at the lengths that matter (tokens,
# groups, list widths); BH0 is never specialised, the scales are floats
_DIVISIBLE_INTS = ("T", "TK", "NG", "KMAX", "NKB")
_ARG_TYPES = {"lse": "*fp32", "delta": "*fp32", "fx_scale": "*fp32", "dk32": "*fp32", "dv32": "*fp32", "dq32": "*fp32",
              "idx": "*i32", "cnt_ptr": "*i32", "inv_ptr": "*i32", "inv_grp": "*i32", "inv_bits": "*i64",
              "bits": "*i8", "T": "i32", "TK": "i32", "NG": "i32", "KMAX": "i32", "BH0": "i32", "NKB": "i32",
              "qk_scale": "fp32", "sm_scale": "fp32"}  # every other argument: a bf16 tensor (q, k, v, o, do, dq...)


def default_pack(kind: str, G: int, BS: int) -> int:
    """How the library runs a pass's lists: the token dq kernels pack (``packing.token_pack_factor``,
    ``DSV_TOKEN_PACK``), the forward never does."""
    from megatron_dsv.ops.sparse_attention.packing import token_pack_factor

    return token_pack_factor(G, BS) if kind in DQ_PASSES else 1


def pass_kernel(kind: str, D: int, G: int, BS: int, cfg: Dict[str, int], pack: int = 1, hr: int = 1,
                even_keys: bool = True):
    """``(kernel, constexprs)`` of one pass as ``launch`` launches it (bf16; ``hr`` query heads per kv head). Token
    lists (``BS == 0``) with ``pack`` > 1 run packed groups of ``pack * G`` rows (:mod:`...sparse_attention.packing`);
    ``even_keys`` False: block lists over a key length that is not a multiple of the block (``EVEN_T``)."""
    from megatron_dsv.ops.sparse_attention.launch import _bd
    from megatron_dsv.ops.sparse_attention.triton_bwd import bwd_kv_kernel, bwd_q_kernel
    from megatron_dsv.ops.sparse_attention.triton_fwd import sparse_attn_fwd_kernel, sparse_attn_fwd_kt_kernel

    if kind not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}; got {kind!r}")
    if pack > 1 and (BS != 0 or kind not in PACKING_PASSES):
        raise ValueError(f"--pack {pack}: only token lists' fwd and dq kernels pack (block_size 0); got {kind}, "
                         f"block_size {BS}")
    if kind in TOKEN_PASSES and BS != 0:
        raise ValueError(f"{kind} is a token lists' pass: block_size must be 0, got {BS}")
    if kind in BLOCK_PASSES and BS == 0:
        raise ValueError(f"{kind} is a block lists' pass: block_size must be 64 or 128, got 0")
    if int(cfg.get("DQ", 1)) == 2:
        raise ValueError("DQ=2 (the fused backward's TMA reduce-add) is not reported: its dq32 is a tensor descriptor")
    Gk, GB = (pack * G, G) if pack > 1 else (G, 0)
    const = dict(H=16, HR=hr, K=D, BD=_bd(D), G=Gk, BS=BS, BM=cfg["BM"], BN=cfg["BN"])
    even = even_keys or BS == 0
    if kind == "fwd" and cfg.get("KT"):  # keys as the MMA's rows (launch.sparse_fwd's cfg KT=1; never packed)
        if GB:
            raise ValueError("cfg KT=1 (keys as the MMA's rows) takes unpacked lists: --pack must be 1")
        return sparse_attn_fwd_kt_kernel, dict(const, EVEN_T=even, LAZY_L=int(cfg.get("LAZY_L", 0)))
    if kind == "fwd":
        return sparse_attn_fwd_kernel, dict(const, EVEN_T=even, GB=GB)
    if kind in DQ_PASSES:  # token lists scatter dK/dV here (fp32 atomics, or int64 fixed point)
        atomic = 2 if kind == "bwd_q_fixed" else int(BS == 0)
        return bwd_q_kernel, dict(const, EVEN_T=even, ATOMIC_KV=atomic, GB=GB)
    return bwd_kv_kernel, dict(const, BS=0 if kind == "bwd_kv_token" else BS,
                               DQ=int(cfg.get("DQ", 1)) if kind == "bwd_fused" else 0)


def resources(fn, constexprs: Dict[str, object], num_warps: int, num_stages: int,
              arg_types: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    """Compile ``fn`` (the constexprs of :func:`pass_kernel`) for sm_90a: ``{regs, spill_stores, spill_loads, smem,
    fits}`` (bytes per thread for the spills, per program for smem; ``fits``: smem within
    :data:`HOPPER_SMEM_BYTES`), or ``{error}`` if it does not compile."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    types = dict(arg_types or _ARG_TYPES,
                 **({"dk32": "*i64", "dv32": "*i64"} if constexprs.get("ATOMIC_KV") == 2 else {}))
    missing = [n for n in names if n not in constexprs and n not in types and not n.islower()]
    if missing:
        raise ValueError(f"{fn.fn.__name__}: no value for constexpr arguments {missing}")
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*bf16") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in _DIVISIBLE_INTS}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    log = io.StringIO()
    try:  # Triton prints its own ptxas run's -v report (its options: the registers and spills it builds with)
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # e.g. a tile the layout rules reject, or no ptxas in this Triton build
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}")
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    report = log.getvalue()
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None or spill is None:
        return dict(error=f"no ptxas report in Triton's output: {report.strip()[-200:]!r}")
    smem = int(kernel.metadata.shared)
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                smem=smem, fits=smem <= HOPPER_SMEM_BYTES)


# the Triton top-k's (topk_estimation)
TOPK_KERNELS = ("threshold", "threshold_flags", "sliced_search", "sample_thresholds", "window", "window_kth", "write",
                "keys")
_TOPK_ARG_TYPES = {"P": "*bf16", "Kp": "*bf16", "Counts": "*i32", "Tout": "*i32", "GTout": "*i32", "Flags": "*i32",
                   "Tin": "*i32", "GTin": "*i32", "Out": "*i32", "Buf": "*i32", "Keys": "*i32", "S": "i32",
                   "n_items": "i32", "NG": "i32", "KMAX": "i32", "CAP": "i32", "F": "i32", "NSV": "i32", "Z": "fp32",
                   "g0": "i32", "n_g": "i32", "Lo": "*i64", "Hi": "*i64", "Cnt": "*i32", "L": "i32", "Tlo": "*i32",
                   "Thi": "*i32", "Ahi": "*i32", "Run": "*i32", "Small": "*i32", "TileIds": "*i32",
                   "NFlagged": "*i32", "n_tiles": "i32", "n_slices": "i32", "TileDone": "*i32",
                   "Chi": "*i32", "Next": "*i32", "PassDone": "*i32"}


def topk_rows(block_sizes, r: int = 16) -> List[Dict[str, object]]:
    """Registers, spills and shared memory of the Triton top-k's kernels as ``estimate_topk_triton`` launches them
    (``triton_impl.kernel_meta`` on ``resolve_tile``'s tiles, the passes that decide the lists (the exact search, the
    window pass, the write pass) on ``resolve_pass_tile``'s, with ``resolve_scoring``'s defaults; bf16 proxies and
    keys, ``r`` ranks), per list kind (block size, 0: token lists); the window and write passes of token lists with
    ``scan_store`` as a GPU runs it (``triton_impl.scan_store_mode`` 2: the inline-PTX store), block lists' without."""
    import torch

    from megatron_dsv.ops.topk_estimation import keys_impl, sample_impl
    from megatron_dsv.ops.topk_estimation import triton_impl as ti

    kernels = {"threshold": (ti._tk_threshold, dict(NPROBE=ti._NPROBE, NPASS=ti._NPASS, HAS_FLAGS=False)),
               "threshold_flags": (ti._tk_threshold, dict(NPROBE=ti._NPROBE, NPASS=ti._NPASS, HAS_FLAGS=True)),
               "sliced_search": (ti._tk_sliced_search, dict(NPROBE=ti._NPROBE, NPASS=ti._NPASS)),
               "sample_thresholds": (sample_impl._ss_thresholds, dict(NPROBE=ti._NPROBE, SMALL=sample_impl.SMALL_KEYS)),
               "window": (sample_impl._ss_window, {}),
               "window_kth": (sample_impl._ss_kth, dict(NPROBE=ti._NPROBE, SMALL=sample_impl.SMALL_KEYS)),
               "write": (ti._tk_write, {}), "keys": (keys_impl._tk_keys, {})}
    deciding = ("threshold", "threshold_flags", "sliced_search", "window", "write")
    rows = []
    tc = "tc" if ti.tensor_core_scorable(torch.bfloat16, r) else False
    for bs in block_sizes:
        for name in TOPK_KERNELS:  # each kernel on its method's tile (resolve_tile: "keys" has its own on blocks)
            BG, BN = ti.resolve_tile("keys" if name == "keys" else "sample", tc, bs)
            if name in deciding:  # the passes that decide the lists
                BG, BN = ti.resolve_pass_tile((), bs, BG, ti.kernel_meta(r, bs, BG=BG, BN=BN)["BN"])
            dot, pack = ti.resolve_scoring("auto", 0, torch.bfloat16, r, bs, BG, BN)
            meta = ti.kernel_meta(r, bs, dot=dot, pack_counts=pack, BG=BG, BN=BN)
            warps = meta.pop("num_warps")
            if name == "window_kth":  # the search on the buffer alone: no scoring settings
                meta = {n: meta[n] for n in ("BG", "BN", "PACK")}
            fn, extra = kernels[name]
            if name in ("window", "write"):  # scan_store on token lists only (estimate_topk_triton)
                extra = dict(SCAN_STORE=2 if bs == 0 else 0)
            row = dict(kernel=name, block_size=bs, BG=meta["BG"], BN=meta["BN"], num_warps=warps)
            row.update(resources(fn, dict(meta, **extra), warps, 3, _TOPK_ARG_TYPES))
            rows.append(row)
    return rows


def configs(kind: str, D: int, G: int, BS: int, space: str) -> List[Dict[str, int]]:
    """The configs to compile: ``launch.pick_config``'s (space ``defaults``) or the tuning sweep's candidates
    (``tune``; ``bwd_fused`` and ``bwd_kv_token`` have none there: their default)."""
    from megatron_dsv.ops.sparse_attention.launch import pick_config

    kind = "bwd_q" if kind in DQ_PASSES else kind  # the same kernel and config, another scatter
    if space not in ("defaults", "tune"):
        raise ValueError(f"space must be 'defaults' or 'tune'; got {space!r}")
    if space == "defaults" or kind in ("bwd_fused", "bwd_kv_token"):
        return [pick_config(kind, D, G, BS)]
    from benchmarks.sparse_attention_tune import tune_configs

    name = {("fwd", True): "fwd_tok", ("bwd_q", True): "bwd_q_tok"}.get((kind, BS == 0), kind)
    out = tune_configs(name, D, G, G)
    if kind == "fwd" and G < 128 and D <= 128:  # the keys-as-rows forward the sweep times beside the default
        from benchmarks.bench_sparse_attention import KT_FWD_CONFIGS

        out += [dict(cfg, BM=G, KT=1) for cfg in KT_FWD_CONFIGS.values()]
    return out


def report_rows(dims, groups, blocks, passes, space: str = "defaults", pack: Optional[int] = None, hr: int = 1,
                uneven_keys: bool = False, progress: bool = True):
    """One row per compiled (D, G, block size, pass, config): the passes that apply to each list kind
    (:data:`TOKEN_PASSES`, :data:`BLOCK_PASSES`), token lists packed as the library runs them (``pack`` None,
    :func:`default_pack`) or ``pack`` groups at a time (fwd and dq kernels, ``pack * G`` <= 128); ``uneven_keys``:
    block lists' fwd and dq kernel also over a key length that is not a multiple of the block."""
    todo = []
    for D, G, BS, kind in itertools.product(dims, groups, blocks, passes):
        if (kind in TOKEN_PASSES and BS != 0) or (kind in BLOCK_PASSES and BS == 0):
            continue
        P = default_pack(kind, G, BS) if pack is None else pack
        if P > 1 and (BS != 0 or kind not in PACKING_PASSES or P * G > 128):
            continue
        evens = (True, False) if uneven_keys and BS and kind in ("fwd", "bwd_q") else (True,)
        cfgs = [c for c in configs(kind, D, G * P, BS, space) if P == 1 or not c.get("KT")]  # KT: unpacked only
        todo += [(D, G, BS, kind, P, even, cfg) for cfg in cfgs for even in evens]
    rows = []
    for i, (D, G, BS, kind, P, even, cfg) in enumerate(todo):
        fn, const = pass_kernel(kind, D, G, BS, cfg, P, hr, even)
        row = dict(D=D, G=G, block_size=BS, pack=P, hr=hr, even_keys=even, pass_=kind, **cfg,
                   **resources(fn, const, cfg["num_warps"], cfg["num_stages"]))
        rows.append(row)
        if progress:
            print(f"[{i + 1}/{len(todo)}] {format_row(row)}", flush=True)
    return rows


def format_row(r: Dict[str, object]) -> str:
    extra = (f" pack={r['pack']}" if r.get("pack", 1) > 1 else "") + (f" hr={r['hr']}" if r.get("hr", 1) > 1 else "")
    extra += "" if r.get("even_keys", True) else " uneven"
    extra += (" keys-as-rows" + (" lazy-sum" if r.get("LAZY_L") else "")) if r.get("KT") else ""
    head = (f"D={r['D']:3d} G={r['G']:3d} block={r['block_size']:3d}{extra} "
            f"{r['pass_']:12s} BM={r['BM']:3d} BN={r['BN']:3d} w={r['num_warps']} s={r['num_stages']}")
    if "error" in r:
        return f"{head}  does not compile: {r['error']}"
    flag = "" if r["fits"] else "  TOO MUCH SHARED MEMORY"
    spill = f"  spills {r['spill_stores']} B" if r["spill_stores"] else ""
    return f"{head}  regs {r['regs']:3d}  smem {r['smem'] // 1024:3d} KB{spill}{flag}"


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=_ints, default=[64, 96, 128, 256])
    ap.add_argument("--group-size", type=_ints, default=[32, 64, 128])
    ap.add_argument("--block-size", type=_ints, default=[0, 128], help="0: token lists")
    ap.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated, of {PASSES}")
    ap.add_argument("--space", choices=("defaults", "tune"), default="defaults")
    ap.add_argument("--pack", type=int, default=None,
                    help="token lists packed P groups at a time (fwd and dq kernels; default: as the library "
                         "runs them, the dq kernels packed by DSV_TOKEN_PACK, the forward not)")
    ap.add_argument("--query-heads-per-kv", type=int, default=1, help="GQA: query heads sharing a kv head")
    ap.add_argument("--uneven-keys", action="store_true",
                    help="block lists' fwd and dq kernel also over a key length not a multiple of the block")
    ap.add_argument("--topk", action="store_true",
                    help="the Triton top-k's kernels instead (token lists and --block-size's block lists)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: under the interpreter Triton does not compile for a GPU")
    passes = [p for p in args.passes.split(",") if p]
    bad = [p for p in passes if p not in PASSES]
    if bad:
        ap.error(f"--passes: unknown {bad}; allowed: {PASSES}")
    import triton

    print(f"Triton {triton.__version__}, sm_90a, shared memory limit {HOPPER_SMEM_BYTES // 1024} KB", flush=True)
    if args.topk:
        rows = topk_rows(sorted(set([0] + args.block_size)))
        for r in rows:
            print(f"topk {r['kernel']:>15s}  block {r['block_size']:3d}  BG {r['BG']} BN {r['BN']:2d} "
                  f"warps {r['num_warps']}  " + (r["error"] if "error" in r else
                                                  f"regs {r['regs']:3d}  spills {r['spill_stores']} B"), flush=True)
    else:
        rows = report_rows(args.head_dim, args.group_size, args.block_size, passes, args.space, args.pack,
                           args.query_heads_per_kv, args.uneven_keys)
    spilled = [r for r in rows if r.get("spill_stores")]
    too_big = [r for r in rows if r.get("fits") is False]
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows)} configs: {len(spilled)} spill, {len(too_big)} need more shared memory than an SM has, "
          f"{len(failed)} do not compile")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90a", smem_limit=HOPPER_SMEM_BYTES, rows=rows), f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

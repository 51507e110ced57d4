#!/usr/bin/env python
"""What the sparse attention kernels ask of a Hopper SM, from a machine without a GPU: registers per thread, bytes
spilled to local memory, and shared memory per program (and whether that fits an H100's / H200's 227 KB).

    python tools/kernel_resources.py                                  # every pass's default config, D x G x lists
    python tools/kernel_resources.py --head-dim 256 --group-size 128 --block-size 128 --space tune
    python tools/kernel_resources.py --head-dim 128 --group-size 32 --block-size 0 --pack 4 --json out.json

Triton compiles each kernel for ``sm_90a`` and the ``ptxas`` bundled with that Triton (the GPU machine's
compiler, when it is the GPU's Triton version) reports registers and spills: the same cubin the GPU would build,
with the JIT's specialisation (16-byte aligned pointers, lengths divisible by 16). A config whose shared memory
exceeds the SM's fails at launch; one that spills pays local-memory traffic in its inner loop. What it cannot say is
which config is fastest (``benchmarks/bench_sparse_attention.py --tune`` times them); it narrows what to time.
The device machine runs Triton 3.6 while this machine's virtualenv may hold another version, whose code
generation differs: for figures that hold on the GPU, put the GPU's Triton on PYTHONPATH, e.g.
``pip download --no-deps --only-binary=:all: triton==3.6.0 -d /tmp/w && pip install --no-deps --target
/tmp/triton36 /tmp/w/triton-*.whl`` and ``PYTHONPATH=/tmp/triton36 python tools/kernel_resources.py``.

Passes (``launch.pick_config``'s kinds): ``fwd``, ``bwd_q`` (token lists: with the dK/dV atomics, as they run),
``bwd_kv`` (block lists' inverse-map dK/dV), ``bwd_kv_token`` (token lists' deterministic inverse walk) and
``bwd_fused``. ``--space tune`` takes the candidates of ``bench_sparse_attention.tune_space`` instead of the
defaults. Needs Triton's compiler API and its bundled ``ptxas``; runs without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOPPER_SMEM_BYTES = 227 * 1024  # the most shared memory one program may opt into on sm_90 (H100, H200)
PASSES = ("fwd", "bwd_q", "bwd_kv", "bwd_kv_token", "bwd_fused")
# the kernels' non-constexpr integer arguments the JIT sees divisible by 16 at the lengths that matter (tokens,
# groups, list widths); BH0 is never specialised, the scales are floats
_DIVISIBLE_INTS = ("T", "TK", "NG", "KMAX", "NKB")
_ARG_TYPES = {"lse": "*fp32", "delta": "*fp32", "fx_scale": "*fp32", "dk32": "*fp32", "dv32": "*fp32", "dq32": "*fp32",
              "idx": "*i32", "cnt_ptr": "*i32", "inv_ptr": "*i32", "inv_grp": "*i32", "inv_bits": "*i64",
              "bits": "*i8", "T": "i32", "TK": "i32", "NG": "i32", "KMAX": "i32", "BH0": "i32", "NKB": "i32",
              "qk_scale": "fp32", "sm_scale": "fp32"}  # every other argument: a bf16 tensor (q, k, v, o, do, dq...)


def pass_kernel(kind: str, D: int, G: int, BS: int, cfg: Dict[str, int], pack: int = 1):
    """``(kernel, constexprs)`` of one pass as ``launch`` launches it (bf16, one kv head per query head). Token lists
    (``BS == 0``) with ``pack`` > 1 run packed groups of ``pack * G`` rows (:mod:`...sparse_attention.packing`)."""
    from megatron_dsv.ops.sparse_attention.triton_bwd import bwd_kv_kernel, bwd_q_kernel
    from megatron_dsv.ops.sparse_attention.triton_fwd import sparse_attn_fwd_kernel

    if kind not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}; got {kind!r}")
    if pack > 1 and (BS != 0 or kind not in ("fwd", "bwd_q")):
        raise ValueError(f"--pack {pack}: only token lists' fwd and bwd_q pack (block_size 0); got {kind}, "
                         f"block_size {BS}")
    if kind in ("bwd_kv_token",) and BS != 0:
        raise ValueError(f"bwd_kv_token is the token lists' pass: block_size must be 0, got {BS}")
    from megatron_dsv.ops.sparse_attention.launch import _bd

    Gk, GB = (pack * G, G) if pack > 1 else (G, 0)
    const = dict(H=16, HR=1, K=D, BD=_bd(D), G=Gk, BS=BS, BM=cfg["BM"], BN=cfg["BN"])
    if kind == "fwd":
        return sparse_attn_fwd_kernel, dict(const, EVEN_T=True, GB=GB)
    if kind == "bwd_q":  # token lists scatter dK/dV with fp32 atomics in this kernel; block lists leave them
        return bwd_q_kernel, dict(const, EVEN_T=True, ATOMIC_KV=int(BS == 0), GB=GB, ROT=int(cfg.get("ROT", 0)))
    return bwd_kv_kernel, dict(const, BS=0 if kind == "bwd_kv_token" else BS,
                               DQ=int(cfg.get("DQ", 1)) if kind == "bwd_fused" else 0)


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (Triton >= 3.7 names it per target; 3.6 has one)."""
    from triton.backends.nvidia import compiler

    try:
        path = compiler.get_ptxas(90).path
    except TypeError:  # Triton 3.6: get_ptxas() takes no target
        path = compiler.get_ptxas().path
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"Triton's ptxas ({path}) is missing: the resource report needs it")
    return path


def resources(fn, constexprs: Dict[str, object], num_warps: int, num_stages: int) -> Dict[str, object]:
    """Compile ``fn`` for sm_90a: ``{regs, spill_stores, spill_loads, smem, fits}`` (bytes per thread for the
    spills, per program for smem; ``fits``: smem within :data:`HOPPER_SMEM_BYTES`), or ``{error}`` if it does not
    compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    missing = [n for n in names if n not in constexprs and n not in _ARG_TYPES and not n.islower()]
    if missing:
        raise ValueError(f"{fn.fn.__name__}: no value for constexpr arguments {missing}")
    sig = {n: "constexpr" if n in constexprs else _ARG_TYPES.get(n, "*bf16") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in _DIVISIBLE_INTS}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # e.g. a tile the layout rules reject
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        proc = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"],
                              capture_output=True, text=True)
    report = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if proc.returncode != 0 or regs is None or spill is None:
        return dict(error=f"ptxas: {report.strip()[-200:]}")
    smem = int(kernel.metadata.shared)
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                smem=smem, fits=smem <= HOPPER_SMEM_BYTES)


def configs(kind: str, D: int, G: int, BS: int, space: str) -> List[Dict[str, int]]:
    """The configs to compile: ``launch.pick_config``'s (space ``defaults``) or the tuning sweep's candidates
    (``tune``; ``bwd_fused`` and ``bwd_kv_token`` have none there: their default)."""
    from megatron_dsv.ops.sparse_attention.launch import pick_config

    if space == "defaults":
        return [pick_config(kind, D, G, BS)]
    if space != "tune":
        raise ValueError(f"space must be 'defaults' or 'tune'; got {space!r}")
    from benchmarks.bench_sparse_attention import tune_space

    name = {("fwd", True): "fwd_tok", ("bwd_q", True): "bwd_q_tok"}.get((kind, BS == 0), kind)
    if kind in ("bwd_fused", "bwd_kv_token"):
        return [pick_config(kind, D, G, BS)]
    return [dict(BM=min(BM, G), BN=BN, num_warps=w, num_stages=st) for BM, BN, w, st in tune_space(name, D)]


def report_rows(dims, groups, blocks, passes, space: str = "defaults", pack: int = 1, progress: bool = True):
    """One row per compiled (D, G, block size, pass, config); passes that do not apply to a list kind are left
    out (``bwd_kv``/``bwd_fused`` are block lists', ``bwd_kv_token`` token lists')."""
    todo = []
    for D, G, BS, kind in itertools.product(dims, groups, blocks, passes):
        if (BS == 0) != (kind == "bwd_kv_token") and kind in ("bwd_kv", "bwd_fused", "bwd_kv_token"):
            continue
        if pack > 1 and (BS != 0 or kind not in ("fwd", "bwd_q") or pack * G > 128):
            continue
        todo += [(D, G, BS, kind, cfg) for cfg in configs(kind, D, G * pack, BS, space)]
    rows = []
    for i, (D, G, BS, kind, cfg) in enumerate(todo):
        fn, const = pass_kernel(kind, D, G, BS, cfg, pack)
        row = dict(D=D, G=G, block_size=BS, pack=pack, pass_=kind, **cfg,
                   **resources(fn, const, cfg["num_warps"], cfg["num_stages"]))
        rows.append(row)
        if progress:
            print(f"[{i + 1}/{len(todo)}] {format_row(row)}", flush=True)
    return rows


def format_row(r: Dict[str, object]) -> str:
    head = (f"D={r['D']:3d} G={r['G']:3d} block={r['block_size']:3d}{' pack=%d' % r['pack'] if r['pack'] > 1 else ''} "
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
    ap.add_argument("--pack", type=int, default=1, help="token lists packed P groups at a time (fwd, bwd_q)")
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
    rows = report_rows(args.head_dim, args.group_size, args.block_size, passes, args.space, args.pack)
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

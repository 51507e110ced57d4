"""The dq kernel's dK/dV scatter (and the token packing passes, and the Triton top-k's window and write passes)
compile for the H200 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' arithmetic on CPU but never lowers them; Triton's own compiler (with the
ptxas its wheel ships) does, for a named target, without a driver. This checks what the fixed-point path
(``ATOMIC_KV=2``, the token lists' deterministic backward) becomes on the GPU: integer reductions
(``red ... add.u64``), no float atomics, and a rounding to integer, against the fp32 atomic path
(``ATOMIC_KV=1``). It runs in a subprocess: this test session has ``TRITON_INTERPRET=1`` set, under which
``@triton.jit`` functions are the interpreter's.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COMPILE = r"""
import inspect, json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as e:
    print(json.dumps({"skip": f"Triton's compiler API is not importable: {type(e).__name__}: {e}"})); sys.exit(0)
from megatron_dsv.ops.sparse_attention.triton_bwd import bwd_q_kernel

names = list(inspect.signature(bwd_q_kernel.fn).parameters)
ptr = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "do": "*bf16", "lse": "*fp32", "delta": "*fp32",
       "dq": "*bf16", "idx": "*i32", "bits": "*i8", "cnt_ptr": "*i32", "fx_scale": "*fp32", "T": "i32", "TK": "i32",
       "NG": "i32", "KMAX": "i32", "BH0": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
out = {}
for mode in (1, 2):
    acc = "*i64" if mode == 2 else "*fp32"
    sig = {n: ptr.get(n, acc if n in ("dk32", "dv32") else "constexpr") for n in names}
    const = dict(H=4, HR=2, K=128, BD=128, G=32, BM=32, BN=64, BS=0, EVEN_T=False, ATOMIC_KV=mode, GB=0)
    src = ASTSource(fn=bwd_q_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    except Exception as e:
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            print(json.dumps({"skip": f"no ptxas in this Triton build: {e}"})); sys.exit(0)
        raise
    lines = [l for l in kernel.asm["ptx"].splitlines() if "red.global" in l or "atom.global" in l]
    out[mode] = dict(u64=sum(".add.u64" in l or ".add.s64" in l for l in lines),
                     f32=sum(".add.f32" in l for l in lines),
                     rounding=sum("cvt.rmi" in l for l in kernel.asm["ptx"].splitlines()),
                     cubin=len(kernel.asm["cubin"]))
# packed token lists (GB > 0): 128-row tiles of four 32-row groups, forward and dq kernel, on Hopper's wgmma
from megatron_dsv.ops.sparse_attention.triton_fwd import sparse_attn_fwd_kernel
for name, fn, extra in (("packed_fwd", sparse_attn_fwd_kernel, {}),
                        ("packed_bwd_q", bwd_q_kernel, {"ATOMIC_KV": 1})):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: ptr.get(n, "*fp32" if n in ("dk32", "dv32") else "constexpr") for n in names}
    const = dict(H=4, HR=2, K=128, BD=128, G=128, BM=128, BN=64, BS=0, EVEN_T=True, GB=32, **extra)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=2))
    ptx = kernel.asm["ptx"].splitlines()
    out[name] = dict(cubin=len(kernel.asm["cubin"]), wgmma=sum("wgmma.mma_async" in l for l in ptx),
                     bits_loads=sum("ld.global" in l and ".b8" in l or "ld.global.u8" in l or "ld.global.s8" in l
                                    for l in ptx))
# the packing passes (packing.py): atomic_or on the key bitmap (or an atomic add per run), prefix sums over 2048 keys
from megatron_dsv.ops.sparse_attention.packing import _compact_kernel, _mark_kernel, _mark_runs_kernel
mark_types = dict(idx="*i32", cnt="*i32", bitmap="*i32", KM="i32", NG="i32", NW="i32", NGP="i32", TK="i32")
for name, fn, types, const in (
        ("pack_mark", _mark_kernel, mark_types, dict(BLOCK=256)),
        ("pack_mark_runs", _mark_runs_kernel, mark_types, dict(BLOCK=256)),
        ("pack_compact", _compact_kernel, dict(bitmap="*i32", out_idx="*i32", out_bits="*i8", out_cnt="*i32",
                                               NW="i32", W="i32"), dict(P=4, WB=64))):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    ptx = kernel.asm["ptx"].splitlines()
    atomics = [l for l in ptx if "atom." in l or "red." in l]
    out[name] = dict(cubin=len(kernel.asm["cubin"]), atom_or=sum(".or." in l for l in atomics),
                     atom_add=sum(".add." in l for l in atomics))
print(json.dumps(out))
"""


def _compile_in_subprocess(script: str, tmp_path) -> dict:
    """Run a compile script in a fresh process without the interpreter (Triton's real compiler, its own cache
    in ``tmp_path``): the JSON it prints last, or a skip with the reason it gives."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def test_fixed_point_scatter_compiles_for_sm90(tmp_path):
    result = _compile_in_subprocess(_COMPILE, tmp_path)
    fp32, fixed = result["1"], result["2"]
    assert fp32["cubin"] > 0 and fixed["cubin"] > 0
    assert fp32["f32"] > 0 and fp32["u64"] == 0, fp32  # the fp32 atomics: float reductions only
    assert fixed["u64"] > 0 and fixed["f32"] == 0, fixed  # fixed point: integer reductions, no float atomics
    assert fixed["rounding"] > 0, fixed  # floor(x * 2^e + 1/2) lowers to a round-down conversion
    for name in ("packed_fwd", "packed_bwd_q"):  # packed lists compile to Hopper's wgmma
        assert result[name]["cubin"] > 0 and result[name]["wgmma"] > 0, result[name]
    assert result["pack_mark"]["cubin"] > 0 and result["pack_mark"]["atom_or"] > 0, result["pack_mark"]
    runs = result["pack_mark_runs"]  # integer adds at run boundaries, no atomic_or
    assert runs["cubin"] > 0 and runs["atom_add"] > 0 and runs["atom_or"] == 0, runs
    assert result["pack_compact"]["cubin"] > 0, result["pack_compact"]


_TOPK_COMPILE = r"""
import inspect, json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as e:
    print(json.dumps({"skip": f"Triton's compiler API is not importable: {type(e).__name__}: {e}"})); sys.exit(0)
from megatron_dsv.ops.topk_estimation import sample_impl, triton_impl as ti

types = {"Counts": "*i32", "Tlo": "*i32", "Thi": "*i32", "Buf": "*i32", "Ahi": "*i32", "Run": "*i32", "Tin": "*i32",
         "GTin": "*i32", "Out": "*i32", "S": "i32", "n_items": "i32", "NG": "i32", "CAP": "i32", "KMAX": "i32"}
out = {}
for name, fn in (("window", sample_impl._ss_window), ("write", ti._tk_write)):
    for mode in (0, 2):  # scan_store=False, and the GPU's scan_store (the inline PTX store)
        meta = ti.kernel_meta(16, 0, dot="tc", pack_counts=4, BG=32, BN=64)  # token lists' pass tile, bf16
        warps = meta.pop("num_warps")
        meta["SCAN_STORE"] = mode
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: "constexpr" if n in meta else types.get(n, "*bf16") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in meta.items()}, attrs=attrs)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
        except Exception as e:
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                print(json.dumps({"skip": f"no ptxas in this Triton build: {e}"})); sys.exit(0)
            raise
        ptx = kernel.asm["ptx"]
        out[f"{name}{mode}"] = dict(cubin=len(kernel.asm["cubin"]), ptx_stores=ptx.count("@p st.global.b32"),
                                    converts=kernel.asm["ttgir"].count("convert_layout"))
print(json.dumps(out))
"""


def test_topk_scan_store_compiles_for_sm90(tmp_path):
    """The Triton top-k's window and write passes with ``scan_store`` (``triton_impl.scan_store_mode`` 2: the keys
    carried through the scan, the store as inline PTX in its layout) compile for sm_90 with their layout conversions
    down to 3 and 1 (8 and 5 with ``scan_store=False``, Triton 3.6 and 3.9), and the store is the inline one."""
    result = _compile_in_subprocess(_TOPK_COMPILE, tmp_path)
    for name, most in (("window", 3), ("write", 1)):
        old, new = result[f"{name}0"], result[f"{name}2"]
        assert old["cubin"] > 0 and new["cubin"] > 0, result
        assert new["converts"] <= most < old["converts"], result
        assert new["ptx_stores"] > 0 and old["ptx_stores"] == 0, result

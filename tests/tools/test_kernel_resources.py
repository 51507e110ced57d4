"""tools/kernel_resources.py: the sparse attention kernels compiled for sm_90a on a machine without a GPU, their
registers, spills and shared memory read from Triton's own ptxas.

Every pass's default config (``launch.pick_config``) over head dims x group sizes x list kinds must fit an H100's /
H200's shared memory: a config that does not fails at launch on the GPU, and only there. Runs in a subprocess: this
session has ``TRITON_INTERPRET=1``, under which Triton does not compile for a GPU.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PRELUDE = r"""
import json, sys
try:
    from triton.backends.compiler import GPUTarget  # noqa: F401
    from triton.compiler import ASTSource  # noqa: F401
except Exception as e:
    print(json.dumps({"skip": f"Triton's compiler API is not importable: {type(e).__name__}: {e}"})); sys.exit(0)
sys.path.insert(0, "tools")
import kernel_resources as kr
fn, const = kr.pass_kernel("fwd", 64, 32, 128, dict(BM=32, BN=64))
probe = kr.resources(fn, const, 4, 2)
if "ptxas" in probe.get("error", "").lower():
    print(json.dumps({"skip": f"this Triton build cannot run ptxas: {probe['error']}"})); sys.exit(0)
"""
# two halves, compiled by two processes side by side (the compiles are single-threaded; CI has 2 cores)
_PARTS = (r"""
# every default, token lists' dq kernels packed as the library packs them, block lists also over uneven key lengths
out = {"defaults": kr.report_rows([64, 256], [32, 128], [0, 128], kr.PASSES, uneven_keys=True, progress=False)}
# the packed forward (the sweep times it), and GQA (two query heads a kv head)
out["packed"] = kr.report_rows([128], [32], [0], ("fwd",), pack=4, progress=False)
out["gqa"] = kr.report_rows([128], [128], [128], ("bwd_kv",), hr=2, progress=False)
# a tile known not to fit: D=256 token lists' dq kernel on 128 query rows (its dK/dV scatter: > 227 KB)
fn, const = kr.pass_kernel("bwd_q", 256, 128, 0, dict(BM=128, BN=32))
out["too_big"] = kr.resources(fn, const, 8, 2)
print(json.dumps(out))
""", r"""
out = {"defaults": kr.report_rows([96, 128], [32, 128], [0, 128], kr.PASSES, uneven_keys=True, progress=False)}
# the keys-as-rows forward the sweep times at G = 32 (cfg KT=1: wgmma, not mma.sync, on 32-row query tiles)
out["kt"] = [r for r in kr.report_rows([128], [32], [0], ("fwd",), space="tune", progress=False) if r.get("KT")]
# ... and never packed: at G = 16 packed 4 at a time (64 rows) the tune space leaves it out instead of failing
out["kt_packed"] = [r.get("KT", 0) for r in kr.report_rows([128], [16], [0], ("fwd",), space="tune", pack=4,
                                                            progress=False)]
# the Triton top-k's kernels as estimate_topk_triton launches them, token lists and blocks of 64 and 128
out["topk"] = kr.topk_rows([0, 64, 128])
print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    procs = []
    for part in _PARTS:  # each its own Triton cache: no two processes writing one cache entry
        part_env = dict(env, TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
        procs.append(subprocess.Popen([sys.executable, "-c", _PRELUDE + part], cwd=ROOT, env=part_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    result = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, stderr[-3000:]
            part = json.loads(stdout.strip().splitlines()[-1])
            if "skip" in part:
                pytest.skip(part["skip"])
            result["defaults"] = result.get("defaults", []) + part.pop("defaults")
            result.update(part)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return result


def test_every_default_config_compiles_and_fits_hopper_shared_memory(report):
    rows = report["defaults"]
    # 4 head dims x 2 group sizes: token lists fwd, bwd_q, bwd_q_fixed, bwd_kv_token; block lists fwd and bwd_q over
    # even and uneven key lengths, bwd_kv, bwd_fused
    assert len(rows) == 4 * 2 * (4 + 6)
    assert {r["pass_"] for r in rows if r["block_size"] == 0} == {"fwd", "bwd_q", "bwd_q_fixed", "bwd_kv_token"}
    assert {r["pass_"] for r in rows if r["block_size"] == 128} == {"fwd", "bwd_q", "bwd_kv", "bwd_fused"}
    assert {(r["pass_"], r["even_keys"]) for r in rows if r["block_size"] == 128 and not r["even_keys"]} == {
        ("fwd", False), ("bwd_q", False)}
    for r in rows + report["packed"] + report["gqa"] + report["kt"]:
        assert "error" not in r, r
        assert r["fits"] and 0 < r["smem"] <= 227 * 1024, r
        assert 0 < r["regs"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0, r


def test_token_dq_kernels_are_packed_as_the_library_runs_them(report):
    token = [r for r in report["defaults"] if r["block_size"] == 0 and r["D"] == 128]
    packs = {(r["pass_"], r["G"]): (r["pack"], r["BM"]) for r in token if r["pass_"] != "bwd_kv_token"}
    # DSV_TOKEN_PACK on (the default): the dq kernels run 4 groups of 32 as one 128-row group; the forward never packs
    assert packs == {("fwd", 32): (1, 32), ("bwd_q", 32): (4, 128), ("bwd_q_fixed", 32): (4, 128),
                     ("fwd", 128): (1, 128), ("bwd_q", 128): (1, 128), ("bwd_q_fixed", 128): (1, 128)}
    assert [(r["pass_"], r["G"], r["pack"], r["BM"]) for r in report["packed"]] == [("fwd", 32, 4, 128)]
    assert [(r["pass_"], r["hr"]) for r in report["gqa"]] == [("bwd_kv", 2)]


def test_a_tile_beyond_shared_memory_is_reported(report):
    r = report["too_big"]
    assert "error" not in r, r
    assert r["fits"] is False and r["smem"] > 227 * 1024, r


def test_bad_arguments_name_what_is_allowed(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import kernel_resources as kr

    cfg = dict(BM=64, BN=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="pass must be one of"):
        kr.pass_kernel("bwd", 128, 64, 0, cfg)
    with pytest.raises(ValueError, match="only token lists"):
        kr.pass_kernel("fwd", 128, 32, 128, cfg, pack=4)
    with pytest.raises(ValueError, match="block_size must be 0"):
        kr.pass_kernel("bwd_kv_token", 128, 64, 128, cfg)
    with pytest.raises(ValueError, match="block_size must be 64 or 128"):
        kr.pass_kernel("bwd_kv", 128, 64, 0, cfg)
    with pytest.raises(ValueError, match="DQ=2"):
        kr.pass_kernel("bwd_fused", 128, 64, 128, dict(cfg, DQ=2))
    with pytest.raises(ValueError, match="space must be"):
        kr.configs("fwd", 128, 64, 0, "all")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # under the interpreter Triton compiles for no GPU: the CLI says so
    with pytest.raises(SystemExit):
        kr.main(["--head-dim", "128"])


def test_keys_as_rows_forward_is_reported_with_the_sweeps_candidates(report):
    kt = report["kt"]
    assert len(kt) == 4 and {(r["BN"], r["num_warps"], r.get("LAZY_L", 0)) for r in kt} == {
        (64, 4, 0), (128, 8, 0), (64, 4, 1), (128, 8, 1)}
    assert all(r["BM"] == 32 and r["pass_"] == "fwd" for r in kt)
    assert report["kt_packed"] and not any(report["kt_packed"])


def test_topk_kernels_compile_without_spilling(report):
    """The Triton top-k's search (whole and sliced), sample (its three kernels), write and keys kernels at the
    library's tiles and scoring (``resolve_tile``, ``resolve_pass_tile``, ``kernel_meta``, ``resolve_scoring``): the
    token lists' kernels spill nothing, block lists' at most a few words (before its rewrite the search kernel
    spilled 4.6 KB a thread and "sample" 18.9 KB, Triton 3.6). This machine's Triton may not be the GPU's."""
    rows = report["topk"]
    assert {(r["kernel"], r["block_size"]) for r in rows} == {(k, b) for k in ("threshold", "threshold_flags",
                                                              "sliced_search", "sample_thresholds", "window",
                                                              "window_kth", "write", "keys")
                                                              for b in (0, 64, 128)}
    assert not [r for r in rows if "error" in r], rows
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in rows if r["block_size"] == 0), rows
    assert all(r["spill_loads"] <= 64 for r in rows), rows
    assert all(r["num_warps"] == 8 and r["BN"] * max(1, r["block_size"]) <= 512 for r in rows), rows

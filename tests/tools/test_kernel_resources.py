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

_RUN = r"""
import json, sys
try:
    from triton.backends.compiler import GPUTarget  # noqa: F401
    from triton.compiler import ASTSource  # noqa: F401
except Exception as e:
    print(json.dumps({"skip": f"Triton's compiler API is not importable: {type(e).__name__}: {e}"})); sys.exit(0)
sys.path.insert(0, "tools")
import kernel_resources as kr
try:
    kr._ptxas()
except FileNotFoundError as e:
    print(json.dumps({"skip": str(e)})); sys.exit(0)
out = {"defaults": kr.report_rows([64, 96, 128, 256], [32, 128], [0, 128], kr.PASSES, progress=False)}
# packed token lists: 4 groups of 32 as one 128-row tile, forward and dq kernel
out["packed"] = kr.report_rows([128], [32], [0], ("fwd", "bwd_q"), pack=4, progress=False)
# a tile known not to fit: D=256 token lists' dq kernel on 128 query rows (its dK/dV scatter: > 227 KB)
fn, const = kr.pass_kernel("bwd_q", 256, 128, 0, dict(BM=128, BN=32))
out["too_big"] = kr.resources(fn, const, 8, 2)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    proc = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def test_every_default_config_compiles_and_fits_hopper_shared_memory(report):
    rows = report["defaults"]
    # 4 head dims x 2 group sizes: token lists fwd, bwd_q, bwd_kv_token; block lists fwd, bwd_q, bwd_kv, bwd_fused
    assert len(rows) == 4 * 2 * 7
    assert {r["pass_"] for r in rows if r["block_size"] == 0} == {"fwd", "bwd_q", "bwd_kv_token"}
    assert {r["pass_"] for r in rows if r["block_size"] == 128} == {"fwd", "bwd_q", "bwd_kv", "bwd_fused"}
    for r in rows + report["packed"]:
        assert "error" not in r, r
        assert r["fits"] and 0 < r["smem"] <= 227 * 1024, r
        assert 0 < r["regs"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0, r


def test_packed_rows_compile_the_128_row_tile(report):
    assert [(r["pass_"], r["G"], r["pack"], r["BM"]) for r in report["packed"]] == [("fwd", 32, 4, 128),
                                                                                     ("bwd_q", 32, 4, 128)]


def test_a_tile_beyond_shared_memory_is_reported(report):
    r = report["too_big"]
    assert "error" not in r, r
    assert r["fits"] is False and r["smem"] > 227 * 1024, r


def test_bad_arguments_name_what_is_allowed():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import kernel_resources as kr

    cfg = dict(BM=64, BN=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="pass must be one of"):
        kr.pass_kernel("bwd", 128, 64, 0, cfg)
    with pytest.raises(ValueError, match="only token lists"):
        kr.pass_kernel("fwd", 128, 32, 128, cfg, pack=4)
    with pytest.raises(ValueError, match="block_size must be 0"):
        kr.pass_kernel("bwd_kv_token", 128, 64, 128, cfg)
    with pytest.raises(ValueError, match="space must be"):
        kr.configs("fwd", 128, 64, 0, "all")
    with pytest.raises(SystemExit):  # under the interpreter Triton compiles for no GPU: the CLI says so
        kr.main(["--head-dim", "128"])

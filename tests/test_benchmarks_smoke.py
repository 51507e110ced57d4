"""The recall benchmark runs end to end on the CPU (--quick) and its JSON files plot.

It is the tool that produces the issue's recall and overhead figures on the GPU; here it is run
in a subprocess (its own process group) on the tiny DiT, and the columns the README and the
notes quote are checked for presence and range, not for GPU-sized values.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_bench_recall_quick_writes_rows_and_trajectory(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_recall.py"), "--quick", "--predictor-input", "qk",
           "--background", "texture", "--log-every", "10", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " [qk] iteration     30 |" in proc.stdout  # progress lines
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [f.split("-")[0] for f in files] == ["recall", "recall_trajectory"], files
    rows = json.loads((tmp_path / files[0]).read_text())["rows"]
    assert [r["layer"] for r in rows] == [1, 2, 3, 4] and all(r["stage"] == 2 for r in rows)
    for r in rows:
        assert 0.0 <= r["recall"] <= 1.0 and 0.0 <= r["sparsity_measured"] <= 1.0
        assert r["ms_step"] > 0 and r["ms_step_dense"] > 0 and r["background"] == "texture"
    trajectory = json.loads((tmp_path / files[1]).read_text())["rows"]
    assert {r["stage"] for r in trajectory} == {1, 2} and {r["layer"] for r in trajectory} == {1, 2, 3, 4}

    sys.path.insert(0, ROOT)
    from benchmarks.plot_results import main as plot

    written = plot(["--results", str(tmp_path)])
    assert sorted(os.path.basename(p) for p in written) == [f[:-5] + ".png" for f in files]

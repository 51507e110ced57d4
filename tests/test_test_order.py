"""The xdist workers start the longest groups first: tools/test_durations.py reads a --durations report into
tests/durations.json, and tests/conftest.py orders the collected groups by it."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import DURATIONS, _longest_groups_first

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REPORT = """============================ slowest durations =============================
164.18s setup    tests/tools/test_kernel_resources.py::test_every_default_config_compiles
113.81s call     tests/megatron_lm/test_core_v019_cpu.py::test_plugin_tests_pass_on_megatron_core_0_19
2.50s call     tests/ops/test_a.py::test_x[fp16-tok]
1.25s teardown tests/ops/test_a.py::test_y
0.50s call     tests/test_b.py::Test::test_z
(1 durations < 0.005s hidden.)
1 failed, 5 passed in 3.00s
"""


def test_durations_tool_sums_each_files_phases(tmp_path):
    log, out = tmp_path / "log", tmp_path / "durations.json"
    log.write_text(REPORT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "test_durations.py"), str(log), "--note",
                           "test", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["measured"] == "test"
    assert list(data["seconds"].items()) == [("tests/tools/test_kernel_resources.py", 164.2),
                                             ("tests/megatron_lm/test_core_v019_cpu.py", 113.8),
                                             ("tests/ops/test_a.py", 3.8), ("tests/test_b.py", 0.5)]
    log.write_text("5 passed in 3.00s\n")  # no --durations lines: refused, saying what to run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "test_durations.py"), str(log), "--note",
                           "test", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--durations=0" in proc.stderr


class _Item:
    def __init__(self, nodeid, group=None):
        self.nodeid = nodeid
        self.marker = pytest.mark.xdist_group(group or nodeid.split("::")[0]).mark

    def get_closest_marker(self, name):
        return self.marker if name == "xdist_group" else None


def test_groups_are_ordered_by_their_measured_seconds(tmp_path):
    seconds = {"tests/slow_one.py": 100.0, "tests/many.py": 30.0, "tests/proc_a.py": 20.0, "tests/proc_b.py": 20.0}
    (tmp_path / "durations.json").write_text(json.dumps({"measured": "test", "seconds": seconds}))
    items = ([_Item(f"tests/many.py::t{i}") for i in range(5)] + [_Item("tests/proc_a.py::t", "processes")]
             + [_Item("tests/unknown.py::t0"), _Item("tests/unknown.py::t1")] + [_Item("tests/slow_one.py::t")]
             + [_Item("tests/proc_b.py::t", "processes")])
    _longest_groups_first(items, str(tmp_path / "durations.json"))
    # slow_one (100 s) before the two "processes" files together (40 s), then many (30 s), then unknown (2 x 0.5 s)
    assert [it.nodeid for it in items] == ["tests/slow_one.py::t", "tests/proc_a.py::t", "tests/proc_b.py::t",
                                           *[f"tests/many.py::t{i}" for i in range(5)],
                                           "tests/unknown.py::t0", "tests/unknown.py::t1"]


def test_every_measured_file_exists():
    """A renamed or deleted test file leaves its entry behind: regenerate tests/durations.json (the tool's doc)."""
    with open(DURATIONS) as f:
        seconds = json.load(f)["seconds"]
    assert seconds and all(os.path.isfile(os.path.join(ROOT, p)) for p in seconds), [
        p for p in seconds if not os.path.isfile(os.path.join(ROOT, p))]

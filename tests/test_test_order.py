"""The xdist groups and their order: a file's tests on one worker, the process files together (tests/conftest.py's
scheduler); the longest groups first (tools/test_durations.py reads a --durations report into tests/durations.json,
and tests/conftest.py orders the collected groups by it)."""

import json
import os
import re
import subprocess
import sys

from tests.conftest import DURATIONS, PROCESS_FILES, _longest_groups_first, group_of

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
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_groups_are_ordered_by_their_measured_seconds(tmp_path):
    seconds = {"tests/slow_one.py": 100.0, "tests/many.py": 30.0, "tests/test_slurm.py": 20.0,
               "tests/test_run_tests_script.py": 20.0}
    (tmp_path / "durations.json").write_text(json.dumps({"measured": "test", "seconds": seconds}))
    items = ([_Item(f"tests/many.py::t{i}") for i in range(5)] + [_Item("tests/test_slurm.py::t")]
             + [_Item("tests/unknown.py::t0"), _Item("tests/unknown.py::t1")] + [_Item("tests/slow_one.py::t")]
             + [_Item("tests/test_run_tests_script.py::t")])
    _longest_groups_first(items, str(tmp_path / "durations.json"))
    # slow_one (100 s) before the two PROCESS_FILES together (40 s), then many (30 s), then unknown (2 x 0.5 s)
    assert [it.nodeid for it in items] == ["tests/slow_one.py::t", "tests/test_slurm.py::t",
                                           "tests/test_run_tests_script.py::t",
                                           *[f"tests/many.py::t{i}" for i in range(5)],
                                           "tests/unknown.py::t0", "tests/unknown.py::t1"]


def test_groups_are_files_and_the_process_files_share_one():
    assert group_of("tests/ops/test_a.py::test_x[fp16-tok]") == "tests/ops/test_a.py"
    assert {group_of(f"{p}::t") for p in PROCESS_FILES} == {"processes"}
    assert all(os.path.isfile(os.path.join(ROOT, p)) for p in PROCESS_FILES)


PROBE = """
def pytest_sessionfinish(session):
    sched = session.config.pluginmanager.getplugin("dsession").sched
    print("SCHEDULER", type(sched).__name__)
"""


def test_two_workers_run_each_file_on_one(tmp_path):
    """A real 2-worker run of two small files: the controller uses tests/conftest.py's scheduler, and each file's
    tests run on one worker."""
    (tmp_path / "dsv_sched_probe.py").write_text(PROBE)
    files = ["tests/attention/test_local_lists.py", "tests/attention/test_block.py"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "dsv_sched_probe", "-s",
                           "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder", "-v", *files], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "SCHEDULER GroupScheduling" in proc.stdout, proc.stdout[-3000:]
    workers = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(gw\d+)\].* PASSED (\S+?)::", line)
        if m:
            workers.setdefault(m.group(2), set()).add(m.group(1))
    assert set(workers) == set(files) and all(len(w) == 1 for w in workers.values()), workers


def test_every_measured_file_exists():
    """A renamed or deleted test file leaves its entry behind: regenerate tests/durations.json (the tool's doc)."""
    with open(DURATIONS) as f:
        seconds = json.load(f)["seconds"]
    assert seconds and all(os.path.isfile(os.path.join(ROOT, p)) for p in seconds), [
        p for p in seconds if not os.path.isfile(os.path.join(ROOT, p))]

"""Test set-up shared by every test.

Without a GPU, Triton kernels run under the interpreter: ``TRITON_INTERPRET``
must be set before the first ``import triton``, so it is set here.
"""

import json
import os
from collections import Counter

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the H200 device, not in CPU CI)")
# Triton on CPU tensors needs the interpreter, which is on only where this file set it (no GPU) or the caller did
INTERPRETER_ON = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: longer CPU tests")
    config.addinivalue_line("markers", "alone: runs in tools/run_tests.sh's last phase, in one process after the "
                                       "xdist workers have ended (real Slurm jobs: on 2 workers one's torchrun lost "
                                       "its c10d rendezvous store beside the other worker's tests)")
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU tensors under TRITON_INTERPRET=1; "
                                       "skipped where the interpreter is off (a GPU machine: the gpu-marked twins)")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        config.pluginmanager.register(_LongestGroupsFirst(), "dsv-longest-groups-first")


def pytest_collection_modifyitems(config, items):
    """Skip markers (gpu, interpreter)."""
    gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 device, not in CPU CI)")
    interp = pytest.mark.skip(reason="runs Triton on CPU tensors under the interpreter, which is off here "
                                     "(TRITON_INTERPRET != 1, as on a GPU machine); "
                                     "tests/ops/test_sparse_attention_gpu.py runs the kernels on the GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(gpu)
        if "interpreter" in item.keywords and not INTERPRETER_ON:
            item.add_marker(interp)


# The pytest-xdist groups (tools/run_tests.sh: 2 workers). A group's tests run on one worker, in turn: a file's module
# fixtures (a compile, an unpacked Megatron-LM tree, a trained checkpoint) are made once, and the files below, which
# start, count (frontier_launch.running_workers) or stop processes by name, or reinstall the venv every test imports
# from, never run beside each other. xdist's own --dist loadgroup cannot do this under pytest 9 (it renames test ids
# through an attribute pytest 9 no longer reads, so every test was its own group): the scheduler below groups by path.
PROCESS_FILES = ("tests/test_bench_quality.py", "tests/test_slurm.py", "tests/test_video_runs_arms.py",
                 "tests/test_benchmarks_smoke.py", "tests/test_example_launchers.py", "tests/test_run_tests_script.py")
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")


def group_of(nodeid: str) -> str:
    """A test's xdist group: "processes" for :data:`PROCESS_FILES`, else its file."""
    path = nodeid.split("::")[0]
    return "processes" if path in PROCESS_FILES else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a GPU machine's pytest may not have
def pytest_xdist_make_scheduler(config, log):
    """The xdist controller's scheduler: whole groups (:func:`group_of`) to a worker, in the workers' collection
    order, which :func:`_longest_groups_first` sets (tools/run_tests.sh passes --no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


class _LongestGroupsFirst:
    """On an xdist worker (whose collection order the controller schedules by), the groups longest first."""

    @pytest.hookimpl(trylast=True)  # after -m / -k / --deselect have removed what will not run
    def pytest_collection_modifyitems(self, config, items):
        _longest_groups_first(items)


def _longest_groups_first(items, durations: str = DURATIONS):
    """Order the xdist groups by their measured seconds, longest first (tests/durations.json; a file not in it counts
    half a second a test), keeping each group's own order. Without it xdist orders the groups by their number of
    tests, which put a one-test file of two minutes last, on one worker, while the other idled."""
    with open(durations) as f:
        seconds = json.load(f)["seconds"]
    paths = [it.nodeid.split("::")[0] for it in items]
    tests_in = Counter(paths)
    cost = Counter()
    for it, p in zip(items, paths):  # a file's measured seconds, shared among its collected tests
        cost[group_of(it.nodeid)] += seconds.get(p, 0.5 * tests_in[p]) / tests_in[p]
    items.sort(key=lambda it: -cost[group_of(it.nodeid)])  # stable: a group's tests keep their order


@pytest.fixture(scope="session")
def megatron_cpu():
    """Megatron-Core model-parallel state on one gloo process (CPU), set up once per session.

    Yields the ``ProcessGroupCollection`` of the default groups (tp, cp, dp, ...).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        import tempfile

        # A file store, not TCP: no port to race for with other test processes.
        store = tempfile.NamedTemporaryFile(prefix="dsv-gloo-", delete=False).name
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if HAS_CUDA:  # the tracker stores CUDA RNG states: it cannot exist on a CPU-only torch
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    from megatron.core.process_groups_config import ProcessGroupCollection

    yield ProcessGroupCollection.use_mpu_process_groups()


def _megatron_lm_tarballs() -> str:
    """The folder of Megatron-LM tarballs: $MEGATRON_LM_TARBALLS, else ../shared/megatron-lm beside the checkout."""
    if os.environ.get("MEGATRON_LM_TARBALLS"):
        return os.environ["MEGATRON_LM_TARBALLS"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(os.path.dirname(root), "shared", "megatron-lm")


@pytest.fixture(scope="session")
def megatron_lm_tree(tmp_path_factory):
    """``get(tag, patched=False)``: a Megatron-LM tree at ``tag`` unpacked from
    ``../shared/megatron-lm/Megatron-LM-<tag>.tgz`` once per session (a shallow clone with its .git), or
    a second copy with the patch set applied (tools/apply_patches.py); skips naming the file when absent.
    Callers must not modify the trees (clone them for that)."""
    import subprocess
    import sys

    trees = {}

    def get(tag: str, patched: bool = False) -> str:
        key = (tag, patched)
        if key not in trees:
            tgz = os.path.join(_megatron_lm_tarballs(), f"Megatron-LM-{tag}.tgz")
            if not os.path.isfile(tgz):
                pytest.skip(f"{tgz} absent (set MEGATRON_LM_TARBALLS to a folder of Megatron-LM-<tag>.tgz)")
            dest = tmp_path_factory.mktemp(f"mlm-{tag}-{'patched' if patched else 'pristine'}")
            subprocess.run(["tar", "xzf", tgz, "-C", str(dest)], check=True)
            tree = os.path.join(dest, "Megatron-LM")
            if patched:
                tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                                    "apply_patches.py")
                proc = subprocess.run([sys.executable, tool, "--tag", tag, tree], capture_output=True, text=True)
                assert proc.returncode == 0, proc.stdout + proc.stderr
            trees[key] = tree
        return trees[key]

    return get


@pytest.fixture
def fast_table(tmp_path):
    """A speedup-table JSON (benchmark format) saying sparse is 2x faster at every sparsity."""
    rows = [dict(S=s, sparsity=sp, granularity=gr, speedup_fwd=2.0, speedup_bwd=2.0)
            for s in (128, 512, 4096) for sp in (0.0, 0.5, 0.9) for gr in ("token", "block")]
    path = tmp_path / "sparse_attention-test.json"
    path.write_text(json.dumps({"meta": {"gpu": "test"}, "rows": rows}))
    return str(path)

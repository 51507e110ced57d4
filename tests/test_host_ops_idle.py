"""benchmarks/host_ops.idle_sites: the device's idle gaps, each charged to the code whose launch ended it (a
synthetic profiler event list: the attribution is bookkeeping over events, the same on any machine)."""

import os
import sys

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.host_ops import _repo_frame, idle_sites  # noqa: E402

OURS = os.path.join(ROOT, "megatron_dsv", "attention", "core_attention.py")
TORCH = "/usr/lib/python3/site-packages/torch/nn/functional.py"


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def _cpu(eid, start, end, stack=(), parent=None, thread=1, name=None):
    e = FunctionEvent(id=eid, name=name or f"aten::op{eid}", thread=thread, start_us=start, end_us=end, stack=list(stack))
    e.cpu_parent = parent
    return e


def _kernel(eid, start, end, launch_id):
    """A kernel linked to its launch as torch 2.13 does (linked_correlation_id); torch 2.11 gives the kernel the
    launch's id instead (tested below)."""
    return FunctionEvent(id=eid, name=f"k{eid}", thread=0, start_us=start, end_us=end, device_type=DeviceType.CUDA,
                         linked_correlation_id=launch_id)


def test_repo_frame_takes_the_innermost_frame_of_this_repository():
    assert _repo_frame([f"{TORCH}(10): linear", f"{OURS}(300): _estimate", f"{OURS}(280): _attend"]) \
        == "megatron_dsv.attention.core_attention:_estimate"
    assert _repo_frame([f"{TORCH}(10): linear"]) is None and _repo_frame(None) is None
    # torch 2.11 writes paths under their sys.path entry
    assert _repo_frame(["torch/nn/modules/module.py(1783): _call_impl", "megatron_dsv/ops/dense.py(40): dense_attention"]) \
        == "megatron_dsv.ops.dense:dense_attention"


def test_idle_gaps_are_charged_to_the_launch_that_ended_them():
    op = _cpu(1, 0.0, 100.0, stack=[f"{TORCH}(1): f", f"{OURS}(300): _estimate"])
    launch_a = _cpu(11, 5.0, 6.0, parent=op, name="cudaLaunchKernel")     # inside the op: charged through its parent's stack
    loose = _cpu(2, 150.0, 160.0, stack=[f"{OURS}(400): decide"])
    launch_b = _cpu(12, 170.0, 171.0, name="cuLaunchKernelEx")          # outside any op (a Triton launch): the latest op with a stack
    launch_c = _cpu(13, 200.0, 201.0, parent=op, name="cudaLaunchKernel")
    events = [op, launch_a, loose, launch_b, launch_c,
              _kernel(101, 10.0, 50.0, 11),      # busy 10-50
              _kernel(102, 40.0, 60.0, 11),      # overlaps: busy to 60
              _kernel(103, 190.0, 200.0, 12),    # gap 60 -> 190: 130 us, ended by launch_b
              _kernel(104, 205.0, 210.0, 13),    # gap 200 -> 205, ended by launch_c: its parent op's frame
              _kernel(105, 230.0, 240.0, 99)]    # gap 20 us, no launch event known
    got = idle_sites(_Prof(events), n_steps=2, min_gap_us=2.0)
    assert got["busy_ms"] == pytest.approx((50 + 10 + 5 + 10) / 2 / 1e3)
    assert got["idle_ms"] == pytest.approx((130 + 5 + 20) / 2 / 1e3)
    sites = {s["fn"]: s for s in got["sites"]}
    assert sites["megatron_dsv.attention.core_attention:decide (after)"]["ms"] == pytest.approx(130 / 2 / 1e3)
    assert sites["megatron_dsv.attention.core_attention:_estimate"]["ms"] == pytest.approx(5 / 2 / 1e3)
    assert sites["<no launch event>"]["ms"] == pytest.approx(20 / 2 / 1e3)
    assert [s["fn"] for s in got["sites"]][0].endswith("decide (after)")  # largest first
    small = idle_sites(_Prof(events), n_steps=2, min_gap_us=10.0)  # the 5 us gap: idle, not charged
    assert small["idle_ms"] == got["idle_ms"] and "megatron_dsv.attention.core_attention:_estimate" not in \
        {s["fn"] for s in small["sites"]}
    assert sum(s["gaps"] for s in got["sites"]) == pytest.approx(1.5)  # 3 charged gaps over 2 steps


def test_a_kernel_carrying_its_launch_id_is_charged_as_well():
    """torch 2.11: no linked_correlation_id, the kernel's id is its launch's; an op of the same id (another
    counter) is not taken for the launch."""
    op = _cpu(7, 0.0, 50.0, stack=[f"{OURS}(300): _estimate"])
    same_id_op = _cpu(2, 0.0, 1.0, stack=[f"{OURS}(100): decide"])
    launch = _cpu(7, 20.0, 21.0, parent=op, name="cudaLaunchKernel")
    k1 = FunctionEvent(id=5, name="k1", thread=0, start_us=0.0, end_us=10.0, device_type=DeviceType.CUDA)
    k2 = FunctionEvent(id=7, name="k2", thread=0, start_us=30.0, end_us=40.0, device_type=DeviceType.CUDA)
    got = idle_sites(_Prof([op, same_id_op, launch, k1, k2]), n_steps=1)
    assert [s["fn"] for s in got["sites"]] == ["megatron_dsv.attention.core_attention:_estimate"]


def test_no_device_events_is_no_idle():
    assert idle_sites(_Prof([_cpu(1, 0.0, 1.0)]), n_steps=1) == dict(idle_ms=0.0, busy_ms=0.0, sites=[])

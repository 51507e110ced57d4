#!/usr/bin/env python
"""What a training step asks of the host: the torch ops, the Triton launches and the host syncs of one step per
kind (full attention; DSV stage 2 plain, predictor-training and profile steps; stage 1), and which code asks.

A short DSV step on the GPU is host-bound (frontier run 4, H200, 4 layers x 8 heads x 64: the stage-2 step at 32K
took 64 ms of wall-clock for 49 ms of device time, at 16K 75 ms against full attention's 32 ms): every op costs
the host a dispatch and a launch, and every sync drains the queue so that the host time after it cannot overlap
the device. The counts are properties of the code, the same on a CPU as on a GPU where the code path is the same:

    TRITON_INTERPRET=1 python benchmarks/host_ops.py             # the GPU's code path (Triton kernels) on a CPU
    python benchmarks/host_ops.py --frames 4 --res 128 --json out.json
    python benchmarks/host_ops.py --frames 16 32 --res 256 --time   # GPU: also where each step's wall-clock goes

``--time`` (a GPU): per step kind and length, the wall-clock of a step (median, synced around each, as a
training loop whose step end reads its scalars), the device's busy time in it (kernels, from torch.profiler),
the host's own time (cProfile, the time spent waiting in syncs taken out), the sync sites (torch's sync debug
mode, file:line) and the host functions taking the most own time. A step whose host time exceeds its device
time is host-bound: what to cut is in the last list.

Per step kind it prints the totals and the callers issuing the most ops (the innermost frame of this repository,
``module:function``: megatron_dsv or benchmarks). ``scalar reads`` are ``Tensor.item()`` calls and tensors'
conversions to Python numbers (``aten::_local_scalar_dense``): on a GPU they sync when their tensor lives on the
device, which a CPU cannot tell apart (DSV keeps its per-step scalars in host mirrors). ``syncs`` counts what does
sync on a GPU: scalar reads and data-dependent-size ops (``nonzero``, ``unique``, ``masked_select``) of device
tensors, and device-to-host copies (on a CPU: none). Caveats: on CUDA the backward runs in autograd's threads,
without a Python stack, so its ops show as ``<torch>``; under the Triton interpreter the interpreter's own tensor
work is not counted (a launch is one launch, as on a GPU); a profile step's new budgets are decided on the next
step (counted here on the profile step kind, whose uncounted warm-up step is a profile step too).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import force, schedule_step, train_setup  # noqa: E402
from benchmarks.common import collect_meta, flow_matching_step, head_sparsity, init_dist  # noqa: E402
from megatron_dsv.attention import dsv_layers, dsv_on_step_end  # noqa: E402

SYNC_OPS = ("nonzero", "unique", "masked_select", "_unique2", "unique_consecutive")
COPY_OPS = ("_to_copy", "copy_")
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"stage2_plain": (2, False, False), "stage2_predictor": (2, True, False),  # (stage, train, profile)
         "stage2_profile": (2, True, True), "stage1": (1, True, False)}


def caller() -> str:
    """``module:function`` of the innermost frame of this repository outside this file (torch's frames
    skipped), else ``<torch>``."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PKG) and "site-packages" not in path and not path.endswith("host_ops.py"):
            rel = os.path.relpath(path, _PKG)[:-3].replace(os.sep, ".")
            return f"{rel}:{frame.name}"
    return "<torch>"


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _syncs(name: str, args, kwargs) -> bool:
    """Whether this op syncs the host with a GPU stream (see the module docstring)."""
    first = args[0] if args else None
    if name == "_local_scalar_dense" or name in SYNC_OPS:
        return _on_device(first)
    if name == "_to_copy":  # device -> host
        dev = kwargs.get("device")
        return _on_device(first) and dev is not None and torch.device(dev).type == "cpu"
    if name == "copy_":  # host destination, device source, blocking
        return (len(args) > 1 and isinstance(first, torch.Tensor) and first.device.type == "cpu"
                and _on_device(args[1]) and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
    return False


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (``ops``), the scalar reads (``reads``) and the GPU syncs (``syncs``),
    each by caller."""

    def __init__(self):
        super().__init__()
        self.ops, self.reads, self.syncs = collections.Counter(), collections.Counter(), collections.Counter()
        self.op_names = collections.Counter()

    supports_higher_order_operators = True  # compiled FlexAttention (the sparse backend "auto" picks on a GPU)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):  # one op, run as it would run without the counter
            from torch.utils._python_dispatch import _disable_current_modes

            self.ops[caller()] += 1
            self.op_names[func.name()] += 1
            with _disable_current_modes():
                return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        where = caller()
        self.ops[where] += 1
        self.op_names[name] += 1
        if name == "_local_scalar_dense":
            self.reads[where] += 1
        if _syncs(name, args, kwargs):
            self.syncs[f"{where} ({name})"] += 1
        return func(*args, **kwargs)


class LaunchCounter:
    """Counts Triton kernel launches by kernel name while active: compiled (``JITFunction.run``) and
    interpreted ones (``InterpretedFunction.run``, whose own tensor work the op counter does not see)."""

    def __init__(self):
        self.launches = collections.Counter()
        self._patched = []

    def __enter__(self):
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: nothing launches
            return self
        from torch.utils._python_dispatch import _disable_current_modes

        counter = self.launches
        for cls in (JITFunction, InterpretedFunction):
            orig = cls.run

            def run(fn, *args, _orig=orig, **kwargs):
                counter[getattr(getattr(fn, "fn", fn), "__name__", "kernel")] += 1
                with _disable_current_modes():
                    return _orig(fn, *args, **kwargs)
            self._patched.append((cls, orig))
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, orig in self._patched:
            cls.run = orig
        self._patched.clear()
        return False


def count_step(fn) -> dict:
    """The ops, syncs and Triton launches of one call of ``fn`` (after one uncounted call: lazy set-up and
    first-call caches, such as the dispatcher's decisions after the state was forced, are not the steady
    step)."""
    fn()
    with LaunchCounter() as lc, OpCounter() as oc:
        fn()
    return dict(ops=sum(oc.ops.values()), reads=sum(oc.reads.values()), syncs=sum(oc.syncs.values()),
                launches=sum(lc.launches.values()), ops_by_caller=dict(oc.ops.most_common()),
                reads_by_caller=dict(oc.reads.most_common()), syncs_by_caller=dict(oc.syncs.most_common()),
                launches_by_kernel=dict(lc.launches.most_common()), ops_by_name=dict(oc.op_names.most_common()))


def step_kinds(args, frames: int, device, dtype) -> dict:
    """{kind: counts} for full attention and DSV's step kinds, at the given shape."""
    out = {}
    for arm in ("full", "dsv"):
        model, cfg, dsv, opt, g, latents, labels = train_setup("full" if arm == "full" else "dsv_stage2", args,
                                                               frames, args.res, device, dtype)
        if arm == "full":
            out["full"] = count_step(lambda: flow_matching_step(model, opt, latents, labels, g))
            continue
        sparsity = head_sparsity(cfg.heads, args.sparsity_min, args.sparsity_max, args.sparsity_mean)
        for kind, (stage, train, profile) in KINDS.items():
            at = schedule_step(dsv, stage, train, profile)
            force(model, stage, sparsity if stage == 2 else None, at, train, profile)

            def one(at=at):  # the step, then numbered `at` again: the next step is of the same kind
                flow_matching_step(model, opt, latents, labels, g)
                dsv_on_step_end(model, at)
            out[kind] = count_step(one)
            out[kind]["sparse_layers"] = sum(int(layer.last_sparse) for layer in dsv_layers(model))
    return out


_WAITS = ("synchronize", "'item' of", "'cpu' of", "'tolist' of", "_local_scalar_dense", "'to' of")


def time_step(fn, reps: int, top: int) -> dict:
    """GPU only: ``fn``'s wall-clock (median ms of ``reps`` calls, the device synced around each), its device
    busy time (ms of kernels a call, torch.profiler), its sync sites (file:line: count, from
    ``torch.cuda.set_sync_debug_mode``) and its host side (:func:`host_profile`)."""
    import warnings

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import median_ms

    for _ in range(2):
        fn()
    wall = median_ms(fn, reps)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, **(stack_config() if cuda else {})) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / reps / 1e3
    idle = idle_sites(prof, reps, top) if cuda else None
    sites = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename, _PKG) if w.filename.startswith(_PKG) else w.filename}:{w.lineno}"] += 1
    return dict(ms_wall=wall, ms_device=device_ms, sync_sites=dict(sites.most_common()), idle=idle,
                **host_profile(fn, reps, top))


def _repo_frame(stack) -> Optional[str]:
    """The innermost frame of this repository in a profiler stack (``path(line): function`` entries, innermost
    first), as ``module:function``; None when no frame is ours."""
    for entry in stack or ():
        path, _, rest = entry.partition("(")
        if "site-packages" in path or path.endswith("host_ops.py"):
            continue
        # the profiler writes a path under its sys.path entry ("megatron_dsv/attention/x.py") or a full one
        rel = os.path.relpath(os.path.abspath(path), _PKG) if os.path.isabs(path) else os.path.normpath(path)
        if rel.split(os.sep)[0] in ("megatron_dsv", "benchmarks") and rel.endswith(".py"):
            return f"{rel[:-3].replace(os.sep, '.')}:{rest.partition(': ')[2] or rest}"
    return None


def stack_config() -> dict:
    """torch.profiler keyword arguments that give its ops their Python stacks (``with_stack``; torch 2.11 fills
    the stacks only with the experimental verbose config)."""
    kwargs = dict(with_stack=True)
    try:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(verbose=True)
    except (AttributeError, TypeError):  # another torch: with_stack alone
        pass
    return kwargs


def idle_sites(prof, n_steps: int, top: int = 15, min_gap_us: float = 2.0) -> dict:
    """Where the device waits for the host, from a torch.profiler run (``with_stack=True``) of ``n_steps`` steps.

    The device's timeline (kernels, copies and sets, merged) has gaps; each gap of more than ``min_gap_us`` is
    charged to the code that launched the work ending it: the kernel's launch (its CUDA runtime event, by
    correlation id), then up its enclosing CPU ops to the first with a Python stack (else the latest op with one
    that began before it on the launching thread: a Triton kernel launched outside any torch op), and there the
    innermost frame of this repository. A gap charged to a frame means the device idled until that code's launch
    came: the host's work before it, up to the previous launch, is what to cut. ``idle_ms`` is the step's idle time
    between its first and last kernel; ``busy_ms`` the device's busy time (ms a step). The profiler slows the
    host: read the shares."""
    import bisect

    from torch.autograd import DeviceType

    events = list(prof.events())
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not device:
        return dict(idle_ms=0.0, busy_ms=0.0, sites=[])
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # the launches (CUDA runtime and driver calls) by correlation id: a kernel's linked_correlation_id (torch
    # 2.13), or its own id, which is the same number (torch 2.11); ops' ids are another counter, left out
    by_id = {e.id: e for e in cpu if e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn")}
    with_stack: Dict[int, list] = collections.defaultdict(list)  # thread -> [(start, frame)] of ops with our frame
    for e in cpu:
        frame = _repo_frame(e.stack)
        if frame is not None:
            with_stack[e.thread].append((e.time_range.start, frame))
    for rows in with_stack.values():
        rows.sort()

    def site(kernel) -> str:
        launch = by_id.get(getattr(kernel, "linked_correlation_id", 0) or kernel.id)
        if launch is None:
            return "<no launch event>"
        node = launch
        while node is not None:
            frame = _repo_frame(node.stack)
            if frame is not None:
                return frame
            node = node.cpu_parent
        rows = with_stack.get(launch.thread, [])
        i = bisect.bisect_right(rows, (launch.time_range.start, "\uffff")) - 1
        return f"{rows[i][1]} (after)" if i >= 0 else "<torch>"

    charged: Dict[str, float] = collections.Counter()
    counts: Dict[str, int] = collections.Counter()
    busy = idle = 0.0
    start, end = device[0].time_range.start, device[0].time_range.end
    busy_from = start
    for e in device[1:]:
        s, t = e.time_range.start, e.time_range.end
        if s > end:
            busy += end - busy_from
            if s - end > min_gap_us:
                where = site(e)
                charged[where] += s - end
                counts[where] += 1
            idle += s - end
            busy_from = s
        end = max(end, t)
    busy += end - busy_from
    rows = sorted(charged.items(), key=lambda kv: -kv[1])[:top]
    return dict(idle_ms=idle / n_steps / 1e3, busy_ms=busy / n_steps / 1e3,
                sites=[dict(fn=k, ms=v / n_steps / 1e3, gaps=counts[k] / n_steps) for k, v in rows])


def print_idle(label: str, got: dict, tag: str = "[idle]") -> None:
    """:func:`idle_sites`' result as lines starting with ``tag``."""
    print(f"{tag} {label}: the device idled {got['idle_ms']:.1f} ms a step between its kernels (busy "
          f"{got['busy_ms']:.1f} ms), under the profiler; the gaps by the code whose launch ended them:", flush=True)
    for e in got["sites"]:
        print(f"{tag}   {e['ms']:8.3f} ms  x{e['gaps']:6.1f}  {e['fn'][:110]}", flush=True)


def host_profile(fn, reps: int, top: int) -> dict:
    """The host's side of ``reps`` calls of ``fn`` under cProfile (the device synced around them, on a GPU): its
    own time outside syncs (``ms_host``; the calls in ``_WAITS`` count as waiting, ``ms_waiting``, which includes
    their own small host work), the ``top`` functions by own time (``host_top``) and this repository's functions
    by cumulative time, their callees included (``host_cumulative_ours``), in ms a call."""
    import cProfile
    import pstats

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    pr = cProfile.Profile()
    sync()
    pr.enable()
    for _ in range(reps):
        fn()
    sync()
    pr.disable()
    stats = pstats.Stats(pr).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}

    def label(key):
        file, line, name = key
        return name if file == "~" else f"{os.path.relpath(file, _PKG) if file.startswith(_PKG) else os.path.basename(file)}:{line}({name})"
    total = sum(v[2] for v in stats.values())
    waiting = sum(v[2] for k, v in stats.items() if any(w in label(k) for w in _WAITS))
    own = sorted(((label(k), v[2], v[1]) for k, v in stats.items()), key=lambda x: -x[1])[:top]
    # this repository's functions by cumulative time (their callees included): which of our calls cost the host
    ours = sorted(((label(k), v[3], v[1]) for k, v in stats.items()
                   if k[0].startswith(os.path.join(_PKG, "megatron_dsv"))), key=lambda x: -x[1])[:top]
    return dict(ms_host=1e3 * (total - waiting) / reps, ms_waiting=1e3 * waiting / reps,
                host_top=[dict(fn=f, ms=1e3 * t / reps, calls=n / reps) for f, t, n in own],
                host_cumulative_ours=[dict(fn=f, ms=1e3 * t / reps, calls=n / reps) for f, t, n in ours])


def time_kinds(args, device, dtype, frames: int) -> dict:
    """{kind: time_step(...)} at ``frames`` latent frames, for the same step kinds as :func:`step_kinds`."""
    out = {}
    for arm in ("full", "dsv"):
        model, cfg, dsv, opt, g, latents, labels = train_setup("full" if arm == "full" else "dsv_stage2", args,
                                                               frames, args.res, device, dtype)
        if arm == "full":
            out["full"] = time_step(lambda: flow_matching_step(model, opt, latents, labels, g), args.reps, args.top)
            del model, opt
            continue
        sparsity = head_sparsity(cfg.heads, args.sparsity_min, args.sparsity_max, args.sparsity_mean)
        for kind, (stage, train, profile) in KINDS.items():
            at = schedule_step(dsv, stage, train, profile)
            force(model, stage, sparsity if stage == 2 else None, at, train, profile)

            def one(at=at):
                flow_matching_step(model, opt, latents, labels, g)
                dsv_on_step_end(model, at)
            out[kind] = time_step(one, args.reps, args.top)
            out[kind]["sparse_layers"] = sum(int(layer.last_sparse) for layer in dsv_layers(model))
        del model, opt
        torch.cuda.empty_cache()
    return out


def print_times(S: int, result: dict) -> None:
    print(f"\nS={S}: {'step kind':18s} {'wall ms':>8s} {'device':>8s} {'host':>8s} {'waiting':>8s} {'syncs':>6s}")
    for kind, r in result.items():
        print(f"S={S}: {kind:18s} {r['ms_wall']:8.1f} {r['ms_device']:8.1f} {r['ms_host']:8.1f} {r['ms_waiting']:8.1f} "
              f"{sum(r['sync_sites'].values()):6d}" + (f"   ({r['sparse_layers']} sparse layers)" if "sparse_layers" in r else ""))
    for kind, r in result.items():
        print(f"S={S} {kind}: sync sites {r['sync_sites']}")
        if r.get("idle"):
            print_idle(f"S={S} {kind}", r["idle"], tag=f"S={S} {kind}:")
        for key, what in (("host_top", "host functions by own time"),
                          ("host_cumulative_ours", "megatron_dsv functions by cumulative time")):
            print(f"S={S} {kind}: {what} (ms a step, calls a step):")
            for row in r[key]:
                print(f"    {row['ms']:7.2f} ms {row['calls']:7.1f}  {row['fn'][:120]}")


def print_table(result: dict, top: int) -> None:
    full = result["full"]["ops"]
    print(f"{'step kind':18s} {'ops':>7s} {'vs full':>8s} {'reads':>6s} {'syncs':>6s} {'triton':>7s}")
    for kind, r in result.items():
        print(f"{kind:18s} {r['ops']:7d} {r['ops'] - full:+8d} {r['reads']:6d} {r['syncs']:6d} {r['launches']:7d}"
              + (f"   ({r['sparse_layers']} sparse layers)" if "sparse_layers" in r else ""))
    for kind, r in result.items():
        if kind == "full":
            continue
        print(f"\n{kind}: callers by ops (top {top})")
        for where, n in list(r["ops_by_caller"].items())[:top]:
            print(f"  {n:6d}  {where}")
        for what in ("reads", "syncs"):
            if r[f"{what}_by_caller"]:
                print(f"{kind}: {'scalar reads' if what == 'reads' else 'GPU syncs'}")
                for where, n in r[f"{what}_by_caller"].items():
                    print(f"  {n:6d}  {where}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.8b")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--frames", type=int, nargs="+", default=[4],
                    help="latent frames (tokens: frames x (res / 8)^2); several: one count (and timing) each")
    ap.add_argument("--res", type=int, default=128)
    ap.add_argument("--granularity", default="block", choices=("block", "token"))
    ap.add_argument("--local-radius", type=int, nargs=3, default=None)
    ap.add_argument("--sparsity-min", type=float, default=0.74)
    ap.add_argument("--sparsity-max", type=float, default=0.9)
    ap.add_argument("--sparsity-mean", type=float, default=0.82)
    ap.add_argument("--speedup-table", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=15, help="callers listed per step kind")
    ap.add_argument("--json", default=None, help="write the counts (and times) here")
    ap.add_argument("--time", action="store_true", help="GPU: also time each step kind (see the module docstring)")
    ap.add_argument("--reps", type=int, default=10, help="steps per timing (--time)")
    ap.add_argument("--no-count", action="store_true", help="with --time: time only (no op counts)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.no_count and not args.time:
        ap.error("--no-count needs --time (nothing else to do)")
    if args.time and device.type != "cuda":
        ap.error("--time needs a GPU (it times kernels and host syncs)")
    init_dist()
    counts, times = {}, {}
    for frames in args.frames:
        S = frames * (args.res // 8) ** 2
        if not args.no_count:
            counts[S] = step_kinds(args, frames, device, dtype)
            print(f"\nS={S}")
            print_table(counts[S], args.top)
        if args.time:
            times[S] = time_kinds(args, device, dtype, frames)
            print_times(S, times[S])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=collect_meta(), args=vars(args), device=str(device), steps=counts, times=times), f,
                      indent=1)


if __name__ == "__main__":
    main()

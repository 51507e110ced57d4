"""Shared benchmark plumbing: the results-file format of DESIGN.md section 6.

Every benchmark writes ``benchmarks/results/<bench>-<gpu>-<yyyymmdd>.json`` as
``{"meta": {...}, "rows": [...]}`` where meta names the hardware, versions,
date and commit, and every row carries the same-run dense figure.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["collect_meta", "gpu_slug", "write_results", "bench_ms", "dense_fwd_bwd_ms", "init_dist", "sync",
           "flow_matching_step", "MainWeightsAdamW"]


def _git_commit() -> str:
    env = os.environ.get("DSV_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


def _git_tree(root: Optional[str] = None) -> Optional[str]:
    """The git tree hash of the working tree as it is (tracked and untracked, ignored files left out),
    written through a throw-away index: equal to ``git rev-parse <commit>^{tree}`` of the commit that
    holds exactly this code, even where ``HEAD`` is stale or the tree is dirty (a copied checkout)."""
    import tempfile

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            subprocess.run(["git", "add", "-A", "."], cwd=root, env=env, check=True, capture_output=True, timeout=60)
            return subprocess.check_output(["git", "write-tree"], cwd=root, env=env, stderr=subprocess.DEVNULL,
                                           text=True, timeout=60).strip()
    except Exception:
        return None


def collect_meta() -> Dict[str, object]:
    """Hardware, versions, date and commit of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:
        mcore = None
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "megatron_core": mcore,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "tree": _git_tree(),  # find the commit: git log --format='%H %T' | grep <tree>
    }


def gpu_slug(meta: Dict[str, object]) -> str:
    """'NVIDIA H200' -> 'h200'."""
    name = str(meta["gpu"]).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu"


def write_results(bench: str, rows: List[Dict[str, object]], out_dir: Optional[str] = None,
                  meta: Optional[Dict[str, object]] = None) -> Path:
    """Write ``<out_dir>/<bench>-<gpu>-<yyyymmdd>.json`` and return its path.

    ``out_dir`` defaults to ``$DSV_RESULTS_DIR`` or ``benchmarks/results``.
    """
    meta = meta or collect_meta()
    out = Path(out_dir or os.environ.get("DSV_RESULTS_DIR") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().strftime("%Y%m%d")
    path = out / f"{bench}-{gpu_slug(meta)}-{day}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return path


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (CUDA events via triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def dense_fwd_bwd_ms(B: int, H: int, S: int, D: int, dtype=torch.bfloat16, rep: int = 50) -> Dict[str, float]:
    """Same-run dense baseline: cuDNN (through torch SDPA, forced first) fwd and bwd ms."""
    from megatron_dsv.ops.dense import dense_attention

    dev = torch.device("cuda")
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    fwd = bench_ms(lambda: dense_attention(q, k, v), rep=rep)
    o = dense_attention(q, k, v)
    do = torch.randn_like(o)
    bwd = bench_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), rep=rep)
    return {"ms_dense_fwd": fwd, "ms_dense_bwd": bwd, "dense_backend": "cudnn (torch SDPA, priority)"}


def head_sparsity(H: int, lo: float, hi: float, mean: float):
    """H per-head sparsities spread evenly from ``lo`` to ``hi``, shifted so their mean is ``mean``
    (clipped to [lo, hi]): the heterogeneous-head workload of the CP and end-to-end benchmarks."""
    base = [lo + (hi - lo) * i / max(1, H - 1) for i in range(H)]
    shift = mean - sum(base) / H
    return [min(hi, max(lo, s + shift)) for s in base]


def init_dist():
    """A one-process group (NCCL on a GPU, gloo on CPU) and Megatron's parallel state, for benches that
    build Megatron-Core models."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if torch.cuda.is_available():  # the CUDA RNG tracker needs a CUDA build
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def sync():
    """Wait for the device (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall-clock milliseconds of ``reps`` calls of ``fn``, the device synced around each (whole
    training steps, where host work counts too; ``bench_ms`` times kernels by CUDA events)."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def flow_matching_step(model, opt, latents, labels, generator, text=None) -> torch.Tensor:
    """One optimizer step of the flow-matching loss (``text``: a text-conditioned model's embeddings, e.g.
    Wan's), gradients clipped at 1; returns the loss.

    The step reads its gradient norm on the host before the update, as every real trainer's step does (Megatron's
    ``get_grad_norm_fp32`` ends in ``.item()``, ``megatron_dsv.train``'s optimizers return it as a float): one
    stream sync a step, for every arm alike. Without it full attention's clocked steps synced nowhere while
    DSV's synced once at its step end, so the host ran ahead across full attention's steps only."""
    from megatron_dsv.models.video_dit import flow_matching_loss
    from megatron_dsv.training.dsv_hooks import prefetch_step_end

    loss = flow_matching_loss(model, latents, labels, generator=generator, text=text)
    loss.backward()
    prefetch_step_end(model)  # DSV's step end issued before the read below, which covers it (the caller's
    # dsv_on_step_end completes it); nothing without DSV layers
    float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))  # the trainer's read (see above)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


class MainWeightsAdamW:
    """AdamW that keeps fp32 main copies of low-precision (bf16/fp16) parameters, as Megatron's bf16
    optimizers do: the update is applied to the fp32 copy, which is then rounded into the model.

    Updating bf16 parameters in place loses every step smaller than half the bf16 spacing: at lr 3e-4
    a norm gain at 1.0 (spacing 2^-7 above, 2^-8 below) never moves at all. fp32 (and fp64) parameters
    are used directly (no copy). ``groups`` as for ``torch.optim.AdamW`` (a parameter list or dicts
    with ``params``; other keys, such as a schedule's ``lr_mult``, are kept in :attr:`param_groups`).
    :meth:`state_dict` holds the main copies, so a resumed run continues from the exact fp32 weights.
    As with any main-weights optimizer, a low-precision parameter changed outside it keeps the change
    only until its next update (then the main copy, unaware of it, is written back).
    """

    def __init__(self, groups, lr: float, **kwargs):
        groups = list(groups)
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]
        self._pairs = []  # (model parameter, fp32 main parameter), in group order
        main_groups, seen = [], set()
        for group in groups:
            mains = []
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("MainWeightsAdamW: a parameter appears twice in the groups")
                seen.add(id(p))
                low = p.dtype in (torch.bfloat16, torch.float16)  # fp32 and fp64 are their own main weights
                main = p.detach().float().clone().requires_grad_(True) if low else p
                self._pairs.append((p, main))
                mains.append(main)
            main_groups.append(dict(group, params=mains))
        self.optimizer = torch.optim.AdamW(main_groups, lr=lr, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        stepped = [(p, main) for p, main in self._pairs if main is not p and p.grad is not None]
        for p, main in stepped:
            main.grad = p.grad.float()
        self.optimizer.step()
        if stepped:  # a parameter without a gradient is neither updated nor overwritten
            torch._foreach_copy_([p for p, _ in stepped], [main for _, main in stepped])
        for _, main in stepped:
            main.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, main in self._pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "main_params": [main.detach().clone() for p, main in self._pairs if main is not p]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "main_params" not in state or "optimizer" not in state:
            raise ValueError("optimizer state has no fp32 main weights ('main_params'): written by a plain "
                             "AdamW, before MainWeightsAdamW; start the run afresh")
        copies = [(p, main) for p, main in self._pairs if main is not p]
        if len(state["main_params"]) != len(copies):
            raise ValueError(f"optimizer state has {len(state['main_params'])} main weights, the model "
                             f"{len(copies)} low-precision parameters")
        for (p, main), saved in zip(copies, state["main_params"]):
            if saved.shape != main.shape:
                raise ValueError(f"main weight of shape {tuple(saved.shape)} for a parameter of shape "
                                 f"{tuple(main.shape)}")
            main.copy_(saved)
            p.copy_(main)
        self.optimizer.load_state_dict(state["optimizer"])

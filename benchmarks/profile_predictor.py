"""Time the predictors' training (each layer's ``collect`` in the forward plus the step end's
batched ``train_predictors``), the Adam step and the profiler's oracle pass on the GPU, with
torch.profiler tables.

    python benchmarks/profile_predictor.py [--S 16384 --H 12 --D 96 --input qk]

The default shape is the 0.8B preset at 16x64x64 latents (the recall benchmark's). Run it alone:
another process on the host's CPUs (a build, say) inflates the launch-bound figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_dsv.attention.predictor import LowRankPredictor, adam_step_many, train_predictors  # noqa: E402
from megatron_dsv.attention.schedule import sampled_queries  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402


def _ms(fn, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=16384)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--D", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=28, help="predictors in the multi-tensor Adam step")
    ap.add_argument("--input", choices=("qk", "hidden"), default="qk")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cfg = DSVConfig(predictor_input=a.input)
    preds = [LowRankPredictor(cfg, a.H, a.D, a.hidden, n + 1).cuda() for n in range(a.layers)]
    q = torch.randn(1, a.H, a.S, a.D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, a.H, a.S, a.D, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(a.S, 1, a.hidden, device="cuda", dtype=torch.bfloat16) if a.input == "hidden" else None
    qi = sampled_queries(a.S, cfg.predictor_query_stride, 3, "cuda")
    collect = lambda: preds[0].collect(q, k, hidden, qi)  # noqa: E731

    def train_all():  # one step's predictor work: every layer collects, then the batched pass
        for p in preds:
            p.collect(q, k, hidden, qi)
        train_predictors(preds)

    for _ in range(3):
        train_all()
    ms_collect = _ms(lambda: (collect(), preds[0]._stash.clear()), 20)
    print(f"collect: {ms_collect:.3f} ms per layer per step (S={a.S}, H={a.H}, D={a.D}, "
          f"{qi.numel()} sampled rows, {a.input})")
    ms_all = _ms(train_all, 20)
    print(f"collect x {a.layers} layers + train_predictors: {ms_all:.3f} ms per step "
          f"(batched pass ~{ms_all - a.layers * ms_collect:.3f} ms)")
    for p in preds:
        p.grad_count.fill_(1.0)
    adam = lambda: adam_step_many(preds, [1e-4] * len(preds), [1.0] * len(preds))  # noqa: E731
    adam()  # the first call loads the kernels
    print(f"adam_step_many over {a.layers} layers: {_ms(adam, 20):.3f} ms per step")
    step = train_all

    _table(step)
    # the profile step's extra work per layer: the projections, the lists and one oracle pass
    # (sparsity + recall curve + recall of the built lists), as DSVCoreAttention._profile runs it
    from megatron_dsv.ops.topk_estimation import estimate_topk
    from megatron_dsv.attention.profiler import profile_stats

    lib = DSVConfig()
    q_lr, k_lr = preds[0].project(q, k, hidden, dtype=q.dtype)
    budgets = torch.full((a.H,), max(1, a.S // 10 // (lib.block_size or 1)), dtype=torch.int64)  # items, 90% sparse
    lists = estimate_topk(q_lr, k_lr, budgets, lib.group_size, lib.block_size)
    curve = dict(q_lr=q_lr, k_lr=k_lr, group_size=lib.group_size, block_size=lib.block_size)
    prof_step = lambda: profile_stats(q, k, lib.theta, a.D ** -0.5, qi, curve=curve,  # noqa: E731
                                      lists=(lists[0], lists[1], lib.group_size, lib.block_size))
    prof_step()
    print(f"profile_stats (one oracle pass, curve + list recall, block {lib.block_size}, G {lib.group_size}): "
          f"{_ms(prof_step, 5):.3f} ms per layer per profiled step")
    _table(prof_step)


def _table(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()

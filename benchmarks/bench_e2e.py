"""End-to-end training step of the video DiT: full attention vs DSV stage 2, DSV stage 1 and a 3D window.

One model shape (``--preset``, with ``--layers`` of its layers to fit device time; per-layer figures
let the full depth be computed), one sequence length per video (``--frames`` x ``--res``: tokens =
frames * (res / 8)^2), the same synthetic inputs, batch 1, AdamW on fp32 main weights, bf16 on a GPU. Arms:

* ``full``: ``DenseCoreAttention`` (torch SDPA, cuDNN first: the fastest dense attention measured here);
* ``dsv_stage2``: DSV with the library defaults in stage 2, per-head budgets forced to a profile
  (``--budget-source``: ``spread`` = sparsities spread evenly over ``--sparsity-min .. --sparsity-max``
  around ``--sparsity-mean``, labelled as such; the study's checkpoints are not real-profile sources
  yet, since no trained model here runs sparse);
* ``dsv_stage1``: DSV in stage 1 (the library's: the (2, 2, 1) window where ``stage1_local_radius`` auto applies,
  else dense attention; + predictor statistics every step + profiles);
* ``window``: the fixed 3D local window (``models/window_attention.py``) at the stage-2 kept fraction.

DSV arms use key-block lists unless ``--granularity token`` (rows carry ``granularity``).

A step = zero grads, forward, flow-matching loss, backward, optimizer step, ``dsv_on_step_end``. The
DSV steps differ by what the schedule asks (predictor training every ``predictor_train_interval`` steps,
profiles every ``profile_interval`` in warm-up and ``profile_interval_after_warmup`` after): each kind
(plain / predictor / profile) is timed (median of ``--reps``), then weighted by its frequency into the
amortised ``ms_step`` (stage 1: at the warm-up profile period; ``ms_step_after_warmup`` weights the same
kinds at ``profile_interval_after_warmup``). Breakdown (stacked bars): attention fwd+bwd and selection from isolated
measurements at the same shapes x layers, predictor and profiler from the step kinds' differences,
"linear and rest" the remainder. Peak memory: ``torch.cuda.max_memory_allocated`` over the arm's training
steps (``peak_mem_gb``), and per step kind (``peak_mem_gb_plain`` / ``_train`` / ``_profile``).
MFU: performed FLOPs (linear 6 x layer parameters x tokens, attention 4 S^2 hidden x 3.5 x kept fraction)
over time, against ``--peak-tflops`` (H200 bf16 dense: 989).

    PYTHONPATH=. python benchmarks/bench_e2e.py --preset 2.7b --layers 2 --frames 16 32 64 128 --res 256
    PYTHONPATH=. python benchmarks/bench_e2e.py --quick        # CPU check: tiny model, 256 tokens
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (MainWeightsAdamW, flow_matching_step, head_sparsity, init_dist, median_ms,  # noqa: E402
                               write_results)
from megatron_dsv.attention import dsv_layers, dsv_on_step_end  # noqa: E402
from megatron_dsv.attention.schedule import is_profile_step, trains_predictor  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402

ARMS = ("full", "dsv_stage2", "dsv_stage1", "window")
PARTS = ("attention", "selection", "predictor", "profiler", "linear_rest")


def build(arm: str, args, frames: int, res: int, device, dtype):
    """``(model, cfg, dsv_config)`` of one arm (same seed: same weights where shapes agree)."""
    from megatron_dsv.models.dit_config import VideoDiTConfig
    from megatron_dsv.models.video_dit import build_video_dit

    over = dict(layers=args.layers, latent_frames=frames, latent_height=res // 4, latent_width=res // 4, num_classes=8)
    if args.heads:  # a narrower layer than the preset's: hidden = heads x head dim (as benchmarks/video_runs.py)
        over.update(heads=args.heads, head_dim=args.head_dim, hidden=args.heads * args.head_dim)
    cfg = VideoDiTConfig.from_preset(args.preset, **over)
    table = args.speedup_table if device.type == "cuda" else None
    local = None if args.local_radius is None else tuple(args.local_radius)
    dsv = (DSVConfig(speedup_table=table, granularity=args.granularity, local_radius=local)
           if arm.startswith("dsv") else None)
    kwargs = {}
    if arm == "window":
        from megatron_dsv.models.window_attention import WindowConfig, radius_for_fraction

        cube = DSVConfig().query_group_shape
        kept = 1.0 - args.sparsity_mean
        kwargs["window_config"] = WindowConfig(cube=cube, radius=radius_for_fraction(cfg.token_grid(), cube, kept),
                                               block_size=DSVConfig().kv_block_size)
    torch.manual_seed(args.seed)
    model = build_video_dit(cfg, dsv_config=dsv, dtype=dtype, **kwargs).to(device)
    return model, cfg, dsv


def force(model, stage: int, sparsity, step: int, train: bool, profile: bool) -> None:
    """Put every DSV layer in ``stage`` with per-head ``sparsity`` (budget density 1 - s) at schedule
    position ``step``, and switch its predictor training and profiling on or off."""
    for layer in dsv_layers(model):
        layer.stage.fill_(stage)
        layer.step.fill_(step)
        if sparsity is not None:
            s = torch.tensor(sparsity, dtype=torch.float32)
            layer.sparsity.copy_(s)
            layer.budget_density.copy_(1.0 - s)
            layer.profiles.fill_(max(1, int(layer.profiles[0])))
        layer.predictor_training, layer.profiling = train, profile
        layer._sync_host()


def schedule_step(cfg: DSVConfig, stage: int, train: bool, profile: bool) -> int:
    """A step counter at which the schedule trains the predictor iff ``train`` and profiles iff ``profile``
    (in stage 1 inside warm-up, in stage 2 after it)."""
    start = 1 if stage == 1 else cfg.profile_warmup_steps + 1
    for step in range(start - 1 if profile else start, start + 100_000):
        if is_profile_step(step, cfg) == profile and (trains_predictor(step, stage, cfg) or not train):
            return step
    raise ValueError(f"no step of the schedule trains={train} and profiles={profile}")


def train_setup(arm: str, args, frames: int, res: int, device, dtype):
    """``(model, cfg, dsv, opt, g, latents, labels)``: an arm's model in training mode, its optimizer and one
    fixed batch of random latents (the generator ``g`` seeded at 0)."""
    model, cfg, dsv = build(arm, args, frames, res, device, dtype)
    model.train()
    opt = MainWeightsAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(1, cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width,
                          generator=g, device=device).to(dtype)
    labels = torch.zeros(1, dtype=torch.long, device=device)
    return model, cfg, dsv, opt, g, latents, labels


def run_arm(arm: str, args, frames: int, res: int, device, dtype) -> dict:
    model, cfg, dsv, opt, g, latents, labels = train_setup(arm, args, frames, res, device, dtype)
    S = frames * (res // 8) ** 2
    stage = 2 if arm == "dsv_stage2" else 1
    sparsity = head_sparsity(cfg.heads, args.sparsity_min, args.sparsity_max, args.sparsity_mean) if stage == 2 else None

    def step_of(train, profile):
        at = schedule_step(dsv, stage, train, profile) if dsv is not None else 0

        def one():
            if dsv is not None:
                force(model, stage, sparsity, at, train, profile)
            flow_matching_step(model, opt, latents, labels, g)
            if dsv is not None:
                dsv_on_step_end(model, at + 1)
        return one

    kinds = {"plain": (False, False)}
    if dsv is not None:
        kinds.update(train=(True, False), profile=(dsv.predictor_train_interval > 0 or stage == 1, True))
    ms, peaks = {}, {}
    for name, (train, profile) in kinds.items():
        fn = step_of(train, profile)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            fn()
        ms[name] = median_ms(fn, args.reps)
        if device.type == "cuda":  # per step kind: which of them sets the peak
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
    out = dict(arm=arm, S=S, frames=frames, res=res, preset=args.preset, layers=args.layers, hidden=cfg.hidden,
               heads=cfg.heads, head_dim=cfg.head_dim, granularity=args.granularity if dsv is not None else None)
    parts = dict.fromkeys(PARTS, 0.0)
    if dsv is None:
        out["ms_step"] = ms["plain"]
    else:
        if stage == 1:  # every step trains; warm-up profiles every profile_interval
            n_prof = dsv.profile_interval
            out["ms_step"] = ms["train"] + (ms["profile"] - ms["train"]) / n_prof
            # the same measured step kinds, weighted as after the profiler's warm-up (a longer period)
            n_after = dsv.profile_interval_after_warmup
            out["ms_step_after_warmup"] = ms["train"] + (ms["profile"] - ms["train"]) / n_after
            parts["predictor"] = ms["train"] - ms["plain"]
        else:
            n_train, n_prof = dsv.predictor_train_interval, dsv.profile_interval_after_warmup
            share = 1.0 / n_train if n_train else 0.0
            out["ms_step"] = ms["plain"] + share * (ms["train"] - ms["plain"]) + (ms["profile"] - ms["train"]) / n_prof
            parts["predictor"] = share * (ms["train"] - ms["plain"])
        parts["profiler"] = (ms["profile"] - ms["train"]) / n_prof
        out.update(ms_plain_step=ms["plain"], ms_predictor_step=ms["train"], ms_profile_step=ms["profile"],
                   profile_every=n_prof)
        layers = dsv_layers(model)
        out["sparse_layers"] = sum(int(layer.last_sparse) for layer in layers)
        out["kept_fraction"] = float(torch.stack([layer.last_k for layer in layers]).mean()) / S
    kept = out.get("kept_fraction", 1.0) if arm != "window" else 1.0 - args.sparsity_mean
    out["sparsity"] = 1.0 - kept if arm in ("dsv_stage2", "window") else 0.0
    out["budget_source"] = (f"spread {args.sparsity_min:.2f}..{args.sparsity_max:.2f}, mean {args.sparsity_mean:.2f} "
                            "(not a trained model's profile)") if stage == 2 and dsv is not None else None
    parts["attention"], parts["selection"] = attention_parts(arm, cfg, S, out, args, device, dtype, dsv)
    parts["linear_rest"] = max(0.0, out["ms_step"] - sum(parts.values()))
    out.update({f"ms_{k}": v for k, v in parts.items()})
    out["ms_per_layer"] = out["ms_step"] / args.layers
    out["tokens_per_s"] = S / (out["ms_step"] / 1e3)
    layer_params = 12 * cfg.hidden ** 2 + 2 * cfg.hidden * (cfg.ffn_hidden - 4 * cfg.hidden)  # qkv, o, mlp, adaLN ~
    flops = args.layers * (6 * layer_params * S + 4 * S * S * cfg.hidden * 3.5 * kept)
    out["mfu"] = flops / (out["ms_step"] / 1e3) / (args.peak_tflops * 1e12)
    out["peak_mem_gb"] = max(peaks.values()) if peaks else None  # the training steps' peak
    out.update({f"peak_mem_gb_{name}": gb for name, gb in peaks.items()})
    return out


def attention_parts(arm, cfg, S, out, args, device, dtype, dsv):
    """(attention fwd+bwd, selection) milliseconds for all layers, measured alone at the arm's shapes."""
    from megatron_dsv.attention import _ops
    from megatron_dsv.ops.dense import dense_attention

    if arm == "window":
        return 0.0, 0.0  # inside "linear and rest": its kernel calls are not separated here
    H, D = cfg.heads, cfg.head_dim
    q, k, v, do = (torch.randn(1, H, S, D, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    sel = 0.0
    if arm == "dsv_stage2" and out.get("sparse_layers"):
        sp = torch.tensor(head_sparsity(H, args.sparsity_min, args.sparsity_max, args.sparsity_mean))
        from megatron_dsv.attention.dispatcher import density_budgets

        from megatron_dsv.attention.neighbourhood import local_item_lists

        radius = dsv.local_radius_for(cfg.token_grid(), _ops.resolve_backends(dsv)[1])
        forced = (None if radius is None else
                  local_item_lists(cfg.token_grid(), dsv.query_group_shape, radius, dsv.block_size, device))
        floor = 0 if forced is None else min(S, forced.shape[1] * max(1, dsv.block_size))
        budgets, _ = density_budgets(1.0 - sp, S, dsv, floor)
        q_lr, k_lr = (torch.randn(1, H, S, dsv.predictor_rank, device=device, dtype=dtype) for _ in range(2))
        backend_topk = _ops.resolve_backends(dsv)[1]

        def select():  # as the layer does: local + predicted lists go to Triton where auto says CUDA
            return _ops.run_estimate_topk(backend_topk, q_lr, k_lr, budgets, dsv.group_size, dsv.block_size,
                                          dsv.group_proxy, dsv.block_score, forced)
        sel = median_ms(select, args.reps)
        idx, cnt = select()
        backend = _ops.resolve_backends(dsv)[0]

        def attn():
            o = _ops.run_sparse_attention(backend, q, k, v, idx, cnt, dsv.group_size, dsv.block_size, D ** -0.5)
            torch.autograd.grad(o, (q, k, v), do)
    else:
        def attn():
            torch.autograd.grad(dense_attention(q, k, v), (q, k, v), do)
    attn()
    return args.layers * median_ms(attn, args.reps), args.layers * sel


def plot(rows, path):
    """Stacked bars of the step's parts per (S, arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    labels = [f"{r['arm']}\n{r['S'] // 1024}K" for r in rows]
    bottom = [0.0] * len(rows)
    for i, part in enumerate(PARTS):
        vals = [max(0.0, r[f"ms_{part}"]) for r in rows]  # a difference of two timings can dip below 0 in noise
        ax.bar(labels, vals, bottom=bottom, label=part, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in enumerate(rows):
        ax.text(x, r["ms_step"], f"{r['speedup_step']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"ms per training step ({rows[0]['preset']}, {rows[0]['layers']} layers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="2.7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--frames", type=int, nargs="+", default=[16, 32, 64, 128],
                    help="frames per video (with --res 256: 16K, 32K, 64K, 128K tokens)")
    ap.add_argument("--res", type=int, nargs="+", default=[256], help="pixel side per frame (tokens per frame = (res / 8)^2)")
    ap.add_argument("--heads", type=int, default=None,
                    help="attention heads instead of the preset's, with --head-dim; hidden = heads x head dim")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim with --heads")
    ap.add_argument("--local-radius", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                    help="DSV arms: local + predicted lists (DSVConfig.local_radius), in query cubes; default: the "
                         "library's auto (1 1 1 on a grid the query cube tiles); 0 0 0: predicted lists alone")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--granularity", default="block", choices=("block", "token"),
                    help="DSV's KV lists (DSVConfig.granularity): 128-key blocks (default) or tokens (the paper's)")
    ap.add_argument("--sparsity-min", type=float, default=0.80)
    ap.add_argument("--sparsity-max", type=float, default=0.98)
    ap.add_argument("--sparsity-mean", type=float, default=0.90)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H200: 989)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speedup-table", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                            "sparse_attention-h200-20261130.json"))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny preset, 2 layers, 256 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.frames, args.res, args.reps, args.warmup = "tiny", 2, [4], [64], 1, 1
    init_dist()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for frames in args.frames:
        for res in args.res:
            dense = None
            for arm in args.arms:
                try:
                    row = run_arm(arm, args, frames, res, device, dtype)
                except torch.cuda.OutOfMemoryError as err:
                    print(f"{arm} at {frames}x{res}: out of memory ({err})", flush=True)
                    torch.cuda.empty_cache()
                    continue
                dense = row["ms_step"] if arm == "full" else dense
                row["ms_dense_step"] = dense
                row["speedup_step"] = dense / row["ms_step"] if dense else float("nan")
                if "ms_step_after_warmup" in row:
                    row["speedup_step_after_warmup"] = dense / row["ms_step_after_warmup"] if dense else float("nan")
                rows.append(row)
                print(f"{arm:>11} S={row['S']:>7} {row['ms_step']:9.1f} ms/step  x{row['speedup_step']:.2f} "
                      f"attention {row['ms_attention']:.1f} selection {row['ms_selection']:.1f} predictor "
                      f"{row['ms_predictor']:.1f} profiler {row['ms_profiler']:.1f} rest {row['ms_linear_rest']:.1f} "
                      f"mem {row['peak_mem_gb'] or 0:.1f} GB mfu {row['mfu']:.2f}", flush=True)
                path = write_results("e2e" + args.tag, rows, args.out_dir)
    if rows:
        try:
            plot([r for r in rows if r.get("speedup_step") == r.get("speedup_step")], str(path).replace(".json", ".png"))
        except ImportError as err:
            print(f"no plot ({err}): pip install -e '.[plots]'")
        print("wrote", path)


if __name__ == "__main__":
    main()

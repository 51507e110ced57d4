"""One training step of the Wan2.1-T2V-1.3B transformer at its native video size: full attention vs DSV stage 2.

The shape is the ``wan2.1-t2v-1.3b`` preset (megatron_dsv/models/wan_config.py: 30 layers, hidden 1536 =
12 heads x 128, MLP 8960), random weights (Megatron's init), bf16 with AdamW on fp32 main weights, batch 1.
The video is Wan's native 81 frames x 480 x 832: its VAE compresses 4x in time (causal: 1 + (81 - 1) / 4 =
21 latent frames) and 8x in space (60 x 104), the (1, 2, 2) patch gives a 21 x 30 x 52 token grid,
32760 tokens. Synthetic inputs: Gaussian latents and Gaussian text embeddings [1, 512, 4096] (Wan pads
its umT5 text to 512 tokens). Arms:

* ``full``: dense self-attention (``DenseCoreAttention``: torch SDPA with cuDNN first, megatron.core local
  layers, no Transformer Engine);
* ``dsv_stage2``: DSV with the library defaults (query cube 4 x 4 x 8, 128-key blocks), every layer forced
  into stage 2 with per-head budgets spread over ``--sparsity-min .. --sparsity-max`` around
  ``--sparsity-mean`` (bench_e2e.py's ``force``): synthetic budgets, labelled as such in every row (no trained
  Wan profile exists here). ``ms_step`` is the plain sparse step; ``ms_step_amortised`` weights in the steps
  that also train the predictor and profile, at the schedule's intervals (as bench_e2e.py).

Token grid vs query cube (``--fit``): WanTransformer orders tokens cube-major and accepts any grid; where a
side is not a multiple of the cube's (21 x 30 x 52 vs 4 x 4 x 8: none is), the edge cubes are partial and
the query groups near the edges straddle cubes; no cube of a supported volume (16..128) divides 21 x 30 x
52. ``none`` (default) keeps the native grid as a fine-tune would run it; ``crop`` cuts the latent grid to
whole cubes (20 x 28 x 48 tokens, 26880); ``pad`` appends zero latents to whole cubes (24 x 32 x 56,
43008; the padding is attended like video, no mask). Every row says which (``grid_fit``).

Memory: ``--recompute auto`` runs every arm without activation recomputation and, if one runs out of
memory, all arms again with full recomputation (megatron-core ``recompute_granularity='full'``, uniform, one
layer per checkpoint; GPU only), so the arms stay comparable; the rows say which (``recompute``). Measured
on the CPU (saved tensors of a bf16 forward, attention's own left out as cuDNN keeps only O and the LSE):
~190 KiB per token per layer, ~6 GB a layer at 32760 tokens, ~185 GB for 30 layers, beyond an H200's 141 GB:
the 30-layer run needs recomputation (``--recompute full`` skips auto's failed first attempt). Timing:
median over ``--reps`` steps after ``--warmup``; peak memory ``torch.cuda.max_memory_allocated`` over the
arm's steps, ``static_mem_gb`` the weights, fp32 main weights and Adam moments between steps.

    PYTHONPATH=. python benchmarks/bench_wan.py                    # H200: 30 layers, 32760 tokens, both arms
    PYTHONPATH=. python benchmarks/bench_wan.py --layers 2         # per-layer figures, quick
    PYTHONPATH=. python benchmarks/bench_wan.py --quick            # CPU smoke run: tiny Wan, 300 tokens
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_e2e import force, schedule_step  # noqa: E402
from benchmarks.common import MainWeightsAdamW, flow_matching_step, head_sparsity, init_dist, median_ms  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from megatron_dsv.attention import dsv_layers, dsv_on_step_end  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402

ARMS = ("full", "dsv_stage2")
FITS = ("none", "crop", "pad")
PRESET = "wan2.1-t2v-1.3b"
VAE_STRIDE = (4, 8, 8)  # Wan VAE: time (causal: the first frame alone), height, width
# --quick: a tiny Wan (CPU seconds) whose 5 x 6 x 10 token grid is no multiple of the 4 x 4 x 8 cube either
QUICK = dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, text_dim=32, freq_dim=64,
             ffn_dim=256, num_layers=2, rope_max_seq_len=64)


def latent_grid(frames: int, height: int, width: int):
    """Wan VAE latent grid ``(T, H, W)`` of a ``frames x height x width`` video (81 x 480 x 832 -> 21 x 60 x 104)."""
    st, sh, sw = VAE_STRIDE
    if frames < 1 or (frames - 1) % st:
        raise ValueError(f"--frames must be 1 + {st} k (Wan's causal VAE), got {frames}")
    for name, side, s in (("--height", height, sh), ("--width", width, sw)):
        if side < s or side % s:
            raise ValueError(f"{name} must be a positive multiple of {s} (the VAE's stride), got {side}")
    return 1 + (frames - 1) // st, height // sh, width // sw


def fit_grid(latent, patch, cube, mode: str):
    """``(latent grid, note)``: the latent grid the run uses under ``--fit mode`` and a line saying what was done."""
    tokens = [g // p for g, p in zip(latent, patch)]
    if mode == "none":
        whole = all(t % c == 0 for t, c in zip(tokens, cube))
        return tuple(latent), ("native grid" + ("" if whole else f": not a multiple of the query cube {tuple(cube)}, "
                                                "edge cubes partial (groups near the edges straddle cubes)"))
    if mode == "crop":
        fitted = [t // c * c for t, c in zip(tokens, cube)]
        if min(fitted) < 1:
            raise ValueError(f"--fit crop: token grid {tuple(tokens)} is smaller than the cube {tuple(cube)} on a side")
        note = "cropped to whole query cubes (latents cut at the far edges)"
    elif mode == "pad":
        fitted = [-(-t // c) * c for t, c in zip(tokens, cube)]
        note = "padded to whole query cubes (zero latents at the far edges, attended unmasked)"
    else:
        raise ValueError(f"--fit must be one of {list(FITS)}, got {mode!r}")
    return tuple(t * p for t, p in zip(fitted, patch)), note


def _wan_config(args, latent):
    from megatron_dsv.models.wan_config import WanConfig

    if args.quick:
        return WanConfig(**QUICK, latent_grid=latent)
    return WanConfig.from_preset(PRESET, num_layers=args.layers, latent_grid=latent)


def _recompute_overrides(mode: str) -> dict:
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def run_arm(arm: str, args, cfg, recompute: str, device, dtype) -> dict:
    from megatron_dsv.models.wan import build_wan, count_wan_parameters

    table = args.speedup_table if device.type == "cuda" else None
    # --quick: token lists and a small k_min, so that 300 tokens at 90% sparsity run the sparse path at all
    small = dict(granularity="token", k_min=16) if args.quick else {}
    dsv = DSVConfig(speedup_table=table, **small) if arm == "dsv_stage2" else None
    torch.manual_seed(args.seed)
    model = build_wan(cfg, dsv_config=dsv, use_te=False, dtype=dtype, **_recompute_overrides(recompute)).to(device)
    model.train()
    opt = MainWeightsAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(1, cfg.in_channels, *cfg.latent_grid, generator=g, device=device).to(dtype)
    text = torch.randn(1, args.text_len, cfg.text_dim, generator=g, device=device).to(dtype)
    grid = cfg.token_grid()
    S = math.prod(grid)
    sparsity = head_sparsity(cfg.num_attention_heads, args.sparsity_min, args.sparsity_max, args.sparsity_mean)

    def step_of(train: bool, profile: bool):
        at = schedule_step(dsv, 2, train, profile) if dsv is not None else 0

        def one():
            if dsv is not None:
                force(model, 2, sparsity, at, train, profile)
            flow_matching_step(model, opt, latents, None, g, text=text)
            if dsv is not None:
                dsv_on_step_end(model, at + 1)
        return one

    kinds = {"plain": (False, False)}
    if dsv is not None and not args.plain_only:
        kinds.update(train=(True, False), profile=(dsv.predictor_train_interval > 0, True))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ms, static = {}, None
    for name, (train, profile) in kinds.items():
        fn = step_of(train, profile)
        for _ in range(args.warmup):
            fn()
        if static is None and cuda:  # between steps: weights, fp32 main weights, Adam moments (grads freed)
            static = torch.cuda.memory_allocated() / 2**30
        ms[name] = median_ms(fn, args.reps)
    out = dict(arm=arm, preset="tiny (--quick)" if args.quick else PRESET, layers=cfg.num_layers,
               preset_layers=None if args.quick else _preset_layers(), hidden=cfg.hidden,
               heads=cfg.num_attention_heads, head_dim=cfg.attention_head_dim, ffn=cfg.ffn_dim,
               params=count_wan_parameters(cfg), weights="random (Megatron init)",
               dtype=str(dtype).replace("torch.", ""),
               video=None if args.quick else [args.frames, args.height, args.width], latent_grid=list(cfg.latent_grid),
               token_grid=list(grid), S=S, text_len=args.text_len, recompute=recompute, warmup=args.warmup,
               reps=args.reps, ms_step=ms["plain"], ms_per_layer=ms["plain"] / cfg.num_layers)
    if dsv is None:
        out["attention"] = "DenseCoreAttention: torch SDPA, cuDNN first"
        out.update(sparsity=0.0, budget_source=None, cube=list(cfg.cube))
    else:
        out.update(_dsv_fields(model, dsv, ms, S, args))
    out["tokens_per_s"] = S / (ms["plain"] / 1e3)
    out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out["static_mem_gb"] = static
    if out["preset_layers"] and cfg.num_layers < out["preset_layers"]:
        out["ms_step_full_depth_linear"] = out["ms_per_layer"] * out["preset_layers"]  # embedders/head counted 30x
    return out


def _dsv_fields(model, dsv: DSVConfig, ms: dict, S: int, args) -> dict:
    """The DSV arm's columns: backends, lists, what ran sparse, the synthetic budgets, the amortised step."""
    from megatron_dsv.attention import _ops

    layers = dsv_layers(model)
    kernel, topk = _ops.resolve_backends(dsv)
    kept = float(torch.stack([layer.last_k for layer in layers]).mean()) / S
    out = dict(attention=f"DSVCoreAttention stage 2 (kernel backend {kernel}, top-k backend {topk})",
               cube=list(dsv.query_group_shape), granularity=dsv.granularity, block=dsv.block_size, k_min=dsv.k_min,
               sparse_layers=sum(int(layer.last_sparse) for layer in layers), kept_fraction=kept, sparsity=1.0 - kept,
               budget_source=f"synthetic: per-head sparsity spread {args.sparsity_min:.2f}..{args.sparsity_max:.2f}, "
                             f"mean {args.sparsity_mean:.2f} (not a trained model's profile)")
    if "train" in ms:
        n_train, n_prof = dsv.predictor_train_interval, dsv.profile_interval_after_warmup
        share = 1.0 / n_train if n_train else 0.0
        out.update(ms_predictor_step=ms["train"], ms_profile_step=ms["profile"], profile_every=n_prof,
                   predictor_every=n_train,
                   ms_step_amortised=ms["plain"] + share * (ms["train"] - ms["plain"])
                   + (ms["profile"] - ms["train"]) / n_prof)
    return out


def _preset_layers() -> int:
    from megatron_dsv.models.wan_config import WAN_PRESETS

    return int(WAN_PRESETS[PRESET]["num_layers"])


def run_arms(args, cfg, device, dtype):
    """Rows of every arm at one recompute mode: ``--recompute``, or under ``auto`` none and, if an arm runs
    out of memory, full recomputation for all of them (so the arms compare like with like)."""
    modes = [args.recompute] if args.recompute != "auto" else (["none", "full"] if device.type == "cuda" else ["none"])
    reason = None  # why the last mode was needed (None: the first one fitted)
    for mode in modes:
        rows, failed = _try_arms(args, cfg, mode, device, dtype)
        if failed is None:
            return rows, reason
        reason = failed
        print(failed, flush=True)
        gc.collect()  # out of the except block: the traceback's frames (model, optimizer) are freed
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return [], reason


def _try_arms(args, cfg, mode: str, device, dtype):
    """(rows, None), or (rows so far, a line naming the arm that ran out of memory)."""
    rows = []
    try:
        for arm in args.arms:
            rows.append(run_arm(arm, args, cfg, mode, device, dtype))
            print(_line(rows[-1]), flush=True)
    except torch.cuda.OutOfMemoryError as err:
        return rows, f"{args.arms[len(rows)]} ran out of memory with recompute={mode}: {str(err).splitlines()[0]}"
    return rows, None


def _line(row) -> str:
    mem = f"{row['peak_mem_gb']:.1f} GB" if row["peak_mem_gb"] is not None else "n/a"
    extra = f" amortised {row['ms_step_amortised']:.1f} ms" if "ms_step_amortised" in row else ""
    sparse = f" sparsity {row['sparsity']:.3f} sparse layers {row['sparse_layers']}/{row['layers']}" \
        if row["arm"] != "full" else ""
    return (f"{row['arm']:>10} S={row['S']} layers={row['layers']} recompute={row['recompute']}: "
            f"{row['ms_step']:.1f} ms/step ({row['ms_per_layer']:.1f}/layer){extra} peak {mem}{sparse}")


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default: the preset's, 30)")
    ap.add_argument("--frames", type=int, default=81, help="video frames (default 81, Wan's native)")
    ap.add_argument("--height", type=int, default=480, help="video height in pixels (default 480)")
    ap.add_argument("--width", type=int, default=832, help="video width in pixels (default 832)")
    ap.add_argument("--fit", choices=FITS, default="none",
                    help="token grid vs query cube: none (native grid, partial edge cubes), crop or pad to whole cubes")
    ap.add_argument("--text-len", type=int, default=512, help="text tokens (default 512: Wan pads umT5's to 512)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--recompute", choices=("auto", "none", "full"), default="auto",
                    help="activation recomputation (full: GPU only); auto: none, full if an arm runs out of memory")
    ap.add_argument("--sparsity-min", type=float, default=0.80)
    ap.add_argument("--sparsity-max", type=float, default=0.98)
    ap.add_argument("--sparsity-mean", type=float, default=0.90)
    ap.add_argument("--plain-only", action="store_true",
                    help="DSV: time the plain sparse step only (no predictor-training and profiling step kinds)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speedup-table", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                            "sparse_attention-h200-20261130.json"))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: tiny Wan (2 layers, 2 heads x 64), 17 x 96 x 160 video = 5 x 6 x 10 tokens")
    return ap


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.frames, args.height, args.width, args.text_len, args.reps, args.warmup = 17, 96, 160, 7, 1, 1
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.recompute == "full" and not torch.cuda.is_available():
        ap.error("--recompute full needs a GPU (megatron-core's activation checkpoint stores CUDA RNG states)")
    args.layers = args.layers or (QUICK["num_layers"] if args.quick else _preset_layers())
    try:
        native = latent_grid(args.frames, args.height, args.width)
        base = _wan_config(args, native)
        latent, note = fit_grid(native, base.patch_size, DSVConfig().query_group_shape, args.fit)
        cfg = _wan_config(args, latent)
    except ValueError as err:
        ap.error(str(err))
    init_dist()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    native_tokens = base.token_grid()
    print(f"Wan {PRESET if not args.quick else 'tiny'}: {args.layers} layers, video {args.frames} x {args.height} x "
          f"{args.width} -> latents {native} -> tokens {native_tokens}; fit {args.fit}: {note}", flush=True)
    rows, reason = run_arms(args, cfg, device, dtype)
    if not rows:
        print(f"no rows: {reason}")
        return 1
    dense = next((r["ms_step"] for r in rows if r["arm"] == "full"), None)
    for r in rows:
        r.update(grid_fit=dict(mode=args.fit, note=note, native_token_grid=list(native_tokens),
                               native_S=math.prod(native_tokens)),
                 recompute_reason=reason, ms_dense_step=dense,
                 speedup_step=dense / r["ms_step"] if dense else None)
        if "ms_step_amortised" in r and dense:
            r["speedup_step_amortised"] = dense / r["ms_step_amortised"]
        if r["arm"] != "full" and dense:
            print(f"{r['arm']}: x{r['speedup_step']:.2f} vs full" + (f" (amortised x{r['speedup_step_amortised']:.2f})"
                                                                      if "speedup_step_amortised" in r else ""))
    path = write_results("wan" + args.tag, rows, args.out_dir)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

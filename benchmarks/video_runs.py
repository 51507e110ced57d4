"""Training runs of the video DiT on rendered or synthetic videos, shared by the sparsity study
(``bench_sparsity_emergence.py``) and the quality comparison (``bench_quality.py``).

An *arm* is one training run, written on the command line as ``key=value`` pairs joined by commas:

    data=vizdoom,frames=32,res=256,attn=dsv,lr=3e-4,qk_norm=1,rope=10000,steps=1500,minutes=3

Keys (defaults in :data:`ARM_DEFAULTS`): ``data`` (``vizdoom``, ``ale``, ``footage`` or ``synthetic``), ``frames``
and ``res`` (clip length and square frame size in pixels; with the fixed 4x DCT downsampler and
patch (1, 2, 2), tokens S = frames * (res / 8)^2), ``attn`` (``full``, ``dsv`` or ``window``),
``lr``, ``qk_norm`` (0/1), ``qk_lr`` (learning-rate multiplier of the QK-norm gains and biases, the
parameters that set the attention logits' scale under QK-norm), ``rope`` (RoPE base), ``gran`` (DSV's KV list
granularity, ``block`` or ``token``: ``DSVConfig.granularity``), ``rule`` and ``recall`` (DSV's budget rule, ``recall`` or
``sparsity``, and the recall rule's target: ``DSVConfig.budget_rule`` / ``recall_target``), ``local`` (DSV's local +
predicted lists, the always-on radius in cubes as ``rt.rh.rw``, ``0.0.0`` = off, ``auto`` = the library's
default: ``DSVConfig.local_radius``), ``lmode`` (how those lists size each cube's list: ``shared`` or
``window``, ``DSVConfig.local_mode``), ``thr`` (the dispatcher's ``DSVConfig.sparsity_threshold``), ``cap``
(``DSVConfig.max_density``, the cap on every head's kept fraction; 0 = none), ``s1local`` (what stage 1 attends:
``0.0.0`` every key, ``rt.rh.rw`` the 3D window of that radius in cubes, ``auto`` the library's default:
``DSVConfig.stage1_local_radius``), ``group`` (the query cube ``t.h.w`` of 16-128 tokens that shares one list:
``DSVConfig.query_group_shape``, default ``4.4.8``), ``steps`` and ``minutes`` (the run
stops at whichever comes first, so a run fits the device time; with ``--align-stops`` a run stopped by its minutes is saved
where it stopped and reports its last validation step), ``stage1`` (DSV's stage-1 steps; default
half of ``steps``), ``window_frac`` (the window baseline's kept fraction of keys), ``label`` (a
name for the plots; default built from the keys that differ from the defaults).
Every arm with the same data keys trains on the same clips (``--data-seed``), in the same order and from the
same initial weights (``--seed``: a seed is one draw of init, data order and training noise; ``--init-seed`` and
``--order-seed`` fix the init and the clip order apart from it), and is validated on the same
held-out clips, noise and timesteps; with ``--ema-decay`` > 0 (default 0.999) validation evaluates the
exponential moving average of the weights (:class:`megatron_dsv.training.ema.ModelEMA`), as diffusion
trainers evaluate and sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MainWeightsAdamW, flow_matching_step, sync  # noqa: E402
from megatron_dsv.attention import dsv_layers, dsv_metrics, dsv_on_step_end, dsv_stage  # noqa: E402
from megatron_dsv.attention.schedule import is_profile_step  # noqa: E402
from megatron_dsv.config import LOCAL_MODES, SUPPORTED_GROUP_SIZES, DSVConfig  # noqa: E402

ARM_DEFAULTS = dict(data="vizdoom", frames=32, res=256, attn="dsv", lr=3e-4, qk_norm=1, qk_lr=1.0, rope=10000.0,
                    gran="block", rule="recall", recall=0.96, local="0.0.0", lmode="shared", thr=0.8, cap=0.0,
                    s1local="0.0.0", group="4.4.8", steps=1000, minutes=3.0, stage1=None, window_frac=0.1, label=None)
_INT_KEYS = ("frames", "res", "qk_norm", "steps", "stage1")
_FLOAT_KEYS = ("lr", "qk_lr", "rope", "minutes", "window_frac", "recall", "thr", "cap")
DATA_SOURCES = ("vizdoom", "ale", "footage", "synthetic")
GRANULARITIES = ("block", "token")  # DSVConfig.granularity
BUDGET_RULES = ("recall", "sparsity")  # DSVConfig.budget_rule
ATTENTIONS = ("full", "dsv", "window")


def parse_arm(text: str) -> dict:
    """``"data=ale,frames=32"`` -> a full arm dict (defaults filled, values typed and checked)."""
    arm = dict(ARM_DEFAULTS)
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise ValueError(f"arm entries must be key=value, got {part!r} in {text!r}")
        key, value = part.split("=", 1)
        if key not in ARM_DEFAULTS:
            raise ValueError(f"unknown arm key {key!r} in {text!r}; allowed: {sorted(ARM_DEFAULTS)}")
        arm[key] = int(value) if key in _INT_KEYS else float(value) if key in _FLOAT_KEYS else value
    if arm["data"] not in DATA_SOURCES:
        raise ValueError(f"arm data must be one of {DATA_SOURCES}, got {arm['data']!r}")
    if arm["attn"] not in ATTENTIONS:
        raise ValueError(f"arm attn must be one of {ATTENTIONS}, got {arm['attn']!r}")
    if arm["gran"] not in GRANULARITIES:
        raise ValueError(f"arm gran must be one of {GRANULARITIES}, got {arm['gran']!r}")
    if arm["rule"] not in BUDGET_RULES:
        raise ValueError(f"arm rule must be one of {BUDGET_RULES}, got {arm['rule']!r}")
    if arm["lmode"] not in LOCAL_MODES:
        raise ValueError(f"arm lmode must be one of {LOCAL_MODES}, got {arm['lmode']!r}")
    arm["local_radius"] = local_radius(arm["local"])
    arm["stage1_local_radius"] = local_radius(arm["s1local"], "s1local")
    arm["query_group_shape"] = three_ints(arm["group"], "group")
    if math.prod(arm["query_group_shape"]) not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"arm group (the query cube t.h.w, DSVConfig.query_group_shape) must hold one of "
                         f"{SUPPORTED_GROUP_SIZES} tokens, got {arm['group']!r}")
    if arm["res"] % 8:
        raise ValueError(f"arm res must be a multiple of 8 (4x downsampler, 2x2 patches), got {arm['res']}")
    if arm["qk_lr"] != 1.0 and not arm["qk_norm"]:
        raise ValueError(f"arm qk_lr={arm['qk_lr']:g} needs qk_norm=1 (it scales the QK-norm parameters' lr)")
    if arm["stage1"] is None:
        arm["stage1"] = arm["steps"] // 2
    if arm["label"] is None:
        variants = [f"{k.replace('_', '')}{arm[k]:g}" for k in ("lr", "qk_norm", "qk_lr", "rope")
                    if arm[k] != ARM_DEFAULTS[k]]
        if arm["attn"] == "dsv":
            variants += [f"{arm['gran']}lists"] if arm["gran"] != "block" else []
            variants += ["paperrule"] if arm["rule"] == "sparsity" else []
            variants += [f"recall{arm['recall']:g}"] if arm["rule"] == "recall" and arm["recall"] != 0.96 else []
            variants += [f"thr{arm['thr']:g}"] if arm["thr"] != ARM_DEFAULTS["thr"] else []
            variants += [f"cap{arm['cap']:g}"] if arm["cap"] else []
            variants += [f"local{arm['local']}"] if arm["local_radius"] is None or any(arm["local_radius"]) else []
            variants += [f"lmode{arm['lmode']}"] if arm["lmode"] != ARM_DEFAULTS["lmode"] else []
            variants += ([f"s1local{arm['s1local']}"] if arm["stage1_local_radius"] is None
                         or any(arm["stage1_local_radius"]) else [])
            variants += [f"group{arm['group']}"] if arm["group"] != ARM_DEFAULTS["group"] else []
            variants += ["staysdense"] if arm["stage1"] >= arm["steps"] else []
        if arm["attn"] == "window":
            variants += [f"frac{arm['window_frac']:g}"]
        arm["label"] = "-".join([arm["data"], arm["attn"], *variants, f"S{_tokens_text(tokens_of(arm))}"])
    return arm


def three_ints(text: str, key: str, auto: bool = False):
    """``"0.1.1"`` -> ``(0, 1, 1)`` (an arm key of three ints joined by dots); ``"auto"`` -> None where allowed."""
    if auto and str(text) == "auto":
        return None
    parts = str(text).split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"arm {key} must be three ints >= 0 joined by dots (t.h.w){' or auto' if auto else ''}, "
                         f"got {text!r}")
    return tuple(int(p) for p in parts)


def local_radius(text: str, key: str = "local"):
    """``"0.1.1"`` -> ``(0, 1, 1)``, ``"auto"`` -> None (the ``local`` and ``s1local`` arm keys:
    DSVConfig.local_radius / stage1_local_radius in cubes; None is the library's automatic choice)."""
    return three_ints(text, key, auto=True)


def tokens_of(arm: dict) -> int:
    """Sequence length of an arm's clips."""
    return arm["frames"] * (arm["res"] // 8) ** 2


def _tokens_text(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


class Clips:
    """An arm's clips rendered once and kept on the device: ``train`` then ``val`` (held out)."""

    _cache: Dict[tuple, "Clips"] = {}

    def __init__(self, latents: torch.Tensor, labels: torch.Tensor, n_train: int, decoder):
        self.latents, self.labels, self.n_train, self.decoder = latents, labels, n_train, decoder
        self.order_seed = 0

    @classmethod
    def for_arm(cls, arm: dict, args, channels: int, device, dtype) -> "Clips":
        key = (arm["data"], arm["frames"], arm["res"], args.samples, args.val_samples, _data_seed(args), channels,
               args.frame_skip)
        if key not in cls._cache:
            cls._cache.clear()  # one data set on the device at a time
            cls._cache[key] = cls._load_or_render(key, arm, args, channels, device, dtype)
        clips = cls._cache[key]
        clips.order_seed = order_seed(args)
        return clips

    @classmethod
    def _load_or_render(cls, key, arm, args, channels, device, dtype) -> "Clips":
        """Rendered once per data key: with ``--clips-cache DIR`` the latents are kept there (tensors only,
        loaded with ``weights_only``), so concurrent arms of one study render nothing twice."""
        cache = getattr(args, "clips_cache", None)
        if not cache:
            return cls._render(arm, args, channels, device, dtype)
        path = os.path.join(cache, f"clips-v{_CLIPS_FORMAT}-" + "-".join(str(k) for k in key) + ".pt")
        if not os.path.exists(path):
            clips = cls._render(arm, args, channels, device, dtype)
            os.makedirs(cache, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save({"latents": clips.latents.cpu(), "labels": clips.labels.cpu(), "n_train": clips.n_train}, tmp)
            os.replace(tmp, path)
            return clips
        state = torch.load(path, map_location="cpu", weights_only=True)
        print(f"loaded {state['latents'].shape[0]} {arm['data']} clips from {path}", flush=True)
        return cls(state["latents"].to(device, dtype), state["labels"].to(device), int(state["n_train"]),
                   cls._decoder(arm, args, channels))

    @staticmethod
    def _decoder(arm, args, channels):
        if arm["data"] == "synthetic":
            return None
        from megatron_dsv.data.rendered import RenderedVideoDataset, decode_video

        ds = RenderedVideoDataset(arm["data"], args.samples + args.val_samples, frames=arm["frames"],
                                  height=arm["res"], width=arm["res"], channels=channels, frame_skip=args.frame_skip,
                                  seed=_data_seed(args), holdout_from=args.samples)
        return lambda latents: decode_video(ds.denormalize(latents))

    @classmethod
    def _render(cls, arm, args, channels, device, dtype) -> "Clips":
        n = args.samples + args.val_samples
        t0 = time.perf_counter()
        if arm["data"] == "synthetic":
            from megatron_dsv.data.synthetic import SyntheticVideoDataset

            ds = SyntheticVideoDataset(n, channels=channels, frames=arm["frames"], height=arm["res"] // 4,
                                       width=arm["res"] // 4, seed=_data_seed(args), num_classes=8,
                                       background="texture")
            items, decoder = [ds[i] for i in range(n)], None
        else:
            from megatron_dsv.data.rendered import RenderedVideoDataset, decode_video, render_dataset

            ds = RenderedVideoDataset(arm["data"], n, frames=arm["frames"], height=arm["res"], width=arm["res"],
                                      channels=channels, frame_skip=args.frame_skip, seed=_data_seed(args),
                                      holdout_from=args.samples)
            items = render_dataset(ds, workers=args.workers)

            def decoder(latents, ds=ds):
                return decode_video(ds.denormalize(latents))
        latents = torch.stack([x["latents"] for x in items]).to(device, dtype)
        labels = torch.stack([x["label"] for x in items]).to(device)
        print(f"rendered {n} {arm['data']} clips {tuple(latents.shape[1:])} ({tokens_of(arm)} tokens) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        return cls(latents, labels, args.samples, decoder)

    def batch_at(self, it: int, batch: int):
        """Batch ``it``: the training clips in epochs, each epoch a permutation drawn from the run's seed
        (seed 0 keeps the rendered order, as runs before seeds did)."""
        idx = []
        for pos in range(it * batch, (it + 1) * batch):
            epoch, i = divmod(pos, self.n_train)
            idx.append(int(self._epoch_order(epoch)[i]))
        return self.latents[idx], self.labels[idx]

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self.order_seed == 0:
            return torch.arange(self.n_train)
        key = (self.order_seed, epoch)
        if getattr(self, "_order_key", None) != key:
            g = torch.Generator().manual_seed(self.order_seed * 1_000_003 + epoch)
            self._order_key, self._order = key, torch.randperm(self.n_train, generator=g)
        return self._order


_CLIPS_FORMAT = 1  # raise when rendering changes: cached clips of another version are then not reused


def _readable_file(path: str):
    """argparse type of --speedup-table (applied to its default too): a missing table stops the run at its start
    on any device, not at its first GPU layer (run 21: a worker started from a copy of the code without it).
    '' or 'none': no table (the dispatcher's FLOP model)."""
    if path in ("", "none"):
        return None
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path!r}")
    return path


def _fixed_or_seed(args, name: str) -> int:
    fixed = getattr(args, name, None)
    return args.seed if fixed is None else fixed


def init_seed(args) -> int:
    """The seed of the initial weights: ``--init-seed``, else ``--seed`` (a seed is one draw of init, data order
    and training noise; a study that fixes the init varies only the other two)."""
    return _fixed_or_seed(args, "init_seed")


def order_seed(args) -> int:
    """The seed of the clip order: ``--order-seed``, else ``--seed`` (0: the clips in their rendered order, as runs
    before seeds did); a study that fixes it (and the init) varies only the training noise."""
    return _fixed_or_seed(args, "order_seed")


def run_harness(args) -> dict:
    """What a run's curve depends on besides its arm, seed and schedule: ``batch`` (clips a step) and the fixed
    ``init_seed`` / ``order_seed`` (None: the seed's own). A run checkpoint resumes only in its own harness, and a
    report compares only runs of one (:func:`benchmarks.quality_report.harness_of` reads it back from a curve)."""
    return dict(batch=int(args.batch), init_seed=getattr(args, "init_seed", None),
                order_seed=getattr(args, "order_seed", None))


def _data_seed(args) -> int:
    """The seed of the rendered clips: ``--data-seed``, else ``--seed`` (runs before the two were split)."""
    data_seed = getattr(args, "data_seed", None)
    return args.seed if data_seed is None else data_seed


def build_model(arm: dict, args, device, dtype):
    """The arm's video DiT (seeded: every arm of a run starts from the same weights where shapes agree)."""
    from megatron_dsv.models.dit_config import VideoDiTConfig
    from megatron_dsv.models.video_dit import build_video_dit

    grid = (arm["frames"], arm["res"] // 4, arm["res"] // 4)
    over = dict(latent_frames=grid[0], latent_height=grid[1], latent_width=grid[2], qk_layernorm=bool(arm["qk_norm"]),
                rope_theta=float(arm["rope"]), num_classes=len(_classes(arm)))
    if args.layers:
        over["layers"] = args.layers
    if getattr(args, "heads", None):  # a narrower layer than the preset's: hidden = heads x head dim
        over.update(heads=args.heads, head_dim=args.head_dim, hidden=args.heads * args.head_dim)
    cfg = VideoDiTConfig.from_preset(args.preset, **over)
    dsv = window = None
    if arm["attn"] == "dsv":
        dsv = DSVConfig(stage_switch_rule="steps", stage_switch_steps=arm["stage1"], granularity=arm["gran"],
                        budget_rule=arm["rule"], recall_target=arm["recall"], local_radius=arm["local_radius"],
                        local_mode=arm["lmode"], stage1_local_radius=arm["stage1_local_radius"],
                        query_group_shape=arm["query_group_shape"],
                        sparsity_threshold=arm["thr"], max_density=arm["cap"] or None,
                        profile_interval=args.profile_every, profile_warmup_steps=10**9,
                        speedup_table=args.speedup_table if device.type == "cuda" else None)
    elif arm["attn"] == "window":
        from megatron_dsv.models.window_attention import WindowConfig, radius_for_fraction

        cube = DSVConfig().query_group_shape
        radius = radius_for_fraction(cfg.token_grid(), cube, arm["window_frac"])
        window = WindowConfig(cube=cube, radius=radius, block_size=DSVConfig().kv_block_size)
    torch.manual_seed(init_seed(args))
    kwargs = dict(window_config=window) if window is not None else {}
    model = build_video_dit(cfg, dsv_config=dsv, dtype=dtype, **kwargs).to(device)
    return model, cfg


def _classes(arm):
    if arm["data"] == "synthetic":
        return range(8)
    from megatron_dsv.data.rendered import SOURCES

    return SOURCES[arm["data"]]


@torch.no_grad()
def val_parts(model, clips: Clips, batch: int, seed: int = 1234) -> torch.Tensor:
    """Flow-matching loss of every held-out clip at every fixed timestep (t = 0.1 .. 0.9), at fixed noise:
    ``[held-out clips, 5]`` (fp32, on the CPU), in eval mode (a DSV model attends as its dispatcher says; no
    predictor or profiler work). The validation loss is its mean (in fp64); :func:`val_breakdown` its means per
    class and t."""
    was = model.training
    model.eval()
    g = torch.Generator(device=clips.latents.device).manual_seed(seed)
    ts = torch.linspace(0.1, 0.9, 5)
    val = list(range(clips.n_train, clips.latents.shape[0]))
    rows = []
    try:
        for start in range(0, len(val), batch):
            idx = val[start:start + batch]
            x0, labels = clips.latents[idx].float(), clips.labels[idx]
            cols = []
            for t in ts:
                noise = torch.randn(x0.shape, generator=g, device=x0.device)
                tb = torch.full((len(idx),), float(t), device=x0.device)
                x_t = (1 - t) * x0 + t * noise
                v = model(x_t.to(clips.latents.dtype), tb, labels).float()
                cols.append((v - (noise - x0)).square().flatten(1).mean(1))
            rows.append(torch.stack(cols, 1).cpu())
    finally:
        model.train(was)
    return torch.cat(rows)


def val_breakdown(parts: torch.Tensor, labels: torch.Tensor, class_names) -> dict:
    """:func:`val_parts` summarised: the mean loss per class (``by_class``, by name: for footage, per source video)
    and per timestep (``by_t``, t = 0.1 .. 0.9), so a seed's spread can be traced to a video or a noise level."""
    labels = labels.cpu()
    names = list(class_names)
    by_class = {str(names[int(c)]): float(parts[labels == c].mean()) for c in labels.unique().tolist()}
    return dict(by_class=by_class, by_t=[float(x) for x in parts.mean(0)])


def run_path(arm: dict, args):
    """Where an arm's run is saved: ``<save_dir>/<label>[-s<seed>].pt`` (seed 0 keeps the old name)."""
    if not args.save_dir:
        return None
    return os.path.join(args.save_dir, arm["label"] + (f"-s{args.seed}" if args.seed else "") + ".pt")


def validate(model, ema, clips: "Clips", args, class_names) -> Tuple[float, dict]:
    """``(loss, breakdown)`` of the run's validation: the mean of :func:`val_parts` (in fp64) and its
    :func:`val_breakdown` by ``class_names``; on the EMA weights when the run keeps one, else on the live weights."""
    batch = getattr(args, "val_batch", None) or args.batch
    if ema is None:
        parts = val_parts(model, clips, batch)
    else:
        with ema.swap_in(model):
            parts = val_parts(model, clips, batch)
    return float(parts.double().mean()), val_breakdown(parts, clips.labels[clips.n_train:], class_names)


def train_arm(arm: dict, args, on_profile=None, on_val=None):
    """Train one arm (resumed from ``args.save_dir`` when its checkpoint is there); returns ``(model, clips, summary)``.

    ``on_profile(step, model)`` runs after every DSV profile step, ``on_val(step, loss, counters, breakdown)`` after
    every validation (every ``args.val_every`` steps and at the end; on the EMA weights with ``args.ema_decay`` > 0;
    ``counters``: the run's stage-2 layer-steps so far, ``{"sparse_steps", "layer_steps"}``, whose differences
    between validations say how many of the steps in between ran each layer sparse, and its training seconds so far
    (``train_s``: the steps' own time, validations left out, one-off compiles in, paid again at each resume) of
    which ``shared_s`` ran while another frontier worker was training on the machine (:func:`shared_gpu`; other GPU
    work such as tests beside the run is not seen): a validation interval with no shared seconds ran without another
    worker, so its seconds are a step-time figure; ``breakdown``: the loss per
    class and per timestep, :func:`val_breakdown`).
    AdamW on fp32 main weights, the learning rate of :func:`lr_scale` (linear warm-up over ``args.warmup`` steps,
    with ``args.lr_cooldown`` a linear decay over the last part of ``args.schedule_steps``, default the arm's
    steps), gradient clipping at 1, batch ``args.batch``.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, cfg = build_model(arm, args, device, dtype)
    model.train()
    clips = Clips.for_arm(arm, args, cfg.in_channels, device, dtype)
    class_names = list(_classes(arm))
    opt = _optimizer(model, arm)
    g = torch.Generator(device=device).manual_seed(args.seed)
    dsv = dsv_layers(model)
    cfg_dsv = dsv[0].dsv_config if dsv else None
    ema = _ema(model, args)
    path = run_path(arm, args)
    schedule = lr_schedule(args, getattr(args, "schedule_steps", None) or arm["steps"])
    harness = run_harness(args)
    start, counters, last_val = 0, {"sparse_steps": 0, "layer_steps": 0}, None
    if path and os.path.exists(path):
        start, counters, last_val = load_run(path, arm, model, opt, g, ema, schedule, harness=harness)
        print(f" [{arm['label']}] resumed at step {start} from {path}", flush=True)
    if start == 0 or "train_s" in counters:  # a run saved before the seconds were counted never gets them
        counters.setdefault("train_s", 0.0)
        counters.setdefault("shared_s", 0.0)
    # align (args.align_stops): runs stopped by their minutes report their last validation step
    align = bool(getattr(args, "align_stops", False)) and on_val is not None
    # the last validated state: what a run stopped by its minutes reports (saved with the run, so a run stopped
    # twice between two validations still reports its last validated step)
    aligned = (last_val["step"], last_val["val"], dict(last_val["counters"])) if last_val else \
        (start, float("nan"), dict(counters))
    t_start, times, losses = time.perf_counter(), [], []
    shared = shared_gpu()  # at the interval's start; an interval is shared if either end of it is
    counted = 0  # the steps in `times` whose seconds are in counters["train_s"]
    step = start - 1
    for step in range(start, arm["steps"]):
        scale = lr_scale(step, schedule)
        for group in opt.param_groups:
            group["lr"] = arm["lr"] * group["lr_mult"] * scale
        latents, labels = clips.batch_at(step, args.batch)
        t0 = time.perf_counter()
        loss = flow_matching_step(model, opt, latents, labels, g)
        if ema is not None:
            ema.update(model)
        if dsv:
            if dsv_stage(model) == 2:
                counters["layer_steps"] += len(dsv)
                counters["sparse_steps"] += sum(int(layer.last_sparse) for layer in dsv)
            dsv_on_step_end(model, step + 1)
            if on_profile is not None and is_profile_step(step, cfg_dsv):
                on_profile(step + 1, model)
        stop = time.perf_counter() - t_start > 60.0 * arm["minutes"]  # the run's minutes are spent
        # a log line, a validation, the last step or a stop: synced, so the seconds since the last one are all in
        # (a run stopped by its minutes saves them with its step)
        boundary = (step + 1) % args.log_every == 0 or step + 1 == arm["steps"] or stop or \
            (on_val is not None and (step + 1) % args.val_every == 0)
        if boundary or step == 0:
            sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
        if boundary and "train_s" in counters:
            seconds, counted = sum(times[counted:]), len(times)
            now_shared = shared_gpu()
            counters["train_s"] += seconds
            counters["shared_s"] += seconds if (shared or now_shared) else 0.0
            shared = now_shared
        if (step + 1) % args.log_every == 0:
            _log_line(arm, step + 1, model, losses[-args.log_every:], times[-args.log_every:], args.batch,
                      tokens_of(arm))
        if on_val is not None and (step + 1) % args.val_every == 0:
            val, breakdown = validate(model, ema, clips, args, class_names)
            on_val(step + 1, val, dict(counters), breakdown)
            if align and path and step + 1 < arm["steps"]:
                aligned = (step + 1, val, dict(counters))
                save_run(path, arm, model, opt, g, step + 1, counters, ema, last_val=aligned, schedule=schedule,
                         harness=harness)
        if stop:
            print(f" [{arm['label']}] stopped at step {step + 1} by its {arm['minutes']} min budget", flush=True)
            break
    steps_done = step + 1
    if align and path and steps_done < arm["steps"]:
        # stopped by the minutes: the run is saved where it stopped (the next launch resumes there, no step is
        # trained twice; validations stay at multiples of val_every), and what it reports (steps, loss,
        # counters) is its last validation step's, so every run of a study reports at validated steps
        if aligned[0] != steps_done:  # (stopped right at a validation: saved there already)
            save_run(path, arm, model, opt, g, steps_done, counters, ema, last_val=aligned, schedule=schedule,
                     harness=harness)
        print(f" [{arm['label']}] saved at step {steps_done}; reports its validation step {aligned[0]} (its DSV "
              f"metrics are of step {steps_done})", flush=True)
        steps_done, final_val, counters = aligned
    else:
        final_val, breakdown = validate(model, ema, clips, args, class_names)
        if path:  # with its validation: a run extended later (more steps) and stopped early reports this one
            save_run(path, arm, model, opt, g, steps_done, counters, ema, last_val=(steps_done, final_val, counters),
                     schedule=schedule, harness=harness)
        if on_val is not None and steps_done % args.val_every:
            on_val(steps_done, final_val, dict(counters), breakdown)
    summary = dict(steps=steps_done, val_loss=final_val, ms_step=1e3 * _median(times[1:] or times),
                   sparse_layer_fraction=counters["sparse_steps"] / max(1, counters["layer_steps"]),
                   minutes=(time.perf_counter() - t_start) / 60.0)
    if dsv:
        m = dsv_metrics(model)
        summary.update(sparsity_mean=m["dsv/sparsity_measured_mean"], sparsity_smoothed=m["dsv/sparsity_mean"],
                       recall=m["dsv/recall_mean"], budget_density=m["dsv/budget_density_mean"],
                       stage=int(m["dsv/stage"]))
    return model, clips, summary


def lr_schedule(args, schedule_steps: int) -> dict:
    """The learning-rate schedule of a run as plain numbers (kept in its checkpoint: a run resumes only on the
    schedule it started with): ``warmup`` steps, then the cooldown from step ``decay_start`` to ``decay_end``
    (``decay_start == decay_end``: none) down to ``min_frac`` of the rate."""
    frac = float(getattr(args, "lr_cooldown", 0.0) or 0.0)
    min_frac = float(getattr(args, "lr_min_frac", 0.0) or 0.0)
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"--lr-cooldown must be a fraction of the run's steps in [0, 1], got {frac:g}")
    if not 0.0 <= min_frac <= 1.0:
        raise ValueError(f"--lr-min-frac must be in [0, 1], got {min_frac:g}")
    if schedule_steps < 1:
        raise ValueError(f"the schedule's steps must be >= 1, got {schedule_steps}")
    end = int(schedule_steps)
    start = end - int(round(frac * end))
    if frac and start < args.warmup:
        raise ValueError(f"--lr-cooldown {frac:g} starts the decay at step {start}, inside the {args.warmup}-step "
                         "warm-up: a shorter cooldown or warm-up")
    return dict(warmup=int(args.warmup), decay_start=start, decay_end=end, min_frac=min_frac if frac else 1.0)


def schedule_key(schedule) -> str:
    """A schedule as runs are compared by (curves and checkpoints before schedules were recorded hold None: a
    constant rate after the warm-up): ``"constant"`` or the cooldown's numbers as sorted JSON."""
    if schedule is None or schedule.get("decay_end", 0) <= schedule.get("decay_start", 0):
        return "constant"
    return json.dumps(schedule, sort_keys=True)


def lr_scale(step: int, sch: dict) -> float:
    """The learning-rate multiplier of 0-based ``step`` on schedule ``sch`` (:func:`lr_schedule`): linear warm-up,
    constant, then with a cooldown a linear decay to ``min_frac`` (a warmup-stable-decay schedule); steps past
    ``decay_end`` (an arm's extra steps) stay at the floor."""
    scale = min(1.0, (step + 1) / max(1, sch["warmup"]))
    if step + 1 > sch["decay_start"] and sch["decay_end"] > sch["decay_start"]:
        done = min(1.0, (step + 1 - sch["decay_start"]) / (sch["decay_end"] - sch["decay_start"]))
        scale *= 1.0 - (1.0 - sch["min_frac"]) * done
    return scale


def _ema(model, args):
    """The run's weight EMA (``args.ema_decay`` > 0), or None."""
    decay = getattr(args, "ema_decay", 0.0) or 0.0
    if decay <= 0:
        return None
    from megatron_dsv.training.ema import ModelEMA

    return ModelEMA(model, decay)


def qk_norm_parameters(model) -> List[torch.nn.Parameter]:
    """The QK-norm gains and biases of every layer (``*.q_layernorm.*``, ``*.k_layernorm.*``)."""
    from megatron_dsv.training.optim import is_qk_norm_param  # the trainer's --qk-norm-lr-mult rule

    return [p for n, p in model.named_parameters() if is_qk_norm_param(n)]


def qk_gains(model) -> List[float]:
    """Per layer, the factor by which the QK-norm gains scale the logits of unit-variance q, k:
    ``sqrt(mean((gamma_q * gamma_k)^2))`` (1 at initialisation); empty without QK-norm."""
    gains = {}
    for n, p in model.named_parameters():
        for which in ("q", "k"):
            if n.endswith(f".{which}_layernorm.weight"):
                gains.setdefault(n.rsplit(f".{which}_layernorm", 1)[0], {})[which] = p.detach().float()
    return [float(((g["q"] * g["k"]) ** 2).mean().sqrt()) for g in gains.values() if len(g) == 2]


def _optimizer(model, arm: dict) -> MainWeightsAdamW:
    """AdamW on fp32 main weights (Megatron's bf16 recipe), no weight decay; the QK-norm parameters in
    their own group at ``qk_lr`` times the rate. Each group's ``lr_mult`` is applied by the schedule in
    :func:`train_arm`."""
    qk = {id(p) for p in qk_norm_parameters(model)}
    rest = [p for p in model.parameters() if id(p) not in qk]
    groups = [dict(params=rest, lr_mult=1.0)]
    if qk:
        groups.append(dict(params=[p for p in model.parameters() if id(p) in qk], lr_mult=float(arm["qk_lr"])))
    return MainWeightsAdamW(groups, lr=arm["lr"], weight_decay=0.0)


_RESUME_KEYS = ("data", "frames", "res", "attn", "lr", "qk_norm", "qk_lr", "rope", "gran", "rule", "recall", "local",
                "lmode", "thr", "stage1", "window_frac")
_FORMATS = ("megatron_dsv.video_run.v2", "megatron_dsv.video_run.v3")  # v3: + the weight EMA
# the harness of a run saved before each field was recorded: every study until run 31 trained at batch 1 from each
# seed's own weights, and until run 32 in each seed's own clip order
_HARNESS_BEFORE = dict(batch=1, init_seed=None, order_seed=None)


def save_run(path: str, arm: dict, model, opt, g, step: int, counters: dict, ema=None, last_val=None,
             schedule=None, harness: dict | None = None) -> None:
    """Model (with its DSV state), optimizer, weight EMA, noise generator and step of a run, written atomically;
    ``last_val``: (step, loss, counters) of its last validation (what a run stopped by its minutes reports);
    ``harness``: :func:`run_harness` (batch, fixed init and clip order; None: batch 1, the seed's own), in which
    alone it resumes."""
    harness = dict(_HARNESS_BEFORE, **(harness or {}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {"format": _FORMATS[-1], "arm": {k: arm[k] for k in _RESUME_KEYS}, "step": step,
             "counters": counters, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": g.get_state(),
             "ema": None if ema is None else ema.state_dict(), "schedule": schedule, **harness,
             "last_val": None if last_val is None else dict(step=int(last_val[0]), val=float(last_val[1]),
                                                            counters=dict(last_val[2]))}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f" [{arm['label']}] saved step {step} to {path}", flush=True)


def load_run(path: str, arm: dict, model, opt, g, ema=None, schedule=None, harness: dict | None = None):
    """Restore what :func:`save_run` wrote (tensors only: ``weights_only=True``); returns (step, counters,
    last validation as a dict of step, val, counters, or None). ``harness``: the resuming run's
    :func:`run_harness`, which must be the saved run's (a run saved before a field was recorded has its value then:
    batch 1, the seed's own init and order, :data:`_HARNESS_BEFORE`); None: not checked.
    A run saved without an EMA (format v2, or ``--ema-decay 0``) starts its EMA at the loaded weights."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated file, not a checkpoint, pickled objects
        raise ValueError(f"cannot read run checkpoint {path!r} ({type(err).__name__}: {err}); delete it to "
                         "start the arm afresh") from err
    if isinstance(state, dict) and state.get("format") == "megatron_dsv.video_run.v1":
        raise ValueError(f"{path!r} was written before fp32 main weights (format v1, bf16 AdamW); its optimizer "
                         "cannot continue exactly: delete it to start the arm afresh")
    if not isinstance(state, dict) or state.get("format") not in _FORMATS:
        raise ValueError(f"{path!r} is not a video-run checkpoint (format one of {_FORMATS})")
    saved = dict(state["arm"])
    for key in ("qk_lr", "gran", "rule", "recall", "local", "lmode", "thr"):  # written before the key existed
        saved.setdefault(key, ARM_DEFAULTS[key])
    differ = {k: (saved.get(k), arm[k]) for k in _RESUME_KEYS if saved.get(k) != arm[k]}
    if differ:
        raise ValueError(f"run checkpoint {path!r} was written by another arm: (saved, now) = {differ}")
    saved_schedule = state.get("schedule")
    if schedule is not None and schedule_key(saved_schedule) != schedule_key(schedule):
        raise ValueError(f"run checkpoint {path!r} was trained on another learning-rate schedule (saved "
                         f"{schedule_key(saved_schedule)}, now {schedule_key(schedule)}): resume with its --warmup / "
                         "--lr-cooldown / --lr-min-frac, or start afresh")
    for key, was in _HARNESS_BEFORE.items() if harness is not None else ():
        saved_value, now = state.get(key, was), harness.get(key, was)
        if saved_value != now:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"run checkpoint {path!r} was trained with {flag} {saved_value}, not {now} (None: the "
                             f"seed's own): resume it with {flag} {saved_value}, or start afresh in another --save-dir")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    g.set_state(state["rng"])
    if ema is not None:
        if state.get("ema") is None:
            ema.reset(model)
            print(f" {path}: saved without a weight EMA; the EMA starts at the loaded weights", flush=True)
        else:
            ema.load_state_dict(state["ema"])
    return int(state["step"]), dict(state["counters"]), state.get("last_val")


def shared_gpu() -> bool:
    """Whether another frontier worker (``bench_quality.py --worker``, any study) runs on this machine now: its steps
    share the GPU with this run's. Other GPU work (tests, a timing phase) is not seen."""
    from benchmarks.frontier_launch import running_workers

    return running_workers(exclude=os.getpid()) > 0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _log_line(arm, step, model, losses, times, batch, S):
    ms = 1e3 * sum(times) / len(times)
    loss = float(torch.stack(losses).float().mean())
    line = (f" [{arm['label']}] iteration {step:6d}/{arm['steps']} | ms/step {ms:8.1f} | "
            f"tokens/s {batch * S / (ms / 1e3):10.0f} | loss {loss:.4f}")
    if dsv_layers(model):
        m = dsv_metrics(model)
        n = len(dsv_layers(model))
        line += (f" | stage {int(m['dsv/stage'])} | sparsity {m['dsv/sparsity_measured_mean']:.3f} "
                 f"(smoothed {m['dsv/sparsity_mean']:.3f}) | density {m['dsv/budget_density_mean']:.3f} | "
                 f"recall {m['dsv/recall_mean']:.3f} | sparse layers {round(m['dsv/sparse_fraction'] * n)}/{n}")
    print(line, flush=True)


def layer_sparsity(model) -> List[float]:
    """The last profile's exact theta-sparsity (unsmoothed) of each DSV layer, in layer order."""
    m = dsv_metrics(model)
    return [m[f"dsv/layer{layer.layer_number}/sparsity_measured"] for layer in dsv_layers(model)]


def add_run_args(ap, preset="0.8b", layers=4, samples=64):
    """Arguments every arm of a run shares."""
    ap.add_argument("--preset", default=preset, help="model width: a VideoDiTConfig preset (layer shape)")
    ap.add_argument("--layers", type=int, default=layers, help="layers (fewer than the preset's, to fit device time)")
    ap.add_argument("--heads", type=int, default=None,
                    help="attention heads instead of the preset's, with --head-dim; hidden = heads x head dim "
                         "(a narrower model reaches the attention-dominated regime at fewer tokens)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim with --heads")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=100, help="linear learning-rate warm-up steps")
    ap.add_argument("--lr-cooldown", type=float, default=0.0,
                    help="decay the learning rate linearly over this last fraction of the run's steps (0: constant "
                         "after the warm-up, as runs 1-12); bench_quality counts the study's steps, not an arm's "
                         "extra steps, which stay at the floor")
    ap.add_argument("--lr-min-frac", type=float, default=0.0, help="the rate at the cooldown's end, a fraction of lr")
    ap.add_argument("--samples", type=int, default=samples, help="training clips (rendered once, cycled)")
    ap.add_argument("--val-samples", type=int, default=8, help="held-out clips for the validation loss")
    ap.add_argument("--frame-skip", type=int, default=None,
                    help="engine tics (games) or source frames (footage) between two frames of a clip; default: "
                         "the source's (rendered.DEFAULT_FRAME_SKIP: 4 tics, 1 frame)")
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                    help="renderer processes")
    ap.add_argument("--profile-every", type=int, default=25, help="DSV profile period (steps)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--val-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order (one draw of a seed)")
    ap.add_argument("--init-seed", type=int, default=None,
                    help="the initial weights (default: --seed); a study over seeds that fixes it varies only the "
                         "data order and the training noise")
    ap.add_argument("--order-seed", type=int, default=None,
                    help="the clip order (default: --seed; 0: the rendered order); a study over seeds that fixes it "
                         "and --init-seed varies only the training noise")
    ap.add_argument("--data-seed", type=int, default=None,
                    help="the rendered clips (default: --seed); a study over seeds fixes it so every seed sees the "
                         "same clips and held-out set")
    ap.add_argument("--ema-decay", type=float, default=0.999,
                    help="validate an EMA of the weights with this decay (0: the live weights); 0.999 averages about "
                         "the last 1000 steps, a tenth to a quarter of the study's runs")
    ap.add_argument("--val-batch", type=int, default=8, help="clips per validation forward")
    ap.add_argument("--align-stops", action="store_true",
                    help="save at every validation and let a run stopped by its minutes end at its last validation "
                         "step (the next call retrains the steps past it), so concurrent runs share validation steps")
    ap.add_argument("--clips-cache", default=None,
                    help="keep rendered clips in this folder (tensors only) so concurrent arms render once")
    ap.add_argument("--speedup-table", type=_readable_file,
                    default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         "sparse_attention-h200-20261130.json"),
                    help="the dispatcher's measured kernel speedups (DSVConfig.speedup_table; GPU runs only; "
                         "'none': the FLOP model)")
    ap.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--save-dir", default=None,
                    help="save each arm's run (model, DSV state, optimizer, RNG) as <label>.pt here at its end, and "
                         "resume from it when it exists: a long run continues across calls")


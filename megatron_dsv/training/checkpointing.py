"""Checkpoint save / resume with ``megatron.core.dist_checkpointing``.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt      the newest complete iteration ("150")
    DIR/iter_0000150/                           dist_checkpointing files (model incl. DSV state,
                                                optimizer, the EMA of the weights under ``ema.*``), plus
        train_state.json                        iteration, consumed samples, args, model/DSV config,
                                                LR-scheduler state, and size + sha256 of every file
        rng/rank_00000.json                     per-rank RNG states (torch, cuda, python, numpy,
                                                Megatron's tensor-parallel tracker)

A checkpoint is written into ``.tmp_iter_*`` and renamed once complete, and the tracker is
replaced atomically, so a crash never leaves a half-written "latest". Non-tensor metadata is JSON;
the only torch.load in the loading path is weights_only=True. Loading checks every file against
the manifest first and raises ``CheckpointError`` naming the file; nothing on disk is modified.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import shutil
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_dsv.checksums import file_sha256
from megatron_dsv.config import DSVConfig
from megatron_dsv.training.distributed import barrier, is_rank0
from megatron_dsv.training.optim import unwrap

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint_dir", "has_checkpoint",
           "verify_checkpoint", "read_train_state", "load_model_for_inference", "check_scheduler", "check_dsv_state",
           "dsv_state_keys", "dsv_config_from_dict", "TRACKER_FILE", "STATE_FILE"]

FORMAT = "megatron_dsv.checkpoint/1"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "train_state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the offending file."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


# ---------------------------------------------------------------- RNG states as JSON
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def get_rng_state() -> dict:
    from megatron.core import tensor_parallel

    py = random.getstate()
    np_state = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "torch": _b64(torch.get_rng_state()),
             "cuda": _b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None}
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states() if torch.cuda.is_available() else {}
    state["tracker"] = {name: _b64(s) for name, s in tracker.items() if isinstance(s, torch.Tensor)}
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    if state.get("tracker") and torch.cuda.is_available():
        tensor_parallel.get_cuda_rng_tracker().set_states({n: _unb64(s) for n, s in state["tracker"].items()})


# ---------------------------------------------------------------- manifest
def _manifest(directory: str, checksums: bool = True) -> dict:
    files = {}
    for base, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, directory)
            if rel != STATE_FILE:
                files[rel] = {"size": os.path.getsize(path)}
                if checksums:
                    files[rel]["sha256"] = file_sha256(path)
    return files


def _write_json_atomic(path: str, payload) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- save
def _sharded_state(model, optimizer, is_loading: bool, ema=None, skip_model_keys=()) -> dict:
    """What dist_checkpointing saves / loads: {"model", "optimizer"?, "ema"?}; ``skip_model_keys`` are
    left out of the model's part (weights-only loads), after the optimizer and EMA took their layout."""
    model_state = unwrap(model).sharded_state_dict()
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    if ema is not None:
        state["ema"] = ema.sharded_state_dict(model_state)
    if skip_model_keys:
        skip = set(skip_model_keys)
        state["model"] = {k: v for k, v in model_state.items() if k not in skip}
    return state


def _have_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def _save_strategy():
    """Megatron-Core's torch_dist save strategy on GPU; the same format written synchronously through
    torch.distributed.checkpoint's FileSystemWriter where the stock writer cannot run (a CPU-only torch:
    its staging calls torch.cuda.synchronize; no psutil: it measures memory with it)."""
    if torch.cuda.is_available() and _have_psutil():
        return None
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    class HostSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            planner = mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                   flatten_state_dict=False)
            dcp_save(mcore_torch.mcore_to_pyt_state_dict(state, False), storage_writer=FileSystemWriter(checkpoint_dir),
                     planner=planner)

    return HostSaveStrategy("torch_dist", 1)


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, train_state: dict,
                    checksums: bool = True, ema=None) -> str:
    """Write ``root/iter_<iteration>`` atomically and point the tracker at it; returns its path.

    ``train_state`` holds JSON-able run metadata (consumed_samples, args, model_config, ...).
    ``checksums=False`` records sizes only (hashing tens of GB on rank 0 costs a minute per save).
    ``ema``: a :class:`~megatron_dsv.training.ema.ModelEMA` saved beside the weights (its averages
    sharded as they are, its update count in train_state.json)."""
    from megatron.core import dist_checkpointing

    final, tmp = iteration_dir(root, iteration), os.path.join(root, f".tmp_iter_{iteration:07d}")
    if is_rank0():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(tmp)  # empty: dist_checkpointing treats a non-empty target as a stale checkpoint
    barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False, ema=ema), tmp,
                            sharded_strategy=_save_strategy())
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    _write_json_atomic(os.path.join(tmp, "rng", f"rank_{rank:05d}.json"), get_rng_state())
    barrier()
    if is_rank0():
        payload = {"format": FORMAT, "iteration": iteration, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                   "scheduler": _jsonable(scheduler.state_dict()) if scheduler is not None else None,
                   "has_optimizer": optimizer is not None, "ema": ema.meta() if ema is not None else None,
                   **_jsonable(train_state)}
        payload["files"] = _manifest(tmp, checksums)
        _write_json_atomic(os.path.join(tmp, STATE_FILE), payload)
        if os.path.exists(final):
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        tracker = os.path.join(root, TRACKER_FILE)
        with open(tracker + ".tmp", "w") as f:
            f.write(f"{iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    barrier()
    return final


# ---------------------------------------------------------------- load
def has_checkpoint(path: str) -> bool:
    """True when ``path`` is a --save root with a tracker file or one checkpoint folder."""
    return os.path.isfile(os.path.join(path, TRACKER_FILE)) or os.path.isfile(os.path.join(path, STATE_FILE))


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` is a --save root (uses its tracker) or one ``iter_*`` folder."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"no checkpoint at {path!r}: neither {STATE_FILE} nor {tracker} exists")
    with open(tracker, "rb") as f:
        raw = f.read(256)
    text = raw.decode("utf-8", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"checkpoint tracker {tracker} must hold the newest complete iteration as decimal "
                              f"digits (e.g. '150'), got {raw[:40]!r}; the file is damaged: write the number of an "
                              f"existing iter_* folder into it, or --load that folder directly")
    directory = iteration_dir(path, int(text))
    if not os.path.isdir(directory):
        raise CheckpointError(f"{tracker} names iteration {text} but {directory} does not exist")
    return directory


def read_train_state(directory: str) -> dict:
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"missing {path}: not a complete megatron_dsv checkpoint")
    try:
        with open(path) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): the checkpoint is corrupt") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {state.get('format') if isinstance(state, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    return state


def verify_checkpoint(directory: str) -> dict:
    """Check every file against the manifest (size, sha256); returns the train state."""
    state = read_train_state(directory)
    for rel, meta in sorted(state.get("files", {}).items()):
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file missing: {path} (listed in {STATE_FILE})")
        if os.path.getsize(path) != meta["size"] or ("sha256" in meta and file_sha256(path) != meta["sha256"]):
            raise CheckpointError(f"checkpoint file corrupt: {path} (size or sha256 differs from {STATE_FILE})")
    common = os.path.join(directory, "common.pt")
    if os.path.isfile(common):
        try:  # dist_checkpointing's common state: plain values only, never arbitrary pickles
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{common} does not load with weights_only=True: {err}") from err
    return state


def check_model_config(state: dict, model_config, directory: str) -> None:
    saved, current = state.get("model_config"), _jsonable(model_config)
    if saved is None:
        return
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {current.get(k)!r}" for k in diff[:8])
        raise CheckpointError(f"model in {os.path.join(directory, STATE_FILE)} does not match this run ({detail})")


OPTIMIZER_LAYOUT_ARGS = {"qk_norm_lr_mult": 1.0}
"""Flags (with the value a checkpoint written before the flag existed had) that shape the optimizer's
parameter groups: a resumed run must use the saved value to load the optimizer state."""


def check_optimizer_args(state: dict, args, directory: str) -> None:
    """CheckpointError naming the flag when ``args`` would build other optimizer groups than the saved run."""
    saved = state.get("args") or {}
    for key, default in OPTIMIZER_LAYOUT_ARGS.items():
        was, now = saved.get(key, default), getattr(args, key, default)
        if was != now:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"{flag} is {now} but the checkpoint {directory} was trained with {flag} {was}: "
                                  f"pass {flag} {was} to resume its optimizer state (or --no-load-optim)")


SCHEDULE_FLAGS = (("max_lr", "--lr"), ("min_lr", "--min-lr"),
                  ("lr_warmup_steps", "--lr-warmup-iters (default: 10% of --lr-decay-iters, at most 20)"),
                  ("lr_decay_steps", "--lr-decay-iters (default: --train-iters)"),
                  ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"), ("end_wd", "--weight-decay"))
"""The LR-scheduler fields a resumed run must agree on with its checkpoint, and the flags that set them.
(The weight-decay increment steps follow --train-iters too but are unused: weight decay is constant.)"""


def check_scheduler(saved: dict, scheduler, args, directory: str) -> None:
    """Megatron-LM's rule: a resumed run whose LR schedule differs from the checkpoint's is refused
    unless told ``--override-opt-param-scheduler`` (this run's flags) or
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's schedule)."""
    if getattr(args, "override_opt_param_scheduler", False) or getattr(args, "use_checkpoint_opt_param_scheduler",
                                                                       False):
        return
    diffs = {}  # flag -> message: --weight-decay sets two fields
    for key, flag in SCHEDULE_FLAGS:
        if key in saved and saved[key] != getattr(scheduler, key):
            diffs.setdefault(flag, f"{flag} gives {getattr(scheduler, key)!r}, the checkpoint {saved[key]!r}")
    if diffs:
        raise CheckpointError(f"this run's learning-rate schedule differs from the checkpoint {directory}'s: "
                              f"{'; '.join(diffs.values())}. Pass --override-opt-param-scheduler to use this run's "
                              "flags, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")


def dsv_state_keys(model) -> list:
    """State-dict keys of the model's DSV state: everything under a DSVCoreAttention (predictors and
    their Adam moments, smoothed sparsity, budgets, stage, counters, CP plan)."""
    from megatron_dsv.attention import DSVCoreAttention

    bare = unwrap(model)
    prefixes = tuple(name + "." for name, m in bare.named_modules() if isinstance(m, DSVCoreAttention))
    return [key for key in bare.state_dict() if prefixes and key.startswith(prefixes)]


def check_dsv_state(state: dict, model, directory: str, load_dsv_state: bool = True) -> list:
    """Keys to leave out of the load: none when the checkpoint and the run agree on DSV; the run's DSV
    keys with ``load_dsv_state=False`` (--no-load-dsv-state); otherwise a CheckpointError naming the flags."""
    keys = dsv_state_keys(model)
    saved_dsv, run_dsv = bool(state.get("dsv_config")), bool(keys)
    if not load_dsv_state:
        if is_rank0() and (saved_dsv or run_dsv):
            print(" > --no-load-dsv-state: weights loaded without DSV state" + (
                  "; DSV starts afresh (stage 1, new predictors)" if run_dsv else
                  " (the checkpoint's predictors, sparsity and stage are dropped)"), flush=True)
        return keys
    if saved_dsv and not run_dsv:
        raise CheckpointError(f"checkpoint {directory} was trained with --use-dsv-attention and holds DSV state "
                              "(predictors, per-head sparsity, stage) that this run, without --use-dsv-attention, "
                              "would drop: pass --use-dsv-attention to resume it, or --no-load-dsv-state to load "
                              "its weights into dense attention")
    if run_dsv and not saved_dsv:
        raise CheckpointError(f"checkpoint {directory} has no DSV state (trained without --use-dsv-attention): "
                              "pass --no-load-dsv-state to start DSV (stage 1, fresh predictors) from its weights, "
                              "or leave --use-dsv-attention out")
    if saved_dsv and "stage1_local_radius" not in state["dsv_config"] and is_rank0():
        from megatron_dsv.attention import dsv_layers

        if any(layer.dsv_config.stage1_local_radius is None for layer in dsv_layers(model)):
            print(f" > checkpoint {directory} was saved before --dsv-stage1-local-radius existed (its stage 1 was "
                  "dense); this run's default (auto) attends a 3D window in stage 1 where it applies: pass "
                  "--dsv-stage1-local-radius 0 0 0 to keep a dense stage 1", flush=True)
    if saved_dsv and is_rank0():
        _note_switch_change(state["dsv_config"], model, directory)
    return []


def _note_switch_change(saved: dict, model, directory: str) -> None:
    """One line when this run's stage switch is not the checkpoint's: a run saved in stage 1 under the loss rule
    (the default before 2026-12-06) and resumed past step 400 on today's default switches at once."""
    from megatron_dsv.attention import dsv_layers

    layers = dsv_layers(model)
    if not layers:
        return
    cfg = layers[0].dsv_config
    was = (saved.get("stage_switch_rule", "loss_or_steps"), saved.get("stage_switch_steps"))
    now = (cfg.stage_switch_rule, cfg.stage_switch_steps)
    if was != now:
        print(f" > checkpoint {directory} was trained with the stage switch rule {was[0]!r} at step {was[1]}; this "
              f"run's is {now[0]!r} at step {now[1]} (--dsv-stage-switch-rule, --dsv-stage-switch-steps): a run still "
              "in stage 1 past that step moves to stage 2 at its next step", flush=True)


def load_checkpoint(path: str, model, optimizer, scheduler, model_config=None, load_optim: bool = True,
                    load_rng: bool = True, args=None, ema=None, load_dsv_state: bool = True) -> dict:
    """Restore model (incl. DSV state), optimizer, scheduler, EMA and RNG; returns the train state.

    ``args`` (the run's flags): checked against the saved run's for the optimizer's group layout and
    the LR schedule. ``ema``: a ModelEMA restored from the checkpoint, or (a checkpoint without one)
    restarted at the loaded weights. ``load_dsv_state=False``: weights only (--no-load-dsv-state)."""
    from megatron.core import dist_checkpointing

    directory = resolve_checkpoint_dir(path)
    state = verify_checkpoint(directory)
    if model_config is not None:
        check_model_config(state, model_config, directory)
    skip = check_dsv_state(state, model, directory, load_dsv_state)
    load_optim = load_optim and optimizer is not None and state.get("has_optimizer", False)
    if load_optim and args is not None:
        check_optimizer_args(state, args, directory)
        if scheduler is not None and state.get("scheduler"):
            check_scheduler(state["scheduler"], scheduler, args, directory)
    with_ema = ema is not None and bool(state.get("ema"))
    sharded = _sharded_state(model, optimizer if load_optim else None, is_loading=True,
                             ema=ema if with_ema else None, skip_model_keys=skip)
    try:
        loaded = dist_checkpointing.load(sharded, directory)
        if skip:
            current = unwrap(model).state_dict()
            loaded["model"].update({key: current[key] for key in skip})
        unwrap(model).load_state_dict(loaded["model"], strict=True)
        if load_optim:
            optimizer.load_state_dict(loaded["optimizer"])
        if with_ema:
            ema.load_sharded(loaded["ema"], state["ema"])
    except Exception as err:
        raise CheckpointError(f"cannot load checkpoint {directory}: {type(err).__name__}: {err}") from err
    if load_optim and scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    _ema_notes(ema, state, model, directory)
    if load_rng:
        _restore_rng(directory, state)
    return state


def _ema_notes(ema, state: dict, model, directory: str) -> None:
    """An EMA-free checkpoint (saved before --ema-decay, or with 0) restarts the EMA at its weights; an
    EMA in the checkpoint that this run does not keep is left there. Both said once."""
    if ema is not None and not state.get("ema"):
        ema.reset(unwrap(model))
        if is_rank0():
            print(f" > checkpoint {directory} holds no EMA of the weights (saved before --ema-decay existed, or with "
                  "--ema-decay 0): the EMA starts from the loaded weights", flush=True)
    elif ema is None and state.get("ema") and is_rank0():
        print(f" > checkpoint {directory} holds an EMA of the weights; --ema-decay 0: not used", flush=True)


def _restore_rng(directory: str, state: dict) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.get("world_size") != world:
        if is_rank0():
            print(f" > checkpoint saved with {state.get('world_size')} ranks, running {world}: RNG states not "
                  "restored", flush=True)
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = os.path.join(directory, "rng", f"rank_{rank:05d}.json")
    try:
        with open(rng_path) as f:
            set_rng_state(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot restore RNG state from {rng_path}: {err}") from err


def load_model_for_inference(ckpt_dir: str, device="cpu", dtype: Optional[torch.dtype] = None, ema: bool = False):
    """Build the checkpoint's VideoDiT (with its DSV config and state) and load its weights.

    ``ema=True``: the trainable weights are the checkpoint's EMA (what validation and the trainer's
    samples use); a checkpoint without one raises CheckpointError. Sets up a single-process gloo group
    and Megatron's model-parallel state when none exists. Returns ``(model, cfg)`` with the model in
    eval mode on ``device``."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

    from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit
    from megatron_dsv.training.distributed import _init_default_group
    from megatron_dsv.training.ema import ModelEMA

    directory = resolve_checkpoint_dir(ckpt_dir)
    state = verify_checkpoint(directory)
    if ema and not state.get("ema"):
        raise CheckpointError(f"checkpoint {directory} holds no EMA of the weights (saved with --ema-decay 0 or "
                              "before it existed): load it with ema=False")
    device = torch.device(device)
    if not dist.is_initialized():
        _init_default_group("nccl" if device.type == "cuda" else "gloo", device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        if torch.cuda.is_available():
            tensor_parallel.model_parallel_cuda_manual_seed(int(state.get("args", {}).get("seed", 1234)))
    cfg = config_from_dict(VideoDiTConfig, state["model_config"])
    dsv = dsv_config_from_dict(state["dsv_config"]) if state.get("dsv_config") else None
    model = build_video_dit(cfg, dsv_config=dsv, dtype=dtype or torch.float32).to(device)
    averaged = ModelEMA(model, state["ema"]["decay"]) if ema else None
    try:
        sharded = _sharded_state(model, None, is_loading=True, ema=averaged)
        loaded = dist_checkpointing.load(sharded, directory)
        model.load_state_dict(loaded["model"], strict=True)
        if averaged is not None:
            averaged.load_sharded(loaded["ema"], state["ema"])
            averaged.copy_to(model)
    except Exception as err:
        raise CheckpointError(f"cannot load model from {directory}: {type(err).__name__}: {err}") from err
    return model.eval(), cfg


def dsv_config_from_dict(values: dict) -> DSVConfig:
    """The DSVConfig a checkpoint was saved with. A checkpoint from before ``max_density`` existed (2026-12-02)
    trained with uncapped lists: it gets None, not today's default cap; one from before ``stage1_local_radius``
    (2026-12-03) trained a dense stage 1: it gets (0, 0, 0), not today's auto window."""
    return DSVConfig(**{"max_density": None, "stage1_local_radius": (0, 0, 0), **values})


def config_from_dict(cls, values: dict):
    """Dataclass from its JSON dict: lists go back to tuples where the field default is a tuple."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise CheckpointError(f"checkpoint model_config has fields {unknown} unknown to {cls.__name__}")
    kwargs = {}
    for key, value in values.items():
        default = names[key].default
        kwargs[key] = tuple(value) if isinstance(value, list) and isinstance(default, tuple) else value
    return cls(**kwargs)

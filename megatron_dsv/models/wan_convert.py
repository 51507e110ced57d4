"""diffusers ``WanTransformer3DModel`` weights <-> :class:`~megatron_dsv.models.wan.WanTransformer` weights.

Two layouts of our side: the *full* state (every tensor whole, as at TP = 1; what the mapping
produces) and a model's *local* state (its TP shard: column-parallel weights split along dim 0, row-parallel
along dim 1, as each parameter's ``partition_dim`` says). Only safetensors are read: a folder holding
pickled weights (``.bin``, ``.pt``) is refused, never ``torch.load``-ed.

The mapping per layer ``i`` (diffusers -> ours, ``decoder.layers.i.``):

    attn1.to_q / to_k / to_v       -> self_attention.linear_qkv     rows regrouped per head: [q_h, k_h, v_h]
    attn1.norm_q / norm_k          -> self_attention.q_layernorm / k_layernorm
    attn1.to_out.0                 -> self_attention.linear_proj
    attn2.to_q                     -> cross_attention.linear_q
    attn2.to_k / to_v              -> cross_attention.linear_kv     rows regrouped per head: [k_h, v_h]
    attn2.norm_q / norm_k          -> cross_attention.q_layernorm / k_layernorm
    attn2.to_out.0                 -> cross_attention.linear_proj
    norm2                          -> pre_cross_attn_layernorm       (cross_attn_norm only)
    ffn.net.0.proj / ffn.net.2     -> mlp.linear_fc1 / linear_fc2
    scale_shift_table              -> scale_shift_table

and outside the layers ``patch_embedding`` (Conv3d, kernel = stride = patch) -> ``patch_embed`` (Linear on
the flattened (C, pt, ph, pw) patch), ``condition_embedder.{time_embedder, time_proj, text_embedder}`` ->
``{time_embedder, time_proj, text_embedder}``, ``scale_shift_table``, ``proj_out`` unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import torch

from megatron_dsv.models.wan_config import WanConfig

__all__ = ["diffusers_shapes", "diffusers_to_ours", "ours_to_diffusers", "load_diffusers_folder", "CONFIG_NAME",
           "save_megatron_checkpoint", "load_megatron_checkpoint", "read_megatron_config",
           "save_diffusers_folder", "load_into_model", "full_state_from_model", "WEIGHTS_NAME", "INDEX_NAME"]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

_WB = ("weight", "bias")
# our prefix -> diffusers prefix, one-to-one (weight and bias)
_TOP = {"time_embedder.linear_1": "condition_embedder.time_embedder.linear_1",
        "time_embedder.linear_2": "condition_embedder.time_embedder.linear_2",
        "time_proj": "condition_embedder.time_proj",
        "text_embedder.linear_1": "condition_embedder.text_embedder.linear_1",
        "text_embedder.linear_2": "condition_embedder.text_embedder.linear_2",
        "proj_out": "proj_out"}
_LAYER = {"self_attention.linear_proj": "attn1.to_out.0", "cross_attention.linear_q": "attn2.to_q",
          "cross_attention.linear_proj": "attn2.to_out.0", "mlp.linear_fc1": "ffn.net.0.proj",
          "mlp.linear_fc2": "ffn.net.2"}
_NORMS = {"self_attention.q_layernorm": "attn1.norm_q", "self_attention.k_layernorm": "attn1.norm_k",
          "cross_attention.q_layernorm": "attn2.norm_q", "cross_attention.k_layernorm": "attn2.norm_k"}


def diffusers_shapes(cfg: WanConfig) -> Dict[str, Tuple[int, ...]]:
    """Every key of a diffusers text-to-video ``WanTransformer3DModel`` state dict of shape ``cfg``, with its shape."""
    h, f, p = cfg.hidden, cfg.ffn_dim, cfg.patch_size
    shapes = {"patch_embedding.weight": (h, cfg.in_channels, *p), "patch_embedding.bias": (h,),
              "scale_shift_table": (1, 2, h)}
    linear = {"condition_embedder.time_embedder.linear_1": (h, cfg.freq_dim),
              "condition_embedder.time_embedder.linear_2": (h, h), "condition_embedder.time_proj": (6 * h, h),
              "condition_embedder.text_embedder.linear_1": (h, cfg.text_dim),
              "condition_embedder.text_embedder.linear_2": (h, h), "proj_out": (cfg.out_dim, h)}
    for i in range(cfg.num_layers):
        b = f"blocks.{i}."
        shapes[b + "scale_shift_table"] = (1, 6, h)
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                linear[f"{b}{attn}.{proj}"] = (h, h)
            shapes[f"{b}{attn}.norm_q.weight"] = shapes[f"{b}{attn}.norm_k.weight"] = (h,)
        linear[b + "ffn.net.0.proj"], linear[b + "ffn.net.2"] = (f, h), (h, f)
        if cfg.cross_attn_norm:
            shapes[b + "norm2.weight"] = shapes[b + "norm2.bias"] = (h,)
    for name, (out, inp) in linear.items():
        shapes[name + ".weight"], shapes[name + ".bias"] = (out, inp), (out,)
    return shapes


# Keys diffusers itself drops on load (WanTransformer3DModel._keys_to_ignore_on_load_unexpected): unused.
_IGNORED = ("norm_added_q",)


def _drop_ignored(state: dict) -> dict:
    return {k: v for k, v in state.items() if not any(part in k for part in _IGNORED)}


def _check_diffusers_state(state: dict, cfg: WanConfig) -> None:
    expected = diffusers_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"diffusers state dict does not match WanConfig {_shape_summary(cfg)}: missing keys "
                         f"{_few(missing)}, unexpected keys {_few(unexpected)}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"diffusers key {key!r} has shape {tuple(state[key].shape)}, expected {shape} "
                             f"for WanConfig {_shape_summary(cfg)}")


def _few(keys, n: int = 8):
    return keys if len(keys) <= n else keys[:n] + [f"... {len(keys) - n} more"]


def _shape_summary(cfg: WanConfig) -> str:
    return (f"(num_layers={cfg.num_layers}, hidden={cfg.hidden}, heads={cfg.num_attention_heads}, "
            f"ffn_dim={cfg.ffn_dim}, text_dim={cfg.text_dim}, in/out_channels={cfg.in_channels}/{cfg.out_channels})")


def _per_head(parts, heads: int) -> torch.Tensor:
    """``[heads*hn, ...]`` tensors (q, k, v) -> rows regrouped per head ``[heads * len(parts) * hn, ...]``."""
    split = [t.reshape(heads, -1, *t.shape[1:]) for t in parts]
    return torch.stack(split, dim=1).reshape(-1, *parts[0].shape[1:])


def _from_per_head(t: torch.Tensor, heads: int, n: int):
    """Inverse of :func:`_per_head`: ``n`` tensors ``[heads*hn, ...]`` (cloned: they are saved separately)."""
    split = t.reshape(heads, n, -1, *t.shape[1:])
    return [split[:, j].reshape(-1, *t.shape[1:]).clone() for j in range(n)]


def diffusers_to_ours(state: dict, cfg: WanConfig) -> Dict[str, torch.Tensor]:
    """diffusers state dict -> our *full* state dict (no DSV state, no ``_extra_state``). ValueError names
    the first key or shape that does not match ``cfg``. Keys diffusers ignores on load (``norm_added_q``)
    are dropped."""
    state = _drop_ignored(state)
    _check_diffusers_state(state, cfg)
    H = cfg.num_attention_heads
    out = {"patch_embed.weight": state["patch_embedding.weight"].reshape(cfg.hidden, -1),
           "patch_embed.bias": state["patch_embedding.bias"], "scale_shift_table": state["scale_shift_table"]}
    for ours, theirs in _TOP.items():
        for wb in _WB:
            out[f"{ours}.{wb}"] = state[f"{theirs}.{wb}"]
    for i in range(cfg.num_layers):
        b, o = f"blocks.{i}.", f"decoder.layers.{i}."
        out[o + "scale_shift_table"] = state[b + "scale_shift_table"]
        for wb in _WB:
            out[f"{o}self_attention.linear_qkv.{wb}"] = _per_head(
                [state[f"{b}attn1.to_{x}.{wb}"] for x in "qkv"], H)
            out[f"{o}cross_attention.linear_kv.{wb}"] = _per_head(
                [state[f"{b}attn2.to_{x}.{wb}"] for x in "kv"], H)
            for ours, theirs in _LAYER.items():
                out[f"{o}{ours}.{wb}"] = state[f"{b}{theirs}.{wb}"]
            if cfg.cross_attn_norm:
                out[f"{o}pre_cross_attn_layernorm.{wb}"] = state[f"{b}norm2.{wb}"]
        for ours, theirs in _NORMS.items():
            out[f"{o}{ours}.weight"] = state[f"{b}{theirs}.weight"]
    return out


def ours_to_diffusers(state: dict, cfg: WanConfig) -> Dict[str, torch.Tensor]:
    """Our *full* state dict -> diffusers' (the inverse of :func:`diffusers_to_ours`, exact)."""
    H, p = cfg.num_attention_heads, cfg.patch_size
    expected = set(_our_keys(cfg))
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"our state dict lacks keys {_few(missing)} for WanConfig {_shape_summary(cfg)}")
    out = {"patch_embedding.weight": state["patch_embed.weight"].reshape(cfg.hidden, cfg.in_channels, *p),
           "patch_embedding.bias": state["patch_embed.bias"], "scale_shift_table": state["scale_shift_table"]}
    for ours, theirs in _TOP.items():
        for wb in _WB:
            out[f"{theirs}.{wb}"] = state[f"{ours}.{wb}"]
    for i in range(cfg.num_layers):
        b, o = f"blocks.{i}.", f"decoder.layers.{i}."
        out[b + "scale_shift_table"] = state[o + "scale_shift_table"]
        for wb in _WB:
            for x, t in zip("qkv", _from_per_head(state[f"{o}self_attention.linear_qkv.{wb}"], H, 3)):
                out[f"{b}attn1.to_{x}.{wb}"] = t
            for x, t in zip("kv", _from_per_head(state[f"{o}cross_attention.linear_kv.{wb}"], H, 2)):
                out[f"{b}attn2.to_{x}.{wb}"] = t
            for ours, theirs in _LAYER.items():
                out[f"{b}{theirs}.{wb}"] = state[f"{o}{ours}.{wb}"]
            if cfg.cross_attn_norm:
                out[f"{b}norm2.{wb}"] = state[f"{o}pre_cross_attn_layernorm.{wb}"]
        for ours, theirs in _NORMS.items():
            out[f"{b}{theirs}.weight"] = state[f"{o}{ours}.weight"]
    _check_diffusers_state(out, cfg)
    return out


def _our_keys(cfg: WanConfig):
    """The keys :func:`diffusers_to_ours` produces (computed on meta tensors, no data)."""
    meta = {k: torch.empty(s, device="meta") for k, s in diffusers_shapes(cfg).items()}
    return list(diffusers_to_ours(meta, cfg))


# ---------------------------------------------------------------- folders
def load_diffusers_folder(folder: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``(config dict, state dict)`` of a diffusers ``WanTransformer3DModel`` folder (the ``transformer/``
    subfolder of a pipeline): ``config.json`` plus one safetensors file or an index of shards."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{folder!r} is not a diffusers model folder: no config.json (for a pipeline, pass its "
                         "transformer/ subfolder)")
    with open(cfg_path) as f:
        config = json.load(f)
    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        pickles = sorted(n for n in os.listdir(folder) if n.endswith(_PICKLES))
        raise ValueError(f"{folder!r} holds no {WEIGHTS_NAME} nor {INDEX_NAME}"
                         + (f" (pickled weights {pickles} are never loaded: re-save with safe_serialization=True)"
                            if pickles else ""))
    state = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    return config, state


def save_diffusers_folder(folder: str, cfg: WanConfig, state: Dict[str, torch.Tensor],
                          max_shard_bytes: int = 5 * 2 ** 30) -> None:
    """Write ``config.json`` and safetensors (sharded with an index above ``max_shard_bytes``) that
    ``WanTransformer3DModel.from_pretrained(folder)`` loads."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg.to_diffusers(), f, indent=2, sort_keys=True)
    shards, current, size = [], {}, 0
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key], size = t, size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, start=1):
        name = f"diffusion_pytorch_model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(folder, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------- full <-> a model's TP shard
def _tp_rank_size():
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 0, 1, None
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def load_into_model(model, full: Dict[str, torch.Tensor]) -> None:
    """Copy our *full* state into ``model`` (a WanTransformer, any TP degree): each TP-sharded parameter gets
    this rank's slice. Model keys outside the mapping (DSV state, ``_extra_state``) keep their values."""
    from megatron_dsv.models.wan import unwrap_wan

    bare = unwrap_wan(model)
    rank, size, _ = _tp_rank_size()
    params = dict(bare.named_parameters())
    local = bare.state_dict()
    missing = sorted(set(full) - set(local))
    if missing:
        raise ValueError(f"model has no parameters {_few(missing)}: built with another WanConfig?")
    new = dict(local)
    for key, tensor in full.items():
        p = params.get(key)
        if p is not None and getattr(p, "tensor_model_parallel", False) and size > 1:
            tensor = tensor.chunk(size, dim=p.partition_dim)[rank]
        if tuple(tensor.shape) != tuple(local[key].shape):
            raise ValueError(f"key {key!r}: converted shape {tuple(tensor.shape)} (this TP rank's slice) does not "
                             f"match the model's {tuple(local[key].shape)}")
        new[key] = tensor.to(local[key].dtype)
    unused = sorted(k for k in params if k not in full and ".core_attention." not in k)
    if unused:
        raise ValueError(f"model parameters {_few(unused)} have no diffusers counterpart")
    bare.load_state_dict(new, strict=True)


def full_state_from_model(model) -> Dict[str, torch.Tensor]:
    """Our *full* state of ``model`` (TP shards all-gathered; DSV state and ``_extra_state`` left out)."""
    import torch.distributed as dist

    from megatron_dsv.models.wan import unwrap_wan

    bare = unwrap_wan(model)
    _, size, group = _tp_rank_size()
    out = {}
    for key, p in bare.named_parameters():
        if ".core_attention." in key:
            continue
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[key] = t.clone()
    return out


# ---------------------------------------------------------------- Megatron dist_checkpointing
CONFIG_NAME = "wan_config.json"
_DTYPE_KEY = "_params_dtype"  # beside the WanConfig fields in wan_config.json: the checkpoint's dtype


def _weight_keys(sharded: dict) -> dict:
    """The Wan weights of a sharded state dict: DSV state (under ``core_attention.``) left out."""
    return {k: v for k, v in sharded.items() if ".core_attention." not in k}


def save_megatron_checkpoint(model, directory: str) -> None:
    """dist_checkpointing save of ``model``'s weights (TP-sharded as built; no DSV state) as
    ``{"model": ...}`` (the trainer's layout), plus ``wan_config.json``. Every rank calls it."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_dsv.models.wan import unwrap_wan
    from megatron_dsv.training.checkpointing import _save_strategy

    bare = unwrap_wan(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(directory, exist_ok=True)
        if os.listdir(directory):
            raise ValueError(f"checkpoint directory {directory!r} is not empty: pass a new one")
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save({"model": _weight_keys(bare.sharded_state_dict())}, directory,
                            sharded_strategy=_save_strategy())
    if rank0:
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            dtype = str(bare.patch_embed.weight.dtype).replace("torch.", "")
            json.dump({**bare.wan_config.to_dict(), _DTYPE_KEY: dtype}, f, indent=1, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()


def read_megatron_config(directory: str) -> Tuple[WanConfig, torch.dtype]:
    """The WanConfig and parameter dtype saved beside a converted checkpoint (``wan_config.json``)."""
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} has no {CONFIG_NAME}: not a checkpoint written by tools/convert_checkpoint.py "
                         "(pass --config-from DIFFUSERS_DIR or the WanConfig of the run)")
    with open(path) as f:
        values = json.load(f)
    dtype = getattr(torch, values.pop(_DTYPE_KEY, "float32"))
    return WanConfig(**values), dtype


def convert_diffusers_folder(folder: str, directory: str, latent_grid=None, dtype=None,
                             tensor_model_parallel_size: int = 1):
    """A diffusers ``WanTransformer3DModel`` folder -> a Megatron dist checkpoint in ``directory`` (the
    ``to-megatron`` step of tools/convert_checkpoint.py): ``(WanConfig, the converted model)``. ``dtype`` None keeps the
    folder's; ``latent_grid`` None is WanConfig's default. Needs the TP group set up when TP > 1."""
    from megatron_dsv.models.wan import build_wan

    config, state = load_diffusers_folder(folder)
    cfg = WanConfig.from_diffusers(config) if latent_grid is None else WanConfig.from_diffusers(
        config, latent_grid=tuple(latent_grid))
    full = diffusers_to_ours(state, cfg)
    dtype = dtype or next(iter(state.values())).dtype
    # every weight is overwritten: skip Megatron's random init (minutes for 14B on a CPU)
    model = build_wan(cfg, use_te=False, dtype=dtype, tensor_model_parallel_size=tensor_model_parallel_size,
                      perform_initialization=False)
    load_into_model(model, full)
    save_megatron_checkpoint(model, directory)
    return cfg, model


def load_megatron_checkpoint(model, directory: str, ema: bool = False) -> None:
    """Load the Wan weights of a dist_checkpointing checkpoint (a converted one or a trainer's ``iter_*``)
    into ``model`` at any TP degree; the model's DSV state is left as it is (a fresh DSV run starts its
    predictors from their initialisation). ``ema``: the trainer's EMA of the weights (``--ema-decay``; what
    one samples with) instead of the live weights. Every rank calls it."""
    from megatron.core import dist_checkpointing

    from megatron_dsv.models.wan import unwrap_wan

    bare = unwrap_wan(model)
    sharded = _weight_keys(bare.sharded_state_dict())
    if ema:
        from megatron_dsv.training.ema import ModelEMA

        averaged = ModelEMA(bare, decay=0.5)  # only its layout: the shadow comes from the checkpoint
        loaded = dist_checkpointing.load({"ema": averaged.sharded_state_dict(sharded)}, directory)["ema"]
        averaged.load_sharded(loaded, {"num_updates": 0})
        averaged.copy_to(bare)
        return
    loaded = dist_checkpointing.load({"model": sharded}, directory)["model"]
    result = bare.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if ".core_attention." not in k and not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {directory!r} does not fit the model: missing {_few(missing)}, "
                         f"unexpected {_few(list(result.unexpected_keys))}")

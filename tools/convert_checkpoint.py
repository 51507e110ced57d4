#!/usr/bin/env python
"""Convert Wan2.1 checkpoints between diffusers and Megatron (megatron_dsv's WanTransformer).

    # diffusers folder (safetensors; a pipeline's transformer/ subfolder) -> Megatron dist_checkpointing
    python tools/convert_checkpoint.py to-megatron --diffusers Wan2.1-T2V-1.3B-Diffusers/transformer --out ckpt/wan13b
    # the same, written as TP=2 shards (not needed: any TP degree loads any checkpoint, see below)
    torchrun --nproc-per-node 2 tools/convert_checkpoint.py to-megatron --diffusers DIR --out CKPT --tp 2

    # Megatron checkpoint (a converted one or a trainer's iter_* folder) -> diffusers folder
    python tools/convert_checkpoint.py to-diffusers --megatron ckpt/wan13b --out wan13b-diffusers

The Megatron checkpoint holds the weights as ``{"model": sharded_state_dict}`` (the trainer's layout;
dist_checkpointing reshards on load, so a run at any TP degree reads it: convert in one process, which
holds the model once, rather than on every TP rank) and ``wan_config.json``. A trainer
checkpoint has no ``wan_config.json``: pass ``--config-from`` (the diffusers folder it came from, or a
converted checkpoint). Conversion runs on the CPU (``CUDA_VISIBLE_DEVICES`` is cleared) over gloo;
pickled weights (.bin/.pt) are refused, never unpickled. Needs ``pip install -e .[wan]`` only for
checking against diffusers, not for converting.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU job: set before torch is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-megatron", help="diffusers WanTransformer3DModel folder -> Megatron dist checkpoint")
    a.add_argument("--diffusers", required=True, help="folder with config.json and *.safetensors")
    a.add_argument("--out", required=True, help="new (empty) checkpoint folder")
    a.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="parameter dtype of the checkpoint (auto: the safetensors' dtype)")
    b = sub.add_parser("to-diffusers", help="Megatron dist checkpoint -> diffusers WanTransformer3DModel folder")
    b.add_argument("--megatron", required=True, help="converted checkpoint or trainer iter_* folder")
    b.add_argument("--out", required=True, help="output folder (config.json + safetensors)")
    b.add_argument("--config-from", default=None,
                   help="where to read the shape when --megatron has no wan_config.json: a diffusers folder or a "
                        "converted checkpoint")
    b.add_argument("--ema", action="store_true",
                   help="export the trainer's EMA of the weights (a checkpoint of a run with --ema-decay)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="dtype of the written tensors (auto: the checkpoint's; a trainer checkpoint read with "
                        "--config-from a diffusers folder: the dtype it was trained in must be given, default fp32)")
    return p


def _init_distributed(tp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            import tempfile

            store = tempfile.NamedTemporaryFile(prefix="dsv-convert-", delete=False).name
            dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"--tp {tp} must divide the number of processes ({world})")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def to_megatron(args) -> None:
    from megatron_dsv.models.wan_convert import convert_diffusers_folder

    tp = args.tp or _world_size()
    _init_distributed(tp)
    cfg, model = convert_diffusers_folder(args.diffusers, args.out, dtype=DTYPES[args.dtype],
                                          tensor_model_parallel_size=tp)
    dtype = next(model.parameters()).dtype
    _log(f"wrote {args.out}: {cfg.num_layers} layers, hidden {cfg.hidden}, TP {tp}, {dtype}")


def _config_for(args):
    """(WanConfig, dtype of the checkpoint's parameters)."""
    from megatron_dsv.models.wan_config import WanConfig
    from megatron_dsv.models.wan_convert import CONFIG_NAME, read_megatron_config

    source = args.megatron
    if not os.path.isfile(os.path.join(source, CONFIG_NAME)):
        if args.config_from is None:
            raise ValueError(f"{source!r} has no {CONFIG_NAME}: pass --config-from (the diffusers folder it was "
                             "converted from, or a converted checkpoint)")
        source = args.config_from
        if os.path.isfile(os.path.join(source, "config.json")):
            import json

            with open(os.path.join(source, "config.json")) as f:
                return WanConfig.from_diffusers(json.load(f)), DTYPES[args.dtype] or torch.float32
    return read_megatron_config(source)


def to_diffusers(args) -> None:
    import torch.distributed as dist

    from megatron_dsv.models.wan import build_wan
    from megatron_dsv.models.wan_convert import (full_state_from_model, load_megatron_checkpoint, ours_to_diffusers,
                                                 save_diffusers_folder)

    tp = _world_size()
    _init_distributed(tp)
    cfg, saved_dtype = _config_for(args)
    model = build_wan(cfg, use_te=False, dtype=saved_dtype, tensor_model_parallel_size=tp,
                      perform_initialization=False)
    load_megatron_checkpoint(model, args.megatron, ema=args.ema)
    state = ours_to_diffusers(full_state_from_model(model), cfg)
    if DTYPES[args.dtype] is not None:
        state = {k: v.to(DTYPES[args.dtype]) for k, v in state.items()}
    if dist.get_rank() == 0:
        save_diffusers_folder(args.out, cfg, state)
        _log(f"wrote {args.out} (diffusers: WanTransformer3DModel.from_pretrained({args.out!r}))")


def _log(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[convert_checkpoint] {msg}", flush=True)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"to-megatron": to_megatron, "to-diffusers": to_diffusers}[args.command](args)
    except ValueError as err:
        print(f"convert_checkpoint.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

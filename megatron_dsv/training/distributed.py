"""Process groups: from torchrun's environment (RANK/WORLD_SIZE/LOCAL_RANK) or a single process.

One call, ``initialize_distributed(args)``, sets the device, the default process group (nccl on
GPU, gloo on CPU), Megatron-Core's model-parallel groups (tp, pp=1, cp; dp is what is left) and
the seeds, and returns the ``ProcessGroupCollection`` that the model and optimizer receive.
Calling it again in the same process (tests) reuses the groups when their sizes match.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DistEnv", "initialize_distributed", "resolve_device", "set_seed", "is_rank0", "barrier"]


@dataclass
class DistEnv:
    """Where this process sits: device, ranks and the Megatron-Core process groups."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    tp_size: int
    cp_size: int
    pg_collection: object


def resolve_device(choice: str) -> torch.device:
    match choice:
        case "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        case "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda was given but no CUDA GPU is visible (allowed: auto, cpu, cuda)")
            return torch.device("cuda")
        case "cpu":
            return torch.device("cpu")
    raise ValueError(f"--device must be one of auto, cpu, cuda, got {choice!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_default_group(backend: str, device: torch.device) -> None:
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        init_method = "env://"
    elif world == 1:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    else:
        raise ValueError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (launch with torchrun or srun + torchrun)")
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=init_method, **kwargs)


def set_seed(seed: int, device: torch.device) -> None:
    """Same seed on every rank (identical initial weights under DP); Megatron's TP RNG tracker too."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device.type == "cuda":  # the tracker holds CUDA generator states: it cannot exist on a CPU-only torch
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_distributed(args) -> DistEnv:
    """Set up device, process groups and seeds from ``args`` (tp/cp sizes, backend, device, seed)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    device = resolve_device(args.device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = args.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--distributed-backend nccl needs --device cuda (allowed on CPU: gloo)")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if tp > 1 and device.type != "cuda":
        # megatron.core.tensor_parallel's gathers allocate on torch.cuda.current_device().
        raise ValueError(f"--tensor-model-parallel-size {tp} needs GPUs (megatron-core's tensor-parallel "
                         "collectives are CUDA-only); on CPU use 1 and data parallelism")
    _init_default_group(backend, device)
    world = dist.get_world_size()
    if world % (tp * cp) != 0:
        raise ValueError(f"world size {world} must be divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--context-parallel-size ({cp})")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != tp
                or parallel_state.get_context_parallel_world_size() != cp):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                                 context_parallel_size=cp)
    set_seed(args.seed, device)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return DistEnv(device=device, rank=dist.get_rank(), world_size=world, local_rank=local_rank,
                   dp_rank=parallel_state.get_data_parallel_rank(),
                   dp_size=parallel_state.get_data_parallel_world_size(), tp_size=tp, cp_size=cp,
                   pg_collection=pgs)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()

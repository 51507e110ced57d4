"""Run by torchrun in test_distributed.py: train, then write this rank's losses (and validation losses) as JSON."""

import json
import os
import sys

from megatron_dsv.training.arguments import parse_args
from megatron_dsv.training.trainer import train

if __name__ == "__main__":
    out = sys.argv[1]
    args = parse_args(sys.argv[2:])
    result = train(args)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"losses_rank{rank}.json"), "w") as f:
        json.dump({"losses": result.losses, "consumed_samples": result.consumed_samples,
                   "valid_losses": result.valid_losses}, f)
    # the teardown megatron_dsv.train does: process groups left to interpreter shutdown die in any order, and a
    # gloo thread still joinable then aborts the process ("terminate called without an active exception", seen
    # once in CI after a CP=2 run had finished and written its losses)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dsv.parallel.cp_attention import CPContext

    if dist.is_initialized():
        CPContext.release()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

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

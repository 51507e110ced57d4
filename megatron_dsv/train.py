"""Entry point: ``python -m megatron_dsv.train [flags]`` (console script ``dsv-train``).

``--use-dsv-attention`` alone runs the embedded default: the tiny video DiT with DSV attention on
synthetic videos (fp32 on CPU, bf16 on GPU), 300 iterations with stage 1 -> stage 2 at iteration 150,
checkpoints and a sample GIF under ``outputs/default/``; without the switch the same job trains with
dense attention (as a Megatron-LM launch script without ``--use-dsv-attention``). Under torchrun every process runs this same
command.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    import warnings

    from megatron_dsv.training.arguments import parse_args

    # Transformer Engine and Apex are optional: the banner names the layers in use instead of one
    # megatron-core warning per module that falls back.
    warnings.filterwarnings("ignore", message=r".*not installed\. Falling back.*")

    args = parse_args(argv)
    import torch.distributed as dist

    from megatron_dsv.training.trainer import train

    owns_group = not dist.is_initialized()  # a caller's process group (tests, notebooks) stays up
    try:
        train(args)
    except ValueError as err:  # configuration errors: one clear line instead of a traceback
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if owns_group and dist.is_initialized():
            from megatron.core import parallel_state

            from megatron_dsv.parallel.cp_attention import CPContext

            CPContext.release()  # DSV's CP groups must not outlive the default group into shutdown
            parallel_state.destroy_model_parallel()  # its groups die with the default group
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The Megatron-LM flags this Python environment needs for its fused kernels, one per line.

Megatron-LM (core_v0.16.1 and core_v0.19.0) defaults to Transformer Engine layers and to fusions
that need TE or apex, and stops at start-up, at model construction or in the first forward when they
are missing. What is printed, and the failure each flag avoids:

* ``--transformer-impl=local`` (no TE): the TE layer spec does not build
  (``NameError: name 'TESpecProvider' is not defined``);
* ``--no-rope-fusion`` (no TE): ``ValueError: apply_rope_fusion is not available. Please install TE >= 1.4``;
* ``--no-gradient-accumulation-fusion`` (no TE and no apex ``fused_weight_gradient_mlp_cuda``): RuntimeError
  in ColumnParallelLinear;
* ``--no-masked-softmax-fusion`` (no ``scaled_masked_softmax_cuda``): core_v0.19's dense attention fails with
  ``ModuleNotFoundError`` in its first forward (DSV layers do not use it; runs without
  ``--use-dsv-attention`` do);
* ``--no-persist-layer-norm`` (no apex): ``AssertionError: persist_layer_norm not supported by torch LayerNorm``.

The other fusions (``--no-bias-gelu-fusion``, ``--no-bias-dropout-fusion``, ``--no-bias-swiglu-fusion``)
fall back to PyTorch by themselves.

    python examples/megatron_lm/fusion_flags.py            # the flags, one per line (none on a full machine)
    python examples/megatron_lm/fusion_flags.py --explain  # which piece is missing, on stderr

The launchers (``pretrain_gpt_dsv.sh``, ``../video_dit/pretrain_video_dit.sh``) call this with the
interpreter that runs Megatron-LM, so the same script works unchanged with or without TE and apex.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Dict, List, Tuple

__all__ = ["available", "fusion_flags", "main"]


def _imports(name: str) -> bool:
    """True when ``import name`` works (any failure, e.g. a TE built for another torch, is 'missing')."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken install is as missing as an absent one
        return False
    return True


def available(importer: Callable[[str], bool] = _imports) -> Dict[str, bool]:
    """Which optional pieces import: ``transformer_engine``, ``apex``, apex's ``fused_weight_gradient_mlp_cuda``
    and ``scaled_masked_softmax_cuda`` (Megatron's fused softmax kernels, built with apex)."""
    names = ("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda")
    return {name: importer(name) for name in names}


def fusion_flags(have: Dict[str, bool]) -> List[Tuple[str, str]]:
    """``[(flag, why), ...]`` for the pieces missing from ``have`` (as :func:`available` returns)."""
    flags = []
    te = have.get("transformer_engine", False)
    if not te:
        flags.append(("--transformer-impl=local", "transformer_engine does not import: Megatron's local layers"))
        flags.append(("--no-rope-fusion", "transformer_engine does not import: RoPE without its fused kernel"))
        if not have.get("fused_weight_gradient_mlp_cuda", False):
            flags.append(("--no-gradient-accumulation-fusion",
                          "neither transformer_engine nor apex's fused_weight_gradient_mlp_cuda imports"))
    if not have.get("scaled_masked_softmax_cuda", False):
        flags.append(("--no-masked-softmax-fusion", "scaled_masked_softmax_cuda does not import: PyTorch softmax in "
                                                    "Megatron's dense attention (core_v0.19 fails without it)"))
    if not have.get("apex", False):
        flags.append(("--no-persist-layer-norm", "apex does not import: torch LayerNorm (no persistent kernel)"))
    return flags


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the Megatron-LM flags this environment needs "
                                                 "(missing transformer_engine / apex), one per line.")
    parser.add_argument("--explain", action="store_true", help="say on stderr which piece each flag stands for")
    args = parser.parse_args(argv)
    flags = fusion_flags(available())
    for flag, why in flags:
        print(flag)
        if args.explain:
            print(f"fusion_flags: {flag}: {why}", file=sys.stderr)
    if args.explain and not flags:
        print("fusion_flags: transformer_engine and apex import: Megatron-LM's defaults apply", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The Megatron-LM flags this Python environment needs for its fused kernels, one per line.

Megatron-LM (core_v0.16.1 and core_v0.19.0) defaults to Transformer Engine layers and to fusions
that need TE or apex, and stops at start-up or at model construction when they are missing:

=====================================  ==========================================  ===================
default                                 without it                                  flag printed
=====================================  ==========================================  ===================
``--transformer-impl transformer_engine``  no TE: the TE layer spec does not build      ``--transformer-impl local``
``apply_rope_fusion`` (RoPE models)     no TE: ``ValueError: apply_rope_fusion is   ``--no-rope-fusion``
                                        not available. Please install TE >= 1.4``
``gradient_accumulation_fusion``        local layers without apex's                 ``--no-gradient-accumulation-fusion``
                                        ``fused_weight_gradient_mlp_cuda``:
                                        RuntimeError in ColumnParallelLinear
``persist_layer_norm``                  no apex: ``AssertionError: persist_layer_   ``--no-persist-layer-norm``
                                        norm not supported by torch LayerNorm``
=====================================  ==========================================  ===================

(The other fusions, ``--no-masked-softmax-fusion``, ``--no-bias-gelu-fusion``,
``--no-bias-dropout-fusion``, ``--no-bias-swiglu-fusion``, fall back to PyTorch by themselves, and
DSV replaces the fused softmax's attention anyway.)

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
    """Which optional pieces import: ``transformer_engine``, ``apex``, apex's ``fused_weight_gradient_mlp_cuda``."""
    return {name: importer(name) for name in ("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda")}


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

"""megatron_dsv: DSV dynamic sparse attention for video DiT training, as a Megatron-LM plugin.

Data flows one way: args -> DSVConfig -> layer spec -> DSVCoreAttention ->
(grouping, predictor, dispatcher) -> ops / parallel. Nothing under ``ops`` or
``parallel`` reads Megatron's global args.
"""

__version__ = "0.1.0"

from megatron_dsv.config import DSVConfig  # noqa: E402

__all__ = ["DSVConfig", "__version__"]

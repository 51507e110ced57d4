"""The DSV method: core attention, grouping, predictor, profiler, dispatcher, schedule."""

from megatron_dsv.attention.core_attention import DSVCoreAttention

__all__ = ["DSVCoreAttention"]

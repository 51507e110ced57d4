"""Megatron-Core trainer for the video DiT (no Megatron-LM needed) and its checkpointing."""

__all__ = ["train", "parse_args", "load_model_for_inference"]


def __getattr__(name):
    # Lazy: importing the package must not pull megatron.core in (arguments are cheap to import).
    if name == "train":
        from megatron_dsv.training.trainer import train

        return train
    if name == "parse_args":
        from megatron_dsv.training.arguments import parse_args

        return parse_args
    if name == "load_model_for_inference":
        from megatron_dsv.training.checkpointing import load_model_for_inference

        return load_model_for_inference
    raise AttributeError(name)

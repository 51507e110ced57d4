"""Small-model flags and an in-process runner shared by the trainer tests."""

from megatron_dsv.training.arguments import parse_args

# 2 layers, hidden 64, 4x8x8 latents -> 64 tokens per video: a step costs tens of milliseconds on CPU.
SMALL = ["--use-dsv-attention", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
         "--model-override", "head_dim=32", "--model-override", "latent_frames=4",
         "--model-override", "latent_height=8", "--model-override", "latent_width=8",
         "--micro-batch-size", "4", "--synthetic-samples", "64", "--no-sample", "--log-interval", "1",
         "--lr", "2e-3", "--dsv-k-min", "8", "--dsv-profile-interval", "2"]


def run(tmp_path, *flags, name="run"):
    """Train in this process; returns the TrainResult."""
    from megatron_dsv.training.trainer import train

    args = parse_args([*SMALL, "--output-dir", str(tmp_path / name), *flags])
    return train(args)

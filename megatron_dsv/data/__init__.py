"""Video data: procedural synthetic videos (embedded default) and latent-shard datasets (real data)."""

from megatron_dsv.data.shards import LatentShardDataset, write_shard
from megatron_dsv.data.synthetic import MOTIONS, SHAPES, SyntheticVideoDataset

__all__ = ["SyntheticVideoDataset", "LatentShardDataset", "write_shard", "SHAPES", "MOTIONS"]

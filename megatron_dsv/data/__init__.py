"""Video data: procedural synthetic videos (embedded default), rendered game footage (ViZDoom, ALE) and
real camera footage (the [video] extra, imported only when used), and latent-shard datasets."""

from megatron_dsv.data.rendered import RenderedVideoDataset
from megatron_dsv.data.shards import CycledDataset, LatentShardDataset, write_shard
from megatron_dsv.data.synthetic import MOTIONS, SHAPES, SyntheticVideoDataset

__all__ = ["SyntheticVideoDataset", "RenderedVideoDataset", "LatentShardDataset", "CycledDataset", "write_shard",
           "SHAPES", "MOTIONS"]

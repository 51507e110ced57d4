"""Video data: procedural synthetic videos (embedded default), rendered game footage (ViZDoom, ALE; the
[video] extra, imported only when used) and latent-shard datasets (real data)."""

from megatron_dsv.data.rendered import RenderedVideoDataset
from megatron_dsv.data.shards import LatentShardDataset, write_shard
from megatron_dsv.data.synthetic import MOTIONS, SHAPES, SyntheticVideoDataset

__all__ = ["SyntheticVideoDataset", "RenderedVideoDataset", "LatentShardDataset", "write_shard", "SHAPES", "MOTIONS"]

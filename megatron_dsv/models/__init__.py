"""Models and layer specs: the video DiT (megatron.core TransformerBlock), its specs, sampling, and the
3D local-window attention baseline."""

from megatron_dsv.models.dit_config import PRESETS, VideoDiTConfig, count_parameters
from megatron_dsv.models.sampling import sample_videos, write_gif_and_grid
from megatron_dsv.models.video_dit import (VideoDiT, build_video_dit, flow_matching_loss, get_video_dit_layer_spec,
                                           unwrap_video_dit)
from megatron_dsv.models.window_attention import WindowConfig, WindowCoreAttention, get_window_layer_spec

__all__ = ["VideoDiT", "VideoDiTConfig", "PRESETS", "build_video_dit", "get_video_dit_layer_spec",
           "flow_matching_loss", "count_parameters", "sample_videos", "write_gif_and_grid", "unwrap_video_dit",
           "WindowConfig", "WindowCoreAttention", "get_window_layer_spec"]

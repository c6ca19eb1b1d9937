"""Reference models: a Wan 2.1-style video DiT (configs ``tiny``, ``wan-1.3b``, ``wan-14b``)."""

from lightning_adaptiveload.models.layers import NormModulate
from lightning_adaptiveload.models.sharding import shard_model
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

__all__ = ["NormModulate", "VideoDiT", "VideoDiTConfig", "shard_model"]

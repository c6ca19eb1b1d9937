"""`lightning-adaptiveload synth / index`: synthetic shards and the shard index."""

from lightning_adaptiveload.data.shards import index_main, synth_main

__all__ = ["synth_main", "index_main"]

"""Shard I/O (pure: format, reader, index, writer, synthetic data, mixes) and the DataModule that adapts it to Lightning."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "AdaptiveLoadDataModule": "datamodule",
        "Mix": "mixes",
        "ShardError": "shards",
        "ShardIndex": "shards",
        "ShardInfo": "shards",
        "ShardWriter": "shards",
        "available_mixes": "mixes",
        "expand_paths": "shards",
        "iter_shard": "shards",
        "load_mix": "mixes",
        "write_synthetic_shards": "shards",
    },
)

"""Shard I/O (pure: format, reader, index, writer, synthetic data, mixes, the planned loader) and the
DataModule that adapts it to Lightning.

Pure (no Lightning): ``format`` (names, limits, REASONS, ShardError, ShardInfo), ``paths``, ``npy``,
``scan`` (the checking tar scan), ``reader`` (iter_shard), ``index_file`` / ``index`` / ``indexing``
(ShardIndex), ``columnar`` / ``key_columns`` / ``index_columns`` / ``compact`` / ``compact_build`` (the binary index, CompactIndex), ``writer`` (ShardWriter), ``synthetic``, ``mixes``, ``untrusted``, ``media`` / ``media_encode`` / ``demo`` (ingest's pure half; its random-weight stand-ins), ``collate`` / ``packed_collate`` (the batch dicts), ``stream`` (a plan's
stream into batches), ``loader`` (PlannedShardDataset, PlannedDataLoader), ``resume``,
``index_agreement``, ``settings`` (Loader, Source: the DataModule's loading settings). Lightning adapters: ``datamodule``, ``ingest``.
"""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "AdaptiveLoadDataModule": "datamodule",
        "CompactIndex": "compact",
        "INDEX_NAME": "format",
        "Loader": "settings",
        "Source": "settings",
        "MAX_MEMBER_BYTES": "format",
        "Mix": "mixes",
        "PlannedDataLoader": "loader",
        "PlannedShardDataset": "loader",
        "REASONS": "format",
        "ShardError": "format",
        "ShardIndex": "index",
        "ShardInfo": "format",
        "ShardWriter": "writer",
        "apply_sample_transform": "stream",
        "collate_packed": "packed_collate",
        "available_mixes": "mixes",
        "expand_paths": "paths",
        "iter_shard": "reader",
        "load_index": "compact",
        "load_mix": "mixes",
        "stream_batches": "stream",
        "write_synthetic_shards": "synthetic",
        "SyntheticShards": "synthetic",
    },
)

"""Shards: the on-disk format of pre-encoded latents, and everything that reads or writes it (pure: no
Lightning).

- ``format``: member names, limits, the ``REASONS`` table, ``ShardError``, ``ShardInfo``.
- ``untrusted``, ``npy``, ``paths``, ``scan``: the bounded parsers every shard byte goes through.
- ``reader`` (``iter_shard``) and ``writer`` (``ShardWriter``).
- The index an epoch is planned from, in two implementations behind one protocol (``protocol.Index``):
  ``index`` (``ShardIndex``, with ``index_file`` and ``indexing``) and ``compact`` (``CompactIndex``, the
  binary columns of ``columnar``, ``key_columns``, ``index_columns``, ``compact_build``).
- ``synthetic`` and ``mixes``: generated shards whose shapes follow a length mix.
"""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "CompactIndex": "compact",
        "INDEX_NAME": "format",
        "MAX_MEMBER_BYTES": "format",
        "Mix": "mixes",
        "REASONS": "format",
        "ShardError": "format",
        "ShardIndex": "index",
        "ShardInfo": "format",
        "ShardWriter": "writer",
        "SyntheticShards": "synthetic",
        "available_mixes": "mixes",
        "expand_paths": "paths",
        "iter_shard": "reader",
        "load_index": "compact",
        "load_mix": "mixes",
        "write_synthetic_shards": "synthetic",
    },
)

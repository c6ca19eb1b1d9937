"""Loading: an epoch plan turned into batches on every rank (pure PyTorch: no Lightning).

- ``settings``: ``Loader`` and ``Source``, the DataModule's loading settings.
- ``stream``: one (rank, worker) stream of a plan read from its shards and batched.
- ``collate`` and ``packed_collate``: the batch dicts of the bucketed and the packed contract.
- ``loader``: ``PlannedShardDataset`` and ``PlannedDataLoader``.
- ``resume``: the saved data position and its replay; ``replan``: the rest of an epoch planned again.
- ``index_agreement``: one check that all ranks hold the same index.
- ``datamodule_inputs``: the checks behind the DataModule's arguments.
"""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "Loader": "settings",
        "PlannedDataLoader": "loader",
        "PlannedShardDataset": "loader",
        "Source": "settings",
        "apply_sample_transform": "stream",
        "collate_packed": "packed_collate",
        "stream_batches": "stream",
    },
)

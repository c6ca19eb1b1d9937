"""What the rest of the package asks of a shard index: one protocol, two implementations.

:class:`~lightning_adaptiveload.shards.index.ShardIndex` keeps one :class:`ShardInfo` of Python lists per
shard (``index.json``); :class:`~lightning_adaptiveload.shards.compact.CompactIndex` keeps flat arrays
(``index.npidx``) for indexes of tens of millions of samples. Planning, loading, the DataModule and the
tools take either through :class:`ShardIndexLike`; ``tests/data/test_index_protocol.py`` checks that both
implement all of it with the same signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from lightning_adaptiveload.shards.format import ShardInfo

__all__ = ["ShardIndexLike"]


@runtime_checkable
class ShardIndexLike(Protocol):
    """A shard index: per shard its path, sample keys and latent shapes, and what indexing skipped.

    A sample is named by its ``ref``, ``(shard, position)``: the shard's place in :attr:`paths` and the
    sample's place in that shard's file order.
    """

    @property
    def shards(self) -> Sequence[ShardInfo]:
        """One :class:`ShardInfo` per shard, in index order."""
        ...

    @property
    def num_samples(self) -> int:
        """Samples over all shards."""
        ...

    @property
    def num_shards(self) -> int:
        """Shards in the index."""
        ...

    @property
    def paths(self) -> list[str]:
        """Each shard's path or URL, in index order."""
        ...

    def sample_refs(self) -> list[tuple[int, int]]:
        """Every sample's ``(shard, position)``, shard by shard in file order."""
        ...

    def latent_shape(self, ref: tuple[int, int]) -> tuple[int, int, int, int]:
        """The latent shape ``(C, F, H, W)`` of the sample at ``ref``."""
        ...

    def total_tokens(self, patch_size: Sequence[int] = ...) -> int:
        """Patch tokens over all samples, for the patch size ``(pt, ph, pw)``."""
        ...

    def counts(self) -> dict[str, int]:
        """Skipped samples and shards by reason (the ``REASONS`` table's names)."""
        ...

    def skipped(self) -> list[dict[str, Any]]:
        """What indexing skipped: one dict per sample or shard (``shard``, ``key``, ``reason``, ``detail``)."""
        ...

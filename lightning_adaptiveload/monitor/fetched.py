"""What the data path fetched from object storage, per epoch: bytes and requests of the ranged reads.

Each batch of a stream with ranged reads carries ``batch["fetched"]`` (the bytes, requests, retries and
cache hits its reader counted since the stream's previous batch, see
:func:`~lightning_adaptiveload.loading.stream.stream_batches`); :class:`FetchTally` sums them per
epoch on one rank, and :func:`merge_tallies` adds the ranks' tallies into the summary's ``fetched``.
Batches without the key (local shards, streamed reads) add nothing: the tally stays empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FETCH_FIELDS", "FetchTally", "merge_tallies"]

#: The counters of ``batch["fetched"]``.
FETCH_FIELDS = ("bytes", "requests", "retries", "cache_hits")


class FetchTally:
    """Per-epoch sums of ``batch["fetched"]`` on one rank (``epochs``: ``{epoch: {field: int}}``)."""

    def __init__(self) -> None:
        self.epochs: dict[int, dict[str, int]] = {}

    def add(self, batch: Any, epoch: int) -> None:
        """Count one batch's ``"fetched"`` (if it has one) under ``epoch``."""
        got = batch.get("fetched") if isinstance(batch, Mapping) else None
        if not isinstance(got, Mapping):
            return
        row = self.epochs.setdefault(int(epoch), dict.fromkeys(FETCH_FIELDS, 0))
        for name in FETCH_FIELDS:
            value = got.get(name, 0)
            row[name] += int(value.item() if hasattr(value, "item") else value)


def merge_tallies(epochs_by_rank: Sequence[Mapping[int, Mapping[str, int]]]) -> dict[str, Any]:
    """The summary's ``fetched``: per epoch the counters summed over the ranks, and their totals; empty
    when no rank fetched anything by ranges.

    Returns:
        ``{"per_epoch": [{"epoch", "bytes", "requests", "retries", "cache_hits"}, ...], "total": {...},
        "bytes_per_request": float}`` or ``{}``.
    """
    per: dict[int, dict[str, int]] = {}
    for epochs in epochs_by_rank:
        for epoch, row in epochs.items():
            into = per.setdefault(int(epoch), dict.fromkeys(FETCH_FIELDS, 0))
            for name in FETCH_FIELDS:
                into[name] += int(row.get(name, 0))
    if not per:
        return {}
    total = {name: sum(row[name] for row in per.values()) for name in FETCH_FIELDS}
    return {
        "per_epoch": [{"epoch": e, **per[e]} for e in sorted(per)],
        "total": total,
        "bytes_per_request": total["bytes"] / total["requests"] if total["requests"] else 0.0,
    }

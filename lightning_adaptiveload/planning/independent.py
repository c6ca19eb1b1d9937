"""The ``independent`` schedule: each stream's batches are the exact simulation of bucketing its samples
in file order, as the stream will read them.

A batch is emitted when its bucket holds B samples; at most ``max_buffered_samples`` are held (at the
bound the fullest pending bucket is emitted early); leftovers come at the end as partial batches, oldest
bucket first. Pure Python.
"""

from __future__ import annotations

from lightning_adaptiveload.planning.inputs import Bucket
from lightning_adaptiveload.planning.plan import Batch, Read, Ref, Stream

__all__ = ["buffer_bound", "independent_batches"]

# Auto buffer bound: this many times the largest batch size, at least _MIN_BUFFER samples.
_BUFFER_FACTOR = 4
_MIN_BUFFER = 64


def buffer_bound(max_buffered: int | None, sizes: list[int], buckets: list[Bucket]) -> int:
    """The samples a stream may hold: ``max_buffered`` checked, or the default for None.

    Raises:
        ValueError: ``max_buffered`` is below the largest batch size (names it and the shape).
    """
    largest = max(sizes, default=1)
    if max_buffered is None:
        return max(_MIN_BUFFER, _BUFFER_FACTOR * largest)
    value = int(max_buffered)
    if value < largest:
        b = buckets[sizes.index(largest)]
        raise ValueError(
            f"max_buffered_samples={value} is below the largest batch size {largest} (latent shape "
            f"{list(b.shape)}): a full batch could never be formed; set it to at least {largest} "
            f"(recommended {_BUFFER_FACTOR * largest}) or leave it None"
        )
    return value


def _items(reads: list[Read], bucket_of: list[list[int]]) -> list[list[tuple[Ref, int]]]:
    """Per read, its samples as (ref, bucket id) in file order."""
    return [[((shard, i), bucket_of[shard][i]) for i in ids] for shard, ids in reads]


def _simulate(
    items: list[list[tuple[Ref, int]]], sizes: list[int], bound: int, counts: dict[str, int]
) -> list[Batch]:
    """Bucketing of one stream in file order; a full bucket is emitted at once.

    If the buffer reaches ``bound`` samples with no full bucket, the largest pending bucket is emitted
    early (a ``bound_partial_batches``); at the end the pending buckets are emitted oldest first.
    """
    pending: dict[int, list[Ref]] = {}
    out: list[Batch] = []
    buffered = 0
    for read in items:
        for ref, b in read:
            group = pending.get(b)
            if group is None:
                group = pending[b] = []
            group.append(ref)
            buffered += 1
            if len(group) == sizes[b]:
                del pending[b]
                out.append(Batch(b, group))
                buffered -= len(group)
            elif buffered >= bound:
                big = max(pending, key=lambda x: len(pending[x]))
                group = pending.pop(big)
                out.append(Batch(big, group, bound=True))
                buffered -= len(group)
                counts["bound_partial_batches"] += 1
    for b, group in pending.items():  # insertion order = oldest first
        out.append(Batch(b, group))
        counts["partial_batches"] += 1
    return out


def independent_batches(
    reads: dict[Stream, list[Read]],
    bucket_of: list[list[int]],
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
) -> dict[Stream, list[Batch]]:
    """Every stream's batches, simulated from its reads (``counts``: partial and bound_partial_batches)."""
    return {st: _simulate(_items(rd, bucket_of), sizes, bound, counts) for st, rd in reads.items()}

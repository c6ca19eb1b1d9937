"""The ``independent`` schedule: each stream's batches are the exact simulation of bucketing its samples
in file order, as the stream will read them.

A batch is emitted when its bucket holds B samples; at most ``max_buffered_samples`` are held (at the
bound the fullest pending bucket is emitted early); leftovers come at the end as partial batches, oldest
bucket first. Streams whose buffer never reaches the bound are simulated in NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from lightning_adaptiveload.planning.batch_arrays import BatchArrays
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
    columns: tuple[dict[Stream, list[np.ndarray]], np.ndarray, np.ndarray] | None = None,
) -> dict[Stream, BatchArrays]:
    """Every stream's batches, simulated from its reads (``counts``: partial and bound_partial_batches), as
    :class:`~.batch_arrays.BatchArrays`. ``columns``: the same reads' sample ids as arrays
    (:func:`~.assign.read_id_arrays`) and every sample's bucket id with each shard's first position in it,
    read instead of the lists."""
    out: dict[Stream, BatchArrays] = {}
    for st, rd in reads.items():
        fast = _unbounded(
            rd, bucket_of, sizes, bound, counts, None if columns is None else (columns[0][st], *columns[1:])
        )
        if fast is None:
            fast = BatchArrays.from_batches(_simulate(_items(rd, bucket_of), sizes, bound, counts))
        out[st] = fast
    return out


def _unbounded(
    reads: list[Read],
    bucket_of: list[list[int]],
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
    columns: tuple[list[np.ndarray], np.ndarray, np.ndarray] | None = None,
) -> BatchArrays | None:
    """:func:`_simulate` in arrays, for a stream whose buffer never reaches ``bound``; None if it would
    (then the loop runs, with its early emissions).

    Without the bound, bucket b's batches are its samples in file order cut into runs of B_b: a full run
    is emitted at its last sample, and the partial runs at the end, in the order of their first samples
    (the order in which their pending buckets were opened).
    """
    if not reads:
        return BatchArrays.from_batches([])
    if columns is None:
        ids = [np.asarray(i, dtype=np.int64) for _, i in reads]
        bk = np.concatenate([np.asarray(bucket_of[s], dtype=np.int64)[i] for (s, _), i in zip(reads, ids)])
    else:
        ids, bucket_ids, offsets = columns
        bk = bucket_ids[np.concatenate([offsets[s] + i for (s, _), i in zip(reads, ids)])].astype(np.int64)
    shard_col = np.repeat(np.asarray([s for s, _ in reads], dtype=np.int64), [len(i) for i in ids])
    id_col = np.concatenate(ids)
    n = len(bk)
    size = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(bk, kind="stable")  # by bucket, file order within
    cnt = np.bincount(bk, minlength=len(sizes))
    start = np.cumsum(cnt) - cnt
    occ = np.empty(n, dtype=np.int64)  # position of each sample among its bucket's samples
    occ[order] = np.arange(n, dtype=np.int64) - start[bk[order]]
    b_size = size[bk]
    completes = (occ + 1) % b_size == 0
    buffered = np.arange(1, n + 1, dtype=np.int64) - np.cumsum(np.where(completes, b_size, 0))
    if bool((~completes & (buffered >= bound)).any()):
        return None
    done = np.flatnonzero(completes)
    first = start[bk[done]] + occ[done] + 1 - b_size[done]
    rem = cnt % size
    part = np.flatnonzero(rem)
    lo = start[part] + cnt[part] - rem[part]  # first sample of each partial run, in ``order``
    late = np.argsort(order[lo], kind="stable")  # the partial runs, oldest bucket first
    counts["partial_batches"] += len(part)
    rows_bucket = np.concatenate([bk[done], part[late]])
    return BatchArrays(
        rows_bucket,
        np.concatenate([b_size[done], rem[part][late]]),
        np.zeros(len(rows_bucket), dtype=bool),
        np.concatenate([first, lo[late]]),
        shard_col[order],
        id_col[order],
    )

"""The ``independent`` schedule: each stream's batches are the exact simulation of bucketing its samples
in file order, as the stream will read them.

A batch is emitted when its bucket holds B samples; at most ``max_buffered_samples`` are held (at the
bound the fullest pending bucket is emitted early); leftovers come at the end as partial batches, oldest
bucket first. Streams whose buffer never reaches the bound are simulated in NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lightning_adaptiveload.planning.batch_arrays import BatchArrays, RefSource
from lightning_adaptiveload.planning.inputs import Bucket
from lightning_adaptiveload.planning.lockstep_schedule import stable_order_within
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
    reads: Mapping[Stream, list[Read]],
    bucket_of: list[list[int]],
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
    columns: tuple[Mapping[Stream, list[tuple[int, np.ndarray]]], np.ndarray, np.ndarray] | None = None,
) -> dict[Stream, BatchArrays]:
    """Every stream's batches, simulated from its reads (``counts``: partial and bound_partial_batches), as
    :class:`~.batch_arrays.BatchArrays`. ``columns``: the same reads with their sample ids as arrays
    (:func:`~.assign.read_arrays`), every sample's bucket id and each shard's first position in it, read
    instead of the lists: the streams are then simulated together (:func:`_unbounded_all`), and the lists
    are read only for a stream whose buffer reaches the bound."""
    if columns is None:
        fast: Mapping[Stream, BatchArrays | None] = {
            st: _unbounded(rd, bucket_of, sizes, bound, counts) for st, rd in reads.items()
        }
    else:
        fast = _unbounded_all(*columns, sizes, bound, counts)
    out: dict[Stream, BatchArrays] = {}
    for st in reads:
        got = fast[st]
        out[st] = (
            got
            if got is not None
            else BatchArrays.from_batches(_simulate(_items(reads[st], bucket_of), sizes, bound, counts))
        )
    return out


# Streams are simulated together in groups of about this many samples: arrays that stay in cache and that
# the allocator reuses, where arrays of all the samples would each be fresh memory (slow to touch).
_GROUP_SAMPLES = 1 << 18


def _unbounded_all(
    reads: Mapping[Stream, list[tuple[int, np.ndarray]]],
    bucket_ids: np.ndarray,
    offsets: np.ndarray,
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
) -> dict[Stream, BatchArrays | None]:
    """:func:`_unbounded` of every stream, on arrays: ``reads[st]``'s (shard, sample ids) in read order,
    the sample of id i of shard s in bucket ``bucket_ids[offsets[s] + i]``; streams in groups
    (:func:`_unbounded_group`)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    bucket_ids = np.asarray(bucket_ids)
    out: dict[Stream, BatchArrays | None] = {}
    group: list[Stream] = []
    held = 0
    for st, rd in reads.items():
        group.append(st)
        held += sum(len(a) for _, a in rd)
        if held >= _GROUP_SAMPLES:
            out.update(_unbounded_group(group, reads, bucket_ids, offsets, sizes, bound, counts))
            group, held = [], 0
    if group:
        out.update(_unbounded_group(group, reads, bucket_ids, offsets, sizes, bound, counts))
    return out


def _unbounded_group(
    streams: list[Stream],
    reads: Mapping[Stream, list[tuple[int, np.ndarray]]],
    bucket_ids: np.ndarray,
    offsets: np.ndarray,
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
) -> dict[Stream, BatchArrays | None]:
    """:func:`_unbounded` of ``streams`` at once: their samples laid end to end (read positions), each
    step of :func:`_unbounded` runs once over all of them, with positions, counts and sums per stream
    from the group's; a stream's refs are gathered when first used (:class:`~.batch_arrays.RefSource`)."""
    n_s, n_b = len(streams), len(sizes)
    shards: list[int] = []
    ids: list[np.ndarray] = []
    reads_per_stream = np.zeros(n_s, dtype=np.int64)
    for i, st in enumerate(streams):
        rd = reads[st]
        reads_per_stream[i] = len(rd)
        for s, a in rd:
            shards.append(s)
            ids.append(a)
    read_len = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    # A read of consecutive ids is a slice of the bucket ids; others are gathered.
    parts = [
        bucket_ids[offsets[s] + int(a[0]) : offsets[s] + int(a[0]) + len(a)]
        if len(a) and int(a[-1]) - int(a[0]) == len(a) - 1
        else bucket_ids[offsets[s] + a]
        for s, a in zip(shards, ids)
    ]
    z = np.zeros(0, dtype=np.int64)
    bk = np.concatenate(parts).astype(np.int64) if parts else z
    read_lo = np.concatenate([[0], np.cumsum(read_len)])
    lo = read_lo[np.concatenate([[0], np.cumsum(reads_per_stream)])]  # each stream's first sample; n last
    per_stream = np.diff(lo)
    n = int(lo[-1])
    stream = np.repeat(np.arange(n_s, dtype=np.int64), per_stream)
    key = stream * n_b + bk  # (stream, bucket)
    order = stable_order_within(bk, n_b, lo.tolist())  # by stream, bucket, file order
    size = np.asarray(sizes, dtype=np.int64)
    cnt = np.bincount(key, minlength=n_s * n_b)
    start = np.cumsum(cnt) - cnt
    at = np.empty(n, dtype=np.int64)  # each sample's position in ``order``
    at[order] = np.arange(n, dtype=np.int64)
    b_size = size[bk]
    completes = (at - start[key] + 1) % b_size == 0  # the last sample of a run of B of its bucket
    buffered = np.cumsum(np.where(completes, 1 - b_size, 1))  # the buffer after each sample, per stream
    buffered -= np.repeat(np.concatenate([[0], buffered])[lo[:-1]], per_stream)
    over = np.zeros(n_s, dtype=bool)
    over[stream[~completes & (buffered >= bound)]] = True
    done = np.flatnonzero(completes)
    done_stream = stream[done]
    done_bucket, done_n = bk[done], b_size[done]
    done_start = at[done] + 1 - done_n - lo[done_stream]
    rem = cnt % np.tile(size, n_s)
    part = np.flatnonzero(rem)  # (stream, bucket) of each partial run
    part_at = start[part] + cnt[part] - rem[part]  # its first sample, in ``order``
    late = np.argsort(order[part_at], kind="stable")  # by stream, then oldest bucket first
    part, part_at = part[late], part_at[late]
    part_stream = part // n_b
    part_bucket, part_n, part_start = part % n_b, rem[part], part_at - lo[part_stream]
    counts["partial_batches"] += int((~over[part_stream]).sum())
    edges = np.arange(n_s + 1, dtype=np.int64)
    d_lo = np.searchsorted(done_stream, edges).tolist()
    p_lo = np.searchsorted(part_stream, edges).tolist()
    id_col = np.concatenate(ids).astype(np.int64) if ids else z
    shard_of_read = np.asarray(shards, dtype=np.int64)
    out: dict[Stream, BatchArrays | None] = {}
    for i, st in enumerate(streams):
        if over[i]:
            out[st] = None
            continue
        d, p = slice(d_lo[i], d_lo[i + 1]), slice(p_lo[i], p_lo[i + 1])  # full batches, then partial
        out[st] = BatchArrays(
            np.concatenate([done_bucket[d], part_bucket[p]]),
            np.concatenate([done_n[d], part_n[p]]),
            np.zeros(d.stop - d.start + p.stop - p.start, dtype=bool),
            np.concatenate([done_start[d], part_start[p]]),
            None,
            None,
            RefSource(read_lo, shard_of_read, id_col, order[lo[i] : lo[i + 1]]),
        )
    return out


def _unbounded(
    reads: list[Read],
    bucket_of: list[list[int]],
    sizes: list[int],
    bound: int,
    counts: dict[str, int],
) -> BatchArrays | None:
    """:func:`_simulate` in arrays, for a stream whose buffer never reaches ``bound``; None if it would
    (then the loop runs, with its early emissions).

    Without the bound, bucket b's batches are its samples in file order cut into runs of B_b: a full run
    is emitted at its last sample, and the partial runs at the end, in the order of their first samples
    (the order in which their pending buckets were opened).
    """
    if not reads:
        return BatchArrays.from_batches([])
    ids = [np.asarray(i, dtype=np.int64) for _, i in reads]
    bk = np.concatenate([np.asarray(bucket_of[s], dtype=np.int64)[i] for (s, _), i in zip(reads, ids)])
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

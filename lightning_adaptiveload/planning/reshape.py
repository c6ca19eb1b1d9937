"""Edits of one stream's batches that keep every batch within the constraints: split batches, pack
partial batches of a bucket into fewer, take samples out; and where a stream's batches may be edited.

A stream's batches up to its last lockstep (``equal``) batch keep their steps, so edits act after it
(:func:`fixed_prefix`); packing also stays after the last batch emitted early at the buffer bound
(:func:`pack_start`). Used by :mod:`.equalise` to give every rank the same number of steps. Python and NumPy.

A stream is a list of :class:`~.plan.Batch` or a :class:`~.batch_arrays.BatchArrays` (the independent
schedule's), whose methods make the same edits on arrays.
"""

from __future__ import annotations

import heapq
import math
import operator

import numpy as np

from lightning_adaptiveload.planning.batch_arrays import BatchArrays, chunk_sizes, most_packable
from lightning_adaptiveload.planning.plan import Batch, Ref

__all__ = [
    "batch_len",
    "capacity",
    "fixed_prefix",
    "last_nonempty",
    "merge_batches",
    "pack_start",
    "split_batches",
    "tail_samples",
    "take",
]


def fixed_prefix(stream: list[Batch]) -> int:
    """Length of the stream's prefix that must stay in place: up to its last equal (lockstep) batch."""
    if isinstance(stream, BatchArrays):
        return 0  # independent batches are never equal
    return _after_last(list(map(_EQUAL, stream)))


def pack_start(stream: list[Batch], sizes: list[int]) -> int:
    """Where the stream's packable batches begin: after its last lockstep batch and after its last batch
    emitted early at the buffer bound (the independent schedule): packing such a batch with a later one would hold
    its samples past the bound. (A lockstep stream reads each bucket on demand, so packing its tail batches
    holds nothing extra.)"""
    if isinstance(stream, BatchArrays):
        return stream.pack_start()
    return max(_after_last(list(map(_EQUAL, stream))), _after_last(list(map(_BOUND, stream))))


# The flags are read with C-level maps: these scans run over whole streams many times per plan.
_EQUAL = operator.attrgetter("equal")
_BOUND = operator.attrgetter("bound")
_REFS = operator.attrgetter("refs")


def _after_last(flags: list[bool]) -> int:
    """One past the position of the last true flag; 0 if none."""
    try:
        return len(flags) - flags[::-1].index(True)
    except ValueError:
        return 0


def capacity(stream: list[Batch]) -> int:
    """How many batches splitting could add: every batch down to one sample each."""
    if isinstance(stream, BatchArrays):
        return int(stream.n.sum()) - len(stream)
    return sum(map(len, map(_REFS, stream))) - len(stream)


def split_batches(stream: list[Batch], need: int) -> int:
    """Add up to ``need`` batches to ``stream`` by splitting; returns how many were added.

    Only the batches after the stream's last equal (lockstep) batch are split first, largest piece first
    (latest on ties): splitting a batch shifts every later batch of the stream by one step, so earlier
    steps must not move. Then equal batches, latest first. Under the independent schedule no batch is "equal", so
    the largest batches anywhere are split.
    """
    if isinstance(stream, BatchArrays):
        return stream.split(need)
    if need <= 0:
        return 0
    pieces = [1] * len(stream)
    last_equal = max((j for j, bt in enumerate(stream) if bt.equal), default=-1)
    heap = [(-len(bt.refs), -j) for j, bt in enumerate(stream) if j > last_equal and len(bt.refs) > 1]
    heapq.heapify(heap)
    equal_left = [j for j, bt in enumerate(stream) if bt.equal and len(bt.refs) > 1]
    added = 0
    while added < need:
        if heap:
            _, neg_j = heapq.heappop(heap)
            j = -neg_j
        elif equal_left:
            j = equal_left.pop()
        else:
            break
        pieces[j] += 1
        added += 1
        n = len(stream[j].refs)
        if n > pieces[j]:
            heapq.heappush(heap, (-math.ceil(n / pieces[j]), -j))
    if added:
        new: list[Batch] = []
        for bt, k in zip(stream, pieces):
            if k == 1:
                new.append(bt)
                continue
            new.extend(Batch(bt.bucket, chunk) for chunk in _chunks(bt.refs, k))
        stream[:] = new
    return added


def _chunks(refs: list[Ref], k: int) -> list[list[Ref]]:
    """``refs`` in ``k`` consecutive runs whose sizes differ by at most one (the larger first)."""
    out, start = [], 0
    for size in chunk_sizes(len(refs), k):
        out.append(refs[start : start + size])
        start += size
    return out


def take(stream: list[Batch], bucket: int, k: int, partial_only: bool, sizes: list[int]) -> list[Ref]:
    """Remove ``k`` samples of ``bucket`` from the stream's movable batches (after its last lockstep
    batch), last batch first; a batch left empty is dropped. Returns the refs, in file order."""
    if isinstance(stream, BatchArrays):
        return stream.take(bucket, k, partial_only, sizes)
    out: list[Ref] = []
    first = pack_start(stream, sizes) if partial_only else fixed_prefix(stream)
    for j in range(len(stream) - 1, first - 1, -1):
        bt = stream[j]
        if bt.bucket != bucket or (partial_only and len(bt.refs) >= sizes[bucket]):
            continue
        n = min(k - len(out), len(bt.refs))
        out.extend(bt.refs[len(bt.refs) - n :])
        bt.refs = bt.refs[: len(bt.refs) - n]
        if not bt.refs:
            del stream[j]
        if len(out) == k:
            break
    return sorted(out)


def tail_samples(stream: list[Batch], partial_only: bool, sizes: list[int]) -> dict[int, int]:
    """Samples per bucket in the stream's movable batches (only its packable partial ones, see
    :func:`pack_start`, if ``partial_only``)."""
    if isinstance(stream, BatchArrays):
        return stream.tail_samples(partial_only, sizes)
    out: dict[int, int] = {}
    for bt in stream[pack_start(stream, sizes) if partial_only else fixed_prefix(stream) :]:
        if bt.refs and not (partial_only and len(bt.refs) >= sizes[bt.bucket]):
            out[bt.bucket] = out.get(bt.bucket, 0) + len(bt.refs)
    return out


def merge_batches(stream: list[Batch], need: int, sizes: list[int]) -> int:
    """Remove up to ``need`` batches from ``stream`` by packing its partial batches of one bucket (from
    :func:`pack_start` on) into fewer; returns how many were removed.

    The packed batches take the places of the last ones of the bucket (file order kept), each at most
    the bucket's batch size B, so every constraint of a batch still holds.
    """
    if isinstance(stream, BatchArrays):
        return stream.merge(need, sizes)
    removed = 0
    while removed < need:
        first = pack_start(stream, sizes)
        where: dict[int, list[int]] = {}
        for j in range(first, len(stream)):
            bt = stream[j]
            if bt.refs and len(bt.refs) < sizes[bt.bucket]:
                where.setdefault(bt.bucket, []).append(j)
        best, spare = most_packable(
            {b: (len(pos), sum(len(stream[j].refs) for j in pos)) for b, pos in where.items()}, sizes
        )
        if best < 0:
            break
        pos = where[best]
        keep = len(pos) - min(spare, need - removed)
        refs = [ref for j in pos for ref in stream[j].refs]
        for j, chunk in zip(pos[len(pos) - keep :], _chunks(refs, keep)):
            stream[j] = Batch(best, chunk)
        for j in reversed(pos[: len(pos) - keep]):
            del stream[j]
        removed += len(pos) - keep
    return removed


def batch_len(stream: list[Batch] | BatchArrays, j: int) -> int:
    """Samples in batch j."""
    return int(stream.n[j]) if isinstance(stream, BatchArrays) else len(stream[j].refs)


def last_nonempty(stream: list[Batch] | BatchArrays) -> tuple[int, int] | None:
    """(bucket, samples) of the stream's last non-empty movable batch (after its last lockstep batch)."""
    if isinstance(stream, BatchArrays):
        rows = np.flatnonzero(stream.n)
        return None if not len(rows) else (int(stream.bucket[rows[-1]]), int(stream.n[rows[-1]]))
    bt = next((bt for bt in reversed(stream[fixed_prefix(stream) :]) if bt.refs), None)
    return None if bt is None else (bt.bucket, len(bt.refs))

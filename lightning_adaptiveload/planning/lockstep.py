"""The ``lockstep`` schedule: at every step, every rank takes a batch of the same lockstep class and size.

Buckets of near-equal per-sample cost form a *lockstep class*. Within each worker index w, the R streams
(one per rank) first exchange samples so that they hold equal counts of every class
(:func:`_balance_classes`), then take, step by step, a batch of one class and one size on every rank
(:func:`~.lockstep_schedule.schedule`). A lockstep stream reads each bucket's samples as a separate
sequence of shard reads, so it needs to hold no samples beyond the batch it is assembling. Python and
NumPy.
"""

from __future__ import annotations

import itertools

import numpy as np

from lightning_adaptiveload.planning.inputs import Bucket
from lightning_adaptiveload.planning.lockstep_schedule import class_members, schedule
from lightning_adaptiveload.planning.plan import Batch, Read, Ref, Stream

__all__ = ["lockstep_batches", "lockstep_classes"]


def lockstep_classes(buckets: list[Bucket], tolerance: float) -> tuple[list[int], list[int]]:
    """Group buckets whose per-sample cost is within ``tolerance`` (relative) of the group's cheapest.

    Returns (class id per bucket, batch size per class = the smallest batch size of its buckets). A
    full lockstep step is B_c samples of one class on every rank: equal size, equal cost within the
    tolerance (landscape and portrait buckets of one length have the same S and cost, hence one class).
    """
    order = sorted(range(len(buckets)), key=lambda b: (buckets[b].cost, buckets[b].seq_len, b))
    class_of = [0] * len(buckets)
    sizes: list[int] = []
    start = None
    for b in order:
        c = buckets[b].cost
        if start is None or c > start * (1 + tolerance):
            start = c
            sizes.append(buckets[b].batch_size)
        class_of[b] = len(sizes) - 1
        sizes[-1] = min(sizes[-1], buckets[b].batch_size)
    return class_of, sizes


def lockstep_batches(
    reads: dict[Stream, list[Read]],
    bucket_of: list[list[int]],
    world: int,
    workers: int,
    class_of: list[int],
    class_size: list[int],
    sizes: list[int],
    counts: dict[str, int],
) -> dict[Stream, list[Batch]]:
    """Every stream's lockstep batches, worker index by worker index.

    ``reads`` is rewritten in place: per bucket, the runs of that bucket's samples in each shard,
    including the samples a stream got from another in the class balance. ``counts``: moved_samples,
    reduced_steps, tail_batches.
    """
    sim: dict[Stream, list[Batch]] = {}
    n_buckets = len(class_of)
    for w in range(workers):
        chains = [_bucket_chains(reads[(r, w)], bucket_of, n_buckets) for r in range(world)]
        if world > 1:
            _balance_classes(chains, class_of, len(class_size), counts)
        group = schedule(chains, class_of, class_size, sizes, counts)
        for r in range(world):
            sim[(r, w)] = group[r]
            reads[(r, w)] = _reads_of_chains(chains[r])
    return sim


def _bucket_chains(reads: list[Read], bucket_of: list[list[int]], n_buckets: int) -> list[list[Ref]]:
    """A stream's samples split by bucket, each list in read order."""
    if not reads:
        return [[] for _ in range(n_buckets)]
    ids = [np.asarray(i, dtype=np.int64) for _, i in reads]
    shard = np.concatenate([np.full(len(i), s, dtype=np.int64) for (s, _), i in zip(reads, ids)])
    bk = np.concatenate([np.asarray(bucket_of[s], dtype=np.int64)[i] for (s, _), i in zip(reads, ids)])
    order = np.argsort(bk, kind="stable")  # by bucket, read order within
    refs = list(zip(shard[order].tolist(), np.concatenate(ids)[order].tolist()))
    ends = np.cumsum(np.bincount(bk, minlength=n_buckets)).tolist()
    return [refs[a:b] for a, b in zip([0] + ends[:-1], ends)]


def _reads_of_chains(chains: list[list[Ref]]) -> list[Read]:
    """Per-bucket chains -> reads: runs of consecutive refs from one shard, chain by chain (ids ascending
    within a read)."""
    n = sum(map(len, chains))
    if not n:
        return []
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(chains)), np.int64, 2 * n)
    shard, ids = flat[0::2], flat[1::2]
    new = np.ones(n, dtype=bool)  # a read starts at a chain's first ref or where the shard changes
    new[1:] = shard[1:] != shard[:-1]
    lens = np.fromiter(map(len, chains), dtype=np.int64, count=len(chains))
    new[(np.cumsum(lens) - lens)[lens > 0]] = True
    run = np.cumsum(new) - 1
    ids = ids[np.lexsort((ids, run))].tolist()
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n).tolist()
    return [(s, ids[a:b]) for s, a, b in zip(shard[starts].tolist(), starts.tolist(), ends)]


def _balance_classes(
    chains: list[list[list[Ref]]], class_of: list[int], n_classes: int, counts: dict[str, int]
) -> None:
    """Move samples between the R streams of one worker index so that they hold equal class counts.

    ``chains[r][b]`` is stream r's list of samples of bucket b, in read order; it is edited in place.
    Lockstep pairs the streams' samples class by class, so a stream with more samples of a class than
    the others would end the epoch with unequal (tail) steps. For each class, streams above the common
    count give their last samples of the class to streams below it, which read them from the giver's
    shard (``select``) after their own. Class counts then differ by at most one sample between streams.
    ``counts["moved_samples"]`` is updated.
    """
    n_r = len(chains)
    members = class_members(class_of, n_classes)
    for c in range(n_classes):
        have = [sum(len(chains[r][b]) for b in members[c]) for r in range(n_r)]
        base, rem = divmod(sum(have), n_r)
        target = [base] * n_r
        for r in sorted(range(n_r), key=lambda x: (-have[x], x))[:rem]:
            target[r] += 1
        given: list[tuple[int, Ref]] = []
        for r in range(n_r):
            surplus = have[r] - target[r]
            # the giver's last samples: take from its longest bucket chains of the class, from the end
            while surplus > 0:
                b = max(members[c], key=lambda x: (len(chains[r][x]), -x))
                given.append((b, chains[r][b].pop()))
                surplus -= 1
        given.sort(key=lambda g: (g[0], g[1]))
        pos = 0
        for r in range(n_r):
            deficit = target[r] - have[r]
            for b, ref in given[pos : pos + max(0, deficit)]:
                chains[r][b].append(ref)
            pos += max(0, deficit)
        counts["moved_samples"] += len(given)

"""The ``lockstep`` schedule on arrays, for a plan that keeps one rank's streams (:mod:`.lockstep`).

A rank-local plan still decides every stream's steps (the steps line up across ranks, and the step count,
global tokens and balance figures are global), but it needs the batches, the sample refs and the reads
of its own streams only. Here each worker index's samples are arrays sorted by (stream, bucket, read
order), so that the per-bucket *chains* of every stream are slices; the class balance moves samples by
index, the steps come from the streams' counts (:func:`~.lockstep_schedule.schedule_takes`), and only
the kept rank's batches and reads become Python objects. Another rank's stream holds a shared placeholder
for each equal batch (its length is what the rest of the planner counts) and its unequal batches in full
(the packed tail re-plans their samples across ranks).

The choices are those of :func:`~.lockstep.lockstep_batches`, sample for sample: a rank-local plan
equals the kept part of the plan of every stream (``tests/planning/test_chunked_plan.py``). Pure NumPy.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lightning_adaptiveload.planning.assign import Piece
from lightning_adaptiveload.planning.lockstep import _reads_of_chains
from lightning_adaptiveload.planning.lockstep_schedule import (
    chain_starts,
    class_members,
    schedule_takes,
    stable_order,
)
from lightning_adaptiveload.planning.plan import Batch, Read, Stream

__all__ = ["EQUAL_ELSEWHERE", "LocalLockstep", "lockstep_local"]

#: Placeholder for an equal lockstep batch of a stream the plan does not keep (shared, never mutated).
EQUAL_ELSEWHERE = Batch(-1, [], True)


@dataclass
class LocalLockstep:
    """The lockstep batches of a rank-local plan.

    Attributes:
        sim: per stream, its batches: the kept streams' in full; other streams' equal batches as
            :data:`EQUAL_ELSEWHERE`, followed by their unequal batches in full.
        equal: per stream, (bucket ids, sample counts) of its equal batches, in order (int64 arrays).
        reads: the kept streams' reads (as :func:`~.lockstep._reads_of_chains` gives them).
        lockstep_reads: per stream, how many of its reads keep a sample once its unequal batches' samples
            are taken out (:func:`~.tail.tail_reads`).
    """

    sim: dict[Stream, list[Batch]]
    equal: dict[Stream, tuple[np.ndarray, np.ndarray]]
    reads: dict[Stream, list[Read]]
    lockstep_reads: dict[Stream, int]


def lockstep_local(
    pieces: dict[Stream, list[Piece]],
    bucket_ids: np.ndarray,
    shard_offsets: np.ndarray,
    world: int,
    workers: int,
    class_of: list[int],
    class_size: list[int],
    sizes: list[int],
    counts: dict[str, int],
    keep: int,
) -> LocalLockstep:
    """:func:`~.lockstep.lockstep_batches` materialising only rank ``keep``'s streams.

    Args:
        pieces: every stream's pieces (the assignment); their reads are :func:`~.assign.reads_of`'s.
        bucket_ids, shard_offsets: bucket id of sample i of shard s at ``bucket_ids[shard_offsets[s] + i]``.
        world, workers, class_of, class_size, sizes, counts: as :func:`~.lockstep.lockstep_batches`.
        keep: the rank whose streams are kept.
    """
    out = LocalLockstep({}, {}, {}, {})
    args = (pieces, bucket_ids, shard_offsets, world, class_of, class_size, sizes, keep)
    # The worker indices are independent; NumPy releases the GIL in its long loops, so two threads overlap
    # much of their work. Each returns its own counters, added in worker order (deterministic).
    if workers > 1:
        with ThreadPoolExecutor(max_workers=min(workers, 2), thread_name_prefix="lockstep-plan") as pool:
            parts = list(pool.map(lambda w: _one_worker(w, *args), range(workers)))
    else:
        parts = [_one_worker(w, *args) for w in range(workers)]
    for part, added in parts:
        for name in ("sim", "equal", "reads", "lockstep_reads"):
            getattr(out, name).update(getattr(part, name))
        for key, value in added.items():
            counts[key] += value
    return out


def _one_worker(
    w: int,
    pieces: dict[Stream, list[Piece]],
    bucket_ids: np.ndarray,
    shard_offsets: np.ndarray,
    world: int,
    class_of: list[int],
    class_size: list[int],
    sizes: list[int],
    keep: int,
) -> tuple[LocalLockstep, dict[str, int]]:
    """Worker index ``w``'s part of :func:`lockstep_local`, and what it adds to the plan's counters."""
    n_b = len(class_of)
    out = LocalLockstep({}, {}, {}, {})
    counts: dict[str, int] = collections.defaultdict(int)
    shard, sid, stream, bucket = _worker_arrays(
        [pieces[(r, w)] for r in range(world)], bucket_ids, shard_offsets
    )
    if world > 1:
        shard, sid, stream, bucket = _balance(
            shard, sid, stream, bucket, world, class_of, len(class_size), counts
        )
    avail = np.bincount(stream * n_b + bucket, minlength=world * n_b).reshape(world, n_b)
    first = np.cumsum(avail.ravel()) - avail.ravel()  # where chain (r, b) starts in the arrays
    b, k, eq = schedule_takes(avail.copy(), class_of, class_size, sizes, counts)
    start = chain_starts(b, k, n_b) + first.reshape(world, n_b)[np.arange(world)[:, None], b]
    n_eq = int(eq.sum())  # the equal steps come first
    eq_taken = np.zeros(world * n_b, dtype=np.int64)
    np.add.at(eq_taken, (np.arange(world)[:, None] * n_b + b[:, :n_eq]).ravel(), k[:, :n_eq].ravel())
    runs = _run_starts(shard, stream * n_b + bucket)
    kept_run = np.arange(len(shard)) - first[stream * n_b + bucket] < eq_taken[stream * n_b + bucket]
    per_stream_reads = np.bincount(stream[runs & kept_run], minlength=world)
    for r in range(world):
        st = (r, w)
        out.equal[st] = (b[r, :n_eq], k[r, :n_eq])
        out.lockstep_reads[st] = int(per_stream_reads[r])
        if r != keep:  # its equal batches are placeholders, its unequal ones (a few) are kept whole
            tail = [j for j in range(n_eq, b.shape[1]) if k[r, j]]
            out.sim[st] = [EQUAL_ELSEWHERE] * n_eq + [
                Batch(int(b[r, j]), _refs(shard, sid, int(start[r, j]), int(k[r, j])), False)
                for j in tail
            ]
            continue
        lo = int(first[r * n_b])
        shard_l, sid_l = (
            shard[lo : lo + int(avail[r].sum())].tolist(),
            sid[lo : lo + int(avail[r].sum())].tolist(),
        )
        out.sim[st] = [
            Batch(bb, list(zip(shard_l[p - lo : p - lo + kk], sid_l[p - lo : p - lo + kk])), j < n_eq)
            for j, (bb, p, kk) in enumerate(zip(b[r].tolist(), start[r].tolist(), k[r].tolist()))
            if kk
        ]
        out.reads[st] = _reads_of_chains(
            [
                list(zip(shard_l[a - lo : a - lo + n], sid_l[a - lo : a - lo + n]))
                for a, n in zip(first[r * n_b : (r + 1) * n_b].tolist(), avail[r].tolist())
            ]
        )
    return out, dict(counts)


def _refs(shard: np.ndarray, sid: np.ndarray, start: int, n: int) -> list[tuple[int, int]]:
    return list(zip(shard[start : start + n].tolist(), sid[start : start + n].tolist()))


def _worker_arrays(
    pieces: list[list[Piece]], bucket_ids: np.ndarray, shard_offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples of one worker index's streams: (shard, sample id, stream, bucket), sorted by (stream,
    bucket), read order within (every stream's per-bucket chain of :func:`~.lockstep._bucket_chains`).

    The read order is :func:`~.assign.reads_of`'s: a stream's pieces in order, consecutive pieces of one
    shard read as one (their ids sorted)."""
    shards: list[int] = []
    ids: list[np.ndarray] = []
    per_stream = np.zeros(len(pieces), dtype=np.int64)
    for r, stream_pieces in enumerate(pieces):
        last = len(ids)
        for p in stream_pieces:
            a = p.id_array if p.id_array is not None else np.asarray(p.ids, dtype=np.int64)
            if len(ids) > last and shards[-1] == p.shard:
                ids[-1] = np.sort(np.concatenate([ids[-1], a]))
            else:
                shards.append(p.shard)
                ids.append(a)
            per_stream[r] += len(a)
    n = int(per_stream.sum())
    if not n:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    sid = np.concatenate(ids).astype(np.int64, copy=False)
    shard = np.repeat(np.asarray(shards, dtype=np.int64), [len(a) for a in ids])
    stream = np.repeat(np.arange(len(pieces), dtype=np.int64), per_stream)
    bucket = np.asarray(bucket_ids, dtype=np.int64)[np.asarray(shard_offsets, dtype=np.int64)[shard] + sid]
    n_b = int(bucket.max()) + 1
    chain = stream * n_b + bucket
    order = stable_order(chain, len(pieces) * n_b)
    stream, bucket = _sorted_chains(np.bincount(chain, minlength=len(pieces) * n_b), n_b)
    return shard[order], sid[order], stream, bucket


def _sorted_chains(per_chain: np.ndarray, n_b: int) -> tuple[np.ndarray, np.ndarray]:
    """(stream, bucket) of arrays sorted by chain ``stream * n_b + bucket`` with ``per_chain[c]`` samples
    in chain c: what gathering both columns by the sorting order gives, from the counts alone."""
    # Two repeats of short tables, not one of the chain ids then a division and a remainder of every sample.
    n_streams = len(per_chain) // n_b
    per_stream = np.asarray(per_chain, dtype=np.int64).reshape(n_streams, n_b).sum(axis=1)
    stream = np.repeat(np.arange(n_streams, dtype=np.int64), per_stream)
    bucket = np.repeat(np.tile(np.arange(n_b, dtype=np.int64), n_streams), per_chain)
    return stream, bucket


def _balance(
    shard: np.ndarray,
    sid: np.ndarray,
    stream: np.ndarray,
    bucket: np.ndarray,
    world: int,
    class_of: list[int],
    n_classes: int,
    counts: dict[str, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`~.lockstep._balance_classes` on the arrays: per class, the streams above the common count
    give their last samples of their longest chains of the class (the lower bucket on ties), sorted by
    (bucket, shard, id), to the streams below it in stream order, appended to their chains."""
    n_b = len(class_of)
    n = len(shard)
    chain = stream * n_b + bucket
    have_b = np.bincount(chain, minlength=world * n_b).reshape(world, n_b)
    first = np.cumsum(have_b.ravel()) - have_b.ravel()
    new_stream = stream.copy()
    moved_all: list[np.ndarray] = []
    for members in class_members(class_of, n_classes):
        if not members:
            continue
        have = have_b[:, members].sum(axis=1)
        base, rem = divmod(int(have.sum()), world)
        target = np.full(world, base, dtype=np.int64)
        target[sorted(range(world), key=lambda x: (-int(have[x]), x))[:rem]] += 1
        given: list[np.ndarray] = []
        for r in np.flatnonzero(have > target).tolist():
            lens = have_b[r, members].tolist()
            final = _after_pops(lens, int(have[r] - target[r]))
            for m, a, z in zip(members, final, lens):
                if z > a:
                    given.append(np.arange(first[r * n_b + m] + a, first[r * n_b + m] + z, dtype=np.int64))
        if not given:
            continue
        idx = np.concatenate(given)
        idx = idx[np.lexsort((sid[idx], shard[idx], bucket[idx]))]
        deficit = np.maximum(target - have, 0)
        new_stream[idx] = np.repeat(np.arange(world, dtype=np.int64), deficit)[: len(idx)]
        moved_all.append(idx)
        counts["moved_samples"] += len(idx)
    if not moved_all:
        return shard, sid, stream, bucket
    # The samples a stream got go after its own in each chain, in the order given: the stable sort of
    # (the staying samples, in their chain order, then the moved ones) by new chain, placed from counts.
    moved = np.concatenate(moved_all)
    stays = np.ones(n, dtype=bool)
    stays[moved] = False
    kept = np.flatnonzero(stays)
    new_count = np.bincount(new_stream * n_b + bucket, minlength=world * n_b)
    new_first = np.cumsum(new_count) - new_count
    kept_chain = chain[kept]  # ascending: the input is sorted by chain and a staying sample keeps its chain
    kept_count = np.bincount(kept_chain, minlength=world * n_b)
    kept_first = np.cumsum(kept_count) - kept_count
    order = np.empty(n, dtype=np.int64)
    order[new_first[kept_chain] + np.arange(len(kept), dtype=np.int64) - kept_first[kept_chain]] = kept
    moved_chain = new_stream[moved] * n_b + bucket[moved]
    by_chain = np.argsort(moved_chain, kind="stable")
    mc = moved_chain[by_chain]
    rank = np.arange(len(mc), dtype=np.int64) - np.searchsorted(mc, mc, side="left")
    order[new_first[mc] + kept_count[mc] + rank] = moved[by_chain]
    new_stream, bucket = _sorted_chains(new_count, n_b)
    return shard[order], sid[order], new_stream, bucket


def _after_pops(lens: list[int], pops: int) -> list[int]:
    """Chain lengths after ``pops`` single pops, each from the longest chain (the first on ties): every
    chain above some level h comes down to h, then the first chains at h (in order) lose one more."""
    lo, hi = 0, max(lens)
    while lo < hi:  # the lowest level h with sum(max(0, len - h)) <= pops
        mid = (lo + hi) // 2
        if sum(x - mid for x in lens if x > mid) <= pops:
            hi = mid
        else:
            lo = mid + 1
    out = [min(x, lo) for x in lens]
    left = pops - sum(lens) + sum(out)
    for j, x in enumerate(out):
        if left <= 0:
            break
        if x == lo:
            out[j] -= 1
            left -= 1
    return out


def _run_starts(shard: np.ndarray, chain: np.ndarray) -> np.ndarray:
    """Where a read starts in the sorted arrays: at a chain's first sample or where the shard changes."""
    new = np.ones(len(shard), dtype=bool)
    if len(shard) > 1:
        new[1:] = (shard[1:] != shard[:-1]) | (chain[1:] != chain[:-1])
    return new

"""Epoch planning from the index alone: which stream reads which samples, and every batch it yields.

Every rank calls :func:`plan_epoch` with the same index and settings and gets the same
:class:`EpochPlan`, without talking to the others. A *stream* is one (rank, worker) pair: the
DataLoader worker ``worker`` of rank ``rank`` (worker 0 when the loader has no workers).

1. **Shard order** is a permutation seeded by ``(seed, epoch)``, the same on every rank.
2. **Assignment.** Shards (or, when needed, contiguous halves of shards: *pieces*) go to streams by a
   greedy longest-processing-time partition: independent mode balances ranks on their estimated batch
   count (sum of 1/B), then each rank's workers; lockstep mode balances all R * W streams on estimated
   cost. A piece is split when loads would differ by more than 5% or there are fewer pieces than bins.
3. **Batches.** ``independent``: each stream's batch list is the exact simulation of bucketing its samples
   in file order (a batch is emitted when its bucket holds B samples; at most ``max_buffered_samples``
   held; leftovers at the end as partial batches). ``lockstep``: within each worker index w, the R streams
   (one per rank) first exchange samples so that they hold equal counts of every *lockstep class*
   (buckets of near-equal cost), then take, at every step, a batch of the same class and the same size on
   every rank (:func:`_lockstep_schedule`). A lockstep stream reads each bucket's samples as a separate
   sequence of shard reads, so it needs to hold no samples beyond the batch it is assembling.
4. **Equal steps.** The common step count is chosen between the fewest batches the ranks can reach
   (partial batches of a bucket packed together) and the most (one sample per batch), where it changes
   the fewest batches; samples move between ranks that cannot reach it alone (read from the giver's
   shards), then each rank splits or packs its own batches (every batch still meets both constraints).
   Where no common count of non-empty batches exists, or a rank can get no sample at all (``underfull=
   "pad"``), ranks take empty batches: zero-weight steps. Lockstep does this per worker index first and
   only after the last lockstep step of a stream, so that the steps before stay aligned.
5. **Step order.** A rank's step sequence is the DataLoader's round robin over its workers, skipping
   exhausted ones (what torch does for an IterableDataset), so that the plan knows which batch every rank
   takes at every step and hence the step's ``global_tokens``.

Resume: ``exclude`` leaves out the samples already consumed (:func:`consumed_refs` computes them from an
earlier plan and the steps each rank took), so the rest of an epoch can be planned for another number of
ranks; :func:`continue_plan` continues a plan for the same ranks with another number of workers, batch
for batch. Pure Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.monitor.stats import balance_summary
from lightning_adaptiveload.planning.batching import DualConstraintBatcher

__all__ = [
    "EpochPlan",
    "PlanError",
    "SCHEDULES",
    "consumed_refs",
    "continue_plan",
    "index_fingerprint",
    "plan_epoch",
]

Ref = tuple[int, int]
Stream = tuple[int, int]
SCHEDULES = ("independent", "lockstep", "packed")
# A rank whose estimated load exceeds the mean by more than this gets its largest piece split.
_BALANCE_TOLERANCE = 0.05
# Splitting stops at this many pieces per stream (each piece is one extra pass over part of a shard).
_MAX_PIECES_PER_STREAM = 8
# Auto buffer bound: this many times the largest batch size, at least _MIN_BUFFER samples.
_BUFFER_FACTOR = 4
_MIN_BUFFER = 64


class PlanError(ValueError):
    """An epoch cannot be planned with these settings; the message says why and what to do."""


@dataclass
class _Bucket:
    shape: tuple[int, ...]
    seq_len: int
    batch_size: int
    cost: float  # of one sample


@dataclass
class EpochPlan:
    """The plan of one epoch for every stream; identical on every rank.

    Attributes:
        world_size, num_workers, seed, epoch, mode: the settings planned for (``num_workers`` as given;
            0 means one stream per rank, worker 0).
        buckets: per bucket id: ``{"shape": (C, T, H, W), "seq_len": S, "batch_size": B, "cost": cost(S),
            "lockstep_class": int}``.
        streams: ``streams[(rank, worker)]`` is the list of batches that stream yields, in order; a batch
            is a list of sample refs ``(shard_id, sample_id)`` in file order.
        batch_buckets: ``batch_buckets[(rank, worker)][j]`` is the bucket id of batch j.
        batch_steps: ``batch_steps[(rank, worker)][j]`` is the rank step at which batch j is taken.
        reads: ``reads[(rank, worker)]`` is the list of ``(shard_id, sample_ids)`` the stream reads (sample
            ids ascending). Independent mode: one read per piece, in order. Lockstep mode: per bucket, the
            runs of that bucket's samples in each shard, so that the stream can take the next samples of
            any bucket without buffering others; a shard is then opened once per bucket it holds (seeking
            over the other members). A reader opens a read when a batch first needs it.
        step_order: ``step_order[rank][k] = (worker, j)``: the batch the rank takes at step k.
        steps: steps per rank (the same for every rank).
        global_tokens: per step, the sum of the batch tokens over all ranks.
        report: counters of the plan (see :func:`plan_epoch`).
    """

    world_size: int
    num_workers: int
    seed: int
    epoch: int
    mode: str
    buckets: list[dict[str, Any]]
    streams: dict[Stream, list[list[Ref]]]
    batch_buckets: dict[Stream, list[int]]
    batch_steps: dict[Stream, list[int]]
    reads: dict[Stream, list[tuple[int, list[int]]]]
    step_order: list[list[tuple[int, int]]]
    steps: int
    global_tokens: list[int]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def workers_per_rank(self) -> int:
        """Streams per rank: ``max(1, num_workers)``."""
        return max(1, self.num_workers)

    def rank_batches(self, rank: int) -> list[list[Ref]]:
        """The batches rank ``rank`` takes, in step order."""
        return [self.streams[(rank, w)][j] for w, j in self.step_order[rank]]

    def step_batch(self, rank: int, step: int) -> tuple[int, list[Ref]]:
        """(bucket id, refs) of the batch rank ``rank`` takes at ``step``."""
        w, j = self.step_order[rank][step]
        return self.batch_buckets[(rank, w)][j], self.streams[(rank, w)][j]


# ------------------------------------------------------------------------------------------------------
# Input
# ------------------------------------------------------------------------------------------------------


@dataclass
class _Input:
    paths: list[str]
    keys: list[Sequence[str] | None]
    shapes: list[Sequence[Sequence[int]]]


def _as_input(index_or_shapes: Any) -> _Input:
    shards = getattr(index_or_shapes, "shards", None)
    if shards is not None:
        return _Input(
            paths=[str(getattr(s, "path", f"shard {i}")) for i, s in enumerate(shards)],
            keys=[getattr(s, "keys", None) for s in shards],
            shapes=[s.latent_shapes for s in shards],
        )
    try:
        shapes = [list(s) for s in index_or_shapes]
    except TypeError:
        raise TypeError(
            "plan_epoch needs a ShardIndex or a list (one per shard) of lists of latent shapes (C, T, H, W), "
            f"got {type(index_or_shapes).__name__}"
        ) from None
    return _Input(paths=[f"shard {i}" for i in range(len(shapes))], keys=[None] * len(shapes), shapes=shapes)


def index_fingerprint(index_or_shapes: Any) -> str:
    """A short hash of the shards' keys and latent shapes (not their paths): detects a changed data set."""
    data = _as_input(index_or_shapes)
    h = hashlib.sha1()
    for keys, shapes in zip(data.keys, data.shapes):
        h.update(b"|shard|")
        if keys is not None:
            h.update("\x00".join(keys).encode())
        h.update(repr([tuple(int(x) for x in s) for s in shapes]).encode())
    return h.hexdigest()[:16]


def _exclusions(exclude: Any) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    if exclude is None:
        return out
    if isinstance(exclude, Mapping):
        for shard, ids in exclude.items():
            out.setdefault(int(shard), set()).update(int(i) for i in ids)
        return out
    for shard, sample in exclude:
        out.setdefault(int(shard), set()).add(int(sample))
    return out


# ------------------------------------------------------------------------------------------------------
# Assignment
# ------------------------------------------------------------------------------------------------------


@dataclass
class _Piece:
    shard: int
    order: int  # position of the shard in the seeded order
    ids: list[int]  # sample ids, ascending
    buckets: list[int]  # bucket id per sample
    cost: float


def _lpt(pieces: list[_Piece], bins: int) -> tuple[list[list[_Piece]], list[float]]:
    """Greedy longest-processing-time partition: largest piece first onto the least-loaded bin."""
    loads = [0.0] * bins
    out: list[list[_Piece]] = [[] for _ in range(bins)]
    heap = [(0.0, b) for b in range(bins)]
    for piece in sorted(pieces, key=lambda p: (-p.cost, p.order, p.ids[0])):
        load, b = heapq.heappop(heap)
        out[b].append(piece)
        loads[b] = load + piece.cost
        heapq.heappush(heap, (loads[b], b))
    return out, loads


def _split_piece(piece: _Piece, cost_of: list[float]) -> tuple[_Piece, _Piece]:
    half = (len(piece.ids) + 1) // 2
    parts = []
    for ids, bk in ((piece.ids[:half], piece.buckets[:half]), (piece.ids[half:], piece.buckets[half:])):
        parts.append(_Piece(piece.shard, piece.order, ids, bk, sum(cost_of[b] for b in bk)))
    return parts[0], parts[1]


def _assign(
    pieces: list[_Piece], world: int, workers: int, cost_of: list[float], force_split: int, lockstep: bool
) -> tuple[dict[Stream, list[_Piece]], int]:
    """Pieces -> streams. Returns the assignment and how many pieces were split.

    Independent mode balances ranks (LPT over ranks, then over each rank's workers). Lockstep mode pairs
    the streams of one worker index across ranks, so it balances every stream (LPT over all R * W).
    """
    pieces = list(pieces)
    splits = 0
    bins = world * workers if lockstep else world
    cap = world * workers * _MAX_PIECES_PER_STREAM
    while True:
        per_bin, loads = _lpt(pieces, bins)
        mean = sum(loads) / bins
        want = (
            force_split > 0
            or len(pieces) < bins
            or (mean > 0 and max(loads) > (1 + _BALANCE_TOLERANCE) * mean)
        )
        splittable = [p for p in pieces if len(p.ids) > 1]
        if not want or not splittable or (len(pieces) >= cap and force_split <= 0):
            break
        # Split the costliest eighth of the pieces per round: a few LPT rounds instead of one per split.
        splittable.sort(key=lambda p: (-p.cost, -len(p.ids), p.order, p.ids[0]))
        chosen = splittable[: max(1, len(pieces) // 8, min(force_split, len(splittable)))]
        chosen_ids = {id(p) for p in chosen}
        pieces = [p for p in pieces if id(p) not in chosen_ids]
        for p in chosen:
            pieces.extend(_split_piece(p, cost_of))
        splits += len(chosen)
        force_split -= len(chosen)
    out: dict[Stream, list[_Piece]] = {}
    for r in range(world):
        if lockstep:
            # bin k -> (rank k % world, worker k // world): the LPT's first bins spread over ranks.
            per_worker = [per_bin[w * world + r] for w in range(workers)]
        else:
            per_worker, _ = _lpt(per_bin[r], workers)
        for w in range(workers):
            out[(r, w)] = sorted(per_worker[w], key=lambda p: (p.order, p.ids[0]))
    return out, splits


def _reads_of(pieces: list[_Piece]) -> list[tuple[int, list[int]]]:
    reads: list[tuple[int, list[int]]] = []
    for p in pieces:
        if reads and reads[-1][0] == p.shard:
            reads[-1] = (p.shard, sorted(reads[-1][1] + p.ids))
        else:
            reads.append((p.shard, list(p.ids)))
    return reads


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
    members: list[list[int]] = [[] for _ in range(n_classes)]
    for b, c in enumerate(class_of):
        members[c].append(b)
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


def _bucket_chains(
    reads: list[tuple[int, list[int]]], bucket_of: list[list[int]], n_buckets: int
) -> list[list[Ref]]:
    """A stream's samples split by bucket, each list in read order."""
    chains: list[list[Ref]] = [[] for _ in range(n_buckets)]
    for shard, ids in reads:
        bk = bucket_of[shard]
        for i in ids:
            chains[bk[i]].append((shard, i))
    return chains


def _reads_of_chains(chains: list[list[Ref]]) -> tuple[list[tuple[int, list[int]]], int]:
    """Per-bucket chains -> reads: runs of consecutive refs from one shard, chain by chain."""
    reads: list[tuple[int, list[int]]] = []
    for chain in chains:
        last = None
        for shard, i in chain:
            if shard != last:
                reads.append((shard, [i]))
                last = shard
            else:
                reads[-1][1].append(i)
    return [(s, sorted(ids)) for s, ids in reads], len(reads)


def _items(reads: list[tuple[int, list[int]]], bucket_of: list[list[int]]) -> list[list[tuple[Ref, int]]]:
    """Per read, its samples as (ref, bucket id) in file order."""
    return [[((shard, i), bucket_of[shard][i]) for i in ids] for shard, ids in reads]


# ------------------------------------------------------------------------------------------------------
# Batch simulation
# ------------------------------------------------------------------------------------------------------

# A simulated batch: [bucket id, refs, equal], equal marking a lockstep step shared by all ranks.
_Batch = list


def _simulate_independent(
    items: list[list[tuple[Ref, int]]], sizes: list[int], bound: int, counts: dict[str, int]
) -> list[_Batch]:
    """Bucketing of one stream in file order; a full bucket is emitted at once.

    If the buffer reaches ``bound`` samples with no full bucket, the largest pending bucket is emitted
    early (a ``bound_partial_batches``); at the end the pending buckets are emitted oldest first.
    """
    pending: dict[int, list[Ref]] = {}
    out: list[_Batch] = []
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
                out.append([b, group, False])
                buffered -= len(group)
            elif buffered >= bound:
                big = max(pending, key=lambda x: len(pending[x]))
                group = pending.pop(big)
                out.append([big, group, False, "bound"])  # marked: never packed with a later batch
                buffered -= len(group)
                counts["bound_partial_batches"] += 1
    for b, group in pending.items():  # insertion order = oldest first
        out.append([b, group, False])
        counts["partial_batches"] += 1
    return out


def _lockstep_classes(buckets: list[_Bucket], tolerance: float) -> tuple[list[int], list[int]]:
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


def _lockstep_schedule(
    chains: list[list[list[Ref]]],
    class_of: list[int],
    class_size: list[int],
    sizes: list[int],
    counts: dict[str, int],
) -> list[list[_Batch]]:
    """The lockstep steps of the R streams of one worker index (``chains[r][b]``: stream r's samples of
    bucket b in read order; a stream reads each bucket's samples as its own sequence of shard reads, so it
    can take any bucket's next samples at any time without buffering others).

    At each step every stream takes B_c samples of one class c (from its fullest bucket of that class): the
    class, among those every stream can fill, with the largest share of its samples still unused, so that
    the classes are spread evenly over the epoch. When no class can be filled on every stream, the class
    with the largest minimum count m >= 1 is taken with B = m on every stream (``reduced_steps``; still
    equal). Only when the streams share no class at all is an unequal step taken: each stream with samples
    takes its own fullest bucket (``tail_batches``); streams with nothing take nothing (the equal-steps pass
    fixes the counts).
    """
    n_r = len(chains)
    n_b = len(class_of)
    n_c = len(class_size)
    members: list[list[int]] = [[] for _ in range(n_c)]
    for b, c in enumerate(class_of):
        members[c].append(b)
    pos = [[0] * n_b for _ in range(n_r)]
    avail = [[len(chains[r][b]) for b in range(n_b)] for r in range(n_r)]
    best = [[0] * n_c for _ in range(n_r)]  # best[r][c]: the fullest bucket of class c on stream r

    def fullest(r: int, c: int) -> int:
        pick, most = members[c][0], -1
        for x in members[c]:
            if avail[r][x] > most:
                pick, most = x, avail[r][x]
        return pick

    for r in range(n_r):
        for c in range(n_c):
            best[r][c] = fullest(r, c)
    n_ok = [sum(1 for r in range(n_r) if avail[r][best[r][c]] >= class_size[c]) for c in range(n_c)]
    remaining = [sum(avail[r][b] for r in range(n_r) for b in members[c]) for c in range(n_c)]
    initial = [max(1, x) for x in remaining]
    out: list[list[_Batch]] = [[] for _ in range(n_r)]

    def take(r: int, b: int, k: int, equal: bool) -> None:
        c = class_of[b]
        was_ok = avail[r][best[r][c]] >= class_size[c]
        p = pos[r][b]
        out[r].append([b, chains[r][b][p : p + k], equal])
        pos[r][b] = p + k
        avail[r][b] -= k
        remaining[c] -= k
        best[r][c] = fullest(r, c)
        if was_ok and avail[r][best[r][c]] < class_size[c]:
            n_ok[c] -= 1

    while True:
        pick, share = -1, -1.0
        for c in range(n_c):
            if n_ok[c] == n_r and remaining[c] / initial[c] > share:
                pick, share = c, remaining[c] / initial[c]
        if pick >= 0:
            k = class_size[pick]
            for r in range(n_r):
                take(r, best[r][pick], k, True)
            continue
        if not any(remaining):
            break
        pick, m_best = -1, 0
        for c in range(n_c):
            m = min(avail[r][best[r][c]] for r in range(n_r))
            if m > m_best:
                pick, m_best = c, m
        if pick >= 0:
            for r in range(n_r):
                take(r, best[r][pick], m_best, True)
            counts["reduced_steps"] += 1
            continue
        for r in range(n_r):
            b = max(range(n_b), key=lambda x: (min(avail[r][x], sizes[x]), -x))
            if avail[r][b]:
                take(r, b, min(avail[r][b], sizes[b]), False)
                counts["tail_batches"] += 1
    return out


# ------------------------------------------------------------------------------------------------------
# Equal step counts
# ------------------------------------------------------------------------------------------------------


def _split_batches(stream: list[_Batch], need: int) -> int:
    """Add up to ``need`` batches to ``stream`` by splitting; returns how many were added.

    Only the batches after the stream's last equal (lockstep) batch are split first, largest piece first
    (latest on ties): splitting a batch shifts every later batch of the stream by one step, so earlier
    steps must not move. Then equal batches, latest first. In independent mode no batch is "equal", so
    the largest batches anywhere are split.
    """
    if need <= 0:
        return 0
    pieces = [1] * len(stream)
    last_equal = max((j for j, bt in enumerate(stream) if bt[2]), default=-1)
    heap = [(-len(bt[1]), -j) for j, bt in enumerate(stream) if j > last_equal and len(bt[1]) > 1]
    heapq.heapify(heap)
    equal_left = [j for j, bt in enumerate(stream) if bt[2] and len(bt[1]) > 1]
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
        n = len(stream[j][1])
        if n > pieces[j]:
            heapq.heappush(heap, (-math.ceil(n / pieces[j]), -j))
    if added:
        new: list[_Batch] = []
        for bt, k in zip(stream, pieces):
            if k == 1:
                new.append(bt)
                continue
            refs = bt[1]
            n = len(refs)
            start = 0
            for i in range(k):
                size = n // k + (1 if i < n % k else 0)
                new.append([bt[0], refs[start : start + size], False])
                start += size
        stream[:] = new
    return added


def _capacity(stream: list[_Batch]) -> int:
    return sum(len(bt[1]) - 1 for bt in stream)


def _round_robin(lengths: list[int]) -> list[tuple[int, int]]:
    """The DataLoader's order over workers: batch j of every worker in turn, skipping exhausted ones."""
    if not lengths or max(lengths) == 0:
        return []
    n_w = len(lengths)
    w = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)])
    j = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    order = np.argsort(j * n_w + w, kind="stable")
    return list(zip(w[order].tolist(), j[order].tolist()))


# ------------------------------------------------------------------------------------------------------
# The planner
# ------------------------------------------------------------------------------------------------------


def plan_epoch(
    index_or_shapes: Any,
    world_size: int,
    num_workers: int,
    batcher: DualConstraintBatcher,
    seed: int,
    epoch: int,
    mode: str = "independent",
    exclude: Iterable[Ref] | Mapping[int, Collection[int]] | None = None,
    max_buffered_samples: int | None = None,
    lockstep_tolerance: float = 0.05,
    underfull: str = "error",
) -> EpochPlan:
    """Plan one epoch for every (rank, worker) stream, from the index alone.

    Args:
        index_or_shapes: a ``ShardIndex`` (uses ``.shards[i].latent_shapes``, ``.keys``, ``.path``) or a
            list, one per shard, of lists of latent shapes (C, T, H, W).
        world_size: number of ranks R.
        num_workers: DataLoader workers per rank (0: the main process reads, one stream per rank).
        batcher: batch sizes per shape (its ``"auto"`` cap is resolved here from every shape of the index,
            excluded ones included, so that a resumed epoch keeps the cap). ``partial`` must be ``"emit"``.
        seed: shard-order seed (with ``epoch``).
        epoch: epoch number.
        mode: ``"independent"``, ``"lockstep"`` or ``"packed"`` (:mod:`~.packed`: one pack of samples of
            any shapes per rank and step, tokens <= ``max_tokens``, equal pack costs across ranks).
        exclude: sample refs ``(shard_id, sample_id)`` to leave out (already consumed), or
            ``{shard_id: sample_ids}``.
        max_buffered_samples: independent mode: samples a stream may hold decoded (in one worker) while
            its buckets fill; at the bound the fullest pending bucket is emitted early. None:
            ``max(64, 4 * largest batch size)``; must be at least the largest batch size. (Lockstep streams
            read per bucket and hold only the batch being assembled.)
        lockstep_tolerance: relative cost tolerance that groups buckets into one lockstep class.
        underfull: what to do when some rank can get no sample at all (fewer samples than ranks, e.g. a
            tiny validation set): ``"error"`` raises :class:`PlanError`; ``"pad"`` gives such ranks empty
            batches (``batch_size == 0``: zero-weight steps, which the token-weighted loss and metrics
            ignore). Where every rank can get a sample, the epoch is always planned; a few empty batches
            are still added where no common count of non-empty batches exists (say 5 one-sample batches on
            2 ranks), counted in ``report["empty_batches"]``.

    Returns:
        The :class:`EpochPlan`. ``plan.report`` holds: samples, batches, steps, tokens,
        padding_tokens (0: latents are never padded), skipped (reason -> count; ``oversize`` here),
        excluded, partial_batches (end of stream), bound_partial_batches (emitted early at the buffer
        bound), split_batches (batches added to equalise steps), merged_batches (partial batches packed
        into fewer to equalise steps), empty_batches (zero-sample batches, see ``underfull``),
        reduced_steps (lockstep steps with a smaller common B), lockstep_tail_steps (lockstep mode:
        steps whose batches differ in lockstep class or size across ranks; 0 in independent mode),
        unequal_steps (the same count in any mode), lockstep_classes, shard_splits, pieces,
        max_buffered_samples, max_compute, est_compute_cv (mean over steps of the CV of the batch costs
        across ranks), est_straggler_wait (:func:`~lightning_adaptiveload.monitor.stats.straggler_wait` over the
        steps: share of the summed step time spent waiting for the slowest rank, by the cost model;
        ``est_wait_share`` is its old name), samples_per_rank, plan_seconds.

    Raises:
        PlanError: ``underfull="error"`` and some rank can get no sample (fewer samples than ranks).
        ValueError: bad settings, an oversize sample under ``oversize="raise"``, mixed C in a bucket.
    """
    t0 = time.perf_counter()
    if mode not in SCHEDULES:
        raise ValueError(f"mode (schedule) must be one of {SCHEDULES}, got {mode!r}")
    if underfull not in ("error", "pad"):
        raise ValueError(f"underfull must be 'error' or 'pad', got {underfull!r}")
    if int(world_size) < 1 or int(num_workers) < 0:
        raise ValueError(f"world_size must be >= 1 and num_workers >= 0, got {world_size} and {num_workers}")
    if batcher.partial != "emit":
        raise ValueError(
            "plan_epoch needs a batcher with partial='emit': a planned epoch yields every sample exactly once, so "
            "incomplete buckets are emitted as smaller batches (counted), never carried into the next epoch"
        )
    world, workers = int(world_size), max(1, int(num_workers))
    data = _as_input(index_or_shapes)
    if mode == "packed":  # one pack per rank and step, of any shapes: see planning/packed.py
        from lightning_adaptiveload.planning.packed import plan_packed

        excl = _exclusions(exclude)
        return plan_packed(data, world, num_workers, batcher, seed, epoch, excl, underfull, t0)
    batcher.resolve_max_compute(s for shapes in data.shapes for s in shapes)

    # Buckets and per-sample bucket ids (-1: oversize, skipped).
    bucket_id: dict[tuple[int, ...], int] = {}
    by_key: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}
    buckets: list[_Bucket] = []
    bucket_of: list[list[int]] = []
    oversize = 0
    for sid, shapes in enumerate(data.shapes):
        row = []
        for i, raw in enumerate(shapes):
            shape = raw if type(raw) is tuple else tuple(raw)
            b = bucket_id.get(shape)
            if b is None:
                shape = tuple(int(x) for x in shape)
                b = bucket_id.get(shape)
            if b is None:
                where = f"{data.paths[sid]}, key {_key(data, sid, i)!r}"
                if len(shape) != 4:
                    raise ValueError(f"{where}: latent shape {list(shape)} must be (C, T, H, W)")
                s, size = batcher._sized(shape)
                if size == 0:
                    if batcher.oversize == "raise":
                        raise ValueError(batcher._oversize_message(shape, s, where=f"shard {where}: "))
                    b = -1
                else:
                    first = by_key.setdefault(shape[1:], (shape, where))
                    if first[0] != shape:
                        raise ValueError(
                            f"shard {where}: latent shape {list(shape)} differs in C from {list(first[0])} "
                            f"(shard {first[1]}) in the same (T, H, W) bucket; all latents must come from one VAE"
                        )
                    b = len(buckets)
                    buckets.append(_Bucket(shape, s, size, batcher.cost_model.cost(s)))
                bucket_id[shape] = b
                bucket_id[raw if type(raw) is tuple else tuple(raw)] = b
            if b < 0:
                oversize += 1
            row.append(b)
        bucket_of.append(row)
    sizes = [bk.batch_size for bk in buckets]
    cost_of = [bk.cost for bk in buckets]
    bound = _buffer_bound(max_buffered_samples, sizes, buckets)
    if not 0 <= float(lockstep_tolerance) < 1:
        raise ValueError(f"lockstep_tolerance must be in [0, 1), got {lockstep_tolerance!r}")
    class_of, class_size = _lockstep_classes(buckets, float(lockstep_tolerance))

    # Seeded shard order, the same on every rank (string seeds hash with SHA-512, not PYTHONHASHSEED).
    order = list(range(len(data.shapes)))
    random.Random(f"lightning-adaptiveload:{seed}:{epoch}").shuffle(order)
    position = {shard: k for k, shard in enumerate(order)}
    excl = _exclusions(exclude)
    # Load of a sample for the assignment. Independent mode: its share of a batch (1/B), so that ranks get
    # near-equal step counts and few batches must be split. Lockstep: its cost (class counts are then
    # equalised by moving samples, which also equalises the steps).
    weight_of = cost_of if mode == "lockstep" else [1.0 / s for s in sizes]
    pieces: list[_Piece] = []
    n_excluded = 0
    for sid, row in enumerate(bucket_of):
        gone = excl.get(sid, ())
        ids = [i for i, b in enumerate(row) if b >= 0 and i not in gone]
        n_excluded += sum(1 for i in gone if 0 <= i < len(row) and row[i] >= 0)
        if ids:
            bks = [row[i] for i in ids]
            pieces.append(_Piece(sid, position[sid], ids, bks, sum(weight_of[b] for b in bks)))
    n_samples = sum(len(p.ids) for p in pieces)

    counts = dict.fromkeys(
        (
            "partial_batches",
            "bound_partial_batches",
            "reduced_steps",
            "tail_batches",
            "split_batches",
            "merged_batches",
            "empty_batches",
            "moved_samples",
            "moved_batches",
        ),
        0,
    )
    assignment, n_splits = _assign(pieces, world, workers, weight_of, 0, mode == "lockstep")
    reads = {st: _reads_of(ps) for st, ps in assignment.items()}
    sim: dict[Stream, list[_Batch]] = {}
    if mode == "independent":
        for st, rd in reads.items():
            sim[st] = _simulate_independent(_items(rd, bucket_of), sizes, bound, counts)
    else:
        for w in range(workers):
            chains = [_bucket_chains(reads[(r, w)], bucket_of, len(buckets)) for r in range(world)]
            if world > 1:
                _balance_classes(chains, class_of, len(class_size), counts)
            group = _lockstep_schedule(chains, class_of, class_size, sizes, counts)
            for r in range(world):
                sim[(r, w)] = group[r]
                reads[(r, w)], _ = _reads_of_chains(chains[r])
    moves: list[tuple[Stream, Stream, list[Ref]]] = []
    # Empty batches take the cheapest bucket's shape (they carry no sample; the shape only types them).
    pad_bucket = min(range(len(buckets)), key=lambda b: (cost_of[b], b)) if buckets else None
    deficit = _equalise(sim, world, workers, mode, sizes, counts, moves, pad_bucket)
    if deficit is not None:
        raise RuntimeError(
            f"plan_epoch could not equalise the step counts at world size {world} ({deficit['short']}); "
            "this is a planner bug: report it with the seed, epoch and world size"
        )
    _apply_moves(reads, moves, sim)
    samples_per_rank = [sum(len(bt[1]) for w in range(workers) for bt in sim[(r, w)]) for r in range(world)]
    if underfull == "error" and n_samples and min(samples_per_rank) == 0:
        raise PlanError(_underfull_message(world, workers, len(data.shapes), n_samples, samples_per_rank))

    step_order = [_round_robin([len(sim[(r, w)]) for w in range(workers)]) for r in range(world)]
    steps = len(step_order[0]) if step_order else 0
    batch_steps: dict[Stream, list[int]] = {}
    seq_len = np.array([bk.seq_len for bk in buckets] + [0], dtype=np.int64)
    bucket_cost = np.array(cost_of + [0.0], dtype=np.float64)
    cls = np.array(class_of + [-1], dtype=np.int64)
    step_bucket = np.full((world, steps), -1, dtype=np.int64)
    step_n = np.zeros((world, steps), dtype=np.int64)
    for r in range(world):
        for w in range(workers):
            batches = sim[(r, w)]
            # round robin: batch j of worker w is taken at this rank's step list position
            batch_steps[(r, w)] = [0] * len(batches)
        for k, (w, j) in enumerate(step_order[r]):
            batch_steps[(r, w)][j] = k
        for w in range(workers):
            batches = sim[(r, w)]
            if batches:
                idx = np.array(batch_steps[(r, w)], dtype=np.int64)
                step_bucket[r, idx] = [bt[0] for bt in batches]
                step_n[r, idx] = [len(bt[1]) for bt in batches]
    tokens = step_n * seq_len[step_bucket]
    global_tokens = tokens.sum(axis=0).tolist() if steps else []
    costs = step_n * bucket_cost[step_bucket]
    if steps:
        sig_same = (cls[step_bucket] == cls[step_bucket[0]]).all(axis=0) & (step_n == step_n[0]).all(axis=0)
        unequal = int((~sig_same).sum())
        figures = balance_summary(costs.T)  # the cost model's estimate of the step times
        est_cv, est_wait = figures["cv_mean"], figures["straggler_wait"]
    else:
        unequal, est_cv, est_wait = 0, 0.0, 0.0
    plan_streams = {st: [bt[1] for bt in sim[st]] for st in sim}
    report = {
        "epoch": int(epoch),
        "mode": mode,
        "world_size": world,
        "num_workers": int(num_workers),
        "samples": n_samples,
        "batches": sum(len(v) for v in plan_streams.values()),
        "steps": steps,
        "tokens": int(sum(global_tokens)),
        "padding_tokens": 0,
        "skipped": {"oversize": oversize} if oversize else {},
        "excluded": n_excluded,
        "partial_batches": counts["partial_batches"],
        "bound_partial_batches": counts["bound_partial_batches"],
        "split_batches": counts["split_batches"],
        "merged_batches": counts["merged_batches"],
        "empty_batches": counts["empty_batches"],
        "reduced_steps": counts["reduced_steps"],
        "lockstep_tail_steps": unequal if mode == "lockstep" else 0,
        "unequal_steps": unequal,
        "lockstep_classes": len(class_size),
        "moved_samples": counts["moved_samples"],
        "moved_batches": counts["moved_batches"],
        "shard_splits": n_splits,
        "reads": sum(len(v) for v in reads.values()),
        "max_buffered_samples": bound,
        "max_compute": batcher.max_compute,
        "est_compute_cv": est_cv,
        "est_straggler_wait": est_wait,
        "est_wait_share": est_wait,  # the old name of est_straggler_wait, kept for scripts
        "samples_per_rank": [
            sum(len(b) for w in range(workers) for b in plan_streams[(r, w)]) for r in range(world)
        ],
        "plan_seconds": 0.0,
    }
    plan = EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=int(seed),
        epoch=int(epoch),
        mode=mode,
        buckets=[
            {
                "shape": bk.shape,
                "seq_len": bk.seq_len,
                "batch_size": bk.batch_size,
                "cost": bk.cost,
                "lockstep_class": class_of[b],
            }
            for b, bk in enumerate(buckets)
        ],
        streams=plan_streams,
        batch_buckets={st: [bt[0] for bt in sim[st]] for st in sim},
        batch_steps=batch_steps,
        reads=reads,
        step_order=step_order,
        steps=steps,
        global_tokens=[int(x) for x in global_tokens],
        report=report,
    )
    report["plan_seconds"] = time.perf_counter() - t0
    return plan


def _key(data: _Input, shard: int, i: int) -> str:
    keys = data.keys[shard]
    return str(keys[i]) if keys is not None and i < len(keys) else f"#{i}"


def _buffer_bound(max_buffered: int | None, sizes: list[int], buckets: list[_Bucket]) -> int:
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


def _apply_moves(
    reads: dict[Stream, list[tuple[int, list[int]]]],
    moves: list[tuple[Stream, Stream, list[Ref]]],
    sim: dict[Stream, list[_Batch]],
) -> None:
    """Make the reads of every stream that gave or got samples match its batches: its own reads keep the
    samples it still holds, and the samples it got are read from their shards (``select``) after them.

    Computed from the final batches, not move by move, so a sample that moved more than once (even back)
    is read once, by the stream that holds it.
    """
    touched = {st for giver, receiver, _ in moves for st in (giver, receiver)}
    for st in touched:
        have = {ref for bt in sim[st] for ref in bt[1]}
        kept = [(shard, [i for i in ids if (shard, i) in have]) for shard, ids in reads[st]]
        kept = [(shard, ids) for shard, ids in kept if ids]
        known = {(shard, i) for shard, ids in kept for i in ids}
        extra: dict[int, list[int]] = {}
        for shard, i in sorted(have - known):
            extra.setdefault(shard, []).append(i)
        reads[st] = kept + sorted(extra.items())


def _fixed(stream: list[_Batch]) -> int:
    """Length of the stream's prefix that must stay in place: up to its last equal (lockstep) batch."""
    return max((j + 1 for j, bt in enumerate(stream) if bt[2]), default=0)


def _pack_start(stream: list[_Batch], sizes: list[int]) -> int:
    """Where the stream's packable batches begin: after its last lockstep batch and after its last batch
    emitted early at the buffer bound (independent mode): packing such a batch with a later one would hold
    its samples past the bound. (A lockstep stream reads each bucket on demand, so packing its tail batches
    holds nothing extra.)"""
    bound = max((j + 1 for j, bt in enumerate(stream) if len(bt) > 3), default=0)
    return max(_fixed(stream), bound)


@dataclass
class _Bounds:
    """Batch counts a slot (a list of streams that must together reach the common count) can reach.

    ``count``: batches now. ``most``: samples (every batch one sample: the most batches a split can
    reach). ``least``: the fewest batches a merge can reach: every batch before :func:`_pack_start`, and
    per (stream, bucket) the partial batches after it packed into ``ceil(samples / B)`` batches.
    """

    count: int
    most: int
    least: int


def _bounds(sim: dict[Stream, list[_Batch]], slot: list[Stream], sizes: list[int]) -> _Bounds:
    count = most = least = 0
    for st in slot:
        stream = sim[st]
        count += len(stream)
        most += sum(len(bt[1]) for bt in stream)
        k = _pack_start(stream, sizes)
        least += k
        partial: dict[int, int] = {}
        for bt in stream[k:]:
            if len(bt[1]) >= sizes[bt[0]]:
                least += 1
            else:
                partial[bt[0]] = partial.get(bt[0], 0) + len(bt[1])
        least += sum(-(-n // sizes[b]) for b, n in partial.items())
    return _Bounds(count, most, least)


def _take(stream: list[_Batch], bucket: int, k: int, partial_only: bool, sizes: list[int]) -> list[Ref]:
    """Remove ``k`` samples of ``bucket`` from the stream's movable batches (after its last lockstep
    batch), last batch first; a batch left empty is dropped. Returns the refs, in file order."""
    out: list[Ref] = []
    first = _pack_start(stream, sizes) if partial_only else _fixed(stream)
    for j in range(len(stream) - 1, first - 1, -1):
        bt = stream[j]
        if bt[0] != bucket or (partial_only and len(bt[1]) >= sizes[bucket]):
            continue
        n = min(k - len(out), len(bt[1]))
        out.extend(bt[1][len(bt[1]) - n :])
        bt[1] = bt[1][: len(bt[1]) - n]
        if not bt[1]:
            del stream[j]
        if len(out) == k:
            break
    return sorted(out)


def _tail_samples(stream: list[_Batch], partial_only: bool, sizes: list[int]) -> dict[int, int]:
    """Samples per bucket in the stream's movable batches (only its packable partial ones, see
    :func:`_pack_start`, if ``partial_only``)."""
    out: dict[int, int] = {}
    for bt in stream[_pack_start(stream, sizes) if partial_only else _fixed(stream) :]:
        if bt[1] and not (partial_only and len(bt[1]) >= sizes[bt[0]]):
            out[bt[0]] = out.get(bt[0], 0) + len(bt[1])
    return out


def _merge_batches(stream: list[_Batch], need: int, sizes: list[int]) -> int:
    """Remove up to ``need`` batches from ``stream`` by packing its partial batches of one bucket (from
    :func:`_pack_start` on) into fewer; returns how many were removed.

    The packed batches take the places of the last ones of the bucket (file order kept), each at most
    the bucket's batch size B, so every constraint of a batch still holds.
    """
    removed = 0
    while removed < need:
        first = _pack_start(stream, sizes)
        where: dict[int, list[int]] = {}
        for j in range(first, len(stream)):
            bt = stream[j]
            if bt[1] and len(bt[1]) < sizes[bt[0]]:
                where.setdefault(bt[0], []).append(j)
        best, spare = -1, 0
        for b, pos in where.items():
            n = sum(len(stream[j][1]) for j in pos)
            s = len(pos) - (-(-n // sizes[b]))
            if s > spare:
                best, spare = b, s
        if best < 0:
            break
        pos = where[best]
        keep = len(pos) - min(spare, need - removed)
        refs = [ref for j in pos for ref in stream[j][1]]
        n = len(refs)
        chunks, start = [], 0
        for i in range(keep):
            size = n // keep + (1 if i < n % keep else 0)
            chunks.append(refs[start : start + size])
            start += size
        for j, chunk in zip(pos[len(pos) - keep :], chunks):
            stream[j] = [best, chunk, False]
        for j in reversed(pos[: len(pos) - keep]):
            del stream[j]
        removed += len(pos) - keep
    return removed


def _packed_least(sim: dict[Stream, list[_Batch]], slots: list[list[Stream]], sizes: list[int]) -> int:
    """The fewest batches all slots together can reach: as :class:`_Bounds` ``least``, but each bucket's
    partial batches packed across all streams (samples can move between them)."""
    least = 0
    partial: dict[int, int] = {}
    for slot in slots:
        for st in slot:
            stream = sim[st]
            k = _pack_start(stream, sizes)
            least += k
            for bt in stream[k:]:
                if len(bt[1]) >= sizes[bt[0]]:
                    least += 1
                else:
                    partial[bt[0]] = partial.get(bt[0], 0) + len(bt[1])
    return least + sum(-(-n // sizes[b]) for b, n in partial.items())


def _common_count(bounds: list[_Bounds], least: int, pad: bool) -> int | None:
    """The step count every slot should reach, or None if no count can be reached without empty batches.

    Any count T with ``ceil(least / S) <= T <= samples // S`` (``least``: :func:`_packed_least`) can be
    reached by moving samples between slots and then splitting or packing within each. Among those, the
    one that changes the fewest batches (moves weigh more: they add reads) is taken, the smaller on ties
    (fuller batches).
    """
    n_slots = len(bounds)
    total = sum(b.most for b in bounds)
    if total == 0:
        return 0
    lo = max(1, -(-least // n_slots))
    hi = total // n_slots
    if lo > hi:
        return lo if pad else None
    count = np.array([b.count for b in bounds], dtype=np.int64)
    most = np.array([b.most for b in bounds], dtype=np.int64)
    least = np.array([b.least for b in bounds], dtype=np.int64)
    cands = np.unique(np.clip(np.concatenate([count, most, least, [lo, hi]]), lo, hi))
    t = cands[:, None]
    cost = np.abs(count[None, :] - t) + 4 * (np.maximum(0, t - most) + np.maximum(0, least - t))
    return int(cands[int(np.argmin(cost.sum(axis=1)))])


def _equal_counts(
    sim: dict[Stream, list[_Batch]],
    slots: list[list[Stream]],
    sizes: list[int],
    counts: dict[str, int],
    moves: list[tuple[Stream, Stream, list[Ref]]],
    pad_bucket: int | None,
) -> dict[str, Any] | None:
    """Give every slot (a list of streams: one rank's, or one stream) the same number of batches.

    1. The common count T is chosen between the fewest and the most batches the slots can reach together
       (:func:`_common_count`), not at the largest count of one slot.
    2. Samples move between slots until each can reach T alone: a slot with fewer samples than T gets
       samples from the slot with the most to spare; a slot whose batches cannot be packed into T gets
       rid of one partial batch's worth at a time. Moved samples go to the end of the receiver's
       shortest stream as one batch (read from the giver's shard), and leave only batches after the
       giver's last lockstep batch, so no lockstep step shifts.
    3. Each slot then splits (``split_batches``) or packs (``merged_batches``) its own batches to T.
    4. With ``pad_bucket`` set, a slot that still has fewer samples than T takes empty batches of that
       bucket (zero-weight steps, ``empty_batches``); without it, the shortfall is returned.

    Returns None on success, else the shortfall (for the error message).
    """
    n_slots = len(slots)
    bounds = [_bounds(sim, slot, sizes) for slot in slots]
    least = _packed_least(sim, slots, sizes)
    target = _common_count(bounds, least, pad_bucket is not None)
    if target is None:
        return {"target": -(-least // n_slots), "short": [(0, 1)], "slots": slots}
    slot_of = {st: i for i, slot in enumerate(slots) for st in slot}

    def room(st_g: Stream, bucket: int, k: int) -> tuple[Stream, int] | None:
        """A partial batch of ``bucket`` in another stream that can take ``k`` more samples without raising
        its slot's fewest batches above the target (or, in the giver's own slot, at all)."""
        size = sizes[bucket]
        for st, stream in sim.items():
            if st == st_g or st not in slot_of:
                continue
            first = _pack_start(stream, sizes)
            spots = [
                j for j in range(first, len(stream)) if stream[j][0] == bucket and len(stream[j][1]) < size
            ]
            if not spots:
                continue
            u = sum(len(stream[j][1]) for j in spots)
            j = next((j for j in spots if len(stream[j][1]) + k <= size), None)
            if j is None or not stream[j][1]:
                continue
            grow = -(-(u + k) // size) - (-(-u // size))
            q = slot_of[st]
            if grow == 0 or (q != slot_of[st_g] and bounds[q].least + grow <= target):
                return st, j
        return None

    def give(g: int, q: int, st_g: Stream, bucket: int, k: int, partial_only: bool) -> None:
        refs = _take(sim[st_g], bucket, k, partial_only, sizes)
        st_q = min(slots[q], key=lambda st: (len(sim[st]), st))
        sim[st_q].append([bucket, refs, False])
        moves.append((st_g, st_q, refs))
        counts["moved_batches"] += 1
        bounds[g] = _bounds(sim, slots[g], sizes)
        bounds[q] = _bounds(sim, slots[q], sizes)

    def pack(g: int) -> bool:
        """Move one partial batch's worth of a bucket from slot ``g`` into a partial batch elsewhere."""
        for st in slots[g]:
            for b, n in _tail_samples(sim[st], True, sizes).items():
                k = n - sizes[b] * (-(-n // sizes[b]) - 1)
                hit = room(st, b, k)
                if hit is None:
                    continue
                refs = _take(sim[st], b, k, True, sizes)
                st_q, j = hit
                sim[st_q][j] = [b, sim[st_q][j][1] + refs, False]
                moves.append((st, st_q, refs))
                counts["moved_batches"] += 1
                bounds[g] = _bounds(sim, slots[g], sizes)
                bounds[slot_of[st_q]] = _bounds(sim, slots[slot_of[st_q]], sizes)
                return True
        return False

    while True:
        heavy = [i for i in range(n_slots) if bounds[i].least > target]
        short = [i for i in range(n_slots) if bounds[i].most < target]
        if heavy:
            g = max(heavy, key=lambda i: (bounds[i].least - target, -i))
            # One partial batch's worth of one bucket (the giver's packed count drops by one): first into
            # another stream's partial batch of that bucket that has room (packing across streams)...
            if pack(g):
                continue
            # ... else as a new batch to the slot with the fewest batches
            q = min(range(n_slots), key=lambda i: (bounds[i].least, i))
            if bounds[q].least >= target:
                # No slot can take a batch: make room by packing another slot's partial batches, or
                # settle for more steps.
                if not any(pack(i) for i in range(n_slots) if i != g):
                    target = max(x.least for x in bounds)
                continue
            pick = None
            for st in slots[g]:
                for b, n in _tail_samples(sim[st], True, sizes).items():
                    pick = pick or (st, b, n - sizes[b] * (-(-n // sizes[b]) - 1), True)
            if pick is None:
                for st in slots[g]:
                    bt = next((bt for bt in reversed(sim[st][_fixed(sim[st]) :]) if bt[1]), None)
                    if bt is not None:
                        pick = (st, bt[0], len(bt[1]), False)
                        break
            if pick is None:
                target = max(x.least for x in bounds)  # nothing the giver may move: settle for more steps
                continue
            give(g, q, *pick)
            continue
        if short:
            q = short[0]
            g = max(range(n_slots), key=lambda i: (bounds[i].most, -i))
            spare = bounds[g].most - target
            if spare <= 0:
                break
            best = None
            for st in slots[g]:
                for b, n in _tail_samples(sim[st], False, sizes).items():
                    if best is None or n > best[2]:
                        best = (st, b, n)
            if best is None:
                break
            st, b, n = best
            give(g, q, st, b, min(target - bounds[q].most, spare, sizes[b], n), False)
            continue
        break
    short = []
    for i, slot in enumerate(slots):
        need = target - bounds[i].count
        if need > 0:
            for st in sorted(slot, key=lambda x: -_capacity(sim[x])):
                if need <= 0:
                    break
                added = _split_batches(sim[st], need)
                counts["split_batches"] += added
                need -= added
        elif need < 0:
            for st in slot:
                removed = _merge_batches(sim[st], -need, sizes)
                counts["merged_batches"] += removed
                need += removed
        if need > 0 and pad_bucket is not None:
            for _ in range(need):
                st = min(slot, key=lambda x: (len(sim[x]), x))
                sim[st].append([pad_bucket, [], False])
            counts["empty_batches"] += need
            need = 0
        if need != 0:
            short.append((i, need))
    if short:
        return {"target": target, "short": short, "slots": slots}
    return None


def _equalise(
    sim: dict[Stream, list[_Batch]],
    world: int,
    workers: int,
    mode: str,
    sizes: list[int],
    counts: dict[str, int],
    moves: list[tuple[Stream, Stream, list[Ref]]],
    pad_bucket: int | None,
) -> dict[str, Any] | None:
    """Give every rank the same number of steps (:func:`_equal_counts` over ranks).

    Lockstep first equalises each worker index across ranks (one stream per slot), so that every rank's
    round robin interleaves its workers identically and the lockstep steps stay aligned; where a worker
    index holds too few samples for that, the ranks are equalised as wholes (the steps after the first
    unequal one are then counted in ``unequal_steps``). Returns None on success, else the shortfall.
    """
    if mode == "lockstep" and world > 1:
        for w in range(workers):
            _equal_counts(sim, [[(r, w)] for r in range(world)], sizes, counts, moves, None)
    return _equal_counts(
        sim, [[(r, w) for w in range(workers)] for r in range(world)], sizes, counts, moves, pad_bucket
    )


def _underfull_message(
    world: int, workers: int, n_shards: int, n_samples: int, samples_per_rank: list[int]
) -> str:
    empty = [r for r, n in enumerate(samples_per_rank) if n == 0]
    return (
        f"world size {world}: {n_samples} samples in {n_shards} shards leave {len(empty)} rank(s) without "
        f"any sample (rank {empty[0]} first), with {workers} stream(s) per rank; those ranks would take only "
        "empty (zero-weight) steps. Pass underfull='pad' to allow that (the DataModule's val_underfull), or "
        "use more data or fewer ranks"
    )


def consumed_refs(plan: EpochPlan, steps_per_rank: Sequence[int] | int) -> set[Ref]:
    """The sample refs in the first ``steps_per_rank[r]`` steps of every rank r (an int: the same for all)."""
    if isinstance(steps_per_rank, int):
        steps_per_rank = [steps_per_rank] * plan.world_size
    if len(steps_per_rank) != plan.world_size:
        raise ValueError(
            f"steps_per_rank has {len(steps_per_rank)} entries but the plan has world size {plan.world_size}"
        )
    out: set[Ref] = set()
    for r, k in enumerate(steps_per_rank):
        if not 0 <= int(k) <= plan.steps:
            raise ValueError(f"rank {r} consumed {k} steps but the plan has {plan.steps}")
        for w, j in plan.step_order[r][: int(k)]:
            out.update(plan.streams[(r, w)][j])
    return out


def continue_plan(plan: EpochPlan, steps_done: int, num_workers: int) -> EpochPlan:
    """The rest of ``plan`` after ``steps_done`` steps, for the same ranks and ``num_workers`` workers.

    Every rank takes exactly the batches it would have taken in the uninterrupted epoch, at the same
    steps (so the resumed run sees the same data in the same order, and lockstep steps stay equal); the
    remaining steps are dealt to the new workers round robin, which is the order the DataLoader takes them
    in. A stream reads, per shard, the samples its batches need (one read per shard, opened when first
    needed).

    Args:
        plan: the epoch's plan (same world size as now).
        steps_done: steps every rank has consumed (0 <= steps_done <= plan.steps).
        num_workers: DataLoader workers per rank now (0: the main process).

    Returns:
        A plan with ``steps = plan.steps - steps_done``; its report counts the remaining work.
    """
    if not 0 <= steps_done <= plan.steps:
        raise ValueError(f"steps_done={steps_done} is outside 0..{plan.steps} for this plan")
    workers = max(1, int(num_workers))
    world = plan.world_size
    steps = plan.steps - steps_done
    streams: dict[Stream, list[list[Ref]]] = {(r, w): [] for r in range(world) for w in range(workers)}
    buckets_of: dict[Stream, list[int]] = {(r, w): [] for r in range(world) for w in range(workers)}
    batch_steps: dict[Stream, list[int]] = {(r, w): [] for r in range(world) for w in range(workers)}
    for r in range(world):
        for k in range(steps):
            w_old, j = plan.step_order[r][steps_done + k]
            st = (r, k % workers)
            streams[st].append(plan.streams[(r, w_old)][j])
            buckets_of[st].append(plan.batch_buckets[(r, w_old)][j])
            batch_steps[st].append(k)
    reads: dict[Stream, list[tuple[int, list[int]]]] = {}
    for st, batches in streams.items():
        per_shard: dict[int, list[int]] = {}
        for batch in batches:
            for shard, i in batch:
                per_shard.setdefault(shard, []).append(i)
        reads[st] = [(shard, sorted(ids)) for shard, ids in per_shard.items()]
    step_order = [[(k % workers, k // workers) for k in range(steps)] for _ in range(world)]
    report = dict(plan.report)
    samples = sum(len(b) for v in streams.values() for b in v)
    report.update(
        num_workers=int(num_workers),
        samples=samples,
        batches=sum(len(v) for v in streams.values()),
        steps=steps,
        tokens=int(sum(plan.global_tokens[steps_done:])),
        excluded=report.get("excluded", 0) + report.get("samples", 0) - samples,
        resumed_at_step=steps_done,
        reads=sum(len(v) for v in reads.values()),
        samples_per_rank=[sum(len(b) for w in range(workers) for b in streams[(r, w)]) for r in range(world)],
    )
    return EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=plan.seed,
        epoch=plan.epoch,
        mode=plan.mode,
        buckets=plan.buckets,
        streams=streams,
        batch_buckets=buckets_of,
        batch_steps=batch_steps,
        reads=reads,
        step_order=step_order,
        steps=steps,
        global_tokens=list(plan.global_tokens[steps_done:]),
        report=report,
    )

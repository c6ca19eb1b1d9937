"""The ``lockstep`` schedule on arrays, for a plan that keeps one rank's streams (:mod:`.lockstep`).

A rank-local plan still decides every stream's steps (the steps line up across ranks, and the step count,
global tokens and balance figures are global), but it needs the batches, the sample refs and the reads
of its own streams only. Here each worker index's samples are held as per-bucket *chains* of every stream
(:class:`_Chains`): counts per chain and per read, and a sort order that finds any chain position's sample.
The class balance moves samples by chain position, the steps come from the chains' counts
(:func:`~.lockstep_schedule.schedule_takes`), and only the samples of the kept rank's streams and of the
other streams' unequal batches are looked up; only the kept rank's batches and reads become Python
objects. Another rank's stream holds a shared placeholder for each equal batch (its length is what the
rest of the planner counts) and its unequal batches in full (the packed tail re-plans their samples
across ranks).

The choices are those of :func:`~.lockstep.lockstep_batches`, sample for sample: a rank-local plan
equals the kept part of the plan of every stream (``tests/planning/test_chunked_plan.py``). Pure NumPy.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
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
    stable_order_within,
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
    chains = _Chains.of_pieces([pieces[(r, w)] for r in range(world)], bucket_ids, shard_offsets, n_b)
    if world > 1:
        chains.balance(class_of, len(class_size), counts)
    avail = chains.lengths().reshape(world, n_b)
    left = avail.copy()  # what the steps leave of each chain (schedule_takes consumes it)
    b, k, eq = schedule_takes(left, class_of, class_size, sizes, counts)
    n_eq = int(eq.sum())  # the equal steps come first
    rows = np.arange(world, dtype=np.int64)[:, None]
    tail_b, tail_k = b[:, n_eq:], k[:, n_eq:]
    tail_taken = np.zeros(world * n_b, dtype=np.int64)
    np.add.at(tail_taken, (rows * n_b + tail_b).ravel(), tail_k.ravel())
    eq_taken = avail - left - tail_taken.reshape(world, n_b)  # per chain, the samples of its equal steps
    per_stream_reads = chains.prefix_reads(eq_taken.ravel())
    # Every other stream's unequal batches, looked up at once: batch (r, j) takes tail_k[r, j] samples of
    # chain (r, tail_b[r, j]) from where its equal steps and earlier unequal steps stopped.
    tail_start = chain_starts(tail_b, tail_k, n_b) + eq_taken[rows, tail_b]
    has = tail_k > 0
    has[keep] = False
    br, bj = np.nonzero(has)  # by stream, then step
    n_of = tail_k[br, bj]
    chain_of = br * n_b + tail_b[br, bj]
    shard, sid = chains.refs(np.repeat(chain_of, n_of), _ranges(tail_start[br, bj], n_of))
    refs = list(zip(shard.tolist(), sid.tolist()))
    ends = np.cumsum(n_of).tolist()
    tail: dict[int, list[Batch]] = collections.defaultdict(list)
    for r, bb, lo, hi in zip(br.tolist(), tail_b[br, bj].tolist(), [0] + ends[:-1], ends):
        tail[r].append(Batch(bb, refs[lo:hi], False))
    for r in range(world):
        st = (r, w)
        out.equal[st] = (b[r, :n_eq], k[r, :n_eq])
        out.lockstep_reads[st] = int(per_stream_reads[r])
        if r != keep:  # its equal batches are placeholders, its unequal ones (a few) are kept whole
            out.sim[st] = [EQUAL_ELSEWHERE] * n_eq + tail.get(r, [])
    # The kept rank's stream: its whole chains, then its batches as slices of them.
    lens = avail[keep]
    chain_of = np.repeat(keep * n_b + np.arange(n_b, dtype=np.int64), lens)
    shard, sid = chains.refs(chain_of, _ranges(np.zeros_like(lens), lens))
    refs = list(zip(shard.tolist(), sid.tolist()))
    ends = np.cumsum(lens).tolist()
    kept_chains = [refs[lo:hi] for lo, hi in zip([0] + ends[:-1], ends)]
    start = chain_starts(b[keep : keep + 1], k[keep : keep + 1], n_b)[0]
    out.sim[(keep, w)] = [
        Batch(bb, kept_chains[bb][p : p + kk], j < n_eq)
        for j, (bb, p, kk) in enumerate(zip(b[keep].tolist(), start.tolist(), k[keep].tolist()))
        if kk
    ]
    out.reads[(keep, w)] = _reads_of_chains(kept_chains)
    return out, dict(counts)


class _Chains:
    """One worker index's samples as the per-bucket chains of its R streams: counts, one sort order, and
    the class balance as trims and appends, with no (shard, id) columns in chain order.

    Stream r's chain of bucket b (chain ``c = r * n_b + b``) is the stream's samples of bucket b in read
    order (:func:`~.assign.reads_of`'s reads: its pieces in order, consecutive pieces of one shard read as
    one, ids ascending), as :func:`~.lockstep._bucket_chains` gives it. The samples are held in *read
    order* (stream by stream, read by read): ``read_lo[k]`` is read k's first position, ``read_shard[k]``
    its shard, ``read_id0[k]`` its first sample id (its ids run on from there, unless ``listed[k]``: then
    they are ``listed_ids[listed_lo[k]:]``). ``order`` lists the read positions by chain, as a stable sort
    by chain does: the p-th sample of chain c is at read position ``order[first[c] + p]``; ``length[c]``
    counts chain c's samples. Per chain, its *segments* (its samples in one read) in read order give its
    shard runs without the samples: ``seg_chain``, ``seg_start`` (the first position in its chain) and
    ``seg_new`` (whether it starts a run of one shard in the chain).

    The class balance (:meth:`balance`) moves no sample: a giver keeps the first ``kept[c]`` samples of
    each chain and gives the rest; a receiver appends the samples it got after its own. So chain c is its
    first ``kept[c]`` own samples, then ``recv_count[c]`` received ones: ``recv_shard`` and ``recv_sid``
    from ``recv_first[c]`` on, in the order appended. :meth:`refs` finds the sample at any chain position.

    The work per sample is a concatenation of the reads' bucket ids, a count per (read, bucket) and a
    stable sort of each stream's samples by bucket (:func:`~.lockstep_schedule.stable_order_within`);
    the balance, the steps and the read counts work on counts, and only the positions looked up (the
    samples given, the kept rank's chains, the unequal batches) touch samples.
    """

    def __init__(self, world: int, n_b: int) -> None:
        """No samples in ``world`` streams of ``n_b`` buckets (:meth:`of_pieces` fills them)."""
        self.world, self.n_b = world, n_b
        none = np.zeros(0, dtype=np.int64)
        self.read_lo = self.read_shard = self.read_id0 = self.listed_lo = self.listed_ids = none
        self.listed = np.zeros(0, dtype=bool)
        self.order = self.seg_chain = self.seg_start = none
        self.seg_new = np.zeros(0, dtype=bool)
        self.length, self.first, self.kept = (np.zeros(world * n_b, dtype=np.int64) for _ in range(3))
        self.recv_shard = self.recv_sid = none
        self.recv_first, self.recv_count = (np.zeros(world * n_b, dtype=np.int64) for _ in range(2))

    @classmethod
    def of_pieces(
        cls, pieces: list[list[Piece]], bucket_ids: np.ndarray, shard_offsets: np.ndarray, n_b: int | None
    ) -> _Chains:
        """The chains of the streams whose pieces are ``pieces[r]`` (``n_b``: bucket count, or None for
        the largest bucket id of the samples + 1)."""
        world = len(pieces)
        shards: list[int] = []
        ids: list[np.ndarray] = []
        reads_per_stream = np.zeros(world, dtype=np.int64)
        for r, stream_pieces in enumerate(pieces):
            last = len(ids)
            for p in stream_pieces:
                a = p.id_array if p.id_array is not None else np.asarray(p.ids, dtype=np.int64)
                if len(ids) > last and shards[-1] == p.shard:
                    ids[-1] = np.sort(np.concatenate([ids[-1], a]))
                else:
                    shards.append(p.shard)
                    ids.append(a)
            reads_per_stream[r] = len(ids) - last
        offsets, bucket_ids = np.asarray(shard_offsets, dtype=np.int64), np.asarray(bucket_ids)
        # A read of consecutive ids (a whole shard, or one piece of it) is a slice of the bucket ids.
        id0 = [int(a[0]) if len(a) else 0 for a in ids]
        run_on = [len(a) == 0 or int(a[-1]) - int(a[0]) == len(a) - 1 for a in ids]
        parts = [
            bucket_ids[offsets[s] + a0 : offsets[s] + a0 + len(a)] if ok else bucket_ids[offsets[s] + a]
            for s, a, a0, ok in zip(shards, ids, id0, run_on)
        ]
        bk = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if n_b is None:
            n_b = int(bk.max()) + 1 if len(bk) else 1
        out = cls(world, n_b)
        n_reads = len(ids)
        read_len = np.fromiter(map(len, ids), dtype=np.int64, count=n_reads)
        out.read_lo = np.r_[0, np.cumsum(read_len)].astype(np.int64)
        out.read_shard = np.asarray(shards, dtype=np.int64)
        out.read_id0 = np.asarray(id0, dtype=np.int64)
        out.listed = ~np.asarray(run_on, dtype=bool)
        listed_len = np.where(out.listed, read_len, 0)
        out.listed_lo = np.cumsum(listed_len) - listed_len
        out.listed_ids = (
            np.concatenate([a for a, ok in zip(ids, run_on) if not ok]).astype(np.int64)
            if not all(run_on)
            else np.zeros(0, dtype=np.int64)
        )
        # Samples per (read, bucket); a stream's chains are its reads' columns, read by read.
        per_read = np.bincount(
            np.repeat(np.arange(n_reads, dtype=np.int64) * n_b, read_len) + bk, minlength=n_reads * n_b
        ).reshape(n_reads, n_b)
        read_stream = np.repeat(np.arange(world, dtype=np.int64), reads_per_stream)
        cells = stable_order((read_stream[:, None] * n_b + np.arange(n_b)).ravel(), world * n_b)
        seg_count = per_read.ravel()[cells]
        nz = seg_count > 0
        seg_count, cells = seg_count[nz], cells[nz]
        out.seg_chain = read_stream[cells // n_b] * n_b + cells % n_b
        seg_shard = out.read_shard[cells // n_b]
        out.length = np.bincount(out.seg_chain, weights=seg_count, minlength=world * n_b).astype(np.int64)
        out.first = np.cumsum(out.length) - out.length
        out.seg_start = np.cumsum(seg_count) - seg_count - out.first[out.seg_chain]
        out.seg_new = np.ones(len(cells), dtype=bool)
        out.seg_new[1:] = (out.seg_chain[1:] != out.seg_chain[:-1]) | (seg_shard[1:] != seg_shard[:-1])
        out.kept = out.length.copy()
        # The chain order: each stream's samples stably sorted by bucket.
        stream_lo = out.read_lo[np.r_[0, np.cumsum(reads_per_stream)]].tolist()
        out.order = stable_order_within(bk, n_b, stream_lo)
        return out

    def own_refs(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, sample id) of the own samples at positions ``at`` of the chain order (``first[c] + p``)."""
        i = self.order[at]
        k = np.searchsorted(self.read_lo, i, side="right") - 1
        step = i - self.read_lo[k]
        sid = self.read_id0[k] + step
        listed = self.listed[k]
        if listed.any():
            sid[listed] = self.listed_ids[self.listed_lo[k[listed]] + step[listed]]
        return self.read_shard[k], sid

    def refs(self, chain: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, sample id) of position ``pos`` of chain ``chain`` after the balance (arrays)."""
        kept = self.kept[chain]
        own = pos < kept
        shard = np.empty(len(pos), dtype=np.int64)
        sid = np.empty(len(pos), dtype=np.int64)
        shard[own], sid[own] = self.own_refs(self.first[chain[own]] + pos[own])
        got = self.recv_first[chain[~own]] + pos[~own] - kept[~own]
        shard[~own], sid[~own] = self.recv_shard[got], self.recv_sid[got]
        return shard, sid

    def lengths(self) -> np.ndarray:
        """Every chain's sample count after the balance."""
        return self.kept + self.recv_count

    def balance(self, class_of: list[int], n_classes: int, counts: dict[str, int]) -> None:
        """:func:`_balance` on the chains: the givers' ``kept`` lengths and the samples each chain got."""
        n_b = self.n_b
        have_b = self.length.reshape(self.world, n_b)
        got: list[tuple[np.ndarray, ...]] = []
        for given, bucket, deficit in _class_moves(have_b, self.first, class_of, n_classes, self.kept):
            shard, sid = self.own_refs(given)
            by = np.lexsort((sid, shard, bucket))
            stream = np.repeat(np.arange(self.world, dtype=np.int64), deficit)
            got.append((shard[by], sid[by], stream * n_b + bucket[by]))
            counts["moved_samples"] += len(given)
        if not got:
            return
        shard, sid, chain = (np.concatenate(col) for col in zip(*got))
        by_chain = stable_order(chain, self.world * n_b)  # each chain's samples in the order dealt
        self.recv_shard, self.recv_sid = shard[by_chain], sid[by_chain]
        self.recv_count = np.bincount(chain, minlength=self.world * n_b)
        self.recv_first = np.cumsum(self.recv_count) - self.recv_count

    def prefix_reads(self, taken: np.ndarray) -> np.ndarray:
        """Per stream, its reads (runs of one shard in a chain, chain by chain) that hold one of the first
        ``taken[c]`` samples of its chain c: its run starts at a chain position below ``taken[c]``."""
        n_b = self.n_b
        own = np.minimum(taken, self.kept)
        hit = self.seg_new & (self.seg_start < own[self.seg_chain])
        reads = np.bincount(self.seg_chain[hit] // n_b, minlength=self.world)
        extra = taken - self.kept  # received samples taken, where positive
        chains = np.flatnonzero((extra > 0) & (self.recv_count > 0))
        if len(chains):
            n = np.minimum(extra[chains], self.recv_count[chains])
            at = _ranges(self.recv_first[chains], n)
            shard = self.recv_shard[at]
            new = np.ones(len(at), dtype=bool)
            new[1:] = shard[1:] != shard[:-1]
            lo = np.cumsum(n) - n  # each chain's first received sample starts a run unless its shard is
            prev = self.kept[chains] > 0  # that of the chain's last own sample
            if prev.any():
                last, _ = self.own_refs(self.first[chains[prev]] + self.kept[chains[prev]] - 1)
                new[lo[prev]] = shard[lo[prev]] != last
            new[lo[~prev]] = True
            reads += np.bincount(np.repeat(chains // n_b, n)[new], minlength=self.world)
        return reads


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``starts[i] + arange(lens[i])`` for every i, concatenated (int64)."""
    starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)


def _class_moves(
    have_b: np.ndarray, first: np.ndarray, class_of: list[int], n_classes: int, kept: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The moves of :func:`~.lockstep._balance_classes` by chain position: per class that moves samples,
    the positions ``first[c] + p`` of the samples given (streams above the common count give the last
    samples of their longest chains of the class, the lower bucket on ties), their buckets, and how many
    each stream gets (below the common count: its deficit; the samples sorted by (bucket, shard, id) are
    dealt in stream order). ``kept`` (per chain, the samples it keeps) is lowered in place for the givers.

    ``have_b`` (R, buckets): samples per chain; ``first``: where each chain starts in the chain order."""
    world, n_b = have_b.shape
    for members in class_members(class_of, n_classes):
        if not members:
            continue
        m = np.asarray(members, dtype=np.int64)
        lens = have_b[:, m]
        have = lens.sum(axis=1)
        base, rem = divmod(int(have.sum()), world)
        target = np.full(world, base, dtype=np.int64)
        target[np.argsort(-have, kind="stable")[:rem]] += 1  # the fullest streams (the first on ties)
        givers = np.flatnonzero(have > target)
        if not len(givers):
            continue
        final = _after_pops(lens[givers], have[givers] - target[givers])
        cells = givers[:, None] * n_b + m[None, :]
        gone = (lens[givers] - final).ravel()
        kept[cells] = final
        yield (
            _ranges((first[cells] + final).ravel(), gone),
            np.repeat(np.broadcast_to(m, final.shape).ravel(), gone),
            np.maximum(target - have, 0),
        )


def _after_pops(lens: np.ndarray, pops: np.ndarray) -> np.ndarray:
    """Per row, chain lengths ``lens[row]`` after ``pops[row]`` single pops, each from the longest chain (the
    first on ties): every chain above some level h comes down to h, then the first chains at h (in order)
    lose one more."""
    lo = np.zeros(len(lens), dtype=np.int64)
    hi = lens.max(axis=1)
    while True:  # per row, the lowest level h with sum(max(0, len - h)) <= pops (a bisection)
        on = lo < hi
        if not on.any():
            break
        mid = (lo + hi) // 2
        fits = np.maximum(lens - mid[:, None], 0).sum(axis=1) <= pops
        hi = np.where(on & fits, mid, hi)
        lo = np.where(on & ~fits, mid + 1, lo)
    out = np.minimum(lens, lo[:, None])
    left = pops - (lens.sum(axis=1) - out.sum(axis=1))
    at = out == lo[:, None]
    return out - (at & (np.cumsum(at, axis=1) <= left[:, None])).astype(np.int64)


def _worker_arrays(
    pieces: list[list[Piece]], bucket_ids: np.ndarray, shard_offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples of one worker index's streams as arrays in chain order: (shard, sample id, stream,
    bucket), sorted by (stream, bucket), read order within; what :class:`_Chains` holds without them."""
    chains = _Chains.of_pieces(pieces, bucket_ids, shard_offsets, None)
    shard, sid = chains.own_refs(np.arange(len(chains.order), dtype=np.int64))
    stream, bucket = _sorted_chains(chains.length, chains.n_b)
    return shard, sid, stream, bucket


def _sorted_chains(per_chain: np.ndarray, n_b: int) -> tuple[np.ndarray, np.ndarray]:
    """(stream, bucket) of arrays sorted by chain ``stream * n_b + bucket`` with ``per_chain[c]`` samples
    in chain c: what gathering both columns by the sorting order gives, from the counts alone."""
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
    """:func:`~.lockstep._balance_classes` on arrays in chain order (:func:`_worker_arrays`), the balanced
    arrays in full: the moves of :func:`_class_moves`, the samples a stream got after its own in each
    chain, in the order given. (:meth:`_Chains.balance` makes the same moves without placing samples.)"""
    n_b = len(class_of)
    n = len(shard)
    chain = stream * n_b + bucket
    have_b = np.bincount(chain, minlength=world * n_b).reshape(world, n_b)
    first = np.cumsum(have_b.ravel()) - have_b.ravel()
    new_stream = stream.copy()
    moved_all: list[np.ndarray] = []
    for idx, _, deficit in _class_moves(have_b, first, class_of, n_classes, have_b.ravel().copy()):
        idx = idx[np.lexsort((sid[idx], shard[idx], bucket[idx]))]
        new_stream[idx] = np.repeat(np.arange(world, dtype=np.int64), deficit)
        moved_all.append(idx)
        counts["moved_samples"] += len(idx)
    if not moved_all:
        return shard, sid, stream, bucket
    # The stable sort of (the staying samples, in their chain order, then the moved ones) by new chain,
    # placed from counts.
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

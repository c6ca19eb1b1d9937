"""Equal step counts: every rank must take the same number of steps, or DDP hangs.

The common count is chosen between the fewest batches the ranks can reach (partial batches of a bucket
packed together) and the most (one sample per batch), where it changes the fewest batches. Samples move
between ranks that cannot reach it alone (read from the giver's shards), then each rank splits or packs
its own batches (:mod:`.reshape`; every batch still meets both constraints). Where no common count of
non-empty batches exists, or a rank can get no sample at all, ranks take empty batches: zero-weight
steps. Lockstep does this per worker index first and only after the last lockstep step of a stream, so
that the steps before stay aligned. Pure Python and NumPy.
"""

from __future__ import annotations

import operator
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.batch_arrays import BatchArrays
from lightning_adaptiveload.planning.plan import Batch, Read, Ref, Stream
from lightning_adaptiveload.planning.reshape import (
    batch_len,
    capacity,
    last_nonempty,
    merge_batches,
    pack_start,
    split_batches,
    tail_samples,
    take,
)

__all__ = ["apply_moves", "equalise"]

Move = tuple[Stream, Stream, list[Ref]]  # (giver, receiver, refs)


def equalise(
    sim: dict[Stream, list[Batch]],
    world: int,
    workers: int,
    schedule: str,
    sizes: list[int],
    counts: dict[str, int],
    moves: list[Move],
    pad_bucket: int | None,
) -> dict[str, Any] | None:
    """Give every rank the same number of steps (:func:`_equal_counts` over ranks).

    Lockstep first equalises each worker index across ranks (one stream per slot), so that every rank's
    round robin interleaves its workers identically and the lockstep steps stay aligned; where a worker
    index holds too few samples for that, the ranks are equalised as wholes (the steps after the first
    unequal one are then counted in ``unequal_steps``). Returns None on success, else the shortfall.
    """
    if schedule == "lockstep" and world > 1:
        for w in range(workers):
            _equal_counts(sim, [[(r, w)] for r in range(world)], sizes, counts, moves, None)
    return _equal_counts(
        sim, [[(r, w) for w in range(workers)] for r in range(world)], sizes, counts, moves, pad_bucket
    )


def apply_moves(
    reads: MutableMapping[Stream, list[Read]], moves: list[Move], sim: dict[Stream, list[Batch]]
) -> None:
    """Make the reads of every stream that gave or got samples match its batches: its own reads keep the
    samples it still holds, and the samples it got are read from their shards (``select``) after them.

    Computed from the final batches, not move by move, so a sample that moved more than once (even back)
    is read once, by the stream that holds it.
    """
    touched = {st for giver, receiver, _ in moves for st in (giver, receiver)}
    moved: dict[Stream, set[Ref]] = {}
    for giver, receiver, refs in moves:
        moved.setdefault(giver, set()).update(refs)
        moved.setdefault(receiver, set()).update(refs)
    for st in touched:
        if isinstance(sim[st], BatchArrays):
            reads[st] = _reads_holding(reads[st], sim[st].ref_keys(), moved[st])
            continue
        have = {ref for bt in sim[st] for ref in bt.refs}
        kept = [(shard, [i for i in ids if (shard, i) in have]) for shard, ids in reads[st]]
        kept = [(shard, ids) for shard, ids in kept if ids]
        known = {(shard, i) for shard, ids in kept for i in ids}
        extra: dict[int, list[int]] = {}
        for shard, i in sorted(have - known):
            extra.setdefault(shard, []).append(i)
        reads[st] = kept + sorted(extra.items())


def _reads_holding(reads: list[Read], have: np.ndarray, moved: set[Ref]) -> list[Read]:
    """:func:`apply_moves` for one stream on arrays (``have``: its refs as ``shard << 32 | id``), the same
    reads. Only refs that moved can differ between the stream's reads and its batches (splitting and
    packing keep a stream's samples), so only they are looked up."""
    have = np.sort(have)
    keys = np.array(sorted((s << 32) | i for s, i in moved), dtype=np.int64)
    pos = np.minimum(np.searchsorted(have, keys), max(len(have) - 1, 0))
    held = (have[pos] == keys) if len(have) else np.zeros(len(keys), dtype=bool)
    gone: dict[int, set[int]] = {}
    for key in keys[~held].tolist():
        gone.setdefault(key >> 32, set()).add(key & 0xFFFFFFFF)
    touched_shards = {s for s, _ in moved}
    kept: list[Read] = []
    in_reads: set[Ref] = set()
    for shard, ids in reads:
        if shard in touched_shards:
            in_reads.update((shard, i) for i in ids if (shard, i) in moved)
            drop = gone.get(shard)
            ids = [i for i in ids if i not in drop] if drop else list(ids)
        else:
            ids = list(ids)
        if ids:
            kept.append((shard, ids))
    extra: dict[int, list[int]] = {}
    for key in keys[held].tolist():  # ascending: by shard, then id
        ref = (key >> 32, key & 0xFFFFFFFF)
        if ref not in in_reads:
            extra.setdefault(ref[0], []).append(ref[1])
    return kept + sorted(extra.items())


@dataclass
class _Bounds:
    """Batch counts a slot (a list of streams that must together reach the common count) can reach.

    ``count``: batches now. ``most``: samples (every batch one sample: the most batches a split can
    reach). ``least``: the fewest batches a merge can reach: every batch before
    :func:`~.reshape.pack_start`, and per (stream, bucket) the partial batches after it packed into
    ``ceil(samples / B)`` batches.
    """

    count: int
    most: int
    least: int


def _columns(stream: list[Batch] | BatchArrays) -> tuple[np.ndarray, np.ndarray]:
    """The stream's (sample counts, bucket ids) as int64 arrays."""
    if isinstance(stream, BatchArrays):
        return stream.n, stream.bucket
    m = len(stream)
    return (
        np.fromiter(map(len, map(_REFS, stream)), dtype=np.int64, count=m),
        np.fromiter(map(_BUCKET, stream), dtype=np.int64, count=m),
    )


def _least_parts(stream: list[Batch] | BatchArrays, size: np.ndarray) -> tuple[int, int, int, np.ndarray]:
    """(batches, samples, the batches a merge keeps apart: those before :func:`~.reshape.pack_start` and
    the full ones after it, and per bucket the samples of the partial batches after it)."""
    n, bk = _columns(stream)
    k = pack_start(stream, size)
    fixed, partial = k, np.zeros(len(size), dtype=np.int64)
    if k < len(n):
        tail_n, tail_bk = n[k:], bk[k:]
        full = tail_n >= size[tail_bk]
        fixed += int(full.sum())  # full batches stay; per bucket, the partial ones packed
        partial = np.bincount(tail_bk[~full], weights=tail_n[~full], minlength=len(size)).astype(np.int64)
    return len(n), int(n.sum()), fixed, partial


def _bounds(sim: dict[Stream, list[Batch]], slot: list[Stream], sizes: list[int]) -> _Bounds:
    count = most = least = 0
    size = np.asarray(sizes, dtype=np.int64)
    for st in slot:
        m, samples, fixed, partial = _least_parts(sim[st], size)
        count += m
        most += samples
        least += fixed + int((-(-partial // size)).sum())
    return _Bounds(count, most, least)


# Batch fields read with C-level maps (the bounds are recomputed after every move).
_REFS = operator.attrgetter("refs")
_BUCKET = operator.attrgetter("bucket")


def _packed_least(sim: dict[Stream, list[Batch]], slots: list[list[Stream]], sizes: list[int]) -> int:
    """The fewest batches all slots together can reach: as :class:`_Bounds` ``least``, but each bucket's
    partial batches packed across all streams (samples can move between them)."""
    least = 0
    size = np.asarray(sizes, dtype=np.int64)
    partial = np.zeros(len(sizes), dtype=np.int64)
    for slot in slots:
        for st in slot:
            _, _, fixed, part = _least_parts(sim[st], size)
            least += fixed
            partial += part
    return least + int((-(-partial // size)).sum())


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
    sim: dict[Stream, list[Batch]],
    slots: list[list[Stream]],
    sizes: list[int],
    counts: dict[str, int],
    moves: list[Move],
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
    bounds = [_bounds(sim, slot, sizes) for slot in slots]
    least = _packed_least(sim, slots, sizes)
    target = _common_count(bounds, least, pad_bucket is not None)
    if target is None:
        return {"target": -(-least // len(slots)), "short": [(0, 1)], "slots": slots}
    mover = _Mover(sim, slots, sizes, counts, moves, bounds, target)
    mover.run()
    short = _reach(sim, slots, sizes, counts, mover.bounds, mover.target, pad_bucket)
    if short:
        return {"target": mover.target, "short": short, "slots": slots}
    return None


def _reach(
    sim: dict[Stream, list[Batch]],
    slots: list[list[Stream]],
    sizes: list[int],
    counts: dict[str, int],
    bounds: list[_Bounds],
    target: int,
    pad_bucket: int | None,
) -> list[tuple[int, int]]:
    """Split or pack each slot's own batches to ``target`` (then pad with empty batches if allowed).
    Returns the slots that missed it: (slot, batches still wanted; negative: too many)."""
    short = []
    for i, slot in enumerate(slots):
        need = target - bounds[i].count
        if need > 0:
            for st in sorted(slot, key=lambda x: -capacity(sim[x])):
                if need <= 0:
                    break
                added = split_batches(sim[st], need)
                counts["split_batches"] += added
                need -= added
        elif need < 0:
            for st in slot:
                removed = merge_batches(sim[st], -need, sizes)
                counts["merged_batches"] += removed
                need += removed
        if need > 0 and pad_bucket is not None:
            for _ in range(need):
                st = min(slot, key=lambda x: (len(sim[x]), x))
                sim[st].append(Batch(pad_bucket, []))
            counts["empty_batches"] += need
            need = 0
        if need != 0:
            short.append((i, need))
    return short


class _Mover:
    """Step 2 of :func:`_equal_counts`: moves samples between slots until each can reach the target
    alone (the target rises where no slot can take more)."""

    def __init__(
        self,
        sim: dict[Stream, list[Batch]],
        slots: list[list[Stream]],
        sizes: list[int],
        counts: dict[str, int],
        moves: list[Move],
        bounds: list[_Bounds],
        target: int,
    ) -> None:
        self.sim = sim
        self.slots = slots
        self.sizes = sizes
        self.counts = counts
        self.moves = moves
        self.bounds = bounds
        # Every slot's least and most as arrays (kept equal to ``bounds`` by _refresh): the scans of run()
        # then cost one NumPy pass, not a Python loop over every slot per move (1,024 ranks).
        self._least = np.array([b.least for b in bounds], dtype=np.int64)
        self._most = np.array([b.most for b in bounds], dtype=np.int64)
        self.target = target
        self.slot_of = {st: i for i, slot in enumerate(slots) for st in slot}
        self._spots: dict[Stream, dict[int, list[int]]] = {}
        # tail_samples per (stream, partial_only), cached like _spots: without it every move rescanned
        # whole streams (quadratic: 5M samples on 64 ranks spent 320 s of a 500 s plan there).
        self._tails: dict[tuple[Stream, bool], dict[int, int]] = {}

    def run(self) -> None:
        least, most = self._least, self._most
        while len(least):
            # The heaviest slot above the target (the first of equals), else the first below it.
            if least.max() > self.target:
                self._relieve(int(np.argmax(least)))
                continue
            short = most < self.target
            if short.any() and self._fill(int(np.argmax(short))):
                continue
            break

    def _relieve(self, g: int) -> None:
        """Slot ``g`` cannot pack its batches into the target: move one partial batch's worth of one bucket
        (its packed count drops by one)."""
        bounds = self.bounds
        # First into another stream's partial batch of that bucket that has room (packing across streams)...
        if self._pack(g):
            return
        # ... else as a new batch to the slot with the fewest batches
        q = int(np.argmin(self._least))  # the fewest batches (the first of equals)
        if bounds[q].least >= self.target:
            # No slot can take a batch: make room by packing another slot's partial batches, or settle for
            # more steps.
            if not any(self._pack(i) for i in range(len(self.slots)) if i != g):
                self.target = int(self._least.max())
            return
        pick = self._pick(g)
        if pick is None:
            self.target = int(self._least.max())  # nothing the giver may move: settle for more steps
            return
        self._give(g, q, *pick)

    def _pick(self, g: int) -> tuple[Stream, int, int, bool] | None:
        """What slot ``g`` gives: the samples of one bucket beyond its full batches (partial only), else its
        last non-empty movable batch; None if nothing may move."""
        sim, sizes = self.sim, self.sizes
        for st in self.slots[g]:
            for b, n in self._tail(st, True).items():
                return st, b, n - sizes[b] * (-(-n // sizes[b]) - 1), True
        for st in self.slots[g]:
            last = last_nonempty(sim[st])
            if last is not None:
                return st, last[0], last[1], False
        return None

    def _fill(self, q: int) -> bool:
        """Slot ``q`` has fewer samples than the target: give it samples from the slot with the most to
        spare. False if no slot can."""
        bounds = self.bounds
        g = int(np.argmax(self._most))  # the most samples (the first of equals)
        spare = bounds[g].most - self.target
        if spare <= 0:
            return False
        best = None
        for st in self.slots[g]:
            for b, n in self._tail(st, False).items():
                if best is None or n > best[2]:
                    best = (st, b, n)
        if best is None:
            return False
        st, b, n = best
        self._give(g, q, st, b, min(self.target - bounds[q].most, spare, self.sizes[b], n), False)
        return True

    def _partials(self, st: Stream, stream: list[Batch]) -> dict[int, list[int]]:
        """Per bucket, the stream's partial batches after :func:`~.reshape.pack_start` (ascending). Cached
        until a move changes the stream (``_give``, ``_pack``): ``_room`` asks every stream at every move."""
        if st not in self._spots and isinstance(stream, BatchArrays):
            self._spots[st] = stream.partial_spots(self.sizes)
        if st not in self._spots:
            spots: dict[int, list[int]] = {}
            for j in range(pack_start(stream, self.sizes), len(stream)):
                bt = stream[j]
                if len(bt.refs) < self.sizes[bt.bucket]:
                    spots.setdefault(bt.bucket, []).append(j)
            self._spots[st] = spots
        return self._spots[st]

    def _tail(self, st: Stream, partial_only: bool) -> dict[int, int]:
        """:func:`~.reshape.tail_samples` of stream ``st``, cached until a move changes the stream."""
        key = (st, partial_only)
        if key not in self._tails:
            self._tails[key] = tail_samples(self.sim[st], partial_only, self.sizes)
        return self._tails[key]

    def _changed(self, *streams: Stream) -> None:
        """Forget what was cached of these streams (their batches changed)."""
        for st in streams:
            self._spots.pop(st, None)
            self._tails.pop((st, True), None)
            self._tails.pop((st, False), None)

    def _refresh(self, *slots: int) -> None:
        for i in slots:
            self.bounds[i] = _bounds(self.sim, self.slots[i], self.sizes)
            self._least[i], self._most[i] = self.bounds[i].least, self.bounds[i].most

    def _give(self, g: int, q: int, st_g: Stream, bucket: int, k: int, partial_only: bool) -> None:
        """Move ``k`` samples of ``bucket`` from stream ``st_g`` (of slot ``g``) to slot ``q``'s shortest
        stream, as a new batch at its end."""
        refs = take(self.sim[st_g], bucket, k, partial_only, self.sizes)
        st_q = min(self.slots[q], key=lambda st: (len(self.sim[st]), st))
        self.sim[st_q].append(Batch(bucket, refs))
        self._changed(st_g, st_q)
        self.moves.append((st_g, st_q, refs))
        self.counts["moved_batches"] += 1
        self._refresh(g, q)

    def _room(self, st_g: Stream, bucket: int, k: int) -> tuple[Stream, int] | None:
        """A partial batch of ``bucket`` in another stream that can take ``k`` more samples without raising
        its slot's fewest batches above the target (or, in the giver's own slot, at all)."""
        size = self.sizes[bucket]
        for st, stream in self.sim.items():
            if st == st_g or st not in self.slot_of:
                continue
            spots = self._partials(st, stream).get(bucket)
            if not spots:
                continue
            u = sum(batch_len(stream, j) for j in spots)
            j = next((j for j in spots if batch_len(stream, j) + k <= size), None)
            if j is None or not batch_len(stream, j):
                continue
            grow = -(-(u + k) // size) - (-(-u // size))
            q = self.slot_of[st]
            if grow == 0 or (q != self.slot_of[st_g] and self.bounds[q].least + grow <= self.target):
                return st, j
        return None

    def _pack(self, g: int) -> bool:
        """Move one partial batch's worth of a bucket from slot ``g`` into a partial batch elsewhere."""
        sim, sizes = self.sim, self.sizes
        for st in self.slots[g]:
            for b, n in self._tail(st, True).items():
                k = n - sizes[b] * (-(-n // sizes[b]) - 1)
                hit = self._room(st, b, k)
                if hit is None:
                    continue
                refs = take(sim[st], b, k, True, sizes)
                st_q, j = hit
                sim[st_q][j] = Batch(b, sim[st_q][j].refs + refs)
                self._changed(st, st_q)
                self.moves.append((st, st_q, refs))
                self.counts["moved_batches"] += 1
                self._refresh(g, self.slot_of[st_q])
                return True
        return False

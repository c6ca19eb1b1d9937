"""Which stream reads which samples: shards (or contiguous parts of shards, *pieces*) go to the (rank,
worker) streams by a greedy longest-processing-time partition.

The shard order is a permutation seeded by ``(seed, epoch)``, the same on every rank; excluded samples
(already consumed, on resume) are left out of the pieces. A piece is split in halves when the loads
would differ by more than 5% or there are fewer pieces than bins. Python and NumPy.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.plan import Read, Stream
from lightning_adaptiveload.planning.resume import ConsumedMask

__all__ = [
    "Piece",
    "StreamReads",
    "assign",
    "exclusions",
    "read_arrays",
    "read_id_arrays",
    "reads_of",
    "shard_pieces",
    "shard_weight_terms",
]

# A rank whose estimated load exceeds the mean by more than this gets its largest piece split.
_BALANCE_TOLERANCE = 0.05
# Splitting stops at this many pieces per stream (each piece is one extra pass over part of a shard).
_MAX_PIECES_PER_STREAM = 8


@dataclass
class Piece:
    """Samples of one shard that go to one stream together."""

    shard: int
    order: int  # position of the shard in the seeded order
    ids: Sequence[int]  # sample ids, ascending (a range for a whole shard)
    buckets: Sequence[int]  # bucket id per sample (an int64 array on arrays)
    cost: float
    # The same ids as an int64 array, where the pieces came from arrays (planning on arrays reads these).
    id_array: np.ndarray | None = field(default=None, repr=False, compare=False)


def exclusions(exclude: Any) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    if exclude is None:
        return out
    if isinstance(exclude, ConsumedMask):  # already {shard: ids}, one flag per sample
        return exclude  # type: ignore[return-value]
    if isinstance(exclude, Mapping):
        for shard, ids in exclude.items():
            out.setdefault(int(shard), set()).update(int(i) for i in ids)
        return out
    for shard, sample in exclude:
        out.setdefault(int(shard), set()).add(int(sample))
    return out


def shard_pieces(
    bucket_of: list[list[int]],
    seed: int,
    epoch: int,
    exclude: Any,
    weight_of: list[float],
    arrays: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[Piece], int]:
    """One piece per shard with samples left: its samples that are not oversize (bucket -1) or excluded.

    Args:
        bucket_of: per shard, per sample, its bucket id.
        seed, epoch: seed the shard order.
        exclude: refs ``(shard_id, sample_id)`` or ``{shard_id: sample_ids}`` to leave out, or None.
        weight_of: per bucket, the load of one sample for the assignment.
        arrays: the same bucket ids as (ids, shard offsets) arrays (a compact index's), read instead.

    Returns:
        The pieces and how many (non-oversize) samples were excluded.
    """
    # Seeded shard order, the same on every rank (string seeds hash with SHA-512, not PYTHONHASHSEED).
    order = list(range(len(bucket_of)))
    random.Random(f"lightning-adaptiveload:{seed}:{epoch}").shuffle(order)
    position = {shard: k for k, shard in enumerate(order)}
    excl = exclusions(exclude)
    pieces: list[Piece] = []
    n_excluded = 0
    weight = np.asarray(weight_of, dtype=np.float64)
    fast = _whole_shards(arrays, weight, excl) if arrays is not None else None
    for sid, row in enumerate(bucket_of if arrays is None else range(len(arrays[1]) - 1)):
        if fast is not None and sid not in fast.slow:
            # Every sample of the shard is kept: its lists are slices of the index-wide ones.
            a, b = fast.offsets[sid], fast.offsets[sid + 1]
            if b > a:
                # A range and an array view, not lists: 2 x 10M Python ints per 10M samples planned.
                ids = np.arange(b - a, dtype=np.int64)
                cost = math.fsum(fast.terms[sid])  # the same exactly rounded sum as below
                pieces.append(Piece(sid, position[sid], range(b - a), fast.buckets[a:b], cost, ids))
            continue
        if arrays is None:
            bk = np.asarray(row, dtype=np.int64)
        else:
            bk = arrays[0][int(arrays[1][sid]) : int(arrays[1][sid + 1])].astype(np.int64)
        keep = bk >= 0
        gone = excl.get(sid)
        if gone:
            out = np.fromiter((i for i in gone if 0 <= i < len(bk)), dtype=np.int64)
            n_excluded += int(keep[out].sum())
            keep[out] = False
        if keep.all():
            ids, kept_bk = np.arange(len(bk)), bk
        else:
            ids = np.flatnonzero(keep)
            kept_bk = bk[ids]
        if len(ids):
            # The exactly rounded sum (math.fsum), not Python's sum(): its rounding is part of the plan (the
            # LPT orders pieces by cost), and sum() of floats rounds differently from Python 3.12 on, so ranks
            # or a resumed run on another Python would plan another epoch.
            cost = math.fsum(weight[kept_bk].tolist())
            pieces.append(
                Piece(sid, position[sid], ids.tolist(), kept_bk.tolist(), cost, ids.astype(np.int64))
            )
    return pieces, n_excluded


@dataclass
class _WholeShards:
    """Index-wide lists for :func:`shard_pieces` on arrays: per sample its bucket, each shard's first
    position, per shard the terms whose exactly rounded sum is its samples' summed weight
    (:func:`shard_weight_terms`), and the shards that need the per-shard path (an oversize sample, an
    exclusion, or a sum the terms cannot give exactly)."""

    offsets: list[int]
    buckets: np.ndarray
    terms: list[list[float]]
    slow: set[int]


def _whole_shards(arrays: tuple[np.ndarray, np.ndarray], weight: np.ndarray, excl: dict) -> _WholeShards:
    bk = np.asarray(arrays[0], dtype=np.int64)
    offsets = np.asarray(arrays[1], dtype=np.int64)
    oversize = np.flatnonzero(bk < 0)
    slow = set((np.searchsorted(offsets, oversize, side="right") - 1).tolist()) | set(excl)
    terms, inexact = shard_weight_terms(np.maximum(bk, 0), offsets, weight)
    return _WholeShards(offsets.tolist(), bk, terms, slow | inexact)


_SPLIT_BITS = 11  # a weight's low mantissa bits split off: counts below 2**11 multiply both parts exactly


def shard_weight_terms(
    bk: np.ndarray, offsets: np.ndarray, weight: np.ndarray
) -> tuple[list[list[float]], set[int]]:
    """Per shard, floats whose exact sum is the exact sum of its samples' weights ``weight[bk]``, so that
    ``math.fsum`` of them is bit for bit ``math.fsum`` of the per-sample list, at a few terms per bucket
    instead of one per sample; and the shards where that does not hold (a bucket with 2**11 samples or
    more in the shard, or a weight that is not finite): those sum their samples' list.

    Each weight ``w`` is split into ``hi`` (its low 11 mantissa bits cleared) and ``lo = w - hi`` (exact);
    a count ``c < 2**11`` times either is exact in float64, and ``c*hi + c*lo`` is ``c*w`` exactly.
    """
    m = len(offsets) - 1
    nb = len(weight)
    if m <= 0 or nb == 0:
        return [[] for _ in range(max(m, 0))], set()
    lens = np.diff(offsets)
    shard_of = np.repeat(np.arange(m, dtype=np.int64) * nb, lens)
    shard_of += bk
    counts = np.bincount(shard_of, minlength=m * nb).reshape(m, nb)
    del shard_of
    w = np.asarray(weight, dtype=np.float64)
    if not np.isfinite(w).all():
        return [[] for _ in range(m)], set(range(m))
    hi = (w.view(np.uint64) & ~np.uint64((1 << _SPLIT_BITS) - 1)).view(np.float64)
    lo = w - hi
    inexact = set(np.flatnonzero((counts >= 1 << _SPLIT_BITS).any(axis=1)).tolist())
    terms = np.concatenate([counts * hi, counts * lo], axis=1)
    return terms.tolist(), inexact


def _lpt(pieces: list[Piece], bins: int) -> tuple[list[list[Piece]], list[float]]:
    """Greedy longest-processing-time partition: largest piece first onto the least-loaded bin."""
    loads = [0.0] * bins
    out: list[list[Piece]] = [[] for _ in range(bins)]
    heap = [(0.0, b) for b in range(bins)]
    for piece in sorted(pieces, key=lambda p: (-p.cost, p.order, p.ids[0])):
        load, b = heapq.heappop(heap)
        out[b].append(piece)
        loads[b] = load + piece.cost
        heapq.heappush(heap, (loads[b], b))
    return out, loads


def _split_piece(piece: Piece, cost_of: list[float]) -> tuple[Piece, Piece]:
    half = (len(piece.ids) + 1) // 2
    arr = piece.id_array
    parts = []
    for ids, bk, a in (
        (piece.ids[:half], piece.buckets[:half], None if arr is None else arr[:half]),
        (piece.ids[half:], piece.buckets[half:], None if arr is None else arr[half:]),
    ):
        parts.append(Piece(piece.shard, piece.order, ids, bk, math.fsum(cost_of[b] for b in bk), a))
    return parts[0], parts[1]


def assign(
    pieces: list[Piece], world: int, workers: int, cost_of: list[float], lockstep: bool
) -> tuple[dict[Stream, list[Piece]], int]:
    """Pieces -> streams. Returns the assignment and how many pieces were split.

    The independent schedule balances ranks (LPT over ranks, then over each rank's workers). The lockstep
    schedule pairs the streams of one worker index across ranks, so it balances every stream (LPT over all
    R * W).
    """
    pieces = list(pieces)
    splits = 0
    bins = world * workers if lockstep else world
    cap = world * workers * _MAX_PIECES_PER_STREAM
    while True:
        per_bin, loads = _lpt(pieces, bins)
        mean = math.fsum(loads) / bins
        want = len(pieces) < bins or (mean > 0 and max(loads) > (1 + _BALANCE_TOLERANCE) * mean)
        splittable = [p for p in pieces if len(p.ids) > 1]
        if not want or not splittable or len(pieces) >= cap:
            break
        # Split the costliest eighth of the pieces per round: a few LPT rounds instead of one per split.
        splittable.sort(key=lambda p: (-p.cost, -len(p.ids), p.order, p.ids[0]))
        chosen = splittable[: max(1, len(pieces) // 8)]
        chosen_ids = {id(p) for p in chosen}
        pieces = [p for p in pieces if id(p) not in chosen_ids]
        for p in chosen:
            pieces.extend(_split_piece(p, cost_of))
        splits += len(chosen)
    out: dict[Stream, list[Piece]] = {}
    for r in range(world):
        if lockstep:
            # bin k -> (rank k % world, worker k // world): the LPT's first bins spread over ranks.
            per_worker = [per_bin[w * world + r] for w in range(workers)]
        else:
            per_worker, _ = _lpt(per_bin[r], workers)
        for w in range(workers):
            out[(r, w)] = sorted(per_worker[w], key=lambda p: (p.order, p.ids[0]))
    return out, splits


def reads_of(pieces: list[Piece]) -> list[Read]:
    """A stream's reads: one per piece, in order (consecutive pieces of one shard read as one)."""
    reads: list[Read] = []
    for p in pieces:
        if reads and reads[-1][0] == p.shard:
            reads[-1] = (p.shard, sorted(reads[-1][1] + list(p.ids)))
        else:
            reads.append((p.shard, list(p.ids)))
    return reads


def read_arrays(pieces: list[Piece]) -> list[tuple[int, np.ndarray]]:
    """:func:`reads_of`'s reads with their sample ids as int64 arrays (from the pieces' arrays)."""
    out: list[tuple[int, np.ndarray]] = []
    for p in pieces:
        ids = p.id_array if p.id_array is not None else np.asarray(p.ids, dtype=np.int64)
        if out and out[-1][0] == p.shard:
            out[-1] = (p.shard, np.sort(np.concatenate([out[-1][1], ids])))
        else:
            out.append((p.shard, ids))
    return out


def read_id_arrays(pieces: list[Piece]) -> list[np.ndarray]:
    """The sample ids of each of :func:`reads_of`'s reads, as int64 arrays (from the pieces' arrays)."""
    return [ids for _, ids in read_arrays(pieces)]


class StreamReads(MutableMapping):
    """Every stream's reads (:func:`reads_of` of its pieces), each made on first access (or set): a
    rank-local plan makes the lists of sample ids of the streams it keeps or edits only. ``count``: how
    many reads a stream has, without its lists."""

    def __init__(self, assignment: Mapping[Stream, list[Piece]]) -> None:
        self._pieces = assignment
        self._reads: dict[Stream, list[Read]] = {}

    def __getitem__(self, st: Stream) -> list[Read]:
        got = self._reads.get(st)
        if got is None:
            got = self._reads[st] = reads_of(self._pieces[st])
        return got

    def __setitem__(self, st: Stream, reads: list[Read]) -> None:
        if st not in self._pieces:
            raise KeyError(st)
        self._reads[st] = reads

    def __delitem__(self, st: Stream) -> None:
        raise TypeError("StreamReads: every stream has reads; set them instead")

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def count(self, st: Stream) -> int:
        """``len(self[st])``: one read per run of pieces of one shard, unless the reads were set."""
        got = self._reads.get(st)
        if got is not None:
            return len(got)
        ps = self._pieces[st]
        return sum(1 for i, p in enumerate(ps) if i == 0 or ps[i - 1].shard != p.shard)

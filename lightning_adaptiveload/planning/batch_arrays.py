"""One stream's batches as arrays (:class:`BatchArrays`), the form the independent schedule plans in.

A plan of 64 ranks holds millions of batches; as :class:`~.plan.Batch` objects each costs a Python object
and a list of refs, most of them for ranks a rank-local plan throws away. Here a stream is five columns
(bucket, sample count, bound flag, start of its run of refs) over two ref columns (shard id, sample id), and
Python objects are made only for the batches a plan keeps.

The edits of :mod:`.reshape` (split, pack, take out samples) have a method each that makes exactly the same
batches as the list version (``tests/planning/test_batch_arrays.py`` compares them on random streams, and
the plan digests of ``tests/planning/test_plan_identity.py`` pin the plans). A list of :class:`~.plan.Batch`
and a :class:`BatchArrays` answer the same calls of :mod:`.reshape` and :mod:`.equalise`. Lockstep batches
(``equal``, ``pack``) stay lists. Pure NumPy.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import numpy as np

from lightning_adaptiveload.planning.plan import Batch, Ref

__all__ = ["BatchArrays", "RefSource", "chunk_sizes", "most_packable"]

_REFS = operator.attrgetter("refs")
_I64 = np.int64


def chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``k`` consecutive runs of ``n`` items that differ by at most one, the larger first."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def most_packable(groups: dict[int, tuple[int, int]], sizes: list[int]) -> tuple[int, int]:
    """Of the partial batches per bucket (``bucket -> (batches, samples)``, in the stream's order), the
    bucket whose packing into full batches removes the most batches (the first on ties) and how many;
    ``(-1, 0)`` if no packing removes one."""
    best, spare = -1, 0
    for b, (count, total) in groups.items():
        s = count - (-(-total // sizes[b]))
        if s > spare:
            best, spare = b, s
    return best, spare


class BatchArrays:
    """A stream's batches as columns; batch j is ``bucket[j]`` with the refs
    ``zip(shard, ids)[start[j] : start[j] + n[j]]``, emitted early at the buffer bound if ``bound[j]``.

    The ref columns may be given as a :class:`RefSource` instead (``shard`` and ``ids`` None): they are
    then made on first use, so that a stream no edit touches and no plan keeps never gathers its refs."""

    __slots__ = ("bucket", "n", "bound", "start", "_shard", "_ids", "_source")

    def __init__(
        self,
        bucket: np.ndarray,
        n: np.ndarray,
        bound: np.ndarray,
        start: np.ndarray,
        shard: np.ndarray | None,
        ids: np.ndarray | None,
        source: RefSource | None = None,
    ) -> None:
        self.bucket, self.n, self.bound, self.start = bucket, n, bound, start
        self._shard, self._ids, self._source = shard, ids, source

    def _refs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._source is not None:
            self._shard, self._ids = self._source.columns()
            self._source = None
        return self._shard, self._ids  # type: ignore[return-value]

    @property
    def shard(self) -> np.ndarray:
        """Shard id of each ref (batch order)."""
        return self._refs()[0]

    @shard.setter
    def shard(self, value: np.ndarray) -> None:
        self._refs()
        self._shard = value

    @property
    def ids(self) -> np.ndarray:
        """Sample id of each ref (batch order)."""
        return self._refs()[1]

    @ids.setter
    def ids(self, value: np.ndarray) -> None:
        self._refs()
        self._ids = value

    @classmethod
    def from_batches(cls, batches: list[Batch]) -> BatchArrays:
        """The same batches as columns (batches of the independent schedule: no ``equal`` or ``pack`` ones)."""
        if any(bt.equal or bt.pack for bt in batches):
            raise ValueError("BatchArrays holds batches of the independent schedule only (no equal or pack batches)")
        m = len(batches)
        n = np.fromiter(map(len, map(_REFS, batches)), dtype=_I64, count=m)
        flat = [ref for bt in batches for ref in bt.refs]
        return cls(
            np.fromiter((bt.bucket for bt in batches), dtype=_I64, count=m),
            n,
            np.fromiter((bt.bound for bt in batches), dtype=bool, count=m),
            np.cumsum(n) - n,
            np.fromiter((s for s, _ in flat), dtype=_I64, count=len(flat)),
            np.fromiter((i for _, i in flat), dtype=_I64, count=len(flat)),
        )

    # -- the list protocol that reshape/equalise use --------------------------------------------------------

    def __len__(self) -> int:
        return len(self.bucket)

    def refs_of(self, j: int) -> list[Ref]:
        a = int(self.start[j])
        b = a + int(self.n[j])
        return list(zip(self.shard[a:b].tolist(), self.ids[a:b].tolist()))

    def __getitem__(self, j: int) -> Batch:
        """Batch j as a new :class:`~.plan.Batch` (a copy: edit through ``stream[j] = ...``)."""
        return Batch(int(self.bucket[j]), self.refs_of(j), bound=bool(self.bound[j]))

    def __setitem__(self, j: int, bt: Batch) -> None:
        start = self._store(bt.refs)
        self.bucket[j], self.n[j], self.bound[j], self.start[j] = bt.bucket, len(bt.refs), bt.bound, start

    def append(self, bt: Batch) -> None:
        start = self._store(bt.refs)
        self.bucket = np.append(self.bucket, _I64(bt.bucket))
        self.n = np.append(self.n, _I64(len(bt.refs)))
        self.bound = np.append(self.bound, bool(bt.bound))
        self.start = np.append(self.start, _I64(start))

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches())

    def _store(self, refs: list[Ref]) -> int:
        """Append refs to the ref columns; returns where they start."""
        start = len(self.shard)
        if refs:
            self.shard = np.concatenate([self.shard, np.fromiter((s for s, _ in refs), dtype=_I64)])
            self.ids = np.concatenate([self.ids, np.fromiter((i for _, i in refs), dtype=_I64)])
        return start

    def _keep_rows(self, keep: np.ndarray) -> None:
        self.bucket, self.n = self.bucket[keep], self.n[keep]
        self.bound, self.start = self.bound[keep], self.start[keep]

    # -- whole-stream views ---------------------------------------------------------------------------------

    def batches(self) -> list[Batch]:
        return [
            Batch(b, refs, bound=f)
            for b, refs, f in zip(self.bucket.tolist(), self.refs_lists(), self.bound.tolist())
        ]

    def refs_lists(self) -> list[list[Ref]]:
        """Every batch's refs, in order."""
        flat = list(zip(self.shard.tolist(), self.ids.tolist()))
        return [flat[a : a + k] for a, k in zip(self.start.tolist(), self.n.tolist())]

    def ref_keys(self) -> np.ndarray:
        """Every ref the stream holds, as ``shard << 32 | id`` (int64), in batch order."""
        if not len(self.bucket):
            return np.zeros(0, dtype=_I64)
        lengths = self.n
        idx = np.repeat(self.start - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        return (self.shard[idx] << 32) | self.ids[idx]

    def pack_start(self) -> int:
        """:func:`~.reshape.pack_start`: after the last batch emitted at the bound (no equal batches here)."""
        hit = np.flatnonzero(self.bound)
        return int(hit[-1]) + 1 if len(hit) else 0

    def movable(self, start: int, partial_only: bool, sizes: np.ndarray) -> np.ndarray:
        """Rows from ``start`` on that hold samples (and, if ``partial_only``, fewer than their B)."""
        rows = np.arange(start, len(self.bucket), dtype=_I64)
        ok = self.n[start:] > 0
        if partial_only:
            ok &= self.n[start:] < sizes[self.bucket[start:]]
        return rows[ok]

    # -- the edits of reshape.py ----------------------------------------------------------------------------

    def split(self, need: int) -> int:
        """:func:`~.reshape.split_batches` (no equal batches: the largest batches anywhere, latest on ties)."""
        if need <= 0:
            return 0
        cand = np.flatnonzero(self.n > 1)
        if len(cand) > need:
            # Only the `need` largest batches (latest on ties) can be split: each of them stays above any
            # other batch until it has been split once, and there are only `need` splits.
            key = self.n[cand] * (len(self.n) + 1) + cand
            cand = cand[np.argpartition(-key, need - 1)[:need]]
        pieces = _split_pieces(self.n[cand], cand, need)
        added = int(pieces.sum()) - len(cand)
        if added:
            k = np.ones(len(self.bucket), dtype=_I64)
            k[cand] = pieces
            row = np.repeat(np.arange(len(k), dtype=_I64), k)
            i = np.arange(len(row), dtype=_I64) - np.repeat(np.cumsum(k) - k, k)  # piece index in its batch
            n, kk = self.n[row], k[row]
            q, r = n // kk, n % kk
            self.bucket = self.bucket[row]
            self.start = self.start[row] + i * q + np.minimum(i, r)
            self.n = q + (i < r)
            self.bound = self.bound[row] & (kk == 1)  # a split batch's pieces are new batches
        return added

    def take(self, bucket: int, k: int, partial_only: bool, sizes: list[int]) -> list[Ref]:
        """:func:`~.reshape.take`: ``k`` samples of ``bucket`` out of the movable batches, last first."""
        first = self.pack_start() if partial_only else 0
        rows = np.arange(first, len(self.bucket), dtype=_I64)
        sel = self.bucket[first:] == bucket
        if partial_only:
            sel &= self.n[first:] < sizes[bucket]
        rows = rows[sel][::-1]
        cum = np.cumsum(self.n[rows])
        hit = np.flatnonzero(cum >= k)
        used = rows if not len(hit) else rows[: int(hit[0]) + 1]
        take_n = self.n[used].copy()
        if len(hit):
            take_n[-1] -= int(cum[hit[0]]) - k
        out: list[Ref] = []
        for j, m in zip(used.tolist(), take_n.tolist()):
            end = int(self.start[j]) + int(self.n[j])
            out.extend(zip(self.shard[end - m : end].tolist(), self.ids[end - m : end].tolist()))
        self.n[used] -= take_n
        gone = used[self.n[used] == 0]
        if len(gone):
            keep = np.ones(len(self.bucket), dtype=bool)
            keep[gone] = False
            self._keep_rows(keep)
        return sorted(out)

    def tail_samples(self, partial_only: bool, sizes: list[int]) -> dict[int, int]:
        """:func:`~.reshape.tail_samples`: samples per bucket in the movable batches, buckets in order of
        their first batch."""
        size = np.asarray(sizes, dtype=_I64)
        rows = self.movable(self.pack_start() if partial_only else 0, partial_only, size)
        return _per_bucket(self.bucket[rows], self.n[rows], len(sizes))

    def partial_spots(self, sizes: list[int]) -> dict[int, list[int]]:
        """Per bucket, the rows from :meth:`pack_start` on with fewer samples than B (empty ones included),
        ascending; buckets in order of their first such row (``equalise._Mover._partials``)."""
        size = np.asarray(sizes, dtype=_I64)
        first = self.pack_start()
        rows = np.arange(first, len(self.bucket), dtype=_I64)
        rows = rows[self.n[first:] < size[self.bucket[first:]]]
        return _rows_per_bucket(rows, self.bucket[rows])

    def merge(self, need: int, sizes: list[int]) -> int:
        """:func:`~.reshape.merge_batches`: pack partial batches of one bucket into fewer."""
        size = np.asarray(sizes, dtype=_I64)
        removed = 0
        while removed < need:
            rows = self.movable(self.pack_start(), True, size)
            where = _rows_per_bucket(rows, self.bucket[rows])
            best, spare = most_packable(
                {b: (len(pos), int(self.n[pos].sum())) for b, pos in where.items()}, sizes
            )
            if best < 0:
                break
            pos = where[best]
            keep = len(pos) - min(spare, need - removed)
            idx = np.concatenate([np.arange(self.start[j], self.start[j] + self.n[j]) for j in pos])
            base = len(self.shard)
            self.shard = np.concatenate([self.shard, self.shard[idx]])
            self.ids = np.concatenate([self.ids, self.ids[idx]])
            offset = 0
            for j, m in zip(pos[len(pos) - keep :], chunk_sizes(len(idx), keep)):
                self.n[j], self.start[j], self.bound[j] = m, base + offset, False
                offset += m
            drop = np.ones(len(self.bucket), dtype=bool)
            drop[pos[: len(pos) - keep]] = False
            self._keep_rows(drop)
            removed += len(pos) - keep
        return removed


class RefSource:
    """Ref columns made when first needed: the samples at read positions ``at`` of reads laid end to end
    (read k from position ``read_lo[k]``, of shard ``read_shard[k]``; sample ids ``ids`` by position)."""

    __slots__ = ("read_lo", "read_shard", "ids", "at")

    def __init__(self, read_lo: np.ndarray, read_shard: np.ndarray, ids: np.ndarray, at: np.ndarray) -> None:
        self.read_lo, self.read_shard, self.ids, self.at = read_lo, read_shard, ids, at

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard ids, sample ids), int64."""
        read = np.searchsorted(self.read_lo, self.at, side="right") - 1
        return self.read_shard[read], self.ids[self.at]


def _split_pieces(n: np.ndarray, j: np.ndarray, need: int) -> np.ndarray:
    """Pieces per batch (sizes ``n`` > 1, rows ``j``) after ``need`` single splits, each of the batch whose
    pieces are largest (``ceil(n / pieces)``; the latest row on ties), or fewer once every piece holds one
    sample: :func:`~.reshape.split_batches`' heap, from counts.

    The largest piece only shrinks, so the splits come level by level: every split of a batch whose piece
    is above some level v happens before any at v. To bring its pieces to v or below, a batch needs
    ``ceil(n / v)`` pieces; the split level is the lowest v whose splits above it fit in ``need`` (a
    bisection), and the splits left are made at v, latest row first (a batch split at v whose pieces are
    still v is split again at once: it stays the latest at v).
    """
    if need >= int((n - 1).sum()):
        return n.copy()  # one sample per piece
    lo, hi = 2, int(n.max())
    while lo < hi:  # the lowest level v whose splits above it fit in need
        mid = (lo + hi) // 2
        if int((-(-n // mid) - 1).sum()) <= need:
            hi = mid
        else:
            lo = mid + 1
    k = -(-n // lo)
    left = need - int((k - 1).sum())
    if left:
        at_level = -(-n // (lo - 1)) - k  # splits each batch takes at level lo
        by = np.argsort(-j, kind="stable")  # latest row first
        before = np.cumsum(at_level[by]) - at_level[by]
        k[by] += np.clip(left - before, 0, at_level[by])
    return k


def _per_bucket(bucket: np.ndarray, n: np.ndarray, n_buckets: int) -> dict[int, int]:
    if not len(bucket):
        return {}
    uniq, first = np.unique(bucket, return_index=True)
    sums = np.bincount(bucket, weights=n, minlength=n_buckets)
    return {int(b): int(sums[b]) for b in uniq[np.argsort(first)].tolist()}


def _rows_per_bucket(rows: np.ndarray, bucket: np.ndarray) -> dict[int, list[int]]:
    if not len(rows):
        return {}
    uniq, first = np.unique(bucket, return_index=True)
    return {int(b): rows[bucket == b].tolist() for b in uniq[np.argsort(first)].tolist()}

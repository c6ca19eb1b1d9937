"""The step loop of the ``lockstep`` schedule (:mod:`.lockstep`), vectorised over the R streams of one
worker index.

Each step is a few NumPy operations on the streams' sample counts per bucket (an (R, buckets) array),
whatever R; the batches themselves are materialised at the end, one list slice per batch. The choices
(class of each step, bucket of each stream, tie-breaks) are those of the loop this replaced, step for
step: the plans are identical (``tests/planning/test_plan_identity.py``).
"""

from __future__ import annotations

import heapq

import numpy as np

from lightning_adaptiveload.planning.plan import Batch, Ref

__all__ = [
    "chain_starts",
    "class_members",
    "schedule",
    "schedule_takes",
    "stable_order",
    "stable_order_within",
]


def class_members(class_of: list[int], n_classes: int) -> list[list[int]]:
    """Per lockstep class, its buckets in ascending order."""
    members: list[list[int]] = [[] for _ in range(n_classes)]
    for b, c in enumerate(class_of):
        members[c].append(b)
    return members


class _State:
    """Counts of one worker index's streams: ``avail[r, b]`` samples of bucket b left on stream r;
    ``best[r, c]``/``most[r, c]``: stream r's fullest bucket of class c (the first of the class's
    buckets on ties) and its count; ``remaining[c]``: samples of class c left on all streams."""

    def __init__(self, avail: np.ndarray, members: list[list[int]], class_size: list[int]) -> None:
        self.avail = avail
        self.rows = np.arange(avail.shape[0])
        self.members = [np.asarray(m, dtype=np.int64) for m in members]
        self.class_size = class_size
        n_r, n_c = avail.shape[0], len(members)
        self.best = np.zeros((n_r, n_c), dtype=np.int64)
        self.most = np.zeros((n_r, n_c), dtype=np.int64)
        self.full = [False] * n_c  # every stream can fill a batch of the class
        for c in range(n_c):
            self.refresh(c)
        self.remaining = [int(avail[:, m].sum()) for m in self.members]
        self.initial = [max(1, x) for x in self.remaining]

    def refresh(self, c: int) -> None:
        sub = self.avail[:, self.members[c]]
        pick = sub.argmax(axis=1)  # the first maximum: the loop's strict ">" over ascending buckets
        self.best[:, c] = self.members[c][pick]
        self.most[:, c] = sub[self.rows, pick]
        self.full[c] = bool((self.most[:, c] >= self.class_size[c]).all())

    def full_class(self) -> int:
        """The class every stream can fill with the largest share of its samples unused, or -1."""
        pick, share = -1, -1.0
        for c, ok in enumerate(self.full):
            if ok and self.remaining[c] / self.initial[c] > share:
                pick, share = c, self.remaining[c] / self.initial[c]
        return pick


def _full_steps(
    avail: np.ndarray, members: list[list[int]], class_size: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The steps at which some class can be filled on every stream, at once (``avail`` consumed in place).

    The step loop of :func:`schedule_takes` takes, while some class c is *full* (each stream holds B_c
    samples in one of c's buckets), the full class with the largest share of its samples unused, and on
    every stream B_c samples of that stream's fullest bucket of c (the first on ties). Two facts make this
    phase computable without the loop:

    * Stream r can take ``q_r(c) = sum over c's buckets of floor(count / B_c)`` batches of c, in any
      order, and each take lowers that by exactly one; so c stays full for exactly ``min_r q_r(c)`` takes,
      whatever the other classes do. The class sequence depends only on these numbers and on the
      classes' unused shares: a loop over scalars.
    * Taking B_c from the fullest bucket each time, stream r's t-th batch of c comes from the bucket of
      the t-th largest of the values ``count_b - i * B_c`` (0 <= i < floor(count_b / B_c)), ties to the
      lower bucket: a sort.

    Returns ``(bucket, count)``: (R, steps) and (steps,) of these steps, in order.
    """
    n_r, n_c = avail.shape[0], len(class_size)
    takes = [0] * n_c
    remaining = [0] * n_c
    for c in range(n_c):
        if not members[c] or class_size[c] <= 0:
            continue
        sub = avail[:, members[c]]
        takes[c] = int((sub // class_size[c]).sum(axis=1).min()) if n_r else 0
        remaining[c] = int(sub.sum())
    initial = [max(1, x) for x in remaining]
    heap = [(-(remaining[c] / initial[c]), c) for c in range(n_c) if takes[c] > 0]
    heapq.heapify(heap)
    seq: list[int] = []
    left = list(takes)
    # The loop's choice: the largest unused share, the first class on ties (heap order: (-share, c)).
    while heap:
        _, c = heapq.heappop(heap)
        seq.append(c)
        remaining[c] -= class_size[c] * n_r
        left[c] -= 1
        if left[c] > 0:
            heapq.heappush(heap, (-(remaining[c] / initial[c]), c))
    steps = np.asarray(seq, dtype=np.int64)
    bucket = np.zeros((n_r, len(seq)), dtype=np.int64)
    for c in range(n_c):
        if takes[c] == 0:
            continue
        at = np.flatnonzero(steps == c)
        m = np.asarray(members[c], dtype=np.int64)
        picks = _greedy_picks(avail[:, m], class_size[c], takes[c])  # (R, takes) positions in m
        bucket[:, at] = m[picks]
        cell = (np.arange(n_r, dtype=np.int64)[:, None] * len(m) + picks).ravel()
        taken = np.bincount(cell, minlength=n_r * len(m)).reshape(n_r, len(m))
        avail[:, m] -= taken * class_size[c]
    return bucket, np.asarray(class_size, dtype=np.int64)[steps] if len(seq) else np.zeros(0, dtype=np.int64)


def _greedy_picks(counts: np.ndarray, size: int, n: int) -> np.ndarray:
    """Per stream (row of ``counts``: its samples in each bucket of one class), the buckets (columns) of
    its first ``n`` batches of ``size`` samples, each from its fullest bucket (the first on ties): the
    columns of the ``n`` largest values ``counts[r, j] - i * size`` (0 <= i < counts // size), ties to
    the lower column. (R, n)."""
    n_r, n_m = counts.shape
    if n_m == 1 or n == 0:
        return np.zeros((n_r, n), dtype=np.int64)
    # Value count - i * size = size * (level) + remainder, level = count // size - i: the batches come level
    # by level, highest first, and within a level in one order per stream (remainder descending, then
    # column): a boolean (stream, level, column) table read in C order lists them.
    q = counts // size
    cols = np.arange(n_m, dtype=np.int64)
    perm = np.argsort((size - counts % size) * n_m + cols[None, :], axis=1)
    q_sorted = np.take_along_axis(q, perm, axis=1)
    levels = np.arange(int(q.max()), 0, -1, dtype=np.int64)
    mask = q_sorted[:, None, :] >= levels[None, :, None]
    row, _, at = np.nonzero(mask)
    per_row = q.sum(axis=1)
    pos = (np.cumsum(per_row) - per_row)[:, None] + np.arange(n, dtype=np.int64)[None, :]
    return perm[row[pos], at[pos]]


def schedule(
    chains: list[list[list[Ref]]],
    class_of: list[int],
    class_size: list[int],
    sizes: list[int],
    counts: dict[str, int],
) -> list[list[Batch]]:
    """The batches of every stream of one worker index, in step order.

    ``chains[r][b]``: stream r's samples of bucket b in read order (a stream reads each bucket's samples
    as its own sequence of shard reads, so it can take any bucket's next samples at any time).

    At each step every stream takes B_c samples of one class c (from its fullest bucket of that class):
    the class, among those every stream can fill, with the largest share of its samples still unused.
    When no class can be filled on every stream, the class with the largest minimum count m >= 1 is taken
    with B = m on every stream (``reduced_steps``). Only when the streams share no class at all is an
    unequal step taken: each stream with samples takes its own fullest bucket, capped at its batch size
    (``tail_batches``).
    """
    n_r, n_b = len(chains), len(class_of)
    avail = np.array([[len(ch) for ch in chains[r]] for r in range(n_r)], dtype=np.int64).reshape(n_r, n_b)
    return _materialise(chains, *schedule_takes(avail, class_of, class_size, sizes, counts))


def schedule_takes(
    avail: np.ndarray, class_of: list[int], class_size: list[int], sizes: list[int], counts: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`schedule` on the streams' sample counts per bucket (``avail[r, b]``, consumed in place).

    Returns ``(bucket, count, equal)``: arrays (R, steps), (R, steps) and (steps,): at step j stream r takes
    ``count[r, j]`` samples (0: no batch) of bucket ``bucket[r, j]``; ``equal[j]``: a step shared by every
    stream (same class and size). The equal steps come first; a stream takes each bucket's samples in
    chain order (see :func:`chain_starts`).
    """
    n_r, n_c = avail.shape[0], len(class_size)
    members = class_members(class_of, n_c)
    full_b, full_k = _full_steps(avail, members, class_size)
    st = _State(avail, members, class_size)
    cls = np.asarray(class_of, dtype=np.int64)
    cap = np.asarray(sizes, dtype=np.int64)
    rows = st.rows
    # Per step: the bucket of every stream, its sample count (0: no batch), and whether it is equal.
    take_b: list[np.ndarray] = []
    take_k: list[np.ndarray | int] = []
    take_eq: list[bool] = []
    while True:
        pick = st.full_class()
        if pick >= 0:
            k = class_size[pick]
        elif not any(st.remaining):
            break
        else:
            m = st.most.min(axis=0) if n_c else np.zeros(0, dtype=np.int64)
            pick = int(m.argmax()) if n_c and m.max() > 0 else -1
            k = int(m[pick]) if pick >= 0 else 0
            if pick >= 0:
                counts["reduced_steps"] += 1
        if pick >= 0:
            bs = st.best[:, pick].copy()
            avail[rows, bs] -= k
            st.remaining[pick] -= k * n_r
            st.refresh(pick)
            take_b.append(bs)
            take_k.append(k)
            take_eq.append(True)
            continue
        # No class is shared by every stream: each takes its own fullest bucket (first on ties).
        bs = np.minimum(avail, cap).argmax(axis=1)
        ks = np.minimum(avail[rows, bs], cap[bs])
        has = ks > 0
        avail[rows, bs] -= ks
        counts["tail_batches"] += int(has.sum())
        for c in sorted(set(cls[bs[has]].tolist())):
            st.remaining[c] -= int(ks[has & (cls[bs] == c)].sum())
            st.refresh(c)
        take_b.append(bs)
        take_k.append(ks)
        take_eq.append(False)
    b = np.zeros((n_r, len(take_b)), dtype=np.int64)
    k = np.zeros((n_r, len(take_b)), dtype=np.int64)
    for j, (bb, kk) in enumerate(zip(take_b, take_k)):
        b[:, j], k[:, j] = bb, kk
    eq = np.r_[np.ones(len(full_k), dtype=bool), np.asarray(take_eq, dtype=bool)]
    return np.hstack([full_b, b]), np.hstack([np.broadcast_to(full_k, (n_r, len(full_k))), k]), eq


def stable_order(key: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` for keys in [0, bound): on 16-bit keys where they fit (NumPy
    sorts those by radix, several times faster than 64-bit keys)."""
    if bound <= 1 << 16:
        key = key.astype(np.uint16)
    elif bound <= 1 << 31:
        key = key.astype(np.int32)
    return np.argsort(key, kind="stable")


def stable_order_within(key: np.ndarray, bound: int, starts: list[int]) -> np.ndarray:
    """:func:`stable_order` of each run ``key[starts[i] : starts[i + 1]]``, as positions in ``key``: the
    stable sort by (run, key) for keys in [0, bound). Runs of a few thousand keys sorted one at a time stay
    in cache: several times faster than one sort of them all."""
    out = np.empty(len(key), dtype=np.int64)
    small = key.astype(np.uint16) if bound <= 1 << 16 else key
    for a, z in zip(starts[:-1], starts[1:]):
        if z > a:
            out[a:z] = np.argsort(small[a:z], kind="stable")
            out[a:z] += a
    return out


def chain_starts(b: np.ndarray, k: np.ndarray, n_b: int) -> np.ndarray:
    """Where each batch of :func:`schedule_takes` starts in its bucket's chain (R, steps): the samples the
    stream took from that bucket before."""
    n_r = b.shape[0]
    key = (np.arange(n_r)[:, None] * n_b + b).ravel()
    order = stable_order(key, n_r * n_b)  # by (stream, bucket), steps in order
    taken = k.ravel()[order]
    ends = np.cumsum(taken)
    group_first = np.r_[True, key[order][1:] != key[order][:-1]]
    base = np.maximum.accumulate(np.where(group_first, ends - taken, 0))
    start = np.empty_like(ends)
    start[order] = ends - taken - base
    return start.reshape(n_r, -1)


def _materialise(
    chains: list[list[list[Ref]]], b: np.ndarray, k: np.ndarray, take_eq: np.ndarray
) -> list[list[Batch]]:
    """The recorded steps -> each stream's batches (a bucket's batches are consecutive slices of its chain)."""
    n_r = len(chains)
    if not b.shape[1]:
        return [[] for _ in range(n_r)]
    start = chain_starts(b, k, max(len(ch) for ch in chains))
    eqs = take_eq.tolist()
    out: list[list[Batch]] = []
    for r in range(n_r):
        ch = chains[r]
        out.append(
            [
                Batch(bb, ch[bb][p : p + kk], eq)
                for bb, p, kk, eq in zip(b[r].tolist(), start[r].tolist(), k[r].tolist(), eqs)
                if kk
            ]
        )
    return out

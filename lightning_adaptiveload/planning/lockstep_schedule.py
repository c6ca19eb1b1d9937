"""The step loop of the ``lockstep`` schedule (:mod:`.lockstep`), vectorised over the R streams of one
worker index.

Each step is a few NumPy operations on the streams' sample counts per bucket (an (R, buckets) array),
whatever R; the batches themselves are materialised at the end, one list slice per batch. The choices
(class of each step, bucket of each stream, tie-breaks) are those of the loop this replaced, step for
step: the plans are identical (``tests/test_plan_identity.py``).
"""

from __future__ import annotations

import numpy as np

from lightning_adaptiveload.planning.plan import Batch, Ref

__all__ = ["class_members", "schedule"]


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
    n_r, n_b, n_c = len(chains), len(class_of), len(class_size)
    avail = np.array([[len(ch) for ch in chains[r]] for r in range(n_r)], dtype=np.int64).reshape(n_r, n_b)
    st = _State(avail, class_members(class_of, n_c), class_size)
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
    return _materialise(chains, take_b, take_k, take_eq)


def _materialise(
    chains: list[list[list[Ref]]], take_b: list[np.ndarray], take_k: list, take_eq: list[bool]
) -> list[list[Batch]]:
    """The recorded steps -> each stream's batches (a bucket's batches are consecutive slices of its chain)."""
    n_r = len(chains)
    if not take_b:
        return [[] for _ in range(n_r)]
    b = np.stack(take_b, axis=1)  # (R, steps)
    k = np.stack([np.broadcast_to(x, (n_r,)) for x in take_k], axis=1)
    # Where each batch starts in its bucket's chain: the samples the stream took from the bucket before.
    n_b = max(len(ch) for ch in chains)
    key = (np.arange(n_r)[:, None] * n_b + b).ravel()
    order = np.argsort(key, kind="stable")  # by (stream, bucket), steps in order
    taken = k.ravel()[order]
    ends = np.cumsum(taken)
    group_first = np.r_[True, key[order][1:] != key[order][:-1]]
    base = np.maximum.accumulate(np.where(group_first, ends - taken, 0))
    start = np.empty_like(ends)
    start[order] = ends - taken - base
    start = start.reshape(n_r, -1)
    out: list[list[Batch]] = []
    for r in range(n_r):
        ch = chains[r]
        out.append(
            [
                Batch(bb, ch[bb][p : p + kk], eq)
                for bb, p, kk, eq in zip(b[r].tolist(), start[r].tolist(), k[r].tolist(), take_eq)
                if kk
            ]
        )
    return out

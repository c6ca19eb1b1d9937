"""The ``lockstep`` schedule: at every step, every rank takes a batch of the same lockstep class and size.

Buckets of near-equal per-sample cost form a *lockstep class*. Within each worker index w, the R streams
(one per rank) first exchange samples so that they hold equal counts of every class
(:func:`_balance_classes`), then take, step by step, a batch of one class and one size on every rank
(:class:`_Schedule`). A lockstep stream reads each bucket's samples as a separate sequence of shard reads,
so it needs to hold no samples beyond the batch it is assembling. Pure Python.
"""

from __future__ import annotations

from lightning_adaptiveload.planning.inputs import Bucket
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
        group = _Schedule(chains, class_of, class_size, sizes, counts).run()
        for r in range(world):
            sim[(r, w)] = group[r]
            reads[(r, w)] = _reads_of_chains(chains[r])
    return sim


def _bucket_chains(reads: list[Read], bucket_of: list[list[int]], n_buckets: int) -> list[list[Ref]]:
    """A stream's samples split by bucket, each list in read order."""
    chains: list[list[Ref]] = [[] for _ in range(n_buckets)]
    for shard, ids in reads:
        bk = bucket_of[shard]
        for i in ids:
            chains[bk[i]].append((shard, i))
    return chains


def _reads_of_chains(chains: list[list[Ref]]) -> list[Read]:
    """Per-bucket chains -> reads: runs of consecutive refs from one shard, chain by chain."""
    reads: list[Read] = []
    for chain in chains:
        last = None
        for shard, i in chain:
            if shard != last:
                reads.append((shard, [i]))
                last = shard
            else:
                reads[-1][1].append(i)
    return [(s, sorted(ids)) for s, ids in reads]


def _class_members(class_of: list[int], n_classes: int) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in range(n_classes)]
    for b, c in enumerate(class_of):
        members[c].append(b)
    return members


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
    members = _class_members(class_of, n_classes)
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


class _Schedule:
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

    def __init__(
        self,
        chains: list[list[list[Ref]]],
        class_of: list[int],
        class_size: list[int],
        sizes: list[int],
        counts: dict[str, int],
    ) -> None:
        self.chains = chains
        self.class_of = class_of
        self.class_size = class_size
        self.sizes = sizes
        self.counts = counts
        n_r, n_b, n_c = len(chains), len(class_of), len(class_size)
        self.members = _class_members(class_of, n_c)
        self.pos = [[0] * n_b for _ in range(n_r)]
        self.avail = [[len(chains[r][b]) for b in range(n_b)] for r in range(n_r)]
        # best[r][c]: the fullest bucket of class c on stream r
        self.best = [[self._fullest(r, c) for c in range(n_c)] for r in range(n_r)]
        avail, best = self.avail, self.best
        self.n_ok = [sum(1 for r in range(n_r) if avail[r][best[r][c]] >= class_size[c]) for c in range(n_c)]
        self.remaining = [sum(avail[r][b] for r in range(n_r) for b in self.members[c]) for c in range(n_c)]
        self.initial = [max(1, x) for x in self.remaining]
        self.out: list[list[Batch]] = [[] for _ in range(n_r)]

    def _fullest(self, r: int, c: int) -> int:
        pick, most = self.members[c][0], -1
        for x in self.members[c]:
            if self.avail[r][x] > most:
                pick, most = x, self.avail[r][x]
        return pick

    def _take(self, r: int, b: int, k: int, equal: bool) -> None:
        c = self.class_of[b]
        was_ok = self.avail[r][self.best[r][c]] >= self.class_size[c]
        p = self.pos[r][b]
        self.out[r].append(Batch(b, self.chains[r][b][p : p + k], equal))
        self.pos[r][b] = p + k
        self.avail[r][b] -= k
        self.remaining[c] -= k
        self.best[r][c] = self._fullest(r, c)
        if was_ok and self.avail[r][self.best[r][c]] < self.class_size[c]:
            self.n_ok[c] -= 1

    def _full_class(self) -> int:
        """The class every stream can fill with the largest share of its samples unused, or -1."""
        n_r = len(self.chains)
        pick, share = -1, -1.0
        for c in range(len(self.class_size)):
            if self.n_ok[c] == n_r and self.remaining[c] / self.initial[c] > share:
                pick, share = c, self.remaining[c] / self.initial[c]
        return pick

    def _reduced_class(self) -> tuple[int, int]:
        """The class with the largest minimum count m >= 1 over the streams, and m; (-1, 0) if none."""
        pick, m_best = -1, 0
        for c in range(len(self.class_size)):
            m = min(self.avail[r][self.best[r][c]] for r in range(len(self.chains)))
            if m > m_best:
                pick, m_best = c, m
        return pick, m_best

    def run(self) -> list[list[Batch]]:
        """The batches of every stream, in step order."""
        n_r, n_b = len(self.chains), len(self.class_of)
        avail, best = self.avail, self.best
        while True:
            pick = self._full_class()
            if pick >= 0:
                for r in range(n_r):
                    self._take(r, best[r][pick], self.class_size[pick], True)
                continue
            if not any(self.remaining):
                break
            pick, m_best = self._reduced_class()
            if pick >= 0:
                for r in range(n_r):
                    self._take(r, best[r][pick], m_best, True)
                self.counts["reduced_steps"] += 1
                continue
            for r in range(n_r):
                b = max(range(n_b), key=lambda x: (min(avail[r][x], self.sizes[x]), -x))
                if avail[r][b]:
                    self._take(r, b, min(avail[r][b], self.sizes[b]), False)
                    self.counts["tail_batches"] += 1
        return self.out

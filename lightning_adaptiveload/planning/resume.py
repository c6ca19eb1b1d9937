"""Resuming an epoch: the samples an interrupted plan consumed, and the rest of a plan for another
number of DataLoader workers.

:func:`consumed_refs` gives the samples in the steps each rank took; passed as ``exclude`` to
:func:`~.planner.plan_epoch` they let the rest of an epoch be planned for another number of ranks.
:func:`continue_plan` continues a plan for the same ranks with another number of workers, batch for
batch. :class:`ConsumedMask` holds consumed samples as one flag per sample of the index (a resume of
100M samples holds 100 MB, not a Python tuple per sample) and passes as ``exclude``; :func:`mark_consumed`
marks the samples of a range of one rank's steps in it. Pure Python and NumPy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.plan import EpochPlan, Read, Ref, Stream

__all__ = ["ConsumedMask", "consumed_digest", "consumed_refs", "continue_plan", "mark_consumed"]


class ConsumedMask(Mapping):
    """Consumed samples, one flag per sample of the index, read as ``{shard_id: sample_ids}``.

    A :class:`~collections.abc.Mapping` from each shard with a consumed sample to the set of its consumed
    sample ids (built on access, one shard at a time), so that it passes as ``exclude`` to
    :func:`~.planner.plan_epoch` (and a chunked or counted plan) like a dict of sets, in memory of one byte
    per sample of the index.

    Args:
        shard_offsets: (shards + 1,) each shard's first position in index order and the sample count last.
    """

    def __init__(self, shard_offsets: Sequence[int] | np.ndarray) -> None:
        self.offsets = np.asarray(shard_offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or (np.diff(self.offsets) < 0).any():
            raise ValueError(
                "ConsumedMask: shard_offsets must be a non-decreasing 1-d sequence, one per shard + 1"
            )
        self.flags = np.zeros(int(self.offsets[-1]), dtype=bool)
        self._counts: np.ndarray | None = None

    @classmethod
    def of_index(cls, index_or_shapes: Any) -> ConsumedMask:
        """An empty mask for a ``ShardIndex``, ``CompactIndex`` or per-shard lists of shapes."""
        from lightning_adaptiveload.planning.inputs import as_input

        data = as_input(index_or_shapes)
        if data.arrays is not None:
            return cls(data.arrays.shard_offsets)
        return cls(np.r_[0, np.cumsum([len(row) for row in data.shapes])])

    def copy(self) -> ConsumedMask:
        out = ConsumedMask(self.offsets)
        out.flags[:] = self.flags
        return out

    def mark(self, shard: int, ids: Sequence[int] | np.ndarray) -> None:
        """Flag samples ``ids`` of ``shard`` consumed."""
        a, b = int(self.offsets[shard]), int(self.offsets[shard + 1])
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= b - a):
            raise ValueError(
                f"ConsumedMask.mark: shard {shard} has {b - a} samples, got ids up to {ids.max()}"
            )
        self.flags[a + ids] = True
        self._counts = None

    def total(self) -> int:
        """How many samples are flagged."""
        return int(self.flags.sum())

    def _shard_counts(self) -> np.ndarray:
        if self._counts is None:
            cum = np.r_[0, np.cumsum(self.flags, dtype=np.int64)]
            self._counts = cum[self.offsets[1:]] - cum[self.offsets[:-1]]
        return self._counts

    def __getitem__(self, shard: int) -> set[int]:
        s = int(shard)
        if not 0 <= s < len(self.offsets) - 1 or not self._shard_counts()[s]:
            raise KeyError(shard)
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        return set(np.flatnonzero(self.flags[a:b]).tolist())

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._shard_counts()).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self._shard_counts()))

    def __contains__(self, shard: object) -> bool:
        try:
            s = int(shard)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False
        return 0 <= s < len(self.offsets) - 1 and bool(self._shard_counts()[s])


def mark_consumed(mask: ConsumedMask, plan: EpochPlan, rank: int, start: int, stop: int) -> None:
    """Flag in ``mask`` the samples of steps ``start <= k < stop`` of ``rank`` in ``plan`` (which holds that
    rank's streams: a plan of every rank or that rank's rank-local plan)."""
    if (plan.rank is not None and int(rank) != plan.rank) or not 0 <= int(rank) < plan.world_size:
        raise ValueError(f"mark_consumed: the plan holds no streams of rank {rank}")
    if not 0 <= int(start) <= int(stop) <= plan.steps:
        raise ValueError(f"mark_consumed: steps {start}..{stop} are outside 0..{plan.steps} of this plan")
    per_shard: dict[int, list[int]] = {}
    for w, j in plan.step_order[int(rank)][int(start) : int(stop)]:
        for shard, i in plan.streams[(int(rank), w)][j]:
            per_shard.setdefault(shard, []).append(i)
    for shard, ids in per_shard.items():
        mask.mark(shard, ids)


def consumed_refs(plan: EpochPlan, steps_per_rank: Sequence[int] | int) -> set[Ref]:
    """The sample refs in the first ``steps_per_rank[r]`` steps of every rank r (an int: the same for all)."""
    if plan.rank is not None:
        raise ValueError(
            f"consumed_refs needs the plan of every rank, but this plan holds only rank {plan.rank}'s streams "
            "(plan_epoch(rank=...)); plan the epoch with rank=None to find what every rank consumed"
        )
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


def consumed_digest(plan: EpochPlan, steps_per_rank: Mapping[int, int]) -> int:
    """A 64-bit digest of the sample refs in the first ``steps_per_rank[r]`` steps of the ranks given.

    Order-independent and additive: the sum (mod 2^64) of a mix of each ref, so the digests of the ranks'
    parts (each computed from its own rank-local plan) add up to the digest of the whole epoch's. Saved
    with a resume state and compared with the replanned epoch's, it tells whether a replay reproduces
    exactly the samples that were consumed (same seed, settings and planner).

    Raises:
        ValueError: a rank the plan does not hold, or a count outside ``0..plan.steps``.
    """
    shards: list[int] = []
    samples: list[int] = []
    for r, k in steps_per_rank.items():
        if not 0 <= int(r) < plan.world_size or (plan.rank is not None and int(r) != plan.rank):
            raise ValueError(f"consumed_digest: the plan holds no streams of rank {r}")
        if not 0 <= int(k) <= plan.steps:
            raise ValueError(f"rank {r} consumed {k} steps but the plan has {plan.steps}")
        for w, j in plan.step_order[int(r)][: int(k)]:
            for shard, i in plan.streams[(int(r), w)][j]:
                shards.append(shard)
                samples.append(i)
    x = (np.asarray(shards, dtype=np.uint64) << np.uint64(32)) | np.asarray(samples, dtype=np.uint64)
    with np.errstate(over="ignore"):  # splitmix64's finaliser, wrapping by design
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return int(x.sum(dtype=np.uint64))


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
    ranks = range(world) if plan.rank is None else [plan.rank]  # a rank-local plan continues its rank
    keys = [(r, w) for r in ranks for w in range(workers)]
    streams: dict[Stream, list[list[Ref]]] = {st: [] for st in keys}
    buckets_of: dict[Stream, list[int]] = {st: [] for st in keys}
    batch_steps: dict[Stream, list[int]] = {st: [] for st in keys}
    packs: dict[Stream, list[bool]] = {st: [] for st in keys}
    for r in ranks:
        for k in range(steps):
            w_old, j = plan.step_order[r][steps_done + k]
            st = (r, k % workers)
            streams[st].append(plan.streams[(r, w_old)][j])
            buckets_of[st].append(plan.batch_buckets[(r, w_old)][j])
            batch_steps[st].append(k)
            packs[st].append(plan.is_pack((r, w_old), j))
    reads = {st: reads_per_shard(batches) for st, batches in streams.items()}
    return EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=plan.seed,
        epoch=plan.epoch,
        schedule=plan.schedule,
        buckets=plan.buckets,
        streams=streams,
        batch_buckets=buckets_of,
        batch_steps=batch_steps,
        reads=reads,
        step_order=[
            [(k % workers, k // workers) for k in range(steps)] if r in ranks else [] for r in range(world)
        ],
        steps=steps,
        global_tokens=list(plan.global_tokens[steps_done:]),
        report=_rest_report(plan, steps_done, int(num_workers), streams, reads),
        # A lockstep plan's packed tail stays packs (the packed schedule marks every batch by its schedule).
        pack_batches=packs if plan.pack_batches else {},
        rank=plan.rank,
    )


def reads_per_shard(batches: list[list[Ref]]) -> list[Read]:
    """One read per shard, in order of first need, of the samples ``batches`` take from it."""
    per_shard: dict[int, list[int]] = {}
    for batch in batches:
        for shard, i in batch:
            per_shard.setdefault(shard, []).append(i)
    return [(shard, sorted(ids)) for shard, ids in per_shard.items()]


def _rest_report(
    plan: EpochPlan,
    steps_done: int,
    num_workers: int,
    streams: dict[Stream, list[list[Ref]]],
    reads: dict[Stream, list[Read]],
) -> dict:
    """``plan.report`` with the counters of the remaining work."""
    workers, world = max(1, num_workers), plan.world_size
    report = dict(plan.report)
    samples = sum(len(b) for v in streams.values() for b in v)
    report.update(
        num_workers=num_workers,
        samples=samples,
        batches=sum(len(v) for v in streams.values()),
        steps=plan.steps - steps_done,
        tokens=int(sum(plan.global_tokens[steps_done:])),
        excluded=report.get("excluded", 0) + report.get("samples", 0) - samples,
        resumed_at_step=steps_done,
        reads=sum(len(v) for v in reads.values()),
        samples_per_rank=[
            sum(len(b) for w in range(workers) for b in streams[(r, w)]) if (r, 0) in streams else -1
            for r in range(world)
        ],
    )
    if plan.rank is not None:  # samples, batches, excluded and reads then count this rank's streams only
        report["counts_of_rank"] = plan.rank
    return report

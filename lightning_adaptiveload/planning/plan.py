"""What an epoch plan is: :class:`EpochPlan` (every stream's batches, reads and step order), the
:class:`Batch` the planning steps hand each other while they build it, and :class:`PlanError`.

:mod:`.planner` makes plans (:func:`~.planner.plan_epoch`); :mod:`.resume` continues them. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

from lightning_adaptiveload.planning.settings import Schedule

__all__ = [
    "AUTO_MAX_WAIT",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "Batch",
    "EpochPlan",
    "PlanError",
    "Read",
    "Ref",
    "Stream",
    "batching_label",
    "underfull_message",
]

Ref = tuple[int, int]  # a sample: (shard id, sample id)
Stream = tuple[int, int]  # (rank, worker)
Read = tuple[int, list[int]]  # (shard id, sample ids ascending): what a stream reads of one shard
#: The schedules a plan is made with (``plan.schedule``); see ``docs/schedules.md``.
SCHEDULES = ("independent", "lockstep", "packed")
#: The schedules a setting may name: :data:`SCHEDULES` or ``"auto"`` (lockstep, or packed where lockstep's
#: estimated straggler wait exceeds :data:`AUTO_MAX_WAIT`; :func:`~.planner.plan_epoch`).
SCHEDULE_CHOICES: tuple[str, ...] = get_args(Schedule)
#: ``schedule="auto"``: the largest estimated straggler wait (share of the step time) lockstep may have
#: before the epoch is planned packed instead (where the model runs packs).
AUTO_MAX_WAIT = 0.02


def batching_label(schedule: str, sizing: str) -> str:
    """How a configuration is named wherever it is printed (the epoch line, the end of fit, ``simulate``).

    ``"schedule S, sizing Z"``; but the packed schedule sizes no batches, so the batcher's ``sizing`` (and
    ``max_compute``) change nothing in it: each rank's pack is filled up to ``max_tokens`` and the packs of
    a step are balanced by the cost model. Its label says that rather than name a sizing rule that does not
    apply (the simulator builds its packed plans with an ``equal_tokens`` batcher, the DataModule with
    whatever sizing the recipe sets, and both plans are the same).

    Example:
        >>> batching_label("lockstep", "dual")
        'schedule lockstep, sizing dual'
    """
    if schedule == "packed":
        return "schedule packed (no batch sizing: packs up to max_tokens, balanced by the cost model)"
    return f"schedule {schedule}, sizing {sizing}"


class PlanError(ValueError):
    """An epoch cannot be planned with these settings; the message says why and what to do."""


@dataclass(slots=True)
class Batch:
    """One batch of a stream while the epoch is planned (the plan keeps only ``refs`` and ``bucket``).

    Attributes:
        bucket: bucket id (index into the plan's buckets).
        refs: the batch's samples, in file order; empty for an empty (zero-weight) batch.
        equal: a lockstep step shared by every rank (same class and size): it must keep its step.
        bound: emitted early at the independent schedule's buffer bound: never packed with a later batch.
        pack: a pack of samples of any shapes (lockstep's packed tail, :mod:`.tail`), collated as a pack;
            ``bucket`` is then its largest sample's bucket.
    """

    bucket: int
    refs: list[Ref]
    equal: bool = False
    bound: bool = False
    pack: bool = False


@dataclass
class EpochPlan:
    """The plan of one epoch for every stream; identical on every rank.

    Attributes:
        world_size, num_workers, seed, epoch, schedule: the settings planned for (``num_workers`` as given;
            0 means one stream per rank, worker 0).
        buckets: per bucket id: ``{"shape": (C, T, H, W), "seq_len": S, "batch_size": B, "cost": cost(S),
            "lockstep_class": int}``.
        streams: ``streams[(rank, worker)]`` is the list of batches that stream yields, in order; a batch
            is a list of sample refs ``(shard_id, sample_id)`` in file order.
        batch_buckets: ``batch_buckets[(rank, worker)][j]`` is the bucket id of batch j.
        batch_steps: ``batch_steps[(rank, worker)][j]`` is the rank step at which batch j is taken.
        reads: ``reads[(rank, worker)]`` is the list of ``(shard_id, sample_ids)`` the stream reads (sample
            ids ascending). Independent schedule: one read per piece, in order. Lockstep schedule: per
            bucket, the runs of that bucket's samples in each shard, so that the stream can take the next
            samples of any bucket without buffering others; a shard is then opened once per bucket it holds
            (seeking over the other members). Packed schedule: per pack, the runs of its samples in each
            shard. A reader opens a read when a batch first needs it.
        step_order: ``step_order[rank][k] = (worker, j)``: the batch the rank takes at step k.
        steps: steps per rank (the same for every rank).
        global_tokens: per step, the sum of the batch tokens over all ranks.
        report: counters of the plan: epoch, schedule, world_size, num_workers, samples, batches, steps,
            tokens,
            padding_tokens (0: latents are never padded), skipped (reason -> count; ``oversize`` here),
            excluded, partial_batches (end of stream), bound_partial_batches (emitted early at the buffer
            bound), split_batches (batches added to equalise steps), merged_batches (partial batches packed
            into fewer to equalise steps), empty_batches (zero-sample batches, see ``underfull``),
            reduced_steps (lockstep steps with a smaller common B), lockstep_tail_steps (lockstep schedule:
            steps whose batches differ in lockstep class or size across ranks; 0 in the independent
            schedule), unequal_steps (the same count under any schedule), lockstep_classes, moved_samples,
            moved_batches,
            shard_splits, reads, max_buffered_samples, max_compute, est_compute_cv (mean over steps of the
            CV of the batch costs across ranks), est_straggler_wait
            (:func:`~lightning_adaptiveload.stats.straggler_wait` over the steps: share of the summed
            step time spent waiting for the slowest rank, by the cost model; ``est_wait_share`` is its old
            name), samples_per_rank, plan_seconds. :func:`~.resume.continue_plan` adds resumed_at_step.
            The lockstep schedule adds lockstep_tail (the setting), packed_tail_steps (steps of packs at the
            end, see :mod:`.tail`), packed_tail_samples, tail_fill_mean (mean tokens / max_tokens of the tail
            packs; 0 without a tail).
        pack_batches: ``pack_batches[(rank, worker)][j]``: whether batch j is a pack (samples of any shapes,
            collated by :func:`~lightning_adaptiveload.loading.packed_collate.collate_packed`) rather than a bucketed batch. Empty: no
            batch is a pack, unless ``schedule == "packed"`` (every batch is). Use :meth:`is_pack`.
    """

    world_size: int
    num_workers: int
    seed: int
    epoch: int
    schedule: str
    buckets: list[dict[str, Any]]
    streams: dict[Stream, list[list[Ref]]]
    batch_buckets: dict[Stream, list[int]]
    batch_steps: dict[Stream, list[int]]
    reads: dict[Stream, list[Read]]
    step_order: list[list[tuple[int, int]]]
    steps: int
    global_tokens: list[int]
    report: dict[str, Any] = field(default_factory=dict)
    pack_batches: dict[Stream, list[bool]] = field(default_factory=dict)
    rank: int | None = None
    step_costs: Any = field(default=None, repr=False, compare=False)

    def is_pack(self, stream: Stream, j: int) -> bool:
        """Whether batch ``j`` of ``stream`` is a pack (collated as one, see ``docs/data_path.md``)."""
        if self.schedule == "packed":
            return True
        flags = self.pack_batches.get(stream)
        return bool(flags) and bool(flags[j])

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


def underfull_message(
    world: int, workers: int, n_shards: int, n_samples: int, samples_per_rank: list[int]
) -> str:
    """Why ranks got no sample, and what to do (``underfull="pad"``, more data, fewer ranks)."""
    empty = [r for r, n in enumerate(samples_per_rank) if n == 0]
    return (
        f"world size {world}: {n_samples} samples in {n_shards} shards leave {len(empty)} rank(s) without "
        f"any sample (rank {empty[0]} first), with {workers} stream(s) per rank; those ranks would take only "
        "empty (zero-weight) steps. Pass underfull='pad' to allow that (the DataModule's val_underfull), or "
        "use more data or fewer ranks"
    )

"""The schedules as objects: ``independent``, ``lockstep``, ``packed`` and ``auto``, looked up once by name.

Each schedule is a frozen dataclass holding its own settings and implementing
:class:`~.job.EpochSchedule`: ``name``, ``segments(job)``, ``plan_whole(job)`` and ``plan(job)``.
:data:`SCHEDULE_TYPES` maps every name a setting may give (``PlanSettings.schedule``) to its class, and
:func:`schedule_for` builds the schedule of a :class:`~.settings.PlanSettings`: the one place a schedule
name is turned into behaviour. Which schedule to use: ``docs/schedules.md``.

Pure Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_adaptiveload.planning import packed_counts
from lightning_adaptiveload.planning.assign import exclusions
from lightning_adaptiveload.planning.bucketed import plan_bucketed
from lightning_adaptiveload.planning.chunked import plan_segments, segment_count
from lightning_adaptiveload.planning.job import EpochSchedule, PlanJob
from lightning_adaptiveload.planning.packed import plan_packed
from lightning_adaptiveload.planning.plan import AUTO_MAX_WAIT, EpochPlan
from lightning_adaptiveload.planning.resume import ConsumedMask
from lightning_adaptiveload.planning.settings import PlanSettings

__all__ = ["SCHEDULE_TYPES", "Auto", "Independent", "Lockstep", "Packed", "schedule_for"]


def _num_samples(data: Any) -> int:
    if data.arrays is not None:
        return int(data.arrays.shard_offsets[-1])
    return sum(map(len, data.shapes))


def _plan_in_segments(schedule: EpochSchedule, job: PlanJob) -> EpochPlan:
    """A bucketed schedule's epoch: at once, or in segments (:mod:`.chunked`) where it asks for them."""
    groups = schedule.segments(job)
    if groups > 1:
        return plan_segments(job, schedule, groups)
    return schedule.plan_whole(job)


class _Bucketed:
    """What the bucketed schedules share: planned by :func:`.bucketed.plan_bucketed`, in segments of about
    ``chunk_samples`` where the epoch is larger (the subclass's field)."""

    chunk_samples: int | None

    def segments(self, job: PlanJob) -> int:
        return segment_count(_num_samples(job.data), self.chunk_samples, job.world, job.workers)

    def plan_whole(self, job: PlanJob) -> EpochPlan:
        return plan_bucketed(job, self)  # type: ignore[arg-type]

    def plan(self, job: PlanJob) -> EpochPlan:
        return _plan_in_segments(self, job)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class Independent(_Bucketed):
    """Each rank batches its own samples (bucketed, no step alignment); equal step counts at the end."""

    name: ClassVar[str] = "independent"
    always_packs: ClassVar[bool] = False
    """Every training step is a pack (the module must run packs)."""
    has_lockstep_tail: ClassVar[bool] = False
    """Its epochs may end in lockstep's tail (``PlanSettings.lockstep_tail`` applies)."""
    lockstep: ClassVar[bool] = False
    tail: ClassVar[str] = "bucketed"  # no lockstep tail
    packs_tail: ClassVar[bool] = False

    tolerance: float = 0.05
    """Groups buckets into the lockstep classes the plan reports (``buckets[i]["lockstep_class"]``)."""
    chunk_samples: int | None = None
    """Plan an epoch of more samples in segments of about this many (:mod:`.chunked`); None: at once."""

    @classmethod
    def from_settings(cls, settings: PlanSettings) -> Independent:
        return cls(tolerance=settings.lockstep_tolerance, chunk_samples=settings.chunk_samples)


@dataclass(frozen=True, kw_only=True)
class Lockstep(_Bucketed):
    """All ranks take a batch of the same lockstep class and size at every step (:mod:`.lockstep`)."""

    name: ClassVar[str] = "lockstep"
    always_packs: ClassVar[bool] = False
    """Every training step is a pack (the module must run packs)."""
    has_lockstep_tail: ClassVar[bool] = True
    """Its epochs may end in lockstep's tail (``PlanSettings.lockstep_tail`` applies)."""
    lockstep: ClassVar[bool] = True

    tolerance: float = 0.05
    """Relative cost tolerance that groups buckets into one lockstep class."""
    tail: str = "packed"
    """The end of the epoch: ``"packed"`` (balanced packs, :mod:`.tail`) or ``"bucketed"``."""
    chunk_samples: int | None = None
    """Plan an epoch of more samples in segments of about this many (:mod:`.chunked`); None: at once."""

    @property
    def packs_tail(self) -> bool:
        """Whether the end of the epoch runs as packs (the model must run packs)."""
        return self.tail == "packed"

    @classmethod
    def from_settings(cls, settings: PlanSettings) -> Lockstep:
        return cls(
            tolerance=settings.lockstep_tolerance,
            tail=settings.lockstep_tail,
            chunk_samples=settings.chunk_samples,
        )


@dataclass(frozen=True, kw_only=True)
class Packed:
    """Every rank takes one pack of samples of any shapes per step, the packs of a step of equal cost
    (:mod:`.packed`). An epoch of more than :data:`~.packed_counts.TEMPLATE_SAMPLES` samples left to plan
    is planned on counts (:mod:`.packed_counts`), rank-locally and in bounded memory: never in segments."""

    name: ClassVar[str] = "packed"
    always_packs: ClassVar[bool] = True
    """Every training step is a pack (the module must run packs)."""
    has_lockstep_tail: ClassVar[bool] = False
    """Its epochs may end in lockstep's tail (``PlanSettings.lockstep_tail`` applies)."""

    @classmethod
    def from_settings(cls, settings: PlanSettings) -> Packed:
        return cls()

    def segments(self, job: PlanJob) -> int:
        return 1

    def plan_whole(self, job: PlanJob) -> EpochPlan:
        exclude = exclusions(job.exclude)
        n_gone = exclude.total() if isinstance(exclude, ConsumedMask) else sum(map(len, exclude.values()))
        args = (job.data, job.world, job.num_workers, job.batcher, job.seed, job.epoch, exclude,
                job.settings.underfull, job.t0, job.rank, job.settings.keep_step_costs)  # fmt: skip
        if _num_samples(job.data) - n_gone > packed_counts.TEMPLATE_SAMPLES:
            return packed_counts.plan_on_counts(*args)
        return plan_packed(*args)

    def plan(self, job: PlanJob) -> EpochPlan:
        return self.plan_whole(job)


@dataclass(frozen=True, kw_only=True)
class Auto:
    """Lockstep, or packed where lockstep's estimated straggler wait exceeds ``max_wait`` and packs may run
    (``lockstep.tail == "packed"``: the DataModule sets the tail to ``"bucketed"`` for a module that does
    not run packs). ``plan.report["schedule_auto"]`` says which was chosen and why; the DataModule logs
    it on the epoch line."""

    name: ClassVar[str] = "auto"
    always_packs: ClassVar[bool] = False
    """Every training step is a pack (the module must run packs)."""
    has_lockstep_tail: ClassVar[bool] = True
    """Its epochs may end in lockstep's tail (``PlanSettings.lockstep_tail`` applies)."""

    lockstep: Lockstep
    """The lockstep schedule tried first."""
    packed: Packed
    """The schedule taken instead where lockstep waits too long."""
    max_wait: float = AUTO_MAX_WAIT
    """The largest estimated straggler wait (share of the step time) lockstep may have."""

    @classmethod
    def from_settings(cls, settings: PlanSettings) -> Auto:
        return cls(
            lockstep=Lockstep.from_settings(settings),
            packed=Packed.from_settings(settings),
            max_wait=AUTO_MAX_WAIT,
        )

    def segments(self, job: PlanJob) -> int:
        return self.lockstep.segments(job)

    def plan_whole(self, job: PlanJob) -> EpochPlan:
        return self._choose(job, whole=True)

    def plan(self, job: PlanJob) -> EpochPlan:
        return self._choose(job, whole=False)

    def _choose(self, job: PlanJob, whole: bool) -> EpochPlan:
        lock_job = job.replace(settings=job.settings.replace(schedule="lockstep"), t0=time.perf_counter())
        plan = self.lockstep.plan_whole(lock_job) if whole else self.lockstep.plan(lock_job)
        wait, max_wait = float(plan.report["est_straggler_wait"]), self.max_wait
        may_pack = self.lockstep.packs_tail and int(job.world) > 1
        if wait <= max_wait or not may_pack:
            why = (
                f"lockstep's estimated straggler wait {wait:.2%} is within {max_wait:.0%}"
                if wait <= max_wait
                else f"lockstep's estimated straggler wait is {wait:.2%}, above {max_wait:.0%}, but the model "
                "does not run packs (lockstep_tail='bucketed')"
                if int(job.world) > 1
                else "one rank: nothing to wait for"
            )
            choice = {"chose": "lockstep", "lockstep_wait": wait, "why": why}
        else:
            lockstep_seconds = plan.report["plan_seconds"]
            del plan
            pack_job = job.replace(settings=job.settings.replace(schedule="packed"), t0=time.perf_counter())
            plan = self.packed.plan(pack_job)
            choice = {
                "chose": "packed",
                "lockstep_wait": wait,
                "why": f"lockstep's estimated straggler wait is {wait:.2%}, above {max_wait:.0%} (a mix "
                "without length classes): packed balances every step",
                "lockstep_plan_seconds": lockstep_seconds,
            }
        plan.report["schedule_auto"] = choice
        return plan


#: Every schedule name a setting may give, and its class (each has ``from_settings``).
SCHEDULE_TYPES: dict[str, Any] = {
    Independent.name: Independent,
    Lockstep.name: Lockstep,
    Packed.name: Packed,
    Auto.name: Auto,
}


def schedule_for(settings: PlanSettings) -> EpochSchedule:
    """The schedule ``settings.schedule`` names, built from ``settings`` (looked up in :data:`SCHEDULE_TYPES`).

    Raises:
        ValueError: a name without a schedule (``PlanSettings`` refuses those when built; this guards a
            registry that lost one).
    """
    try:
        kind = SCHEDULE_TYPES[settings.schedule]
    except KeyError:
        raise ValueError(
            f"schedule {settings.schedule!r} has no schedule object; the schedules are {sorted(SCHEDULE_TYPES)}"
        ) from None
    return kind.from_settings(settings)

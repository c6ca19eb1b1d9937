"""What every schedule is asked to plan, and the protocol a schedule implements.

:func:`~.planner.plan_epoch` checks its arguments once and hands a :class:`PlanJob` to the schedule it
looked up by name (:func:`~.schedules.schedule_for`); the schedule plans it, or (for an epoch planned
in segments, :mod:`.chunked`) plans each segment's own job with :meth:`EpochSchedule.plan_whole`. No
module here calls the planner back.

Pure Python (no Lightning, no torch).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning_adaptiveload.planning.inputs import PlanInput
    from lightning_adaptiveload.planning.plan import EpochPlan
    from lightning_adaptiveload.planning.settings import PlanSettings

__all__ = ["EpochSchedule", "PlanJob", "gc_paused"]


@dataclass(frozen=True, kw_only=True)
class PlanJob:
    """One epoch (or one segment of it) to plan: :func:`~.planner.plan_epoch`'s arguments, checked.

    ``batcher`` is the one mutable part (its ``"auto"`` compute cap is resolved while planning).
    """

    data: PlanInput
    """The shards' shapes (:func:`~.inputs.as_input`)."""
    world: int
    """Ranks R."""
    num_workers: int
    """DataLoader workers per rank (0: the main process reads; one stream per rank)."""
    batcher: Any
    """The :class:`~.batching.DualConstraintBatcher` that sizes the batches."""
    seed: int
    """Shard-order seed (with ``epoch``)."""
    epoch: int
    """Epoch number."""
    settings: PlanSettings
    """How the epoch is planned."""
    exclude: Any = None
    """Refs or ``{shard_id: sample_ids}`` (or a ``ConsumedMask``) already consumed; None: none."""
    rank: int | None = None
    """Keep only this rank's streams where the schedule can (None: every stream)."""
    progress: Callable[[int, int], None] | None = None
    """Called with (segments planned, segments) after each segment of a chunked plan."""
    t0: float = 0.0
    """``time.perf_counter()`` when planning began (``report["plan_seconds"]``)."""

    @property
    def workers(self) -> int:
        """Streams per rank: ``max(1, num_workers)``."""
        return max(1, self.num_workers)

    def replace(self, **changes: Any) -> PlanJob:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


class EpochSchedule(Protocol):
    """A schedule: how the batches of an epoch are laid out over the ranks and steps.

    The implementations (:mod:`.schedules`) are frozen dataclasses holding their own settings; the planner
    looks one up once by name and calls :meth:`plan`.
    """

    @property
    def name(self) -> str:
        """The name plans and reports carry (``EpochPlan.schedule``, ``report["schedule"]``)."""
        ...

    def segments(self, job: PlanJob) -> int:
        """How many segments ``job``'s epoch is planned in (1: at once)."""
        ...

    def plan_whole(self, job: PlanJob) -> EpochPlan:
        """One plan of all of ``job.data`` (an epoch, or one segment of a chunked epoch)."""
        ...

    def plan(self, job: PlanJob) -> EpochPlan:
        """The epoch's plan: :meth:`plan_whole`, or its segments joined (:mod:`.chunked`)."""
        ...


def gc_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with the cyclic garbage collector off: the planner allocates a few objects per sample
    (refs, lists) and frees none of them until it returns, so the collector's passes over them would take
    about half the planning time, for nothing."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()

    return paused

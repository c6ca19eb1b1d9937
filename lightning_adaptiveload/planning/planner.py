"""Epoch planning from the index alone: which stream reads which samples, and every batch it yields.

Every rank calls :func:`plan_epoch` with the same index and settings and gets the same
:class:`~.plan.EpochPlan`, without talking to the others. A *stream* is one (rank, worker) pair: the
DataLoader worker ``worker`` of rank ``rank`` (worker 0 when the loader has no workers). This module
checks the arguments, looks the schedule up once by its name (:func:`~.schedules.schedule_for`: a
frozen schedule object, :class:`~.job.EpochSchedule`) and hands it the epoch as a :class:`~.job.PlanJob`.
The bucketed schedules (:mod:`.bucketed`) run these steps in order; each lives in its own module:

1. **Buckets** (:mod:`.inputs`): every distinct latent shape sized once by the batcher's sizing rule.
2. **Assignment** (:mod:`.assign`): in a shard order seeded by ``(seed, epoch)``, shards (or contiguous
   halves of shards: *pieces*) go to streams by a greedy longest-processing-time partition: the
   independent schedule balances ranks on their estimated batch count (sum of 1/B), then each rank's
   workers; the lockstep schedule balances all R * W streams on estimated cost.
3. **Batches.** ``independent`` (:mod:`.independent`): each stream's batch list is the exact simulation
   of bucketing its samples in file order. ``lockstep`` (:mod:`.lockstep`): within each worker index,
   the R streams hold equal counts of every lockstep class and take, at every step, a batch of the same
   class and size on every rank. ``packed`` (:mod:`.packed`; :mod:`.packed_counts` for large epochs)
   replaces steps 2 to 4: every rank takes one pack of samples of any shapes per step, and the packs of a
   step cost the same. Which to use: ``docs/schedules.md``.
4. **Equal steps** (:mod:`.equalise`, :mod:`.reshape`): every rank gets the same step count, by moving
   samples between ranks, splitting and packing batches, and (where nothing else works) empty batches.
   Lockstep with ``lockstep_tail="packed"`` (:mod:`.tail`) instead packs the samples of its unequal
   batches into tail steps of one pack per rank: equal counts by construction, balanced to the end.
5. **Step order** (:mod:`.bucketed`): a rank's step sequence is the DataLoader's round robin over its workers,
   skipping exhausted ones (what torch does for an IterableDataset), so that the plan knows which batch
   every rank takes at every step and hence the step's ``global_tokens``.

Resume (:mod:`.resume`): ``exclude`` leaves out the samples already consumed; :func:`~.resume.
continue_plan` continues a plan for another number of workers. Pure Python and NumPy: no Lightning, no
torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from lightning_adaptiveload.planning.chunked import local_plan
from lightning_adaptiveload.planning.inputs import as_input
from lightning_adaptiveload.planning.job import PlanJob, gc_paused
from lightning_adaptiveload.planning.plan import EpochPlan, Ref
from lightning_adaptiveload.planning.schedules import schedule_for
from lightning_adaptiveload.planning.settings import PlanSettings

if TYPE_CHECKING:  # the batcher module imports torch; the planner needs only its sizing rule
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

__all__ = ["PlanSettings", "plan_epoch"]


@gc_paused
def plan_epoch(
    index_or_shapes: Any,
    world_size: int,
    num_workers: int,
    batcher: DualConstraintBatcher,
    seed: int,
    epoch: int,
    settings: PlanSettings | None = None,
    *,
    exclude: Iterable[Ref] | Mapping[int, Collection[int]] | None = None,
    rank: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EpochPlan:
    """Plan one epoch for every (rank, worker) stream, from the index alone.

    Args:
        index_or_shapes: a ``ShardIndex`` (uses ``.shards[i].latent_shapes``, ``.keys``, ``.path``) or a
            list, one per shard, of lists of latent shapes (C, T, H, W).
        world_size: number of ranks R.
        num_workers: DataLoader workers per rank (0: the main process reads, one stream per rank).
        batcher: batch sizes per shape (its ``"auto"`` cap is resolved here from every shape of the index,
            excluded ones included, so that a resumed epoch keeps the cap). ``partial`` must be ``"emit"``.
        seed: shard-order seed (with ``epoch``).
        epoch: epoch number.
        settings: how the epoch is planned (:class:`~.settings.PlanSettings`: the schedule, the lockstep
            tolerance and tail, the buffer bound, ``underfull``, segments and processes); None: the
            defaults. What each setting does:

            * ``schedule``: ``"independent"``, ``"lockstep"`` or ``"packed"`` (``docs/schedules.md``); or
              ``"auto"``: lockstep, unless its estimated straggler wait exceeds
              :data:`~.plan.AUTO_MAX_WAIT` and ``lockstep_tail="packed"`` (the model runs packs), then
              packed (a mix with no length classes, every sample its own shape);
              ``report["schedule_auto"]`` says which and why.
            * ``max_buffered_samples``: independent: samples a stream may hold decoded (in one worker)
              while its buckets fill; at the bound the fullest pending bucket is emitted early. None:
              ``max(64, 4 * largest batch size)``; must be at least the largest batch size. (Lockstep
              streams read per bucket and hold only the batch being assembled.)
            * ``lockstep_tolerance``: relative cost tolerance that groups buckets into one lockstep class.
            * ``underfull``: what to do when some rank can get no sample at all (fewer samples than ranks,
              e.g. a tiny validation set): ``"error"`` raises :class:`PlanError`; ``"pad"`` gives such
              ranks empty batches (``batch_size == 0``: zero-weight steps, which the token-weighted loss
              and metrics ignore). Where every rank can get a sample, the epoch is always planned; a few
              empty batches are still added where no common count of non-empty batches exists (say 5
              one-sample batches on 2 ranks), counted in ``report["empty_batches"]``.
            * ``lockstep_tail``: lockstep, where the classes stop lining up across ranks (the end of an
              epoch on a mix of many length classes): ``"packed"`` re-plans the samples of every unequal
              batch, from all ranks, into tail steps of one balanced pack per rank (:mod:`.tail`; the
              batches are marked in ``plan.pack_batches``, and the model must run packs:
              ``docs/data_path.md``); ``"bucketed"`` keeps them as unequal bucketed batches.
            * ``chunk_samples``: None: plan the epoch at once. A number: an epoch of more samples is
              planned in segments of about that many samples, one after the other (:mod:`.chunked`: the
              memory of one segment at a time, exactly once and equal steps by construction, each segment
              with its own tail); at most that many samples plan exactly as with None. Ignored by the
              packed schedule, which plans an epoch of more than :data:`~.packed_counts.TEMPLATE_SAMPLES`
              samples on counts (:mod:`.packed_counts`), rank-locally and in bounded memory.
            * ``plan_processes``: a chunked plan's segments are planned this many at a time in spawned
              processes (the same plan; each process holds one segment's working set).
            * ``keep_step_costs``: keep ``plan.step_costs`` (every rank's estimated batch cost per step).
        exclude: sample refs ``(shard_id, sample_id)`` to leave out (already consumed), or
            ``{shard_id: sample_ids}``.
        rank: None (default): the plan holds every stream. A rank: a *rank-local* plan holding only that
            rank's streams, reads and step order (``plan.rank``); its steps, global tokens and report are
            those of the plan of every stream. What a training rank needs; :func:`~.resume.consumed_refs`
            needs a plan of every rank.
        progress: called with (segments planned, segments) after each segment of a chunked plan.

    Returns:
        The :class:`~.plan.EpochPlan`; ``plan.report`` counts what the planning did (its keys: the
        ``report`` attribute of :class:`~.plan.EpochPlan`).

    Raises:
        PlanError: ``underfull="error"`` and some rank can get no sample (fewer samples than ranks).
        ValueError: bad settings, an oversize sample under ``oversize="raise"``, mixed C in a bucket.
    """
    t0 = time.perf_counter()
    settings = PlanSettings() if settings is None else settings
    _check_run(world_size, num_workers, batcher)
    world = int(world_size)
    if rank is not None and not 0 <= int(rank) < world:
        raise ValueError(f"rank must be in 0..{world - 1} for world size {world}, got {rank!r}")
    job = PlanJob(
        data=as_input(index_or_shapes),
        world=world,
        num_workers=int(num_workers),
        batcher=batcher,
        seed=seed,
        epoch=epoch,
        settings=settings,
        exclude=exclude,
        rank=None if rank is None else int(rank),
        progress=progress,
        t0=t0,
    )
    plan = schedule_for(settings).plan(job)  # the one place the schedule's name is looked up
    if not settings.keep_step_costs:
        plan.step_costs = None
    return plan if rank is None or plan.rank is not None else local_plan(plan, int(rank))


def _check_run(world_size: int, num_workers: int, batcher: Any) -> None:
    """What ``plan_epoch`` checks besides its :class:`~.settings.PlanSettings` (checked when built)."""
    if int(world_size) < 1 or int(num_workers) < 0:
        raise ValueError(f"world_size must be >= 1 and num_workers >= 0, got {world_size} and {num_workers}")
    if batcher.partial != "emit":
        raise ValueError(
            "plan_epoch needs a batcher with partial='emit': a planned epoch yields every sample exactly once, so "
            "incomplete buckets are emitted as smaller batches (counted), never carried into the next epoch"
        )

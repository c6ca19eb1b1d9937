"""Epoch planning from the index alone: which stream reads which samples, and every batch it yields.

Every rank calls :func:`plan_epoch` with the same index and settings and gets the same
:class:`~.plan.EpochPlan`, without talking to the others. A *stream* is one (rank, worker) pair: the
DataLoader worker ``worker`` of rank ``rank`` (worker 0 when the loader has no workers). This module
runs the steps in order; each lives in its own module:

1. **Buckets** (:mod:`.inputs`): every distinct latent shape sized once by the batcher's sizing rule.
2. **Assignment** (:mod:`.assign`): in a shard order seeded by ``(seed, epoch)``, shards (or contiguous
   halves of shards: *pieces*) go to streams by a greedy longest-processing-time partition: independent
   mode balances ranks on their estimated batch count (sum of 1/B), then each rank's workers; lockstep
   mode balances all R * W streams on estimated cost.
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
5. **Step order** (here): a rank's step sequence is the DataLoader's round robin over its workers,
   skipping exhausted ones (what torch does for an IterableDataset), so that the plan knows which batch
   every rank takes at every step and hence the step's ``global_tokens``.

Resume (:mod:`.resume`): ``exclude`` leaves out the samples already consumed; :func:`~.resume.
continue_plan` continues a plan for another number of workers. Pure Python and NumPy: no Lightning, no
torch.
"""

from __future__ import annotations

import functools
import gc
import itertools
import operator
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_adaptiveload.planning.assign import assign, exclusions, read_id_arrays, reads_of, shard_pieces
from lightning_adaptiveload.planning.batch_arrays import BatchArrays
from lightning_adaptiveload.planning.chunked import local_plan, plan_segments, segment_count
from lightning_adaptiveload.planning.equalise import Move, apply_moves, equalise
from lightning_adaptiveload.planning.independent import buffer_bound, independent_batches
from lightning_adaptiveload.planning.inputs import Bucket, as_input, bucket_table, distinct_shapes
from lightning_adaptiveload.planning.lockstep import lockstep_batches, lockstep_classes
from lightning_adaptiveload.planning.lockstep_local import LocalLockstep, lockstep_local
from lightning_adaptiveload.planning.plan import (
    AUTO_MAX_WAIT,
    Batch,
    EpochPlan,
    PlanError,
    Read,
    Ref,
    Stream,
    underfull_message,
)
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.planning.tail import packed_tail, tail_reads
from lightning_adaptiveload.stats import balance_summary

if TYPE_CHECKING:  # the batcher module imports torch; the planner needs only its sizing rule
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

__all__ = ["PlanSettings", "plan_epoch"]

# Batch fields read with C-level maps (once per batch of every stream).
_REFS = operator.attrgetter("refs")
_BUCKET = operator.attrgetter("bucket")

# Counters the planning steps update (report keys of the same names, see plan_epoch).
_COUNTERS = (
    "partial_batches",
    "bound_partial_batches",
    "reduced_steps",
    "tail_batches",
    "split_batches",
    "merged_batches",
    "empty_batches",
    "moved_samples",
    "moved_batches",
)


def _gc_paused(fn):
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


@_gc_paused
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
    **legacy: Any,
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
        legacy: deprecated: the settings as flat keywords (``mode=`` for ``schedule``,
            ``max_buffered_samples=``, ...), accepted for one release with a ``DeprecationWarning``; not
            together with ``settings``.

    Returns:
        The :class:`~.plan.EpochPlan`; ``plan.report`` counts what the planning did (its keys: the
        ``report`` attribute of :class:`~.plan.EpochPlan`).

    Raises:
        PlanError: ``underfull="error"`` and some rank can get no sample (fewer samples than ranks).
        ValueError: bad settings, an oversize sample under ``oversize="raise"``, mixed C in a bucket.
    """
    t0 = time.perf_counter()
    settings = _settings(settings, legacy)
    _check_run(world_size, num_workers, batcher)
    if settings.schedule == "auto":
        return _plan_auto(index_or_shapes, world_size, num_workers, batcher, seed, epoch, settings,
                          dict(exclude=exclude, rank=rank, progress=progress))  # fmt: skip
    world, workers = int(world_size), max(1, int(num_workers))
    data = as_input(index_or_shapes)
    if rank is not None and not 0 <= int(rank) < world:
        raise ValueError(f"rank must be in 0..{world - 1} for world size {world}, got {rank!r}")
    mode = settings.schedule
    # The packed schedule plans a large epoch on counts, in bounded memory: it needs no segments.
    groups = (
        1 if mode == "packed" else segment_count(_num_samples(data), settings.chunk_samples, world, workers)
    )
    if groups > 1:
        return plan_segments(
            data, world, num_workers, batcher, seed, epoch, settings,
            exclude=exclude, rank=rank, groups=groups, plan_one=plan_epoch, progress=progress,
        )  # fmt: skip
    plan = _plan_whole(
        data, world, num_workers, batcher, seed, epoch, settings, exclude, t0, None if rank is None else int(rank)
    )  # fmt: skip
    if not settings.keep_step_costs:
        plan.step_costs = None
    return plan if rank is None or plan.rank is not None else local_plan(plan, int(rank))


def _settings(settings: PlanSettings | None, legacy: Mapping[str, Any]) -> PlanSettings:
    """``settings``, or (deprecated) the settings built from ``plan_epoch``'s old flat keywords."""
    if not legacy:
        return PlanSettings() if settings is None else settings
    if settings is not None:
        raise TypeError(
            f"plan_epoch takes its settings either as settings=PlanSettings(...) or as the deprecated flat "
            f"keywords, not both; move {sorted(legacy)} into the PlanSettings"
        )
    warnings.warn(
        "plan_epoch's flat setting keywords (mode=, max_buffered_samples=, lockstep_tolerance=, underfull=, "
        "lockstep_tail=, chunk_samples=, keep_step_costs=, plan_processes=) are deprecated and will be removed "
        "in the next release: pass settings=PlanSettings(schedule=..., ...) "
        "(lightning_adaptiveload.planning.settings)",
        DeprecationWarning,
        stacklevel=4,  # the caller of plan_epoch (through _gc_paused)
    )
    return PlanSettings.from_legacy(legacy)


def _plan_auto(
    data: Any,
    world: int,
    num_workers: int,
    batcher: Any,
    seed: int,
    epoch: int,
    settings: PlanSettings,
    kw: dict[str, Any],
) -> EpochPlan:
    """``schedule="auto"``: the lockstep plan, or the packed one where lockstep's estimated straggler wait
    exceeds :data:`~.plan.AUTO_MAX_WAIT` and packs may run (``lockstep_tail="packed"``)."""
    plan = plan_epoch(
        data, world, num_workers, batcher, seed, epoch, settings.replace(schedule="lockstep"), **kw
    )
    wait = float(plan.report["est_straggler_wait"])
    may_pack = settings.lockstep_tail == "packed" and int(world) > 1
    if wait <= AUTO_MAX_WAIT or not may_pack:
        why = (
            f"lockstep's estimated straggler wait {wait:.2%} is within {AUTO_MAX_WAIT:.0%}"
            if wait <= AUTO_MAX_WAIT
            else f"lockstep's estimated straggler wait is {wait:.2%}, above {AUTO_MAX_WAIT:.0%}, but the model "
            "does not run packs (lockstep_tail='bucketed')"
            if int(world) > 1
            else "one rank: nothing to wait for"
        )
        choice = {"chose": "lockstep", "lockstep_wait": wait, "why": why}
    else:
        lockstep_seconds = plan.report["plan_seconds"]
        del plan
        plan = plan_epoch(
            data, world, num_workers, batcher, seed, epoch, settings.replace(schedule="packed"), **kw
        )
        choice = {
            "chose": "packed",
            "lockstep_wait": wait,
            "why": f"lockstep's estimated straggler wait is {wait:.2%}, above {AUTO_MAX_WAIT:.0%} (a mix "
            "without length classes): packed balances every step",
            "lockstep_plan_seconds": lockstep_seconds,
        }
    plan.report["schedule_auto"] = choice
    return plan


def _num_samples(data: Any) -> int:
    if data.arrays is not None:
        return int(data.arrays.shard_offsets[-1])
    return sum(map(len, data.shapes))


def _plan_whole(
    data: Any,
    world: int,
    num_workers: int,
    batcher: DualConstraintBatcher,
    seed: int,
    epoch: int,
    settings: PlanSettings,
    exclude: Any,
    t0: float,
    keep: int | None = None,
) -> EpochPlan:
    """One plan of the whole epoch (the body of :func:`plan_epoch`): every stream, or with ``keep`` set,
    possibly only that rank's streams (the lockstep schedule with its packed tail plans rank-locally on
    arrays; :mod:`.lockstep_local`). The global parts are the same either way."""
    workers = max(1, int(num_workers))
    mode, lockstep_tail, underfull = settings.schedule, settings.lockstep_tail, settings.underfull
    if mode == "packed":  # one pack of any shapes per rank and step: see planning/packed.py
        from lightning_adaptiveload.planning.packed import plan_packed

        return plan_packed(
            data, world, num_workers, batcher, seed, epoch, exclusions(exclude), underfull, t0, keep,
            settings.keep_step_costs,
        )  # fmt: skip
    batcher.resolve_max_compute(distinct_shapes(data))
    table = bucket_table(data, batcher.sizer, batcher.oversize)
    buckets = table.buckets
    sizes = [bk.batch_size for bk in buckets]
    cost_of = [bk.cost for bk in buckets]
    bound = buffer_bound(settings.max_buffered_samples, sizes, buckets)
    class_of, class_size = lockstep_classes(buckets, settings.lockstep_tolerance)
    # Load of a sample for the assignment. Independent mode: its share of a batch (1/B), so that ranks get
    # near-equal step counts and few batches must be split. Lockstep: its cost (class counts are then
    # equalised by moving samples, which also equalises the steps).
    weight_of = cost_of if mode == "lockstep" else [1.0 / s for s in sizes]
    arrays = (table.bucket_ids, table.shard_offsets) if table.bucket_ids is not None else None
    pieces, n_excluded = shard_pieces(table.bucket_of, seed, epoch, exclude, weight_of, arrays)
    n_samples = sum(len(p.ids) for p in pieces)

    counts = dict.fromkeys(_COUNTERS, 0)
    assignment, n_splits = assign(pieces, world, workers, weight_of, mode == "lockstep")
    reads = {st: reads_of(ps) for st, ps in assignment.items()}
    local: LocalLockstep | None = None
    if mode == "independent":
        columns = ({st: read_id_arrays(ps) for st, ps in assignment.items()}, *_bucket_arrays(table))
        sim = independent_batches(reads, table.bucket_of, sizes, bound, counts, columns)
    elif keep is not None and lockstep_tail == "packed" and world > 1:
        local = lockstep_local(
            assignment, *_bucket_arrays(table), world, workers, class_of, class_size, sizes, counts, keep
        )  # only rank ``keep``'s batches and reads become objects
        sim = local.sim
        reads = {**reads, **local.reads}
    else:
        sim = lockstep_batches(reads, table.bucket_of, world, workers, class_of, class_size, sizes, counts)
    tail = {"steps": 0, "samples": 0, "empty": 0}
    if mode == "lockstep" and lockstep_tail == "packed" and world > 1:
        seq_lens = [bk.seq_len for bk in buckets]
        tail = packed_tail(sim, world, workers, table.bucket_of, seq_lens, batcher, seed, epoch)
    n_reads = None
    if tail["steps"]:
        # The lockstep steps line up per worker index and the tail adds one pack per rank and step: the
        # counts are equal already (the equal-steps pass would merge the packs of an underfull tail).
        counts["empty_batches"] += tail["empty"]
        for st in sim if local is None else [(keep, w) for w in range(workers)]:
            reads[st] = tail_reads(reads[st], sim[st], tail["removed"][st])
        if local is not None:
            n_reads = sum(local.lockstep_reads.values()) + sum(
                len({s for s, _ in bt.refs}) for st, v in sim.items() for bt in v[len(local.equal[st][0]) :]
            )  # the packs follow the equal batches
    elif local is not None:
        # Every worker index's streams hold the same number of equal batches and there is no tail: the
        # step counts are equal, which the equal-steps pass would leave as they are.
        n_reads = sum(local.lockstep_reads.values())
    else:
        _equal_steps(sim, reads, world, workers, mode, sizes, cost_of, counts)
    if local is None:
        samples_per_rank = [sum(_samples(sim[(r, w)]) for w in range(workers)) for r in range(world)]
    else:
        samples_per_rank = [
            sum(int(local.equal[(r, w)][1].sum()) + sum(len(bt.refs) for bt in sim[(r, w)][len(local.equal[(r, w)][0]) :])
                for w in range(workers))
            for r in range(world)
        ]  # fmt: skip
    if underfull == "error" and n_samples and min(samples_per_rank) == 0:
        raise PlanError(underfull_message(world, workers, len(data.shapes), n_samples, samples_per_rank))

    pack_load = _pack_load(table.bucket_of, buckets, batcher)
    if local is None:
        steps = _step_table(
            lambda st: _batch_loads(sim[st], pack_load), {st: len(v) for st, v in sim.items()}, world, workers,
            buckets, class_of,
        )  # fmt: skip
    else:
        steps = _step_table(
            lambda st: _local_loads(local, sim[st], st, pack_load), {st: len(v) for st, v in sim.items()}, world,
            workers, buckets, class_of,
        )  # fmt: skip
    # Rank-local where asked and the schedule allows (independent: every stream's batches are arrays, and
    # only the kept rank's become objects; lockstep: see lockstep_local).
    rank_local = keep is not None and (local is not None or mode == "independent")
    kept = [(keep, w) for w in range(workers)] if rank_local else list(sim)
    counts.update(
        samples=n_samples,
        excluded=n_excluded,
        oversize=table.oversize,
        shard_splits=n_splits,
        max_buffered_samples=bound,
    )
    report = _report(
        epoch, mode, world, num_workers, counts, sim, reads, steps, len(class_size), batcher.max_compute
    )
    if n_reads is not None:
        report["reads"] = n_reads
    report.update(samples_per_rank=samples_per_rank, plan_seconds=0.0)
    if mode == "lockstep":
        report.update(
            lockstep_tail=lockstep_tail,
            packed_tail_steps=steps.pack_steps,
            packed_tail_samples=tail["samples"],
            tail_fill_mean=steps.pack_fill / float(batcher.max_tokens),
        )
    plan = EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=int(seed),
        epoch=int(epoch),
        mode=mode,
        buckets=_bucket_dicts(buckets, class_of),
        streams={st: _refs_lists(sim[st]) for st in kept},
        batch_buckets={st: _bucket_list(sim[st]) for st in kept},
        batch_steps={st: steps.batch_steps[st].tolist() for st in kept},
        reads={st: reads[st] for st in kept},
        step_order=[o if r == keep else [] for r, o in enumerate(steps.step_order)]
        if rank_local
        else steps.step_order,
        steps=steps.steps,
        global_tokens=[int(x) for x in steps.global_tokens],
        report=report,
        pack_batches={st: [bt.pack for bt in sim[st]] for st in kept} if tail["steps"] else {},
        step_costs=steps.costs,
        rank=keep if rank_local else None,
    )
    report["plan_seconds"] = time.perf_counter() - t0
    return plan


def _report(
    epoch: int,
    mode: str,
    world: int,
    num_workers: int,
    counts: dict[str, int],
    sim: dict[Stream, list[Batch]],
    reads: dict[Stream, list[Read]],
    steps: _Steps,
    n_classes: int,
    max_compute: float | None,
) -> dict[str, Any]:
    """The plan's report (keys in :func:`plan_epoch`), but ``samples_per_rank`` and ``plan_seconds``."""
    return {
        "epoch": int(epoch),
        "mode": mode,
        "world_size": world,
        "num_workers": int(num_workers),
        "samples": counts["samples"],
        "batches": sum(len(v) for v in sim.values()),
        "steps": steps.steps,
        "tokens": int(sum(steps.global_tokens)),
        "padding_tokens": 0,
        "skipped": {"oversize": counts["oversize"]} if counts["oversize"] else {},
        "excluded": counts["excluded"],
        "partial_batches": counts["partial_batches"],
        "bound_partial_batches": counts["bound_partial_batches"],
        "split_batches": counts["split_batches"],
        "merged_batches": counts["merged_batches"],
        "empty_batches": counts["empty_batches"],
        "reduced_steps": counts["reduced_steps"],
        "lockstep_tail_steps": steps.unequal if mode == "lockstep" else 0,
        "unequal_steps": steps.unequal,
        "lockstep_classes": n_classes,
        "moved_samples": counts["moved_samples"],
        "moved_batches": counts["moved_batches"],
        "shard_splits": counts["shard_splits"],
        "reads": sum(len(v) for v in reads.values()),
        "max_buffered_samples": counts["max_buffered_samples"],
        "max_compute": max_compute,
        "est_compute_cv": steps.est_cv,
        "est_straggler_wait": steps.est_wait,
        "est_wait_share": steps.est_wait,  # the old name of est_straggler_wait, kept for scripts
    }


def _check_run(world_size: int, num_workers: int, batcher: Any) -> None:
    """What ``plan_epoch`` checks besides its :class:`~.settings.PlanSettings` (checked when built)."""
    if int(world_size) < 1 or int(num_workers) < 0:
        raise ValueError(f"world_size must be >= 1 and num_workers >= 0, got {world_size} and {num_workers}")
    if batcher.partial != "emit":
        raise ValueError(
            "plan_epoch needs a batcher with partial='emit': a planned epoch yields every sample exactly once, so "
            "incomplete buckets are emitted as smaller batches (counted), never carried into the next epoch"
        )


def _equal_steps(
    sim: dict[Stream, list[Batch]],
    reads: dict[Stream, list[Read]],
    world: int,
    workers: int,
    mode: str,
    sizes: list[int],
    cost_of: list[float],
    counts: dict[str, int],
) -> None:
    """Equalise the step counts (:func:`~.equalise.equalise`) and make the reads follow the moved samples."""
    moves: list[Move] = []
    # Empty batches take the cheapest bucket's shape (they carry no sample; the shape only types them).
    pad_bucket = min(range(len(cost_of)), key=lambda b: (cost_of[b], b)) if cost_of else None
    deficit = equalise(sim, world, workers, mode, sizes, counts, moves, pad_bucket)
    if deficit is not None:
        raise RuntimeError(
            f"plan_epoch could not equalise the step counts at world size {world} ({deficit['short']}); "
            "this is a planner bug: report it with the seed, epoch and world size"
        )
    apply_moves(reads, moves, sim)


def _round_robin(lengths: list[int]) -> list[tuple[int, int]]:
    """The DataLoader's order over workers: batch j of every worker in turn, skipping exhausted ones."""
    return _round_robin_steps(lengths)[0]


def _round_robin_steps(lengths: list[int]) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
    """:func:`_round_robin` and, per worker, the step of each of its batches."""
    if not lengths or max(lengths) == 0:
        return [], [np.zeros(n, dtype=np.int64) for n in lengths]
    n_w = len(lengths)
    w = np.concatenate([np.full(n, i, dtype=np.int64) for i, n in enumerate(lengths)])
    j = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    order = np.argsort(j * n_w + w, kind="stable")
    step = np.empty(len(order), dtype=np.int64)
    step[order] = np.arange(len(order), dtype=np.int64)
    ends = np.cumsum(lengths)
    return list(zip(w[order].tolist(), j[order].tolist())), np.split(step, ends[:-1])


@dataclass
class _Steps:
    """The step order of every rank and what the cost model says of each step."""

    step_order: list[list[tuple[int, int]]]
    steps: int
    batch_steps: dict[Stream, list[int]]
    global_tokens: list[int]
    unequal: int  # steps whose batches differ in lockstep class or size across ranks (packs aside)
    est_cv: float
    est_wait: float
    pack_steps: int = 0  # steps at which every rank takes a pack (lockstep's packed tail)
    pack_fill: float = 0.0  # mean tokens of those packs
    costs: np.ndarray | None = None  # (world, steps): every rank's estimated batch cost at every step


def _pack_load(
    bucket_of: list[list[int]], buckets: list[Bucket], batcher: Any
) -> Callable[[Batch], tuple[int, float]]:
    """A pack's tokens and estimated cost (``c0 + sum cost(S_i)``, the cost model's pack cost)."""
    seq_len = [bk.seq_len for bk in buckets]

    def load(bt: Batch) -> tuple[int, float]:
        toks = [seq_len[bucket_of[s][i]] for s, i in bt.refs]
        return sum(toks), (batcher.cost_model.pack_cost(toks) if toks else 0.0)

    return load


def _samples(stream: list[Batch] | BatchArrays) -> int:
    if isinstance(stream, BatchArrays):
        return int(stream.n.sum())
    return sum(map(len, map(_REFS, stream)))


def _refs_lists(stream: list[Batch] | BatchArrays) -> list[list[Ref]]:
    return stream.refs_lists() if isinstance(stream, BatchArrays) else list(map(_REFS, stream))


def _bucket_list(stream: list[Batch] | BatchArrays) -> list[int]:
    return stream.bucket.tolist() if isinstance(stream, BatchArrays) else list(map(_BUCKET, stream))


def _batch_loads(
    batches: list[Batch] | BatchArrays, pack_load: Callable[[Batch], tuple[int, float]] | None
) -> tuple[Any, Any, list[tuple[int, int, float]]]:
    """A stream's batches as (bucket ids, sample counts, [(position, tokens, cost) of each pack])."""
    if isinstance(batches, BatchArrays):
        return batches.bucket, batches.n, []  # independent batches are never packs
    packs = []
    if pack_load is not None:
        packs = [(j, *pack_load(bt)) for j, bt in enumerate(batches) if bt.pack]
    return list(map(_BUCKET, batches)), list(map(len, map(_REFS, batches))), packs


def _step_table(
    loads: Callable[[Stream], tuple[Any, Any, list[tuple[int, int, float]]]],
    lengths: Mapping[Stream, int],
    world: int,
    workers: int,
    buckets: list[Bucket],
    class_of: list[int],
) -> _Steps:
    """Each rank's round robin over its workers, the step of every batch, and per step the tokens over all
    ranks and the balance of the estimated batch costs. ``loads(stream)``: its batches as
    :func:`_batch_loads` gives them; ``lengths``: every stream's batch count."""
    seen: dict[tuple[int, ...], tuple[list[tuple[int, int]], list[np.ndarray]]] = {}
    orders = []
    for r in range(world):  # ranks with the same batch counts per worker share one order (lockstep: all)
        key = tuple(lengths[(r, w)] for w in range(workers))
        if key not in seen:
            seen[key] = _round_robin_steps(list(key))
        orders.append(seen[key])
    step_order = [o[0] for o in orders]
    steps = len(step_order[0]) if step_order else 0
    batch_steps: dict[Stream, list[int]] = {}
    seq_len = np.array([bk.seq_len for bk in buckets] + [0], dtype=np.int64)
    bucket_cost = np.array([bk.cost for bk in buckets] + [0.0], dtype=np.float64)
    cls = np.array(class_of + [-1], dtype=np.int64)
    step_bucket = np.full((world, steps), -1, dtype=np.int64)
    step_n = np.zeros((world, steps), dtype=np.int64)
    is_pack = np.zeros((world, steps), dtype=bool)
    pack_tokens = np.zeros((world, steps), dtype=np.int64)
    pack_cost = np.zeros((world, steps), dtype=np.float64)
    for r in range(world):
        for w in range(workers):
            idx = orders[r][1][w]
            batch_steps[(r, w)] = idx
            if lengths[(r, w)]:
                bks, ns, packs = loads((r, w))
                step_bucket[r, idx] = bks
                step_n[r, idx] = ns
                for j, tok, cost in packs:
                    k = idx[j]
                    is_pack[r, k] = True
                    pack_tokens[r, k], pack_cost[r, k] = tok, cost
    tokens = np.where(is_pack, pack_tokens, step_n * seq_len[step_bucket])
    global_tokens = tokens.sum(axis=0).tolist() if steps else []
    costs = np.where(is_pack, pack_cost, step_n * bucket_cost[step_bucket])
    packed_steps = is_pack.all(axis=0) if steps else np.zeros(0, dtype=bool)
    n_pack = int(packed_steps.sum())
    pack_fill = float(tokens[:, packed_steps].mean()) if n_pack else 0.0
    if steps:
        sig_same = (cls[step_bucket] == cls[step_bucket[0]]).all(axis=0) & (step_n == step_n[0]).all(axis=0)
        unequal = int((~(sig_same | packed_steps)).sum())
        figures = balance_summary(costs.T)  # the cost model's estimate of the step times
        est_cv, est_wait = figures["cv_mean"], figures["straggler_wait"]
    else:
        unequal, est_cv, est_wait = 0, 0.0, 0.0
    return _Steps(
        step_order, steps, batch_steps, global_tokens, unequal, est_cv, est_wait, n_pack, pack_fill, costs
    )


def _bucket_arrays(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's bucket id as one array and each shard's first position in it."""
    if table.bucket_ids is not None:
        return table.bucket_ids, table.shard_offsets
    lens = np.fromiter(map(len, table.bucket_of), dtype=np.int64, count=len(table.bucket_of))
    ids = np.fromiter(itertools.chain.from_iterable(table.bucket_of), dtype=np.int64, count=int(lens.sum()))
    return ids, np.r_[0, np.cumsum(lens)].astype(np.int64)


def _local_loads(
    local: LocalLockstep, batches: list[Batch], st: Stream, pack_load: Callable[[Batch], tuple[int, float]]
) -> tuple[Any, Any, list[tuple[int, int, float]]]:
    """:func:`_batch_loads` of a stream of a rank-local lockstep plan: its equal batches from the arrays
    (another rank's are placeholders), then its tail packs."""
    eq_b, eq_k = local.equal[st]
    n_eq = len(eq_b)
    tail = batches[n_eq:]
    bks = np.concatenate([eq_b, np.fromiter(map(_BUCKET, tail), dtype=np.int64, count=len(tail))])
    ns = np.concatenate([eq_k, np.fromiter(map(len, map(_REFS, tail)), dtype=np.int64, count=len(tail))])
    return bks, ns, [(n_eq + j, *pack_load(bt)) for j, bt in enumerate(tail)]


def _bucket_dicts(buckets: list[Bucket], class_of: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "shape": bk.shape,
            "seq_len": bk.seq_len,
            "batch_size": bk.batch_size,
            "cost": bk.cost,
            "lockstep_class": class_of[b],
        }
        for b, bk in enumerate(buckets)
    ]

"""Epochs too large to plan at once: the shards split into *segments*, each planned by the exact planner,
the epoch their plans one after the other; and *rank-local* plans that keep only one rank's streams.

A plan of every stream costs a few Python objects per sample on every rank: at 10M samples about 5 GB
and 23 s. Planned in segments of ``chunk_samples`` samples, a rank holds one segment's working set at a
time plus what it keeps: its own streams (``rank``) and, for the whole epoch, per step only the global
token count and the balance figures of the step's costs.

Guarantees, by construction:

* **exactly once**: the segments partition the shards (split in an order seeded by ``(seed, epoch)``);
  every segment plan holds each of its samples once;
* **equal steps, aligned**: every segment gives every rank the same step count. A segment's step k is the
  epoch's step ``offset + k`` on every rank, so lockstep steps and the packs of one step stay together:
  the segment's batches are dealt to the DataLoader workers so that the round robin over the workers takes
  them in exactly that order (a segment whose own order is the plain round robin keeps each worker's batches
  and reads together, under rotated worker ids);
* **deterministic, identical on every rank**: the split, and each segment's seed, derive from
  ``(seed, epoch)``; the global figures (``steps``, ``global_tokens``, the report) do not depend on
  ``rank``.

Cost: every segment ends with its own end-of-epoch tail (the lockstep tail, the equal-steps repair), so a
chunked epoch has a few more unequal or reshaped steps than one plan of everything would.

Pure Python and NumPy (no Lightning, no torch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.assign import exclusions
from lightning_adaptiveload.planning.inputs import Bucket, PlanInput, as_input
from lightning_adaptiveload.planning.job import EpochSchedule, PlanJob, gc_paused
from lightning_adaptiveload.planning.lockstep import lockstep_classes
from lightning_adaptiveload.planning.plan import EpochPlan, PlanError, Ref, Stream, underfull_message
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.stats import balance_rows, summarize_steps

__all__ = ["local_plan", "plan_segments", "segment_count", "split_shards"]

# A segment holds at least this many samples per stream, so that no rank of a segment goes empty where the
# whole epoch would feed it.
_MIN_PER_STREAM = 16

# Report keys merged other than by summing (ints) or step-weighted averaging (floats).
_SAME = ("epoch", "schedule", "world_size", "num_workers", "lockstep_tail", "max_compute")
_MAX = ("max_buffered_samples",)
_MIN = ("fill_min",)
_RECOMPUTED = ("est_compute_cv", "est_straggler_wait", "est_wait_share", "lockstep_classes", "plan_seconds")


def segment_count(n_samples: int, chunk_samples: int | None, world: int, workers: int) -> int:
    """How many segments an epoch of ``n_samples`` is planned in: ``ceil(n / chunk_samples)``, fewer where a
    segment would hold under 16 samples per stream; 1 (one plan of everything) for ``chunk_samples=None``."""
    if chunk_samples is None or n_samples <= 0:
        return 1
    want = -(-int(n_samples) // int(chunk_samples))
    most = max(1, int(n_samples) // (_MIN_PER_STREAM * world * max(1, workers)))
    return max(1, min(want, most))


def split_shards(counts: np.ndarray, groups: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The shards of each segment (ascending ids): consecutive runs of a seeded shard order, each holding
    about ``sum(counts) / groups`` samples."""
    m = len(counts)
    order = np.random.default_rng([int(seed), int(epoch), 0x5E6]).permutation(m)
    c = np.asarray(counts, dtype=np.int64)[order]
    total = int(c.sum())
    start = np.cumsum(c) - c  # the first sample of each shard in that order
    group = (start * groups) // max(total, 1)
    return [np.sort(order[group == g]) for g in range(groups)]


def _segment_seed(seed: int, epoch: int, g: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(epoch), int(g)]).generate_state(1)[0])


class _SubIndex:
    """The arrays of a compact index restricted to some shards (renumbered 0..n-1), as the planner reads
    them: ``shape_table``, ``shape_ids``, ``shard_offsets``, ``paths``, ``shard_keys``."""

    def __init__(self, index: Any, shards: np.ndarray) -> None:
        off = np.asarray(index.shard_offsets)
        lo, hi = off[shards], off[shards + 1]
        ids = np.concatenate([index.shape_ids[a:b] for a, b in zip(lo.tolist(), hi.tolist())])
        # Only the shapes these shards use, numbered in order of first use as in any compact index (the
        # planner sizes every shape of the table it is given and relies on that numbering).
        used, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")
        renumber = np.empty(len(used), dtype=np.int64)
        renumber[by_first] = np.arange(len(used))
        self.shape_table = np.asarray(index.shape_table)[used[by_first]]
        self.shape_ids = renumber[inverse].astype(ids.dtype)
        self.shard_offsets = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
        paths = index.paths
        self.paths = [paths[s] for s in shards.tolist()]
        self._index, self._shards = index, shards

    def shard_keys(self, shard: int) -> list[str]:
        return self._index.shard_keys(int(self._shards[shard]))


def _sub_input(data: PlanInput, shards: np.ndarray) -> Any:
    if data.arrays is not None:
        return _SubIndex(data.arrays, shards)
    ids = shards.tolist()
    return PlanInput(
        paths=[data.paths[s] for s in ids],
        keys=[data.keys[s] for s in ids],
        shapes=[data.shapes[s] for s in ids],
    )


def _shard_counts(data: PlanInput) -> np.ndarray:
    if data.arrays is not None:
        return np.diff(np.asarray(data.arrays.shard_offsets)).astype(np.int64)
    return np.fromiter((len(s) for s in data.shapes), dtype=np.int64, count=len(data.shapes))


@dataclass
class _Kept:
    """What the epoch keeps of its segments for the streams it returns."""

    streams: dict[Stream, list[list[Ref]]]
    buckets: dict[Stream, list[int]]
    steps: dict[Stream, list[int]]
    reads: dict[Stream, list[tuple[int, list[int]]]]
    packs: dict[Stream, list[bool]]


def plan_segments(job: PlanJob, schedule: EpochSchedule, groups: int) -> EpochPlan:
    """Plan ``job``'s epoch in ``groups`` segments, each with ``schedule.plan_whole``, and join them.

    Args:
        job: the epoch (:class:`~.job.PlanJob`: the planner's input of all shards, the ranks, workers,
            batcher, seed and epoch; ``exclude``: refs or ``{shard_id: sample_ids}`` to leave out;
            ``rank``: keep only this rank's streams (None: every stream); ``progress``: called with
            (segments planned, groups) after each segment). Every segment is planned with
            ``job.settings`` but ``underfull="pad"`` (the whole epoch is checked against
            ``job.settings.underfull``), at once (no ``chunk_samples``), here, and keeping its step costs;
            ``settings.plan_processes`` segments are planned at a time in spawned processes (1: here, one
            after the other; the plan is the same, each process holds one segment's working set and its
            own imports).
        schedule: the bucketed schedule (:class:`~.schedules.Independent` or
            :class:`~.schedules.Lockstep`) that plans each segment; a frozen dataclass, sent whole to the
            processes.
        groups: segments (>= 2).
    """
    data, world, num_workers, batcher = job.data, job.world, job.num_workers, job.batcher
    seed, epoch, settings, exclude, rank = job.seed, job.epoch, job.settings, job.exclude, job.rank
    progress = job.progress
    t0 = time.perf_counter()
    workers = max(1, int(num_workers))
    ranks = range(world) if rank is None else [int(rank)]
    seg_batcher = _fixed_cap_batcher(batcher, data)
    excl = exclusions(exclude)
    kept = _Kept({}, {}, {}, {}, {})
    for st in ((r, w) for r in ranks for w in range(workers)):
        for part in (kept.streams, kept.buckets, kept.steps, kept.reads, kept.packs):
            part[st] = []
    global_id: dict[tuple[int, ...], int] = {}
    bucket_dicts: list[dict[str, Any]] = []
    tokens: list[int] = []
    balance: list[np.ndarray] = []  # per segment (4, steps): cv, imbalance, wait, slowest cost
    reports: list[dict[str, Any]] = []
    offset = 0
    parts = split_shards(_shard_counts(data), groups, seed, epoch)
    tasks = [
        (
            _segment_seed(seed, epoch, g),
            shards,
            {k: excl[s] for k, s in enumerate(shards.tolist()) if s in excl},
        )
        for g, shards in enumerate(parts)
    ]
    segment = settings.replace(underfull="pad", chunk_samples=None, plan_processes=1, keep_step_costs=True)
    seg_job = _Job(world, int(num_workers), seg_batcher, int(epoch), rank, schedule, segment)
    for g, (seg, rows) in enumerate(_planned(data, tasks, seg_job, settings.plan_processes)):
        shards = parts[g]
        to_global = [_global_bucket(b, global_id, bucket_dicts) for b in seg.buckets]
        _keep(seg, kept, ranks, workers, offset, shards.tolist(), to_global)
        tokens.extend(seg.global_tokens)
        if rows is not None:
            balance.append(rows)
        reports.append(seg.report)
        offset += seg.steps
        del seg
        if progress is not None:
            progress(g + 1, groups)
    _global_classes(bucket_dicts, schedule.tolerance)  # type: ignore[attr-defined]
    report = _merge_reports(reports, balance, len({d["lockstep_class"] for d in bucket_dicts}))
    report.update(segments=groups, segment_steps=[int(r["steps"]) for r in reports])
    per_rank = report.get("samples_per_rank", [])
    if settings.underfull == "error" and report["samples"] and per_rank and min(per_rank) == 0:
        raise PlanError(underfull_message(world, workers, len(data.shapes), report["samples"], per_rank))
    plan = EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=int(seed),
        epoch=int(epoch),
        schedule=schedule.name,
        buckets=bucket_dicts,
        streams=kept.streams,
        batch_buckets=kept.buckets,
        batch_steps=kept.steps,
        reads=kept.reads,
        step_order=[
            [(k % workers, k // workers) for k in range(offset)] if r in ranks else [] for r in range(world)
        ],
        steps=offset,
        global_tokens=tokens,
        report=report,
        pack_batches=kept.packs if any(any(v) for v in kept.packs.values()) else {},
        rank=rank,
    )
    report["plan_seconds"] = time.perf_counter() - t0
    return plan


@dataclass
class _Job:
    """What every segment is planned with (sent once to each process of a pool)."""

    world: int
    num_workers: int
    batcher: Any
    epoch: int
    rank: int | None
    schedule: EpochSchedule  # plans every segment (plan_whole)
    settings: PlanSettings  # every segment's


@gc_paused
def _plan_task(data: PlanInput, task: tuple[int, np.ndarray, dict], job: _Job) -> tuple[EpochPlan, Any]:
    """One segment's plan (only ``job.rank``'s streams kept, if set) and its steps' balance rows (4, steps):
    CV, imbalance and wait of the ranks' costs, and the slowest rank's cost."""
    seed, shards, excl = task
    seg_job = PlanJob(
        data=as_input(_sub_input(data, shards)),
        world=job.world,
        num_workers=job.num_workers,
        batcher=job.batcher,
        seed=seed,
        epoch=job.epoch,
        settings=job.settings,
        exclude=excl or None,
        rank=job.rank,
        t0=time.perf_counter(),
    )
    seg = job.schedule.plan_whole(seg_job)
    if job.rank is not None and seg.rank is None:
        seg = local_plan(seg, job.rank)
    rows = None
    if seg.steps:
        costs = np.asarray(seg.step_costs, dtype=np.float64).T  # (steps, world)
        rows = np.stack([*balance_rows(costs), costs.max(axis=1)])
    seg.step_costs = None
    return seg, rows


_POOL: dict[str, Any] = {}


def _pool_init(data: Any, job: _Job) -> None:
    _POOL.update(data=as_input(data), job=job)


def _pool_task(task: tuple[int, np.ndarray, dict]) -> tuple[EpochPlan, Any]:
    return _plan_task(_POOL["data"], task, _POOL["job"])


def _planned(data: PlanInput, tasks: list, job: _Job, processes: int) -> Iterator[tuple[EpochPlan, Any]]:
    """The segments' plans in order: here, or from a pool of spawned processes (spawn: safe beside CUDA
    and threads; each process gets the index once: a loaded binary index maps its file again)."""
    if int(processes) <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _plan_task(data, task, job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    payload = data.arrays if data.arrays is not None else data
    with ProcessPoolExecutor(
        max_workers=min(int(processes), len(tasks)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_pool_init,
        initargs=(payload, job),
    ) as pool:
        yield from pool.map(_pool_task, tasks)


def local_plan(plan: EpochPlan, rank: int) -> EpochPlan:
    """``plan`` with only rank ``rank``'s streams (its global parts unchanged)."""
    keep = [(rank, w) for w in range(plan.workers_per_rank)]
    plan.streams = {st: plan.streams[st] for st in keep}
    plan.batch_buckets = {st: plan.batch_buckets[st] for st in keep}
    plan.batch_steps = {st: plan.batch_steps[st] for st in keep}
    plan.reads = {st: plan.reads[st] for st in keep}
    if plan.pack_batches:
        plan.pack_batches = {st: plan.pack_batches[st] for st in keep}
    plan.step_order = [order if r == rank else [] for r, order in enumerate(plan.step_order)]
    plan.rank = int(rank)
    return plan


def _fixed_cap_batcher(batcher: Any, data: PlanInput) -> Any:
    """A batcher whose ``"auto"`` compute cap is fixed from every shape of the epoch, so that every segment
    sizes its batches with the cap a plan of everything would use (a segment holds only some shapes)."""
    from lightning_adaptiveload.planning.inputs import distinct_shapes

    cap = batcher.resolve_max_compute(distinct_shapes(data))
    if cap is None or batcher.sizing != "dual":
        return batcher
    return type(batcher).from_config({**batcher.config(), "max_compute": float(cap)})


def _global_bucket(d: dict[str, Any], global_id: dict[tuple[int, ...], int], table: list[dict]) -> int:
    shape = tuple(int(x) for x in d["shape"])
    b = global_id.get(shape)
    if b is None:
        b = global_id[shape] = len(table)
        table.append({**d, "shape": d["shape"]})
    return b


def _global_classes(table: list[dict[str, Any]], tolerance: float) -> None:
    """The lockstep classes of the epoch's buckets (each segment numbered the classes of its own buckets)."""
    buckets = [Bucket(tuple(d["shape"]), d["seq_len"], d["batch_size"], d["cost"]) for d in table]
    class_of, _ = lockstep_classes(buckets, tolerance)
    for d, c in zip(table, class_of):
        d["lockstep_class"] = c


def _keep(
    seg: EpochPlan,
    kept: _Kept,
    ranks: Any,
    workers: int,
    offset: int,
    shard_ids: list[int],
    to_global: list[int],
) -> None:
    """Append the segment's batches of the kept ranks so that the epoch's step ``offset + k`` is the
    segment's step k, and map its shard and bucket ids to the epoch's."""
    for r in ranks:
        order = seg.step_order[r]
        lengths = [len(seg.streams[(r, w)]) for w in range(workers)]
        round_robin = lengths == [len(range(w, seg.steps, workers)) for w in range(workers)]
        if round_robin:
            # The segment's worker w takes steps w, w + W, ...: under the rotated id (w + offset) % W the
            # epoch's round robin takes them at offset + k, with its reads unchanged.
            for w in range(workers):
                st, to = (r, w), (r, (w + offset) % workers)
                kept.streams[to].extend(_refs(b, shard_ids) for b in seg.streams[st])
                kept.buckets[to].extend(to_global[b] for b in seg.batch_buckets[st])
                kept.steps[to].extend(offset + k for k in seg.batch_steps[st])
                kept.reads[to].extend((shard_ids[s], ids) for s, ids in seg.reads[st])
                kept.packs[to].extend(seg.is_pack(st, j) for j in range(len(seg.streams[st])))
            continue
        # Another order (workers of unequal lengths): deal the segment's steps to the workers afresh, each
        # stream reading what each batch needs when the batch comes (see _batch_reads).
        streams = [seg.streams[(r, w)] for w in range(workers)]
        buckets = [seg.batch_buckets[(r, w)] for w in range(workers)]
        packs = [[seg.is_pack((r, w), j) for j in range(len(streams[w]))] for w in range(workers)]
        dealt: list[list[list[Ref]]] = [[] for _ in range(workers)]
        to = [((r, w), kept.streams[(r, w)], kept.buckets[(r, w)], kept.steps[(r, w)], kept.packs[(r, w)])
              for w in range(workers)]  # fmt: skip
        for k, (w_old, j) in enumerate(order):
            w = (offset + k) % workers
            batch = [(shard_ids[s], i) for s, i in streams[w_old][j]]
            dealt[w].append(batch)
            _, out_refs, out_buckets, out_steps, out_packs = to[w]
            out_refs.append(batch)
            out_buckets.append(to_global[buckets[w_old][j]])
            out_steps.append(offset + k)
            out_packs.append(packs[w_old][j])
        for w, batches in enumerate(dealt):
            kept.reads[(r, w)].extend(_batch_reads(batches))


def _batch_reads(batches: list[list[Ref]]) -> list[tuple[int, list[int]]]:
    """Reads that follow the batches: per batch one read per shard it takes samples from (ids ascending),
    continuing the previous read where that is of the same shard and ends before these ids. A stream then
    reads ahead at most within one batch; one read per shard for the whole stream (as a resumed plan has)
    could hold a sample from the first batch that needs its shard to the last."""
    out: list[tuple[int, list[int]]] = []
    for batch in batches:
        runs: list[tuple[int, list[int]]] = []
        for shard, i in sorted(batch):
            if runs and runs[-1][0] == shard:
                runs[-1][1].append(i)
            else:
                runs.append((shard, [i]))
        for shard, ids in runs:
            if out and out[-1][0] == shard and out[-1][1][-1] < ids[0]:
                out[-1][1].extend(ids)
            else:
                out.append((shard, ids))
    return out


def _refs(batch: list[Ref], shard_ids: list[int]) -> list[Ref]:
    return [(shard_ids[s], i) for s, i in batch]


def _merge_reports(
    reports: list[dict[str, Any]], balance: list[np.ndarray], n_classes: int
) -> dict[str, Any]:
    """One report for the epoch: counters summed, per-rank lists added, the balance figures computed over
    every step of the epoch (not averaged over segments), other figures weighted by the segments' steps."""
    first = reports[0]
    steps = np.array([max(int(r["steps"]), 0) for r in reports], dtype=np.float64)
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in reports]
        if key in _SAME or key in _RECOMPUTED:
            out[key] = value
        elif key in _MAX:
            out[key] = max(values)
        elif key in _MIN:
            out[key] = min(values)
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            out[key] = value
        elif isinstance(value, int):
            out[key] = int(sum(values))
        elif isinstance(value, float):
            weight = (
                steps
                if key != "tail_fill_mean"
                else np.array([r.get("packed_tail_steps", 0) for r in reports])
            )
            out[key] = (
                float(np.average(values, weights=weight)) if weight.sum() > 0 else float(np.mean(values))
            )
        elif isinstance(value, list):
            out[key] = [int(sum(x)) for x in zip(*values)]
        elif isinstance(value, Mapping):
            merged: dict[str, int] = {}
            for v in values:
                for k2, n in v.items():
                    merged[k2] = merged.get(k2, 0) + int(n)
            out[key] = merged
        else:
            out[key] = value
    if balance:
        c, i, w, t = np.concatenate(balance, axis=1)
        figures = summarize_steps(c, i, w, t)
        est_cv, est_wait = figures["cv_mean"], figures["straggler_wait"]
    else:
        est_cv, est_wait = 0.0, 0.0
    out.update(est_compute_cv=est_cv, est_straggler_wait=est_wait, est_wait_share=est_wait)
    if "lockstep_classes" in out:
        out["lockstep_classes"] = n_classes
    return out

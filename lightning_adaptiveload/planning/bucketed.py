"""The bucketed schedules' plan of a whole epoch: ``independent`` and ``lockstep`` (steps 1 to 5 of
:mod:`.planner`), one plan of every stream or, where the lockstep schedule allows, of one rank's.

Called by the schedule objects (:class:`~.schedules.Independent`, :class:`~.schedules.Lockstep`) for an
epoch, or for each segment of a chunked epoch (:mod:`.chunked`). What differs between the two schedules
comes from the schedule object (its ``lockstep`` flag, ``tail`` and ``tolerance``), never from its name.

Pure Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.assign import StreamReads, assign, read_arrays, reads_of, shard_pieces
from lightning_adaptiveload.planning.batch_arrays import BatchArrays
from lightning_adaptiveload.planning.equalise import Move, apply_moves, equalise
from lightning_adaptiveload.planning.independent import buffer_bound, independent_batches
from lightning_adaptiveload.planning.inputs import Bucket, bucket_table, distinct_shapes
from lightning_adaptiveload.planning.job import PlanJob
from lightning_adaptiveload.planning.lockstep import lockstep_batches, lockstep_classes
from lightning_adaptiveload.planning.lockstep_local import LocalLockstep, lockstep_local
from lightning_adaptiveload.planning.plan import (
    Batch,
    EpochPlan,
    PlanError,
    Read,
    Ref,
    Stream,
    underfull_message,
)
from lightning_adaptiveload.planning.tail import packed_tail, tail_reads
from lightning_adaptiveload.stats import balance_summary

__all__ = ["plan_bucketed"]

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


def plan_bucketed(job: PlanJob, schedule: Any) -> EpochPlan:
    """One plan of all of ``job.data`` with a bucketed schedule: every stream, or with ``job.rank`` set,
    possibly only that rank's streams (the lockstep schedule with its packed tail plans rank-locally on
    arrays; :mod:`.lockstep_local`). The global parts are the same either way.

    Args:
        job: what to plan (:class:`~.job.PlanJob`).
        schedule: the :class:`~.schedules.Independent` or :class:`~.schedules.Lockstep` schedule: its
            ``name`` (the plan's ``schedule``), ``lockstep`` (step-aligned batches of one class on every rank),
            ``tail`` and ``packs_tail`` (lockstep's end of epoch) and ``tolerance`` (groups buckets into lockstep classes; an
            independent plan reports the classes too).
    """
    data, world, num_workers, batcher = job.data, job.world, job.num_workers, job.batcher
    seed, epoch, exclude, t0, keep = job.seed, job.epoch, job.exclude, job.t0, job.rank
    settings = job.settings
    workers = job.workers
    name, lockstep, underfull = schedule.name, bool(schedule.lockstep), settings.underfull
    lockstep_tail = schedule.tail
    packed_end = lockstep and schedule.packs_tail and world > 1  # lockstep's packed tail
    batcher.resolve_max_compute(distinct_shapes(data))
    table = bucket_table(data, batcher.sizer, batcher.oversize)
    buckets = table.buckets
    sizes = [bk.batch_size for bk in buckets]
    cost_of = [bk.cost for bk in buckets]
    bound = buffer_bound(settings.max_buffered_samples, sizes, buckets)
    class_of, class_size = lockstep_classes(buckets, schedule.tolerance)
    # Load of a sample for the assignment. Independent schedule: its share of a batch (1/B), so that ranks get
    # near-equal step counts and few batches must be split. Lockstep: its cost (class counts are then
    # equalised by moving samples, which also equalises the steps).
    weight_of = cost_of if lockstep else [1.0 / s for s in sizes]
    arrays = (table.bucket_ids, table.shard_offsets) if table.bucket_ids is not None else None
    pieces, n_excluded = shard_pieces(table.bucket_of, seed, epoch, exclude, weight_of, arrays)
    n_samples = sum(len(p.ids) for p in pieces)

    counts = dict.fromkeys(_COUNTERS, 0)
    assignment, n_splits = assign(pieces, world, workers, weight_of, lockstep)
    rank_local_lockstep = lockstep and keep is not None and packed_end
    # The rank-local lockstep plan makes its own rank's reads (and counts every rank's): no per-stream lists.
    # Independent: the lists of a stream are made where it is kept or edited (StreamReads).
    reads: Any
    if rank_local_lockstep:
        reads = {}
    elif lockstep:
        reads = {st: reads_of(ps) for st, ps in assignment.items()}
    else:
        reads = StreamReads(assignment)
    local: LocalLockstep | None = None
    if not lockstep:
        columns = ({st: read_arrays(ps) for st, ps in assignment.items()}, *_bucket_arrays(table))
        sim = independent_batches(reads, table.bucket_of, sizes, bound, counts, columns)
    elif rank_local_lockstep:
        local = lockstep_local(
            assignment, *_bucket_arrays(table), world, workers, class_of, class_size, sizes, counts, keep
        )  # only rank ``keep``'s batches and reads become objects
        sim = local.sim
        reads = {**reads, **local.reads}
    else:
        sim = lockstep_batches(reads, table.bucket_of, world, workers, class_of, class_size, sizes, counts)
    tail = {"steps": 0, "samples": 0, "empty": 0}
    if packed_end:
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
        _equal_steps(sim, reads, world, workers, name, sizes, cost_of, counts)
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
    rank_local = keep is not None and (local is not None or not lockstep)
    kept = [(keep, w) for w in range(workers)] if rank_local else list(sim)
    counts.update(
        samples=n_samples,
        excluded=n_excluded,
        oversize=table.oversize,
        shard_splits=n_splits,
        max_buffered_samples=bound,
    )
    report = _report(
        epoch, name, lockstep, world, num_workers, counts, sim, reads, steps, len(class_size), batcher.max_compute
    )  # fmt: skip
    if n_reads is not None:
        report["reads"] = n_reads
    report.update(samples_per_rank=samples_per_rank, plan_seconds=0.0)
    if lockstep:
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
        schedule=name,
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
    schedule: str,
    lockstep: bool,
    world: int,
    num_workers: int,
    counts: dict[str, int],
    sim: dict[Stream, list[Batch]],
    reads: Mapping[Stream, list[Read]],
    steps: _Steps,
    n_classes: int,
    max_compute: float | None,
) -> dict[str, Any]:
    """The plan's report (keys in :func:`~.planner.plan_epoch`), but ``samples_per_rank`` and ``plan_seconds``."""
    return {
        "epoch": int(epoch),
        "schedule": schedule,
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
        "lockstep_tail_steps": steps.unequal if lockstep else 0,
        "unequal_steps": steps.unequal,
        "lockstep_classes": n_classes,
        "moved_samples": counts["moved_samples"],
        "moved_batches": counts["moved_batches"],
        "shard_splits": counts["shard_splits"],
        "reads": _read_count(reads),
        "max_buffered_samples": counts["max_buffered_samples"],
        "max_compute": max_compute,
        "est_compute_cv": steps.est_cv,
        "est_straggler_wait": steps.est_wait,
        "est_wait_share": steps.est_wait,  # the old name of est_straggler_wait, kept for scripts
    }


def _read_count(reads: Mapping[Stream, list[Read]]) -> int:
    """How many reads the streams have (:class:`~.assign.StreamReads` counts them without their lists)."""
    if isinstance(reads, StreamReads):
        return sum(map(reads.count, reads))
    return sum(map(len, reads.values()))


def _equal_steps(
    sim: dict[Stream, list[Batch]],
    reads: MutableMapping[Stream, list[Read]],
    world: int,
    workers: int,
    schedule: str,
    sizes: list[int],
    cost_of: list[float],
    counts: dict[str, int],
) -> None:
    """Equalise the step counts (:func:`~.equalise.equalise`) and make the reads follow the moved samples."""
    moves: list[Move] = []
    # Empty batches take the cheapest bucket's shape (they carry no sample; the shape only types them).
    pad_bucket = min(range(len(cost_of)), key=lambda b: (cost_of[b], b)) if cost_of else None
    deficit = equalise(sim, world, workers, schedule, sizes, counts, moves, pad_bucket)
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
    # Every batch as one code, bucket * span + size (an empty cell: the row of bucket -1); per code its
    # tokens, estimated cost and (class, size) signature are table look-ups.
    loaded = {}
    span = 1
    for r in range(world):
        for w in range(workers):
            batch_steps[(r, w)] = orders[r][1][w]
            if lengths[(r, w)]:
                bks, ns, packs = loaded[(r, w)] = loads((r, w))
                if len(ns):
                    span = max(span, int(np.max(ns)) + 1)
    n_b = len(buckets)
    table = _CodeTable(buckets, class_of, span)
    code = np.full((world, steps), n_b * span, dtype=np.int32 if (n_b + 1) * span < 1 << 31 else np.int64)
    at_r: list[int] = []  # packs: rank, step, tokens, cost
    at_k: list[int] = []
    pack_tok: list[int] = []
    pack_cost: list[float] = []
    for (r, w), (bks, ns, packs) in loaded.items():
        idx = batch_steps[(r, w)]
        code[r, idx] = np.asarray(bks, dtype=np.int64) * span + np.asarray(ns, dtype=np.int64)
        for j, tok, cost in packs:
            at_r.append(r)
            at_k.append(int(idx[j]))
            pack_tok.append(tok)
            pack_cost.append(cost)
    del loaded
    tokens = np.zeros(steps, dtype=np.int64)
    sig_same = np.ones(steps, dtype=bool)
    costs = np.empty((world, steps), dtype=np.float64)
    for a in range(0, steps, _STEP_BLOCK):  # blocks of steps: the temporaries stay small
        block = code[:, a : a + _STEP_BLOCK]
        tokens[a : a + _STEP_BLOCK] = table.tokens[block].sum(axis=0)
        sig = table.signature[block]
        sig_same[a : a + _STEP_BLOCK] = (sig == sig[0]).all(axis=0)
        costs[:, a : a + _STEP_BLOCK] = table.cost[block]
    pr, pk = np.asarray(at_r, dtype=np.int64), np.asarray(at_k, dtype=np.int64)
    pt = np.asarray(pack_tok, dtype=np.int64)
    if len(pk):  # a pack's tokens and cost are its own
        np.add.at(tokens, pk, pt - table.tokens[code[pr, pk]])
        costs[pr, pk] = np.asarray(pack_cost, dtype=np.float64)
    packed_steps = np.bincount(pk, minlength=steps) == world  # every rank takes a pack
    n_pack = int(packed_steps.sum())
    pack_fill = float(int(pt[packed_steps[pk]].sum())) / (world * n_pack) if n_pack else 0.0
    global_tokens = tokens.tolist()
    if steps:
        unequal = int((~(sig_same | packed_steps)).sum())
        figures = balance_summary(costs.T)  # the cost model's estimate of the step times
        est_cv, est_wait = figures["cv_mean"], figures["straggler_wait"]
    else:
        unequal, est_cv, est_wait = 0, 0.0, 0.0
    return _Steps(
        step_order, steps, batch_steps, global_tokens, unequal, est_cv, est_wait, n_pack, pack_fill, costs
    )


# Steps per block of the step table's look-ups.
_STEP_BLOCK = 1024


class _CodeTable:
    """Per batch code ``bucket * span + size`` (bucket -1 at ``len(buckets)``): its tokens (size x the
    bucket's sequence length), estimated cost (size x the bucket's cost, the same float product as
    element by element) and signature ((class, size): equal signatures are one lockstep step)."""

    def __init__(self, buckets: list[Bucket], class_of: list[int], span: int) -> None:
        n = np.arange(span, dtype=np.int64)
        seq_len = np.array([bk.seq_len for bk in buckets] + [0], dtype=np.int64)
        cost = np.array([bk.cost for bk in buckets] + [0.0], dtype=np.float64)
        cls = np.array(class_of + [-1], dtype=np.int64)
        self.tokens = (seq_len[:, None] * n).ravel()
        self.cost = (n * cost[:, None]).ravel()
        self.signature = (cls[:, None] * span + n).ravel()


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

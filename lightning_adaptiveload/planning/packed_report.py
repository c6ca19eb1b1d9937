"""What a packed plan reports, and the :class:`~.plan.EpochPlan` both packed planners assemble: the exact
one (:mod:`.packed`) and the one on counts (:mod:`.packed_counts`).

The report's figures are computed from the packs of the plan's *distinct* steps and which one each step of
the epoch is, so that a plan on counts (whose template steps repeat) never builds a (world, steps) array.
Pure NumPy.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from lightning_adaptiveload.stats import balance_rows, summarize_steps

__all__ = ["ZERO_COUNTERS", "bucket_dicts", "packed_plan", "packed_report", "rank_correlation"]


# The bucketed schedules' counters: 0 here (a pack is never split, merged or moved), so that code reading
# any plan's report works unchanged.
ZERO_COUNTERS = (
    "partial_batches",
    "bound_partial_batches",
    "split_batches",
    "merged_batches",
    "reduced_steps",
    "moved_samples",
    "moved_batches",
    "lockstep_classes",
    "shard_splits",
    "unequal_steps",
    "lockstep_tail_steps",
)


def packed_report(
    n_samples: int,
    oversize: int,
    excluded: int,
    tokens: np.ndarray,
    cost: np.ndarray,
    lens: np.ndarray,
    rows: np.ndarray,
    per_rank: list[int],
    reads: int,
    batcher: Any,
    num_workers: int,
    epoch: int,
) -> dict:
    """The plan's report from the packs of its distinct steps and which one each step of the epoch is.

    Args:
        tokens, cost, lens: (distinct steps, world): the tokens, estimated cost and sample count of each
            pack of each distinct step (a step of the count planner's templates is taken many times; its
            packs rotated over the ranks, which no figure here depends on).
        rows: (steps,): the distinct step of each step of the epoch.
        per_rank: samples of each rank over the epoch.
        reads: reads of all streams.
    """
    world, n_steps = tokens.shape[1], len(rows)
    if n_steps:
        c, i, w = balance_rows(cost)
        figures = summarize_steps(c[rows], i[rows], w[rows], cost.max(axis=1)[rows])
    else:
        figures = {"cv_mean": 0.0, "straggler_wait": 0.0}
    step_tokens = tokens.sum(axis=1)[rows]
    in_step = lens.sum(axis=1)[rows]
    mean_len = np.where(in_step > 0, step_tokens / np.maximum(in_step, 1), 0.0)
    used = np.unique(rows)
    max_tokens = float(batcher.max_tokens)
    return {
        "epoch": int(epoch),
        "schedule": "packed",
        "world_size": world,
        "num_workers": int(num_workers),
        "samples": int(n_samples),
        "batches": world * n_steps,
        "steps": n_steps,
        "tokens": int(step_tokens.sum()),
        "padding_tokens": 0,
        "skipped": {"oversize": int(oversize)} if oversize else {},
        "excluded": int(excluded),
        "empty_batches": int((lens == 0).sum(axis=1)[rows].sum()),
        **dict.fromkeys(ZERO_COUNTERS, 0),
        "reads": int(reads),
        "shard_opens_per_rank": float(reads) / world,
        "max_buffered_samples": int(lens[used].max(initial=0)),
        "max_compute": batcher.max_compute,
        "est_compute_cv": figures["cv_mean"],
        "est_straggler_wait": figures["straggler_wait"],
        "est_wait_share": figures["straggler_wait"],
        "fill_mean": float(step_tokens.sum() / (world * n_steps * max_tokens)) if n_steps else 0.0,
        "fill_min": float(tokens[used].min() / max_tokens) if n_steps else 0.0,
        "order_rank_correlation": rank_correlation(range(n_steps), mean_len),
        "samples_per_rank": [int(x) for x in per_rank],
        "plan_seconds": 0.0,
    }


def bucket_dicts(shapes: list[tuple[int, ...]], seq_len: np.ndarray, batcher: Any) -> list[dict[str, Any]]:
    max_tokens, cost_model = int(batcher.max_tokens), batcher.cost_model
    return [
        {
            "shape": shp,
            "seq_len": int(seq_len[b]),
            "batch_size": max_tokens // int(seq_len[b]) if seq_len[b] <= max_tokens else 0,
            "cost": cost_model.cost(int(seq_len[b])),
            "lockstep_class": -1,
        }
        for b, shp in enumerate(shapes)
    ]


def rank_correlation(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman rank correlation of two equal-length sequences (ties get their mean rank; 0.0 when either
    is constant)."""
    a = np.asarray(list(x), dtype=np.float64)
    b = np.asarray(list(y), dtype=np.float64)
    if len(a) < 2:
        return 0.0
    ra, rb = _mean_ranks(a), _mean_ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _mean_ranks(a: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of ``a`` with tied values sharing their mean rank (ordinal ranks would correlate
    ties with their position)."""
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return (start + (counts - 1) / 2.0)[inverse]


def packed_plan(
    layout: Any,
    world: int,
    num_workers: int,
    seed: int,
    epoch: int,
    buckets: list[dict[str, Any]],
    n_steps: int,
    global_tokens: list[int],
    report: dict,
    step_costs: np.ndarray | None,
    rank: int | None,
    t0: float,
) -> Any:
    """The packed :class:`~.plan.EpochPlan`: ``layout`` holds the kept streams' ``streams``,
    ``batch_buckets``, ``batch_steps`` and ``reads``; ``rank`` None: every rank's, else that rank's only.
    Step k of every rank is batch ``k // W`` of its worker ``k % W`` (the DataLoader's round robin)."""
    from lightning_adaptiveload.planning.plan import EpochPlan

    workers = max(1, int(num_workers))
    order = [(k % workers, k // workers) for k in range(n_steps)]
    plan = EpochPlan(
        world_size=world,
        num_workers=int(num_workers),
        seed=int(seed),
        epoch=int(epoch),
        schedule="packed",
        buckets=buckets,
        streams=layout.streams,
        batch_buckets=layout.batch_buckets,
        batch_steps=layout.batch_steps,
        reads=layout.reads,
        step_order=[order if rank is None or r == rank else [] for r in range(world)],
        steps=n_steps,
        global_tokens=global_tokens,
        report=report,
        step_costs=step_costs,
        rank=None if rank is None else int(rank),
    )
    report["plan_seconds"] = time.perf_counter() - t0
    return plan

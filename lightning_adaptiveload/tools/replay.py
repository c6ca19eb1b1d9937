"""One configuration of the simulator: plan an epoch with the real planner, replay it, measure it.

Owns the configurations (:data:`VARIANTS`: a schedule and a sizing rule each), the populations a plan is made over
(:func:`mix_population`: a mix's exact proportions; :func:`bucket_shares`), the replay of an
:class:`~lightning_adaptiveload.planning.planner.EpochPlan` into per-(step, rank) times
(:func:`replay_plan`), the balance figures of a replay (:func:`balance_metrics`, every formula from
:mod:`lightning_adaptiveload.stats`) and the break points of the ``max_compute`` search
(:func:`budget_candidates`). Plain Python and numpy; no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_adaptiveload import stats
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.shards.mixes import Mix
from lightning_adaptiveload.tools.step_times import BatchCoster, StepTimeTable, tokens_per_sample

__all__ = [
    "VARIANTS",
    "Replay",
    "balance_metrics",
    "bucket_shares",
    "budget_candidates",
    "default_plan_cost",
    "make_batcher",
    "mix_population",
    "replay_plan",
    "resolved_max_compute",
    "replay_packs",
    "run_variant",
]

# The lockstep schedule's target for step-time CV and straggler wait, checked and reported by
# simulate and drawn in its plots (never asserted).
TARGET_LOCKSTEP = 0.02

#: The simulator's configurations (*variants*): name -> (the schedule passed to plan_epoch, the batcher's
#: sizing rule).
VARIANTS: dict[str, tuple[str, str]] = {
    "equal_tokens": ("independent", "equal_tokens"),
    "dual": ("independent", "dual"),
    "lockstep": ("lockstep", "dual"),
    "lockstep_equal_tokens": ("lockstep", "equal_tokens"),
    # One pack per rank and step (planning/packed.py). The packed schedule sizes no batches, so it has no
    # sizing rule (planning.plan.batching_label): the batcher built for it only carries max_tokens and
    # the cost model, and equal_tokens is the one that needs no max_compute.
    "packed": ("packed", "equal_tokens"),
}


def balance_metrics(
    rank_seconds: np.ndarray,
    rank_tokens: np.ndarray,
    *,
    rank_memory: np.ndarray | None = None,
    rank_cost: np.ndarray | None = None,
    max_tokens: int | None = None,
    max_compute: float | None = None,
) -> dict[str, float]:
    """Balance, throughput and memory statistics of per-rank step times.

    The balance figures are :func:`lightning_adaptiveload.stats.balance_summary` of ``rank_seconds``
    (:data:`~lightning_adaptiveload.stats.BALANCE_FIGURES`: the names the monitor's summary uses).

    Args:
        rank_seconds: float array (steps, world): each rank's compute time of each step, seconds.
        rank_tokens: int array (steps, world): tokens in each rank's batch.
        rank_memory: optional float array (steps, world): each rank's peak memory per step (any unit);
            tokens are used when None.
        rank_cost: optional float array (steps, world): the planner's cost-model estimate of each batch.
        max_tokens: the token budget, for ``token_fill``.
        max_compute: the compute budget in cost-model units, for ``compute_fill``.

    Returns:
        ``steps, world, cv_mean, cv_p50, cv_p95, cv_max, imbalance_mean, imbalance_p95, straggler_wait
        (time-weighted), step_wait_mean (unweighted), wait_share and wait_mean (their old names),
        step_seconds_mean, step_time_cv (of the step durations across steps), total_seconds, total_tokens,
        tokens_per_s, peak_tokens, token_fill, compute_fill, vram_utilisation`` (fractions, not percent).

    Raises:
        ValueError: arrays of different or non-2-D shapes, no steps, or negative times.
    """
    t = np.asarray(rank_seconds, dtype=np.float64)
    tok = np.asarray(rank_tokens, dtype=np.float64)
    if t.ndim != 2 or t.shape != tok.shape or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(
            f"rank_seconds {t.shape} and rank_tokens {tok.shape} must both be (steps, world) with steps, world >= 1"
        )
    if np.any(t < 0) or not np.all(np.isfinite(t)):
        raise ValueError("rank_seconds must be finite and >= 0")
    top = t.max(axis=1)
    figures = stats.balance_summary(t)
    step_cv = stats.balance_rows(t)[0]
    total_seconds = float(top.sum())
    total_tokens = float(tok.sum())
    mem = tok if rank_memory is None else np.asarray(rank_memory, dtype=np.float64)
    out = {
        "steps": int(t.shape[0]),
        "world": int(t.shape[1]),
        **figures,
        # A mean above the p95 is no error: fewer than 5% of the steps are unbalanced (a packed epoch's
        # leftover steps); the max says how much those few are.
        "cv_max": float(np.nanmax(step_cv)) if not np.isnan(step_cv).all() else math.nan,
        "wait_share": figures["straggler_wait"],  # old names, kept for scripts
        "wait_mean": figures["step_wait_mean"],
        "step_seconds_mean": float(top.mean()),
        "step_time_cv": stats.cv(top),  # of the step durations across steps
        "total_seconds": total_seconds,
        "total_tokens": total_tokens,
        "tokens_per_s": total_tokens / total_seconds if total_seconds > 0 else math.nan,
        "peak_tokens": int(tok.max()),
        "token_fill": float(tok.mean() / max_tokens) if max_tokens else math.nan,
        "compute_fill": math.nan,
        "vram_utilisation": stats.peak_vram_utilisation_efficiency(mem.ravel().tolist()),
    }
    if rank_cost is not None and max_compute and math.isfinite(max_compute):
        out["compute_fill"] = float(np.asarray(rank_cost, dtype=np.float64).mean() / max_compute)
    return out


def _largest_remainder(p: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to n, proportional to p (Hamilton's method): no bucket is under-drawn by chance."""
    raw = p * n
    counts = np.floor(raw).astype(np.int64)
    rest = n - int(counts.sum())
    if rest > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:rest]] += 1
    return counts


def mix_population(mix: Mix, num_samples: int, num_shards: int, seed: int) -> Any:
    """An in-memory ShardIndex of ``num_samples`` latent shapes in the mix's exact proportions, shuffled."""
    from lightning_adaptiveload.shards.format import ShardInfo
    from lightning_adaptiveload.shards.index import ShardIndex

    counts = _largest_remainder(mix.probabilities, num_samples)
    bucket_ids = np.repeat(np.arange(len(mix.buckets)), counts)
    np.random.default_rng(seed).shuffle(bucket_ids)
    shapes = [mix.buckets[i].latent_shape for i in bucket_ids.tolist()]
    shards = []
    for k, part in enumerate(np.array_split(np.arange(num_samples), num_shards)):
        idx = part.tolist()
        shards.append(
            ShardInfo(
                path=f"sim://{mix.name}/shard-{k:06d}.tar",
                keys=[f"s{i:09d}" for i in idx],
                latent_shapes=[tuple(shapes[i]) for i in idx],
                text_lengths=[0] * len(idx),
                num_bytes=-1,
            )
        )
    return ShardIndex(shards=shards, metadata={"simulated_from_mix": mix.name, "num_samples": num_samples})


def bucket_shares(source: Any) -> dict[tuple[int, int, int, int], float]:
    """Share of each latent shape (C, T, H, W): a mix's probabilities, or the counts of an index's samples."""
    if isinstance(source, Mix):
        return {b.latent_shape: float(b.p) for b in source.buckets}
    counts: dict[tuple[int, int, int, int], int] = {}
    for s in source.shards:
        for shape in s.latent_shapes:
            counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    n = sum(counts.values())
    return {k: v / n for k, v in sorted(counts.items())}


@dataclass
class Replay:
    """Per-(step, rank) arrays of a replayed plan, and which batch sizes each bucket got."""

    seconds: np.ndarray  # (steps, world)
    tokens: np.ndarray
    memory: np.ndarray | None
    cost: np.ndarray
    samples: int
    batch_sizes: dict[tuple[int, int, int, int], set[int]]


def replay_plan(plan: Any, coster: BatchCoster, plan_cost: CostModel, index: Any = None) -> Replay:
    """Turn an EpochPlan into per-(step, rank) seconds, tokens, memory and planned cost.

    Uses the plan's own step order (``plan.step_order``: the DataLoader's round robin over a rank's
    workers) and bucket table, so that what is replayed is exactly what the DataModule would yield. The
    packs of a lockstep plan's packed tail (``plan.is_pack``) are replayed as :func:`replay_packs` does
    (their sample shapes come from ``index``, needed then); memory is then not replayed (None).
    """
    world, n = plan.world_size, plan.steps
    counts = {len(order) for order in plan.step_order}
    if counts != {n}:
        raise RuntimeError(
            f"the plan gives ranks different step counts {sorted(counts)} (plan.steps={n}) at world size {world}; "
            "DDP would hang. This is a planner bug: report it with the seed and world size"
        )
    seconds = np.zeros((n, world))
    tokens = np.zeros((n, world), dtype=np.int64)
    cost = np.zeros((n, world))
    memory: np.ndarray | None = np.zeros((n, world))
    samples = 0
    sizes: dict[tuple[int, int, int, int], set[int]] = {}
    shapes = [tuple(int(v) for v in bk["shape"]) for bk in plan.buckets]
    for r in range(world):
        for k, (w, j) in enumerate(plan.step_order[r]):
            b = len(plan.streams[(r, w)][j])
            if b == 0:
                continue
            if plan.is_pack((r, w), j):
                if index is None:
                    raise ValueError("replay_plan: the plan holds packs; pass the index it was planned from")
                seconds[k, r], tokens[k, r], cost[k, r] = _replay_pack(
                    plan.streams[(r, w)][j], index, coster, plan_cost
                )
                memory = None
                samples += b
                continue
            shape = shapes[plan.batch_buckets[(r, w)][j]]
            thw = (shape[1], shape[2], shape[3])
            sec, mem = coster(thw, b)
            seconds[k, r] = sec
            tok = coster.tokens(thw)
            tokens[k, r] = b * tok
            cost[k, r] = plan_cost.batch_cost(b, tok)
            if mem is None:
                memory = None
            elif memory is not None:
                memory[k, r] = mem
            samples += b
            sizes.setdefault(shape, set()).add(b)
    return Replay(seconds, tokens, memory, cost, samples, sizes)


def make_batcher(batching: str, max_tokens: int, max_compute: Any, plan_cost: CostModel, patch) -> Any:
    """The batcher of a configuration. Both sizing rules carry ``plan_cost``: equal_tokens sizes batches without it,
    but the lockstep classes and the packed schedule's balance are costed with the batcher's cost model."""
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    if batching == "equal_tokens":
        return DualConstraintBatcher(
            max_tokens=max_tokens, sizing="equal_tokens", cost_model=plan_cost, patch_size=patch
        )
    return DualConstraintBatcher(
        max_tokens=max_tokens, max_compute=max_compute, cost_model=plan_cost, sizing="dual", patch_size=patch
    )


def with_noise(seconds: np.ndarray, noise: float, draws: int, seed: int = 0) -> np.ndarray:
    """``(draws, *seconds.shape)``: every rank's time scaled by ``1 + noise * N(0, 1)`` (at least 0), seeded.

    ``noise`` is the relative standard deviation of one rank's step time on identical work: what a real run
    measures (``benchmarks/balance/ddp_modes_report.py``, ``identical_work_noise``), which no schedule removes.
    """
    rng = np.random.default_rng(seed)
    t = np.asarray(seconds, dtype=np.float64)
    return t * np.maximum(1.0 + noise * rng.standard_normal((draws, *t.shape)), 0.0)


def noise_floor(noise: float, ranks: int, draws: int = 4096, seed: int = 0) -> float:
    """The straggler wait of identical work on ``ranks`` ranks with :func:`with_noise`'s noise: the floor under
    any schedule at that size (about ``noise / sqrt(pi)`` at 2 ranks; it grows with the ranks)."""
    return stats.straggler_wait(with_noise(np.ones((draws, ranks)), noise, 1, seed)[0])


def noisy_balance(
    seconds: np.ndarray,
    tokens: np.ndarray,
    noise: float,
    draws: int,
    seed: int = 0,
    overhead_s: float = 0.0,
) -> dict[str, float]:
    """The straggler wait and tokens/s of a replay whose rank times carry ``noise`` (:func:`with_noise`), the
    mean over ``draws`` seeded draws: tokens over the summed slowest rank times, each step plus ``overhead_s``
    (the time a step spends outside the ranks' compute, which the noise does not scale)."""
    total = float(np.asarray(tokens, dtype=np.float64).sum())
    noisy = with_noise(seconds, noise, draws, seed)
    return {
        "straggler_wait": float(np.mean([stats.straggler_wait(d) for d in noisy])),
        "tokens_per_s": float(np.mean([total / (d.max(axis=1) + overhead_s).sum() for d in noisy])),
    }


def run_variant(
    index: Any,
    world: int,
    variant: str,
    *,
    max_tokens: int,
    max_compute: Any,
    plan_cost: CostModel,
    coster: BatchCoster,
    patch,
    num_workers: int,
    seed: int,
    epoch: int,
    plan_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], np.ndarray, Replay, Any]:
    """Plan one epoch of the configuration ``variant`` (a key of :data:`VARIANTS`) at ``world`` ranks and
    measure its replay.

    Returns:
        ``(metrics, per-step compute CV, the replay, the batcher)``; metrics are :func:`balance_metrics`
        plus ``samples``, ``max_compute``, the first-90% figures and the plan's report.
    """
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings

    schedule, batching = VARIANTS[variant]
    batcher = make_batcher(batching, max_tokens, max_compute, plan_cost, patch)
    settings = PlanSettings(schedule=schedule, **dict(plan_options or {}))
    plan = plan_epoch(index, world, num_workers, batcher, seed, epoch, settings)
    if plan.schedule == "packed":
        rep = replay_packs(plan, index, coster, plan_cost)
    else:
        rep = replay_plan(plan, coster, plan_cost, index)
    if rep.seconds.shape[0] == 0:
        raise ValueError(
            f"variant {variant!r} at world size {world}: the plan has no steps ({index.num_samples} samples); "
            "use more samples (min_steps_per_rank) or fewer ranks"
        )
    resolved = resolved_max_compute(batcher, index) if batching == "dual" else None
    m = balance_metrics(
        rep.seconds,
        rep.tokens,
        rank_memory=rep.memory,
        rank_cost=rep.cost,
        max_tokens=max_tokens,
        max_compute=resolved,
    )
    m["samples"] = rep.samples
    m["max_compute"] = resolved
    # The end of an epoch (leftover partial buckets, steps split to equalise step counts, lockstep tails)
    # weighs more in a short simulated epoch than in a real one: report the first 90% of steps apart.
    body = max(1, int(0.9 * rep.seconds.shape[0]))
    head = balance_metrics(rep.seconds[:body], rep.tokens[:body])
    m["cv_mean_first90"] = head["cv_mean"]
    m["straggler_wait_first90"] = m["wait_share_first90"] = head["straggler_wait"]
    m["plan_report"] = {
        k: plan.report.get(k)
        for k in (
            "partial_batches",
            "bound_partial_batches",
            "split_batches",
            "reduced_steps",
            "unequal_steps",
            "max_buffered_samples",
            "plan_seconds",
            "fill_mean",
            "reads",
            "shard_opens_per_rank",
            "order_rank_correlation",
            "lockstep_tail",
            "lockstep_tail_steps",
            "packed_tail_steps",
            "packed_tail_samples",
            "tail_fill_mean",
        )
    }
    cv, _, _ = stats.balance_rows(rep.seconds)
    return m, cv, rep, batcher


def _replay_pack(
    refs: list[tuple[int, int]], index: Any, coster: BatchCoster, plan_cost: CostModel
) -> tuple[float, int, float]:
    """One pack's replayed seconds (the pack cost model plus the step overhead), tokens and planned cost.

    A measured table prices packs with its :attr:`~StepTimeTable.pack_cost_model` (its pack model where it
    has one, else its per-sample fit), counted as ``"pack"`` lookups."""
    if isinstance(coster.times, CostModel):
        times = coster.times
    else:
        times = coster.times.pack_cost_model
        coster.times.lookups["pack"] = coster.times.lookups.get("pack", 0) + 1
    shapes = [index.shards[s].latent_shapes[i] for s, i in refs]
    toks = [coster.tokens((int(x[1]), int(x[2]), int(x[3]))) for x in shapes]
    return times.pack_cost(toks) + coster.overhead_s, sum(toks), plan_cost.pack_cost(toks)


def replay_packs(plan: Any, index: Any, coster: BatchCoster, plan_cost: CostModel) -> Replay:
    """:func:`replay_plan` for a packed plan: a pack's seconds are ``c0 + sum cost(S_i)`` of the pack cost
    model (a measured table's :attr:`~StepTimeTable.pack_cost_model`), plus the step overhead."""
    n, world = plan.steps, plan.world_size
    seconds, cost = np.zeros((n, world)), np.zeros((n, world))
    tokens = np.zeros((n, world), dtype=np.int64)
    samples = 0
    for r in range(world):
        for k, (w, j) in enumerate(plan.step_order[r]):
            refs = plan.streams[(r, w)][j]
            if not refs:
                continue
            seconds[k, r], tokens[k, r], cost[k, r] = _replay_pack(refs, index, coster, plan_cost)
            samples += len(refs)
    return Replay(seconds, tokens, None, cost, samples, {})


def resolved_max_compute(batcher: Any, index: Any) -> float | None:
    """The batcher's max_compute as a number (``"auto"`` resolved over the index's shapes), or None."""
    value = getattr(batcher, "max_compute", None)
    if isinstance(value, int | float):
        return float(value)
    shapes = [shape for s in index.shards for shape in s.latent_shapes]
    try:
        return float(batcher.resolve_max_compute(shapes))
    except (AttributeError, TypeError):
        return None


def budget_candidates(
    shares: Mapping[tuple[int, int, int, int], float],
    max_tokens: int,
    plan_cost: CostModel,
    patch,
    limit: int,
    extra: Iterable[float] = (),
) -> list[float]:
    """max_compute values at which some bucket's batch size changes, thinned to ``limit``.

    Any max_compute between two consecutive break points gives the same batch sizes, so the break points
    (``c0 + b * cost(S)``, the batch cost, for every bucket S and every b up to ``max_tokens // S``) are the
    only values worth trying. The largest is the unconstrained (equal-token) plan.
    """
    points: set[float] = set()
    for shape in shares:
        s = tokens_per_sample(shape[1:], patch)
        b_max = max_tokens // s
        for b in range(1, b_max + 1):
            points.add(round(plan_cost.batch_cost(b, s), 12))
    # Below the cheapest single sample every bucket has B = 1, the same plan as at that point.
    floor = min(plan_cost.batch_cost(1, tokens_per_sample(sh[1:], patch)) for sh in shares)
    pts = sorted(v for v in points if v >= floor * (1 - 1e-12))
    if len(pts) > limit:
        # Geometric thinning keeps resolution where batches are small, where each step of B matters most.
        picks = np.unique(np.round(np.geomspace(1, len(pts), limit)).astype(int) - 1)
        pts = [pts[i] for i in picks]
    pts = sorted(set(pts) | {float(v) for v in extra if v is not None and math.isfinite(v)})
    return pts


def default_plan_cost(times: StepTimeTable | CostModel, shares, patch, p: float | None) -> CostModel:
    """The cost model the dual batcher plans with: ``S^p`` with p given, else p fitted to the times."""
    if p is not None:
        return CostModel(kind="power", p=float(p))
    seqs = sorted({tokens_per_sample(sh[1:], patch) for sh in shares})
    if isinstance(times, StepTimeTable):
        if len(set(times.points()[0])) >= 2:
            return times.fit_cost_model("power")
        # One measured length cannot fix an exponent: plan with the times' own fallback model instead.
        times = times.fallback
    if len(seqs) < 2:
        return times
    return CostModel.fit(seqs, [times.cost(s) for s in seqs], kind="power")

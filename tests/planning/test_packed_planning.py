"""Invariants of the packed schedule's plans: exactly once, equal steps, tokens <= max_tokens, balance,
bounded buffering, resume with another world size or worker count."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.packed import rank_correlation
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.planning.sizing import tokens_per_sample

# (C, T, H, W) latents of the tiny mix's kind: 24 to 225 tokens under patch (1, 2, 2).
SHAPES = [(16, t, h, w) for t in (1, 3, 5, 9) for h, w in ((8, 12), (12, 8), (10, 10))]
COST = CostModel(kind="quadratic", alpha=1.0, beta=0.004, c0=20.0)


def _index(rng: random.Random, n_shards: int, max_size: int) -> list[list[tuple]]:
    return [[rng.choice(SHAPES) for _ in range(rng.randint(1, max_size))] for _ in range(n_shards)]


def _refs(index) -> set[tuple[int, int]]:
    return {(s, i) for s, shard in enumerate(index) for i in range(len(shard))}


def _check(plan, index, max_tokens, expected: set) -> None:
    taken = [ref for batches in plan.streams.values() for b in batches for ref in b]
    assert sorted(taken) == sorted(expected), "every sample exactly once"
    assert all(len(order) == plan.steps for order in plan.step_order), "equal steps on every rank"
    for st_, batches in plan.streams.items():
        read = sorted((s, i) for s, ids in plan.reads[st_] for i in ids)
        assert read == sorted(ref for b in batches for ref in b), "a stream reads exactly its samples"
        for b in batches:
            assert sum(tokens_per_sample(index[s][i]) for s, i in b) <= max_tokens
    for k in range(plan.steps):
        total = sum(
            tokens_per_sample(index[s][i])
            for r in range(plan.world_size)
            for s, i in plan.step_batch(r, k)[1]
        )
        assert plan.global_tokens[k] == total


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_shards=st.integers(1, 12),
    world=st.integers(1, 12),
    workers=st.integers(0, 3),
    resumed=st.booleans(),
)
def test_property_packed_exactly_once_equal_steps_and_resume(seed, n_shards, world, workers, resumed):
    rng = random.Random(seed)
    index = _index(rng, n_shards, 40)
    max_tokens = rng.choice([225, 400, 900])
    batcher = DualConstraintBatcher(max_tokens, sizing="equal_tokens", cost_model=COST)
    refs = _refs(index)
    if len(refs) < world:
        return
    exclude = set(rng.sample(sorted(refs), rng.randint(0, len(refs) - world))) if resumed else set()
    plan = plan_epoch(
        index,
        world,
        workers,
        batcher,
        seed=seed,
        epoch=1,
        exclude=exclude,
        settings=PlanSettings(schedule="packed"),
    )
    _check(plan, index, max_tokens, refs - exclude)
    twin = plan_epoch(
        index,
        world,
        workers,
        batcher,
        seed=seed,
        epoch=1,
        exclude=exclude,
        settings=PlanSettings(schedule="packed"),
    )
    assert twin.streams == plan.streams and twin.step_order == plan.step_order, "deterministic from the index"
    # Resume with another worker count: the same packs at the same steps.
    done = rng.randint(0, plan.steps)
    rest = continue_plan(plan, done, rng.randint(0, 3))
    left = {ref for batches in rest.streams.values() for b in batches for ref in b}
    assert left == refs - exclude - consumed_refs(plan, done)
    assert all(len(order) == rest.steps == plan.steps - done for order in rest.step_order)
    # Resume with another world size: replan what is left.
    gone = exclude | consumed_refs(plan, done)
    world2 = rng.randint(1, 12)
    if len(refs - gone) >= world2:
        again = plan_epoch(
            index,
            world2,
            workers,
            batcher,
            seed=seed,
            epoch=1,
            exclude=gone,
            settings=PlanSettings(schedule="packed"),
        )
        _check(again, index, max_tokens, refs - gone)


def mix_index(samples: int, seed: int = 0) -> list[list]:
    """``samples`` random SHAPES in shards of 50."""
    rng = np.random.default_rng(seed)
    shapes = [SHAPES[i] for i in rng.choice(len(SHAPES), samples)]
    return [shapes[i : i + 50] for i in range(0, len(shapes), 50)]


def test_packed_balances_fills_and_stays_shuffled():
    index = mix_index(6000)
    batcher = DualConstraintBatcher(900, sizing="equal_tokens", cost_model=COST)
    plan = plan_epoch(index, 8, 2, batcher, seed=0, epoch=0, settings=PlanSettings(schedule="packed"))
    rep = plan.report
    assert rep["est_compute_cv"] < 0.01 and rep["est_straggler_wait"] < 0.01
    assert rep["fill_mean"] > 0.9
    assert abs(rep["order_rank_correlation"]) < 0.3
    assert rep["max_buffered_samples"] <= 900 // 24  # a stream holds at most one pack


def test_rank_correlation_handles_ties():
    # Tied values share their mean rank: ordinal ranks would correlate a constant run with its position.
    assert abs(rank_correlation(range(6), [1, 1, 1, 2, 1, 1])) < 0.5
    assert abs(rank_correlation(range(4), [1, 2, 3, 4]) - 1.0) < 1e-12


def test_monitor_step_table_reports_fill():
    from lightning_adaptiveload.monitor.steps import FIELD_INDEX as _IDX
    from lightning_adaptiveload.monitor.steps import NUM_FIELDS
    from lightning_adaptiveload.monitor.steps import step_table as _step_table

    steps = np.full((2, 2, NUM_FIELDS), 1.0)
    steps[:, :, _IDX["num_tokens"]] = [[900, 700], [450, 450]]
    table = _step_table(steps, np.ones(2), np.ones(2), max_tokens=1000.0)
    np.testing.assert_allclose(table["fill"], [0.8, 0.45])
    assert np.isnan(_step_table(steps, np.ones(2), np.ones(2))["fill"]).all()  # cap unknown: not made up


def test_packed_oversize_raises_or_skips():
    import pytest

    index = [[(16, 9, 10, 10), (16, 1, 8, 12)], [(16, 1, 10, 10)]]  # 225, 24 and 25 tokens
    strict = DualConstraintBatcher(200, sizing="equal_tokens", cost_model=COST)
    with pytest.raises(ValueError, match="shard 0, sample #0.*225 tokens"):
        plan_epoch(index, 1, 0, strict, seed=0, epoch=0, settings=PlanSettings(schedule="packed"))
    lenient = DualConstraintBatcher(200, sizing="equal_tokens", cost_model=COST, oversize="skip")
    plan = plan_epoch(index, 1, 0, lenient, seed=0, epoch=0, settings=PlanSettings(schedule="packed"))
    assert plan.report["skipped"] == {"oversize": 1}
    assert sorted(ref for b in plan.rank_batches(0) for ref in b) == [(0, 1), (1, 0)]

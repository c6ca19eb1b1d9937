"""The packed schedule of a large epoch, planned on counts (``planning/packed_counts.py``): the same
guarantees as the exact planner (exactly once, equal steps, packs within max_tokens, resume), rank-local plans
that are their rank's part of the plan of every stream, and the balance of the exact planner.

The template size is lowered (``packed_counts.TEMPLATE_SAMPLES``) so that small indexes take the count path."""

from __future__ import annotations

import random
from unittest import mock

import numpy as np
import pytest
from _plan_cases import timeless_report
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_packed_planning import COST, SHAPES, _check, _index, _refs, mix_index

from lightning_adaptiveload.planning import packed_counts
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.packed_counts import plan_counts
from lightning_adaptiveload.planning.plan import PlanError
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.index import ShardIndex, ShardInfo

GLOBAL = ("steps", "global_tokens", "buckets", "world_size", "num_workers", "schedule", "seed", "epoch")


def _compact(index: list[list[tuple]]) -> CompactIndex:
    shards = [
        ShardInfo(
            f"s{k}.tar", [f"k{k}_{i}" for i in range(len(row))], [list(x) for x in row], [0] * len(row), -1
        )
        for k, row in enumerate(index)
    ]
    return CompactIndex.from_shard_index(ShardIndex(shards=shards))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_shards=st.integers(2, 14),
    world=st.integers(1, 9),
    workers=st.integers(0, 3),
    template=st.integers(8, 120),
    resumed=st.booleans(),
    compact=st.booleans(),
)
# Found by a local run: 7 samples for 8 ranks (the default policy refuses such a plan).
@example(seed=255, n_shards=2, world=8, workers=0, template=8, resumed=False, compact=False)
def test_property_count_plans_keep_every_guarantee(
    seed, n_shards, world, workers, template, resumed, compact
):
    rng = random.Random(seed)
    index = _index(rng, n_shards, 40)
    max_tokens = rng.choice([225, 400, 900])
    batcher = DualConstraintBatcher(max_tokens, sizing="equal_tokens", cost_model=COST)
    refs = _refs(index)
    exclude = set(rng.sample(sorted(refs), rng.randint(0, len(refs) // 3))) if resumed else set()
    data = _compact(index) if compact else index
    kw = dict(settings=PlanSettings(schedule="packed"), exclude=exclude)
    with mock.patch.object(packed_counts, "TEMPLATE_SAMPLES", template):
        if len(refs - exclude) < world:  # some rank would get nothing: refused under the default policy
            with pytest.raises(PlanError, match=r"leave \d+ rank\(s\) without any sample"):
                plan_epoch(data, world, workers, batcher, seed=seed, epoch=1, **kw)
            return
        plan = plan_epoch(data, world, workers, batcher, seed=seed, epoch=1, **kw)
        assert ("planned_on_counts" in plan.report) == (len(refs - exclude) > template)
        _check(plan, index, max_tokens, refs - exclude)
        if len(refs - exclude) >= world:
            assert min(plan.report["samples_per_rank"]) > 0
        twin = plan_epoch(data, world, workers, batcher, seed=seed, epoch=1, **kw)
        assert twin.streams == plan.streams and twin.step_order == plan.step_order, "deterministic"
        other = plan_epoch(
            index if compact else _compact(index), world, workers, batcher, seed=seed, epoch=1, **kw
        )
        assert other.streams == plan.streams, "the same plan from a list index and a compact one"
        # Reads counted for every stream without building them: what the streams read.
        assert plan.report["reads"] == sum(len(v) for v in plan.reads.values())
        # Rank-local plans: each rank's own part of the plan of every stream, and the same global parts.
        for r in range(world):
            local = plan_epoch(data, world, workers, batcher, seed=seed, epoch=1, rank=r, **kw)
            assert set(local.streams) == {(r, w) for w in range(max(1, workers))}
            for st_ in local.streams:
                assert local.streams[st_] == plan.streams[st_]
                assert local.batch_steps[st_] == plan.batch_steps[st_]
                assert local.batch_buckets[st_] == plan.batch_buckets[st_]
                assert local.reads[st_] == plan.reads[st_]
            assert local.step_order[r] == plan.step_order[r]
            assert all(getattr(local, f) == getattr(plan, f) for f in GLOBAL)
            assert timeless_report(local.report) == timeless_report(plan.report)
        # Resume with another worker count: the same packs at the same steps.
        done = rng.randint(0, plan.steps)
        rest = continue_plan(plan, done, rng.randint(0, 3))
        left = {ref for batches in rest.streams.values() for b in batches for ref in b}
        assert left == refs - exclude - consumed_refs(plan, done)
        # Resume with another world size: replan what is left.
        gone = exclude | consumed_refs(plan, done)
        world2 = rng.randint(1, 9)
        if len(refs - gone) >= world2:
            again = plan_epoch(
                data,
                world2,
                workers,
                batcher,
                seed=seed,
                epoch=1,
                exclude=gone,
                settings=PlanSettings(schedule="packed"),
            )
            _check(again, index, max_tokens, refs - gone)


def test_count_plan_balances_and_fills_like_the_exact_planner():
    index = mix_index(12_000)
    batcher = DualConstraintBatcher(900, sizing="equal_tokens", cost_model=COST)
    exact = plan_epoch(index, 8, 2, batcher, seed=0, epoch=0, settings=PlanSettings(schedule="packed")).report
    with mock.patch.object(packed_counts, "TEMPLATE_SAMPLES", 1_500):
        rep = plan_epoch(
            index, 8, 2, batcher, seed=0, epoch=0, settings=PlanSettings(schedule="packed")
        ).report
    assert rep["planned_on_counts"]["copies"][0] > 1  # the template was copied
    assert rep["est_compute_cv"] < 0.01 and rep["est_straggler_wait"] < 0.01
    assert rep["fill_mean"] > exact["fill_mean"] - 0.01
    assert rep["steps"] <= exact["steps"] * 1.01 + 1
    assert abs(rep["order_rank_correlation"]) < 0.3
    assert rep["empty_batches"] == 0
    assert rep["max_buffered_samples"] <= 900 // 24


def test_slots_partition_every_count_and_match_their_packs():
    values = np.array([24, 60, 120, 225])
    counts = np.array([700, 310, 95, 41])
    cost = CostModel(kind="quadratic", alpha=1.0, beta=0.004, c0=20.0)
    cp = plan_counts(values, counts, cost, 400, 5, np.random.default_rng(1), template=150)
    assert len(cp.parts) > 1 and cp.parts[0].reps > 1
    got = {v: [] for v in range(len(values))}
    tokens = np.zeros((5, cp.steps), dtype=np.int64)
    for r in range(5):
        position, v, ordinal = cp.slots_of(r)
        for x, o in zip(v.tolist(), ordinal.tolist()):
            got[x].append(o)
        np.add.at(tokens[r], position, values[v])
        # The pack of every slot, found from the slot alone, is the pack the slot was dealt from.
        pack = cp.pack_ids(v, ordinal)
        g = cp.order[position]
        assert (pack // 5 == g).all() and (pack % 5 == (r + g) % 5).all()
    for x in range(len(values)):
        assert sorted(got[x]) == list(range(int(counts[x]))), "every ordinal of every count exactly once"
    assert (tokens == np.stack([cp.at_positions(r, cp.pack_tokens) for r in range(5)])).all()
    assert (tokens <= 400).all()


@pytest.mark.parametrize("compact", [False, True])
def test_count_path_oversize_raises_naming_the_sample_or_skips(compact):
    index = [[SHAPES[0]] * 30, [SHAPES[1]] * 5 + [(16, 9, 40, 40)] + [SHAPES[2]] * 30]
    data = _compact(index) if compact else index
    with mock.patch.object(packed_counts, "TEMPLATE_SAMPLES", 20):
        with pytest.raises(
            ValueError, match=r"s?1(\.tar)?, sample #5: latent shape \[16, 9, 40, 40\] has 3600 tokens"
        ):
            plan_epoch(
                data,
                2,
                0,
                DualConstraintBatcher(900, cost_model=COST),
                seed=0,
                epoch=0,
                settings=PlanSettings(schedule="packed"),
            )
        plan = plan_epoch(
            data,
            2,
            0,
            DualConstraintBatcher(900, cost_model=COST, oversize="skip"),
            seed=0,
            epoch=0,
            settings=PlanSettings(schedule="packed"),
        )
    assert plan.report["skipped"] == {"oversize": 1} and plan.report["samples"] == 65
    assert "planned_on_counts" in plan.report


def test_packed_plans_ignore_chunk_samples():
    rng = random.Random(2)
    index = _index(rng, 20, 40)
    batcher = DualConstraintBatcher(400, sizing="equal_tokens", cost_model=COST)
    with mock.patch.object(packed_counts, "TEMPLATE_SAMPLES", 50):
        whole = plan_epoch(index, 3, 2, batcher, seed=1, epoch=0, settings=PlanSettings(schedule="packed"))
        chunked = plan_epoch(
            index, 3, 2, batcher, seed=1, epoch=0, settings=PlanSettings(schedule="packed", chunk_samples=60)
        )
    assert chunked.streams == whole.streams and "segments" not in chunked.report

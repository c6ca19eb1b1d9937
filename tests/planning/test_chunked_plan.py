"""Chunked and rank-local planning (issue 16): an epoch planned in segments keeps every guarantee of a plan
made at once, and a rank-local plan is its rank's part of the plan of every stream."""

import random

import numpy as np
import pytest
from _plan_cases import timeless_report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planning import all_refs, check_plan, random_index

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.chunked import segment_count, split_shards
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan
from lightning_adaptiveload.planning.settings import PlanSettings

GLOBAL = ("steps", "global_tokens", "buckets", "world_size", "num_workers", "schedule", "seed", "epoch")


def _batcher(rng: random.Random, schedule: str) -> DualConstraintBatcher:
    cost = CostModel(kind="power", p=rng.choice([1.0, 1.5, 2.0]))
    if schedule == "packed":
        return DualConstraintBatcher(rng.choice([200, 400]), cost_model=cost, partial="emit")
    return DualConstraintBatcher(
        rng.choice([96, 200, 400]), sizing=rng.choice(["dual", "equal_tokens"]), cost_model=cost
    )


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    world=st.integers(1, 6),
    workers=st.integers(0, 3),
    schedule=st.sampled_from(["independent", "lockstep", "packed"]),
    tail=st.sampled_from(["packed", "bucketed"]),
    resumed=st.booleans(),
)
def test_chunked_plan_keeps_every_guarantee(seed, world, workers, schedule, tail, resumed):
    rng = random.Random(seed)
    index = random_index(rng, rng.randint(12, 30), 60)
    batcher = _batcher(rng, schedule)
    refs = all_refs(index)
    exclude = set(rng.sample(refs, rng.randint(0, len(refs) // 3))) if resumed else set()
    chunk = rng.randint(60, 250)
    kw = dict(settings=PlanSettings(schedule=schedule, lockstep_tail=tail, chunk_samples=chunk), exclude=exclude)
    plan = plan_epoch(index, world, workers, batcher, seed=seed, epoch=1, **kw)
    # (The packed schedule plans large epochs on counts and never in segments.)
    groups = 1 if schedule == "packed" else segment_count(len(refs), chunk, world, max(1, workers))
    assert plan.report.get("segments", 1) == groups
    # Exactly once, equal steps, one shape per bucketed batch, packs within max_tokens, global tokens
    # per step recomputed from the batches, unequal/pack/empty counts as reported.
    check_plan(plan, index, batcher, exclude)
    if groups > 1:
        assert sum(plan.report["segment_steps"]) == plan.steps
    assert (
        plan.global_tokens
        == plan_epoch(index, world, workers, batcher, seed=seed, epoch=1, **kw).global_tokens
    )
    # Rank-local plans: each rank's own streams of the full plan, and the same global parts.
    for r in range(world):
        local = plan_epoch(index, world, workers, batcher, seed=seed, epoch=1, rank=r, **kw)
        assert local.rank == r
        assert set(local.streams) == {(r, w) for w in range(max(1, workers))}
        for st_ in local.streams:
            assert local.streams[st_] == plan.streams[st_]
            assert local.batch_steps[st_] == plan.batch_steps[st_]
            assert local.reads[st_] == plan.reads[st_]
            assert [local.is_pack(st_, j) for j in range(len(local.streams[st_]))] == [
                plan.is_pack(st_, j) for j in range(len(plan.streams[st_]))
            ]
        assert local.step_order[r] == plan.step_order[r]
        assert all(getattr(local, f) == getattr(plan, f) for f in GLOBAL)
        assert timeless_report(local.report) == timeless_report(plan.report)
        # Resume with another worker count, on the rank-local plan: the same batches as the full plan's.
        done = rng.randint(0, plan.steps)
        new_workers = rng.randint(0, 3)
        rest, rest_full = continue_plan(local, done, new_workers), continue_plan(plan, done, new_workers)
        assert all(rest.step_batch(r, k) == rest_full.step_batch(r, k) for k in range(rest.steps))


def test_at_most_chunk_samples_plans_exactly_as_at_once():
    rng = random.Random(3)
    index = random_index(rng, 20, 60)
    n = len(all_refs(index))
    for schedule in ("independent", "lockstep", "packed"):
        batcher = _batcher(random.Random(1), schedule)
        whole = plan_epoch(index, 4, 2, batcher, seed=5, epoch=0, settings=PlanSettings(schedule=schedule))
        same = plan_epoch(
            index, 4, 2, batcher, seed=5, epoch=0, settings=PlanSettings(schedule=schedule, chunk_samples=n)
        )
        assert same.streams == whole.streams and same.global_tokens == whole.global_tokens
        assert "segments" not in same.report


def test_segments_partition_the_shards_and_depend_on_seed_and_epoch():
    counts = np.random.default_rng(0).integers(1, 50, size=200)
    parts = split_shards(counts, 7, seed=1, epoch=2)
    joined = np.sort(np.concatenate(parts))
    assert joined.tolist() == list(range(200))
    sizes = [int(counts[p].sum()) for p in parts]
    assert max(sizes) - min(sizes) <= 2 * int(counts.max())  # about equal sample counts
    again = split_shards(counts, 7, seed=1, epoch=2)
    assert all((a == b).all() for a, b in zip(parts, again))
    other = split_shards(counts, 7, seed=1, epoch=3)
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(parts, other))


def test_segment_count_keeps_every_stream_fed():
    assert segment_count(10_000, None, 8, 2) == 1
    assert segment_count(10_000, 1_000, 8, 2) == 10
    # 16 samples per stream at least: 10,000 samples on 64 x 4 streams give 2 segments, not 10
    assert segment_count(10_000, 1_000, 64, 4) == 2
    with pytest.raises(ValueError, match="chunk_samples"):  # refused where the settings are built
        PlanSettings(chunk_samples=0)


def test_rank_local_plan_refuses_consumed_refs_and_bad_rank():
    rng = random.Random(0)
    index = random_index(rng, 10, 40)
    batcher = _batcher(rng, "lockstep")
    local = plan_epoch(
        index, 3, 1, batcher, seed=0, epoch=0, rank=1, settings=PlanSettings(schedule="lockstep")
    )
    with pytest.raises(ValueError, match="every rank"):
        consumed_refs(local, 1)
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        plan_epoch(index, 3, 1, batcher, seed=0, epoch=0, rank=3)


def test_progress_is_called_once_per_segment():
    rng = random.Random(2)
    index = random_index(rng, 30, 60)
    seen = []
    plan = plan_epoch(
        index, 2, 1, _batcher(rng, "independent"), seed=0, epoch=0, settings=PlanSettings(chunk_samples=200),
        progress=lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    groups = plan.report["segments"]
    assert groups > 1 and seen == [(k + 1, groups) for k in range(groups)]


def _read_ahead(reads, batches) -> int:
    """The most samples a stream's reader holds read ahead (reads opened in order, each read in file order,
    as ``loading/stream.py`` reads them)."""
    read_of = {(s, i): k for k, (s, ids) in enumerate(reads) for i in ids}
    pos, got, top = [0] * len(reads), set(), 0
    for batch in batches:
        for ref in batch:
            if ref in got:
                got.discard(ref)
                continue
            k = read_of[ref]
            while (reads[k][0], reads[k][1][pos[k]]) != ref:
                got.add((reads[k][0], reads[k][1][pos[k]]))
                pos[k] += 1
            pos[k] += 1
            top = max(top, len(got))
    return top


@pytest.mark.parametrize("schedule", ["independent", "lockstep"])
def test_chunked_streams_read_about_one_batch_ahead(schedule):
    # Segments dealt afresh to the workers read per batch: a stream reads ahead at most within one batch,
    # never holding a sample from the first batch that opens its shard until the last (what one read per
    # shard and stream would do: the test fails with resume.reads_per_shard in their place).
    for seed in range(12):
        rng = random.Random(seed)
        index = random_index(rng, 25, 60)
        batcher = _batcher(rng, schedule)
        whole = plan_epoch(index, 3, 2, batcher, seed=seed, epoch=0, settings=PlanSettings(schedule=schedule))
        plan = plan_epoch(
            index, 3, 2, batcher, seed=seed, epoch=0, settings=PlanSettings(schedule=schedule, chunk_samples=150)
        )
        assert plan.report["segments"] > 1
        largest = max(len(b) for v in plan.streams.values() for b in v)
        before = max(_read_ahead(whole.reads[st], whole.streams[st]) for st in whole.streams)
        after = max(_read_ahead(plan.reads[st], plan.streams[st]) for st in plan.streams)
        assert after <= max(before, largest), (seed, before, after, largest)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["lockstep", "independent"])
def test_segments_planned_in_a_process_pool_give_the_same_plan(schedule):
    rng = random.Random(11)
    index = random_index(rng, 30, 60)
    batcher = _batcher(rng, schedule)
    s = PlanSettings(schedule=schedule, chunk_samples=250)
    one = plan_epoch(index, 3, 2, batcher, 4, 2, s, rank=1)
    pool = plan_epoch(index, 3, 2, batcher, 4, 2, s.replace(plan_processes=2), rank=1)
    assert one.report["segments"] > 2
    assert pool.streams == one.streams and pool.reads == one.reads and pool.global_tokens == one.global_tokens
    assert timeless_report(pool.report) == timeless_report(one.report)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    world=st.integers(2, 7),
    workers=st.integers(0, 3),
    resumed=st.booleans(),
    tolerance=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_rank_local_lockstep_on_arrays_equals_the_plan_of_every_stream(
    seed, world, workers, resumed, tolerance
):
    """The lockstep schedule planned rank-locally on arrays (planning/lockstep_local.py) gives each rank
    exactly its part of the plan of every stream, and the same global parts, step costs included."""
    rng = random.Random(seed)
    index = random_index(rng, rng.randint(4, 24), 80)
    batcher = _batcher(rng, "lockstep")
    refs = all_refs(index)
    exclude = set(rng.sample(refs, rng.randint(0, len(refs) // 3))) if resumed else set()
    s = PlanSettings(
        schedule="lockstep", lockstep_tail="packed", lockstep_tolerance=tolerance, keep_step_costs=True
    )
    kw = dict(settings=s, exclude=exclude)
    plan = plan_epoch(index, world, workers, batcher, seed=seed, epoch=3, **kw)
    for r in range(world):
        local = plan_epoch(index, world, workers, batcher, seed=seed, epoch=3, rank=r, **kw)
        assert local.rank == r
        for st_ in [(r, w) for w in range(max(1, workers))]:
            assert local.streams[st_] == plan.streams[st_]
            assert local.batch_buckets[st_] == plan.batch_buckets[st_]
            assert local.batch_steps[st_] == plan.batch_steps[st_]
            assert local.reads[st_] == plan.reads[st_]
            assert local.pack_batches.get(st_) == plan.pack_batches.get(st_)
        assert local.step_order[r] == plan.step_order[r]
        assert all(getattr(local, f) == getattr(plan, f) for f in GLOBAL)
        np.testing.assert_array_equal(local.step_costs, plan.step_costs)
        assert timeless_report(local.report) == timeless_report(plan.report)

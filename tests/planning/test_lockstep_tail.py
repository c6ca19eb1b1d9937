"""Lockstep's packed tail (planning/tail.py): where the lockstep classes stop lining up across ranks, the
rest of the epoch runs as balanced packs; exactly once, equal steps, aligned ranks, resumable."""

from __future__ import annotations

import random

import pytest
from test_planning import all_refs, check_plan

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan
from lightning_adaptiveload.planning.settings import PlanSettings

# Dozens of length classes: 16 latent lengths in three aspects.
MANY = [(4, t, h, w) for t in range(1, 17) for h, w in ((4, 6), (6, 4), (4, 4))]


def many_class_index(seed: int, n_shards: int = 12, size: int = 40) -> list[list[tuple]]:
    rng = random.Random(seed)
    return [rng.choices(MANY, k=rng.randint(size // 2, size)) for _ in range(n_shards)]


def batcher() -> DualConstraintBatcher:
    return DualConstraintBatcher(400, sizing="equal_tokens", cost_model=CostModel(kind="power", p=1.5))


@pytest.mark.parametrize("world,workers", [(4, 0), (4, 2), (7, 3)])
def test_many_class_mix_ends_in_packed_steps_exactly_once_equal_steps(world, workers):
    index, b = many_class_index(0, n_shards=24, size=80), batcher()
    bucketed = plan_epoch(
        index,
        world,
        workers,
        b,
        seed=1,
        epoch=0,
        settings=PlanSettings(schedule="lockstep", lockstep_tail="bucketed"),
    )
    packed = plan_epoch(index, world, workers, b, seed=1, epoch=0, settings=PlanSettings(schedule="lockstep"))
    check_plan(bucketed, index, b)
    check_plan(packed, index, b)  # exactly once, equal steps, every step all packs or none
    assert bucketed.report["lockstep_tail_steps"] > 0, "the mix must have a lockstep tail to test"
    assert packed.report["lockstep_tail"] == "packed"
    assert packed.report["packed_tail_steps"] > 0 and packed.report["lockstep_tail_steps"] == 0
    assert 0 < packed.report["tail_fill_mean"] <= 1
    # The equal lockstep steps are kept: only the unequal batches' samples are re-planned.
    assert packed.report["packed_tail_samples"] < packed.report["samples"] / 2
    assert packed.report["est_compute_cv"] < bucketed.report["est_compute_cv"] / 2
    assert packed.report["est_straggler_wait"] < bucketed.report["est_straggler_wait"]


def test_packs_are_marked_and_lockstep_batches_kept_homogeneous():
    index, b = many_class_index(3), batcher()
    plan = plan_epoch(index, 4, 2, b, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep"))
    n_packs = 0
    for st, batches in plan.streams.items():
        assert len(plan.pack_batches[st]) == len(batches)
        for j, refs in enumerate(batches):
            if plan.is_pack(st, j):
                n_packs += 1
            else:
                assert len({index[s][i] for s, i in refs}) <= 1
    assert n_packs == 4 * plan.report["packed_tail_steps"]
    # A pack holds several shapes somewhere: the tail is not bucketed
    shapes = [
        {index[s][i] for s, i in refs}
        for st, batches in plan.streams.items()
        for j, refs in enumerate(batches)
        if plan.is_pack(st, j)
    ]
    assert max(len(x) for x in shapes) > 1


def test_one_rank_or_bucketed_tail_has_no_packs_and_bad_option_is_refused():
    index, b = many_class_index(1), batcher()
    one = plan_epoch(index, 1, 2, b, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep"))
    assert one.report["packed_tail_steps"] == 0 and one.pack_batches == {}
    old = plan_epoch(
        index, 4, 2, b, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep", lockstep_tail="bucketed")
    )
    assert old.pack_batches == {} and not any(
        old.is_pack(st, j) for st, v in old.streams.items() for j in range(len(v))
    )
    with pytest.raises(ValueError, match="lockstep_tail"):
        plan_epoch(
            index, 4, 2, b, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep", lockstep_tail="pack")
        )


def test_resume_a_mixed_plan_across_worker_counts_and_world_sizes():
    index, b = many_class_index(5), batcher()
    plan = plan_epoch(index, 4, 2, b, seed=2, epoch=1, settings=PlanSettings(schedule="lockstep"))
    first_pack = min(
        k for k in range(plan.steps) if plan.is_pack((0, plan.step_order[0][k][0]), plan.step_order[0][k][1])
    )
    for done in (0, first_pack - 1, first_pack + 1, plan.steps):
        for workers in (0, 1, 3):
            rest = continue_plan(plan, done, workers)
            assert rest.steps == plan.steps - done
            for r in range(4):
                for k in range(rest.steps):
                    w, j = rest.step_order[r][k]
                    w0, j0 = plan.step_order[r][done + k]
                    assert rest.streams[(r, w)][j] == plan.streams[(r, w0)][j0]
                    assert rest.is_pack((r, w), j) == plan.is_pack((r, w0), j0)
        # the rest of the epoch on another number of ranks: every sample exactly once over both parts
        gone = consumed_refs(plan, done)
        for world in (3, 6):
            other = plan_epoch(
                index,
                world,
                1,
                b,
                seed=2,
                epoch=1,
                exclude=gone,
                settings=PlanSettings(schedule="lockstep", underfull="pad"),
            )
            check_plan(other, index, b, gone)
            assert sorted(gone | {ref for v in other.streams.values() for bt in v for ref in bt}) == all_refs(
                index
            )

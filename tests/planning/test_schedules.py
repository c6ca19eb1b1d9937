"""Schedules as objects (issue 39, item 2): each name a setting gives maps to one frozen schedule object,
looked up once; the objects plan what ``plan_epoch`` plans, and the planner never calls itself back."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import time

import numpy as np
import pytest

from lightning_adaptiveload.planning import packed_counts, schedules
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.bucketed import plan_bucketed
from lightning_adaptiveload.planning.inputs import as_input
from lightning_adaptiveload.planning.job import EpochSchedule, PlanJob, gc_paused
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.schedules import (
    SCHEDULE_TYPES,
    Auto,
    Independent,
    Lockstep,
    Packed,
    schedule_for,
)
from lightning_adaptiveload.planning.settings import PlanSettings

_SHAPES = [(16, 1, 8, 8), (16, 2, 8, 8), (16, 3, 8, 12), (16, 5, 8, 8), (16, 2, 16, 16)]


def _data(n: int = 120, per_shard: int = 15, seed: int = 0) -> list[list[tuple[int, ...]]]:
    pick = np.random.default_rng(seed).integers(0, len(_SHAPES), n)
    return [[_SHAPES[i] for i in pick[s : s + per_shard]] for s in range(0, n, per_shard)]


def _batcher() -> DualConstraintBatcher:
    return DualConstraintBatcher(512, partial="emit")


def _job(settings: PlanSettings, world: int = 2, workers: int = 1, **kw) -> PlanJob:
    return PlanJob(
        data=as_input(kw.pop("data", _data())),
        world=world,
        num_workers=workers,
        batcher=_batcher(),
        seed=3,
        epoch=1,
        settings=settings,
        t0=time.perf_counter(),
        **kw,
    )


def test_every_schedule_name_has_one_object_built_from_the_settings():
    s = PlanSettings(schedule="lockstep", lockstep_tolerance=0.1, lockstep_tail="bucketed", chunk_samples=50)
    assert schedule_for(s) == Lockstep(tolerance=0.1, tail="bucketed", chunk_samples=50)
    assert schedule_for(s.replace(schedule="independent")) == Independent(tolerance=0.1, chunk_samples=50)
    assert schedule_for(s.replace(schedule="packed")) == Packed()
    auto = schedule_for(s.replace(schedule="auto"))
    assert auto == Auto(lockstep=Lockstep(tolerance=0.1, tail="bucketed", chunk_samples=50), packed=Packed())
    assert set(SCHEDULE_TYPES) == {"independent", "lockstep", "packed", "auto"}
    for name, kind in SCHEDULE_TYPES.items():
        obj = schedule_for(s.replace(schedule=name))
        assert type(obj) is kind and obj.name == name
        for member in ("segments", "plan_whole", "plan"):  # the EpochSchedule protocol
            assert callable(getattr(obj, member)), (name, member)
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.chunk_samples = 1  # type: ignore[misc]
        assert pickle.loads(pickle.dumps(obj)) == obj  # sent whole to the planning processes


def test_a_name_without_an_object_is_named(monkeypatch):
    monkeypatch.delitem(SCHEDULE_TYPES, "packed")
    with pytest.raises(ValueError, match=r"schedule 'packed' has no schedule object; the schedules are"):
        schedule_for(PlanSettings(schedule="packed"))


@pytest.mark.parametrize("name", ["independent", "lockstep", "packed", "auto"])
def test_the_object_plans_what_plan_epoch_plans(name):
    settings = PlanSettings(schedule=name, keep_step_costs=True)
    plan = schedule_for(settings).plan(_job(settings))
    ref = plan_epoch(_data(), 2, 1, _batcher(), 3, 1, settings)
    assert plan.schedule == ref.schedule == (name if name != "auto" else ref.report["schedule_auto"]["chose"])
    assert plan.streams == ref.streams and plan.global_tokens == ref.global_tokens and plan.steps == ref.steps


def test_bucketed_schedules_plan_in_segments_and_packed_never_does():
    settings = PlanSettings(schedule="lockstep", chunk_samples=40)
    job = _job(settings, data=_data(n=400, per_shard=20))
    lockstep, independent, packed = Lockstep(chunk_samples=40), Independent(chunk_samples=40), Packed()
    assert lockstep.segments(job) == independent.segments(job) > 1
    assert packed.segments(job) == 1 and Lockstep().segments(job) == 1
    plan = lockstep.plan(job)
    assert plan.report["segments"] == lockstep.segments(job) and plan.schedule == "lockstep"
    # A segment's plan is the schedule's own plan_whole: the segments' steps add up to the epoch's.
    assert sum(plan.report["segment_steps"]) == plan.steps


def test_packed_plans_a_large_epoch_on_counts_and_a_small_one_exactly(monkeypatch):
    settings = PlanSettings(schedule="packed")
    exact = Packed().plan(_job(settings))
    assert "planned_on_counts" not in exact.report
    monkeypatch.setattr(packed_counts, "TEMPLATE_SAMPLES", 30)
    counted = Packed().plan(_job(settings))
    assert counted.report["planned_on_counts"]["parts"] >= 1
    assert sorted(r for st in counted.streams.values() for b in st for r in b) == sorted(
        r for st in exact.streams.values() for b in st for r in b
    )  # every sample once either way
    # Samples already consumed count: what is left decides (here at most the template: exact again).
    gone = {s: list(range(15)) for s in range(7)}
    rest = Packed().plan(_job(settings, exclude=gone))
    assert "planned_on_counts" not in rest.report and rest.report["samples"] == 15


def test_auto_routes_through_the_registry_and_says_why(monkeypatch):
    settings = PlanSettings(schedule="auto")
    monkeypatch.setattr(schedules, "AUTO_MAX_WAIT", 1.0)  # any wait is within: lockstep
    plan = schedule_for(settings).plan(_job(settings, world=4))
    choice = plan.report["schedule_auto"]
    assert plan.schedule == choice["chose"] == "lockstep" and "within" in choice["why"]
    monkeypatch.setattr(schedules, "AUTO_MAX_WAIT", -1.0)  # any wait is too much: packed
    plan = schedule_for(settings).plan(_job(settings, world=4))
    assert plan.schedule == plan.report["schedule_auto"]["chose"] == "packed"
    no_packs = settings.replace(lockstep_tail="bucketed")  # a module that runs no packs keeps lockstep
    plan = schedule_for(no_packs).plan(_job(no_packs, world=4))
    assert plan.schedule == "lockstep" and "does not run packs" in plan.report["schedule_auto"]["why"]


def test_plan_bucketed_takes_the_schedule_not_its_name():
    job = _job(PlanSettings(schedule="lockstep"))
    lock = plan_bucketed(job, Lockstep(tail="bucketed"))
    ind = plan_bucketed(job, Independent())
    assert lock.schedule == "lockstep" and ind.schedule == "independent"
    assert lock.report["lockstep_tail"] == "bucketed" and "lockstep_tail" not in ind.report


def test_plan_job_and_protocol():
    job = _job(PlanSettings(), workers=0)
    assert job.workers == 1 and job.replace(num_workers=3).workers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.world = 3  # type: ignore[misc]
    assert {"name", "segments", "plan_whole", "plan"} <= set(dir(EpochSchedule))


def test_gc_paused_restores_the_collector_even_on_error():
    seen = []

    @gc_paused
    def work(fail: bool) -> None:
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("boom")

    assert gc.isenabled()
    work(False)
    with pytest.raises(RuntimeError):
        work(True)
    assert seen == [False, False] and gc.isenabled()


def test_each_schedule_says_whether_it_packs_and_ends_in_lockstep_tail():
    from lightning_adaptiveload.planning.schedules import SCHEDULE_TYPES

    packs = {name: kind.always_packs for name, kind in SCHEDULE_TYPES.items()}
    tails = {name: kind.has_lockstep_tail for name, kind in SCHEDULE_TYPES.items()}
    assert packs == {"independent": False, "lockstep": False, "packed": True, "auto": False}
    assert tails == {"independent": False, "lockstep": True, "packed": False, "auto": True}

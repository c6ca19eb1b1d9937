"""PlanSettings: the plan settings as one frozen value, each checked in one place, handed down whole."""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback

import pytest

from lightning_adaptiveload.loading.loader import PlannedShardDataset
from lightning_adaptiveload.planning import bucketed, chunked, settings
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.plan import SCHEDULE_CHOICES
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.planning.tail import LOCKSTEP_TAILS

# One bad value of every setting: (PlanSettings field, the value, the message).
BAD = [
    ("schedule", "fast", "schedule must be one of"),
    ("lockstep_tail", "pack", "lockstep_tail must be one of"),
    ("underfull", "skip", "underfull must be one of"),
    ("lockstep_tolerance", -0.1, r"lockstep_tolerance must be in \[0, 1\)"),
    ("lockstep_tolerance", 1.0, r"lockstep_tolerance must be in \[0, 1\)"),
    ("lockstep_tolerance", "wide", "lockstep_tolerance must be a number"),
    ("max_buffered_samples", 0, "max_buffered_samples must be a positive number"),
    ("chunk_samples", 0, "chunk_samples must be a positive number"),
    ("plan_processes", 0, "plan_processes must be >= 1"),
    ("plan_processes", "many", "plan_processes must be an integer"),
]
SHAPES = [[(16, 1, 8, 8)] * 6, [(16, 2, 8, 8)] * 5]  # two shards of latent shapes (C, T, H, W)


def _raised_in(exc: BaseException) -> str:
    """The file of the innermost frame of ``exc``'s traceback: where the error was raised."""
    return os.path.normpath(traceback.extract_tb(exc.__traceback__)[-1].filename)


def _entry_points(field: str, value: object):
    """Every way a setting enters the planning path, each called with the bad value once."""
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    yield "PlanSettings", lambda: PlanSettings(**{field: value})
    yield "PlanSettings.replace", lambda: PlanSettings().replace(**{field: value})
    if field == "underfull":  # the DataModule's evaluation splits take it as val_underfull
        yield "AdaptiveLoadDataModule", lambda: AdaptiveLoadDataModule(train_shards="unused", val_underfull=value)
    else:
        yield "AdaptiveLoadDataModule", lambda: AdaptiveLoadDataModule(train_shards="unused", plan={field: value})


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_each_bad_value_is_refused_in_one_place(field, value, message):
    """Whichever layer a bad value comes through, it is refused by PlanSettings.__post_init__, with one
    message: the one place where that setting is checked."""
    sites = set()
    for name, call in _entry_points(field, value):
        with pytest.raises(ValueError, match=message) as err:
            call()
        sites.add(_raised_in(err.value))
        assert "__post_init__" in [f.name for f in traceback.extract_tb(err.value.__traceback__)], name
    assert sites == {os.path.normpath(settings.__file__)}


def test_the_choices_are_the_literals():
    assert SCHEDULE_CHOICES == ("independent", "lockstep", "packed", "auto")
    assert LOCKSTEP_TAILS == ("packed", "bucketed")
    s = PlanSettings(lockstep_tolerance="0.1", chunk_samples=10.0, plan_processes=2)  # a YAML string, a float
    assert (s.lockstep_tolerance, s.chunk_samples, s.plan_processes) == (0.1, 10, 2)
    assert type(s.chunk_samples) is int


def test_settings_are_frozen_and_keyword_only():
    s = PlanSettings(schedule="lockstep")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.schedule = "packed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanSettings("lockstep")  # type: ignore[misc]
    assert s.replace(lockstep_tail="bucketed") == PlanSettings(schedule="lockstep", lockstep_tail="bucketed")
    with pytest.raises(ValueError, match="lockstep_tail must be one of"):
        s.replace(lockstep_tail="tail")


def test_saved_settings_of_older_checkpoints():
    """A resume re-plans with the saved settings. A segment saved before 0.2.0 names its schedule ``mode``,
    and one saved before the packed tail and chunking existed lacks them: the state's one migration
    (``loading/resume.py``) reads it into the current layout, which ``from_saved`` takes."""
    from lightning_adaptiveload.loading.resume import _migrate_state

    old = {"mode": "lockstep", "max_buffered_samples": None, "lockstep_tolerance": 0.1}
    (seg,) = _migrate_state(2, {"version": 2, "segments": [old]})["segments"]
    s = PlanSettings.from_saved(seg, underfull="pad")
    assert s == PlanSettings(
        schedule="lockstep", lockstep_tolerance=0.1, lockstep_tail="bucketed", underfull="pad"
    )
    with pytest.raises(KeyError, match="schedule"):  # the old layout itself is not read here
        PlanSettings.from_saved(old)


def test_the_chain_takes_at_most_twelve_parameters():
    for fn in (plan_epoch, bucketed.plan_bucketed, chunked.plan_segments, PlannedShardDataset.__init__):
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert len(params) <= 12, (fn.__qualname__, params)


def test_the_settings_are_one_argument_not_flat_keywords():
    b = DualConstraintBatcher(400)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mode'"):
        plan_epoch(SHAPES, 2, 1, b, 3, 1, mode="lockstep")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'schedule'"):
        PlannedShardDataset(SHAPES, b, schedule="lockstep")  # type: ignore[call-arg]
    plan = plan_epoch(SHAPES, 2, 1, b, 3, 1, PlanSettings(schedule="lockstep", lockstep_tail="bucketed"))
    assert plan.schedule == plan.report["schedule"] == "lockstep" and not hasattr(plan, "mode")
    assert "mode" not in plan.report


def test_the_dataset_plans_with_its_settings_and_saves_them():
    b = DualConstraintBatcher(400)
    s = PlanSettings(schedule="lockstep", lockstep_tolerance=0.1, lockstep_tail="bucketed")
    ds = PlannedShardDataset(SHAPES, b, s, seed=3, num_workers=1, placement=(0, 2))
    saved = ds.plan_settings()
    assert (
        saved["schedule"] == "lockstep"
        and saved["lockstep_tolerance"] == 0.1
        and saved["lockstep_tail"] == "bucketed"
    )
    plan = ds.make_plan(1)
    assert plan.streams == plan_epoch(SHAPES, 2, 1, b, 3, 1, s).streams


def test_the_datamodule_builds_its_settings_once():
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    dm = AdaptiveLoadDataModule(
        train_shards="unused",
        val_underfull="error",
        plan=PlanSettings(schedule="lockstep", lockstep_tail="bucketed", chunk_samples=1000, plan_processes=2),
    )
    assert dm.plan_settings == PlanSettings(
        schedule="lockstep", lockstep_tail="bucketed", chunk_samples=1000, plan_processes=2
    )
    # Validation, test and predict: one fixed independent plan at once, refused or padded where underfull.
    assert dm.eval_plan_settings == dm.plan_settings.replace(
        schedule="independent", chunk_samples=None, underfull="error"
    )
    assert dm.schedule == "lockstep" and dm.lockstep_tail == "bucketed"


def test_a_dataset_is_placed_once_and_on_ranks_gives_another():
    b = DualConstraintBatcher(400)
    ds = PlannedShardDataset(SHAPES, b, PlanSettings(schedule="lockstep"), placement=(1, 2))
    assert (ds.rank, ds.world_size) == (1, 2) and ds.plan_settings()["world_size"] == 2
    with pytest.raises(AttributeError):
        ds.world_size = 4  # type: ignore[misc]
    assert ds.on_ranks(1, 2) is ds
    ds.begin_epoch(0)
    other = ds.on_ranks(0, 4)
    assert (other.rank, other.world_size, other.plan) == (0, 4, None)
    assert (ds.rank, ds.world_size) == (1, 2) and ds.plan is not None  # the original is untouched
    assert other.begin_epoch(0).world_size == 4
    assert ds.plan.world_size == 2 and ds.report is not other.report  # nothing shared that a plan writes
    for bad in ((2, 2), (-1, 2), (0, 0), (0.0, 1), (True, 2)):
        with pytest.raises(ValueError, match="placement"):
            PlannedShardDataset(SHAPES, b, placement=bad)

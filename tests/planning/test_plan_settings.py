"""PlanSettings: the plan settings as one frozen value, each checked in one place, handed down whole."""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
import warnings

import pytest

from lightning_adaptiveload.loading.loader import PlannedShardDataset
from lightning_adaptiveload.planning import bucketed, chunked, settings
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.plan import SCHEDULE_CHOICES
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.planning.tail import LOCKSTEP_TAILS

# One bad value of every setting: (PlanSettings field, the DataModule's argument, the value, the message).
BAD = [
    ("schedule", "schedule", "fast", "schedule must be one of"),
    ("lockstep_tail", "lockstep_tail", "pack", "lockstep_tail must be one of"),
    ("underfull", "val_underfull", "skip", "underfull must be one of"),
    ("lockstep_tolerance", "lockstep_tolerance", -0.1, r"lockstep_tolerance must be in \[0, 1\)"),
    ("lockstep_tolerance", "lockstep_tolerance", 1.0, r"lockstep_tolerance must be in \[0, 1\)"),
    ("lockstep_tolerance", "lockstep_tolerance", "wide", "lockstep_tolerance must be a number"),
    ("max_buffered_samples", "max_buffered_samples", 0, "max_buffered_samples must be a positive number"),
    ("chunk_samples", "plan_chunk_samples", 0, "chunk_samples must be a positive number"),
    ("plan_processes", "plan_processes", 0, "plan_processes must be >= 1"),
    ("plan_processes", "plan_processes", "many", "plan_processes must be an integer"),
]
SHAPES = [[(16, 1, 8, 8)] * 6, [(16, 2, 8, 8)] * 5]  # two shards of latent shapes (C, T, H, W)


def _raised_in(exc: BaseException) -> str:
    """The file of the innermost frame of ``exc``'s traceback: where the error was raised."""
    return os.path.normpath(traceback.extract_tb(exc.__traceback__)[-1].filename)


def _entry_points(field: str, dm_arg: str, value: object):
    """Every way a setting enters the planning path, each called with the bad value once."""
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    yield "PlanSettings", lambda: PlanSettings(**{field: value})
    yield "AdaptiveLoadDataModule", lambda: AdaptiveLoadDataModule(train_shards="unused", **{dm_arg: value})
    legacy = {"mode" if field == "schedule" else field: value}
    yield (
        "plan_epoch (legacy keywords)",
        lambda: plan_epoch(SHAPES, 2, 0, DualConstraintBatcher(400), 0, 0, **legacy),
    )
    yield (
        "PlannedShardDataset (legacy keywords)",
        lambda: PlannedShardDataset(SHAPES, DualConstraintBatcher(400), **{field: value}),
    )


@pytest.mark.parametrize(("field", "dm_arg", "value", "message"), BAD, ids=[f"{b[0]}={b[2]!r}" for b in BAD])
def test_each_bad_value_is_refused_in_one_place(field, dm_arg, value, message):
    """Whichever layer a bad value comes through, it is refused by PlanSettings.__post_init__, with one
    message: the one place where that setting is checked."""
    sites = set()
    for name, call in _entry_points(field, dm_arg, value):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
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
    """A resume re-plans with the saved settings; older checkpoints lack the packed tail and chunking."""
    old = {"mode": "lockstep", "max_buffered_samples": None, "lockstep_tolerance": 0.1}
    s = PlanSettings.from_saved(old, underfull="pad")
    assert s == PlanSettings(
        schedule="lockstep", lockstep_tolerance=0.1, lockstep_tail="bucketed", underfull="pad"
    )


def test_the_chain_takes_at_most_twelve_parameters():
    for fn in (plan_epoch, bucketed.plan_bucketed, chunked.plan_segments, PlannedShardDataset.__init__):
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert len(params) <= 12, (fn.__qualname__, params)


def test_legacy_keywords_plan_alike_with_a_deprecation_warning():
    b = DualConstraintBatcher(400)
    new = plan_epoch(SHAPES, 2, 1, b, 3, 1, PlanSettings(schedule="lockstep", lockstep_tail="bucketed"))
    with pytest.warns(DeprecationWarning, match="settings=PlanSettings") as record:
        old = plan_epoch(SHAPES, 2, 1, b, 3, 1, mode="lockstep", lockstep_tail="bucketed")
    assert record[0].filename == __file__  # the warning points at the caller
    assert old.streams == new.streams and old.global_tokens == new.global_tokens and old.mode == "lockstep"
    with pytest.raises(TypeError, match="not both"):
        plan_epoch(SHAPES, 2, 1, b, 3, 1, PlanSettings(), mode="lockstep")
    with pytest.raises(TypeError, match=r"unknown plan setting\(s\) \['max_tokens'\]"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            plan_epoch(SHAPES, 2, 1, b, 3, 1, max_tokens=3)
    with pytest.warns(DeprecationWarning, match="PlannedShardDataset"):
        ds = PlannedShardDataset(SHAPES, b, schedule="lockstep", lockstep_tail="bucketed")
    assert (
        ds.settings == PlanSettings(schedule="lockstep", lockstep_tail="bucketed")
        and ds.schedule == "lockstep"
    )


def test_the_dataset_plans_with_its_settings_and_saves_them():
    b = DualConstraintBatcher(400)
    s = PlanSettings(schedule="lockstep", lockstep_tolerance=0.1, lockstep_tail="bucketed")
    ds = PlannedShardDataset(SHAPES, b, s, seed=3, num_workers=1, placement=(0, 2))
    saved = ds.plan_settings()
    assert (
        saved["mode"] == "lockstep"
        and saved["lockstep_tolerance"] == 0.1
        and saved["lockstep_tail"] == "bucketed"
    )
    plan = ds.make_plan(1)
    assert plan.streams == plan_epoch(SHAPES, 2, 1, b, 3, 1, s).streams


def test_the_datamodule_builds_its_settings_once():
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    dm = AdaptiveLoadDataModule(
        train_shards="unused", schedule="lockstep", lockstep_tail="bucketed", plan_chunk_samples=1000,
        val_underfull="error", plan_processes=2,
    )  # fmt: skip
    assert dm.plan_settings == PlanSettings(
        schedule="lockstep", lockstep_tail="bucketed", chunk_samples=1000, plan_processes=2
    )
    # Validation, test and predict: one fixed independent plan at once, refused or padded where underfull.
    assert dm.eval_plan_settings == dm.plan_settings.replace(
        schedule="independent", chunk_samples=None, underfull="error"
    )
    assert dm.schedule == "lockstep" and dm.lockstep_tail == "bucketed"


def test_plans_through_settings_match_the_pinned_digests():
    """The pinned digests (``tests/assets/plan_digests.json``, computed before PlanSettings) hold for plans
    made with ``settings=PlanSettings(...)``, as ``test_plan_identity`` checks them for the flat keywords."""
    import json
    import random

    from _paths import ASSETS
    from _plan_cases import FIELDS, case_key, cases, digest_plan, make_batcher, make_index

    with open(ASSETS / "plan_digests.json") as f:
        expected = json.load(f)
    picked = cases(quick=True)
    assert {c["mode"] for c in picked} == {"independent", "lockstep", "packed"}
    for c in picked:
        index = make_index(c["mix"], c["n"], c["seed"] * 1000 + c["variant"])
        exclude = None
        if c["resume"]:
            rng = random.Random(c["variant"])
            exclude = [(s, i) for s, sh in enumerate(index) for i in range(len(sh)) if rng.random() < 0.3]
        b = make_batcher(c["mix"], c["mode"], c["variant"])
        bound = c["bound"]
        if bound is not None:
            b.resolve_max_compute(s for shard in index for s in shard)
            bound *= max(b.batch_size(s) for shard in index for s in shard)
        s = PlanSettings(
            schedule=c["mode"], max_buffered_samples=bound, underfull="pad", lockstep_tail=c["tail"]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the new form warns of nothing
            plan = plan_epoch(index, c["world"], c["workers"], b, c["seed"], c["epoch"], s, exclude=exclude)
        got, want = digest_plan(plan), expected[case_key(c)]
        assert [f for f in FIELDS if got[f] != want[f]] == [], case_key(c)


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

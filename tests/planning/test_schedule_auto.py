"""``schedule="auto"`` (issue 40): lockstep, or packed where lockstep's estimated straggler wait exceeds
2% on a mix without length classes (every sample its own shape), and the model runs packs."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.plan import AUTO_MAX_WAIT
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.mixes import load_mix


def _native(n: int, seed: int = 1) -> list[list[tuple[int, ...]]]:
    """``n`` samples of the native-resolution mix (no length classes), 200 a shard."""
    shapes = [tuple(b.latent_shape) for b in load_mix("native_480p").buckets]
    pick = np.random.default_rng(seed).integers(0, len(shapes), n)
    return [[shapes[i] for i in pick[s : s + 200]] for s in range(0, n, 200)]


def _plan(data, world, schedule, tail="packed"):
    batcher = DualConstraintBatcher(65520, max_compute="auto", partial="emit")
    return plan_epoch(
        data,
        world,
        2,
        batcher,
        seed=0,
        epoch=0,
        rank=0,
        settings=PlanSettings(schedule=schedule, lockstep_tail=tail),
    )


def test_auto_picks_packed_where_lockstep_waits_and_says_so(monkeypatch):
    from lightning_adaptiveload.planning import schedules

    data = _native(12_000)
    lockstep = _plan(data, 16, "lockstep")
    wait = lockstep.report["est_straggler_wait"]
    assert 0.005 < wait <= AUTO_MAX_WAIT  # near the bound at this size; above it at 200k samples on 64 ranks
    monkeypatch.setattr(schedules, "AUTO_MAX_WAIT", wait / 2)  # this small epoch stands for a large one
    auto = _plan(data, 16, "auto")
    packed = _plan(data, 16, "packed")
    assert auto.schedule == "packed" and auto.streams == packed.streams and auto.steps == packed.steps
    choice = auto.report["schedule_auto"]
    assert choice["chose"] == "packed" and choice["lockstep_wait"] == lockstep.report["est_straggler_wait"]
    assert f"above {wait / 2:.0%}" in choice["why"]
    # Without packs (a module that does not run them) auto keeps lockstep, and says why.
    bucketed = _plan(data, 16, "auto", tail="bucketed")
    assert bucketed.schedule == "lockstep" and "does not run packs" in bucketed.report["schedule_auto"]["why"]


def test_auto_keeps_lockstep_within_the_wait():
    data = _native(12_000)
    within = _plan(data, 16, "auto")
    assert within.schedule == "lockstep" and "within 2%" in within.report["schedule_auto"]["why"]
    one = _plan(data, 1, "auto")
    assert one.schedule == "lockstep" and one.report["schedule_auto"]["chose"] == "lockstep"
    shapes = [[(16, 21, 60, 104)] * 200 for _ in range(40)]  # one shape: lockstep waits for nothing
    same = _plan(shapes, 16, "auto")
    assert same.schedule == "lockstep" and "within 2%" in same.report["schedule_auto"]["why"]


def test_datamodule_auto_logs_its_choice_and_resumes(synthetic_shards, monkeypatch, caplog):
    data = synthetic_shards([21, 4, 15, 9, 30, 7, 12, 18], seed=5, name="auto-shards")
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (0, 2))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule="auto"),
        loader=Loader(seed=7),
    )
    dm.setup("fit")
    with caplog.at_level(logging.INFO):
        first = next(iter(dm.train_dataloader()))
    assert first["keys"] and dm.epoch_report["schedule_auto"]["chose"] in ("lockstep", "packed")
    assert "schedule 'auto' chose" in caplog.text
    state = dm.state_dict()
    assert state["segments"][0]["schedule"] == "auto"
    with pytest.raises(ValueError, match="one of"):
        AdaptiveLoadDataModule(
            train_shards=data,
            batching=Batching(max_tokens=512),
            plan=PlanSettings(schedule="automatic"),
        )

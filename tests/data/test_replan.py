"""Mid-epoch replanning without a trainer or processes: the data module's replan, the loader's restart, the
resume of a replanned epoch, the monitor's trigger and the fit loop's epoch length (issue 41).

Two ranks are simulated in one process (each rank's data module plans its own streams, as in DDP); the DDP
run with the monitor is ``tests/integration/test_replan_ddp.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from _fixtures import assert_each_key_once, index_keys

from lightning_adaptiveload import _dist
from lightning_adaptiveload._lightning_compat import epoch_length_fixed_because as check_trainer
from lightning_adaptiveload._lightning_compat import set_epoch_length
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.replan import ReplanError
from lightning_adaptiveload.loading.resume import check_state
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.monitor.replan import ReplanTrigger, replan_metrics
from lightning_adaptiveload.planning.refit import RefitConfig
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

SIZES = [21, 4, 15, 9, 30, 7, 12, 18]
LINEAR = {"kind": "quadratic", "alpha": 1.0, "beta": 0.0, "gamma": 0.0}
TRUE = {"kind": "quadratic", "alpha": 1e-3, "beta": 2e-5, "gamma": 0.0, "c0": 0.4}


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=3, name="replan-shards")


def make_dm(
    data: str, rank: int, world: int, workers: int, schedule: str, monkeypatch
) -> AdaptiveLoadDataModule:
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512, cost_model=LINEAR, sizing="equal_tokens" if schedule == "independent" else "dual"),
        plan=PlanSettings(schedule=schedule),
        loader=Loader(num_workers=workers, seed=7),
    )
    dm.setup("fit")
    return dm


def _run_to_replan(dm: AdaptiveLoadDataModule, n: int) -> tuple[list[list[str]], object, object]:
    """Take ``n`` batches, replan the rest with the true model; returns the batches taken, the iterator
    (still running) and the replan's report."""
    it = iter(dm.train_dataloader())
    taken = [next(it)["keys"] for _ in range(n)]
    dm.set_cost_model(TRUE)
    return taken, it, dm.replan_rest()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_replan_reads_every_sample_once_with_equal_steps(shards, monkeypatch, schedule, workers):
    world, n = 2, 3
    per_rank, reports, rests = [], [], []
    for rank in range(world):
        dm = make_dm(shards, rank, world, workers, schedule, monkeypatch)
        taken, it, done = _run_to_replan(dm, n)
        rest = [b["keys"] for b in it]
        per_rank.append([{"keys": k} for k in taken + rest])
        reports.append(done)
        rests.append(len(rest))
        assert dm._segments[-1]["kind"] == "refit" and dm._segments[-1]["batcher"]["cost_model"]["c0"] == 0.4
        assert len(rest) == done.steps_left_after and done.consumed_steps == n
    assert_each_key_once(per_rank, index_keys(shards), f"{schedule}, {workers} workers, replanned")
    assert rests[0] == rests[1] and reports[0].to_dict() | {"plan_seconds": 0} == reports[1].to_dict() | {
        "plan_seconds": 0
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["lockstep", "packed"])
def test_resume_after_a_replan_continues_the_replanned_plan(shards, monkeypatch, schedule):
    world, n, more = 2, 2, 2
    for rank in range(world):
        dm = make_dm(shards, rank, world, 0, schedule, monkeypatch)
        taken, it, _ = _run_to_replan(dm, n)
        taken += [next(it)["keys"] for _ in range(more)]  # steps of the new plan, then a checkpoint
        state = dm.state_dict()
        check_state(state)
        assert [s["kind"] for s in state["segments"]] == ["fresh", "refit"]
        assert state["segments"][1]["consumed"] == [more] * world
        uninterrupted = [b["keys"] for b in it]
        again = make_dm(shards, rank, world, 0, schedule, monkeypatch)  # fresh process: the starting model
        again.load_state_dict(state)
        resumed = [b["keys"] for b in again.train_dataloader()]
        assert resumed == uninterrupted, f"rank {rank}: the resume did not continue the replanned plan"
        assert again._segments[-1]["kind"] == "continue"


def test_replan_needs_a_running_epoch(shards, monkeypatch):
    dm = make_dm(shards, 0, 1, 0, "lockstep", monkeypatch)
    with pytest.raises(ReplanError, match="no training epoch is running"):
        dm.replan_rest()


def test_loader_restart_without_a_running_iterator(shards, monkeypatch):
    dm = make_dm(shards, 0, 1, 0, "lockstep", monkeypatch)
    assert dm.train_dataloader().restart() is False


def test_refit_config_replan_settings():
    assert RefitConfig().replan_wait is None  # off by default
    RefitConfig(replan_wait=0.05, replan_window=10, max_replans_per_epoch=2)
    for bad in (
        {"replan_wait": 0.0},
        {"replan_wait": 1.5},
        {"replan_window": 0},
        {"max_replans_per_epoch": 0},
    ):
        with pytest.raises(ValueError, match=f"RefitConfig.{next(iter(bad))}"):
            RefitConfig(**bad) if "replan_wait" in bad else RefitConfig(replan_wait=0.05, **bad)


def _table(times: np.ndarray) -> dict[str, np.ndarray]:
    """A step table of ``(steps, ranks)`` compute times, as ``monitor.steps.step_table`` gives it."""
    from lightning_adaptiveload import stats

    cv, imbalance, wait = stats.balance_rows(times)
    return {
        "step_time_cv": cv,
        "imbalance": imbalance,
        "straggler_wait": wait,
        "compute_time_max_s": times.max(axis=1),
        "counted": np.zeros(len(times)),
    }


def test_trigger_fires_on_the_last_window_only():
    trigger = ReplanTrigger(RefitConfig(replan_wait=0.1, replan_window=4))
    trigger.start_epoch(0)
    assert trigger.should_replan(steps_left=100) is None and math.isnan(trigger.window_wait())
    trigger.add(_table(np.array([[1.0, 2.0]] * 4)))  # wait 25%
    # The last 4 steps: sum(max - mean) = 2 x 0.5 over sum(max) = 2 + 2 + 1 + 1: 1/6.
    trigger.add(_table(np.array([[1.0, 1.0]] * 2)))
    assert trigger.window_wait() == pytest.approx(1 / 6)
    assert trigger.should_replan(steps_left=100) == pytest.approx(1 / 6)
    assert trigger.should_replan(steps_left=3) is None  # less than a window left
    trigger.add(_table(np.array([[1.0, 1.0]] * 2)))
    assert trigger.should_replan(steps_left=100) is None  # 0% now
    trigger.replanned()
    assert trigger.steps == 0 and not trigger.armed  # one replan per epoch
    state = trigger.state_dict()
    resumed = ReplanTrigger(trigger.config)
    resumed.load_state_dict(state)
    resumed.start_epoch(0)  # the same epoch resumed: its replan counts
    assert not resumed.armed
    resumed.start_epoch(1)
    assert resumed.armed
    resumed.disarm()
    assert not resumed.armed


def test_trigger_off_by_default():
    trigger = ReplanTrigger(RefitConfig())
    trigger.add(_table(np.array([[1.0, 9.0]] * 100)))
    assert not trigger.armed and trigger.should_replan(steps_left=1000) is None


def _trainer(**kw) -> SimpleNamespace:
    fetcher = SimpleNamespace(length=10, fetched=4, done=False)
    loop = SimpleNamespace(max_batches=10, _data_fetcher=fetcher)
    base = {"fit_loop": loop, "limit_train_batches": 1.0, "val_check_interval": 1.0, "val_check_batch": 10}
    return SimpleNamespace(**{**base, **kw})


def test_set_epoch_length_updates_the_fit_loop():
    trainer = _trainer()
    assert check_trainer(trainer) == ""
    set_epoch_length(trainer, 13)
    assert trainer.fit_loop.max_batches == 13 and trainer.fit_loop._data_fetcher.length == 13
    assert trainer.val_check_batch == 13 and not trainer.fit_loop._data_fetcher.done
    set_epoch_length(trainer, 4)
    assert trainer.fit_loop._data_fetcher.done


def test_check_trainer_refuses_what_it_cannot_resize():
    assert "limit_train_batches" in check_trainer(_trainer(limit_train_batches=5))
    no_length = _trainer()
    no_length.fit_loop.max_batches = float("inf")
    assert "no length" in check_trainer(no_length)
    assert "data fetcher" in check_trainer(SimpleNamespace(fit_loop=SimpleNamespace(_data_fetcher=None)))


def test_replan_metrics():
    assert replan_metrics(0.05, 40, 44) == {
        "replan/window_wait": 0.05,
        "replan/steps_left_before": 40.0,
        "replan/steps_left_after": 44.0,
    }


@pytest.mark.timeout(180)
def test_resume_after_a_replan_on_another_world_size(shards, monkeypatch):
    """Three ranks resume a replanned epoch of two: the rest is planned afresh, every sample still once."""
    taken, state = [], None
    for rank in range(2):
        dm = make_dm(shards, rank, 2, 0, "lockstep", monkeypatch)
        keys, it, _ = _run_to_replan(dm, 2)
        keys.append(next(it)["keys"])
        taken.append([{"keys": k} for k in keys])
        state = state or dm.state_dict()
    rest = []
    for rank in range(3):
        again = make_dm(shards, rank, 3, 0, "lockstep", monkeypatch)
        again.load_state_dict(state)
        rest.append([{"keys": b["keys"]} for b in again.train_dataloader()])
        assert again._segments[-1]["kind"] == "replan"
    assert len({len(r) for r in rest}) == 1
    assert_each_key_once(taken + rest, index_keys(shards), "replanned on 2 ranks, resumed on 3")

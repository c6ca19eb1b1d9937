"""The ClosedLoop in one process, fed by the LoadBalanceMonitor: cadence, logging, files, hand-off, checkpoint
(this release's and 0.1.0's layout), the refusals, and the guard against resizing ``sizing="dual"`` batches."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload.callbacks.closed_loop import ClosedLoop
from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.monitor import loop_state
from lightning_adaptiveload.monitor.cost_refit import CostRefitter, apply_to_datamodule
from lightning_adaptiveload.monitor.replan import ReplanTrigger
from lightning_adaptiveload.monitor.timing import ManualClock
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import RefitConfig

TRUE = CostModel(kind="quadratic", alpha=1e-3, beta=2e-5, c0=0.4)
# (B, S) of the steps: four lengths, three batch sizes each, twice (c0 is told apart by B).
SHAPES = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)] * 2
ASSET = Path(__file__).resolve().parents[1] / "assets" / "quickstart_v0.1.0_step30.ckpt"


class Batches(IterableDataset):
    def __iter__(self):
        for b, s in SHAPES:
            yield {
                "latents": torch.ones(b, 4),
                "seq_len": s,
                "batch_size": b,
                "num_tokens": b * s,
                "cost": 1.0,
            }


class Timed(L.LightningModule):
    """Each step takes TRUE's cost of its batch on the monitor's ManualClock."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.advance(TRUE.batch_cost(int(batch["batch_size"]), int(batch["seq_len"])))
        return self.lin(batch["latents"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Recording(L.LightningDataModule):
    """A data module that plans with a cost model: records what it was given, and when."""

    def __init__(self) -> None:
        super().__init__()
        # equal_tokens: the model balances but does not size the batches, so a refit is applied by default
        # (sizing "dual" needs resize_batches: test_dual_sizing_applies_the_refit_only_with_resize_batches).
        self.batcher = DualConstraintBatcher(max_tokens=512, sizing="equal_tokens")
        self.events: list = []

    def set_cost_model(self, model: CostModel) -> None:
        self.events.append(("model", model))

    def train_dataloader(self):
        self.events.append(("loader", int(self.trainer.current_epoch)))
        return DataLoader(Batches(), batch_size=None)


def _fit(tmp_path, max_epochs: int, refit, ckpt: str | None = None, dm: Recording | None = None, loop=True):
    clock = ManualClock()
    monitor = LoadBalanceMonitor(
        dirpath=tmp_path, clock=clock, count_flops=False, plots=False, print_summary=False
    )
    closed = ClosedLoop(refit=refit)
    dm = dm or Recording()
    trainer = quiet_cpu_trainer(
        tmp_path,
        max_epochs=max_epochs,
        log_every_n_steps=4,
        callbacks=[monitor, closed] if loop else [monitor],
        reload_dataloaders_every_n_epochs=1,
    )
    trainer.fit(Timed(clock), datamodule=dm, ckpt_path=ckpt)
    return trainer, closed, dm


def _models(dm: Recording) -> list[CostModel]:
    return [m for kind, m in dm.events if kind == "model"]


def test_refit_every_n_steps_and_at_epoch_end_logs_writes_and_hands_off(tmp_path):
    trainer, closed, dm = _fit(tmp_path, 1, {"every_n_steps": 16, "warmup_steps_per_class": 0})
    lines = [json.loads(x) for x in open(tmp_path / "cost_refit.jsonl")]
    assert [(x["epoch"], x["step"]) for x in lines] == [(0, 16), (0, 24)]
    assert lines[0]["status"] == "fitted" and lines[0]["applied"]
    # The second window (8 steps) cannot carry three terms: only the scale of the first fit is refitted.
    assert lines[1]["status"] == "scaled" and "fewer than 12" in lines[1]["reason"]
    models = _models(dm)
    assert len(models) == 2
    assert abs(models[0].beta / TRUE.beta - 1) < 1e-6 and abs(models[0].c0 / TRUE.c0 - 1) < 1e-6
    # Logged under the monitor's prefix, as the monitor's refit option did in 0.1.0.
    assert trainer.callback_metrics["balance/refit/beta"].item() == pytest.approx(models[1].beta, rel=1e-6)
    state = closed.state_dict()
    assert (
        state["version"] == loop_state.STATE_VERSION and state["cost_refit"]["model"] == models[1].to_dict()
    )
    assert closed.monitor is trainer.callbacks[0]


def test_refit_off_and_the_monitor_alone_change_nothing(tmp_path):
    _, closed, dm = _fit(tmp_path / "off", 1, False)
    assert closed.state_dict() == {} and not os.path.exists(tmp_path / "off" / "cost_refit.jsonl")
    assert _models(dm) == []
    trainer, _, dm = _fit(tmp_path / "alone", 1, True, loop=False)
    monitor = trainer.callbacks[0]
    assert isinstance(monitor, LoadBalanceMonitor) and monitor.state_dict() == {}
    assert not os.path.exists(tmp_path / "alone" / "cost_refit.jsonl") and _models(dm) == []
    assert not any(k.startswith("balance/refit/") for k in trainer.callback_metrics)
    assert "balance/straggler_wait" in trainer.callback_metrics  # it still measured


def test_a_resumed_fit_hands_the_learned_model_over_before_planning(tmp_path):
    trainer, closed, _ = _fit(tmp_path / "a", 1, True)
    learned = closed._refitter.model
    assert learned is not None and learned != CostModel.default()
    ckpt = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(ckpt)
    assert "ClosedLoop" in torch.load(ckpt, weights_only=False)["callbacks"]
    dm = Recording()
    _fit(tmp_path / "b", 2, True, ckpt=ckpt, dm=dm)
    # Restored before the epoch's loader is asked for: the epoch after the checkpoint plans with it.
    assert dm.events[0] == ("model", learned)
    assert dm.events.index(("loader", 1)) > 0


def _as_0_1_0(ckpt: str, out: str) -> dict:
    """``ckpt`` rewritten with the closed loop's state where 0.1.0 saved it: under the monitor's key, unversioned."""
    checkpoint = torch.load(ckpt, weights_only=False)
    state = checkpoint["callbacks"].pop("ClosedLoop")
    state.pop("version")
    checkpoint["callbacks"]["LoadBalanceMonitor"] = state
    torch.save(checkpoint, out)
    return state


def test_a_0_1_0_checkpoint_with_the_state_under_the_monitor_restores(tmp_path):
    trainer, closed, _ = _fit(tmp_path / "a", 1, True)
    learned = closed._refitter.model
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"))
    old = str(tmp_path / "old.ckpt")
    saved = _as_0_1_0(str(tmp_path / "a.ckpt"), old)
    assert set(saved) == {"cost_refit", "replan"}  # the 0.1.0 monitor's keys
    dm = Recording()
    _, resumed, _ = _fit(tmp_path / "b", 2, True, ckpt=old, dm=dm)
    assert dm.events[0] == (
        "model",
        learned,
    )  # handed over before epoch 1 was planned, as from this release's
    assert dm.events.index(("loader", 1)) > 0
    assert resumed._refitter.history[: len(closed._refitter.history)] == closed._refitter.history
    # Without a ClosedLoop the monitor says what the checkpoint holds and how to use it.
    with pytest.warns(
        UserWarning, match="0.1.0 LoadBalanceMonitor learned.*add lightning_adaptiveload.ClosedLoop"
    ):
        _fit(tmp_path / "c", 2, True, ckpt=old, dm=Recording(), loop=False)


def test_loop_state_versions_are_read_in_one_place():
    refit = CostRefitter(RefitConfig()).state_dict()
    assert loop_state.current_loop_state({"cost_refit": refit, "replan": {}}) == {
        "version": 2,
        "cost_refit": refit,
        "replan": {},
    }
    same = {"version": 2, "cost_refit": refit}
    assert loop_state.current_loop_state(same) == same
    with pytest.raises(
        ValueError, match=r"version 3 .*reads versions 1 and 2.*checkpoint\['callbacks'\]\['ClosedLoop'\]"
    ):
        loop_state.current_loop_state({"version": 3, "cost_refit": refit})
    states = {"LoadBalanceMonitor": {"cost_refit": refit}, "ClosedLoop": same}
    assert loop_state.find_loop_state(states, "ClosedLoop", "LoadBalanceMonitor") is not states["ClosedLoop"]
    assert loop_state.find_loop_state(states, "ClosedLoop", "LoadBalanceMonitor") == same  # its own key first
    del states["ClosedLoop"]
    assert loop_state.find_loop_state(states, "ClosedLoop", "LoadBalanceMonitor")["version"] == 2
    assert loop_state.find_loop_state(states, "ClosedLoop", None) is None
    assert (
        loop_state.find_loop_state({"LoadBalanceMonitor": {"x": 1}}, "ClosedLoop", "LoadBalanceMonitor")
        is None
    )


@pytest.mark.skipif(not ASSET.exists(), reason="the 0.1.0 checkpoint asset is not in this checkout")
def test_the_0_1_0_quickstart_checkpoint_state_reads():
    states = torch.load(ASSET, map_location="cpu", weights_only=False)["callbacks"]
    assert "ClosedLoop" not in states and "cost_refit" in states["LoadBalanceMonitor"]
    state = loop_state.find_loop_state(states, "ClosedLoop", "LoadBalanceMonitor")
    refitter, trigger = CostRefitter(RefitConfig()), ReplanTrigger(RefitConfig())
    refitter.load_state_dict(state["cost_refit"])
    trigger.load_state_dict(state["replan"])
    assert refitter.window_rows > 0  # mid-epoch: the window since the last refit is in it


def test_bad_refit_setting_is_named():
    with pytest.raises(ValueError, match="unknown keys \\['every_n_step'\\]"):
        ClosedLoop(refit={"every_n_step": 5})
    with pytest.raises(ValueError, match="ClosedLoop: refit must be True, False, a RefitConfig"):
        ClosedLoop(refit="yes")
    with pytest.raises(TypeError, match="refit"):
        LoadBalanceMonitor(refit=True)  # the monitor only measures


def test_a_closed_loop_without_a_monitor_before_it_is_refused_naming_the_fix(tmp_path):
    clock = ManualClock()
    for callbacks, match in (
        ([ClosedLoop()], "have no LoadBalanceMonitor. Add one before the ClosedLoop"),
        ([ClosedLoop(), LoadBalanceMonitor(clock=clock)], "must come after the LoadBalanceMonitor"),
    ):
        trainer = quiet_cpu_trainer(tmp_path, max_epochs=1, callbacks=callbacks)
        with pytest.raises(ValueError, match=match):
            trainer.fit(Timed(clock), datamodule=Recording())


def test_numeric_cap_logs_the_refit_without_applying_it(tmp_path):
    dm = Recording()
    dm.batcher = DualConstraintBatcher(
        max_tokens=512, max_compute=300.0, cost_model={"kind": "power", "p": 1.5}
    )
    with pytest.warns(UserWarning, match="max_compute=300.0 is a number"):
        _fit(tmp_path, 1, {"warmup_steps_per_class": 0}, dm=dm)
    line = json.loads(open(tmp_path / "cost_refit.jsonl").read().splitlines()[-1])
    assert not line["applied"] and "max_compute=300.0" in line["not_applied_because"]
    assert _models(dm) == []
    # A model that was not applied is not applied on resume either (a regression test).
    closed = ClosedLoop(refit=True)
    closed._trainer = type("T", (), {"datamodule": Recording()})()
    state = _fit(tmp_path / "again", 1, {"warmup_steps_per_class": 0}, dm=dm)[1].state_dict()
    assert state["cost_refit"]["applied"] is False
    closed.load_state_dict(state)
    assert closed._trainer.datamodule.events == []
    closed.load_state_dict({**state, "cost_refit": {**state["cost_refit"], "applied": True}})
    assert [kind for kind, _ in closed._trainer.datamodule.events] == ["model"]
    assert np.isfinite(line["error"]["all"]["mean"])


def test_dual_sizing_applies_the_refit_only_with_resize_batches(tmp_path):
    dm = Recording()
    dm.batcher = DualConstraintBatcher(max_tokens=512)  # sizing "dual", max_compute "auto"
    _fit(tmp_path / "default", 1, {"warmup_steps_per_class": 0}, dm=dm)
    line = json.loads(open(tmp_path / "default" / "cost_refit.jsonl").read().splitlines()[-1])
    assert not line["applied"] and "resize_batches" in line["not_applied_because"]
    assert _models(dm) == []
    _fit(tmp_path / "resize", 1, {"warmup_steps_per_class": 0, "resize_batches": True}, dm=dm)
    assert [e[0] for e in dm.events if e[0] == "model"] == ["model"]


class _Module:
    """A data module stand-in: its batcher, its schedule, and the models it was given."""

    def __init__(self, batcher, schedule: str = "lockstep") -> None:
        self.batcher, self.schedule, self.models = batcher, schedule, []

    def set_cost_model(self, model) -> None:
        self.models.append(model)


class _Sizing:
    """A batcher that says its sizing rule only as ``.sizing`` (and, to tell which one is read, a ``.mode``)."""

    cap_follows_cost_model = True

    def __init__(self, sizing: str, mode: str | None = None) -> None:
        self.sizing = sizing
        if mode is not None:
            self.mode = mode


def test_the_guard_against_resizing_dual_batches_reads_sizing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no alias warning (or any other) on the way
        real = _Module(DualConstraintBatcher(max_tokens=512, sizing="dual"))
        assert "resize_batches" in apply_to_datamodule(real, TRUE) and real.models == []
        assert apply_to_datamodule(real, TRUE, resize_batches=True) == "" and real.models == [TRUE]
        dual = _Module(_Sizing("dual", mode="equal_tokens"))
        assert 'sizing="dual"' in apply_to_datamodule(dual, TRUE) and dual.models == []
        tokens = _Module(_Sizing("equal_tokens", mode="dual"))
        assert apply_to_datamodule(tokens, TRUE) == "" and tokens.models == [TRUE]
        packs = _Module(_Sizing("dual"), schedule="packed")  # packs are sized by max_tokens alone
        assert apply_to_datamodule(packs, TRUE) == "" and packs.models == [TRUE]


def test_datamodule_set_cost_model_plans_the_next_epoch_with_it(synthetic_shards):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.loading.settings import Loader
    from lightning_adaptiveload.planning.inputs import distinct_shapes
    from lightning_adaptiveload.planning.settings import Batching

    data = synthetic_shards([16] * 4, seed=1)
    power = {"kind": "power", "p": 1.0}
    dm = AdaptiveLoadDataModule(
        data, batching=Batching(max_tokens=512, cost_model=power), loader=Loader(num_workers=0)
    )
    dm.setup("fit")
    before = dm.train_dataset.make_plan(0)
    dm.set_cost_model(TRUE.to_dict())
    assert dm.batcher.cost_model == TRUE and dm.train_dataset.batcher is dm.batcher
    shapes = distinct_shapes(dm.train_index)
    expected = DualConstraintBatcher(max_tokens=512, cost_model=TRUE).resolve_max_compute(shapes)
    assert dm.batcher.max_compute == pytest.approx(expected)
    after = dm.train_dataset.make_plan(0)
    assert after.report["batches"] != before.report["batches"]  # the new costs size the batches
    assert dm.train_dataset.plan_settings()["batcher"]["cost_model"] == TRUE.to_dict()  # saved for a resume
    fixed = AdaptiveLoadDataModule(
        data,
        batching=Batching(max_tokens=512, max_compute=300.0, cost_model=power),
        loader=Loader(num_workers=0),
    )
    with pytest.raises(ValueError, match="max_compute=300.0 is in the unit of the current cost model"):
        fixed.set_cost_model(TRUE)

"""LoadBalanceMonitor's refit option in one process: cadence, logging, files, hand-off and checkpoint."""

from __future__ import annotations

import json
import os

import lightning as L
import numpy as np
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.monitor.timing import ManualClock
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel

TRUE = CostModel(kind="quadratic", alpha=1e-3, beta=2e-5, c0=0.4)
# (B, S) of the steps: four lengths, three batch sizes each, twice (c0 is told apart by B).
SHAPES = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)] * 2


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
        # (mode "dual" needs resize_batches: test_dual_mode_applies_the_refit_only_with_resize_batches).
        self.batcher = DualConstraintBatcher(max_tokens=512, sizing="equal_tokens")
        self.events: list = []

    def set_cost_model(self, model: CostModel) -> None:
        self.events.append(("model", model))

    def train_dataloader(self):
        self.events.append(("loader", int(self.trainer.current_epoch)))
        return DataLoader(Batches(), batch_size=None)


def _fit(tmp_path, max_epochs: int, refit, ckpt: str | None = None, dm: Recording | None = None):
    clock = ManualClock()
    monitor = LoadBalanceMonitor(
        dirpath=tmp_path, refit=refit, clock=clock, count_flops=False, plots=False, print_summary=False
    )
    dm = dm or Recording()
    trainer = quiet_cpu_trainer(
        tmp_path,
        max_epochs=max_epochs,
        log_every_n_steps=4,
        callbacks=[monitor],
        reload_dataloaders_every_n_epochs=1,
    )
    trainer.fit(Timed(clock), datamodule=dm, ckpt_path=ckpt)
    return trainer, monitor, dm


def test_refit_every_n_steps_and_at_epoch_end_logs_writes_and_hands_off(tmp_path):
    trainer, monitor, dm = _fit(tmp_path, 1, {"every_n_steps": 16, "warmup_steps_per_class": 0})
    lines = [json.loads(x) for x in open(tmp_path / "cost_refit.jsonl")]
    assert [(x["epoch"], x["step"]) for x in lines] == [(0, 16), (0, 24)]
    assert lines[0]["status"] == "fitted" and lines[0]["applied"]
    # The second window (8 steps) cannot carry three terms: only the scale of the first fit is refitted.
    assert lines[1]["status"] == "scaled" and "fewer than 12" in lines[1]["reason"]
    models = [m for kind, m in dm.events if kind == "model"]
    assert len(models) == 2
    assert abs(models[0].beta / TRUE.beta - 1) < 1e-6 and abs(models[0].c0 / TRUE.c0 - 1) < 1e-6
    assert trainer.callback_metrics["balance/refit/beta"].item() == pytest.approx(models[1].beta, rel=1e-6)
    assert monitor.state_dict()["cost_refit"]["model"] == models[1].to_dict()


def test_refit_off(tmp_path):
    _, monitor, dm = _fit(tmp_path, 1, False)
    assert monitor.state_dict() == {} and not os.path.exists(tmp_path / "cost_refit.jsonl")
    assert [e for e in dm.events if e[0] == "model"] == []


def test_a_resumed_fit_hands_the_learned_model_over_before_planning(tmp_path):
    trainer, monitor, _ = _fit(tmp_path / "a", 1, True)
    learned = monitor._refitter.model
    assert learned is not None and learned != CostModel.default()
    ckpt = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(ckpt)
    dm = Recording()
    _fit(tmp_path / "b", 2, True, ckpt=ckpt, dm=dm)
    # Restored before the epoch's loader is asked for: the epoch after the checkpoint plans with it.
    assert dm.events[0] == ("model", learned)
    assert dm.events.index(("loader", 1)) > 0


def test_bad_refit_setting_is_named():
    with pytest.raises(ValueError, match="unknown keys \\['every_n_step'\\]"):
        LoadBalanceMonitor(refit={"every_n_step": 5})
    with pytest.raises(ValueError, match="refit must be True, False, a RefitConfig"):
        LoadBalanceMonitor(refit="yes")


def test_numeric_cap_logs_the_refit_without_applying_it(tmp_path):
    dm = Recording()
    dm.batcher = DualConstraintBatcher(
        max_tokens=512, max_compute=300.0, cost_model={"kind": "power", "p": 1.5}
    )
    with pytest.warns(UserWarning, match="max_compute=300.0 is a number"):
        _fit(tmp_path, 1, {"warmup_steps_per_class": 0}, dm=dm)
    line = json.loads(open(tmp_path / "cost_refit.jsonl").read().splitlines()[-1])
    assert not line["applied"] and "max_compute=300.0" in line["not_applied_because"]
    assert [e for e in dm.events if e[0] == "model"] == []
    # A model that was not applied is not applied on resume either (a regression test).
    monitor = LoadBalanceMonitor(refit=True)
    monitor._trainer = type("T", (), {"datamodule": Recording()})()
    state = _fit(tmp_path / "again", 1, {"warmup_steps_per_class": 0}, dm=dm)[1].state_dict()
    assert state["cost_refit"]["applied"] is False
    monitor.load_state_dict(state)
    assert monitor._trainer.datamodule.events == []
    monitor.load_state_dict({**state, "cost_refit": {**state["cost_refit"], "applied": True}})
    assert [kind for kind, _ in monitor._trainer.datamodule.events] == ["model"]
    assert np.isfinite(line["error"]["all"]["mean"])


def test_dual_mode_applies_the_refit_only_with_resize_batches(tmp_path, caplog):
    dm = Recording()
    dm.batcher = DualConstraintBatcher(max_tokens=512)  # mode "dual", max_compute "auto"
    _fit(tmp_path / "default", 1, {"warmup_steps_per_class": 0}, dm=dm)
    line = json.loads(open(tmp_path / "default" / "cost_refit.jsonl").read().splitlines()[-1])
    assert not line["applied"] and "resize_batches" in line["not_applied_because"]
    assert [e for e in dm.events if e[0] == "model"] == []
    _fit(tmp_path / "resize", 1, {"warmup_steps_per_class": 0, "resize_batches": True}, dm=dm)
    assert [e[0] for e in dm.events if e[0] == "model"] == ["model"]


def test_datamodule_set_cost_model_plans_the_next_epoch_with_it(synthetic_shards):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.planning.inputs import distinct_shapes

    data = synthetic_shards([16] * 4, seed=1)
    dm = AdaptiveLoadDataModule(data, max_tokens=512, num_workers=0, cost_model={"kind": "power", "p": 1.0})
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
        max_tokens=512,
        num_workers=0,
        max_compute=300.0,
        cost_model={"kind": "power", "p": 1.0},
    )
    with pytest.raises(ValueError, match="max_compute=300.0 is in the unit of the current cost model"):
        fixed.set_cost_model(TRUE)

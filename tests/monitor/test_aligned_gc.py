"""AlignedGC: no automatic collection during the fit, collections at fixed global steps, everything restored."""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch
from _fixtures import quiet_cpu_trainer

from lightning_adaptiveload import AlignedGC


class Steps(pl.LightningModule):
    """Records, at every step, whether automatic collection is on and how many objects are frozen; makes a
    reference cycle per step (garbage only a collection frees)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[int, bool, int]] = []
        self.training = False  # between the hooks below (the callback's on_train_start runs first)

    def on_train_start(self):
        self.training = True

    def on_train_end(self):
        self.training = False

    def training_step(self, batch, batch_idx):
        cycle: list = []
        cycle.append(cycle)
        self.seen.append((int(self.global_step), gc.isenabled(), gc.get_freeze_count()))
        return (self.w * batch.sum() - 1.0).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(10, 2), batch_size=1)


def _fit(tmp_path, callback: AlignedGC, module: pl.LightningModule, **trainer) -> None:
    quiet_cpu_trainer(tmp_path, max_epochs=1, callbacks=[callback], **trainer).fit(module)


def test_collections_run_at_the_same_global_steps_and_nothing_else_collects(tmp_path):
    assert gc.isenabled() and gc.get_freeze_count() == 0
    during: list[int] = []
    callback, module = AlignedGC(every_n_steps=3, full_every_n_steps=5), Steps()

    def watch(phase, info):  # every collection during training, ours or automatic
        if phase == "start" and module.training:
            during.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        _fit(tmp_path, callback, module)
    finally:
        gc.callbacks.remove(watch)
    assert all(not enabled for _, enabled, _ in module.seen), "automatic collection was on during a step"
    assert all(frozen > 0 for _, _, frozen in module.seen), "nothing was frozen at the start"
    # The start's full collection (global step 0), then after steps 3, 5, 6, 9 and 10 (full at 5 and 10).
    assert [(step, gen) for step, gen, _ in callback.pauses] == [
        (0, 2),
        (3, 1),
        (5, 2),
        (6, 1),
        (9, 1),
        (10, 2),
    ]
    assert during == [gen for _, gen, _ in callback.pauses[1:]]  # no collection of its own
    assert gc.isenabled() and gc.get_freeze_count() == 0  # restored


def test_a_failing_fit_restores_collection(tmp_path):
    class Fails(Steps):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, AlignedGC(), Fails())
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_accumulated_batches_collect_once_per_step_and_an_epoch_end_collects_in_full(tmp_path):
    callback, module = AlignedGC(every_n_steps=1, full_every_n_steps=None, freeze=False), Steps()
    _fit(tmp_path, callback, module, accumulate_grad_batches=2)
    steps = [step for step, gen, _ in callback.pauses if gen == 1]
    assert steps == [1, 2, 3, 4, 5]  # 10 batches, 5 optimizer steps: one collection each
    assert callback.pauses[-1][1] == 2  # the epoch's end
    assert gc.get_freeze_count() == 0


def test_automatic_collection_left_off_stays_off(tmp_path):
    gc.disable()
    try:
        _fit(tmp_path, AlignedGC(freeze=False), Steps())
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_step_counts_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match=r"AlignedGC: every_n_steps must be an integer >= 1, got"):
        AlignedGC(every_n_steps=bad)
    with pytest.raises(ValueError, match=r"AlignedGC: full_every_n_steps must be an integer >= 1, got"):
        AlignedGC(full_every_n_steps=bad)

"""The planned loaders in every Lightning loop: length from the plan, test/predict data, rebuilding by
Lightning, the per-sample transform, fixed text padding; and ``index`` keeping ``synth``'s metadata."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader

from lightning_adaptiveload.cli.data import index_main
from lightning_adaptiveload.datamodule import (
    AdaptiveLoadDataModule,
    PlannedDataLoader,
    PlannedShardDataset,
)
from lightning_adaptiveload.loading.collate import collate
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards([15, 25], seed=3, name="hooks", text_len_range=(1, 6))


def _keys(d: str) -> list[str]:
    return [k for s in ShardIndex.load(os.path.join(d, "index.json")).shards for k in s.keys]


def test_loader_length_is_each_epochs_planned_steps(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    dm.setup("fit")
    for epoch in range(3):
        loader = dm.train_dataloader()
        n = len(loader)  # asked before iterating, as Lightning does: plans the epoch, then iterates that plan
        batches = list(loader)
        assert dm.epoch_report["epoch"] == epoch
        assert n == len(batches) == dm.epoch_report["steps"] > 0


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[str, list[str]] = {"fit": [], "predict": []}
        self.epoch_steps: list[int] = []
        self.val_epochs: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.epoch_steps.append(self.trainer.num_training_batches)

    def training_step(self, batch, batch_idx):
        self.seen["fit"] += batch["keys"]
        return self.w * batch["latents"].float().mean()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.val_epochs.append(self.current_epoch)

    def predict_step(self, batch, batch_idx):
        self.seen["predict"] += batch["keys"]
        return batch["keys"]

    def test_step(self, batch, batch_idx):
        self.log("n", float(batch["batch_size"]), reduce_fx="sum")

    def configure_optimizers(self):
        # Sized for the longest run the plans allow (estimated_stepping_batches is epoch 0's count x 3 here).
        sched_steps = self.trainer.estimated_stepping_batches
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=sched_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.timeout(180)
def test_trainer_knows_epoch_length_and_runs_test_and_predict(data, tmp_path, monkeypatch):
    # Odd epochs plan 10 samples fewer, so the epochs differ in length as they can in a real run.
    real = PlannedShardDataset.make_plan

    def make_plan(self, epoch, settings=None, exclude=None, local=False):
        if self.fixed_epoch is None and epoch % 2 and exclude is None:
            exclude = {(0, i) for i in range(10)}
        return real(self, epoch, settings, exclude, local)

    monkeypatch.setattr(PlannedShardDataset, "make_plan", make_plan)
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        val_shards=data,
        test_shards=data,
        predict_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    model = _Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=3,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)  # OneCycleLR raises on total_steps=-1
    assert trainer.reload_dataloaders_every_n_epochs == 1
    steps = [dm.train_dataset.make_plan(e).steps for e in range(3)]
    assert steps[0] > steps[1] and steps[0] == steps[2]
    assert model.epoch_steps == steps  # the trainer's count of every epoch is that epoch's own plan
    assert trainer.global_step == sum(steps)
    assert model.val_epochs == [0, 1, 2]  # validation ran at the end of every epoch, short or long
    assert len(model.seen["fit"]) == 40 + 30 + 40

    trainer.test(model, datamodule=dm)
    assert trainer.callback_metrics["n"].item() == 40
    # Lightning rebuilds the predict loader to inject its samplers: the planned loader survives it.
    trainer.predict(model, datamodule=dm)
    assert sorted(model.seen["predict"]) == sorted(_keys(data))


@pytest.mark.timeout(180)
def test_every_epoch_is_planned_once(data, tmp_path, monkeypatch, caplog):
    # Lightning creates the training iterator twice in every epoch after the first when it reloads the
    # loader (FitLoop.setup_data, then the epoch loop's on_run_start); each iterator planned its epoch anew,
    # so epochs 1.. were planned (and their "epoch N" line printed) twice.
    import collections
    import logging

    calls: collections.Counter = collections.Counter()
    real = PlannedShardDataset.make_plan

    def make_plan(self, epoch, settings=None, exclude=None, local=False):
        if self.fixed_epoch is None:  # a training plan (validation plans once, epoch 0, fixed)
            calls[epoch] += 1
        return real(self, epoch, settings, exclude, local)

    monkeypatch.setattr(PlannedShardDataset, "make_plan", make_plan)
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        val_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    model = _Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=dm)
    assert dict(calls) == {0: 1, 1: 1, 2: 1, 3: 1}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[adaptiveload] epoch ")]
    assert [line.split(":")[0] for line in lines] == [f"[adaptiveload] epoch {e}" for e in range(4)]
    assert len(model.seen["fit"]) == 4 * 40  # every epoch still ran its whole plan, each sample once


def test_lightning_can_rebuild_the_loader_for_predict(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        predict_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    dm.setup("predict")
    loader = dm.predict_dataloader()
    rebuilt = _update_dataloader(loader, None, mode=RunningStage.PREDICTING)
    assert isinstance(rebuilt, PlannedDataLoader)
    assert sorted(k for b in rebuilt for k in b["keys"]) == sorted(_keys(data))
    with pytest.raises(ValueError, match="no sampler"):
        PlannedDataLoader(dm.predict_dataset, sampler=[0, 1])


def _flip(sample):
    return {**sample, "latent": sample["latent"].flip(-1), "text": None}


def _crop(sample):
    return {**sample, "latent": sample["latent"][..., :2]}


def test_sample_transform_runs_per_sample_and_keeps_the_planned_shape(data):
    plain = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    flipped = AdaptiveLoadDataModule(
        train_shards=data,
        sample_transform=_flip,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=2),
    )
    for dm in (plain, flipped):
        dm.setup("fit")
    a = {k: (b["latents"][i], b["text"]) for b in plain.train_dataloader() for i, k in enumerate(b["keys"])}
    b = {k: (x["latents"][i], x["text"]) for x in flipped.train_dataloader() for i, k in enumerate(x["keys"])}
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(b[k][0], a[k][0].flip(-1))  # in the workers, every sample once
        assert b[k][1] is None  # caption dropped by the transform

    bad = AdaptiveLoadDataModule(
        train_shards=data,
        sample_transform=_crop,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    bad.setup("fit")
    with pytest.raises(ValueError, match=r"sample_transform _crop changed sample '.+'s latent from"):
        list(bad.train_dataloader())
    with pytest.raises(ValueError, match="must be callable"):
        AdaptiveLoadDataModule(train_shards=data, sample_transform="not a function")


def test_text_pad_to_gives_one_text_length(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0, text_pad_to=8),
    )
    dm.setup("fit")
    for batch in dm.train_dataloader():
        assert batch["text"].shape[:2] == (batch["batch_size"], 8) == batch["text_mask"].shape
    sample = {"__key__": "long", "latent": torch.zeros(4, 1, 2, 2), "text": torch.ones(9, 3)}
    with pytest.raises(ValueError, match="'long' has 9 text states, more than text_pad_to=8"):
        collate([sample], text_pad_to=8)


def test_synth_after_index_reuses_the_data(tmp_path):
    d = str(tmp_path / "syn")
    settings = SyntheticShards(mix="tiny", num_samples=12, samples_per_shard=6, seed=0)
    write_synthetic_shards(d, settings, progress=False)
    assert index_main([d, "--rebuild", "--no-progress"]) == 0
    again = write_synthetic_shards(
        d, settings, progress=False
    )  # raised "already holds an index of other data" before
    assert again.metadata.get("synthetic") and again.num_samples == 12


@pytest.mark.timeout(180)
def test_video_dit_module_tests_and_predicts(data, tmp_path):
    # The quickstart's `test` and `predict` subcommands failed: VideoDiTModule had no test_step/predict_step.
    from lightning_adaptiveload.models.module import SamplingSettings, VideoDiTModule

    dm = AdaptiveLoadDataModule(
        train_shards=data,
        test_shards=data,
        predict_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = VideoDiTModule(preset="tiny", sampling=SamplingSettings(shift=1.0))
    (result,) = trainer.test(model, datamodule=dm)
    assert result["test/loss"] > 0
    predictions = trainer.predict(model, datamodule=dm)
    keys = [k for p in predictions for k in p["keys"]]
    assert sorted(keys) == sorted(_keys(data))
    assert all(p["loss"].shape == (len(p["keys"]),) and (p["loss"] > 0).all() for p in predictions)

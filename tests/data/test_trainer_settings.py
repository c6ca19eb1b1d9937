"""The DataModule makes no hidden edits to the Trainer (issue 39, item 3): the setting Lightning needs
(``reload_dataloaders_every_n_epochs=1``) is set by the CLI or refused by name, and the resume position
comes from the DataModule's own loader (its counting iterator), not from Lightning's fit loop."""

from __future__ import annotations

import os
from types import SimpleNamespace

import _paths
import lightning as L
import pytest
import torch
from _fixtures import quiet_cpu_trainer

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.loader import check_reload_every_epoch
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

ROOT = str(_paths.ROOT)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("trainer-settings"))
    write_synthetic_shards(
        d, settings=SyntheticShards(mix="tiny", num_samples=24, samples_per_shard=12, seed=2), progress=False
    )
    return d


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return (self.w - 1.0) ** 2 * sum(len(k) for k in batch["keys"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_check_reload_every_epoch_names_the_setting():
    check_reload_every_epoch(None)  # plain PyTorch use: no trainer, nothing to check
    check_reload_every_epoch(SimpleNamespace(reload_dataloaders_every_n_epochs=1, max_epochs=5))
    check_reload_every_epoch(SimpleNamespace(reload_dataloaders_every_n_epochs=0, max_epochs=1))
    for max_epochs in (2, -1, None):
        with pytest.raises(ValueError, match=r"Trainer\(reload_dataloaders_every_n_epochs=1\)") as err:
            check_reload_every_epoch(
                SimpleNamespace(reload_dataloaders_every_n_epochs=0, max_epochs=max_epochs)
            )
        assert "got reload_dataloaders_every_n_epochs=0" in str(err.value)


@pytest.mark.timeout(120)
def test_a_trainer_without_the_setting_is_refused_before_any_step_and_left_as_it_was(data, tmp_path):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    trainer = quiet_cpu_trainer(tmp_path, max_epochs=2)
    model = _Tiny()
    with pytest.raises(ValueError, match=r"reload_dataloaders_every_n_epochs=1"):
        trainer.fit(model, datamodule=dm)
    assert model.steps == 0
    assert trainer.reload_dataloaders_every_n_epochs == 0  # refused, never changed


@pytest.mark.timeout(120)
def test_one_epoch_needs_no_setting_and_several_run_with_it(data, tmp_path):
    one = quiet_cpu_trainer(tmp_path, max_epochs=1)
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    one.fit(_Tiny(), datamodule=dm)
    assert one.global_step == dm.epoch_report["steps"] > 0
    several = quiet_cpu_trainer(tmp_path, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    dm2 = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    several.fit(_Tiny(), datamodule=dm2)
    steps = [dm2.train_dataset.make_plan(e).steps for e in range(2)]
    assert several.global_step == sum(steps)


def test_the_cli_sets_the_setting_unless_the_recipe_does(tmp_path):
    from lightning_adaptiveload.cli.fit import TRAINER_DEFAULTS, build_cli

    assert TRAINER_DEFAULTS == {"reload_dataloaders_every_n_epochs": 1}
    recipe = os.path.join(ROOT, "lightning_adaptiveload", "recipes", "quickstart.yaml")
    base = ["--config", recipe, f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    cli = build_cli(base, run=False)
    assert cli.trainer.reload_dataloaders_every_n_epochs == 1 and cli.trainer.max_epochs > 1
    # A user's own trainer_defaults keep the CLI's, and the recipe or command line still wins.
    cli = build_cli(base, run=False, trainer_defaults={"max_epochs": 3})
    assert cli.trainer.reload_dataloaders_every_n_epochs == 1
    cli = build_cli([*base, "--trainer.reload_dataloaders_every_n_epochs=2"], run=False)
    assert cli.trainer.reload_dataloaders_every_n_epochs == 2


def test_the_resume_position_is_the_loaders_count_not_the_fit_loops(data, monkeypatch):
    # A trainer with no fit loop at all: the position can only come from the loader's counting iterator.
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (0, 1))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=300),
        loader=Loader(num_workers=0),
    )
    dm.trainer = SimpleNamespace(current_epoch=0, lightning_module=None, global_rank=0, world_size=1)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    assert dm.train_dataset.batches_yielded == 3
    state = dm.state_dict()
    assert state["epoch"] == 0 and state["segments"][-1]["consumed"] == [3]
    rest = list(it)
    assert dm.state_dict()["segments"][-1]["consumed"] == [3 + len(rest)] == [dm.epoch_report["steps"]]
    dm.trainer.current_epoch = 1  # the trainer went on: the epoch counts as consumed whole
    assert dm.state_dict()["segments"][-1]["consumed"] == [dm.epoch_report["steps"]]


def test_an_exhausted_restart_is_ended_once_and_only_when_restarting():
    from types import SimpleNamespace

    from lightning_adaptiveload._lightning_compat import end_exhausted_restart

    loop = SimpleNamespace(restarting=True)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop))
    assert end_exhausted_restart(trainer) is True and loop.restarting is False
    assert end_exhausted_restart(trainer) is False  # not restarting: nothing to do
    assert end_exhausted_restart(None) is False and end_exhausted_restart(SimpleNamespace()) is False

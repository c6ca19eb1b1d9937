"""A 2-process gloo fit of the tiny VideoDiT with schedule="packed" through the DataModule (CPU), and the
refusal of a module that runs no packs, before its first step."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from _fixtures import index_keys
from _recording import fit_two_ranks

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

SIZES = [9, 3, 7, 5]
MAX_TOKENS = 768


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=5)


def test_packed_fit_two_ranks(shards, tmp_path):
    base = str(tmp_path / "rec.rank{}.jsonl")
    dm = AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=MAX_TOKENS),
        plan=PlanSettings(schedule="packed"),
        loader=Loader(num_workers=0),
    )
    rows = fit_two_ranks(dm, base)
    assert len(rows[0]) == len(rows[1]) > 0  # equal steps
    assert all(r["packed"] for rank in rows for r in rank)
    taken = [k for rank in rows for r in rank for k in r["keys"]]
    assert sorted(taken) == sorted(index_keys(shards))  # every sample exactly once
    for rank in rows:
        for r in rank:
            assert r["num_tokens"] <= MAX_TOKENS
            assert r["cu_seqlens"][-1] == r["num_tokens"]
    # Packs mix shapes (what the bucketed schedules never do).
    assert any(len({tuple(s) for s in r["shapes"]}) > 1 for rank in rows for r in rank)


def test_packed_fit_two_ranks_with_the_kernel_warmup(shards, tmp_path, capfd):
    # The warm-up runs block 0 outside DDP's forward, with gradients to its input only: DDP's reducer must
    # see nothing of it (a parameter marked ready out of turn fails the next all-reduce), and every rank
    # trains the same batches as without it.
    from lightning_adaptiveload.callbacks.kernel_warmup import KernelWarmup

    rows = []
    for name, callbacks in (("plain", None), ("warm", [KernelWarmup()])):
        dm = AdaptiveLoadDataModule(
            train_shards=shards,
            batching=Batching(max_tokens=MAX_TOKENS),
            plan=PlanSettings(schedule="packed"),
            loader=Loader(num_workers=0),
        )
        rows.append(fit_two_ranks(dm, str(tmp_path / f"{name}.rank{{}}.jsonl"), callbacks))
    assert [[r["keys"] for r in rank] for rank in rows[0]] == [[r["keys"] for r in rank] for rank in rows[1]]
    out = capfd.readouterr()
    assert "[adaptiveload] kernel warm-up, epoch 0: " in out.out + out.err  # it ran (rank 0 says so)


class _NoPacks(L.LightningModule):
    """A module of one's own that reads ``batch["latents"]`` as one tensor: it cannot run packs (and has no
    ``runs_packed_batches`` attribute)."""

    def __init__(self, marker: str = "") -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.marker = marker

    def training_step(self, batch, batch_idx):
        open(self.marker, "a").close()  # a step ran: the refusal came too late
        return self.w * batch["latents"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SaysNoPacks(_NoPacks):
    runs_packed_batches = False


@pytest.mark.parametrize("module", [_NoPacks, _SaysNoPacks])
def test_packed_schedule_refuses_a_module_without_packs(shards, module):
    # Before, the packed schedule never asked: the module got packs and failed deep inside its first step
    # ("'list' object has no attribute 'float'"), or trained silently on what it misread.
    dm = AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=MAX_TOKENS),
        plan=PlanSettings(schedule="packed"),
    )
    said = (
        "sets runs_packed_batches = False" if module is _SaysNoPacks else "does not set runs_packed_batches"
    )
    with pytest.raises(ValueError, match=f"{module.__name__} {said}") as err:
        dm.check_module(module())
    assert "data.init_args.plan.schedule" in str(err.value) and "'lockstep' or 'independent'" in str(
        err.value
    )
    dm.check_module(VideoDiTModule(preset="tiny"))  # runs packs
    dm.check_module(None)  # plain PyTorch: nobody to ask
    for schedule in ("independent", "lockstep"):
        AdaptiveLoadDataModule(
            train_shards=dm.train_shards,
            plan=PlanSettings(schedule=schedule),
        ).check_module(module())


@pytest.mark.timeout(240)
def test_packed_schedule_refuses_before_the_first_step_on_every_rank(shards, tmp_path):
    # 2 ranks (ddp_spawn, gloo): both raise in setup, before any collective of the fit, so neither waits
    # for the other; no training step runs.
    marker = str(tmp_path / "a_step_ran")
    dm = AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=MAX_TOKENS),
        plan=PlanSettings(schedule="packed"),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(Exception, match="_NoPacks does not set runs_packed_batches = True"):
        trainer.fit(_NoPacks(marker), datamodule=dm)
    assert not os.path.exists(marker)


def test_cli_refuses_the_module_before_it_prepares_data(tmp_path):
    # The launching process checks the module first: no data is written, no rank is started.
    from types import SimpleNamespace

    from lightning_adaptiveload.cli.fit import _check_before_fit

    where = tmp_path / "would_be_written"
    dm = AdaptiveLoadDataModule(
        train_shards=str(where),
        synthetic={"mix": "tiny", "num_samples": 8},
        plan=PlanSettings(schedule="packed"),
    )
    with pytest.raises(ValueError, match="runs_packed_batches"):
        _check_before_fit(SimpleNamespace(local_rank=0), dm, _NoPacks())
    assert not where.exists()

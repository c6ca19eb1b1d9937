"""KernelWarmup: an epoch's batch shapes run once through the first block before the first step.

What it must do, on CPU: list exactly the batches the loader will yield; cover every dense batch and every
run of a mixed pack; run the same graphs as training (a compiled model compiles nothing more once training
starts); change nothing that trains (parameters, gradients, the random streams); refuse what it cannot do.
"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from _fixtures import quiet_cpu_trainer

from lightning_adaptiveload import Batching, Loader, PlanSettings
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.models.acceleration import compile_blocks, compiled_graphs
from lightning_adaptiveload.models.kernel_warmup import (
    planned_batches,
    warm_kernels,
    warm_packs,
)
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.models.pack_attention import equal_runs
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig
from lightning_adaptiveload.callbacks.kernel_warmup import KernelWarmup

_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)
PATCH = (1, 2, 2)
GRIDS = [(1, 4, 4), (2, 4, 4), (1, 6, 6), (1, 4, 6), (3, 2, 2), (2, 2, 2)]


def _shape(grid):
    return (16, *grid)


def _tokens(shape):
    return shape[1] * (shape[2] // 2) * (shape[3] // 2)


def _random_batches(seed: int, count: int = 30):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.3:  # a bucketed batch
            out.append((_shape(rng.choice(GRIDS)),) * rng.randint(1, 4))
        else:
            out.append(tuple(_shape(rng.choice(GRIDS)) for _ in range(rng.randint(1, 6))))
    return out


def _runs(batch):
    return equal_runs([_tokens(s) for s in batch])


@pytest.mark.parametrize("seed", range(8))
def test_warm_packs_take_every_dense_batch_and_every_run_once(seed):
    batches = _random_batches(seed)
    seen: set = set()
    packs = warm_packs(batches, PATCH, seen)
    dense_in = {b for b in batches if len(set(map(_tokens, b))) == 1}
    runs_in = {r for b in batches if len(set(map(_tokens, b))) > 1 for r in _runs(b)}
    dense_out = [tuple(p) for p in packs if len(set(map(_tokens, p))) == 1]
    mixed_out = [p for p in packs if len(set(map(_tokens, p))) > 1]
    assert sorted(dense_out) == sorted(dense_in)  # each once
    runs_out = [r for p in mixed_out for r in _runs(p)]
    assert runs_in <= set(runs_out)  # every run, as a run of a mixed pack (never merged with a neighbour)
    counts_in = {len(b) for b in batches if len(set(map(_tokens, b))) > 1}
    assert counts_in <= {len(p) for p in mixed_out}  # every sample count of a mixed pack (torch 2.11 guards it)
    assert len(mixed_out) <= len(runs_in) + len(counts_in)
    cap = max(sum(map(_tokens, b)) for b in batches)
    shortest = min(_tokens(s) for b in batches if len(set(map(_tokens, b))) > 1 for s in b)
    for p in mixed_out:
        lengths = [length for length, _ in _runs(p)]
        assert len(lengths) == len(set(lengths))  # one run per length
        assert sum(map(_tokens, p)) <= cap + max(shortest, max(lengths))  # the cap, but for a partner
    # The same batches again: nothing new. A new run alone is taken, with a partner.
    assert warm_packs(batches, PATCH, seen) == []
    new = (_shape((1, 2, 2)),) * 7 + (_shape((1, 6, 6)),)  # a run of 7 one-token samples: new
    again = warm_packs([new], PATCH, seen)
    assert len(again) == 1 and (1, 7) in _runs(again[0]) and len(set(map(_tokens, again[0]))) == 2


def test_warm_packs_of_nothing():
    assert warm_packs([], PATCH) == []
    assert warm_packs([(_shape((1, 4, 4)),) * 2], PATCH) == [[_shape((1, 4, 4))] * 2]


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards([9, 3, 7, 5], seed=5, name="warm")


def _datamodule(shards: str, schedule: str) -> AdaptiveLoadDataModule:
    return AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=768),
        plan=PlanSettings(schedule=schedule),
        loader=Loader(num_workers=0),
    )


@pytest.mark.parametrize("schedule", ["packed", "lockstep", "independent"])
def test_planned_batches_are_what_the_loader_yields(shards, schedule):
    dm = _datamodule(shards, schedule)
    dm.setup("fit")
    yielded = [
        tuple(tuple(x.shape) for x in (b["latents"] if b.get("packed") else b["latents"].unbind(0)))
        for b in dm.train_dataloader()
    ]
    ds = dm.train_dataset
    assert list(planned_batches(ds.plan, ds.rank, ds.index.latent_shape)) == yielded
    assert len(yielded) > 3


def _model(seed: int = 0, compiled: bool = False) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG)).train()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    model.set_activation_checkpointing(True, "save_attention")
    if compiled:
        compile_blocks(model, backend="aot_eager")
    return model


def _train_step(model: VideoDiT, batch, g: torch.Generator) -> None:
    n = len(batch)
    latents = [torch.randn(s, generator=g) for s in batch]
    mask = torch.ones(n, 7, dtype=torch.bool)
    out = model(latents, torch.rand(n, generator=g) * 1000, torch.randn(n, 7, 16, generator=g), mask)
    sum(o.square().sum() for o in out).backward()


def test_warm_up_changes_nothing_that_trains():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    packs = warm_packs(_random_batches(1, 12), PATCH)
    assert warm_kernels(model, packs, (7, torch.float32), torch.device("cpu")) == len(packs) > 2
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)  # its random inputs come from a generator of its own


def test_a_compiled_model_compiles_nothing_more_in_training_after_the_warm_up():
    batches = _random_batches(2, 10)
    per_batch = {}
    for warm in (False, True):
        torch._dynamo.reset()
        model = _model(compiled=True)
        if warm:
            warm_kernels(model, warm_packs(batches, PATCH), (7, torch.float32), torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        counts = []
        for batch in batches:
            start = compiled_graphs()
            _train_step(model, batch, g)
            counts.append(compiled_graphs() - start)
        per_batch[warm] = counts
    assert sum(per_batch[False]) > 0  # without it, training compiles (the test can fail)
    assert per_batch[True] == [0] * len(batches), per_batch


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(tmp_path, shards, callbacks, epochs: int = 2):
    torch.manual_seed(0)
    module = VideoDiTModule(preset="tiny")
    dm = _datamodule(shards, "packed")
    record = _Record()
    trainer = quiet_cpu_trainer(
        tmp_path, max_epochs=epochs, callbacks=[*callbacks, record], reload_dataloaders_every_n_epochs=1
    )
    trainer.fit(module, datamodule=dm)
    return module, record.losses


def test_in_a_fit_it_runs_each_epoch_and_training_is_unchanged(tmp_path, shards, caplog):
    caplog.set_level("INFO")
    warm = KernelWarmup()
    plain_module, plain = _fit(tmp_path / "plain", shards, [])
    warm_module, losses = _fit(tmp_path / "warm", shards, [warm])
    assert losses == plain and len(losses) > 4
    for (name, p), q in zip(plain_module.named_parameters(), warm_module.parameters()):
        assert torch.equal(p, q), name
    assert [h["epoch"] for h in warm.history] == [0, 1]
    assert warm.history[0]["packs"] > 0
    assert sum(h["batches"] for h in warm.history) == len(losses)  # every planned batch read, one per step
    assert "[adaptiveload] kernel warm-up, epoch 0:" in caplog.text


class _OwnModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.model.weight.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)


def test_it_refuses_a_model_it_cannot_run_and_data_without_a_plan(tmp_path, shards):
    with pytest.raises(
        ValueError, match=r"KernelWarmup runs the blocks of a VideoDiT.*_OwnModel.model is Linear"
    ):
        quiet_cpu_trainer(tmp_path, max_steps=1, callbacks=[KernelWarmup()]).fit(_OwnModel())

    class _VideoWithOwnData(VideoDiTModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([{"latents": torch.zeros(1, 16, 1, 4, 4)}], batch_size=None)

    with pytest.raises(ValueError, match="KernelWarmup reads the epoch's plan"):
        quiet_cpu_trainer(tmp_path, max_steps=1, callbacks=[KernelWarmup()]).fit(
            _VideoWithOwnData(preset="tiny")
        )


def test_under_fsdp2_it_steps_aside_with_a_warning(tmp_path, shards, monkeypatch):
    # The two-process FSDP2 tests cost minutes; the decision is the model's sharding, faked here.
    from lightning_adaptiveload.models import warmup_callback

    monkeypatch.setattr(warmup_callback, "is_fsdp2_sharded", lambda module: True)
    warm = KernelWarmup()
    with pytest.warns(UserWarning, match="KernelWarmup does nothing under FSDP2"):
        _, losses = _fit(tmp_path, shards, [warm], epochs=1)
    assert warm.history == [] and len(losses) > 4


@pytest.mark.cuda
def test_on_a_gpu_a_compiled_model_under_autocast_compiles_nothing_more_after_the_warm_up():
    # Inductor's guards (strides, alignment, dynamic sizes) are stricter than aot_eager's: the warm-up must
    # meet the same graphs on the GPU path the recipes take (bf16 autocast, cuDNN attention on Hopper).
    device = torch.device("cuda")
    batches = _random_batches(3, 8)
    torch._dynamo.reset()
    model = _model().to(device)
    model.set_attention_backend("auto")
    compile_blocks(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        warm_kernels(model, warm_packs(batches, PATCH), (7, torch.float32), device)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(0)
    counts = []
    for batch in batches:
        n = len(batch)
        latents = [torch.randn(s, generator=g).to(device) for s in batch]
        text = torch.randn(n, 7, 16, generator=g).to(device)
        start = compiled_graphs()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(latents, (torch.rand(n, generator=g) * 1000).to(device), text, None)
            loss = sum(o.float().square().sum() for o in out)
        loss.backward()
        assert torch.isfinite(loss)
        counts.append(compiled_graphs() - start)
    assert counts == [0] * len(batches), counts

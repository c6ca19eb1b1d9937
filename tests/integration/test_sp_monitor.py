"""LoadBalanceMonitor under sequence parallelism: every rank of a group gets the group's batch, so the job's
tokens, samples and FLOPs count each group once (``step_table``'s ``sequence_degree``), not G times."""

from __future__ import annotations

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload import LoadBalanceMonitor
from lightning_adaptiveload.monitor import steps as st

BATCHES = [(2, 8), (1, 16), (4, 4), (2, 8)]  # (batch_size, seq_len)


def _record(step: int, tokens: float, samples: float, flops: float) -> np.ndarray:
    row = np.full(st.NUM_FIELDS, np.nan)
    for name, value in (
        ("step", step),
        ("batch_idx", step),
        ("epoch", 0),
        ("flags", 0),
        ("num_tokens", tokens),
        ("batch_size", samples),
        ("cost", tokens),
        ("flops", flops),
        ("compute_time_s", 1.0),
        ("iter_time_s", 2.0),
    ):
        row[st.FIELD_INDEX[name]] = value
    return row


def test_step_table_counts_each_sequence_group_once():
    """4 ranks as 2 groups of 2: ranks 0, 1 hold group 0's batch (100 tokens), ranks 2, 3 group 1's (60)."""
    per_rank = [(100, 2, 1e9), (100, 2, 1e9), (60, 3, 5e8), (60, 3, 5e8)]
    steps = np.stack([np.stack([_record(0, *r) for r in per_rank])])  # (1 step, 4 ranks, FIELDS)
    peaks, totals = np.full(4, 1e12), np.full(4, np.nan)
    plain = st.step_table(steps, peaks, totals, max_tokens=200.0)
    grouped = st.step_table(steps, peaks, totals, max_tokens=200.0, sequence_degree=2)
    assert grouped["tokens"][0] == 160 and plain["tokens"][0] == 320
    assert grouped["samples"][0] == 5 and grouped["flops"][0] == 1.5e9
    assert grouped["tokens_per_s"][0] == 80.0  # 160 tokens in the slowest rank's 2 s
    assert grouped["mfu"][0] == pytest.approx(1.5e9 / 2.0 / 4e12)
    # Balance and fill are per rank (a group's ranks hold the same batch): unchanged.
    for name in ("token_cv", "compute_cv", "fill", "rank_tokens_max"):
        np.testing.assert_equal(grouped[name], plain[name])


class _Batches(IterableDataset):
    def __iter__(self):
        for b, s in BATCHES:
            yield {
                "latents": torch.randn(b, 4),
                "seq_len": s,
                "batch_size": b,
                "num_tokens": b * s,
                "cost": float(b * s),
                "global_tokens": -1,
            }


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.lin(batch["latents"]).pow(2).mean()

    def flops_per_batch(self, batch):
        return 7.0 * batch["num_tokens"]  # the batch's FLOPs: under SP, the group's batch

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_Batches(), batch_size=None)


class _SequenceStrategy(SingleDeviceStrategy):
    """One process that says it is a rank of a sequence group of 2 (what ``_dist.sequence_degree`` reads)."""

    sequence_parallel_size = 2


@pytest.mark.parametrize("degree", [1, 2])
def test_the_monitor_reads_the_degree_from_the_strategy(tmp_path, degree):
    monitor = LoadBalanceMonitor(write_files=False, plots=False, print_summary=False)
    strategy = _SequenceStrategy(device="cpu") if degree == 2 else SingleDeviceStrategy(device="cpu")
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[monitor],
    )
    trainer.fit(_Module())
    summary = monitor.summary
    tokens = sum(b * s for b, s in BATCHES)
    assert summary["meta"]["sequence_parallel"] == degree
    assert summary["overall"]["tokens"] == tokens / degree
    assert summary["overall"]["samples"] == sum(b for b, _ in BATCHES) / degree

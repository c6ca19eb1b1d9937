"""A 2-process gloo fit of the tiny VideoDiT with schedule="packed" through the DataModule (CPU)."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch

from lightning_adaptiveload.data import ShardIndex, write_synthetic_shards
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.models.module import VideoDiTModule

SIZES = [9, 3, 7, 5]
MAX_TOKENS = 768


class _RecordingModule(VideoDiTModule):
    """Writes what every rank took at every step (keys, tokens, the pack's shapes) before training on it."""

    def __init__(self, path: str) -> None:
        super().__init__(preset="tiny")
        self.path = path

    def training_step(self, batch, batch_idx):
        row = {
            "epoch": int(self.current_epoch),
            "step": int(batch["step"]),
            "keys": list(batch["keys"]),
            "packed": bool(batch.get("packed")),
            "num_tokens": int(batch["num_tokens"]),
            "shapes": [list(x.shape) for x in batch["latents"]],
            "cu_seqlens": batch["cu_seqlens"].tolist() if batch.get("packed") else None,
        }
        with open(self.path.format(self.global_rank), "a") as f:
            f.write(json.dumps(row) + "\n")
        loss = super().training_step(batch, batch_idx)
        assert torch.isfinite(loss)
        return loss


def test_packed_fit_two_ranks(tmp_path):
    data = str(tmp_path / "shards")
    write_synthetic_shards(
        data, mix="tiny", num_samples=sum(SIZES), samples_per_shard=SIZES, seed=5, progress=False
    )
    base = str(tmp_path / "rec.rank{}.jsonl")
    dm = AdaptiveLoadDataModule(train_shards=data, max_tokens=MAX_TOKENS, schedule="packed", num_workers=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_RecordingModule(base), datamodule=dm)
    rows = [[json.loads(line) for line in open(base.format(r))] for r in range(2)]
    assert len(rows[0]) == len(rows[1]) > 0  # equal steps
    assert all(r["packed"] for rank in rows for r in rank)
    taken = [k for rank in rows for r in rank for k in r["keys"]]
    keys = [k for s in ShardIndex.load(os.path.join(data, "index.json")).shards for k in s.keys]
    assert sorted(taken) == sorted(keys)  # every sample exactly once
    for rank in rows:
        for r in rank:
            assert r["num_tokens"] <= MAX_TOKENS
            assert r["cu_seqlens"][-1] == r["num_tokens"]
    # Packs mix shapes (what the bucketed schedules never do).
    assert any(len({tuple(s) for s in r["shapes"]}) > 1 for rank in rows for r in rank)

"""A tiny ``VideoDiTModule`` that records what every rank took at every step, and a 2-rank ``ddp_spawn``
fit that returns those records: shared by the packed and lockstep-tail DDP tests."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import torch

from lightning_adaptiveload.models.module import VideoDiTModule


class RecordingModule(VideoDiTModule):
    """Writes what every rank took at every step (keys, tokens, the batch's shapes) before training on it."""

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


def fit_two_ranks(
    datamodule: pl.LightningDataModule, base: str, callbacks: list[pl.Callback] | None = None
) -> list[list[dict]]:
    """One epoch of :class:`RecordingModule` on 2 CPU ranks (``ddp_spawn``, gloo), with ``callbacks``; per rank,
    its records (``base`` holds ``{}`` for the rank)."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(RecordingModule(base), datamodule=datamodule)
    return [[json.loads(line) for line in open(base.format(r))] for r in range(2)]

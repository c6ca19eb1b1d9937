"""A module that fails on rank 1 only, for the CLI's test of which error a 2-process run shows last."""

from __future__ import annotations

from lightning_adaptiveload.models.module import VideoDiTModule


class FailsOnRankOne(VideoDiTModule):
    """``VideoDiTModule`` whose first training step raises on global rank 1 (rank 0 then loses its peer)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            raise RuntimeError("rank one broke on purpose (the root cause)")
        return super().training_step(batch, batch_idx)

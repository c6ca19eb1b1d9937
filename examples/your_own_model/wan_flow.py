"""A LightningModule of your own on the adaptive data path: rectified flow around diffusers' Wan.

Nothing here subclasses the suite's ``VideoDiTModule``: the module reads the batch dict of
``docs/data_path.md``, weights its loss with :func:`lightning_adaptiveload.token_weighted_loss`, draws
noise from :func:`lightning_adaptiveload.rank_noise_generator`, fuses its norm + modulate sites with
:class:`lightning_adaptiveload.FusedNormModulateMixin`, and takes packed batches (``runs_packed_batches``) by
running a pack's samples one by one. Run it with ``wan_flow.yaml`` beside it (see ``docs/your_own_model.md``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_adaptiveload import FusedNormModulateMixin, rank_noise_generator, token_weighted_loss


class WanFlowModule(FusedNormModulateMixin, L.LightningModule):
    """Rectified-flow training of a diffusers ``WanTransformer3DModel`` (built in ``configure_model``).

    Args:
        num_layers, num_attention_heads, attention_head_dim, ffn_dim, text_dim, in_channels: the Wan
            config (``text_dim`` must equal the width of the shards' text states).
        lr: peak learning rate of the one-cycle schedule, sized from ``trainer.estimated_stepping_batches``.
        compile: ``torch.compile`` the transformer (lazily, after fusion).
    """

    fuse_submodule = "transformer"  # fuse inside the Wan model; its output head is left as it is
    # training_step takes packs (schedule: packed, and the last steps of a lockstep epoch): see _pack_error.
    runs_packed_batches = True

    def __init__(
        self,
        num_layers: int = 2,
        num_attention_heads: int = 2,
        attention_head_dim: int = 12,
        ffn_dim: int = 32,
        text_dim: int = 16,
        in_channels: int = 16,
        lr: float = 1e-3,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.transformer: torch.nn.Module | None = None
        self._noise: torch.Generator | None = None

    def configure_model(self) -> None:
        if self.transformer is not None:
            return
        from diffusers import WanTransformer3DModel

        h = self.hparams
        self.transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=h.num_attention_heads,
            attention_head_dim=h.attention_head_dim,
            in_channels=h.in_channels,
            out_channels=h.in_channels,
            text_dim=h.text_dim,
            freq_dim=16,
            ffn_dim=h.ffn_dim,
            num_layers=h.num_layers,
            cross_attn_norm=True,
        )
        if h.compile:
            self.transformer.compile()  # lazy: the mixin fuses first, the first forward compiles

    # -- the objective -----------------------------------------------------------------------------

    def _velocity_error(
        self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B,) summed squared error per sample, in tokens' units (divided by the elements per token)."""
        x0 = batch["latents"].float()
        b = x0.shape[0]
        if t is None or noise is None:
            if self._noise is None or self._noise.device != x0.device:
                self._noise = rank_noise_generator(x0.device, self.global_rank)
            t = torch.rand(b, generator=self._noise, device=x0.device)
            noise = torch.randn(x0.shape, generator=self._noise, device=x0.device)
        tb = t.view(b, 1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise
        text = batch["text"]
        if text is None:  # no sample of this batch has a caption: an empty (all-zero) context
            text = x0.new_zeros(b, 1, self.hparams.text_dim)
        pred = self.transformer(x_t, t * 1000, text.float(), return_dict=False)[0]
        elems_per_token = x0.shape[1] * 4  # channels x patch volume (1 * 2 * 2)
        return (pred.float() - (noise - x0)).square().flatten(1).sum(1) / elems_per_token

    def _pack_error(self, batch: dict) -> torch.Tensor:
        """(N,) errors of a pack's samples (``batch["latents"]``: a list of (C, T, H, W) of different shapes).

        Diffusers' Wan has no attention confined to each sample of one sequence, so each sample runs as a
        batch of one, with its row of the pack's padded text: the loss a bucketed batch of the same samples
        gives. A model with varlen attention runs the pack as one sequence instead (``docs/data_path.md``,
        "Packed batches"); either way the ranks' packs cost the same, which is what the packed schedule
        balances.
        """
        text = batch["text"]
        return torch.cat(
            [
                self._velocity_error(
                    {"latents": x.unsqueeze(0), "text": None if text is None else text[i : i + 1]}
                )
                for i, x in enumerate(batch["latents"])
            ]
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch["batch_size"] == 0:
            # Every sample of this batch was skipped while reading: a zero loss that still touches every
            # parameter, so that DDP's gradient all-reduce runs as on the other ranks.
            return sum(p.sum() for p in self.parameters()) * 0.0
        err = (self._pack_error(batch) if batch.get("packed") else self._velocity_error(batch)).sum()
        loss = token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)
        self.log("train/loss", err / batch["num_tokens"], prog_bar=True, batch_size=batch["batch_size"])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        return loss

    def _fixed_error(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x0 = batch["latents"]
        gen = torch.Generator(device=x0.device).manual_seed(batch_idx)  # the same noise every evaluation
        noise = torch.randn(x0.shape, generator=gen, device=x0.device)
        t = torch.full((x0.shape[0],), 0.5, device=x0.device)
        return self._velocity_error(batch, noise, t) / batch["seq_len"]  # (B,) per-token MSE

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if batch["batch_size"]:
            mse = self._fixed_error(batch, batch_idx).mean()
            self.log("val/loss", mse, sync_dist=True, batch_size=batch["batch_size"])

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if batch["batch_size"]:
            mse = self._fixed_error(batch, batch_idx).mean()
            self.log("test/loss", mse, sync_dist=True, batch_size=batch["batch_size"])

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, Any]:
        err = self._fixed_error(batch, batch_idx) if batch["batch_size"] else torch.zeros(0)
        return {"keys": list(batch["keys"]), "loss": err.tolist()}

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PredictionWriter(BasePredictionWriter):
    """Writes each rank's predictions to ``<output_dir>/predictions_rank<r>.jsonl`` (one line per sample)."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0
    ):
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, f"predictions_rank{trainer.global_rank}.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            for key, loss in zip(prediction["keys"], prediction["loss"]):
                f.write(json.dumps({"key": key, "loss": loss}) + "\n")

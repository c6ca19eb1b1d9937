"""A LightningModule of your own on the adaptive data path: rectified flow around diffusers' Wan.

Nothing here subclasses the suite's ``VideoDiTModule``: the module reads the batch dict of
``docs/data_path.md``, weights its loss with :func:`lightning_adaptiveload.token_weighted_loss`, draws
noise from :func:`lightning_adaptiveload.models.loss.rank_noise_generator`, fuses its norm + modulate sites with
:class:`lightning_adaptiveload.FusedNormModulateMixin`, and takes packed batches (``runs_packed_batches``) by
running a pack's samples one by one. Under ``ModelParallelStrategy`` it shards the Wan with FSDP2
(:func:`lightning_adaptiveload.models.sharding.shard_model`). Run it with ``wan_flow.yaml`` beside it (see
``docs/your_own_model.md``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torchmetrics import MeanMetric

from lightning_adaptiveload import FusedNormModulateMixin, token_weighted_loss
from lightning_adaptiveload.models.loss import rank_noise_generator
from lightning_adaptiveload.models.sharding import shard_model
from lightning_adaptiveload.models.wan_flops import wan_flops_per_batch


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
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

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
        trainer = self._trainer  # None when the module is used outside a Trainer (tests, notebooks)
        if trainer is not None and type(trainer.strategy).__name__ == "ModelParallelStrategy":
            # FSDP2: each block its own unit, then the root. Fuse first: fusion changes the modules that
            # FSDP groups (the mixin's own fusion after this method then finds them fused).
            self._fuse_after_configure_model()
            shard_model(self.transformer, self.device_mesh, blocks=self.transformer.blocks)

    def flops_per_batch(self, batch: dict) -> float:
        """Training FLOPs of ``batch`` (the LoadBalanceMonitor's TFLOP/s and MFU): the Wan formula."""
        return wan_flops_per_batch(self.transformer.config, batch)

    # -- the objective -----------------------------------------------------------------------------

    def _velocity_error(
        self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B,) summed squared error per sample, in tokens' units (divided by the elements per token).

        A batch of 0 samples (all skipped while reading, or a rank's padding step in evaluation) runs one
        all-zero sample through the model instead and returns none of its error: so every parameter gets a
        (zero) gradient and every rank runs the same forwards, as DDP and FSDP need; diffusers' Wan cannot
        take 0 samples."""
        x0 = batch["latents"].float()
        b = x0.shape[0]
        if t is None or noise is None:
            if self._noise is None or self._noise.device != x0.device:
                self._noise = rank_noise_generator(x0.device, self.global_rank)
            t = torch.rand(b, generator=self._noise, device=x0.device)
            noise = torch.randn(x0.shape, generator=self._noise, device=x0.device)
        text = batch["text"]
        if b == 0:
            x0 = noise = x0.new_zeros(1, *x0.shape[1:])
            t, text = x0.new_zeros(1), None
        tb = t.view(-1, 1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise
        if text is None:  # no sample of this batch has a caption: an empty (all-zero) context
            text = x0.new_zeros(x0.shape[0], 1, self.hparams.text_dim)
        pred = self.transformer(x_t, t * 1000, text.float(), return_dict=False)[0]
        elems_per_token = x0.shape[1] * 4  # channels x patch volume (1 * 2 * 2)
        return (pred.float() - (noise - x0)).square().flatten(1).sum(1)[:b] / elems_per_token

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
        # A batch whose samples were all skipped while reading has 0 samples: it runs through the model
        # too (its error is 0), so that every parameter gets a gradient and the gradient reduction runs as
        # on the other ranks, and under FSDP every rank takes part in each unit's all-gathers.
        err = (self._pack_error(batch) if batch.get("packed") else self._velocity_error(batch)).sum()
        loss = token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)
        if batch["batch_size"]:
            self.log("train/loss", err / batch["num_tokens"], prog_bar=True, batch_size=batch["batch_size"])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        return loss

    def _fixed_error(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x0 = batch["latents"]
        gen = torch.Generator(device=x0.device).manual_seed(batch_idx)  # the same noise every evaluation
        noise = torch.randn(x0.shape, generator=gen, device=x0.device)
        t = torch.full((x0.shape[0],), 0.5, device=x0.device)
        return self._velocity_error(batch, noise, t) / batch["seq_len"]  # (B,) per-token MSE

    # An empty evaluation step (a rank with no sample left) runs the model too: under FSDP every forward
    # gathers parameters with all ranks. The losses are token-weighted means over every rank's samples
    # (MeanMetric reduces its sums over the ranks at the epoch's end; self.log(sync_dist=True) would
    # average the ranks' means, and a rank that logs nothing would leave the others waiting).
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(self.val_loss, "val/loss", batch, batch_idx)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(self.test_loss, "test/loss", batch, batch_idx)

    def _evaluate(self, metric: MeanMetric, name: str, batch: dict, batch_idx: int) -> None:
        err = self._fixed_error(batch, batch_idx)  # (B,), 0 samples on an empty step
        metric.update(err, weight=torch.full_like(err, batch["seq_len"]))
        self.log(name, metric, on_epoch=True)

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, Any]:
        err = self._fixed_error(batch, batch_idx)
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

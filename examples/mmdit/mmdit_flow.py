"""An SD3-style MMDiT of your own on the adaptive data path: rectified flow on video latents.

The network is built from diffusers' SD3 parts: ``JointTransformerBlock`` (joint attention over the video
and the text tokens, a separate FFN and adaLN-Zero modulation per stream, SD3.5's dual attention in the
blocks listed in ``dual_attention_layers``), ``CombinedTimestepTextProjEmbeddings`` (timestep + pooled
text) and an ``AdaLayerNormContinuous`` head. Video latents (C, T, H, W) are cut into (1, 2, 2) patches
with a 3-D sin-cos position code, so the mix's images and clips of any shape train in one model.

The module reads the batch dict of ``docs/data_path.md``, weights its loss with
:func:`lightning_adaptiveload.token_weighted_loss`, draws noise from
:func:`lightning_adaptiveload.models.loss.rank_noise_generator`, gives the monitor its FLOPs
(``flops_per_batch``), fuses its norm + modulate sites with :class:`lightning_adaptiveload.FusedNormModulateMixin`
(diffusers' ``AdaLayerNormZero``, ``SD35AdaLayerNormZeroX``, ``AdaLayerNormContinuous`` and the blocks' FFN
sites: see ``docs/fusion.md``), and takes packed batches by running a pack's samples one by one. Run it with
``mmdit_flow.yaml`` beside it (see ``docs/your_own_model.md``).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_adaptiveload import FusedNormModulateMixin, token_weighted_loss
from lightning_adaptiveload.models.loss import rank_noise_generator

PATCH = (1, 2, 2)


def sincos_3d(grid: tuple[int, int, int], dim: int, device: torch.device) -> torch.Tensor:
    """(T * H * W, dim) fixed position code: a sin-cos code of each axis' coordinate, side by side."""
    share = 2 * (dim // 6)
    widths = (share, share, dim - 2 * share)  # t, h, w; each even
    axes = torch.meshgrid(*(torch.arange(n, device=device, dtype=torch.float32) for n in grid), indexing="ij")
    parts = []
    for coord, width in zip(axes, widths):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(width // 2, device=device) / max(width // 2, 1))
        angle = coord.reshape(-1, 1) * freqs
        parts += [angle.sin(), angle.cos()]
    return torch.cat(parts, dim=1)


class VideoMMDiT(nn.Module):
    """An SD3-shaped MMDiT for video latents: ``forward(latents (B, C, T, H, W), t (B,), text (B, L, D_text))``.

    Args:
        in_channels: latent channels.
        dim, num_heads: width and attention heads of the blocks.
        num_layers: joint blocks; the last is context-pre-only (no text output), as in SD3.
        text_dim: width of the text states (also the pooled text's, their mean over the valid tokens).
        dual_attention_layers: blocks with SD3.5's second self-attention over the video tokens.
    """

    def __init__(
        self,
        in_channels: int = 16,
        dim: int = 32,
        num_heads: int = 2,
        num_layers: int = 2,
        text_dim: int = 16,
        dual_attention_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        from diffusers.models.attention import JointTransformerBlock
        from diffusers.models.embeddings import CombinedTimestepTextProjEmbeddings
        from diffusers.models.normalization import AdaLayerNormContinuous

        patch = math.prod(PATCH)
        self.in_channels, self.dim, self.text_dim = in_channels, dim, text_dim
        self.patch_embed = nn.Linear(in_channels * patch, dim)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(
            embedding_dim=dim, pooled_projection_dim=text_dim
        )
        self.context_embedder = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(
            JointTransformerBlock(
                dim,
                num_heads,
                dim // num_heads,
                context_pre_only=i == num_layers - 1,
                use_dual_attention=i in tuple(dual_attention_layers),
            )
            for i in range(num_layers)
        )
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, in_channels * patch)

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, c, t, h, w = latents.shape
        pt, ph, pw = PATCH
        grid = (t // pt, h // ph, w // pw)
        x = latents.reshape(b, c, grid[0], pt, grid[1], ph, grid[2], pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        x = self.patch_embed(x.reshape(b, math.prod(grid), -1)) + sincos_3d(grid, self.dim, latents.device)
        valid = text.new_ones(text.shape[:2]) if text_mask is None else text_mask.to(text.dtype)
        pooled = (text * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp_min(1)
        temb = self.time_text_embed(timestep, pooled)
        context = self.context_embedder(text)
        for block in self.blocks:
            context, x = block(hidden_states=x, encoder_hidden_states=context, temb=temb)
        x = self.proj_out(self.norm_out(x, temb))
        x = x.reshape(b, *grid, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, c, t, h, w)

    def flops(self, grid: tuple[int, int, int], text_len: int) -> float:
        """Forward FLOPs of one sample (2 per multiply-add; norms and activations left out)."""
        s, n, d = math.prod(g // p for g, p in zip(grid, PATCH)), text_len, self.dim
        patch = self.in_channels * math.prod(PATCH)
        total = 2 * s * patch * d * 2 + 2 * n * self.text_dim * d  # patch embedding, head; text projection
        for block in self.blocks:
            last = block.context_pre_only
            total += 2 * (s + n) * 3 * d * d + 4 * (s + n) ** 2 * d  # joint q, k, v; attention
            total += 2 * s * d * d + (0 if last else 2 * n * d * d)  # output projections
            total += 16 * s * d * d + (0 if last else 16 * n * d * d)  # FFNs (4x)
            if block.use_dual_attention:
                total += 8 * s * d * d + 4 * s * s * d
        return float(total)


class MMDiTFlowModule(FusedNormModulateMixin, L.LightningModule):
    """Rectified-flow training of a :class:`VideoMMDiT` (built in ``configure_model``).

    Args:
        in_channels, dim, num_heads, num_layers, text_dim, dual_attention_layers: the model (``text_dim``
            must equal the width of the shards' text states).
        lr: peak learning rate of the one-cycle schedule, sized from ``trainer.estimated_stepping_batches``.
    """

    fuse_submodule = "model"
    fuse_allow_empty = False  # this model fuses (docs/fusion.md): if it ever did not, stop with the reason
    runs_packed_batches = True  # a pack's samples run one by one (_pack_error)

    def __init__(
        self,
        in_channels: int = 16,
        dim: int = 32,
        num_heads: int = 2,
        num_layers: int = 2,
        text_dim: int = 16,
        dual_attention_layers: tuple[int, ...] = (),
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: VideoMMDiT | None = None
        self._noise: torch.Generator | None = None
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model = VideoMMDiT(
                h.in_channels, h.dim, h.num_heads, h.num_layers, h.text_dim, tuple(h.dual_attention_layers)
            )

    def flops_per_batch(self, batch: dict) -> float:
        """Training FLOPs (3x forward) of ``batch``, for the LoadBalanceMonitor's TFLOP/s and MFU."""
        latents, text = batch["latents"], batch.get("text")
        text_len = 1 if text is None else int(text.shape[1])
        if isinstance(latents, (list, tuple)):  # a pack: samples of different shapes
            shapes = [x.shape[-3:] for x in latents]
        else:
            shapes = [latents.shape[-3:]] * latents.shape[0]
        return 3 * sum(self.model.flops(tuple(int(v) for v in s), text_len) for s in shapes)

    def _velocity_error(self, batch: dict, noise=None, t=None) -> torch.Tensor:
        """(B,) summed squared error per sample, in tokens' units. A batch of 0 samples runs one all-zero
        sample and returns none of its error (every rank runs the same forwards; DDP needs every gradient)."""
        x0 = batch["latents"].float()
        b = x0.shape[0]
        if t is None or noise is None:
            if self._noise is None or self._noise.device != x0.device:
                self._noise = rank_noise_generator(x0.device, self.global_rank)
            t = torch.rand(b, generator=self._noise, device=x0.device)
            noise = torch.randn(x0.shape, generator=self._noise, device=x0.device)
        text, mask = batch.get("text"), batch.get("text_mask")
        if b == 0:
            x0 = noise = x0.new_zeros(1, *x0.shape[1:])
            t, text, mask = x0.new_zeros(1), None, None
        if text is None:  # no caption in this batch: one all-zero text token
            text, mask = x0.new_zeros(x0.shape[0], 1, self.hparams.text_dim), None
        tb = t.view(-1, 1, 1, 1, 1)
        pred = self.model((1 - tb) * x0 + tb * noise, t * 1000, text.float(), mask)
        elems_per_token = x0.shape[1] * math.prod(PATCH)
        return (pred.float() - (noise - x0)).square().flatten(1).sum(1)[:b] / elems_per_token

    def _pack_error(self, batch: dict) -> torch.Tensor:
        """(N,) errors of a pack's samples, each run as a batch of one with its row of the pack's text."""
        text, mask = batch.get("text"), batch.get("text_mask")
        return torch.cat(
            [
                self._velocity_error({
                    "latents": x.unsqueeze(0),
                    "text": None if text is None else text[i : i + 1],
                    "text_mask": None if mask is None else mask[i : i + 1],
                })
                for i, x in enumerate(batch["latents"])
            ]
        )  # fmt: skip

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        err = (self._pack_error(batch) if batch.get("packed") else self._velocity_error(batch)).sum()
        loss = token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)
        if batch["batch_size"]:
            self.log("train/loss", err / batch["num_tokens"], prog_bar=True, batch_size=batch["batch_size"])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        return loss

    def _evaluate(self, metric: MeanMetric, name: str, batch: dict, batch_idx: int) -> None:
        x0 = batch["latents"]
        gen = torch.Generator(device=x0.device).manual_seed(batch_idx)  # the same noise every evaluation
        noise = torch.randn(x0.shape, generator=gen, device=x0.device)
        t = torch.full((x0.shape[0],), 0.5, device=x0.device)
        err = self._velocity_error(batch, noise, t) / batch["seq_len"]  # (B,) per-token MSE
        metric.update(err, weight=torch.full_like(err, batch["seq_len"]))
        self.log(name, metric, on_epoch=True)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(self.val_loss, "val/loss", batch, batch_idx)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(self.test_loss, "test/loss", batch, batch_idx)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

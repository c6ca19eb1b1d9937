"""A module of your own, trained from Python (no recipe, no CLI), end to end.

A small text-conditioned video transformer written here in plain PyTorch (patchify, self-attention,
cross-attention to the text states through ``nn.MultiheadAttention``, an MLP), trained with rectified flow
on synthetic latents under 2-process DDP on the CPU:

    cd examples/your_own_model && python train_python.py        # 2 CPU processes, about a minute
    python train_python.py --devices 1 --max-steps 5             # shorter: one process, 5 steps

It does what docs/your_own_model.md asks of any module: the loss weighted by tokens
(``token_weighted_loss``, with ``elems_per_token`` defined), noise drawn per rank, empty batches run
through the model, packs taken (lockstep's last steps), and a text mask turned into the
``key_padding_mask`` that ``nn.MultiheadAttention`` wants (True there means *ignore*, the opposite of
``batch["text_mask"]``; a row with no real state gives NaN unless one key is left open). The monitor prints
where its files went at the end of the fit.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_adaptiveload import (
    AdaptiveLoadDataModule,
    Batching,
    LoadBalanceMonitor,
    Loader,
    PlanSettings,
    token_weighted_loss,
)
from lightning_adaptiveload.models.loss import rank_noise_generator

PATCH = (1, 2, 2)  # (pt, ph, pw): the model's patch; the DataModule's Batching(patch_size=...) must match


def text_key_padding_mask(text_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.MultiheadAttention``'s ``key_padding_mask`` for ``batch["text_mask"]``, and which rows have text.

    ``text_mask`` is True at real text states. ``key_padding_mask`` is True at keys to *ignore*: ``~text_mask``,
    except that a sample with no real state (an all-False row: no caption) would ignore every key, and its
    softmax is NaN. Such a row attends to its zero padding instead, and the caller zeroes its output with
    ``has_text``.

    Args:
        text_mask: bool (B, L), True at real text states.

    Returns:
        ``(key_padding_mask, has_text)``: bool (B, L), True at keys to ignore, never all True in a row; and
        bool (B,), False for the samples without text.
    """
    has_text = text_mask.any(dim=1)
    return ~text_mask & has_text[:, None], has_text


class Block(nn.Module):
    """Self-attention over the video tokens, cross-attention to the text, MLP; pre-norm, time-modulated."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim) for _ in range(3))
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 2 * dim)

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """x (B, S, D), temb (B, D), text (B, L, D), text_mask bool (B, L) True at real states -> (B, S, D)."""
        shift, scale = self.modulation(temb)[:, None].chunk(2, dim=-1)
        h = self.norm1(x) * (1 + scale) + shift
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        pad, has_text = text_key_padding_mask(text_mask)
        out = self.cross_attn(self.norm2(x), text, text, key_padding_mask=pad, need_weights=False)[0]
        x = x + out * has_text[:, None, None].to(out.dtype)  # a sample without text gets nothing from it
        return x + self.mlp(self.norm3(x))


class TinyVideoFlow(L.LightningModule):
    """A text-conditioned video transformer of one's own, trained with rectified flow.

    Batches come from ``AdaptiveLoadDataModule`` (``docs/data_path.md``, "The batch"): ``latents`` (B, C, T, H,
    W), ``text`` (B, L, D_text) or None, ``text_mask`` bool (B, L) or None; or a pack (``batch["packed"]``,
    ``latents`` a list of (C, T, H, W)) in the last steps of a lockstep epoch.
    """

    runs_packed_batches = True  # takes packs: run one by one below

    def __init__(
        self,
        in_channels: int = 16,
        text_dim: int = 32,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.patchify = nn.Conv3d(in_channels, dim, kernel_size=PATCH, stride=PATCH)
        self.text_proj = nn.Linear(text_dim, dim)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.unpatchify = nn.ConvTranspose3d(dim, in_channels, kernel_size=PATCH, stride=PATCH)
        self.val_loss = MeanMetric()
        self._noise: torch.Generator | None = None

    def _time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        half = self.hparams.dim // 2
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device) / half)
        angles = 1000.0 * t[:, None] * freqs[None]
        return self.time_mlp(torch.cat([angles.sin(), angles.cos()], dim=-1))

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor | None, text_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x (B, C, T, H, W), t (B,) in [0, 1], text (B, L, D_text) or None, text_mask (B, L) or None ->
        the predicted velocity (B, C, T, H, W)."""
        b = x.shape[0]
        if text is None:
            # No sample of the batch has text: one zero state, masked out. The cross-attention still runs
            # (its output zeroed), so its parameters get a (zero) gradient on every rank, as DDP needs.
            text = x.new_zeros(b, 1, self.hparams.text_dim)
            text_mask = torch.zeros(b, 1, dtype=torch.bool, device=x.device)
        elif text_mask is None:
            text_mask = torch.ones(text.shape[:2], dtype=torch.bool, device=x.device)
        h = self.patchify(x)  # (B, D, T', H', W')
        grid = h.shape[2:]
        h = h.flatten(2).transpose(1, 2)  # (B, S, D)
        temb = self._time_embedding(t)
        ctx = self.text_proj(text.to(h.dtype))
        for block in self.blocks:
            h = block(h, temb, ctx, text_mask)
        return self.unpatchify(h.transpose(1, 2).reshape(h.shape[0], -1, *grid))

    def _errors(self, batch: dict, t: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) each sample's squared error summed over its tokens (the elements divided by elems_per_token).

        A batch of 0 samples (every sample failed to read, or a rank's empty step in evaluation) runs one
        all-zero sample instead and returns none of its error: every parameter then gets a (zero) gradient
        and every rank runs the same forwards, as DDP needs."""
        x0 = batch["latents"].float()
        b = x0.shape[0]
        if self._noise is None:
            self._noise = rank_noise_generator(x0.device, self.global_rank)  # seeded apart on every rank
        text, mask = batch.get("text"), batch.get("text_mask")
        if b == 0:
            x0, text, mask = x0.new_zeros(1, *x0.shape[1:]), None, None
        if t is None:
            t = torch.rand(x0.shape[0], generator=self._noise, device=x0.device)
        noise = torch.randn(x0.shape, generator=self._noise, device=x0.device)
        tb = t.view(-1, 1, 1, 1, 1)
        pred = self((1 - tb) * x0 + tb * noise, t, None if text is None else text.float(), mask)
        elems_per_token = x0.shape[1] * math.prod(PATCH)  # latent elements in one token: C * pt * ph * pw
        return (pred - (noise - x0)).square().flatten(1).sum(1)[:b] / elems_per_token

    def _pack_errors(self, batch: dict) -> torch.Tensor:
        """(N,) errors of a pack's samples, each run as a batch of one with its row of the pack's text."""
        text, mask = batch.get("text"), batch.get("text_mask")
        return torch.cat(
            [
                self._errors(
                    {
                        "latents": x.unsqueeze(0),
                        "text": None if text is None else text[i : i + 1],
                        "text_mask": None if mask is None else mask[i : i + 1],
                    }
                )
                for i, x in enumerate(batch["latents"])
            ]
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        err = (self._pack_errors(batch) if batch.get("packed") else self._errors(batch)).sum()
        # Ranks hold different numbers of tokens and DDP averages ranks equally: every token weighs the same.
        loss = token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)
        self.log(
            "train/loss", err.detach() / max(int(batch["num_tokens"]), 1), batch_size=batch["batch_size"]
        )
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        b = batch["batch_size"]
        t = torch.full((max(b, 1),), 0.5, device=self.device)
        err = self._pack_errors(batch) if batch.get("packed") else self._errors(batch, t=t)
        # Weighted by tokens, so that a rank's empty step (num_tokens 0) weighs nothing.
        self.val_loss.update(err.sum() / max(int(batch["num_tokens"]), 1), weight=int(batch["num_tokens"]))
        self.log("val/loss", self.val_loss, batch_size=max(b, 1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a module of one's own on synthetic latents (CPU).")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (DDP when more than 1)")
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: no limit)")
    parser.add_argument("--num-samples", type=int, default=256, help="synthetic training samples")
    parser.add_argument("--data", default="data/train_python", help="folder for the synthetic shards")
    parser.add_argument("--out", default="runs/train_python", help="folder for logs and the monitor's files")
    args = parser.parse_args(argv)

    data = AdaptiveLoadDataModule(
        train_shards=f"{args.data}/train",
        val_shards=f"{args.data}/val",
        # Written in prepare_data when the folders hold no shards: the tiny mix, text states of width 32
        # (TinyVideoFlow's text_dim), 0 to 16 states, so some samples have no text.
        synthetic={"mix": "tiny", "num_samples": args.num_samples, "samples_per_shard": 32, "text_dim": 32},
        batching=Batching(max_tokens=512, patch_size=PATCH),
        plan=PlanSettings(schedule="lockstep"),
        loader=Loader(num_workers=0),
    )
    model = TinyVideoFlow(text_dim=32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        callbacks=[LoadBalanceMonitor()],
        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
        reload_dataloaders_every_n_epochs=1,  # every epoch has its own planned length
        enable_checkpointing=False,
        log_every_n_steps=2,
        default_root_dir=args.out,
    )
    # Write the data, then check it against max_tokens before the DDP processes start (the CLI does both).
    data.prepare_data()
    data.check_data()
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":  # needed: Lightning's DDP on the CPU starts this script again in each process
    main()

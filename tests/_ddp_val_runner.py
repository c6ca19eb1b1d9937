"""One rank of a CPU DDP validation run on a validation set smaller than the world (tests/integration/test_val_underfull.py).

Launched by ``_ddp_data_runner.launch(cfg, tmp, timeout, script=__file__)``. CONFIG: {"train", "val": shard dirs,
"out": dir, "world": N, "val_underfull": "pad" | "error"}. Writes ``<out>/val.rank<r>.json``: the validation
batches this rank took (batch size, tokens), the token-weighted metric the ranks agreed on, the real
``VideoDiTModule``'s ``val/loss``, or the error raised.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.strategies import DDPStrategy

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.planning.settings import Batching

torch.set_num_threads(1)


class TokenWeightedProbe(pl.LightningModule):
    """Validation metric: the token-weighted mean of each batch's mean squared latent (what a token-weighted
    loss does): an empty batch adds weight 0, so padding a rank must leave the metric unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.metric = torchmetrics.MeanMetric()
        self.seen: list[dict] = []

    def validation_step(self, batch, batch_idx):
        x = batch["latents"].float()
        value = x.square().mean() if x.numel() else x.new_zeros(())
        self.metric.update(value, weight=float(batch["num_tokens"]))
        self.log("val/probe", self.metric, on_step=False, on_epoch=True)
        self.seen.append({"batch_size": int(batch["batch_size"]), "num_tokens": int(batch["num_tokens"])})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(os.environ["LOCAL_RANK"])
    out: dict = {}

    def datamodule() -> AdaptiveLoadDataModule:
        return AdaptiveLoadDataModule(
            train_shards=cfg["train"],
            val_shards=cfg["val"],
            val_underfull=cfg["val_underfull"],
            batching=Batching(max_tokens=512),
            loader=Loader(num_workers=cfg.get("num_workers", 0)),
        )

    def trainer() -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=int(cfg["world"]),
            strategy=DDPStrategy(process_group_backend="gloo"),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    try:
        probe = TokenWeightedProbe()
        t = trainer()
        t.validate(probe, datamodule=datamodule(), verbose=False)
        out["seen"] = probe.seen
        out["probe"] = float(t.callback_metrics["val/probe"])
        # The real module on the same data: the empty batch must run through the model and the logging.
        t.validate(VideoDiTModule(preset="tiny"), datamodule=datamodule(), verbose=False)
        out["val_loss"] = float(t.callback_metrics["val/loss"])
    except Exception as err:  # reported to the test, which checks the message
        out["error"] = f"{type(err).__name__}: {err}"
    with open(os.path.join(cfg["out"], f"val.rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

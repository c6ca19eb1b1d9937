"""One rank of a CPU DDP run whose step times come from a known cost function (launched by tests/integration/test_refit_ddp.py).

The module advances the LoadBalanceMonitor's :class:`ManualClock` by the TRUE cost of each batch
(``c0 + sum(alpha*S_i + beta*S_i^2)``, times a deterministic +-2% per batch and x3 for about one batch in 23:
noise and outliers for the refit to see through), so the monitor measures exactly that. Usage::

    python tests/_refit_runner.py CONFIG.json

CONFIG: {"data", "out", "world", "true": CostModel dict, "runs": [{"name", "schedule", "max_epochs",
"max_tokens", "cost_model": dict, "refit": bool | dict (the ClosedLoop's; False: the monitor alone), "ckpt": bool, "ckpt_every": steps | null,
"kill_at": global step | null, "num_workers": int, "noise": bool, "resume": path | null}]}. Per rank and run it writes
``<out>/<name>.rank<r>.jsonl``: one line per training step (epoch, step, keys, true cost), one per epoch start
(``{"epoch_start": e, "model": the data module's cost model}``) and one per plan segment that starts in an
epoch (``{"segment": the segment's saved settings, "epoch", "global_step", "global_tokens": the plan's}``);
rank 0 writes ``<out>/<name>.metrics.json``: ``trainer.callback_metrics`` at the end of the fit.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

# The checkout this file is in, ahead of any installed copy of the package (a subprocess's sys.path[0] is
# tests/, so it would otherwise import whichever lightning_adaptiveload is installed).
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]
from _ddp_data_runner import CrashAt, SimulatedCrash, launch  # noqa: E402,F401 - launch is re-exported

from lightning_adaptiveload.callbacks.closed_loop import ClosedLoop  # noqa: E402
from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor  # noqa: E402
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.loading.settings import Loader  # noqa: E402
from lightning_adaptiveload.monitor.timing import ManualClock  # noqa: E402
from lightning_adaptiveload.planning.cost_model import CostModel  # noqa: E402
from lightning_adaptiveload.planning.settings import Batching, PlanSettings  # noqa: E402

torch.set_num_threads(1)


def batch_lengths(batch: dict) -> list[int]:
    """The token counts of the batch's samples (a pack's ``seq_lens``, else B copies of ``seq_len``)."""
    if batch.get("packed"):
        return [int(s) for s in batch["seq_lens"].tolist()]
    return [int(batch["seq_len"])] * int(batch["batch_size"])


def true_seconds(true: CostModel, batch: dict, noise: bool = True) -> float:
    """The injected step time: the true cost with deterministic noise and outliers keyed by the batch's keys
    (``noise=False``: the true cost exactly)."""
    if not noise:
        return true.pack_cost(batch_lengths(batch))
    h = zlib.crc32("|".join(batch["keys"]).encode())
    noise = 1.0 + 0.02 * ((h % 2001) / 1000.0 - 1.0)
    outlier = 3.0 if (h >> 11) % 23 == 0 else 1.0
    return true.pack_cost(batch_lengths(batch)) * noise * outlier


class TrueCostModule(pl.LightningModule):
    """A one-parameter model whose step takes the true cost of its batch on the monitor's clock."""

    runs_packed_batches = True

    def __init__(self, path: str, clock: ManualClock, true: CostModel, noise: bool = True) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.path, self.clock, self.true, self.noise = path, clock, true, noise

    def training_step(self, batch, batch_idx):
        lens = batch_lengths(batch)
        self.clock.advance(true_seconds(self.true, batch, self.noise))
        row = {
            "epoch": int(self.current_epoch),
            "global_step": int(self.global_step),
            "step": int(batch["step"]),
            "keys": list(batch["keys"]),
            "true_cost": self.true.pack_cost(lens),
            "planned_cost": float(batch["cost"]),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        x = torch.stack([t.float().mean() for t in batch["latents"]]).mean()
        return (self.w * x - 1.0).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ModelRecorder(Callback):
    """Writes the data module's cost model at every epoch start: the model the epoch was planned with."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_start(self, trainer, pl_module):
        with open(self.path, "a") as f:
            model = trainer.datamodule.batcher.cost_model.to_dict()
            f.write(json.dumps({"epoch_start": int(trainer.current_epoch), "model": model}) + "\n")


class SegmentRecorder(Callback):
    """Writes every new plan segment of a training epoch (a fresh plan, a resume, a mid-epoch replan) with the
    plan's per-step global token counts, at the first step that runs it: the ranks' plans must agree."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, 0

    def on_train_epoch_start(self, trainer, pl_module):
        self.seen = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        dm = trainer.datamodule
        if len(dm._segments) == self.seen:
            return
        self.seen = len(dm._segments)
        seg = {k: v for k, v in dm._segments[-1].items() if k not in ("consumed", "digest", "digests")}
        row = {
            "segment": seg,
            "epoch": int(trainer.current_epoch),
            "global_step": int(trainer.global_step),
            "global_tokens": [int(t) for t in dm.train_dataset.plan.global_tokens],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(os.environ["LOCAL_RANK"])
    true = CostModel.from_dict(cfg["true"])
    for run in cfg["runs"]:
        path = os.path.join(cfg["out"], f"{run['name']}.rank{rank}.jsonl")
        dm = AdaptiveLoadDataModule(
            train_shards=cfg["data"],
            batching=Batching(max_tokens=run.get("max_tokens", 512), cost_model=run["cost_model"]),
            plan=PlanSettings(schedule=run["schedule"], chunk_samples=500_000),  # the DataModule's default
            loader=Loader(num_workers=run.get("num_workers", 0)),
        )
        clock = ManualClock()
        monitor = LoadBalanceMonitor(
            dirpath=os.path.join(cfg["out"], run["name"] + "-monitor"),
            clock=clock,
            count_flops=False,  # the FLOP count runs training_step on a meta copy: it would write rows too
            plots=False,
            print_summary=False,
        )
        callbacks: list[Callback] = [monitor]
        # Lockstep plans bucketed batches with sizing "dual" here, where applying a refit resizes batches: an
        # opt-in (packs are sized by max_tokens alone, so the packed run needs none).
        refit = run.get("refit", {"resize_batches": True})
        if refit is not False:
            callbacks.append(ClosedLoop(refit=refit))
        callbacks += [ModelRecorder(path), SegmentRecorder(path)]
        if run.get("ckpt_every"):
            callbacks.append(
                ModelCheckpoint(
                    dirpath=os.path.join(cfg["out"], run["name"] + "-ckpt"),
                    every_n_train_steps=run["ckpt_every"],
                    save_top_k=-1,
                    filename="at-{step}",
                    auto_insert_metric_name=False,
                )
            )
        if run.get("kill_at") is not None:
            callbacks.append(CrashAt(run["kill_at"]))
        if run.get("ckpt"):
            callbacks.append(
                ModelCheckpoint(
                    dirpath=os.path.join(cfg["out"], run["name"] + "-ckpt"),
                    every_n_epochs=1,
                    save_top_k=-1,
                    filename="epoch{epoch}",
                    auto_insert_metric_name=False,
                )
            )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=int(cfg["world"]),
            strategy=DDPStrategy(process_group_backend="gloo"),
            max_epochs=run["max_epochs"],
            reload_dataloaders_every_n_epochs=1,
            logger=False,
            enable_checkpointing=bool(run.get("ckpt") or run.get("ckpt_every")),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=5,
            callbacks=callbacks,
        )
        try:
            module = TrueCostModule(path, clock, true, noise=run.get("noise", True))
            trainer.fit(module, datamodule=dm, ckpt_path=run.get("resume"))
        except SimulatedCrash:
            torch.distributed.barrier()
        if rank == 0:  # the monitor's logged values (the last of each key)
            with open(os.path.join(cfg["out"], f"{run['name']}.metrics.json"), "w") as f:
                json.dump({k: float(v) for k, v in trainer.callback_metrics.items()}, f)


if __name__ == "__main__":
    main()

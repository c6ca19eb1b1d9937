"""One rank of a CPU (gloo) run of the tiny VideoDiTModule through AdaptiveLoadDataModule, with or without
Ulysses sequence parallelism (launched by tests/integration/test_sp_epoch.py).

Launched like torchrun (see ``tests/_ddp_data_runner.launch``). Usage::

    python tests/_sp_data_runner.py CONFIG.json

CONFIG: {"data": shard dir, "out": dir, "world": N, "init_from": weights folder, "cost_model": the cost model
dict every run plans with, "runs": [{"name", "strategy": "ddp" | "fsdp2", "sequence_parallel": G (1: plain
data parallelism), "max_tokens": the token budget of one data-parallel rank or group (each GPU of a group of
G gets max_tokens / G), "sizing", "schedule", "lockstep_tail", "max_epochs", "ckpt_every" | null, "kill_at": global
step | null, "resume": checkpoint path | null}]}.

Every training step appends one JSON line to ``<out>/<name>.rank<r>.jsonl``: the global step, the plan
step, the keys, the data rank, this rank's loss and ``global_tokens``. A run that ends in the simulated
crash writes ``<out>/<name>.crashed``; an error raised by ``fit`` goes to ``<out>/<name>.rank<r>.error``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import CrashAt, SimulatedCrash  # noqa: E402

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.loading.settings import Loader  # noqa: E402
from lightning_adaptiveload.models.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.models.module_settings import OptimizerSettings  # noqa: E402
from lightning_adaptiveload.planning.settings import Batching, PlanSettings  # noqa: E402

torch.set_num_threads(1)


class Recording(VideoDiTModule):
    """Writes every step's loss, keys and data rank."""

    def __init__(self, path: str, degree: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path, self.degree = path, degree

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        row = {
            "global_step": int(self.global_step),
            "step": int(batch["step"]),
            "keys": list(batch["keys"]),
            "data_rank": int(self.global_rank) // self.degree,
            "loss": float(loss.detach()),
            "global_tokens": int(batch["global_tokens"]),
        }
        with open(self.path.replace("{}", str(self.global_rank)), "a") as f:
            f.write(json.dumps(row) + "\n")
        return loss


def _strategy(name: str, degree: int):
    if degree == 1:
        if name == "ddp":
            return DDPStrategy(process_group_backend="gloo")
        return ModelParallelStrategy(process_group_backend="gloo")
    from lightning_adaptiveload.models.module import SequenceParallelFSDPStrategy, SequenceParallelStrategy

    if name == "ddp":
        return SequenceParallelStrategy(sequence_parallel_size=degree, process_group_backend="gloo")
    return SequenceParallelFSDPStrategy(sequence_parallel_size=degree, process_group_backend="gloo")


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(os.environ["LOCAL_RANK"])
    for run in cfg["runs"]:
        name, out = run["name"], cfg["out"]
        degree = int(run.get("sequence_parallel", 1))
        pl.seed_everything(1234, verbose=False)  # the noise generator's seed: the same in every launch
        path = os.path.join(out, f"{name}.rank{{}}.jsonl")
        dm = AdaptiveLoadDataModule(
            train_shards=cfg["data"],
            # One GPU's budget: a group of G takes G times it, the same as one plain rank's.
            batching=Batching(
                max_tokens=int(run.get("max_tokens", 512)) // degree,
                cost_model=cfg.get("cost_model") if degree == 1 else cfg.get("per_gpu_cost_model"),
                sizing=run.get("sizing", "dual"),
            ),
            plan=PlanSettings(
                schedule=run.get("schedule", "lockstep"),
                lockstep_tail=run.get("lockstep_tail", "bucketed"),
                sequence_parallel=degree,
                sequence_comm=cfg.get("sequence_comm"),
            ),
            loader=Loader(num_workers=int(run.get("num_workers", 0)), seed=0),
        )
        module = Recording(
            path,
            degree,
            init_from=cfg["init_from"],
            optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0),
        )
        callbacks: list[Callback] = []
        if run.get("ckpt_every"):
            callbacks.append(
                ModelCheckpoint(
                    dirpath=os.path.join(out, name + "-ckpt"),
                    every_n_train_steps=run["ckpt_every"],
                    save_top_k=-1,
                    filename="at-{step}",
                    auto_insert_metric_name=False,
                )
            )
        if run.get("kill_at") is not None:
            callbacks.append(CrashAt(run["kill_at"]))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=cfg["world"],
            strategy=_strategy(run.get("strategy", "ddp"), degree),
            max_epochs=run.get("max_epochs", 1),
            reload_dataloaders_every_n_epochs=1,
            logger=False,
            enable_checkpointing=bool(run.get("ckpt_every")),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=run.get("resume"))
        except SimulatedCrash:
            if rank == 0:
                open(os.path.join(out, name + ".crashed"), "w").close()
            torch.distributed.barrier()
        except Exception as exc:  # the test shows it
            with open(os.path.join(out, f"{name}.rank{rank}.error"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
            raise


if __name__ == "__main__":
    main()

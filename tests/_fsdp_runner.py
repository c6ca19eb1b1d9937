"""One rank of a CPU (gloo) run of the tiny VideoDiTModule under DDP or FSDP2 (launched by tests/test_fsdp.py).

Launched like torchrun (see ``tests/_ddp_data_runner.launch``). Usage::

    python tests/_fsdp_runner.py CONFIG.json

CONFIG: {"data": shard dir, "out": dir, "world": N, "init_from": weights folder, "runs": [{"name",
"strategy": "ddp" | "fsdp2" | "fsdp2_full" | "fsdp2_unsharded", "max_steps", "ckpt_every" |
null, "kill_at": global step | null, "resume": checkpoint path | null, "fused": bool, "checkpointing": bool,
"skew": seconds}], "num_nodes": 1 | world}.

Every training step appends one JSON line to ``<out>/<name>.rank<r>.jsonl`` (global step, plan step, keys,
this rank's loss); rank 0 writes the monitor's summary to ``<out>/<name>.monitor.json`` and any error
raised by ``fit`` to ``<out>/<name>.error``. ``skew`` sleeps rank 1 for that long in every backward (after
its forward), to make it the slow rank.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import CrashAt, SimulatedCrash  # noqa: E402

from lightning_adaptiveload import LoadBalanceMonitor  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.fusion import FusedNormModulateMixin  # noqa: E402
from lightning_adaptiveload.models.module import VideoDiTModule  # noqa: E402

torch.set_num_threads(1)


class Recording(VideoDiTModule):
    """Writes every step's loss; sleeps in rank 1's backward when ``skew`` > 0."""

    def __init__(self, path: str, skew: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path, self.skew = path, skew

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        row = {
            "global_step": int(self.global_step),
            "step": int(batch["step"]),
            "keys": list(batch["keys"]),
            "loss": float(loss.detach()),
        }
        with open(self.path.replace("{}", str(self.global_rank)), "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.skew and self.global_rank == 1:
            loss.register_hook(lambda g: time.sleep(self.skew))
        return loss


class FusedRecording(FusedNormModulateMixin, Recording):
    pass


class NoSharding(Recording):
    """A module that builds its model but parallelises nothing (the silent failure the issue describes)."""

    def configure_model(self):
        if self.model is None:
            from lightning_adaptiveload.models.video_dit import VideoDiT

            self.model = VideoDiT(self.model_config)


def _strategy(name: str):
    if name.startswith("ddp"):
        return DDPStrategy(process_group_backend="gloo")
    # "fsdp2_full": a full (single-file) checkpoint gathered on rank 0, instead of one file per rank.
    full = name == "fsdp2_full"
    return ModelParallelStrategy(process_group_backend="gloo", save_distributed_checkpoint=not full)


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    nodes = int(cfg.get("num_nodes", 1))
    if nodes > 1:
        # One process per "node" (as SLURM or torchrun on several hosts would start them): the node rank
        # differs, the local rank is 0 everywhere, so only the trainer knows the global rank.
        os.environ["NODE_RANK"], os.environ["LOCAL_RANK"] = os.environ["LOCAL_RANK"], "0"
    rank = int(os.environ["NODE_RANK"]) * (cfg["world"] // nodes) + int(os.environ["LOCAL_RANK"])
    for run in cfg["runs"]:
        name, out = run["name"], cfg["out"]
        pl.seed_everything(1234, verbose=False)  # the noise generator's seed: the same in every launch
        path = os.path.join(out, f"{name}.rank{{}}.jsonl")
        dm = AdaptiveLoadDataModule(
            train_shards=cfg["data"],
            max_tokens=run.get("max_tokens", 512),
            schedule="lockstep",
            num_workers=0,
            seed=0,
        )
        cls = (
            NoSharding
            if run["strategy"] == "fsdp2_unsharded"
            else FusedRecording
            if run.get("fused")
            else Recording
        )
        module = cls(
            path,
            skew=run.get("skew", 0.0),
            init_from=cfg["init_from"],
            lr=1e-3,
            warmup_steps=0,
            activation_checkpointing=bool(run.get("checkpointing")),
        )
        monitor = LoadBalanceMonitor(write_files=False, print_summary=False, plots=False, count_flops=False)
        callbacks: list[Callback] = [monitor]
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
            devices=cfg["world"] // nodes,
            num_nodes=nodes,
            strategy=_strategy(run["strategy"]),
            max_steps=run["max_steps"],
            gradient_clip_val=run.get("clip"),
            logger=False,
            enable_checkpointing=bool(run.get("ckpt_every")),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            callbacks=callbacks,
        )
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=run.get("resume"))
        except SimulatedCrash:
            if rank == 0:
                open(os.path.join(out, name + ".crashed"), "w").close()
            torch.distributed.barrier()
        except Exception as exc:  # the refusal tests look for the message
            with open(os.path.join(out, f"{name}.rank{rank}.error"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            continue
        if rank == 0 and monitor.summary:
            summary = {**monitor.summary, "rank_compute_s": [c.tolist() for c in monitor._rank_compute]}
            with open(os.path.join(out, name + ".monitor.json"), "w") as f:
                json.dump(summary, f, default=str)


if __name__ == "__main__":
    main()

"""One rank of a CPU (gloo) run of the tiny VideoDiTModule under DDP, FSDP2 or FSDP v1 (launched by
tests/integration/test_fsdp.py and tests/integration/test_fsdp_batches.py).

Launched like torchrun (see ``tests/_ddp_data_runner.launch``). Usage::

    python tests/_fsdp_runner.py CONFIG.json

CONFIG: {"data": shard dir, "out": dir, "world": N, "init_from": weights folder, "runs": [{"name",
"strategy": "ddp" | "fsdp2" | "fsdp2_full" | "fsdp2_unsharded" | "fsdp" | "fsdp_blocks" | "model_checks",
"max_steps" | "max_epochs", "schedule" ("lockstep"), "lockstep_tail" ("packed"), "drop_image_text": bool,
"evaluate": bool, "ckpt_every" | null, "kill_at": global step | null, "resume": checkpoint path | null,
"fused": bool, "checkpointing": bool, "skew": seconds}], "num_nodes": 1 | world}.

Every training step appends one JSON line to ``<out>/<name>.rank<r>.jsonl`` (global step, plan step, keys,
whether it was a pack and had text, this rank's loss); rank 0 writes the monitor's summary to
``<out>/<name>.monitor.json``, and each rank any error raised by ``fit`` to ``<out>/<name>.rank<r>.error``.
``skew`` sleeps rank 1 for that long in every backward (after its forward), to make it the slow rank.
``drop_image_text`` drops the text of every single-frame sample (their batches then have none).
``evaluate`` validates after the epoch (``val_shards`` = the training data), then tests and predicts on it,
and writes ``<out>/<name>.eval.rank<r>.json``: the validation and test losses and the predicted per-sample
losses by key. ``fsdp_blocks`` is FSDP v1 with every ``DiTBlock`` its own unit; ``fsdp`` wraps the module
whole (Lightning's default). ``model_checks`` runs ``_fsdp_model_checks.run_checks`` (no Lightning).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import CrashAt, SimulatedCrash  # noqa: E402

from lightning_adaptiveload import LoadBalanceMonitor, _dist  # noqa: E402
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.fusion import FusedNormModulateMixin  # noqa: E402
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import VideoDiTModule  # noqa: E402
from lightning_adaptiveload.models.module_settings import MemorySettings, OptimizerSettings
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

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
            "packed": bool(batch.get("packed")),
            "text": batch.get("text") is not None,
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


class CpuFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU (gloo). Lightning refuses the class itself off CUDA (an exact type check) and
    gives FSDP no device there, where torch's FSDP then looks for an accelerator; this one names the CPU."""

    def _setup_model(self, model):
        from unittest import mock

        from torch.distributed.fsdp import FullyShardedDataParallel

        class OnCpu(FullyShardedDataParallel):
            def __init__(self, module, *args, **kwargs):
                super().__init__(module, *args, **{**kwargs, "device_id": torch.device("cpu")})

        with mock.patch("torch.distributed.fsdp.FullyShardedDataParallel", OnCpu):
            return super()._setup_model(model)


def _strategy(name: str):
    if name.startswith("ddp"):
        return DDPStrategy(process_group_backend="gloo")
    if name in ("fsdp", "fsdp_blocks"):
        from lightning_adaptiveload.models.video_dit import DiTBlock

        wrap = {DiTBlock} if name == "fsdp_blocks" else None
        return CpuFSDPStrategy(process_group_backend="gloo", auto_wrap_policy=wrap)
    # "fsdp2_full": a full (single-file) checkpoint gathered on rank 0, instead of one file per rank.
    full = name == "fsdp2_full"
    return ModelParallelStrategy(process_group_backend="gloo", save_distributed_checkpoint=not full)


def drop_image_text(sample: dict) -> dict:
    """The sample without text if it is a single frame (``sample_transform``)."""
    return {**sample, "text": None} if sample["latent"].shape[1] == 1 else sample


def evaluate(trainer: pl.Trainer, module: Recording, dm: AdaptiveLoadDataModule, path: str) -> None:
    """After ``fit`` (which validated): test and predict on the same trainer; write the three results."""
    result = {"val": float(trainer.callback_metrics["val/loss"])}
    result["test"] = trainer.test(module, datamodule=dm, verbose=False)[0]["test/loss"]
    predictions = trainer.predict(module, datamodule=dm)
    result["predict"] = {k: float(v) for p in predictions for k, v in zip(p["keys"], p["loss"])}
    with open(path, "w") as f:
        json.dump(result, f)


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
        if run["strategy"] == "model_checks":  # without Lightning, in the process group a fit left
            from _fsdp_model_checks import run_checks

            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("gloo", rank=rank, world_size=cfg["world"])
            run_checks(out, rank, cfg["world"])
            continue
        pl.seed_everything(1234, verbose=False)  # the noise generator's seed: the same in every launch
        path = os.path.join(out, f"{name}.rank{{}}.jsonl")
        evaluating = bool(run.get("evaluate"))
        dm = AdaptiveLoadDataModule(
            train_shards=cfg["data"],
            sample_transform=drop_image_text if run.get("drop_image_text") else None,
            **({"val_shards": cfg["data"], "test_shards": cfg["data"], "predict_shards": cfg["data"]} if evaluating else {}),
            batching=Batching(max_tokens=run.get("max_tokens", 512)),
            plan=PlanSettings(schedule=run.get("schedule", "lockstep"), lockstep_tail=run.get("lockstep_tail", "packed")),
            loader=Loader(num_workers=0, seed=0),
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
            optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0),
            memory=MemorySettings(activation_checkpointing=bool(run.get("checkpointing"))),
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
            max_steps=run.get("max_steps", -1),
            max_epochs=run.get("max_epochs"),
            reload_dataloaders_every_n_epochs=1,
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
            if evaluating:
                evaluate(trainer, module, dm, os.path.join(out, f"{name}.eval.rank{rank}.json"))
        except SimulatedCrash:
            if rank == 0:
                open(os.path.join(out, name + ".crashed"), "w").close()
            torch.distributed.barrier()
        except Exception as exc:  # the refusal tests look for the message
            with open(os.path.join(out, f"{name}.rank{rank}.error"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
            continue
        if rank == 0 and monitor.summary:
            summary = {**monitor.summary, "rank_compute_s": [c.tolist() for c in monitor._rank_compute]}
            with open(os.path.join(out, name + ".monitor.json"), "w") as f:
                json.dump(summary, f, default=str)
    # End as the package's CLI ends every subcommand: the ranks wait for each other, then destroy the gloo
    # group while the interpreter is whole. FSDP2's device mesh keeps its own references to the groups, so
    # the exit handler's destroy cannot stop gloo's workers (docs/ci_flake.md, "2026-12-04").
    _dist.destroy_gloo_group_now()


if __name__ == "__main__":
    main()

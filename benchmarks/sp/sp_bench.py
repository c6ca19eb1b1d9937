"""Measure Ulysses sequence parallelism on the GPUs of one host: tokens/s, MFU, memory per GPU and balance of
one configuration (model, resolution, degree), through the real data path. Launched by ``gpu_sp.sh``.

    python benchmarks/sp/sp_bench.py --config wan13b_480p --degree 2 --steps 20 --warmup 5 --out benchmarks/results

Configurations: ``wan13b_480p`` (wan-1.3b, wan21_480p synthetic shards, DDP, ``max_tokens`` 32,760 per GPU)
and ``wan14b_720p`` (wan-14b, wan21_720p, FSDP2, ``max_tokens`` 75,600 per GPU: the recipe's ceiling; at
degree 1 on 4 GPUs that may not fit, which is recorded as ``"oom"``). At degree G the world's GPUs form
``world / G`` groups (``SequenceParallelStrategy`` / ``SequenceParallelFSDPStrategy``, degree 1 included),
the data is planned for the groups (``plan.sequence_parallel``) and a group's batch holds G times one GPU's
``max_tokens``. Lockstep schedule (the recipes'), activation checkpointing, bf16 mixed precision.

Figures (rank 0 writes ``sp_<config>_g<G>_<device>_<date>.json``):

* ``tokens_per_s``: the steps' ``global_tokens`` (every group's tokens, each once) over their wall time
  (CUDA-synchronised at every step's start and end, on rank 0), after ``--warmup`` steps;
* ``mfu``: the job's training FLOPs (3x ``forward_flops`` of every group's batch) over wall time x GPUs x the
  device's dense bf16 peak (``stats.peak_flops``);
* ``memory_gib``: every GPU's peak allocated and reserved memory;
* ``balance``: the ``LoadBalanceMonitor`` summary (straggler wait, compute CV across the GPUs).

Never asserts a time. Needs the sequence-parallel strategies of ``lightning_adaptiveload.models.module``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_adaptiveload import LoadBalanceMonitor, _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import (
    SequenceParallelFSDPStrategy,
    SequenceParallelStrategy,
    VideoDiTModule,
)
from lightning_adaptiveload.models.module_settings import MemorySettings
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.stats import peak_flops
from lightning_adaptiveload.tools.simulate_sequence import model_comm

CONFIGS = {
    "wan13b_480p": {"preset": "wan-1.3b", "mix": "wan21_480p", "max_tokens": 32760, "fsdp": False},
    "wan14b_720p": {"preset": "wan-14b", "mix": "wan21_720p", "max_tokens": 75600, "fsdp": True},
}


class StepMeter(Callback):
    """Wall time of every step (CUDA-synchronised), its global tokens and this rank's FLOPs."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.rows: list[dict] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        self.rows.append(
            {
                "step": int(trainer.global_step),
                "seconds": time.perf_counter() - self._t0,
                "global_tokens": int(batch["global_tokens"]),
                "num_tokens": int(batch["num_tokens"]),
                "flops": float(pl_module.flops_per_batch(batch)),
            }
        )


def run(args: argparse.Namespace) -> dict:
    cfg = CONFIGS[args.config]
    g = args.degree
    pl.seed_everything(0, verbose=False)
    data = os.path.join(args.data_root, args.config)
    dm = AdaptiveLoadDataModule(
        os.path.join(data, "train"),
        batching=Batching(max_tokens=cfg["max_tokens"]),
        plan=PlanSettings(
            schedule="lockstep",
            sequence_parallel=g,
            sequence_comm=model_comm(cfg["preset"]).to_dict(),
            chunk_samples=None,
        ),
        loader=Loader(num_workers=4, pin_memory=True),
        synthetic={
            "mix": cfg["mix"],
            "num_samples": args.samples,
            "samples_per_shard": 16,
            "text_dim": 4096,
            "text_len_range": [16, 256],
            "seed": 0,
        },
    )
    module = VideoDiTModule(preset=cfg["preset"], memory=MemorySettings(activation_checkpointing=True))
    kind = SequenceParallelFSDPStrategy if cfg["fsdp"] else SequenceParallelStrategy
    meter = StepMeter(args.warmup)
    monitor = LoadBalanceMonitor(write_files=False, print_summary=False, plots=False)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        strategy=kind(sequence_parallel_size=g),
        precision="bf16-mixed",
        max_steps=args.warmup + args.steps,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[meter, monitor],
    )
    result: dict = {"config": args.config, **cfg, "degree": g, "gpus": args.gpus, "groups": args.gpus // g}
    try:
        trainer.fit(module, datamodule=dm)
    except torch.cuda.OutOfMemoryError as err:
        result.update(oom=True, error=str(err).splitlines()[0])
    rows = [r for r in meter.rows if r["step"] >= args.warmup]
    rank = _dist.rank_and_world()[0]
    # Every rank's FLOPs of its group's batch per step and its peak memory, gathered on every rank.
    flops = _dist.all_gather_floats([sum(r["flops"] for r in rows)])
    mem = _dist.all_gather_floats(
        [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30]
    )
    seconds = sum(r["seconds"] for r in rows)
    tokens = sum(r["global_tokens"] for r in rows)
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, "bf16")
    job_flops = sum(f[0] for f in flops) / g  # each group's batch counted once
    result.update(
        device=name,
        date=dt.date.today().isoformat(),
        steps_timed=len(rows),
        warmup=args.warmup,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else None,
        tokens_per_s_per_gpu=tokens / seconds / args.gpus if seconds else None,
        mfu=job_flops / (seconds * args.gpus * peak) if seconds and peak else None,
        memory_gib=[{"rank": r, "allocated": m[0], "reserved": m[1]} for r, m in enumerate(mem)],
        balance={k: v for k, v in (monitor.summary or {}).items() if isinstance(v, int | float | str)},
        steps=rows,
        measured=True,
    )
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tag = name.lower().replace(" ", "-")
        path = os.path.join(args.out, f"sp_{args.config}_g{g}_{tag}_{result['date']}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {path}: {result.get('tokens_per_s')} tokens/s, MFU {result.get('mfu')}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--degree", type=int, required=True, help="sequence-parallel degree G (1, 2, 4)")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="steps before the timed ones")
    ap.add_argument("--samples", type=int, default=512, help="synthetic samples written once")
    ap.add_argument("--data-root", default="/tmp/sp_data")
    ap.add_argument("--out", default="benchmarks/results")
    run(ap.parse_args())


if __name__ == "__main__":
    main()

"""``KernelWarmup``: the Lightning callback of :mod:`.kernel_warmup` (what it runs, what it refuses, and why)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_adaptiveload.models.kernel_warmup import planned_batches, warm_kernels, warm_packs
from lightning_adaptiveload.models.sharding import is_fsdp2_sharded

__all__ = ["KernelWarmup"]


def _refusal(trainer: Any, pl_module: Any) -> str | None:
    model = getattr(pl_module, "model", None)
    if model is None or not hasattr(model, "pack_prologue") or not hasattr(model, "blocks"):
        return (
            f"KernelWarmup runs the blocks of a VideoDiT (pl_module.model with pack_prologue and blocks); "
            f"{type(pl_module).__name__}.model is {type(model).__name__}. Remove the callback for this model"
        )
    ds = getattr(getattr(trainer, "datamodule", None), "train_dataset", None)
    if ds is None or not hasattr(ds, "plan") or not hasattr(ds, "index"):
        return (
            "KernelWarmup reads the epoch's plan: train with lightning_adaptiveload's AdaptiveLoadDataModule"
        )
    return None


def _text_of(batch: Any) -> tuple[int, torch.dtype] | None:
    text = batch.get("text") if isinstance(batch, dict) else None
    return None if text is None else (int(text.shape[1]), text.dtype)


class _Progress:
    """A line every 10 seconds (rank 0) while the warm-up runs."""

    def __init__(self, rank: int) -> None:
        self.rank, self.start, self.last = rank, time.monotonic(), time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.rank == 0 and now - self.last >= 10.0 and done < total:
            self.last = now
            rank_zero_info(
                f"[adaptiveload] kernel warm-up: {done}/{total} batch shapes, {now - self.start:.1f} s"
            )


class KernelWarmup(Callback):
    """Before the first step of every training epoch, build the attention kernels of the shapes this rank's
    plan of the epoch takes (:mod:`~lightning_adaptiveload.models.kernel_warmup` says what runs and what is
    refused).

    Shapes run before (in an earlier epoch) are not run again. Rank 0 logs the time it took; every rank keeps
    :attr:`history`, one dict per epoch: ``epoch``, ``batches`` (planned), ``packs`` (run), ``seconds``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: list[dict[str, Any]] = []
        self._seen: set = set()  # dense batches and runs run before (warm_packs)
        self._pending = False
        self._off = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Not in setup: the model is made, and sharded, in configure_model, after the callbacks' setup.
        why = _refusal(trainer, pl_module)
        if why is not None:
            raise ValueError(why)
        self._off = any(is_fsdp2_sharded(m) for m in pl_module.model.modules())
        if self._off:  # the wan recipes carry the callback: a switch to FSDP2 loses the warm-up, not the run
            rank_zero_warn(
                "KernelWarmup does nothing under FSDP2: one sharded block called alone gathers its parameters, "
                "a collective that ranks warming different shapes would not match. Training goes on without it; "
                "remove the callback to silence this"
            )

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._pending = not self._off

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._pending:
            return
        self._pending = False
        ds = trainer.datamodule.train_dataset
        if ds.plan is None:
            return
        model = pl_module.model
        start = time.monotonic()
        planned = [0]  # batches read from the plan (a generator: counted as warm_packs takes them)

        def batches() -> Iterator[tuple]:
            for b in planned_batches(ds.plan, ds.rank, ds.index.latent_shape):
                planned[0] += 1
                yield b

        packs = warm_packs(batches(), model.config.patch_size, self._seen)
        with trainer.precision_plugin.train_step_context():
            warm_kernels(model, packs, _text_of(batch), pl_module.device, _Progress(trainer.global_rank))
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        seconds = time.monotonic() - start
        entry = {
            "epoch": int(trainer.current_epoch),
            "batches": planned[0],
            "packs": len(packs),
            "seconds": seconds,
        }
        self.history.append(entry)
        rank_zero_info(
            f"[adaptiveload] kernel warm-up, epoch {entry['epoch']}: {entry['packs']} batch shapes (of "
            f"{entry['batches']} planned batches on rank {trainer.global_rank}) through block 0 in {seconds:.1f} s"
        )

"""``KernelWarmup``: the Lightning callback of :mod:`lightning_adaptiveload.models.kernel_warmup` (what it runs,
what it refuses, its budget, and why)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload.models.kernel_warmup import WarmupPlan, plan_warmup, planned_batches, warm_kernels
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
    """Rank 0's lines while the warm-up runs: after the first few packs, an estimate of the whole (and where
    the time budget will stop it); then a line every 10 seconds."""

    ESTIMATE_AFTER = 3

    def __init__(self, rank: int, max_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.max_seconds, self.clock = rank, max_seconds, clock
        self.start = self.last = clock()
        self.estimate: float | None = None  # seconds for every pack, at the rate of the first ones

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        spent = now - self.start
        if done == self.ESTIMATE_AFTER and done < total:
            self.estimate = spent / done * total
            stop = ""
            if self.estimate > self.max_seconds:
                stop = (
                    f"; max_seconds={self.max_seconds:g} stops it after about "
                    f"{int(self.max_seconds * done / max(spent, 1e-9))} of them"
                )
            if self.rank == 0:
                rank_zero_info(
                    f"[adaptiveload] kernel warm-up: the first {done} of {total} batch shapes took {spent:.1f} s: "
                    f"about {self.estimate:.0f} s for all{stop}"
                )
        if self.rank == 0 and now - self.last >= 10.0 and done < total:
            self.last = now
            rank_zero_info(f"[adaptiveload] kernel warm-up: {done}/{total} batch shapes, {spent:.1f} s")


def _check_budget(max_shapes: Any, max_seconds: Any, min_count: Any) -> None:
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
        raise ValueError(
            f"KernelWarmup(max_shapes={max_shapes!r}): the most shapes to warm an epoch must be an integer >= 1; "
            "remove the callback to warm nothing"
        )
    if (
        isinstance(max_seconds, bool)
        or not isinstance(max_seconds, int | float)
        or not (math.isfinite(max_seconds) and max_seconds > 0)
    ):
        raise ValueError(
            f"KernelWarmup(max_seconds={max_seconds!r}): the time budget of an epoch's warm-up must be a finite "
            "number of seconds > 0"
        )
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(
            f"KernelWarmup(min_count={min_count!r}): the steps that must meet a shape for it to be warmed must be "
            "an integer >= 1 (1 warms shapes met once too)"
        )


class KernelWarmup(Callback):
    """Before the first step of every training epoch, build the attention kernels of the shapes this rank's
    plan of the epoch meets often enough, within a budget (:mod:`~lightning_adaptiveload.models.kernel_warmup`
    says what runs and what is refused).

    Args:
        max_shapes: the most shapes (distinct dense batches, runs of mixed packs, mixed sample counts) warmed
            per epoch, the most frequent first.
        max_seconds: an epoch's warm-up stops before a pass that would end past this many seconds (at the
            mean rate so far; on a GPU the clock synchronises the device).
        min_count: a shape is warmed only when at least this many of the epoch's steps meet it (a shape met
            once is built once either way); 1 warms those too.

    Rank 0 logs, before the warm-up, how many new shapes the plan meets and how many it warms, an estimate of
    the time after the first three passes, and at the end the time and what it skipped (shapes, by why, and
    the steps that meet them). Shapes of an earlier epoch (warmed, or built in its training) are not run
    again. Every rank keeps :attr:`history`, one dict per epoch: ``epoch``, ``batches`` (planned), ``shapes``
    (new ones the plan meets), ``warmed``, ``planned_packs``, ``packs`` (run), ``seconds``, ``skipped_shapes``,
    ``skipped_steps`` and ``skipped`` (``once``, ``over_max_shapes``, ``over_max_seconds``).
    """

    def __init__(self, max_shapes: int = 64, max_seconds: float = 300.0, min_count: int = 2) -> None:
        super().__init__()
        _check_budget(max_shapes, max_seconds, min_count)
        self.max_shapes, self.max_seconds, self.min_count = max_shapes, float(max_seconds), min_count
        self.history: list[dict[str, Any]] = []
        self._seen: set = set()  # shapes warmed or met before (WarmupPlan.seen_after)
        self._pending = False
        self._off = False
        self._clock: Callable[[], float] = time.monotonic  # seconds of max_seconds (a test gives its own)

    @override
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

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._pending = not self._off

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._pending:
            return
        self._pending = False
        ds = trainer.datamodule.train_dataset
        if ds.plan is None:
            return
        model = pl_module.model
        device = pl_module.device
        rank = trainer.global_rank

        def clock() -> float:  # the device's time: CUDA work is asynchronous
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return self._clock()

        start = clock()
        plan = plan_warmup(
            planned_batches(ds.plan, ds.rank, ds.index.latent_shape),
            model.config.patch_size,
            self._seen,
            max_shapes=self.max_shapes,
            min_count=self.min_count,
        )
        epoch = int(trainer.current_epoch)
        rank_zero_info(_before(plan, epoch, rank, self.max_seconds))
        run = 0
        if plan.packs:
            with trainer.precision_plugin.train_step_context():
                run = warm_kernels(
                    model,
                    plan.packs,
                    _text_of(batch),
                    device,
                    _Progress(rank, self.max_seconds, clock),
                    max_seconds=self.max_seconds,
                    clock=clock,
                )
        seconds = clock() - start
        self._seen |= plan.seen_after(run)
        skipped = plan.skipped(run)
        entry = {
            "epoch": epoch,
            "batches": plan.steps,
            "shapes": plan.shapes,
            "warmed": plan.shapes - skipped["shapes"],
            "planned_packs": len(plan.packs),
            "packs": run,
            "seconds": seconds,
            "skipped_shapes": skipped["shapes"],
            "skipped_steps": skipped["steps"],
            "skipped": {k: skipped[k] for k in ("once", "over_max_shapes", "over_max_seconds")},
        }
        self.history.append(entry)
        left = ""
        if skipped["shapes"]:
            left = (
                f"; skipped {skipped['shapes']} shapes ({skipped['once']} met fewer than {self.min_count} times, "
                f"{skipped['over_max_shapes']} over max_shapes={self.max_shapes}, {skipped['over_max_seconds']} "
                f"over max_seconds={self.max_seconds:g}), met by {skipped['steps']} of the {plan.steps} steps"
            )
        rank_zero_info(
            f"[adaptiveload] kernel warm-up, epoch {epoch}: {run} batch shapes (of {plan.steps} planned batches "
            f"on rank {rank}) through block 0 in {seconds:.1f} s{left}"
        )


def _before(plan: WarmupPlan, epoch: int, rank: int, max_seconds: float) -> str:
    """The line logged before the warm-up runs: what the plan needs, what will be warmed."""
    line = (
        f"[adaptiveload] kernel warm-up, epoch {epoch}: rank {rank}'s {plan.steps} planned batches meet "
        f"{plan.shapes} new shapes, {plan.recurring} of them at least {plan.min_count} times; warming "
        f"{plan.chosen} (max_shapes={plan.max_shapes}) in {len(plan.packs)} passes, within max_seconds={max_seconds:g}"
    )
    if plan.mostly_once:
        line += (
            f". Nearly every shape is met once ({plan.met_once} of {plan.shapes}): warming one would only move its "
            "build before step 1, so "
        )
        if plan.min_count == 1:
            line += f"min_count=1 warms them anyway, at most max_shapes={plan.max_shapes}"
        else:
            line += (
                "nothing is warmed" if not plan.chosen else f"only the {plan.chosen} that recur are warmed"
            )
    return line

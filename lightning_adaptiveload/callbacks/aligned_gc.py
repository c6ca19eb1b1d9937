"""AlignedGC
=========

Python's garbage collection at the same steps on every rank.

CPython collects when its allocation counters cross a threshold, a moment of each process's own. A full
(generation 2) collection of a training process walks every tracked object (the model's modules, compiled
graphs and their guards, the plan), and in a compiled wan-1.3b run on one H200 two of them took 488 ms and
767 ms, in 2 of 150 steps (run 77, ``benchmarks/results/step_noise_h200_2026-11-29_run76-79``). Under DDP
every other rank waits for such a pause at the step's gradient all-reduce, so pauses that land on different
ranks at different steps add up to a wait on all of them.

This callback turns automatic collection off for the fit and collects on every rank after the same
global steps (every rank runs the same number of steps: the DataModule plans them equal), where the
ranks pause together instead of in turn. At the start of training it collects once and moves what
survives (the model, the data module, imported code) into the permanent generation (``gc.freeze``), so
that later full collections do not walk them again. Everything is restored when the fit ends, also on
an error.

Not measured on GPUs yet: the effect on the straggler wait is a hypothesis until a multi-GPU run shows it.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AlignedGC"]


class AlignedGC(Callback):
    """Collect garbage after the same global steps on every rank; no automatic collection during the fit.

    Args:
        every_n_steps: a collection of generations 0 and 1 (cheap: the objects made since the last one)
            after every this many training steps.
        full_every_n_steps: a full collection (generation 2) after every this many steps; a multiple of
            ``every_n_steps`` is not required. None: only at the end of each training epoch.
        freeze: at the start of training, collect and freeze the survivors (``gc.freeze``), so that full
            collections skip them. They are unfrozen when the fit ends.
        log_pauses: log ``gc/pause_ms`` (this rank's collection time, per logged step) with the module's
            ``log``.

    Raises:
        ValueError: a step count below 1 or not an integer, naming it.

    Attributes:
        pauses: ``(global_step, generation, seconds)`` of every collection it ran, on this rank.
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        full_every_n_steps: int | None = 200,
        freeze: bool = True,
        log_pauses: bool = False,
    ) -> None:
        self.every_n_steps = _steps(every_n_steps, "every_n_steps")
        self.full_every_n_steps = (
            None if full_every_n_steps is None else _steps(full_every_n_steps, "full_every_n_steps")
        )
        self.freeze = bool(freeze)
        self.log_pauses = bool(log_pauses)
        self.pauses: list[tuple[int, int, float]] = []
        self._was_enabled: bool | None = None
        self._frozen = False
        self._last_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.disable()
        self._last_step = int(trainer.global_step)  # collected after a step, never before the first
        if self.freeze and not self._frozen:
            self._collect(trainer, 2)
            gc.freeze()
            self._frozen = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if step == self._last_step:  # a batch of gradient accumulation: the step has not advanced
            return
        self._last_step = step
        if self.full_every_n_steps is not None and step % self.full_every_n_steps == 0:
            pause = self._collect(trainer, 2)
        elif step % self.every_n_steps == 0:
            pause = self._collect(trainer, 1)
        else:
            return
        if self.log_pauses:
            pl_module.log("gc/pause_ms", pause * 1e3, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.full_every_n_steps is None:
            self._collect(trainer, 2)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def _collect(self, trainer: pl.Trainer, generation: int) -> float:
        start = time.perf_counter()
        gc.collect(generation)
        pause = time.perf_counter() - start
        self.pauses.append((int(trainer.global_step), generation, pause))
        return pause

    def _restore(self) -> None:
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


def _steps(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AlignedGC: {name} must be an integer >= 1, got {value!r}")
    return value

"""ClosedLoop
==========

The plan learns the cost of a sample from the run itself: the cost model refitted from the
:class:`~lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor`'s measurements and handed to the data
module, which plans the next epoch (or, with ``replan_wait``, the rest of the running one) with it. See
``docs/closed_loop.md``.

This module holds the Lightning hooks only: the fit and what to apply are in
:mod:`~lightning_adaptiveload.monitor.cost_refit` and :mod:`~lightning_adaptiveload.planning.refit`, the replan
decision in :mod:`~lightning_adaptiveload.monitor.replan`, the checkpoint state's versions in
:mod:`~lightning_adaptiveload.monitor.loop_state`, the fit loop's internals in
:mod:`lightning_adaptiveload._lightning_compat`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload import _dist
from lightning_adaptiveload._lightning_compat import (
    batches_left_in_epoch,
    epoch_length_fixed_because,
    set_epoch_length,
    total_batch_idx,
)
from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.monitor import loop_state, report
from lightning_adaptiveload.monitor.cost_refit import (
    RESIZE_OPT_IN,
    CostRefitter,
    apply_to_datamodule,
    describe_dropped,
    refit_metrics,
    withheld_because,
)
from lightning_adaptiveload.monitor.replan import ReplanTrigger, replan_metrics
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import DROP_REASONS, RefitConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ClosedLoop"]

log = logging.getLogger(__name__)


class ClosedLoop(Callback):
    r"""Refit the cost model from the LoadBalanceMonitor's measurements and plan the next epoch with it.

    Put it after a :class:`~lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor` in the trainer's
    callbacks; it reads the steps the monitor gathers (every rank's, in the monitor's one collective per
    logged step) and adds no collective of its own but one small broadcast per refit.

    - **At the end of every training epoch** (and every ``every_n_steps`` optimizer steps) the cost model is
      refitted from every rank's steps since the last refit
      (:func:`~lightning_adaptiveload.planning.refit.refit_cost_model`, rank 0's result kept on every rank) and
      handed to the data module, whose next epoch is planned with it (an ``AdaptiveLoadDataModule`` with
      ``max_compute="auto"``; otherwise the refit is logged only, and said why).
    - **It is logged** under the monitor's prefix plus ``"refit/"`` and appended to ``cost_refit.jsonl`` in the
      monitor's folder (rank 0).
    - **It is checkpointed** (:meth:`state_dict`): the learned model, its measurements and the window
      gathered since, so that a resumed run plans with them. A checkpoint of 0.1.0 kept them under the
      monitor's state; they are read from there too (:mod:`~lightning_adaptiveload.monitor.loop_state`, which
      checks every field first: a bad one is a ``LoopStateError`` naming the checkpoint key, the field and the
      rule). A restored model the data module refuses (a cost that is not positive at one of its lengths) is
      dropped with a warning naming the checkpoint key, and the data module keeps its own.
    - **It never stops training**: a refit that fails numerically keeps the last good model, rows that are no
      measurement are left out and counted (``points_dropped``), each said in a warning; a
      ``cost_refit.jsonl`` that cannot be written is reported once.
    - With ``RefitConfig(replan_wait=...)`` a window of steps whose straggler wait passes it refits and replans
      the rest of the running epoch (``docs/closed_loop.md``, "Mid-epoch replanning").

    Args:
        refit: the refit settings: ``True`` (:class:`~lightning_adaptiveload.planning.refit.RefitConfig`'s
            defaults), a ``RefitConfig`` or its dict (e.g. ``{"every_n_steps": 500, "resize_batches": True}``),
            or ``False``: off (nothing refitted, nothing in the checkpoint).

    Raises:
        ValueError: on a bad ``refit``; at ``fit`` when the trainer has no ``LoadBalanceMonitor`` before it.

    Example::

        from lightning import Trainer
        from lightning_adaptiveload import ClosedLoop, LoadBalanceMonitor

        trainer = Trainer(strategy="ddp", devices=8, callbacks=[LoadBalanceMonitor(), ClosedLoop()],
                          reload_dataloaders_every_n_epochs=1)
    """

    def __init__(self, refit: bool | RefitConfig | Mapping[str, Any] = True) -> None:
        super().__init__()
        if isinstance(refit, Mapping):
            refit = RefitConfig.from_dict(refit)
        if not isinstance(refit, bool | RefitConfig):
            raise ValueError(
                f"ClosedLoop: refit must be True, False, a RefitConfig or its dict, got {refit!r}"
            )
        self.refit = refit
        # Outside on_train_start: a checkpoint restores the learned model before it.
        self._refitter = CostRefitter(RefitConfig() if refit is True else refit) if refit else None
        self._trigger = ReplanTrigger(self._refitter.config) if self._refitter is not None else None
        self._monitor: LoadBalanceMonitor | None = None
        self._trainer: Any = None  # set in setup: load_state_dict hands a restored model to its data module
        self._reset()

    def _reset(self) -> None:
        self._rank, self._world = 0, 1
        self._refit_step = -1  # the optimizer step of the last every_n_steps refit
        self._warned: set[str] = set()
        self._files = report.FileGuard("ClosedLoop", _warn_user)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ the monitor

    @property
    def monitor(self) -> LoadBalanceMonitor | None:
        """The LoadBalanceMonitor whose measurements this loop reads (found in ``setup``)."""
        return self._monitor

    def _find_monitor(self, trainer: pl.Trainer) -> LoadBalanceMonitor:
        callbacks = list(getattr(trainer, "callbacks", []))
        monitors = [i for i, cb in enumerate(callbacks) if isinstance(cb, LoadBalanceMonitor)]
        names = [type(cb).__name__ for cb in callbacks]
        if not monitors:
            raise ValueError(
                "ClosedLoop refits the cost model from the LoadBalanceMonitor's measurements, and the trainer's "
                f"callbacks {names} have no LoadBalanceMonitor. Add one before the ClosedLoop: "
                "Trainer(callbacks=[LoadBalanceMonitor(), ClosedLoop()]), or in a recipe's trainer.callbacks "
                "'- class_path: lightning_adaptiveload.LoadBalanceMonitor' above "
                "'- class_path: lightning_adaptiveload.ClosedLoop'"
            )
        own = next(i for i, cb in enumerate(callbacks) if cb is self)
        before = [i for i in monitors if i < own]
        if not before:
            raise ValueError(
                f"ClosedLoop must come after the LoadBalanceMonitor in the trainer's callbacks, got {names}: it "
                "acts on the steps the monitor gathered at the end of the same batch. Move the ClosedLoop after "
                "the monitor"
            )
        return callbacks[before[-1]]

    def _on_gather(self, steps: np.ndarray, table: dict[str, np.ndarray]) -> None:
        if self._refitter is not None:
            self._refitter.add_steps(steps)
        if self._trigger is not None:
            self._trigger.add(table)

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitor is not None:
            self._monitor.flush(trainer, pl_module)  # every rank runs the same steps: all flush here

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage != "fit":
            return
        self._monitor = self._find_monitor(trainer)
        self._monitor.add_listener(self._on_gather)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The cost refit's state (``{}`` with ``refit=False``). Gathers the monitor's buffered steps first, so
        that the window is saved whole: a collective, which every rank runs when Lightning saves a checkpoint."""
        if self._refitter is None:
            return {}
        if self._trainer is not None:
            self._flush(self._trainer, self._trainer.lightning_module)
        replan = {} if self._trigger is None else {"replan": self._trigger.state_dict()}
        return {"version": loop_state.STATE_VERSION, "cost_refit": self._refitter.state_dict(), **replan}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (Lightning passes the state under this callback's key), every
        field checked first (:func:`~lightning_adaptiveload.monitor.loop_state.read_loop_state`).

        Raises:
            LoopStateError: (a ``ValueError``) a missing key, a value of the wrong type, a coefficient that is
                not finite or negative: names the checkpoint key, the field and the rule.
        """
        self._load(state_dict, loop_state.state_where(self.state_key))

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A checkpoint with a state under this callback's key is restored by Lightning (load_state_dict); one of
        # 0.1.0 has it under the monitor's.
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return
        monitor_key = self._monitor.state_key if self._monitor is not None else None
        found = states.get(monitor_key) if monitor_key is not None else None
        if loop_state.holds_loop_state(found):
            self._load(found, loop_state.state_where(str(monitor_key)))

    def _load(self, state_dict: Any, where: str) -> None:
        """Check and restore a state found at ``where``; hand its model to the data module, which plans the
        next epoch with it, or drop the model (a warning names it and why) where the data module refuses it."""
        if self._refitter is None or not state_dict:
            return
        state = loop_state.read_loop_state(state_dict, where)  # every part checked before any is restored
        self._refitter.load_state_dict(state["cost_refit"], where)
        if self._trigger is not None and "replan" in state:
            self._trigger.load_state_dict(state["replan"], where)
        # Lightning restores callbacks after `setup` and before the first epoch is planned.
        refitter = self._refitter
        if refitter.model is None or not refitter.applied or self._trainer is None:
            return
        datamodule = getattr(self._trainer, "datamodule", None)
        why_not = self._apply(self._trainer, refitter.model)
        if why_not and datamodule is not None:
            self._warn_once(
                "restored_model",
                f"ClosedLoop: the cost model in {where}['cost_refit']['model'] ({refitter.model.describe()}), "
                f"learned by the run that wrote the checkpoint, is not used: {why_not}. The data module plans "
                "with its own cost model (the recipe's, or the one given to its set_cost_model) until the next "
                "refit.",
            )
        if why_not:
            refitter.model, refitter.applied = None, False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._rank, self._world = _dist.rank_and_world(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._refitter is None or self._monitor is None:
            return
        monitor = self._monitor
        # Just gathered (this batch's step is in the monitor's last gather): check the window's wait.
        just_gathered = monitor.pending_steps == 0 and monitor.gathered_through == total_batch_idx(trainer)
        if just_gathered and self._trigger is not None and self._trigger.armed:
            self._replan_if_waiting(trainer, pl_module)
        every = self._refitter.config.every_n_steps
        step = int(trainer.global_step)
        if every and step % every == 0 and step != self._refit_step:  # once per optimizer step
            self._refit_step = step
            self._refit(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trigger is not None:
            self._trigger.start_epoch(int(trainer.current_epoch))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._refitter is not None:
            self._refit(trainer, pl_module)

    # ------------------------------------------------------------------ the refit

    def _refit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Gather what the monitor buffered, refit the cost model on every rank, hand it to the data module and
        log it; returns whether it was handed over."""
        assert self._refitter is not None
        self._flush(trainer, pl_module)
        if self._refitter.window_rows == 0:
            return False
        datamodule = getattr(trainer, "datamodule", None)
        batcher = getattr(datamodule, "batcher", None)
        prior = getattr(batcher, "cost_model", None) or self._refitter.model or CostModel.default()
        agree = None
        if self._world > 1:  # rank 0's fit on every rank: the next plans must agree bit for bit

            def agree(result: Any) -> Any:
                return trainer.strategy.broadcast(result, src=0)

        window_rows = self._refitter.window_rows
        result = self._refitter.refit(prior, int(trainer.current_epoch), int(trainer.global_step), agree)
        self._say_what_was_left_out(result, prior, window_rows, trainer)
        exact = self._monitor.timing_exact if self._monitor is not None else True
        why_not = withheld_because(result, exact) or self._apply(trainer, result.model)
        self._refitter.settle(result, why_not)
        if why_not and result.status != "kept" and datamodule is not None:
            message = f"ClosedLoop: cost model refitted, not applied: {why_not}"
            if (
                RESIZE_OPT_IN in why_not
            ):  # the default with sizing "dual", not a problem: said once, as information
                if "refit_resize" not in self._warned:
                    self._warned.add("refit_resize")
                    rank_zero_info(message)
            else:
                self._warn_once("refit_" + why_not[:40], message)
        try:
            # The values are the same on every rank (rank 0's fit); sync_dist only spares the user Lightning's
            # epoch-level warning, one per key, at a few scalars' all-reduce per refit.
            pl_module.log_dict(
                {self._prefix + k: v for k, v in refit_metrics(result).items()}, batch_size=1, sync_dist=True
            )
        except Exception as err:  # noqa: BLE001 - a hook where Lightning refuses logging: the file still has it
            self._warn_once("refit_log", f"ClosedLoop: the refit could not be logged here ({err})")
        self._append_line(self._refitter.history[-1])
        return why_not == ""

    def _say_what_was_left_out(self, result: Any, prior: CostModel, rows: int, trainer: pl.Trainer) -> None:
        """Warn (once each) where a refit failed or left out rows that are no measurement; the numbers of every
        refit are in ``cost_refit.jsonl`` (``points_dropped``)."""
        at = f"at epoch {int(trainer.current_epoch)}, step {int(trainer.global_step)}"
        if "fit_failed" in result.points_dropped:
            self._warn_once(
                "refit_failed",
                f"ClosedLoop: the refit {at} failed: {result.reason}. The last good cost model "
                f"({prior.describe()}) stays in use; training goes on.",
            )
        bad = {k: n for k, n in result.points_dropped.items() if k in DROP_REASONS}
        if bad:
            words = describe_dropped(replace(result, points_dropped=bad))
            self._warn_once(
                "refit_dropped",
                f"ClosedLoop: the refit {at} {words} of the window's {rows} rows (rank-steps): readings that "
                "are no measurement. The refit used the others; each refit's counts are in cost_refit.jsonl "
                "(points_dropped).",
            )

    def _apply(self, trainer: pl.Trainer, model: Any) -> str:
        resize = self._refitter is not None and self._refitter.config.resize_batches
        return apply_to_datamodule(getattr(trainer, "datamodule", None), model, resize)

    @property
    def _prefix(self) -> str:
        return self._monitor.prefix if self._monitor is not None else "balance/"

    def _append_line(self, line: Mapping[str, Any]) -> None:
        """A line of ``cost_refit.jsonl`` in the monitor's folder (rank 0, where the monitor writes files). A file
        that cannot be written is reported once, naming it, and training goes on (``docs/monitor.md``)."""
        monitor = self._monitor
        if self._rank != 0 or monitor is None or monitor.outdir is None or not monitor.write_files:
            return
        path = os.path.join(monitor.outdir, "cost_refit.jsonl")
        self._files.write(path, report.append_json_line, path, line)

    # ------------------------------------------------------------------ the mid-epoch replan

    def _replan_if_waiting(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a gather: where the last window's straggler wait is over ``replan_wait`` (rank 0's reading, on
        every rank), refit, and plan the rest of the epoch with the refit model. Logs ``replan/*`` and a
        ``{"event": "replan", ...}`` line of ``cost_refit.jsonl``. Every rank calls it at the same step."""
        trigger = self._trigger
        assert trigger is not None and self._refitter is not None
        if trigger.steps < trigger.config.replan_window:  # the same count on every rank: no collective yet
            return
        datamodule = getattr(trainer, "datamodule", None)
        left = batches_left_in_epoch(trainer)
        wait = trigger.should_replan(int(left) if math.isfinite(left) else 0)
        if self._world > 1:  # the decision must be the same on every rank: rank 0's
            wait = trainer.strategy.broadcast(wait, src=0)
        if wait is None:
            return
        why_not = "" if hasattr(datamodule, "replan_rest") else "the data module has no replan_rest"
        why_not = why_not or epoch_length_fixed_because(trainer)
        if why_not:
            trigger.disarm()
            self._warn_once("replan", f"ClosedLoop: mid-epoch replanning is off: {why_not}")
            return
        applied = self._refit(trainer, pl_module)
        status = self._refitter.history[-1].get("status") if self._refitter.history else None
        if status != "fitted":
            # "kept" or "scaled": too few steps to tell the terms apart; a scaled model has the prior's shape, so
            # its plan would be the old one. Try again after another window.
            trigger.skip()
            return
        if not applied:  # the refit is not applied with these settings (logged): not in this epoch
            trigger.disarm()
            return
        done = datamodule.replan_rest()  # type: ignore[union-attr]
        set_epoch_length(trainer, done.consumed_steps + done.steps_left_after)
        trigger.replanned()
        line = {"event": "replan", "epoch": done.epoch, "step": int(trainer.global_step), "window_wait": wait}
        line.update(done.to_dict(), threshold=trigger.config.replan_wait, window=trigger.config.replan_window)
        metrics = replan_metrics(wait, done.steps_left_before, done.steps_left_after)
        pl_module.log_dict({self._prefix + k: v for k, v in metrics.items()}, batch_size=1, sync_dist=True)
        if self._rank != 0:
            return
        log.info(
            "[adaptiveload] epoch %d: straggler wait %.2f%% over the last %d steps: the rest of the epoch "
            "replanned with the refit cost model (%d steps left before, %d after)",
            done.epoch,
            100 * wait,
            trigger.config.replan_window,
            done.steps_left_before,
            done.steps_left_after,
        )
        self._append_line(line)


def _warn_user(message: str) -> None:
    """A UserWarning on rank 0 (a module function: the callback is pickled under ``ddp_spawn``)."""
    rank_zero_warn(message, category=UserWarning)

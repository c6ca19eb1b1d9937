"""Mid-epoch replanning in the LoadBalanceMonitor: when to replan, and the trainer's count of the epoch's batches.

:class:`ReplanTrigger` (no Lightning) keeps the running epoch's per-step balance figures from the monitor's
gathers and says when the straggler wait of the last ``RefitConfig.replan_window`` steps exceeds
``RefitConfig.replan_wait``; the monitor then refits the cost model and, where the refit is applied, has the
data module plan the rest of the epoch with it (:func:`~lightning_adaptiveload.loading.replan.replan_rest`).

:func:`set_epoch_length` is the one place that tells Lightning's fit loop the epoch's new batch count (its
length was read from the loader when the epoch started). ``docs/closed_loop.md``, "Mid-epoch replanning".
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

from lightning_adaptiveload.monitor import report
from lightning_adaptiveload.monitor.steps import balance_figures
from lightning_adaptiveload.planning.refit import RefitConfig

__all__ = ["ReplanTrigger", "check_trainer", "replan_if_waiting", "replan_metrics", "set_epoch_length"]

log = logging.getLogger(__name__)

_TABLE_KEYS = ("step_time_cv", "imbalance", "straggler_wait", "compute_time_max_s", "counted")


class ReplanTrigger:
    """The running epoch's per-step figures since its start (or its last replan), and the replan decision.

    Args:
        config: the refit settings (``replan_wait``, ``replan_window``, ``max_replans_per_epoch``).

    Attributes:
        replans: mid-epoch replans in the running epoch.
    """

    def __init__(self, config: RefitConfig) -> None:
        self.config = config
        self.replans = 0
        self.epoch: int | None = None
        self._rows: dict[str, list[np.ndarray]] = {k: [] for k in _TABLE_KEYS}

    @property
    def armed(self) -> bool:
        """Whether mid-epoch replanning is on and the epoch may still be replanned."""
        return self.config.replan_wait is not None and self.replans < self.config.max_replans_per_epoch

    @property
    def steps(self) -> int:
        """Steps gathered since the epoch's start or its last replan."""
        return int(sum(len(a) for a in self._rows["counted"]))

    def start_epoch(self, epoch: int) -> None:
        """An epoch starts (or restarts after a resume): no steps; no replans unless it is the epoch the
        replans counted were made in (restored by :meth:`load_state_dict`)."""
        if epoch != self.epoch:
            self.replans = 0
        self.epoch = int(epoch)
        self._clear()

    def state_dict(self) -> dict[str, Any]:
        """The epoch and its replans so far (a resumed epoch replans at most ``max_replans_per_epoch`` in all)."""
        return {"epoch": self.epoch, "replans": self.replans}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = None if state.get("epoch") is None else int(state["epoch"])
        self.replans = int(state.get("replans", 0))

    def add(self, table: dict[str, np.ndarray]) -> None:
        """Add one gather's step table (``monitor.steps.step_table``: one entry per step)."""
        for k in _TABLE_KEYS:
            self._rows[k].append(np.asarray(table[k], dtype=np.float64))

    def window_wait(self) -> float:
        """The straggler wait of the last ``replan_window`` gathered steps (warm-up steps left out), as the
        monitor logs it (``steps.balance_figures``); nan before a whole window has run."""
        n = self.config.replan_window
        if self.steps < n:
            return math.nan
        last = {k: np.concatenate(v)[-n:] for k, v in self._rows.items()}
        return float(balance_figures(last)["straggler_wait"])

    def should_replan(self, steps_left: int) -> float | None:
        """The window's wait when it calls for a replan (over ``replan_wait``, a window of steps left), else
        None. Every rank computes it from the same gathered steps; the monitor still keeps rank 0's answer."""
        if not self.armed or steps_left < self.config.replan_window:
            return None
        wait = self.window_wait()
        return wait if wait > float(self.config.replan_wait) else None  # nan compares False

    def replanned(self) -> None:
        """A replan was made: the next check needs a whole window of the new plan's steps."""
        self.replans += 1
        self._clear()

    def skip(self) -> None:
        """No replan this time (the refit had too few steps): the next check needs another whole window."""
        self._clear()

    def disarm(self) -> None:
        """No more replans in this epoch."""
        self.replans = self.config.max_replans_per_epoch

    def _clear(self) -> None:
        self._rows = {k: [] for k in _TABLE_KEYS}


def check_trainer(trainer: Any) -> str:
    """Why the trainer's running epoch cannot be replanned mid-epoch (``""``: it can).

    The replan changes the epoch's batch count, which Lightning read from the loader when the epoch started:
    :func:`set_epoch_length` updates it, which needs a sized training loader, ``limit_train_batches`` at its
    default and a training step that takes batches (not ``dataloader_iter``).
    """
    loop = getattr(trainer, "fit_loop", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    if loop is None or fetcher is None or not hasattr(fetcher, "length"):
        return "this Lightning version's fit loop has no data fetcher with a length"
    if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
        return "training_step takes dataloader_iter, so Lightning fetches the batches in the step"
    if trainer.limit_train_batches != 1.0:
        return f"limit_train_batches={trainer.limit_train_batches!r} cuts the epoch at a count the replan changes"
    if not math.isfinite(float(loop.max_batches)):
        return "the training loader has no length"
    return ""


def set_epoch_length(trainer: Any, batches: int) -> None:
    """Tell the fit loop that the running epoch has ``batches`` batches in all (the replanned epoch's count):
    the loop's batch count, its data fetcher's length and end flag, and the validation interval derived from
    them (a fraction of the epoch)."""
    loop = trainer.fit_loop
    loop.max_batches = int(batches)
    fetcher = loop._data_fetcher
    fetcher.length = int(batches)
    fetcher.done = fetcher.fetched >= int(batches)
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        trainer.val_check_batch = max(1, int(int(batches) * interval))


def replan_metrics(wait: float, steps_left_before: int, steps_left_after: int) -> dict[str, float]:
    """What the monitor logs of one mid-epoch replan (under its prefix)."""
    return {
        "replan/window_wait": float(wait),
        "replan/steps_left_before": float(steps_left_before),
        "replan/steps_left_after": float(steps_left_after),
    }


def replan_if_waiting(monitor: Any, trainer: Any, pl_module: Any) -> None:
    """The monitor's replan check, after a gather: where the last window's straggler wait is over
    ``replan_wait`` (rank 0's reading, on every rank), refit, and plan the rest of the epoch with the refit
    model. Logs ``replan/*`` and a ``{"event": "replan", ...}`` line of ``cost_refit.jsonl``.

    Args:
        monitor: the :class:`~lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor` (its trigger, refit,
            rank, files).
        trainer: the Lightning trainer; every rank calls this at the same step.
        pl_module: the LightningModule (for logging).
    """
    trigger: ReplanTrigger = monitor._trigger
    if trigger.steps < trigger.config.replan_window:  # the same count on every rank: no collective yet
        return
    datamodule = getattr(trainer, "datamodule", None)
    left = trainer.num_training_batches - trainer.fit_loop.epoch_loop.batch_progress.current.processed
    wait = trigger.should_replan(int(left) if math.isfinite(left) else 0)
    if monitor._world > 1:  # the decision must be the same on every rank: rank 0's
        wait = trainer.strategy.broadcast(wait, src=0)
    if wait is None:
        return
    why_not = "" if hasattr(datamodule, "replan_rest") else "the data module has no replan_rest"
    why_not = why_not or check_trainer(trainer)
    if why_not:
        trigger.disarm()
        monitor._warn_once("replan", f"LoadBalanceMonitor: mid-epoch replanning is off: {why_not}")
        return
    applied = monitor._refit(trainer, pl_module)
    status = monitor._refitter.history[-1].get("status") if monitor._refitter.history else None
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
    pl_module.log_dict({monitor.prefix + k: v for k, v in metrics.items()}, batch_size=1, sync_dist=True)
    if monitor._rank != 0:
        return
    log.info(
        "[adaptiveload] epoch %d: straggler wait %.2f%% over the last %d steps: the rest of the epoch replanned "
        "with the refit cost model (%d steps left before, %d after)",
        done.epoch,
        100 * wait,
        trigger.config.replan_window,
        done.steps_left_before,
        done.steps_left_after,
    )
    if monitor._outdir is not None and monitor.write_files:
        report.append_json_line(os.path.join(monitor._outdir, "cost_refit.jsonl"), line)

"""Mid-epoch replanning of the closed loop: when to replan (no Lightning).

:class:`ReplanTrigger` keeps the running epoch's per-step balance figures from the monitor's gathers and says
when the straggler wait of the last ``RefitConfig.replan_window`` steps exceeds ``RefitConfig.replan_wait``;
the :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop` then refits the cost model and, where
the refit is applied, has the data module plan the rest of the epoch with it
(:func:`~lightning_adaptiveload.loading.replan.replan_rest`) and tells the fit loop the epoch's new batch count
(:func:`lightning_adaptiveload._lightning_compat.set_epoch_length`). ``docs/closed_loop.md``, "Mid-epoch
replanning".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_adaptiveload.monitor import loop_state
from lightning_adaptiveload.monitor.steps import balance_figures
from lightning_adaptiveload.planning.refit import RefitConfig

__all__ = ["ReplanTrigger", "replan_metrics"]

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

    def load_state_dict(self, state: dict[str, Any], where: str = "the replan state") -> None:
        """Restore :meth:`state_dict`'s output, checked first
        (:func:`~lightning_adaptiveload.monitor.loop_state.check_replan_state`).

        Raises:
            LoopStateError: (a ``ValueError``) a field that breaks its rule, named with ``where``.
        """
        loop_state.check_replan_state(state, where, "replan")
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
        None. Every rank computes it from the same gathered steps; the closed loop still keeps rank 0's answer."""
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


def replan_metrics(wait: float, steps_left_before: int, steps_left_after: int) -> dict[str, float]:
    """What the closed loop logs of one mid-epoch replan (under the monitor's prefix)."""
    return {
        "replan/window_wait": float(wait),
        "replan/steps_left_before": float(steps_left_before),
        "replan/steps_left_after": float(steps_left_after),
    }

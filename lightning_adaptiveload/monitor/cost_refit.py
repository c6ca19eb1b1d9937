"""The closed loop's cost refit: the cost model refitted from the steps the LoadBalanceMonitor gathered.

:class:`CostRefitter` turns the monitor's gathered per-step records (every rank's, the same array on every
rank after the monitor's one collective per flush) into :class:`~lightning_adaptiveload.planning.refit.StepMeasurements`,
refits with :func:`~lightning_adaptiveload.planning.refit.refit_cost_model` (identically on every rank: same
rows, same order, float64), keeps the learned model and its measurements for the checkpoint, and hands the
model to a data module that plans with it (:func:`apply_to_datamodule`, which decides where a refit may be
applied). No Lightning here: the hooks of :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop`
call it (``docs/closed_loop.md``).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lightning_adaptiveload.monitor import loop_state
from lightning_adaptiveload.monitor.steps import FIELD_INDEX, FLAG_COUNTED, FLAG_HOOK, FLAG_PACKED
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import (
    RefitConfig,
    RefitResult,
    StepMeasurements,
    mark_warmup,
    refit_cost_model,
)

__all__ = [
    "CostRefitter",
    "measurements_from_steps",
    "measurements_from_ranks_csv",
    "apply_to_datamodule",
    "withheld_because",
    "refit_metrics",
    "format_refit",
    "describe_dropped",
    "STATE_VERSION",
]

STATE_VERSION = loop_state.COST_REFIT_VERSION


def measurements_from_steps(steps: np.ndarray) -> StepMeasurements:
    """The monitor's gathered block ``(K steps, world, FIELDS)`` as one row per rank and step.

    A row is flagged warm-up when some rank counted FLOPs or compiled before or in it (``FLAG_COUNTED``), and,
    with more than one rank, when its compute time was not timed to the end of its own backward
    (``FLAG_HOOK`` unset: the time then holds the wait for the slowest rank). A bucketed batch without
    ``token_sq_sum`` gets ``B * S^2``.
    """
    steps = np.asarray(steps, dtype=np.float64)
    k, world, _ = steps.shape

    def col(name: str) -> np.ndarray:
        return steps[:, :, FIELD_INDEX[name]].reshape(-1)

    flags = col("flags").astype(np.int64)
    count, seq_len = col("batch_size"), col("seq_len")
    square = col("token_sq_sum")
    packed = (flags & FLAG_PACKED) != 0
    square = np.where(np.isfinite(square), square, np.where(packed, np.nan, count * seq_len * seq_len))
    warm = (flags & FLAG_COUNTED) != 0
    if world > 1:
        warm |= (flags & FLAG_HOOK) == 0
    return StepMeasurements(
        rank=np.tile(np.arange(world, dtype=np.float64), k),
        batch_idx=col("batch_idx"),
        count=count,
        token_sum=col("num_tokens"),
        square_sum=square,
        seq_len=seq_len,
        packed=packed.astype(np.float64),
        seconds=col("compute_time_s"),
        warmup=warm.astype(np.float64),
    )


def measurements_from_ranks_csv(path: str | os.PathLike, warmup_steps_per_class: int = 1) -> StepMeasurements:
    """A run's steps read back from the monitor's ``load_balance_ranks.csv``, for a replay of the refit.

    The CSV has no pack flag: a row whose ``num_tokens`` differs from ``seq_len * batch_size`` is a pack, and
    one without ``token_sq_sum`` (files written before that column) is left out when it is a pack. Rows with
    ``flops_counted`` set are warm-up, and so are the first ``warmup_steps_per_class`` steps of each rank and
    shape class (:func:`~lightning_adaptiveload.planning.refit.mark_warmup`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a column the refit needs is missing (names the file and the columns).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"monitor CSV {path!r}: no such file (LoadBalanceMonitor writes it)")
    need = {"rank", "batch_idx", "batch_size", "num_tokens", "seq_len", "compute_time_s"}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = sorted(need - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(
                f"monitor CSV {path}: missing column(s) {missing}; expected LoadBalanceMonitor's load_balance_ranks.csv"
            )
        rows = list(reader)

    def num(row: Mapping[str, str], key: str) -> float:
        value = row.get(key)
        try:
            return float(value) if value not in (None, "") else math.nan
        except ValueError:
            return math.nan

    cols: dict[str, list[float]] = {
        c: []
        for c in (
            "rank",
            "batch_idx",
            "count",
            "token_sum",
            "square_sum",
            "seq_len",
            "packed",
            "seconds",
            "warmup",
        )
    }
    for row in rows:
        b, s, tokens = num(row, "batch_size"), num(row, "seq_len"), num(row, "num_tokens")
        packed = math.isfinite(tokens) and tokens != b * s
        square = num(row, "token_sq_sum")
        if not math.isfinite(square) and not packed:
            square = b * s * s
        cols["rank"].append(num(row, "rank"))
        cols["batch_idx"].append(num(row, "batch_idx"))
        cols["count"].append(b)
        cols["token_sum"].append(tokens)
        cols["square_sum"].append(square)
        cols["seq_len"].append(s)
        cols["packed"].append(float(packed))
        cols["seconds"].append(num(row, "compute_time_s"))
        cols["warmup"].append(float(row.get("flops_counted") in ("1", "1.0")))
    rows_m, _ = mark_warmup(StepMeasurements(**cols), warmup_steps_per_class)
    return rows_m


def format_refit(result: RefitResult) -> str:
    """A refit as a short table: the terms before and after, and the errors per shape class (percent)."""
    lines = [
        f"cost model refit: {result.status}" + (f" ({result.reason})" if result.reason else ""),
        f"  before: {result.prior.describe()}",
        f"  after:  {result.model.describe()}" + (" (clamped)" if result.clamped else ""),
        f"  steps: {result.points_used} used, {result.points_rejected} outliers, {result.points_warmup} warm-up"
        + (f", {describe_dropped(result)}" if result.points_dropped else "")
        + f"; shape change {result.change:.3g}x",
        f"  {'class':<12}{'steps':>7}{'before mean':>13}{'before max':>12}{'after mean':>12}{'after max':>11}",
    ]
    for cls, err in result.error.items():
        prior = result.prior_error.get(cls, {})
        lines.append(
            f"  {cls:<12}{err['n']:>7}{100 * prior.get('mean', math.nan):>12.2f}%{100 * prior.get('max', math.nan):>11.2f}%"
            f"{100 * err['mean']:>11.2f}%{100 * err['max']:>10.2f}%"
        )
    lines.append("  (before: the starting model after its best common scale, i.e. the error of its shape)")
    return "\n".join(lines)


_DROPPED_WORDS = {
    "nan_time": "compute time nan",
    "inf_time": "compute time infinite",
    "negative_time": "compute time negative",
    "zero_time": "compute time zero",
    "subnormal_time": "compute time subnormal",
    "no_work": "no usable token counts",
    "too_few_to_fit": "too few to fit",
    "fit_failed": "the fit failed",
}


def describe_dropped(result: RefitResult) -> str:
    """``"3 left out (2 compute time subnormal, 1 compute time negative)"``, or ``""`` when none was."""
    if not result.points_dropped:
        return ""
    n = sum(result.points_dropped.values())
    parts = ", ".join(f"{k} {_DROPPED_WORDS.get(r, r)}" for r, k in result.points_dropped.items())
    return f"{n} left out ({parts})"


RESIZE_OPT_IN = "resize_batches"


def withheld_because(result: RefitResult, timing_exact: bool) -> str:
    """Why a refit is not even offered to the data module (``""``: offer it, :func:`apply_to_datamodule`).

    Args:
        result: the refit.
        timing_exact: whether the monitor timed each rank's compute apart from its waits (DDP, FSDP2, one
            process); under FSDP v1 or DeepSpeed ZeRO-3 the times hold the parameter all-gather waits.
    """
    if not timing_exact:
        return "the compute times include waits inside the step (see the warning above): logged only"
    if result.status == "kept":
        return "nothing to apply: " + result.reason
    return ""


def apply_to_datamodule(datamodule: Any, model: CostModel, resize_batches: bool = False) -> str:
    """Give ``model`` to the data module so that its next epoch is planned with it.

    Args:
        datamodule: the trainer's data module (``AdaptiveLoadDataModule`` takes a cost model).
        model: the refit model.
        resize_batches: apply it also where the model sizes the batches (``sizing="dual"``, bucketed schedules).

    Returns:
        ``""`` when applied, else why not (no data module that takes a cost model, a numeric ``max_compute``
        in the old model's unit, batch sizes the model would change without ``resize_batches``, or a data
        module that refused the model, e.g. a cost that is not positive at one of its lengths: it keeps its
        own model then).
    """
    setter = getattr(datamodule, "set_cost_model", None)
    if setter is None:
        return (
            f"the data module ({type(datamodule).__name__}) has no set_cost_model: the refit is logged only"
        )
    batcher = getattr(datamodule, "batcher", None)
    if batcher is not None and not getattr(batcher, "cap_follows_cost_model", True):
        return (
            f"max_compute={batcher.max_compute!r} is a number in the starting cost model's unit; a refit model "
            "would change its meaning, so it is logged only. Use max_compute='auto' to plan with the refit model"
        )
    sizes = batcher is not None and getattr(batcher, "sizing", None) == "dual"
    if sizes and not resize_batches and getattr(datamodule, "schedule", None) != "packed":
        return (
            'with sizing="dual" the cost model sizes the batches, and a refit would change the long samples\' '
            f"batch sizes between epochs; it is logged only (ClosedLoop(refit={{'{RESIZE_OPT_IN}': True}}) "
            "applies it)"
        )
    try:
        setter(model)
    except ValueError as err:  # the data module refuses a model it cannot plan with, and keeps its own
        return f"the data module refused it: {err}"
    return ""


def refit_metrics(result: RefitResult) -> dict[str, float]:
    """What the closed loop logs of one refit (under the monitor's prefix): the new terms, the error on the window's kept
    steps (mean and worst, relative), the prior's error after its best scale, the rows used, and whether
    the change was clamped."""
    quadratic = result.model.kind == "quadratic"
    return {
        "refit/c0": result.model.c0,
        "refit/alpha": result.model.alpha if quadratic else math.nan,
        "refit/beta": result.model.beta if quadratic else math.nan,
        "refit/mean_rel_error": result.error.get("all", {}).get("mean", math.nan),
        "refit/max_rel_error": result.error.get("all", {}).get("max", math.nan),
        "refit/prior_mean_rel_error": result.prior_error.get("all", {}).get("mean", math.nan),
        "refit/points": float(result.points_used),
        "refit/clamped": float(result.clamped),
    }


class CostRefitter:
    """Measurements of the current window, the refits so far and the learned model (no Lightning).

    Args:
        config: the refit settings.

    Attributes:
        model: the learned model (None before the first refit or restore).
        applied: whether ``model`` was handed to the data module (a restored model is handed over only then).
        history: every refit's :meth:`RefitResult.to_dict`, with the ``epoch`` and ``step`` it ran at.
    """

    def __init__(self, config: RefitConfig) -> None:
        self.config = config
        self.model: CostModel | None = None
        self.applied = False
        self.history: list[dict[str, Any]] = []
        self._window: list[StepMeasurements] = []
        self._seen: dict[tuple[int, str], int] = {}
        self._last = StepMeasurements.empty()

    @property
    def window_rows(self) -> int:
        """Rows (rank-steps) gathered since the last refit."""
        return sum(len(w) for w in self._window)

    def add_steps(self, steps: np.ndarray) -> None:
        """Add the monitor's gathered block ``(K, world, FIELDS)``; the first steps of each shape are warm-up."""
        rows, self._seen = mark_warmup(
            measurements_from_steps(steps), self.config.warmup_steps_per_class, self._seen
        )
        self._window.append(rows)

    def refit(
        self,
        prior: CostModel,
        epoch: int,
        step: int,
        agree: Callable[[RefitResult], RefitResult] | None = None,
    ) -> RefitResult:
        """Refit on the window's rows, starting from ``prior``; the window then starts empty.

        ``agree``: given this rank's result, returns the one every rank keeps (the closed loop passes a broadcast
        of rank 0's). Every rank fits the same rows in the same order, but an SVD, ``exp``/``log`` and least
        squares may round differently on another CPU or BLAS build, and the plans of the next epoch must
        agree bit for bit across ranks.
        """
        window = StepMeasurements.concat(self._window)
        self._window = []
        try:
            result = refit_cost_model(prior, window, self.config)
        except Exception as err:  # noqa: BLE001 - the refit never stops training: the prior is kept, and said why
            result = RefitResult(
                prior,
                prior,
                "kept",
                f"the refit failed ({type(err).__name__}: {err}): the prior model is kept",
                False,
                1.0,
                0,
                0,
                0,
                points_dropped={"fit_failed": len(window)},
            )
        if agree is not None:
            result = agree(result)
        self.model = result.model
        keep = self.config.max_saved_steps
        self._last = window.take(np.arange(max(0, len(window) - keep), len(window)))
        self.history.append({"epoch": int(epoch), "step": int(step), **result.to_dict()})
        return result

    def settle(self, result: RefitResult, why_not: str) -> None:
        """Record whether the last refit was handed to the data module (``why_not == ""``) or why not."""
        if result.status != "kept":  # a kept prior is what the data module plans with already
            self.applied = why_not == ""
        self.history[-1]["applied"] = why_not == ""
        self.history[-1]["not_applied_because"] = why_not

    def state_dict(self) -> dict[str, Any]:
        """The learned model, the measurements of its last refit, the window gathered since (so that a run
        resumed mid-epoch refits from the same rows; its last ``max_saved_steps`` rows) and the refit history
        (plain values, for any checkpoint loader)."""
        window = StepMeasurements.concat(self._window)
        keep = self.config.max_saved_steps
        return {
            "version": STATE_VERSION,
            "model": None if self.model is None else self.model.to_dict(),
            "applied": self.applied,
            "measurements": self._last.to_dict(),
            "window": window.take(np.arange(max(0, len(window) - keep), len(window))).to_dict(),
            "seen": [[r, c, n] for (r, c), n in sorted(self._seen.items())],
            "history": list(self.history),
        }

    def load_state_dict(self, state: Mapping[str, Any], where: str = "the cost refit state") -> None:
        """Restore :meth:`state_dict`'s output, every field checked first
        (:func:`~lightning_adaptiveload.monitor.loop_state.check_cost_refit_state`); nothing changes when a
        check fails.

        Args:
            state: the state.
            where: where it came from (a checkpoint key), for the messages.

        Raises:
            LoopStateError: (a ``ValueError``) a state of another version, without one of its keys, or with a
                field that breaks its rule: names ``where``, the field and the rule.
        """
        model = loop_state.check_cost_refit_state(state, where, "cost_refit")
        last = StepMeasurements.from_dict(state["measurements"])
        window = [StepMeasurements.from_dict(state["window"])] if "window" in state else []
        self.model = model
        self.applied = bool(state["applied"])
        self._last = last
        self._seen = {(int(r), str(c)): int(n) for r, c, n in state.get("seen", [])}
        self.history = list(state.get("history", []))
        self._window = window

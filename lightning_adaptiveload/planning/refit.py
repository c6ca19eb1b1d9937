"""Refit the cost model from a run's own step times: the plan learns what a sample really costs.

The fitted form is the pack model of :meth:`CostModel.fit_pack_sums`: one step (a bucketed batch of B samples
of S tokens, or a pack of samples of token counts S_i) costs ``c0 + sum_i (alpha * S_i + beta * S_i^2)``
seconds. Its inputs per step are three sums (``N``, ``sum S_i``, ``sum S_i^2``) and the measured compute
time, gathered from every rank (:class:`StepMeasurements`).

:func:`refit_cost_model` is robust and deterministic, so that every rank that calls it with the same gathered
rows gets the same model bit for bit:

- **warm-up**: rows flagged as warm-up are left out (:func:`mark_warmup` flags the first K steps of each shape
  class on each rank, and the caller's own flags: ``torch.compile`` compiling, FLOPs counted);
- **outliers**: the residuals relative to the measured time are compared with their median; a row further away
  than ``outlier_threshold`` robust standard deviations (``1.4826 * MAD``, and never closer than
  ``outlier_floor``) is rejected, and the fit repeated until the kept set stops changing;
- **enough points**: the three terms are fitted only when there are ``min_points_per_term`` kept rows per term
  and the rows tell the terms apart (the design matrix is well conditioned); otherwise only a common scale of
  the prior model is fitted (its shape kept), and with fewer rows still the prior is kept; ``reason`` says why;
- **bounded**: planning depends on the ratios between costs, not their unit, so the change is measured on the
  shape: the new model's costs of the window's steps divided by the prior's, over their geometric mean. A
  ratio beyond ``max_change`` (or below its inverse) is clamped by moving the terms only part of the way from
  the rescaled prior to the fit, and reported (``clamped``).

Rows are sorted before fitting and all arithmetic is float64. Plain NumPy: no Lightning, no torch. The
Lightning shell is :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop` (its ``refit`` setting,
``docs/closed_loop.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.cost_model import CostModel

__all__ = [
    "RefitConfig",
    "StepMeasurements",
    "RefitResult",
    "mark_warmup",
    "refit_cost_model",
    "shape_classes",
    "DROP_REASONS",
]

_TERMS = ("c0", "alpha", "beta")
_MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation
_MAX_CONDITION = 1e7  # a column-normalised design matrix worse than this cannot tell the three terms apart


@dataclass(frozen=True, kw_only=True)
class RefitConfig:
    """How the cost model is refitted from the run's steps.

    Args:
        every_n_steps: also refit every this many optimizer steps (the model then plans the next epoch; the
            running epoch keeps its plan). None: at the end of every training epoch only.
        warmup_steps_per_class: the first this many steps of each shape class on each rank are left out
            (the first run of a shape allocates, autotunes or compiles).
        outlier_threshold: a row whose relative residual lies more than this many robust standard deviations
            from the median residual is rejected.
        outlier_floor: a relative residual within this distance of the median is never rejected (a fit that
            is nearly exact has a MAD near zero).
        max_outlier_rounds: fit-and-reject rounds at most.
        min_points_per_term: kept rows needed per fitted term (3 terms: c0, alpha, beta).
        max_change: the largest factor by which one refit may change the cost of a step relative to the
            others (the shape of the model; its unit may change freely). Beyond it the change is clamped.
        max_saved_steps: the most rows (rank-steps) of measurements kept in a checkpoint, for the last refit's
            and for the window since (the last ones of each).
        resize_batches: also apply the refit where the cost model sizes the batches (``sizing="dual"`` with
            ``max_compute="auto"``): the batch sizes of the long samples then change between epochs, which
            changes what the optimizer sees. False (default): there the refit is logged only; where the model
            only balances (``equal_tokens`` batches, the packed schedule's packs) it is applied.
        replan_wait: mid-epoch replanning (off: None). When the straggler wait of the last ``replan_window``
            steps of an epoch (the share of their time the ranks waited for the slowest, from the measured
            compute times) exceeds this fraction (e.g. ``0.05``), the cost model is refitted and the rest of
            the epoch replanned with it (``AdaptiveLoadDataModule.replan_rest``; exact: every sample once,
            equal steps). Only where the refit is applied (see ``resize_batches``).
        replan_window: steps per window of the replan check; the check runs at the monitor's gathers (every
            ``log_every_n_steps``) once a window of steps has run since the epoch's start or the last replan,
            and only while at least one window of steps is left in the epoch.
        max_replans_per_epoch: mid-epoch replans at most per epoch.
    """

    every_n_steps: int | None = None
    warmup_steps_per_class: int = 1
    outlier_threshold: float = 5.0
    outlier_floor: float = 0.05
    max_outlier_rounds: int = 5
    min_points_per_term: int = 4
    max_change: float = 10.0
    max_saved_steps: int = 100_000
    resize_batches: bool = False
    replan_wait: float | None = None
    replan_window: int = 50
    max_replans_per_epoch: int = 1

    def __post_init__(self) -> None:
        if self.replan_wait is not None and not 0 < self.replan_wait < 1:
            raise ValueError(
                f"RefitConfig.replan_wait must be a fraction of the step time in (0, 1) (e.g. 0.05) or None (off), "
                f"got {self.replan_wait!r}"
            )
        for name in ("replan_window", "max_replans_per_epoch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"RefitConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.every_n_steps is not None and int(self.every_n_steps) < 1:
            raise ValueError(f"RefitConfig.every_n_steps must be >= 1 or None, got {self.every_n_steps!r}")
        for name in ("warmup_steps_per_class", "max_saved_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"RefitConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_outlier_rounds", "min_points_per_term"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"RefitConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not (self.outlier_threshold > 0 and self.outlier_floor >= 0):
            raise ValueError(
                f"RefitConfig: outlier_threshold must be > 0 and outlier_floor >= 0, got "
                f"{self.outlier_threshold!r} and {self.outlier_floor!r}"
            )
        if not self.max_change > 1:
            raise ValueError(f"RefitConfig.max_change must be a factor > 1, got {self.max_change!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RefitConfig:
        """Build from a mapping of the fields; an unknown key is an error that lists the accepted ones."""
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"refit settings have unknown keys {unknown}; accepted keys: {sorted(allowed)}")
        return cls(**dict(data))


_COLUMNS = ("rank", "batch_idx", "count", "token_sum", "square_sum", "seq_len", "packed", "seconds", "warmup")


@dataclass(frozen=True)
class StepMeasurements:
    """Measured steps, one row per rank and step; every field a 1-d float64 array of equal length.

    Args:
        rank: the rank that ran the step.
        batch_idx: the step's batch index (the same on every rank).
        count: samples in the step ``N`` (B of a bucketed batch).
        token_sum: ``sum S_i`` over the step's samples.
        square_sum: ``sum S_i^2`` over the step's samples.
        seq_len: the bucketed batch's S (a pack's longest S_i).
        packed: 1.0 for a pack of mixed shapes, 0.0 for a bucketed batch.
        seconds: the rank's measured compute time of the step.
        warmup: 1.0 for a row left out of the fit (compiling, FLOPs counted, the first of its shape).
    """

    rank: np.ndarray
    batch_idx: np.ndarray
    count: np.ndarray
    token_sum: np.ndarray
    square_sum: np.ndarray
    seq_len: np.ndarray
    packed: np.ndarray
    seconds: np.ndarray
    warmup: np.ndarray

    def __post_init__(self) -> None:
        n = None
        for name in _COLUMNS:
            value = np.asarray(getattr(self, name), dtype=np.float64).reshape(-1)
            object.__setattr__(self, name, value)
            if n is not None and value.shape[0] != n:
                raise ValueError(
                    f"StepMeasurements: column {name!r} has {value.shape[0]} rows, the others {n}"
                )
            n = value.shape[0]

    def __len__(self) -> int:
        return int(self.seconds.shape[0])

    @classmethod
    def empty(cls) -> StepMeasurements:
        return cls(*(np.zeros(0) for _ in _COLUMNS))

    @classmethod
    def concat(cls, parts: list[StepMeasurements]) -> StepMeasurements:
        """The rows of ``parts`` one after the other."""
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, c) for p in parts]) for c in _COLUMNS))

    def take(self, index: np.ndarray) -> StepMeasurements:
        """The rows at ``index`` (an integer or boolean array)."""
        return StepMeasurements(*(getattr(self, c)[index] for c in _COLUMNS))

    def sorted(self) -> StepMeasurements:
        """Rows ordered by (batch_idx, rank, then every other column): the same order whoever gathered them."""
        keys = tuple(getattr(self, c) for c in reversed(_COLUMNS[2:])) + (self.rank, self.batch_idx)
        return self.take(np.lexsort(keys))

    def to_dict(self) -> dict[str, list[float]]:
        """Plain lists per column (for a checkpoint); :meth:`from_dict` inverts it."""
        return {c: getattr(self, c).tolist() for c in _COLUMNS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepMeasurements:
        missing = [c for c in _COLUMNS if c not in data]
        if missing:
            raise ValueError(
                f"StepMeasurements.from_dict: missing columns {missing} (expected {list(_COLUMNS)})"
            )
        return cls(*(data[c] for c in _COLUMNS))


_PACK, _UNKNOWN = -1.0, -2.0  # class codes besides a bucketed batch's token count


def _class_codes(m: StepMeasurements) -> np.ndarray:
    """Per row: S of a bucketed batch, -1 for a pack, -2 for a batch without a length (float64)."""
    finite = np.isfinite(m.seq_len)
    length = np.floor(np.where(finite, m.seq_len, 0.0))
    return np.where(m.packed != 0, _PACK, np.where(finite, length, _UNKNOWN))


def _class_name(code: float) -> str:
    return "pack" if code == _PACK else ("unknown" if code == _UNKNOWN else f"S={int(code)}")


def _class_order(code: float) -> tuple[int, float]:
    """Bucketed classes by token count, then packs, then batches without a length."""
    return (0, code) if code >= 0 else ((1, 0.0) if code == _PACK else (2, 0.0))


def shape_classes(m: StepMeasurements) -> list[str]:
    """The shape class of every row: ``"pack"`` for a pack, ``"S=<tokens>"`` for a bucketed batch
    (``"unknown"`` for a batch that did not say its length)."""
    return [_class_name(c) for c in _class_codes(m)]


def mark_warmup(
    m: StepMeasurements, steps_per_class: int, seen: Mapping[tuple[int, str], int] | None = None
) -> tuple[StepMeasurements, dict[tuple[int, str], int]]:
    """Flag the first ``steps_per_class`` rows of each (rank, shape class) as warm-up, in batch order.

    Args:
        m: the rows (any order).
        steps_per_class: rows flagged per rank and class.
        seen: rows of each (rank, class) in earlier windows of the same run (they count toward the first ones).

    Returns:
        The rows (sorted as :meth:`StepMeasurements.sorted`) with ``warmup`` set, and the updated ``seen``.
    """
    m = m.sorted()
    counts = dict(seen or {})
    if len(m) == 0:
        return m, counts
    # Vectorised over rows (a window holds ranks x steps of them); Python loops over the (rank, class) keys.
    keys, inverse, per_key = np.unique(
        np.stack([m.rank, _class_codes(m)], axis=1), axis=0, return_inverse=True, return_counts=True
    )
    inverse = inverse.reshape(-1)
    names = [(int(r), _class_name(c)) for r, c in keys]
    before = np.array([counts.get(k, 0) for k in names], dtype=np.int64)
    grouped = np.argsort(inverse, kind="stable")  # rows of each key together, in batch order
    starts = np.cumsum(per_key) - per_key
    occurrence = np.empty(len(m), dtype=np.int64)
    occurrence[grouped] = np.arange(len(m)) - np.repeat(starts, per_key)
    warm = np.where(occurrence + before[inverse] < steps_per_class, 1.0, m.warmup)
    for k, n_before, n in zip(names, before, per_key):
        counts[k] = int(n_before + n)
    return StepMeasurements(*(warm if c == "warmup" else getattr(m, c) for c in _COLUMNS)), counts


@dataclass(frozen=True)
class RefitResult:
    """What one refit did.

    Attributes:
        model: the model to plan with now (the prior itself when ``status == "kept"``).
        prior: the model before the refit.
        status: ``"fitted"`` (c0, alpha, beta fitted), ``"scaled"`` (only a common scale of the prior fitted)
            or ``"kept"`` (the prior unchanged).
        reason: why the status is not ``"fitted"`` ("" when it is).
        clamped: whether the change was clamped to ``max_change``.
        change: the largest factor by which the unclamped fit changed a step's cost relative to the others.
        points_used: rows fitted.
        points_warmup: rows left out as warm-up.
        points_rejected: rows rejected as outliers.
        points_dropped: rows that are no measurement, left out before the fit, by reason
            (:data:`DROP_REASONS`: a compute time that is nan, infinite, negative, zero or subnormal, or a step
            without usable token counts), and ``too_few_to_fit``: usable rows not fitted because there were
            fewer than ``min_points_per_term``. ``points_used + points_rejected + points_warmup +
            sum(points_dropped.values())`` is the number of rows given.
        error: per shape class and ``"all"``: ``{"n", "mean", "max"}``, the relative error of ``model`` on the
            kept rows (fractions).
        prior_error: the same for the prior, after the best common scale (its shape error).
    """

    model: CostModel
    prior: CostModel
    status: str
    reason: str
    clamped: bool
    change: float
    points_used: int
    points_warmup: int
    points_rejected: int
    error: dict[str, dict[str, float]] = field(default_factory=dict)
    prior_error: dict[str, dict[str, float]] = field(default_factory=dict)
    points_dropped: dict[str, int] = field(default_factory=dict)

    def terms(self) -> dict[str, dict[str, float]]:
        """``{"before": {...}, "after": {...}}``: the models' c0, alpha, beta (gamma, p, scale when set)."""
        return {"before": _terms(self.prior), "after": _terms(self.model)}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"], out["prior"] = self.model.to_dict(), self.prior.to_dict()
        out["terms"] = self.terms()
        return out


def _terms(model: CostModel) -> dict[str, float]:
    d = {k: v for k, v in model.to_dict().items() if k not in ("kind", "fit_info")}
    d.setdefault("c0", 0.0)
    return {k: float(v) for k, v in d.items()}


def refit_cost_model(prior: CostModel, measurements: StepMeasurements, config: RefitConfig) -> RefitResult:
    """Fit ``c0 + sum(alpha*S + beta*S^2)`` to measured steps, robustly and within ``max_change`` of ``prior``.

    Args:
        prior: the model the steps were planned with (kept, or its shape kept, when the rows do not suffice).
        measurements: the window's rows from every rank (any order; warm-up rows flagged).
        config: the robustness settings.

    Returns:
        A :class:`RefitResult`; never raises for too few or unusable rows, nor for numerical trouble (an SVD
        that does not converge, an overflow): ``status`` is then ``"kept"`` and ``reason`` says why. Rows that
        are no measurement (:data:`DROP_REASONS`) are left out and counted in ``points_dropped``.
    """
    m = measurements.sorted()
    warm = m.warmup != 0
    dropped, usable = _dropped_rows(m, warm)
    n_warm = int(np.sum(warm))
    rows = m.take(usable)
    if len(rows) < config.min_points_per_term:
        reason = (
            f"{len(rows)} usable steps, fewer than min_points_per_term={config.min_points_per_term}: "
            "the prior model is kept"
        )
        if len(rows):
            dropped["too_few_to_fit"] = len(rows)
        return RefitResult(prior, prior, "kept", reason, False, 1.0, 0, n_warm, 0, points_dropped=dropped)
    try:
        with np.errstate(all="ignore"):  # trouble shows as a non-finite result, handled below
            return _refit_rows(prior, rows, config, n_warm, dropped)
    except (np.linalg.LinAlgError, ValueError, FloatingPointError, OverflowError, ZeroDivisionError) as err:
        reason = (
            f"the fit failed numerically on {len(rows)} usable steps ({type(err).__name__}: {err}): the prior "
            "model is kept"
        )
        dropped["fit_failed"] = len(rows)
        return RefitResult(prior, prior, "kept", reason, False, 1.0, 0, n_warm, 0, points_dropped=dropped)


#: Why a row is left out before the fit, in the order it is counted under (one reason a row).
DROP_REASONS = ("nan_time", "inf_time", "negative_time", "zero_time", "subnormal_time", "no_work")
# A nonzero time or count below the smallest normal float is no reading.
_TINY = float(np.finfo(np.float64).tiny)


def _dropped_rows(m: StepMeasurements, warm: np.ndarray) -> tuple[dict[str, int], np.ndarray]:
    """The non-warm-up rows that are no measurement, counted by reason, and the usable rows (bool)."""
    s = m.seconds
    work_ok = np.ones(len(m), dtype=bool)
    for x in (m.token_sum, m.square_sum, m.count):
        work_ok &= np.isfinite(x) & (x >= _TINY)  # positive and normal
    tests = {
        "nan_time": np.isnan(s),
        "inf_time": np.isinf(s),
        "negative_time": s < 0,
        "zero_time": s == 0,
        "subnormal_time": (s > 0) & (s < _TINY),
        "no_work": ~work_ok,
    }
    bad = warm.copy()
    dropped: dict[str, int] = {}
    for reason in DROP_REASONS:
        rows = tests[reason] & ~bad
        if rows.any():
            dropped[reason] = int(rows.sum())
        bad |= rows
    return dropped, ~bad


def _refit_rows(
    prior: CostModel, rows: StepMeasurements, config: RefitConfig, n_warm: int, dropped: dict[str, int]
) -> RefitResult:
    """:func:`refit_cost_model` on its usable rows (at least ``min_points_per_term`` of them)."""
    y = rows.seconds
    prior_pred = _predict(prior, rows)
    need_full = 3 * config.min_points_per_term
    kept = np.ones(len(rows), dtype=bool)
    status, reason, model = "fitted", "", prior
    for _ in range(config.max_outlier_rounds):
        status, reason, model = _fit(prior, rows, kept, need_full, config.min_points_per_term)
        rel = (_predict(model, rows) - y) / y
        centre = float(np.median(rel[kept]))
        spread = _MAD_TO_SIGMA * float(np.median(np.abs(rel[kept] - centre)))
        new_kept = np.abs(rel - centre) <= max(config.outlier_threshold * spread, config.outlier_floor)
        if new_kept.sum() < config.min_points_per_term or np.array_equal(new_kept, kept):
            break
        kept = new_kept
    if status != "kept":
        status, reason, model = _fit(prior, rows, kept, need_full, config.min_points_per_term)
    model, clamped, change = _clamp(prior, model, rows.take(kept), config.max_change)
    if status == "kept":
        model = prior
    elif not bool(np.all(_predict(model, rows.take(kept)) > 0)):
        reason = "the fitted model's cost of a kept step is not positive: the prior model is kept"
        status, model = "kept", prior
    classes = _class_codes(rows)
    pred = _predict(model, rows)
    scale = _best_scale(prior_pred[kept], y[kept])
    return RefitResult(
        model=model,
        prior=prior,
        status=status,
        reason=reason,
        clamped=clamped,
        change=change,
        points_used=int(kept.sum()),
        points_warmup=n_warm,
        points_rejected=int((~kept).sum()),
        error=_errors(pred[kept], y[kept], classes[kept]),
        prior_error=_errors(scale * prior_pred[kept], y[kept], classes[kept]),
        points_dropped=dropped,
    )


def _predict(model: CostModel, m: StepMeasurements) -> np.ndarray:
    """The model's cost of each row's step (float64): exact for bucketed batches and for packs of the
    quadratic form; a power model's pack is taken as ``N`` samples of the pack's mean length."""
    if model.kind == "quadratic":
        return model.c0 + model.alpha * m.token_sum + model.beta * m.square_sum + model.gamma * m.count
    return model.c0 + m.count * model.costs(m.token_sum / m.count)


def _fit(
    prior: CostModel, rows: StepMeasurements, kept: np.ndarray, need_full: int, min_points: int
) -> tuple[str, str, CostModel]:
    """The three-term fit of the kept rows, or the prior's best scale when they cannot carry it."""
    sub = rows.take(kept)
    design = np.stack([np.ones(len(sub)), sub.token_sum, sub.square_sum], axis=1)
    if len(sub) >= need_full:
        cond = _condition(design / sub.seconds[:, None])
        if cond <= _MAX_CONDITION:
            try:
                model = CostModel.fit_pack_sums(sub.count, sub.token_sum, sub.square_sum, sub.seconds)
                return "fitted", "", model
            except ValueError as err:  # e.g. times that do not grow with the tokens
                reason = f"the three-term fit failed ({err}); only the prior's scale is fitted"
        else:
            reason = (
                f"the steps do not tell c0, alpha and beta apart (condition number {cond:.3g} of the design "
                f"matrix, over {_MAX_CONDITION:.0e}: too few distinct step shapes); only the prior's scale is fitted"
            )
    else:
        reason = (
            f"{len(sub)} kept steps, fewer than {need_full} (3 terms x min_points_per_term): only the prior's "
            "scale is fitted"
        )
    if len(sub) < min_points:
        return "kept", f"{len(sub)} kept steps, fewer than min_points_per_term={min_points}", prior
    k = _best_scale(_predict(prior, sub), sub.seconds)
    if not (math.isfinite(k) and k > 0):
        return "kept", "the prior's best scale is not positive: the prior is kept", prior
    return "scaled", reason, _scaled(prior, k)


def _condition(a: np.ndarray) -> float:
    norms = np.linalg.norm(a, axis=0)
    if np.any(norms == 0):
        return math.inf
    s = np.linalg.svd(a / norms, compute_uv=False)
    return float(s[0] / s[-1]) if s[-1] > 0 else math.inf


def _best_scale(pred: np.ndarray, y: np.ndarray) -> float:
    """The factor k minimising the squared relative error of ``k * pred`` against ``y``."""
    r = pred / y
    denom = float(np.sum(r * r))
    return float(np.sum(r) / denom) if denom > 0 else math.nan


def _scaled(model: CostModel, k: float) -> CostModel:
    if model.kind == "power":
        return CostModel(kind="power", p=model.p, scale=model.scale * k, c0=model.c0 * k)
    return CostModel(
        kind="quadratic",
        alpha=model.alpha * k,
        beta=model.beta * k,
        gamma=model.gamma * k,
        c0=model.c0 * k,
    )


def _clamp(
    prior: CostModel, new: CostModel, rows: StepMeasurements, max_change: float
) -> tuple[CostModel, bool, float]:
    """Limit how far ``new`` moves the relative costs of ``rows`` from ``prior``'s (see the module docstring)."""
    if len(rows) == 0:
        return new, False, 1.0
    old_pred, new_pred = _predict(prior, rows), _predict(new, rows)
    ratio = new_pred / old_pred
    if not np.all(np.isfinite(ratio)) or np.any(ratio <= 0):
        return new, False, 1.0
    g = float(np.exp(np.mean(np.log(ratio))))
    q = ratio / g
    change = float(max(np.max(q), 1.0 / np.min(q)))
    if change <= max_change * (1 + 1e-12):
        return new, False, change
    base = _scaled(prior, g)
    if base.kind != "quadratic" or new.kind != "quadratic":
        return base, True, change  # a power prior cannot be blended term by term: keep its shape, rescaled
    lam = 1.0
    for qi in q:
        if qi > max_change:
            lam = min(lam, (max_change - 1.0) / (qi - 1.0))
        elif qi < 1.0 / max_change:
            lam = min(lam, (1.0 - 1.0 / max_change) / (1.0 - qi))
    blend = {
        t: (1.0 - lam) * getattr(base, t) + lam * getattr(new, t) for t in ("alpha", "beta", "gamma", "c0")
    }
    return CostModel(kind="quadratic", **blend), True, change


def _errors(pred: np.ndarray, y: np.ndarray, classes: np.ndarray) -> dict[str, dict[str, float]]:
    """Per shape class and overall (``"all"``): rows, mean and worst relative error |pred - y| / y."""
    out: dict[str, dict[str, float]] = {}
    if len(y) == 0:
        return out
    rel = np.abs(pred - y) / y
    for code in sorted(np.unique(classes).tolist(), key=_class_order):
        sel = classes == code
        out[_class_name(code)] = {
            "n": int(sel.sum()),
            "mean": float(rel[sel].mean()),
            "max": float(rel[sel].max()),
        }
    out["all"] = {"n": int(len(y)), "mean": float(rel.mean()), "max": float(rel.max())}
    return out

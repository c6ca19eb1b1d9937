"""Balance statistics across data-parallel ranks: CV, imbalance, straggler wait, VRAM efficiency, MFU.

Plain Python and numpy (no torch, no Lightning): every function takes plain sequences of numbers, one value
per rank (or per rank and step), so the planner, the simulator and the :class:`~lightning_adaptiveload.
monitor.LoadBalanceMonitor` callback share one definition of each statistic, and a plain-PyTorch user can
call them too. :func:`balance_rows` computes the three balance statistics for many steps at once (the
monitor's path); it is tested against the scalar functions. A bad reading there (a negative, NaN, infinite
or subnormal value) never raises: its row is flagged, counted by reason and left out (its statistics are
``nan``, which :func:`summarize_steps` skips); observability never stops training.

Definitions (``x`` holds one non-negative value per rank, for example the compute time of one step):

- coefficient of variation ``cv(x) = std(x) / mean(x)`` with the *population* standard deviation
  (``ddof = 0``): the ranks of a step are the whole population, not a sample of one;
- ``imbalance(x) = max(x) / mean(x) - 1``: how much longer the slowest rank works than the average one;
- ``straggler_wait(x) = 1 - mean(x) / max(x)``: the share of the ranks' time spent waiting for the slowest
  at the gradient all-reduce, when ``x`` is the ranks' compute time (everyone finishes at ``max(x)``);
  over many steps, ``sum(max - mean) / sum(max)`` (each step weighs by its duration: the share of the
  job's time lost to waiting);
- ``step_wait_mean(x)``: the unweighted mean over steps of the per-step ``1 - mean / max`` (another
  number: short steps weigh as much as long ones);
- ``vram_efficiency(peak, total) = peak / total``: the share of a device's memory a step's peak used;
- ``peak_vram_utilisation_efficiency(peaks) = mean(peaks) / max(peaks)`` over ranks and steps: the share of
  the memory the job must provision (its high-water mark) that a rank actually uses at its peak, on average;
  ``1.0`` when every rank peaks equally at every step (see ``docs/monitor.md``);
- ``mfu(flops, seconds, peak) = flops / seconds / peak``: model FLOPs utilisation (PaLM, arXiv 2204.02311).

All of them are exactly ``0.0`` for a set of equal values, including all zeros (no work is perfectly
balanced), and never leave their range through rounding. :func:`balance_summary` gives the figures both
the simulator and the monitor report (:data:`BALANCE_FIGURES`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "PEAK_FLOPS",
    "TRAINING_FLOPS_PER_FORWARD",
    "cv",
    "imbalance",
    "straggler_wait",
    "step_wait_mean",
    "balance_rows",
    "BalanceRows",
    "BAD_READINGS",
    "measured_wait_rows",
    "BALANCE_FIGURES",
    "summarize_steps",
    "balance_summary",
    "vram_efficiency",
    "peak_vram_utilisation_efficiency",
    "achieved_flops_per_s",
    "mfu",
    "normalize_dtype",
    "resolve_device",
    "peak_flops",
    "percentile",
    "describe",
]

# Training FLOPs per forward FLOP: forward + backward (the backward costs two forwards: gradients of the
# inputs and of the weights); activation recomputation is not counted (model FLOPs, as :func:`mfu` takes).
TRAINING_FLOPS_PER_FORWARD = 3.0


def _values(values: Iterable[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: got no values; pass at least one value (one per rank)")
    for v in out:
        if v < 0:
            raise ValueError(
                f"{what}: got a negative value {v!r} in {out!r}; work, time and memory are non-negative"
            )
    return out


def _ranks(values: Iterable[float], what: str) -> np.ndarray | None:
    """One step's values as float64 (ranks,), or None when a value is nan (the statistic is then nan)."""
    a = np.asarray(_values(values, what), dtype=np.float64)
    return None if np.isnan(a).any() else a


# Rounding can put a mean a few ulps above the maximum of equal values (0.1 three times: the mean is
# 0.10000000000000002), which would make a statistic of perfectly balanced work -2e-16. Every statistic is
# therefore exactly 0.0 when all values are equal and is clamped to its mathematical range otherwise:
# cv in [0, sqrt(n - 1)], imbalance in [0, n - 1], straggler wait in [0, 1 - 1 / n] for n ranks.


def cv(values: Iterable[float]) -> float:
    """Coefficient of variation ``std / mean`` with the population standard deviation.

    Args:
        values: one non-negative number per rank (any unit; the CV has none).

    Returns:
        The CV as a fraction (``0.12`` is 12%), in ``[0, sqrt(n - 1)]``; exactly ``0.0`` when all values are
        equal (all zeros included); ``nan`` if any value is ``nan``.

    Raises:
        ValueError: if ``values`` is empty or holds a negative number.
    """
    return _one_step(values, "cv", 0)


def imbalance(values: Iterable[float]) -> float:
    """Imbalance ``max / mean - 1`` (the paper's "compute imbalance rate").

    Args:
        values: one non-negative number per rank.

    Returns:
        A fraction in ``[0, n - 1]``; exactly ``0.0`` when all values are equal; ``nan`` if any value is
        ``nan``.

    Raises:
        ValueError: if ``values`` is empty or holds a negative number.
    """
    return _one_step(values, "imbalance", 1)


def _one_step(values: Iterable[float], name: str, column: int) -> float:
    """Statistic ``column`` of :func:`balance_rows` for one step's per-rank values (``nan`` if one is)."""
    a = _ranks(values, name)
    if a is None:
        return math.nan
    return float(balance_rows(a[None, :])[column][0])


def straggler_wait(values: Iterable[float] | np.ndarray) -> float:
    """Share of the ranks' time spent waiting for the slowest rank.

    With synchronous data parallelism every rank leaves the gradient all-reduce when the slowest arrives, so
    at a step rank ``r`` waits ``max - x[r]``; summed over ranks and divided by ``world * max`` this is
    ``1 - mean / max`` for one step. Over many steps it is the summed waiting over the summed time,
    ``sum(max - mean) / sum(max)``: each step weighs by its duration, so this is the share of the job's
    time lost to waiting (the figure of the simulator, the monitor's summary and the README). The
    *unweighted* mean over steps of the per-step value is another number: :func:`step_wait_mean`.

    Args:
        values: one step: each rank's own compute time (seconds, or any unit), waiting excluded, shape
            (ranks,); or many steps, a float array of shape (steps, ranks).

    Returns:
        A fraction in ``[0, 1 - 1 / ranks]``; exactly ``0.0`` when all values of every step are equal;
        ``nan`` if any value is ``nan``.

    Raises:
        ValueError: if ``values`` is empty or holds a negative number.
    """
    a = np.asarray(values, dtype=np.float64) if isinstance(values, np.ndarray) else None
    if a is not None and a.ndim == 2:
        return balance_summary(a)["straggler_wait"]
    x = _ranks(values, "straggler_wait")
    if x is None:
        return math.nan
    return float(balance_rows(x[None, :])[2][0])


def step_wait_mean(x: np.ndarray) -> float:
    """Mean over steps of each step's :func:`straggler_wait` ``1 - mean / max``, every step weighing the same.

    Short steps count as much as long ones here, unlike :func:`straggler_wait` over steps (time-weighted);
    the two agree when every step lasts as long.

    Args:
        x: float array of shape (steps, ranks), non-negative.
    """
    return balance_summary(x)["step_wait_mean"]


# Why a row of readings is left out, in the order a row is counted under (one reason a row).
BAD_READINGS = ("negative", "nan", "inf", "subnormal")
_TINY = np.finfo(np.float64).tiny  # the smallest normal float64; a nonzero value below it is no measurement


class BalanceRows(tuple):
    """:func:`balance_rows`' three arrays ``(cv, imbalance, straggler_wait)``, unpacked as before, with the
    rows left out.

    Attributes:
        bad: bool (steps,): the rows holding a bad reading (their three statistics are ``nan``).
        skipped: ``{reason: rows}`` over :data:`BAD_READINGS` (a row counts once, under its first reason).
    """

    bad: np.ndarray
    skipped: dict[str, int]

    def __new__(
        cls, cv_: np.ndarray, imb: np.ndarray, wait: np.ndarray, bad: np.ndarray, skipped: dict[str, int]
    ) -> BalanceRows:
        out = super().__new__(cls, (cv_, imb, wait))
        out.bad, out.skipped = bad, skipped
        return out

    @property
    def skipped_rows(self) -> int:
        """How many rows were left out (``bad.sum()``)."""
        return int(sum(self.skipped.values()))

    def describe_skipped(self, what: str = "rows") -> str:
        """``"2 rows left out (1 negative, 1 nan)"``, or ``""`` when none was."""
        if not self.skipped_rows:
            return ""
        parts = ", ".join(f"{n} {reason}" for reason, n in self.skipped.items() if n)
        return f"{self.skipped_rows} {what} left out ({parts})"


def _bad_rows(a: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    """Rows of ``a`` holding a negative, nan, infinite or subnormal value, and their count by reason."""
    magnitude = np.abs(a)
    tests = {
        "negative": a < 0,
        "nan": np.isnan(a),
        "inf": np.isinf(a),
        "subnormal": (magnitude > 0) & (magnitude < _TINY),
    }
    bad = np.zeros(a.shape[0], dtype=bool)
    counts: dict[str, int] = {}
    for reason in BAD_READINGS:
        rows = tests[reason].any(axis=1) & ~bad
        counts[reason] = int(rows.sum())
        bad |= rows
    return bad, counts


def balance_rows(x: np.ndarray, *, strict: bool = False) -> BalanceRows:
    """:func:`cv`, :func:`imbalance` and :func:`straggler_wait` of every row at once.

    Args:
        x: float array of shape (steps, ranks), non-negative.
        strict: raise on a bad reading instead of leaving its row out.

    A row holding a bad reading (:data:`BAD_READINGS`: a negative value, ``nan``, an infinity or a subnormal
    number, none of which a step time, a token count or a cost can be) gives ``nan`` for its three
    statistics and is counted in the result's ``skipped``; it never raises (the monitor flushes through here:
    one bad timer reading must not stop training).

    Returns:
        A :class:`BalanceRows`: three float64 arrays of shape (steps,), CV, imbalance and straggler wait of
        each row (exactly ``0.0`` for a row of equal values, all zeros included, each clamped to its range,
        see above), and ``.bad`` / ``.skipped`` / ``.skipped_rows``, the rows left out.

    Raises:
        ValueError: if ``x`` is not 2-D or has no column; with ``strict``, a bad reading (naming its row, its
            value and the rule).
    """
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(
            f"balance_rows: expected an array of shape (steps, ranks) with ranks >= 1, got {a.shape}"
        )
    bad, skipped = _bad_rows(a)
    if strict and bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"balance_rows: row {row} holds {a[row].tolist()!r}: {_reason(a[row])}; work, time and "
            "memory are finite, non-negative and normal (or 0)"
        )
    a = np.where(bad[:, None], 0.0, a)  # computed as a zero row (no warning), then set to nan below
    n = a.shape[1]
    mean = a.mean(axis=1)
    top = a.max(axis=1)
    std = a.std(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cv_ = np.clip(std / mean, 0.0, math.sqrt(n - 1))
        imb = np.clip(top / mean - 1.0, 0.0, n - 1.0)
        wait = np.clip(1.0 - mean / top, 0.0, 1.0 - 1.0 / n)
    equal = top == a.min(axis=1)  # balanced (or all zero): exactly 0, whatever the rounding of the mean
    cv_[equal], imb[equal], wait[equal] = 0.0, 0.0, 0.0
    cv_[bad], imb[bad], wait[bad] = np.nan, np.nan, np.nan
    return BalanceRows(cv_, imb, wait, bad, skipped)


def _reason(row: Sequence[float] | np.ndarray) -> str:
    """Why :func:`balance_rows` leaves ``row`` out (its first :data:`BAD_READINGS`), or ``""``."""
    bad, counts = _bad_rows(np.asarray(row, dtype=np.float64).reshape(1, -1))
    if not bad[0]:
        return ""
    reason = next(r for r in BAD_READINGS if counts[r])
    return {
        "negative": "a negative value",
        "nan": "a nan (not measured)",
        "inf": "an infinite value",
        "subnormal": f"a subnormal value (nonzero, below {_TINY:.3g})",
    }[reason]


def measured_wait_rows(sync_wait: np.ndarray, compute: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the ranks' waiting for their peers as each rank *measured* it, next to :func:`balance_rows`'
    ``straggler_wait``, which is derived from the compute times alone.

    A rank's measured synchronisation wait (end of its backward -> end of its gradient collective) is its
    wait for the slowest rank plus the collective's own tail, which every rank pays. The rank that waits
    least is the slowest one: its wait is the tail. Taking it off every rank leaves the wait for peers, so

        measured_wait = mean_r(sync_wait_r - min_r sync_wait_r) / max_r compute_r

    which equals ``1 - mean / max`` of the compute times when both measurements are right: a check of the
    monitor against itself, and the figure to trust where they disagree.

    Args:
        sync_wait: float (steps, ranks), seconds; nan where not measured.
        compute: float (steps, ranks), each rank's own compute time in seconds.

    Returns:
        ``(measured_wait, tail_s)``: float64 (steps,) each; nan for a step with a nan, and for a step whose
        compute times hold a bad reading (:func:`balance_rows`' rule; never raised).
    """
    w = np.asarray(sync_wait, dtype=np.float64)
    c = np.asarray(compute, dtype=np.float64)
    if w.shape != c.shape or w.ndim != 2:
        raise ValueError(f"measured_wait_rows: shapes {w.shape} and {c.shape} must be equal (steps, ranks)")
    bad = _bad_rows(c)[0] | np.isinf(w).any(axis=1)
    w = np.where(bad[:, None], np.nan, w)
    c = np.where(bad[:, None], np.nan, c)
    tail = w.min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (w - tail[:, None]).mean(axis=1) / c.max(axis=1)
    return share, tail


# The balance figures that the simulator and the monitor both report, under these names, so that a
# simulated number and a measured one can be set side by side.
BALANCE_FIGURES = (
    "straggler_wait",
    "step_wait_mean",
    "cv_mean",
    "cv_p50",
    "cv_p95",
    "imbalance_mean",
    "imbalance_p95",
)


def summarize_steps(
    cv_: np.ndarray, imbalance_: np.ndarray, wait: np.ndarray, step_seconds: np.ndarray
) -> dict[str, float]:
    """The :data:`BALANCE_FIGURES` of a run from its per-step statistics.

    Args:
        cv_, imbalance_, wait: float arrays of shape (steps,), as :func:`balance_rows` returns them for
            the ranks' compute times; steps holding ``nan`` are left out.
        step_seconds: float array of shape (steps,): each step's duration, the slowest rank's compute
            time (``max`` over ranks); it weighs ``straggler_wait``.

    Returns:
        ``straggler_wait`` (time-weighted: ``sum(max - mean) / sum(max)``), ``step_wait_mean`` (unweighted
        mean of the per-step wait), ``cv_mean``, ``cv_p50``, ``cv_p95``, ``imbalance_mean``,
        ``imbalance_p95``; all ``nan`` without a step.
    """
    c, i, w, t = (np.asarray(v, dtype=np.float64) for v in (cv_, imbalance_, wait, step_seconds))
    ok = ~(np.isnan(c) | np.isnan(i) | np.isnan(w) | np.isnan(t))
    if not ok.any():
        return dict.fromkeys(BALANCE_FIGURES, math.nan)
    c, i, w, t = c[ok], i[ok], w[ok], t[ok]
    # per-step wait x duration = max - mean: the weighted mean is the summed waiting over the summed time
    weighted = float(np.average(w, weights=t)) if t.sum() > 0 else 0.0
    return {
        "straggler_wait": weighted,
        "step_wait_mean": float(w.mean()),
        "cv_mean": float(c.mean()),
        "cv_p50": float(np.percentile(c, 50)),
        "cv_p95": float(np.percentile(c, 95)),
        "imbalance_mean": float(i.mean()),
        "imbalance_p95": float(np.percentile(i, 95)),
    }


def balance_summary(x: np.ndarray) -> dict[str, float]:
    """The :data:`BALANCE_FIGURES` of the ranks' compute times over many steps.

    Args:
        x: float array of shape (steps, ranks): each rank's own compute time of each step (seconds),
            waiting excluded.

    Returns:
        See :func:`summarize_steps`.
    """
    a = np.asarray(x, dtype=np.float64)
    c, i, w = balance_rows(a)
    return summarize_steps(c, i, w, a.max(axis=1))


def vram_efficiency(peak_bytes: float, total_bytes: float) -> float:
    """Share of a device's memory that a step's peak allocation used: ``peak / total``.

    Args:
        peak_bytes: peak allocated bytes within the step (``torch.cuda.max_memory_allocated`` after a reset).
        total_bytes: the device's total memory in bytes.

    Raises:
        ValueError: if ``total_bytes`` is not positive or ``peak_bytes`` is negative.
    """
    if not total_bytes > 0:
        raise ValueError(f"vram_efficiency: total_bytes must be > 0, got {total_bytes!r}")
    if peak_bytes < 0:
        raise ValueError(f"vram_efficiency: peak_bytes must be >= 0, got {peak_bytes!r}")
    return float(peak_bytes) / float(total_bytes)


def peak_vram_utilisation_efficiency(peaks: Iterable[float], high_water: float | None = None) -> float:
    """Peak VRAM utilisation efficiency: ``mean(peaks) / high_water``.

    A data-parallel job must provision, on every device, the memory of its worst rank at its worst step (the
    high-water mark); memory a rank does not reach at its own peak is provisioned but idle. This statistic is
    the share of the provisioned memory used on average, and is ``1.0`` when every rank peaks equally at
    every step. It is our reading of the AdaptiveLoad paper's term, which gives no formula; it does not
    depend on the device's size, unlike :func:`vram_efficiency`.

    Args:
        peaks: peak allocated bytes, one per (rank, step).
        high_water: the job's high-water mark in bytes; ``max(peaks)`` when ``None``. Pass the running
            maximum of the whole job to score one logging window against it.

    Returns:
        A fraction in ``[0, 1]`` (``0.0`` when every peak is 0); ``nan`` if any peak is ``nan``.

    Raises:
        ValueError: if ``peaks`` is empty or negative, or ``high_water`` is below ``max(peaks)``.
    """
    x = _values(peaks, "peak_vram_utilisation_efficiency")
    if any(math.isnan(v) for v in x):
        return math.nan
    top = max(x) if high_water is None else float(high_water)
    if top < max(x):
        raise ValueError(
            f"peak_vram_utilisation_efficiency: high_water={high_water!r} is below the largest peak "
            f"{max(x)!r}; pass the running maximum over the whole job (or None)"
        )
    if top == 0.0:
        return 0.0
    return (math.fsum(x) / len(x)) / top


def achieved_flops_per_s(flops: float, seconds: float) -> float:
    """FLOP/s achieved: ``flops / seconds`` (``nan`` when ``seconds`` is not positive)."""
    if not seconds > 0:
        return math.nan
    return float(flops) / float(seconds)


def mfu(flops: float, seconds: float, peak_flops_per_s: float | None) -> float:
    """Model FLOPs utilisation: ``flops / seconds / peak_flops_per_s``.

    Args:
        flops: model FLOPs done in ``seconds`` (training: forward + backward = 3x forward; activation
            recomputation is not counted, so this is model FLOPs, not hardware FLOPs).
        seconds: wall time.
        peak_flops_per_s: the summed dense peak FLOP/s of the devices that did the work (see
            :func:`peak_flops`).

    Returns:
        A fraction (``0.4`` is 40%); ``nan`` when the peak is unknown or ``seconds`` is not positive.
    """
    if peak_flops_per_s is None or not peak_flops_per_s > 0:
        return math.nan
    return achieved_flops_per_s(flops, seconds) / float(peak_flops_per_s)


# Dense (no structured sparsity) peak FLOP/s per device, from NVIDIA's datasheets. Datasheets print the
# 2:4-sparsity figure for TF32/BF16/FP16/FP8, twice the dense one; MFU is quoted against dense peaks
# (Lightning 2.6's table holds the sparse figures for H200 and H100 NVL, which halves MFU on them).
# Keys: "fp64" (tensor core), "fp32" (no tensor core), "tf32", "bf16", "fp16", "fp8".
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # A100 SXM4 and PCIe (40 and 80 GB) share their compute.
    "a100": {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    # H100 SXM5 80 GB ("NVIDIA H100 80GB HBM3"); GH200's Hopper GPU has the same compute.
    "h100-sxm": {
        "fp64": 67e12,
        "fp32": 67e12,
        "tf32": 494.7e12,
        "bf16": 989.4e12,
        "fp16": 989.4e12,
        "fp8": 1978.9e12,
    },
    "h100-pcie": {
        "fp64": 51e12,
        "fp32": 51e12,
        "tf32": 378e12,
        "bf16": 756e12,
        "fp16": 756e12,
        "fp8": 1513e12,
    },
    # H100 NVL 94 GB, per GPU (the datasheet's TF32 835, BF16 1671, FP8 3341 are with sparsity).
    "h100-nvl": {
        "fp64": 60e12,
        "fp32": 60e12,
        "tf32": 417.5e12,
        "bf16": 835.5e12,
        "fp16": 835.5e12,
        "fp8": 1670.5e12,
    },
    # H200 SXM 141 GB ("NVIDIA H200"): the datasheet's TF32 989, BF16 1979, FP8 3958 are with sparsity.
    "h200-sxm": {
        "fp64": 67e12,
        "fp32": 67e12,
        "tf32": 494.5e12,
        "bf16": 989.5e12,
        "fp16": 989.5e12,
        "fp8": 1979e12,
    },
    # H200 NVL 141 GB ("NVIDIA H200 NVL"): TF32 835, BF16 1671, FP8 3341 with sparsity.
    "h200-nvl": {
        "fp64": 60e12,
        "fp32": 60e12,
        "tf32": 417.5e12,
        "bf16": 835.5e12,
        "fp16": 835.5e12,
        "fp8": 1670.5e12,
    },
    # L40S: TF32 366, BF16 733, FP8 1466 with sparsity; no useful FP64.
    "l40s": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    # B200 (HGX B200, per GPU; the datasheet's TF32 2.2, BF16 4.5, FP8 9 PFLOPS are with sparsity).
    "b200": {"fp64": 37e12, "fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
}

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "tf32": "tf32",
    "tfloat32": "tf32",
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
    "64": "fp64",
    "fp8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "transformer-engine": "fp8",
}


def normalize_dtype(dtype: object) -> str:
    """Map a dtype or precision name to a key of :data:`PEAK_FLOPS` (``"bf16"``, ``"fp32"``, ...).

    Accepts ``torch.bfloat16`` (any object whose ``str`` is ``"torch.<name>"``), ``"bfloat16"``, ``"bf16"``
    and Lightning precision strings such as ``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``.

    Raises:
        ValueError: if the name is not recognised; the message lists the accepted names.
    """
    name = str(dtype).lower().removeprefix("torch.")
    for suffix in ("-mixed", "-true"):
        name = name.removesuffix(suffix)
    key = _DTYPE_ALIASES.get(name)
    if key is None:
        raise ValueError(
            f"unknown dtype or precision {dtype!r}; use one of {sorted(set(_DTYPE_ALIASES))} "
            "or a torch dtype, or pass the peak FLOP/s yourself"
        )
    return key


def resolve_device(device_name: str) -> str | None:
    """Key of :data:`PEAK_FLOPS` for a CUDA device name (``torch.cuda.get_device_name()``), or ``None``.

    Recognised names include ``"NVIDIA H100 80GB HBM3"`` (SXM), ``"NVIDIA H100 PCIe"``, ``"NVIDIA H100 NVL"``,
    ``"NVIDIA H200"``, ``"NVIDIA H200 NVL"``, ``"NVIDIA GH200 480GB"``, ``"NVIDIA A100-SXM4-80GB"``,
    ``"NVIDIA L40S"`` and ``"NVIDIA B200"``. A bare ``"H100"`` is taken as the SXM part.
    """
    name = device_name.lower()
    # Order matters: "gh200" contains "h200", "gb200" contains "b200".
    if "gb200" in name:
        return None
    if "gh200" in name:
        return "h100-sxm"
    if "h200" in name:
        return "h200-nvl" if "nvl" in name else "h200-sxm"
    if "h100" in name:
        if "nvl" in name:
            return "h100-nvl"
        if "pcie" in name or "hbm2e" in name:
            return "h100-pcie"
        return "h100-sxm"
    if "a100" in name:
        return "a100"
    if "l40s" in name:
        return "l40s"
    if "b200" in name:
        return "b200"
    return None


def peak_flops(device_name: str, dtype: object = "bf16") -> float | None:
    """Dense peak FLOP/s of one device for a dtype, or ``None`` when the device or dtype is not in the table.

    Args:
        device_name: as ``torch.cuda.get_device_name()`` returns it.
        dtype: the matmul dtype, anything :func:`normalize_dtype` accepts. For ``"fp32"`` pass ``"tf32"``
            when TF32 matmuls are allowed (``torch.get_float32_matmul_precision() != "highest"``).

    Example::

        >>> peak_flops("NVIDIA H200", "bf16")
        989500000000000.0
    """
    key = resolve_device(device_name)
    if key is None:
        return None
    return PEAK_FLOPS[key].get(normalize_dtype(dtype))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``numpy.percentile``'s default method) of ``values``; ``nan`` when
    empty.

    Args:
        values: numbers (``nan`` entries are ignored).
        q: percentile in ``[0, 100]``.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q must be within [0, 100], got {q!r}")
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if np.isnan(x).all():  # also empty: numpy would warn and return nan
        return math.nan
    return float(np.nanpercentile(x, q))


def describe(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, p95, min and max of the finite ``values`` (``nan`` and infinities, readings no step
    gives, are left out); all ``nan`` when nothing is left.

    Returns:
        ``{"mean", "p50", "p95", "min", "max", "n"}``; ``n`` counts the finite values.
    """
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    x = np.where(np.isinf(x), np.nan, x)
    n = int(np.count_nonzero(~np.isnan(x)))
    if not n:  # numpy's nan-functions would warn on an empty or all-nan input
        return {"mean": math.nan, "p50": math.nan, "p95": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    p50, p95 = np.nanpercentile(x, [50.0, 95.0])
    return {
        "mean": float(np.nanmean(x)),
        "p50": float(p50),
        "p95": float(p95),
        "min": float(np.nanmin(x)),
        "max": float(np.nanmax(x)),
        "n": n,
    }

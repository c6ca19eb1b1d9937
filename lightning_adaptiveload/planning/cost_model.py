"""The cost of one training sample as a function of its token count.

Two forms:

- ``"quadratic"``: ``cost(S) = alpha * S + beta * S**2 + gamma`` -- linear layers (proportional to S)
  plus attention (proportional to S^2), plus a per-sample constant. Fitted to measured times it is in
  seconds per sample.
- ``"power"``: ``cost(S) = scale * S**p``, the AdaptiveLoad paper's form (``scale = 1`` when p is set by
  hand; then the unit is "token^p").

Both forms take a per-pack (per-step) constant ``c0``: the cost of one step that runs samples of token
counts ``S_1..S_n`` (a batch of one shape, or a *pack* of mixed shapes) is
``c0 + sum_i cost(S_i)`` (:meth:`CostModel.pack_cost`; :meth:`CostModel.batch_cost` for B equal samples).
``c0`` is the fixed cost of a step (kernel launches, optimizer-independent per-step work, the text
encoder's share...): one 1,560-token image takes 0.47 s on an H100 but 21 of them only 1.65 s, which no
per-sample form can express. ``c0 = 0`` (the default) gives the per-sample models exactly as before.

:meth:`CostModel.fit` fits either form by least squares to measured ``(S, seconds)`` pairs;
:meth:`CostModel.fit_packs` fits ``c0``, alpha, beta (and optionally gamma) to measured packs and single
samples together. Plain Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import numpy as np

__all__ = ["CostModel", "KINDS", "SequenceComm"]

KINDS = ("quadratic", "power")

# Token counts up to this value are priced through a table of their distinct values (a bincount).
_POWER_TABLE_MAX = 1 << 26


def _power(s: np.ndarray, p: float) -> np.ndarray:
    """``s ** p`` elementwise with the same bits on every CPU: each distinct value through Python's (the C
    library's) ``pow``, which :meth:`CostModel.cost` uses too.

    numpy's own ``power`` takes SIMD code on some CPUs (AVX-512) and the C library's elsewhere, and the two
    can differ in the last bit. Plans compare sums of costs, so one bit can flip a choice: nodes with
    different CPUs would plan different epochs from the same inputs. Token counts are few distinct
    integers, so this costs one pass over ``s`` and one ``pow`` per distinct count.
    """
    flat = s.ravel()
    if flat.size == 0:
        return np.empty_like(s)
    ints = flat.astype(np.int64)
    if np.array_equal(ints, flat) and ints.min() >= 0 and ints.max() <= _POWER_TABLE_MAX:
        present = np.flatnonzero(np.bincount(ints))
        table = np.zeros(int(present[-1]) + 1, dtype=np.float64)
        table[present] = [math.pow(float(v), p) for v in present.tolist()]
        return table[ints].reshape(s.shape)
    values, where = np.unique(flat, return_inverse=True)
    powered = [math.pow(v, p) if v >= 0 else math.nan for v in values.tolist()]  # numpy's nan for v < 0
    return np.array(powered, dtype=np.float64)[where].reshape(s.shape)


@dataclass
class CostModel:
    """Cost of one sample of S tokens: ``alpha*S + beta*S^2 + gamma`` or ``scale * S^p``.

    Args:
        kind: ``"quadratic"`` or ``"power"``.
        alpha: seconds (or cost units) per token, quadratic form.
        beta: seconds (or cost units) per token squared, quadratic form.
        gamma: constant per sample, quadratic form (may be negative when fitted; the cost must stay
            positive for the token counts it is used on, see :meth:`check_positive`).
        p: exponent, power form.
        scale: multiplier, power form (1 when p is hand-set).
        c0: constant per pack (per step), any form, >= 0; 0 gives the per-sample model.
        fit_info: filled by :meth:`fit`: ``{"n", "rmse", "mean_rel_error", "max_rel_error", "r2"}``
            (rmse in the unit of the fitted seconds, relative errors as fractions).

    Example:
        >>> CostModel(kind="power", p=1.5).cost(100)
        1000.0
        >>> CostModel(kind="quadratic", alpha=1.0, beta=0.5).batch_cost(2, 4)
        24.0
    """

    kind: str = "quadratic"
    alpha: float = 1.0
    beta: float = 0.0
    gamma: float = 0.0
    p: float = 1.0
    scale: float = 1.0
    fit_info: dict[str, float] | None = field(default=None, compare=False)
    c0: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"CostModel kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("alpha", "beta", "gamma", "p", "scale", "c0"):
            raw = getattr(self, name)
            try:
                value = float(raw) if not isinstance(raw, bool) else None
            except (TypeError, ValueError):
                value = None
            if value is None:  # a bool, a string, ...: named, not "could not convert string to float"
                raise ValueError(f"CostModel {name} must be a number, got {raw!r}")
            if not math.isfinite(value):
                raise ValueError(f"CostModel {name} must be finite, got {value!r}")
            setattr(self, name, value)
        if self.kind == "quadratic" and (self.alpha < 0 or self.beta < 0 or self.alpha + self.beta == 0):
            raise ValueError(
                f"a quadratic CostModel needs alpha >= 0, beta >= 0 and not both 0, got alpha={self.alpha}, "
                f"beta={self.beta}"
            )
        if self.c0 < 0:
            raise ValueError(f"CostModel c0 (cost per pack) must be >= 0, got {self.c0}")
        if self.kind == "power" and (self.p <= 0 or self.scale <= 0):
            raise ValueError(
                f"a power CostModel needs p > 0 and scale > 0, got p={self.p}, scale={self.scale}"
            )

    # -- evaluation ------------------------------------------------------------------------------------

    def cost(self, seq_len: float) -> float:
        """Cost of ONE sample of ``seq_len`` tokens (seconds when fitted to seconds)."""
        s = float(seq_len)
        if self.kind == "power":
            return self.scale * s**self.p
        return self.alpha * s + self.beta * s * s + self.gamma

    def batch_cost(self, batch_size: int, seq_len: float) -> float:
        """Cost of a batch of ``batch_size`` samples of ``seq_len`` tokens each: ``c0 + B * cost(S)``.

        An empty batch (``batch_size == 0``) costs 0: no step runs for it.
        """
        if batch_size == 0:
            return 0.0
        return self.c0 + batch_size * self.cost(seq_len)

    def costs(self, seq_lens: Any) -> np.ndarray:
        """Per-sample costs of an array of token counts (vectorised :meth:`cost`; float64, same shape)."""
        s = np.asarray(seq_lens, dtype=np.float64)
        if self.kind == "power":
            return self.scale * _power(s, self.p)
        return self.alpha * s + self.beta * s * s + self.gamma

    def pack_cost(self, seq_lens: Sequence[float]) -> float:
        """Cost of one step running samples of token counts ``seq_lens``: ``c0 + sum cost(S_i)``.

        An empty pack costs 0 (a zero-weight step runs nothing).
        """
        if len(seq_lens) == 0:
            return 0.0
        return float(self.c0 + self.costs(seq_lens).sum())

    def __call__(self, seq_len: float) -> float:
        return self.cost(seq_len)

    def sequence_parallel(
        self, degree: int, comm: SequenceComm | Mapping[str, Any] | None = None
    ) -> CostModel:
        """The cost on ONE GPU of a sample whose sequence is split over ``degree`` GPUs (Ulysses):
        ``cost(S) / G + comm(S, G)`` per sample, ``c0`` per step unchanged (every GPU of the group runs the
        step). The all-to-all term is linear in S (:meth:`SequenceComm.seconds_per_token`), so a quadratic
        model stays quadratic: ``alpha / G + kappa_G``, ``beta / G``, ``gamma / G``. ``degree`` 1: ``self``.

        Dividing ``gamma`` by G slightly flatters a group: the text's keys and values of cross-attention are
        computed on every GPU of it, whole. The comm term is in seconds: the model must be in seconds too.

        Raises:
            ValueError: ``degree`` < 1, or a power model with ``degree`` > 1 (its unit is token^p unless it
                was fitted, and ``scale * S^p / G + kappa * S`` is no longer a power form).
        """
        if isinstance(degree, bool) or int(degree) != degree or int(degree) < 1:
            raise ValueError(f"sequence_parallel must be an integer >= 1, got {degree!r}")
        g = int(degree)
        if g == 1:
            return self
        if self.kind != "quadratic":
            raise ValueError(
                f"sequence_parallel={g} prices Ulysses' all-to-all in seconds, which adds a linear term to the "
                f"cost; the cost model {self.describe()} is of kind {self.kind!r}. Give a quadratic cost model in "
                "seconds (batching.cost_model: {'kind': 'quadratic', 'alpha': ..., 'beta': ...}, e.g. one fitted "
                "by `calibrate`, or null for CostModel.default())"
            )
        kappa = SequenceComm.of(comm).seconds_per_token(g)
        return CostModel(
            kind="quadratic",
            alpha=self.alpha / g + kappa,
            beta=self.beta / g,
            gamma=self.gamma / g,
            c0=self.c0,
        )

    def __repr__(self) -> str:
        tail = f", c0={self.c0!r})" if self.c0 else ")"
        if self.kind == "power":
            return f"CostModel(kind='power', p={self.p!r}, scale={self.scale!r}" + tail
        return (
            f"CostModel(kind='quadratic', alpha={self.alpha!r}, beta={self.beta!r}, gamma={self.gamma!r}"
            + tail
        )

    def check_positive(self, seq_lens: Sequence[int]) -> None:
        """Raise ``ValueError`` if the cost is not positive for one of ``seq_lens``.

        A fitted negative ``gamma`` makes very short samples cost <= 0, which would make compute budgets
        meaningless; the message names the token count and what to do.
        """
        for s in sorted(set(int(x) for x in seq_lens)):
            c = self.cost(s)
            if not c > 0:
                cause = (
                    f" (its gamma={self.gamma!r}, the cost per sample, is negative)"
                    if self.kind == "quadratic" and self.gamma < 0
                    else ""
                )
                raise ValueError(
                    f"cost model {self.describe()} gives cost {c:.6g} <= 0 for a sample of {s} tokens{cause}; "
                    "refit it with data that covers this length, or set gamma=0"
                )

    def describe(self) -> str:
        """A one-line human-readable formula (per sample; ``+ c0 per pack`` when c0 is set)."""
        pack = f" (+ {self.c0:.6g} per pack)" if self.c0 else ""
        if self.kind == "power":
            return f"{self.scale:.6g} * S^{self.p:.4g}" + pack
        return f"{self.alpha:.6g}*S + {self.beta:.6g}*S^2 + {self.gamma:.6g}" + pack

    # -- persistence -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; :meth:`from_dict` inverts it (``fit_info`` included when present)."""
        if self.kind == "power":
            out: dict[str, Any] = {"kind": "power", "p": self.p, "scale": self.scale}
        else:
            out = {"kind": "quadratic", "alpha": self.alpha, "beta": self.beta, "gamma": self.gamma}
        if self.c0:
            out["c0"] = self.c0
        if self.fit_info is not None:
            out["fit_info"] = dict(self.fit_info)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | CostModel) -> CostModel:
        """Build from :meth:`to_dict`'s output (or a YAML mapping); a ``CostModel`` is returned as is.

        Raises:
            ValueError: unknown keys or bad values; the message lists the accepted keys.
        """
        if isinstance(data, CostModel):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(
                f"cost_model must be a mapping such as {{'kind': 'power', 'p': 1.5}}, got {data!r}"
            )
        kind = data.get("kind", "quadratic")
        allowed = {"kind", "fit_info", "c0"} | (
            {"p", "scale"} if kind == "power" else {"alpha", "beta", "gamma"}
        )
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"cost_model has unknown keys {unknown} for kind {kind!r}; accepted keys: {sorted(allowed)}"
            )
        kwargs = {k: v for k, v in data.items() if k != "fit_info"}
        model = cls(**kwargs)
        if data.get("fit_info") is not None:
            model.fit_info = dict(data["fit_info"])
        return model

    @classmethod
    def default(cls) -> CostModel:
        """The quadratic fit of Wan 2.1 1.3B on one H100 (bf16), seconds per sample.

        From the measured trace in ``shared/anchors`` (forward + backward with gradient checkpointing):
        ``3.44e-5 * S + 1.51e-9 * S^2`` seconds; the trace's small negative intercept (-3.6 ms) is left out
        so that the cost stays positive at every length. Used when no cost model is given: only the ratio
        between lengths matters for ``max_compute="auto"`` and for planning.
        """
        return cls(kind="quadratic", alpha=3.44e-5, beta=1.51e-9, gamma=0.0)

    # -- fitting ---------------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        seq_lens: Sequence[float],
        seconds: Sequence[float],
        kind: str = "quadratic",
        batch_sizes: Sequence[int] | None = None,
        fit_gamma: bool = True,
    ) -> CostModel:
        """Least-squares fit to measured times.

        Args:
            seq_lens: tokens per sample S of each measurement.
            seconds: measured time of each measurement: per sample, or per batch when ``batch_sizes``
                is given (then ``seconds[i] = batch_sizes[i] * cost(seq_lens[i])`` is fitted).
            kind: ``"quadratic"`` (alpha, beta >= 0 by non-negative least squares on the batch times;
                gamma free when ``fit_gamma``) or ``"power"`` (ordinary least squares of
                ``log(seconds per sample)`` on ``log S``).
            batch_sizes: samples per measurement, or None for per-sample times.
            fit_gamma: quadratic only: fit the per-sample constant (else gamma = 0).

        Returns:
            The fitted model; ``fit_info`` holds n, rmse (seconds, on the given times), mean and max
            relative error, and r2.

        Raises:
            ValueError: mismatched lengths, too few points, non-positive values.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        s = np.asarray(seq_lens, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        b = np.ones_like(s) if batch_sizes is None else np.asarray(batch_sizes, dtype=np.float64)
        if s.ndim != 1 or s.shape != y.shape or s.shape != b.shape:
            raise ValueError(
                f"seq_lens ({s.shape}), seconds ({y.shape}) and batch_sizes ({b.shape}) must be 1-d of equal length"
            )
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(y)) and np.all(np.isfinite(b))):
            raise ValueError("seq_lens, seconds and batch_sizes must be finite")
        if np.any(s <= 0) or np.any(y <= 0) or np.any(b <= 0):
            raise ValueError("seq_lens, seconds and batch_sizes must all be positive")
        if kind == "power":
            if len(np.unique(s)) < 2:
                raise ValueError("a power fit needs measurements at 2 or more distinct sequence lengths")
            slope, intercept = np.polyfit(np.log(s), np.log(y / b), 1)
            if slope <= 0:
                raise ValueError(
                    f"the power fit gives exponent p = {slope:.4g} <= 0 (time falls with length); check the timings"
                )
            model = cls(kind="power", p=float(slope), scale=float(math.exp(intercept)))
        else:
            model = cls._fit_quadratic(s, y, b, fit_gamma)
        pred = b * np.array([model.cost(v) for v in s])
        resid = pred - y
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        model.fit_info = {
            "n": int(len(s)),
            "rmse": float(np.sqrt(np.mean(resid**2))),
            "mean_rel_error": float(np.mean(np.abs(resid) / y)),
            "max_rel_error": float(np.max(np.abs(resid) / y)),
            "r2": float(1.0 - float(np.sum(resid**2)) / ss_tot) if ss_tot > 0 else 1.0,
        }
        return model

    @classmethod
    def _fit_quadratic(cls, s: np.ndarray, y: np.ndarray, b: np.ndarray, fit_gamma: bool) -> CostModel:
        # Columns: alpha, beta, gamma, each multiplied by the batch size. alpha and beta must be >= 0
        # (a negative attention or linear term is unphysical and breaks extrapolation); with two
        # constrained variables, exact NNLS is the best feasible solution over the 4 supports.
        cols = {"alpha": b * s, "beta": b * s * s, "gamma": b}
        free = ["gamma"] if fit_gamma else []
        scale = {k: float(np.max(np.abs(v))) for k, v in cols.items()}  # conditioning: S^2 is huge
        best: tuple[float, dict[str, float]] | None = None
        n_distinct = len(np.unique(s))
        if n_distinct < 1 + len(free):
            raise ValueError(
                f"a quadratic fit{' with gamma' if fit_gamma else ''} needs measurements at {1 + len(free)} or more "
                f"distinct sequence lengths, got {n_distinct}"
            )
        for use_alpha, use_beta in product((True, False), repeat=2):
            names = [n for n, u in (("alpha", use_alpha), ("beta", use_beta)) if u] + free
            if not (use_alpha or use_beta):
                continue
            if len(names) > n_distinct:
                continue  # not identifiable from this many distinct lengths
            a = np.stack([cols[n] / scale[n] for n in names], axis=1)
            coef, *_ = np.linalg.lstsq(a, y, rcond=None)
            values = {n: float(c / scale[n]) for n, c in zip(names, coef)}
            if values.get("alpha", 0.0) < 0 or values.get("beta", 0.0) < 0:
                continue
            if values.get("alpha", 0.0) + values.get("beta", 0.0) == 0:
                continue
            rss = float(np.sum((a @ coef - y) ** 2))
            if best is None or rss < best[0] - 1e-15 * max(1.0, rss):
                best = (rss, values)
        if best is None:
            raise ValueError(
                "the quadratic fit found no solution with alpha >= 0 and beta >= 0; check the timings "
                "(they should grow with the sequence length)"
            )
        values = best[1]
        return cls(
            kind="quadratic",
            alpha=values.get("alpha", 0.0),
            beta=values.get("beta", 0.0),
            gamma=values.get("gamma", 0.0),
        )

    @classmethod
    def fit_packs(
        cls,
        packs: Sequence[Sequence[float]],
        seconds: Sequence[float],
        fit_gamma: bool = False,
    ) -> CostModel:
        """Least-squares fit of ``c0 + sum_i (alpha*S_i + beta*S_i^2 [+ gamma])`` to measured steps.

        Every measurement is one step: a pack of samples of token counts ``packs[k]`` (one sample, a batch
        of B equal samples, or a mix) that took ``seconds[k]``. All terms are fitted together, so the
        per-step constant ``c0`` is told apart from the per-sample terms by steps that hold different
        numbers of samples (measure single samples AND packs). alpha, beta, c0 are kept >= 0 (exact
        non-negative least squares over the supports); the fit minimises the squared *relative* error,
        so that short steps count as much as long ones.

        Args:
            packs: per measurement, the token counts of its samples (non-empty).
            seconds: measured step time of each measurement (> 0).
            fit_gamma: also fit a per-sample constant gamma (free sign); off by default because c0 and
                gamma are only told apart by steps of different sample counts.

        Returns:
            A quadratic model with ``c0`` set; ``fit_info`` as in :meth:`fit`.

        Raises:
            ValueError: mismatched lengths, empty packs, non-positive values, too few measurements.
        """
        if len(packs) != len(seconds):
            raise ValueError(f"packs ({len(packs)}) and seconds ({len(seconds)}) must have equal length")
        lens = [np.asarray(p, dtype=np.float64) for p in packs]
        for k, p in enumerate(lens):
            if p.size == 0 or not np.all(np.isfinite(p)) or np.any(p <= 0):
                raise ValueError(
                    f"packs[{k}] = {list(packs[k])!r} must hold at least one positive token count"
                )
        return cls.fit_pack_sums(
            [p.size for p in lens],
            [p.sum() for p in lens],
            [(p * p).sum() for p in lens],
            seconds,
            fit_gamma=fit_gamma,
        )

    @classmethod
    def fit_pack_sums(
        cls,
        counts: Sequence[float],
        token_sums: Sequence[float],
        square_sums: Sequence[float],
        seconds: Sequence[float],
        fit_gamma: bool = False,
    ) -> CostModel:
        """:meth:`fit_packs` from each step's sufficient statistics instead of its token counts.

        The pack model is linear in three numbers per step: its sample count ``N``, ``sum S_i`` and
        ``sum S_i^2``; this fits it to them, for measurements that record those and not the samples (a
        LoadBalanceMonitor CSV gives ``N`` and ``sum S_i``; ``benchmarks/balance/ddp_modes_report.py`` recovers
        ``sum S_i^2`` from the planner's cost of the step). Same fit, constraints and ``fit_info`` as
        :meth:`fit_packs`.

        Args:
            counts: samples per step ``N`` (>= 1).
            token_sums: ``sum S_i`` per step (> 0).
            square_sums: ``sum S_i^2`` per step (> 0).
            seconds: measured step time (> 0).
            fit_gamma: also fit the per-sample constant gamma.

        Raises:
            ValueError: mismatched lengths, non-positive or non-finite values, too few measurements, or no
                solution with alpha + beta > 0.
        """
        y = np.asarray(seconds, dtype=np.float64)
        n, s1, s2 = (np.asarray(v, dtype=np.float64) for v in (counts, token_sums, square_sums))
        if y.ndim != 1 or not (y.shape == n.shape == s1.shape == s2.shape):
            raise ValueError(
                f"counts ({n.shape}), token_sums ({s1.shape}), square_sums ({s2.shape}) and seconds ({y.shape}) "
                "must be 1-d of equal length"
            )
        if not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ValueError("seconds must be a 1-d list of positive finite times")
        for name, v in (("counts", n), ("token_sums", s1), ("square_sums", s2)):
            if not np.all(np.isfinite(v)) or np.any(v <= 0):
                raise ValueError(f"{name} must be positive and finite in every step")
        cols = {"c0": np.ones_like(y), "alpha": s1, "beta": s2, "gamma": n}
        names = ["c0", "alpha", "beta"] + (["gamma"] if fit_gamma else [])
        if len(y) < len(names):
            raise ValueError(f"fit_packs needs at least {len(names)} measurements for {names}, got {len(y)}")
        values = _nonneg_lstsq({k: cols[k] / y for k in names}, np.ones_like(y), free={"gamma"})
        if values.get("alpha", 0.0) + values.get("beta", 0.0) == 0:
            raise ValueError(
                "fit_packs found no solution with alpha + beta > 0; check the timings (they should grow with "
                "the token counts)"
            )
        model = cls(
            kind="quadratic",
            alpha=values.get("alpha", 0.0),
            beta=values.get("beta", 0.0),
            gamma=values.get("gamma", 0.0),
            c0=values.get("c0", 0.0),
        )
        pred = model.c0 + model.alpha * s1 + model.beta * s2 + model.gamma * n
        model.fit_info = _fit_info(pred, y)
        return model


def _fit_info(pred: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """n, rmse, mean/max relative error and r2 of predictions ``pred`` against measurements ``y``."""
    resid = pred - y
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {
        "n": int(len(y)),
        "rmse": float(np.sqrt(np.mean(resid**2))),
        "mean_rel_error": float(np.mean(np.abs(resid) / y)),
        "max_rel_error": float(np.max(np.abs(resid) / y)),
        "r2": float(1.0 - float(np.sum(resid**2)) / ss_tot) if ss_tot > 0 else 1.0,
    }


def _nonneg_lstsq(cols: Mapping[str, np.ndarray], y: np.ndarray, free: Collection[str]) -> dict[str, float]:
    """Least squares of ``y`` on ``cols`` with every coefficient not in ``free`` kept >= 0.

    Exact for the few columns used here: the best feasible solution over all supports of the
    constrained columns (with free columns always in). Columns are scaled to unit max for conditioning.
    """
    constrained = [n for n in cols if n not in free]
    always = [n for n in cols if n in free]
    scale = {n: float(np.max(np.abs(v))) or 1.0 for n, v in cols.items()}
    best: tuple[float, dict[str, float]] | None = None
    for use in product((True, False), repeat=len(constrained)):
        names = [n for n, u in zip(constrained, use) if u] + always
        if not names:
            continue
        a = np.stack([cols[n] / scale[n] for n in names], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        values = {n: float(c / scale[n]) for n, c in zip(names, coef)}
        if any(values[n] < 0 for n in names if n not in free):
            continue
        rss = float(np.sum((a @ coef - y) ** 2))
        if best is None or rss < best[0] - 1e-15 * max(1.0, rss):
            best = (rss, values)
    return best[1] if best is not None else {}


@dataclass(frozen=True, kw_only=True)
class SequenceComm:
    """What Ulysses sequence parallelism's all-to-alls cost one GPU, per token of a sample.

    Ulysses splits a sample's S tokens over the G GPUs of a group: each holds ``S / G`` tokens of width D.
    Self-attention turns the sequence shards into head shards and back with four all-to-alls per layer
    (queries, keys, values in; the output back), each GPU sending ``(G - 1) / G`` of its shard:
    ``4 * S * D * dtype_bytes * (G - 1) / G**2`` bytes per GPU and layer in the forward pass (the group as a
    whole moves ``4 * S * D * dtype_bytes * (G - 1) / G``). The backward pass runs the reverse all-to-alls
    (as many bytes), activation checkpointing runs the forward's again: ``passes`` 3. The all-to-alls sit
    on the step's critical path (attention waits for them), so their time adds to the compute:
    ``bytes / link_gb_per_s``.

    Defaults: Wan 2.1 1.3B's width and depth (the model of :meth:`CostModel.default`), bf16, and an
    all-to-all bus bandwidth of 300 GB/s per GPU within a node of NVLink H100/H200s: an assumption (below
    NVLink 4's 450 GB/s per direction), not a measurement; ``benchmarks/sp/gpu_sp.sh`` measures the step.
    Groups across nodes run at the network's bandwidth (about 50 GB/s per GPU at 400 Gb/s): set it.

    Example:
        >>> comm = SequenceComm(hidden=1536, layers=30)
        >>> round(comm.seconds_per_token(2) * 1e9, 3)  # ns per token on each GPU
        921.6
    """

    hidden: int = 1536
    """Model width D (the all-to-alls move activations of this width; heads x head dim)."""

    layers: int = 30
    """Transformer blocks (one self-attention each)."""

    dtype_bytes: int = 2
    """Bytes per activation element (2: bf16)."""

    link_gb_per_s: float = 300.0
    """All-to-all bus bandwidth per GPU, GB/s (10**9 bytes)."""

    passes: float = 3.0
    """All-to-all rounds per step: forward, backward, and the checkpointed forward again (2 without)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"SequenceComm {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("link_gb_per_s", "passes"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"SequenceComm {name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def of(cls, value: SequenceComm | Mapping[str, Any] | None) -> SequenceComm:
        """``value`` as a ``SequenceComm``: itself, built from a dict of its fields, or the defaults (None).

        Raises:
            ValueError: a key that is no field (the message lists them), or a bad value.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"sequence_comm must be a mapping of {_COMM_FIELDS} or None, got {value!r}")
        unknown = sorted(set(value) - set(_COMM_FIELDS))
        if unknown:
            raise ValueError(f"sequence_comm has unknown keys {unknown}; accepted keys: {list(_COMM_FIELDS)}")
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COMM_FIELDS}

    def bytes_per_token(self, degree: int) -> float:
        """Bytes one GPU sends per token of a sample split over ``degree`` GPUs, all layers and passes."""
        g = int(degree)
        return 4.0 * self.layers * self.passes * self.hidden * self.dtype_bytes * (g - 1) / (g * g)

    def seconds_per_token(self, degree: int) -> float:
        """Seconds one GPU spends in all-to-alls per token of a sample split over ``degree`` GPUs (0 at 1)."""
        return self.bytes_per_token(degree) / (self.link_gb_per_s * 1e9)


_COMM_FIELDS = ("hidden", "layers", "dtype_bytes", "link_gb_per_s", "passes")

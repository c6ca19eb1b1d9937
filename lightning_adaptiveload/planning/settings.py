"""The settings an epoch is planned with: one frozen, keyword-only value, validated once, passed whole.

:class:`Batching` is how batches are sized (the settings of a
:class:`~.batching.DualConstraintBatcher`); :class:`PlanSettings` is what the DataModule builds from its arguments, what
:class:`~lightning_adaptiveload.loading.loader.PlannedShardDataset` holds, and what
:func:`~.planner.plan_epoch`, :func:`~.chunked.plan_segments` and the planner's steps read. Every check
of these settings is in :meth:`PlanSettings.__post_init__` and nowhere else: a bad value is refused where
the value is built, with the same message whichever layer it came through.

What a plan also depends on but is not a setting stays an argument of :func:`~.planner.plan_epoch`: the
index, the world size and workers, the batcher, the seed and epoch, the samples to leave out, the rank
to keep and the progress callback.

Pure Python (no Lightning, no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_adaptiveload.planning.cost_model import CostModel, SequenceComm
from lightning_adaptiveload.planning.sizing import BatchSizer

__all__ = ["Batching", "LockstepTail", "Oversize", "PlanSettings", "Schedule", "Sizing", "Underfull"]

#: The schedule an epoch is planned with (``docs/schedules.md``); ``"auto"``: lockstep, or packed where
#: lockstep's estimated straggler wait exceeds :data:`~.plan.AUTO_MAX_WAIT` and the model runs packs.
Schedule = Literal["independent", "lockstep", "packed", "auto"]
#: The end of a lockstep epoch: ``"packed"`` (balanced packs, the model must run packs) or ``"bucketed"``.
LockstepTail = Literal["packed", "bucketed"]
#: Where some rank can get no sample: ``"error"`` raises, ``"pad"`` gives it empty batches.
Underfull = Literal["error", "pad"]

#: The batch sizing rule: ``"dual"`` (token and compute caps) or ``"equal_tokens"`` (token cap only).
Sizing = Literal["dual", "equal_tokens"]
#: A sample with more tokens than ``max_tokens``: ``"raise"`` or ``"skip"`` (left out, counted).
Oversize = Literal["raise", "skip"]

_CHOICES = {"schedule": Schedule, "lockstep_tail": LockstepTail, "underfull": Underfull}


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How an epoch is planned (everything but the index, the ranks, the batcher, the seed and the epoch).

    Raises:
        ValueError: in ``__post_init__``, for any value out of its range, naming the setting, the value
            and what to pass instead.
    """

    schedule: Schedule = "independent"
    """``"independent"``, ``"lockstep"``, ``"packed"`` or ``"auto"`` (``docs/schedules.md``). A plan and its
    report carry the schedule it was planned with under the same name (``EpochPlan.schedule``,
    ``report["schedule"]``)."""

    lockstep_tolerance: float = 0.05
    """Relative cost tolerance, in [0, 1), that groups buckets into one lockstep class."""

    lockstep_tail: LockstepTail = "packed"
    """Lockstep: ``"packed"`` re-plans the samples of the unequal batches at the end of the epoch into
    balanced packs (the model must run packs), ``"bucketed"`` keeps them as unequal bucketed batches.
    Ignored by the other schedules."""

    max_buffered_samples: int | None = None
    """Independent: the samples a stream may hold decoded while its buckets fill (at least the largest
    batch size, checked against the batcher when the epoch is planned). None: ``max(64, 4 * largest
    batch size)``."""

    underfull: Underfull = "error"
    """Where some rank can get no sample: ``"error"`` raises ``PlanError``, ``"pad"`` gives it empty
    batches."""

    chunk_samples: int | None = None
    """An epoch of more samples is planned in segments of about this many (:mod:`.chunked`); None: at
    once. Ignored by the packed schedule."""

    plan_processes: int = 1
    """A chunked epoch's segments are planned this many at a time in spawned processes; 1: here."""

    keep_step_costs: bool = False
    """Keep ``plan.step_costs`` (every rank's estimated batch cost at every step)."""

    sequence_parallel: int = 1
    """GPUs per sequence-parallel group G (Ulysses: one sample's sequence split over G GPUs;
    :mod:`.groups`). The epoch is planned for ``world_size / G`` data-parallel groups, every GPU of a group
    gets the group's batches (the same samples), and a group's batch takes G times ``max_tokens`` at the
    cost of one GPU's share, ``cost(S) / G`` plus the all-to-all (``CostModel.sequence_parallel``). 1: off.
    The world size must be a multiple of it."""

    sequence_comm: dict[str, Any] | None = None
    """What the all-to-all of ``sequence_parallel > 1`` costs: a
    :class:`~.cost_model.SequenceComm` dict (``hidden``, ``layers``, ``dtype_bytes``, ``link_gb_per_s``,
    ``passes``); None: its defaults (Wan 2.1 1.3B, bf16, 300 GB/s). Ignored at ``sequence_parallel=1``."""

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in get_args(choices):
                raise ValueError(f"{name} must be one of {get_args(choices)}, got {value!r}")
        tolerance = _number(self.lockstep_tolerance, "lockstep_tolerance", float)
        if not 0 <= tolerance < 1:
            raise ValueError(f"lockstep_tolerance must be in [0, 1), got {self.lockstep_tolerance!r}")
        for name in ("max_buffered_samples", "chunk_samples"):
            value = getattr(self, name)
            if value is not None and _number(value, name, int) < 1:
                raise ValueError(f"{name} must be a positive number of samples or None, got {value!r}")
        processes = _number(self.plan_processes, "plan_processes", int)
        if processes < 1:
            raise ValueError(f"plan_processes must be >= 1, got {self.plan_processes!r}")
        degree = self.sequence_parallel
        if isinstance(degree, bool) or _number(degree, "sequence_parallel", int) != degree or degree < 1:
            raise ValueError(
                f"sequence_parallel must be an integer >= 1 (GPUs per sequence-parallel group), got {degree!r}"
            )
        object.__setattr__(self, "sequence_parallel", int(degree))
        if self.sequence_comm is not None:  # held as its dict (plain data in a checkpoint's hyperparameters)
            object.__setattr__(self, "sequence_comm", SequenceComm.of(self.sequence_comm).to_dict())
        # Stored as the types the planner computes with (a YAML "0.1" or a NumPy integer arrives as is).
        object.__setattr__(self, "lockstep_tolerance", tolerance)
        object.__setattr__(self, "plan_processes", processes)
        object.__setattr__(self, "keep_step_costs", bool(self.keep_step_costs))
        for name in ("max_buffered_samples", "chunk_samples"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def replace(self, **changes: Any) -> PlanSettings:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any], **given: Any) -> PlanSettings:
        """The settings of a plan saved with resume state (the dataset's ``plan_settings()`` dict, in the
        current layout: :func:`~lightning_adaptiveload.loading.resume.read_state` migrates an older one);
        ``given``: what the saved dict does not hold (``underfull``, ``plan_processes``)."""
        return cls(
            schedule=saved["schedule"],
            max_buffered_samples=saved["max_buffered_samples"],
            lockstep_tolerance=saved["lockstep_tolerance"],
            lockstep_tail=saved["lockstep_tail"],
            chunk_samples=saved["chunk_samples"],
            **given,
        )


def _number(value: Any, name: str, kind: type) -> Any:
    """``value`` as ``kind`` (int or float), or a ValueError naming the setting."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How the batches are sized: the settings of a :class:`~.batching.DualConstraintBatcher`.

    Every check of these settings runs when the value is built, each in one place:
    :class:`~.sizing.BatchSizer` checks ``max_tokens``, ``sizing``, ``patch_size`` and a numeric
    ``max_compute``; :class:`~.cost_model.CostModel` checks ``cost_model``; ``__post_init__`` the rest.

    Raises:
        ValueError: a value out of its range, naming the setting and the value.

    Example:
        >>> Batching(max_tokens=4096, sizing="equal_tokens").sizing
        'equal_tokens'
    """

    max_tokens: int = 4096
    """Token cap per batch (``B * S <= max_tokens``); also the largest sample allowed."""

    max_compute: float | Literal["auto"] | None = None
    """Compute cap per batch in the cost model's unit (``B * cost(S) <= max_compute``); ``"auto"`` or None:
    the cheapest full bucket's compute (``docs/data_path.md``). Ignored with ``sizing="equal_tokens"``. A
    number needs an explicit ``cost_model`` (it is in that model's unit)."""

    cost_model: dict[str, Any] | None = None
    """A :class:`~.cost_model.CostModel` dict (``{"kind": "quadratic", "alpha": ..., "beta": ...}`` or
    ``{"kind": "power", "p": 1.5}``) or a ``CostModel`` (held as its dict); None: :meth:`CostModel.default`."""

    sizing: Sizing = "dual"
    """``"dual"`` (token and compute caps) or ``"equal_tokens"`` (token cap only: ``B = max_tokens // S``)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """The model's patch size (pt, ph, pw): ``S = (T / pt) * (H / ph) * (W / pw)``."""

    oversize: Oversize = "raise"
    """A sample with more than ``max_tokens`` tokens: ``"raise"`` or ``"skip"`` (left out and counted)."""

    def __post_init__(self) -> None:
        cap = self.max_compute
        if isinstance(cap, str) and cap != "auto":
            raise ValueError(f"max_compute must be a number, 'auto' or None, got {cap!r}")
        numeric = cap is not None and cap != "auto"
        sizer = BatchSizer(
            self.max_tokens,
            sizing=self.sizing,
            max_compute=cap if numeric else None,
            patch_size=self.patch_size,
        )
        if self.oversize not in get_args(Oversize):
            raise ValueError(f"oversize must be one of {get_args(Oversize)}, got {self.oversize!r}")
        if self.cost_model is not None:
            # Held as its dict (what a recipe writes, and plain data in a checkpoint's hyperparameters).
            object.__setattr__(self, "cost_model", CostModel.from_dict(self.cost_model).to_dict())
        elif numeric and self.sizing == "dual":
            raise ValueError(
                f"max_compute={cap!r} is in the unit of a cost model, but no cost_model was given; pass "
                "cost_model (e.g. {'kind': 'power', 'p': 1.5} or a fitted one) or use max_compute='auto'"
            )
        object.__setattr__(self, "max_tokens", sizer.max_tokens)
        object.__setattr__(self, "patch_size", sizer.patch_size)
        if numeric:
            object.__setattr__(self, "max_compute", float(cap))  # type: ignore[arg-type]

    def replace(self, **changes: Any) -> Batching:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

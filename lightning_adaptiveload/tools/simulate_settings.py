"""The settings of the planning simulator (:func:`lightning_adaptiveload.tools.simulate.simulate`).

One frozen, keyword-only object, validated once in ``__post_init__``: every bad value is rejected here, with a
message that names the field and the value and says what to do. The command line
(:mod:`lightning_adaptiveload.cli.simulate`) builds it from its arguments.

Example:
    >>> from lightning_adaptiveload.tools.simulate_settings import SimulateSettings
    >>> SimulateSettings(world_sizes=[8, 2], max_tokens=512).world_sizes
    (2, 8)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from lightning_adaptiveload.tools.step_times import DEFAULT_PATCH

__all__ = ["DEFAULT_VARIANTS", "DEFAULT_WORLD_SIZES", "SimulateSettings", "SimulateVariant"]

#: A simulated configuration (a *variant*): a schedule and a batcher sizing rule (``tools.replay.VARIANTS``
#: maps each name to the pair).
SimulateVariant = Literal["equal_tokens", "dual", "lockstep", "lockstep_equal_tokens", "packed"]

DEFAULT_VARIANTS: tuple[SimulateVariant, ...] = ("equal_tokens", "dual", "lockstep")
DEFAULT_WORLD_SIZES: tuple[int, ...] = (2, 8, 16, 64)


@dataclass(frozen=True, kw_only=True)
class SimulateSettings:
    """What :func:`~lightning_adaptiveload.tools.simulate.simulate` simulates, besides its source and step times.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES
    """Data-parallel ranks to simulate, each in 2..1024; stored sorted, without repeats."""

    variants: Sequence[SimulateVariant] = DEFAULT_VARIANTS
    """Configurations to simulate (:data:`SimulateVariant`). ``equal_tokens`` is always simulated (the reference of
    ``tokens_per_s_ratio``), even when not listed."""

    max_tokens: int = 32760
    """The token budget per rank and step (the memory cap), identical in every variant."""

    max_compute: float | Literal["auto", "search"] = "auto"
    """The compute budget of the variants with sizing ``dual``, in planning-cost-model units, ``"auto"`` (the
    batcher's documented rule) or ``"search"`` (the recommended value of the budget search)."""

    p: float | None = None
    """Exponent of the planning model ``S^p`` (ignored when a planning cost model is given); None: fitted to
    the step times."""

    recommend: bool = True
    """Search ``max_compute`` candidates for each variant with sizing ``dual`` and each world size, keeping the
    highest tokens/s."""

    max_candidates: int = 10
    """At most this many ``max_compute`` candidates (break points of the batch sizes) in the search."""

    search_steps_per_rank: int = 64
    """Epoch length per rank of the (mix) population the search plans, at most ``min_steps_per_rank``."""

    num_workers: int = 1
    """DataLoader workers per rank (streams per rank in the plan), >= 0."""

    seed: int = 0
    """The planner's seed."""

    epoch: int = 0
    """The planner's epoch."""

    min_steps_per_rank: int = 200
    """A mix population is sized so that every rank gets about this many steps under ``equal_tokens``."""

    shards_per_stream: int = 4
    """Virtual shards per (rank, worker) stream when drawing from a mix."""

    plan_options: Mapping[str, Any] | None = None
    """Extra keyword arguments of :func:`~lightning_adaptiveload.planning.planner.plan_epoch`, e.g.
    ``{"max_buffered_samples": 256, "lockstep_tolerance": 0.01}``."""

    step_overhead_s: float = 0.0
    """Fixed seconds added to every rank's step (optimizer, all-reduce), >= 0."""

    noise: float = 0.0
    """Relative standard deviation of each rank's step time on identical work, in 0..0.5 (a real run's is in
    its report: ``identical_work_noise``). Above 0, every row also gives its wait and tokens/s with every
    replayed rank time scaled by ``1 + noise * N(0, 1)``, the mean of ``noise_draws`` seeded draws."""

    noise_draws: int = 64
    """Seeded draws the noisy figures average over, >= 1."""

    patch_size: Sequence[int] = DEFAULT_PATCH
    """(pt, ph, pw) of the model's patch embedding."""

    def __post_init__(self) -> None:
        patch = tuple(int(v) for v in self.patch_size)
        if len(patch) != 3 or min(patch) < 1:
            raise ValueError(f"patch_size must be 3 positive integers (pt, ph, pw), got {self.patch_size!r}")
        sizes = [int(w) for w in self.world_sizes]
        if not sizes or any(w < 2 or w > 1024 for w in sizes):
            raise ValueError(
                f"world_sizes must be integers in 2..1024, got {list(self.world_sizes)!r}; simulate at least 2 ranks"
            )
        choices = get_args(SimulateVariant)
        variants = tuple(self.variants)
        unknown = [m for m in variants if m not in choices]
        if unknown:
            raise ValueError(f"variants: unknown variant(s) {unknown}; choose from {sorted(choices)}")
        if not (isinstance(self.max_tokens, int | np.integer) and not isinstance(self.max_tokens, bool)) or (
            self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        mc = self.max_compute
        if (isinstance(mc, str) and mc not in ("auto", "search")) or (
            not isinstance(mc, str) and not (isinstance(mc, int | float) and mc > 0)
        ):
            raise ValueError(f"max_compute must be a positive number, 'auto' or 'search', got {mc!r}")
        for name in ("min_steps_per_rank", "shards_per_stream", "max_candidates", "search_steps_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers!r}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s!r}")
        if (
            isinstance(self.noise, bool)
            or not isinstance(self.noise, int | float)
            or not 0 <= self.noise <= 0.5
        ):
            raise ValueError(
                f"noise must be a relative standard deviation in 0..0.5 (0.02 for 2%), got {self.noise!r}"
            )
        if self.noise_draws < 1:
            raise ValueError(f"noise_draws must be >= 1, got {self.noise_draws!r}")
        if self.p is not None and not self.p > 0:
            raise ValueError(f"p must be a positive exponent or None (fitted), got {self.p!r}")
        object.__setattr__(self, "patch_size", patch)
        object.__setattr__(self, "world_sizes", tuple(sorted(set(sizes))))
        object.__setattr__(self, "variants", variants)
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        if self.plan_options is not None:
            object.__setattr__(self, "plan_options", dict(self.plan_options))

    @property
    def variants_to_run(self) -> list[SimulateVariant]:
        """The variants in the order they run: ``equal_tokens`` first, then the others as listed."""
        return ["equal_tokens"] + [m for m in dict.fromkeys(self.variants) if m != "equal_tokens"]

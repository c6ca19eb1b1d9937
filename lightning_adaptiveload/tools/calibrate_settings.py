"""The settings of the calibration (:func:`lightning_adaptiveload.tools.calibrate.calibrate`).

Three frozen, keyword-only groups, each validated once in its ``__post_init__``: what is measured
(:class:`CalibrateSettings`), how the measured training step runs (:class:`CalibratedTraining`) and how the token
budget is searched (:class:`MemorySearch`). The command line (:mod:`lightning_adaptiveload.cli.calibrate`) builds
them from its arguments and the recipe.

Example:
    >>> from lightning_adaptiveload.tools.calibrate_settings import CalibrateSettings, CalibratedTraining
    >>> CalibrateSettings(mix="tiny", training=CalibratedTraining(device="cpu")).training.device
    'cpu'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["CalibrateSettings", "CalibratedTraining", "MemorySearch", "Precision"]

#: Lightning precision of the measured step.
Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]


@dataclass(frozen=True, kw_only=True)
class CalibratedTraining:
    """How the measured training step runs: the settings of the run the budget is for.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    precision: Precision | None = None
    """Lightning precision; None: ``bf16-mixed`` on CUDA, ``32-true`` on CPU."""

    device: str | None = None
    """``"cuda"``, ``"cuda:1"``, ``"cpu"``; None: CUDA when available."""

    ddp: bool | None = None
    """Count DDP's gradient buckets (4 bytes per fp32 parameter) in the peak; None: on with CUDA."""

    activation_checkpointing: bool = False
    """As in :class:`~lightning_adaptiveload.models.module.VideoDiTModule`."""

    checkpoint_policy: Literal["full", "save_attention", "save_matmuls"] = "full"
    """What a checkpointed block keeps, as in ``VideoDiTModule`` (which checks it)."""

    checkpoint_blocks: Literal["auto"] | None = None
    """``"auto"``: fit the activation-memory model and write ``checkpoint_blocks: auto`` with it into the
    fragment; needs ``activation_checkpointing``."""

    compile: bool = False
    """Measure the compiled step; the fragment then sets ``model.init_args.compile: true``."""

    weight_dtype: Literal["fp32", "bf16"] = "fp32"
    """As in ``VideoDiTModule`` (which checks it): ``"bf16"`` measures bf16 parameters with fp32 master weights."""

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in get_args(Precision):
            raise ValueError(
                f"calibrate: precision must be one of {get_args(Precision)} or None, got {self.precision!r}"
            )
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(
                    f"calibrate: device must be 'cuda', 'cuda:N', 'cpu' or None, got {self.device!r}"
                ) from err
        if self.checkpoint_blocks not in (None, "auto"):
            raise ValueError(
                f"calibrate: checkpoint_blocks must be None or 'auto', got {self.checkpoint_blocks!r}"
            )
        if self.checkpoint_blocks == "auto" and not self.activation_checkpointing:
            raise ValueError(
                "calibrate: checkpoint_blocks='auto' needs activation_checkpointing=True; set both or neither"
            )


@dataclass(frozen=True, kw_only=True)
class MemorySearch:
    """How the token budget ``max_tokens`` is found (or given).

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    vram_fraction: float = 0.9
    """Share of the device memory the peak may use, in (0, 1]."""

    memory_budget_gb: float | None = None
    """The budget in GiB instead of ``vram_fraction`` x device memory (physical memory on CPU)."""

    max_tokens: int | None = None
    """Skip the memory search and use this budget (tokens per rank and step)."""

    max_batch: int = 256
    """Largest batch size the search tries."""

    def __post_init__(self) -> None:
        if not 0 < self.vram_fraction <= 1:
            raise ValueError(f"calibrate: vram_fraction must be in (0, 1], got {self.vram_fraction!r}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(
                f"calibrate: memory_budget_gb must be > 0 or None, got {self.memory_budget_gb!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"calibrate: max_tokens must be >= 1 or None (search), got {self.max_tokens!r}")
        if self.max_batch < 1:
            raise ValueError(f"calibrate: max_batch must be >= 1, got {self.max_batch!r}")


@dataclass(frozen=True, kw_only=True)
class CalibrateSettings:
    """What :func:`~lightning_adaptiveload.tools.calibrate.calibrate` measures and fits, besides the model.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    shapes: Sequence[Sequence[int]] | None = None
    """Latent shapes (C, T, H, W) to measure; or give ``mix``."""

    mix: str | None = None
    """A length mix whose bucket shapes are measured (when ``shapes`` is None)."""

    num_shapes: int = 6
    """How many distinct token counts to measure, spread over the range (<= 0: all)."""

    batch_sizes: Sequence[int] | None = None
    """Batch sizes to time at every shape; None: 1 and the budget's batch size at that shape (only 1 with
    ``packs``)."""

    text_len: int | None = None
    """Padded text length of the timed batches; None: 512 for a 4096-wide text encoder, else 16."""

    warmup: int = 2
    """Untimed runs per point, >= 0."""

    repeats: int = 5
    """Timed runs per point (the median is kept), >= 1."""

    seed: int = 0
    """Seeds the model and the random inputs."""

    kind: Literal["quadratic", "power"] = "quadratic"
    """The cost model's form."""

    max_compute: Literal["resolve", "auto"] = "resolve"
    """``"resolve"`` writes the number the batcher's ``"auto"`` rule gives on the measured shapes; ``"auto"``
    writes ``auto`` (resolved from the training data's shapes)."""

    packs: bool = True
    """Time single samples and the designed packs at ``max_tokens`` and fit ``c0``, alpha, beta to all of
    them (quadratic ``kind`` only)."""

    training: CalibratedTraining = field(default_factory=CalibratedTraining)
    """How the measured step runs."""

    memory: MemorySearch = field(default_factory=MemorySearch)
    """How the token budget is found."""

    def __post_init__(self) -> None:
        if self.shapes is None and self.mix is None:
            raise ValueError(
                "calibrate: give the shapes to measure (shapes=..., --shapes, --seq-lens) or a length mix "
                "(mix=..., --mix)"
            )
        if self.warmup < 0:
            raise ValueError(f"calibrate: warmup must be >= 0, got {self.warmup!r}")
        if self.repeats < 1:
            raise ValueError(f"calibrate: repeats must be >= 1, got {self.repeats!r}")
        if self.kind not in ("quadratic", "power"):
            raise ValueError(f"calibrate: kind must be 'quadratic' or 'power', got {self.kind!r}")
        if self.max_compute not in ("resolve", "auto"):
            raise ValueError(f"calibrate: max_compute must be 'resolve' or 'auto', got {self.max_compute!r}")
        if self.batch_sizes is not None and any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"calibrate: batch_sizes must be positive, got {list(self.batch_sizes)!r}")
        if not isinstance(self.training, CalibratedTraining) or not isinstance(self.memory, MemorySearch):
            raise ValueError(
                "calibrate: training must be a CalibratedTraining and memory a MemorySearch, got "
                f"{type(self.training).__name__} and {type(self.memory).__name__}"
            )

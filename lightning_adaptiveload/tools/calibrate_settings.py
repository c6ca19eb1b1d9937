"""The settings of the calibration (:func:`lightning_adaptiveload.tools.calibrate.calibrate`).

Frozen, keyword-only groups, each validated once in its ``__post_init__``: what is measured
(:class:`CalibrateSettings`), how the measured training step runs (:class:`CalibratedTraining`), how the token
budget is searched (:class:`MemorySearch`) and, for a recipe's own LightningModule, the batches its
``training_step`` is timed on (:class:`ModuleBatches`). The command line (:mod:`lightning_adaptiveload.cli.calibrate`)
builds them from its arguments and the recipe.

Example:
    >>> from lightning_adaptiveload.tools.calibrate_settings import CalibrateSettings, CalibratedTraining
    >>> CalibrateSettings(mix="tiny", training=CalibratedTraining(device="cpu")).training.device
    'cpu'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["CalibrateSettings", "CalibratedTraining", "MemorySearch", "ModuleBatches", "Precision"]

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

    packs: bool | None = None
    """Time single samples and the designed packs at ``max_tokens`` and fit ``c0``, alpha, beta to all of
    them (quadratic ``kind`` only). None: where the model takes packs (``VideoDiTModule`` does; a recipe's own
    module when its class sets ``runs_packed_batches = True``, as the DataModule asks); True: the model must
    take them; False: bucketed batches only (a per-sample fit of the batch times)."""

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
        if self.packs not in (None, True, False):
            raise ValueError(
                f"calibrate: packs must be True, False or None (where the model takes packs), got {self.packs!r}"
            )
        if self.batch_sizes is not None and any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"calibrate: batch_sizes must be positive, got {list(self.batch_sizes)!r}")
        if not isinstance(self.training, CalibratedTraining) or not isinstance(self.memory, MemorySearch):
            raise ValueError(
                "calibrate: training must be a CalibratedTraining and memory a MemorySearch, got "
                f"{type(self.training).__name__} and {type(self.memory).__name__}"
            )


#: dtypes of the latents and text states of a timed batch (those the shards store).
BatchDtype = Literal["float16", "float32"]


@dataclass(frozen=True, kw_only=True)
class ModuleBatches:
    """The batches a recipe's own LightningModule is timed on (:func:`~lightning_adaptiveload.tools.calibrate.calibrate_module`).

    They are the DataModule's batch dicts (``docs/data_path.md``): bucketed ones from
    :func:`~lightning_adaptiveload.loading.collate.collate`, and packs from
    :func:`~lightning_adaptiveload.loading.packed_collate.collate_packed` where the module takes them. The
    command line reads these fields from the recipe's ``data.init_args`` (``batching.patch_size``,
    ``loader.text_pad_to``, ``plan.schedule``, the ``synthetic`` block or the training shards).

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(pt, ph, pw): the data's patch size, which counts the tokens (the model's own, as for the DataModule)."""

    text_dim: int | None = 32
    """D_text of the text states; None: batches without text (``text`` and ``text_mask`` None)."""

    text_pad_to: int | None = None
    """Pad every batch's text to this many states (``loader.text_pad_to``); None: the sample's own length."""

    dtype: BatchDtype = "float16"
    """dtype of the latents and text states, as the shards store them (the synthetic data's default)."""

    schedule: str | None = None
    """The recipe's ``plan.schedule``: ``"packed"`` refuses a module that does not take packs, as the
    DataModule does before its first step."""

    def __post_init__(self) -> None:
        patch = tuple(self.patch_size) if isinstance(self.patch_size, Sequence) else ()
        if len(patch) != 3 or not all(type(p) is int and p >= 1 for p in patch):
            raise ValueError(
                f"calibrate: patch_size must be three positive integers, got {self.patch_size!r}"
            )
        object.__setattr__(self, "patch_size", patch)
        if self.text_dim is not None and not (type(self.text_dim) is int and self.text_dim >= 1):
            raise ValueError(
                f"calibrate: text_dim must be a positive integer or None (no text), got {self.text_dim!r}"
            )
        if self.text_pad_to is not None and not (type(self.text_pad_to) is int and self.text_pad_to >= 1):
            raise ValueError(
                f"calibrate: text_pad_to must be a positive integer or None, got {self.text_pad_to!r}"
            )
        if self.dtype not in get_args(BatchDtype):
            raise ValueError(f"calibrate: dtype must be one of {get_args(BatchDtype)}, got {self.dtype!r}")
        if self.schedule is not None and not isinstance(self.schedule, str):
            raise ValueError(f"calibrate: schedule must be a schedule name or None, got {self.schedule!r}")

"""The settings of :class:`~lightning_adaptiveload.models.module.VideoDiTModule`, one frozen group per concern.

``VideoDiTModule`` takes the architecture (``preset``, ``model_overrides``, ``init_from``: a
:class:`~lightning_adaptiveload.models.config.VideoDiTConfig`), then one settings object per concern:

- :class:`OptimizerSettings`: AdamW, its warm-up, and the weights' dtype (bf16 weights train with fp32
  master weights in the optimizer);
- :class:`SamplingSettings`: the rectified-flow times of training and validation;
- :class:`MemorySettings`: activation checkpointing and its memory model;
- :class:`~lightning_adaptiveload.models.compile_check.CompileSettings`: ``torch.compile`` of the blocks
  (``compile: true`` takes its defaults).

Each field is validated once, in its class's ``__post_init__``; the message names the recipe key
(``model.init_args.optimizer.lr``). In a recipe the groups nest under ``model.init_args``::

    model:
      class_path: lightning_adaptiveload.VideoDiTModule
      init_args:
        preset: wan-1.3b
        optimizer: {lr: 1.0e-4, weight_decay: 0.01, warmup_steps: 200}
        sampling: {shift: 5.0}
        memory: {activation_checkpointing: true}

:func:`module_settings` reads the three groups of a call (each an object, a dict of its fields as a
checkpoint's hyper-parameters keep it, or None for the defaults).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

__all__ = [
    "MemorySettings",
    "ModuleSettings",
    "OptimizerSettings",
    "SamplingSettings",
    "module_settings",
]

T = TypeVar("T")


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _bad(key: str, value: Any, what: str) -> ValueError:
    return ValueError(f"model.init_args.{key} = {value!r}: {what}")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """AdamW with linear warm-up, and the dtype of the weights it updates.

    Raises:
        ValueError: a bad value; the message names the recipe key (``model.init_args.optimizer.lr``).
    """

    lr: float = 1e-4
    """Peak learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas, each in [0, 1)."""

    weight_decay: float = 0.0
    """Decoupled weight decay on matrices (Linear/Conv weights); biases, norm weights and the modulation
    tables are not decayed."""

    eps: float = 1e-8
    """AdamW's epsilon."""

    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps, then constant."""

    weight_dtype: Literal["fp32", "bf16"] = "fp32"
    """``"fp32"`` (autocast casts the weights at every use) or ``"bf16"`` (bf16 parameters, fp32 master
    weights in the optimizer: :class:`~lightning_adaptiveload.models.master_weights.MasterWeightAdamW`, one
    Triton kernel a step on CUDA). Its peak memory is 2 bytes per parameter higher, so calibrate with it. Not
    under FSDP2."""

    def __post_init__(self) -> None:
        if not _positive(self.lr):
            raise _bad("optimizer.lr", self.lr, "the learning rate must be a number > 0")
        betas = tuple(self.betas) if isinstance(self.betas, list | tuple) else self.betas
        if not (
            isinstance(betas, tuple)
            and len(betas) == 2
            and all(isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        ):
            raise _bad("optimizer.betas", self.betas, "give two numbers in [0, 1), e.g. [0.9, 0.999]")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        if not (_positive(self.weight_decay) or self.weight_decay == 0) or isinstance(
            self.weight_decay, bool
        ):
            raise _bad("optimizer.weight_decay", self.weight_decay, "must be a number >= 0")
        if not _positive(self.eps):
            raise _bad("optimizer.eps", self.eps, "must be a number > 0")
        if not _count(self.warmup_steps, 0):
            raise _bad("optimizer.warmup_steps", self.warmup_steps, "must be an integer >= 0")
        if self.weight_dtype not in ("fp32", "bf16"):
            raise _bad("optimizer.weight_dtype", self.weight_dtype, "must be 'fp32' or 'bf16'")


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """The rectified-flow times: how training draws them, and the fixed ones of validation.

    Raises:
        ValueError: a bad value; the message names the recipe key (``model.init_args.sampling.shift``).
    """

    timestep_sampling: Literal["uniform", "sigmoid"] = "uniform"
    """``"uniform"``: t ~ U(0, 1); ``"sigmoid"``: the logit-normal of SD3
    (:func:`~lightning_adaptiveload.models.module.sample_timesteps`)."""

    shift: float = 5.0
    """Timestep shift ``shift * t / (1 + (shift - 1) * t)`` (1 = none; Wan uses 5 at 480p/720p)."""

    sigmoid_scale: float = 1.0
    """Logit standard deviation for ``"sigmoid"`` sampling."""

    num_train_timesteps: int = 1000
    """The model sees ``t * num_train_timesteps`` (Wan: 1000)."""

    val_timesteps: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Fixed times in [0, 1] at which validation, test and predict measure the loss (with fixed noise)."""

    def __post_init__(self) -> None:
        if self.timestep_sampling not in ("uniform", "sigmoid"):
            raise _bad("sampling.timestep_sampling", self.timestep_sampling, "must be 'uniform' or 'sigmoid'")
        if not _positive(self.shift):
            raise _bad("sampling.shift", self.shift, "the timestep shift must be a number > 0 (1 = no shift)")
        if not _positive(self.sigmoid_scale):
            raise _bad("sampling.sigmoid_scale", self.sigmoid_scale, "must be a number > 0")
        if not _count(self.num_train_timesteps, 1):
            raise _bad("sampling.num_train_timesteps", self.num_train_timesteps, "must be an integer >= 1")
        times = self.val_timesteps
        if not (
            isinstance(times, list | tuple)
            and times
            and all(isinstance(t, int | float) and not isinstance(t, bool) and 0.0 <= t <= 1.0 for t in times)
        ):
            raise _bad(
                "sampling.val_timesteps", times, "give one or more times in [0, 1], e.g. [0.25, 0.5, 0.75]"
            )
        object.__setattr__(self, "val_timesteps", tuple(float(t) for t in times))


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Activation checkpointing: whether, what a checkpointed block keeps, and how many blocks.

    Raises:
        ValueError: a bad value; the message names the recipe key (``model.init_args.memory.checkpoint_blocks``).
    """

    activation_checkpointing: bool = False
    """Recompute blocks in the backward pass."""

    checkpoint_policy: Literal["full", "save_attention", "save_matmuls"] = "full"
    """What a checkpointed block keeps: ``"full"`` (inputs only), ``"save_attention"`` (also the attention
    kernels' outputs, so the recompute skips attention) or ``"save_matmuls"`` (every matmul's output: the
    recompute runs only elementwise work)."""

    checkpoint_blocks: int | Literal["auto"] | None = None
    """How many blocks to checkpoint (None: all), spread over the depth; ``"auto"``: per batch, the fewest
    whose modelled peak fits ``memory_budget_gib`` (needs ``activation_memory``; see
    ``VideoDiT.set_activation_checkpointing``)."""

    activation_memory: dict[str, float] | None = None
    """For ``checkpoint_blocks="auto"``: the fitted memory model's numbers (``ActivationMemory.to_dict()``,
    from :func:`~lightning_adaptiveload.models.acceleration.probe_activation_memory` on the target GPU with
    this policy, or ``lightning-adaptiveload calibrate --checkpoint-blocks auto``)."""

    memory_budget_gib: float | None = None
    """For ``"auto"``: the peak one step may allocate, in GiB (None: 88% of the CUDA device's memory)."""

    expandable_segments: bool = False
    """Turn on the CUDA allocator's expandable segments when the model is built (see
    :func:`~lightning_adaptiveload.models.acceleration.use_expandable_segments`); a
    ``PYTORCH_CUDA_ALLOC_CONF`` that names ``expandable_segments`` wins. No effect off CUDA."""

    def __post_init__(self) -> None:
        from lightning_adaptiveload.models.checkpointing import CHECKPOINT_POLICIES
        from lightning_adaptiveload.models.memory import ActivationMemory

        if not isinstance(self.activation_checkpointing, bool):
            raise _bad(
                "memory.activation_checkpointing", self.activation_checkpointing, "must be true or false"
            )
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise _bad(
                "memory.checkpoint_policy",
                self.checkpoint_policy,
                f"must be one of {list(CHECKPOINT_POLICIES)}",
            )
        blocks = self.checkpoint_blocks
        if blocks not in (None, "auto") and not _count(blocks, 0):
            raise _bad(
                "memory.checkpoint_blocks", blocks, "give a block count >= 0, 'auto' or null (all blocks)"
            )
        if blocks == "auto" and self.activation_memory is None:
            raise _bad(
                "memory.checkpoint_blocks",
                blocks,
                '"auto" needs activation_memory (the numbers of an ActivationMemory fitted by '
                "acceleration.probe_activation_memory on the target GPU); or give checkpoint_blocks as a count",
            )
        if self.activation_memory is not None:
            if not isinstance(self.activation_memory, Mapping):
                raise _bad("memory.activation_memory", self.activation_memory, "must be a mapping of numbers")
            try:
                ActivationMemory.from_dict(self.activation_memory)  # the format's one check
            except ValueError as err:
                raise _bad("memory.activation_memory", self.activation_memory, str(err)) from None
            object.__setattr__(self, "activation_memory", dict(self.activation_memory))
        if not isinstance(self.expandable_segments, bool):
            raise _bad("memory.expandable_segments", self.expandable_segments, "must be true or false")
        if self.memory_budget_gib is not None and not _positive(self.memory_budget_gib):
            raise _bad(
                "memory.memory_budget_gib", self.memory_budget_gib, "must be a number of GiB > 0 or null"
            )


def _groups() -> dict[str, type]:
    return {"optimizer": OptimizerSettings, "sampling": SamplingSettings, "memory": MemorySettings}


@dataclass(frozen=True, kw_only=True)
class ModuleSettings:
    """The three groups of :class:`~lightning_adaptiveload.models.module.VideoDiTModule` together, as
    :func:`module_settings` returns them."""

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)


def _as_settings(cls: type[T], value: Any, name: str) -> T:
    """``value`` as a ``cls``: itself, the defaults for None, or built from a mapping of its fields (the
    plain form a checkpoint's hyper-parameters keep)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TypeError(f"model.init_args.{name}: unknown key(s) {unknown}; {cls.__name__} has {names}")
        return cls(**value)
    raise TypeError(
        f"model.init_args.{name}: expected a {cls.__name__} (or a mapping of its fields), got {value!r}"
    )


def module_settings(given: Mapping[str, Any]) -> ModuleSettings:
    """The module's settings groups, each given one read as its class.

    Args:
        given: ``{"optimizer": ..., "sampling": ..., "memory": ...}``: each a settings object, a mapping of
            its fields (a checkpoint's hyper-parameters) or None (the defaults).

    Raises:
        TypeError: a group of another type, or a mapping with a key that is no field of its group (the
            message names the recipe key, ``model.init_args.optimizer``).
    """
    return ModuleSettings(
        **{name: _as_settings(cls, given.get(name), name) for name, cls in _groups().items()}
    )

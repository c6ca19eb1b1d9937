"""Memory planner: an ESTIMATE of what fits on a GPU under DDP and under FSDP2, before anything runs.

Pure arithmetic (no torch, no Lightning). Given a model size, the GPU memory, the GPU count and a token
budget, :func:`estimate_memory` adds up, per GPU:

* model state, in bytes per parameter, with AdamW and ``bf16-mixed`` training:

  ===================  ======================  ==============================================
  what                 DDP (replicated)        FSDP2 (sharded over ``gpus``)
  ===================  ======================  ==============================================
  fp32 weights         4 (the master weights)  4 / gpus
  fp32 gradients       4                       4 / gpus
  AdamW m and v        8                       8 / gpus
  DDP gradient buckets 4                       --
  gathered units       --                      (2 + 2 + 4) x one block: bf16 parameters of the
                                               current and the prefetched block, fp32 gradients
                                               of the block being reduced
  ===================  ======================  ==============================================

  (``cpu_offload``: FSDP2's sharded weights, gradients and AdamW state live in host memory instead.)
* activations: ``max_tokens`` x :func:`activation_bytes_per_token`, a per-token count of what the
  backward keeps (documented there), or the figure ``calibrate`` measured on the real device.

It ignores the CUDA context and allocator fragmentation (hence ``usable_fraction``), the text encoder
(the data path feeds precomputed embeddings) and the attention kernel's workspace. Use it to choose the
strategy and the GPU count; then run ``lightning-adaptiveload calibrate`` on the target GPU for the
measured ``max_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "AUTO_BUDGET_FRACTION",
    "ActivationMemory",
    "MemoryPoint",
    "MemoryEstimate",
    "activation_bytes_per_token",
    "blocks_to_checkpoint",
    "estimate_memory",
]

GB = 1e9  # decimal gigabytes: GPU memory is sold in them (H100 80 GB, H200 141 GB)

# Bytes per parameter of the model state (see the module docstring's table).
_STATE_BYTES = {"weights": 4.0, "grads": 4.0, "adam": 8.0}
_DDP_BUCKET_BYTES = 4.0
_GATHERED_BYTES_PER_BLOCK_PARAM = 2.0 + 2.0 + 4.0


def activation_bytes_per_token(dim: int, ffn_dim: int, num_layers: int, checkpointing: bool = True) -> float:
    """Bytes of activations kept per token for the backward (an estimate, bf16 autocast).

    One block's working set, per token, in bf16 (2 bytes): the two modulated norms and their fp32 copies
    (counted as 4 D), q, k, v and the attention output (4 D), the two output projections (2 D), the
    cross-attention query and output (2 D), the FFN's hidden layer before and after GELU (2 F) and its
    output (D), plus the residual stream (fp32, 2 D in bf16 units): ``(15 D + 2 F) x 2`` bytes.

    With full activation checkpointing each block keeps only its input (the fp32 residual stream, 4 D
    bytes) and one block's working set exists at a time, during its recompute; without it, every block
    keeps its working set.

    Args:
        dim: model width D. ffn_dim: FFN hidden width F. num_layers: blocks.
        checkpointing: every block recomputes its forward in the backward (``activation_checkpointing``).
    """
    working_set = (15 * dim + 2 * ffn_dim) * 2.0
    if checkpointing:
        return num_layers * 4.0 * dim + working_set
    return num_layers * working_set


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory, in GB (1e9 bytes), of one configuration; every figure is an estimate.

    Attributes:
        strategy: ``"ddp"`` or ``"fsdp2"``.
        state_gb: weights + gradients + AdamW state (+ DDP buckets, or FSDP2's gathered units) on the GPU.
        activations_gb: ``max_tokens`` x bytes per token.
        total_gb: their sum. usable_gb: ``gpu_memory_gb x usable_fraction``.
        fits: ``total_gb <= usable_gb``.
        max_tokens_that_fit: the largest token budget that fits beside the state (0 if the state alone
            does not).
        host_gb: what ``cpu_offload`` keeps in host memory per GPU (0 without it).
    """

    strategy: str
    state_gb: float
    activations_gb: float
    total_gb: float
    usable_gb: float
    fits: bool
    max_tokens_that_fit: int
    host_gb: float = 0.0


def estimate_memory(
    params: float,
    gpu_memory_gb: float,
    gpus: int,
    max_tokens: int,
    bytes_per_token: float,
    strategy: str = "fsdp2",
    block_params: float | None = None,
    cpu_offload: bool = False,
    usable_fraction: float = 0.9,
) -> MemoryEstimate:
    """Estimate one GPU's memory for training ``params`` parameters on ``gpus`` GPUs (see the module docstring).

    Args:
        params: parameters of the model.
        gpu_memory_gb: memory of one GPU in GB (1e9 bytes), e.g. 80 (H100), 141 (H200).
        gpus: GPUs that share the model (FSDP2's shard group; for DDP only its data parallelism).
        max_tokens: the token budget of one rank's batch.
        bytes_per_token: activation bytes per token (:func:`activation_bytes_per_token`, or measured).
        strategy: ``"ddp"`` or ``"fsdp2"``.
        block_params: parameters of one block (FSDP2's unit); None: ``params / 40``.
        cpu_offload: FSDP2 only: sharded state in host memory.
        usable_fraction: share of the GPU memory the allocator can use (context, fragmentation).

    Raises:
        ValueError: an unknown strategy, ``cpu_offload`` with DDP, or a non-positive size.
    """
    if strategy not in ("ddp", "fsdp2"):
        raise ValueError(f"estimate_memory: strategy must be 'ddp' or 'fsdp2', got {strategy!r}")
    if cpu_offload and strategy != "fsdp2":
        raise ValueError("estimate_memory: cpu_offload=True needs strategy='fsdp2' (DDP cannot offload)")
    if params <= 0 or gpu_memory_gb <= 0 or gpus < 1 or max_tokens < 0 or bytes_per_token <= 0:
        raise ValueError(
            f"estimate_memory: need params > 0, gpu_memory_gb > 0, gpus >= 1, max_tokens >= 0 and "
            f"bytes_per_token > 0, got {params}, {gpu_memory_gb}, {gpus}, {max_tokens}, {bytes_per_token}"
        )
    per_param = sum(_STATE_BYTES.values())
    host = 0.0
    if strategy == "ddp":
        state = params * (per_param + _DDP_BUCKET_BYTES)
    else:
        unit = block_params if block_params is not None else params / 40
        sharded = params * per_param / gpus
        gathered = unit * _GATHERED_BYTES_PER_BLOCK_PARAM
        state = gathered + (0.0 if cpu_offload else sharded)
        host = sharded if cpu_offload else 0.0
    usable = gpu_memory_gb * GB * usable_fraction
    activations = max_tokens * bytes_per_token
    total = state + activations
    room = usable - state
    return MemoryEstimate(
        strategy=strategy,
        state_gb=state / GB,
        activations_gb=activations / GB,
        total_gb=total / GB,
        usable_gb=usable / GB,
        fits=total <= usable,
        max_tokens_that_fit=max(0, math.floor(room / bytes_per_token)) if room > 0 else 0,
        host_gb=host / GB,
    )


# -- which blocks to checkpoint, per batch ----------------------------------------------------------------


#: ``checkpoint_blocks="auto"``'s default budget: this share of the GPU's memory for the modelled peak (the
#: rest for the allocator's fragmentation and the model's error: up to 1.4 GiB measured on an H100).
AUTO_BUDGET_FRACTION = 0.88


def blocks_to_checkpoint(num_blocks: int, headroom_bytes: float, per_block_bytes: float) -> int:
    """The fewest of ``num_blocks`` blocks to checkpoint when ``headroom_bytes`` are free beyond the peak
    with every block checkpointed and each block left un-checkpointed adds ``per_block_bytes``.

    Raises:
        ValueError: ``headroom_bytes < 0`` (even checkpointing every block does not fit).
    """
    if headroom_bytes < 0:
        raise ValueError(
            f"over the memory budget by {-headroom_bytes / 2**30:.2f} GiB with every block checkpointed"
        )
    if per_block_bytes <= 0:
        return 0
    return max(0, num_blocks - int(headroom_bytes // per_block_bytes))


@dataclass(frozen=True)
class MemoryPoint:
    """One measured training step: a batch of ``batch`` samples of ``seq`` tokens with ``text`` text tokens
    each, ``checkpointed`` of the model's blocks checkpointed, and its peak allocated bytes."""

    batch: int
    seq: int
    text: int
    checkpointed: int
    peak_bytes: float


@dataclass(frozen=True)
class ActivationMemory:
    """Peak memory of a training step as a function of the batch and of how many blocks are checkpointed.

    ``peak = base + B*S*token_all + B*L*text_all + (N - k) * (B*S*token_block + B*L*text_block)`` for a
    batch of B samples of S tokens with L text tokens each, k of the N blocks checkpointed: ``base`` is the
    model state (weights, gradients, optimizer), the ``*_all`` terms what the step keeps with every block
    checkpointed (block inputs, what the policy saves, one block's recompute), the ``*_block`` terms what one
    more un-checkpointed block keeps. Text is a term of its own: a batch of 20 images holds 20 text
    sequences for the cross-attention, a clip of the same tokens one.

    Fitted by :meth:`fit` from measured steps (:func:`lightning_adaptiveload.models.acceleration.
    probe_activation_memory`); :meth:`checkpointed_blocks` then picks, per batch, the fewest blocks to
    checkpoint within a budget (``VideoDiT.set_activation_checkpointing(num_blocks="auto")``).
    """

    num_blocks: int
    base_bytes: float
    token_all: float
    text_all: float
    token_block: float
    text_block: float

    def __post_init__(self) -> None:
        # Read from recipes (activation_memory:): a NaN base would make every budget comparison False.
        if type(self.num_blocks) is not int or self.num_blocks < 1:
            raise ValueError(f"activation_memory: num_blocks={self.num_blocks!r} must be a positive integer")
        for name in list(self.__dataclass_fields__)[1:]:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(
                    f"activation_memory: {name}={value!r} must be a finite number >= 0; measure it with "
                    "acceleration.probe_activation_memory (or `calibrate --checkpoint-blocks auto`)"
                )

    def peak_bytes(self, batch: int, seq: int, text: int, checkpointed: int) -> float:
        """The modelled peak of one step (the formula in the class docstring)."""
        free = self.num_blocks - checkpointed
        return (
            self.base_bytes
            + batch * seq * (self.token_all + free * self.token_block)
            + batch * text * (self.text_all + free * self.text_block)
        )

    def checkpointed_blocks(self, batch: int, seq: int, text: int, budget_bytes: float) -> int:
        """The fewest blocks to checkpoint so that the step's modelled peak stays within ``budget_bytes``.

        Raises:
            ValueError: the batch does not fit even with every block checkpointed (names the batch).
        """
        every = self.peak_bytes(batch, seq, text, self.num_blocks)
        per_block = batch * (seq * self.token_block + text * self.text_block)
        try:
            return blocks_to_checkpoint(self.num_blocks, budget_bytes - every, per_block)
        except ValueError:
            raise ValueError(
                f"a batch of {batch} x {seq} tokens (text {text}) needs {every / 2**30:.1f} GiB with every "
                f"block checkpointed, over the budget of {budget_bytes / 2**30:.1f} GiB; lower max_tokens"
            ) from None

    @classmethod
    def fit(cls, num_blocks: int, points: Sequence[MemoryPoint]) -> ActivationMemory:
        """Least-squares fit of the five coefficients to measured steps (negative ones clipped to 0).

        The points must separate the terms: at least two checkpoint counts, and batches whose text share
        (L / S) differs, e.g. one long clip and a batch of images, each at all N and at N/2 blocks, plus one
        smaller batch for the base.

        Raises:
            ValueError: fewer than five points, or points that do not determine every coefficient.
        """
        if len(points) < 5:
            raise ValueError(f"ActivationMemory.fit needs at least 5 measured steps, got {len(points)}")
        rows = []
        for p in points:
            free = num_blocks - p.checkpointed
            bs, bl = p.batch * p.seq, p.batch * p.text
            rows.append([1.0, bs, bl, free * bs, free * bl])
        a = np.asarray(rows, dtype=np.float64)
        y = np.asarray([p.peak_bytes for p in points], dtype=np.float64)
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        if np.linalg.matrix_rank(a / scale) < 5:
            raise ValueError(
                "ActivationMemory.fit: the measured steps do not separate the terms; measure at two "
                "checkpoint counts, and batches with different text-to-token ratios (a clip and images)"
            )
        coef = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
        base, tok_all, txt_all, tok_block, txt_block = (max(0.0, float(c)) for c in coef)
        return cls(num_blocks, base, tok_all, txt_all, tok_block, txt_block)

    def to_dict(self) -> dict:
        """Plain numbers (for a recipe's ``activation_memory:`` and results JSON); :meth:`from_dict` inverts."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ActivationMemory:
        """From :meth:`to_dict`'s mapping (a recipe's ``activation_memory:``).

        Raises:
            ValueError: a missing or unknown key (named).
        """
        names = set(cls.__dataclass_fields__)
        missing, unknown = names - set(values), set(values) - names
        if missing or unknown:
            raise ValueError(
                f"activation_memory: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; expected "
                f"{sorted(names)}"
            )
        try:
            num_blocks = values["num_blocks"]
            num_blocks = (
                int(num_blocks) if isinstance(num_blocks, float) and num_blocks.is_integer() else num_blocks
            )
            return cls(num_blocks, *(float(values[k]) for k in list(cls.__dataclass_fields__)[1:]))
        except (TypeError, ValueError) as err:
            if str(err).startswith("activation_memory"):
                raise
            raise ValueError(f"activation_memory: {err}; expected numbers for {sorted(names)}") from None

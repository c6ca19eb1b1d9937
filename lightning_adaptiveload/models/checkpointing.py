"""Activation checkpointing of the repeated blocks: the policies (what a checkpointed block keeps) and which
blocks are checkpointed.

``VideoDiT.set_activation_checkpointing`` chooses a policy and a count of blocks, spread evenly over the depth
(:func:`spread`); with ``num_blocks="auto"`` the count is chosen per batch from a fitted
:class:`lightning_adaptiveload.models.memory.ActivationMemory` and a memory budget. Each block applies its own
policy inside its forward, so a compiled block includes its checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_adaptiveload.models import pack_attention as _pack_attention

__all__ = [
    "CHECKPOINT_POLICIES",
    "CONTEXT_FNS",
    "apply_checkpointing",
    "auto_count",
    "run_block",
    "save_attention_contexts",
    "save_matmuls_contexts",
    "spread",
]

# What an activation-checkpointed block keeps for its backward pass (see VideoDiT.set_activation_checkpointing),
# from the least memory (and the most recompute) to the most.
CHECKPOINT_POLICIES = ("full", "save_attention", "save_matmuls")

# Outputs of these ops are kept by the "save_attention" checkpoint policy: the attention kernels hold about
# 70% of a long clip's FLOPs, everything else in a block is cheap to run again.
_ATTENTION_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
}
# A mixed pack's self-attention, one dense kernel call per run of equal-length samples (models/pack_attention.py).
_ATTENTION_OPS.add(_pack_attention.pack_runs_op())
try:  # the variable-length kernel of mixed packs (torch >= 2.10), a custom op of its own
    import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn)

    _ATTENTION_OPS.add(torch.ops.torch_attn._varlen_attn.default)
except (ImportError, AttributeError):
    pass


# ... and by "save_matmuls" with these: the recompute then runs only elementwise work (norms, RoPE, GELU, gates),
# which a compiled block fuses into few kernels.
_MATMUL_OPS = _ATTENTION_OPS | {
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm")
    if hasattr(torch.ops.aten, name)
}


def _save_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_attention_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the ``"save_attention"`` policy."""
    return create_selective_checkpoint_contexts(_save_attention_policy)


def save_matmuls_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the ``"save_matmuls"`` policy."""
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


# policy -> context_fn for torch.utils.checkpoint.checkpoint (absent: "full", the default context).
CONTEXT_FNS = {"save_attention": save_attention_contexts, "save_matmuls": save_matmuls_contexts}


def run_block(policy: str | None, training: bool, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, under ``policy``'s activation checkpoint when training with gradients (None: plain)."""
    if policy is None or not (training and torch.is_grad_enabled()):
        return fn(*args)
    extra = {"context_fn": CONTEXT_FNS[policy]} if policy in CONTEXT_FNS else {}
    return checkpoint(fn, *args, use_reentrant=False, **extra)


def spread(count: int, n: int) -> list[int]:
    """``count`` indices out of ``range(n)``, evenly spaced (e.g. 2 of 6 -> [0, 3])."""
    return sorted({(i * n) // count for i in range(count)}) if count else []


def apply_checkpointing(blocks: Sequence[nn.Module], policy: str | None, count: int) -> None:
    """Set ``checkpoint_policy`` on ``count`` of ``blocks`` (spread over the depth) and None on the rest."""
    chosen = set(spread(count, len(blocks))) if policy is not None else set()
    for i, block in enumerate(blocks):
        block.checkpoint_policy = policy if i in chosen else None


def auto_count(memory: Any, batch: tuple[int, int, int], budget: float, warned: set) -> int:
    """``num_blocks="auto"``: the blocks to checkpoint for a batch of (B, S, L) (``memory`` an
    ``ActivationMemory``). A batch predicted over ``budget`` even with every block checkpointed gets every
    block, and one warning per batch size and length, whatever the text length (``warned`` remembers them:
    text lengths vary by sample): the prediction may be pessimistic, and a real out-of-memory error names
    the batch anyway."""
    try:
        return memory.checkpointed_blocks(*batch, budget)
    except ValueError as err:
        if batch[:2] not in warned:
            warned.add(batch[:2])
            warnings.warn(f"checkpoint_blocks='auto': {err}; checkpointing every block", stacklevel=4)
        return memory.num_blocks

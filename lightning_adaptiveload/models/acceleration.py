"""Step-speed switches that work on our ``VideoDiT`` and on users' own DiTs (diffusers' Wan included).

- :func:`compile_blocks`: regional ``torch.compile`` of a model's repeated blocks. One graph serves every
  block (parameters are graph inputs), compile time is that of one block rather than the whole model,
  and the parts that change with the input's shape (RoPE tables, patchify) stay eager. The fused
  ``layer_norm_modulate`` op is a ``torch.library`` custom op, so it stays one node in the graph.
- :func:`set_attention_backend`: the attention-kernel switch. On our model it sets the SDPA kernel order
  (:mod:`lightning_adaptiveload.models.attention`); on a diffusers model it uses diffusers' own setting
  (``ModelMixin.set_attention_backend``) with the matching name.

Recompiles: :func:`compile_blocks` compiles with symbolic sizes (``dynamic=True``) from the first call, so
one graph serves every sequence length and batch size, except that PyTorch specialises a size of 1 apart
from the others: a mix with B = 1 and B > 1 batches compiles two graphs per block mode
(:data:`MAX_GRAPHS_PER_MODE`, checked in ``tests/test_acceleration.py``). A mode is one combination of
train/eval, text/no text and checkpoint policy. With ``dynamic=None`` the first shape gets a static graph
of its own (three at most). Every block shares the graph (parameters are graph inputs, and the model
feeds every block a contiguous tensor), so 30 blocks do not mean 30 compiles.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_adaptiveload.models import attention as _attention

__all__ = [
    "MAX_GRAPHS_PER_MODE",
    "checkpoint_blocks_for_budget",
    "compile_blocks",
    "repeated_blocks",
    "set_attention_backend",
]

MAX_GRAPHS_PER_MODE = 2

# Our names -> diffusers' AttentionBackendName values (diffusers >= 0.35).
_DIFFUSERS_BACKENDS = {
    "cudnn": "_native_cudnn",
    "flash": "_native_flash",
    "efficient": "_native_efficient",
    "math": "_native_math",
    "default": "native",
}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated transformer blocks: diffusers' declared ``_repeated_blocks`` class names if any,
    else the children of the longest ``nn.ModuleList`` whose entries all have one class."""
    names = getattr(model, "_repeated_blocks", None) or []
    if names:
        found = [m for m in model.modules() if type(m).__name__ in set(names)]
        if found:
            return found
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def compile_blocks(
    model: nn.Module,
    blocks: Iterable[nn.Module] | None = None,
    *,
    dynamic: bool | None = True,
    fullgraph: bool = True,
    mode: str | None = None,
    backend: str = "inductor",
) -> int:
    """``torch.compile`` each repeated block of ``model`` in place (``nn.Module.compile``).

    Args:
        model: any ``nn.Module`` with repeated blocks (see :func:`repeated_blocks`).
        blocks: the blocks to compile instead of the detected ones.
        dynamic: passed to ``torch.compile``; True (symbolic sizes from the first call) bounds the graphs
            across a length mix; None compiles the first shape statically, then switches.
        fullgraph: fail on a graph break instead of splitting the block (a break would leave the fused op's
            neighbours uncompiled and cost a Python round trip per block).
        mode: ``torch.compile`` mode (None: default; ``"max-autotune-no-cudagraphs"`` searches matmul
            configurations at much longer compile time).
        backend: ``torch.compile`` backend (``"aot_eager"`` traces without generating kernels: tests).

    Returns:
        The number of blocks compiled.

    Raises:
        ValueError: no repeated blocks found.
    """
    chosen = list(blocks) if blocks is not None else repeated_blocks(model)
    if not chosen:
        raise ValueError(
            f"compile_blocks: found no repeated blocks in {type(model).__name__} (no nn.ModuleList of one "
            "block class, no _repeated_blocks); pass blocks=... explicitly"
        )
    for block in chosen:
        block.compile(dynamic=dynamic, fullgraph=fullgraph, mode=mode, backend=backend)
    return len(chosen)


def set_attention_backend(
    model: nn.Module, name: str = "auto", device: torch.device | str | None = None
) -> str:
    """Select the attention kernels of ``model``; returns the backend name actually set.

    Args:
        model: our ``VideoDiT`` (anything with ``set_attention_backend`` taking our names) or a diffusers
            ``ModelMixin`` (``WanTransformer3DModel`` ...).
        name: one of :data:`lightning_adaptiveload.models.attention.ATTENTION_BACKENDS`.
        device: for ``"auto"`` on a diffusers model: the device whose capability decides (default: the
            model's parameters' device).

    Raises:
        ValueError: unknown name, or a model with no attention-backend setting.
    """
    _attention.resolve_attention_backends(name)
    is_diffusers = type(model).__module__.startswith("diffusers.")
    if not is_diffusers and hasattr(model, "set_attention_backend"):
        model.set_attention_backend(name)
        return name
    if not hasattr(model, "set_attention_backend"):
        raise ValueError(
            f"{type(model).__name__} has no set_attention_backend; wrap its attention calls in "
            "lightning_adaptiveload.models.attention.sdpa(..., backends=resolve_attention_backends(name))"
        )
    if name == "auto":
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        order = _attention.resolve_attention_backends("auto", dev)
        name = (
            "default"
            if order is None
            else {
                torch.nn.attention.SDPBackend.CUDNN_ATTENTION: "cudnn",
                torch.nn.attention.SDPBackend.FLASH_ATTENTION: "flash",
            }.get(order[0], "default")
        )
    diffusers_name = _DIFFUSERS_BACKENDS[name]
    model.set_attention_backend(diffusers_name)
    return diffusers_name


def checkpoint_blocks_for_budget(
    num_blocks: int, tokens: int, budget_bytes: float, peak_all_bytes: float, peak_none_bytes: float
) -> int:
    """The fewest blocks to checkpoint so that a batch of ``tokens`` fits ``budget_bytes``.

    From two memory probes at that token count: ``peak_all_bytes`` with every block checkpointed and
    ``peak_none_bytes`` with none. Each block left un-checkpointed adds the same share of the difference
    (blocks of one model keep the same activations), so the peak with k checkpointed blocks is
    ``peak_all + (num_blocks - k) / num_blocks * (peak_none - peak_all)``.

    Args:
        num_blocks: blocks in the model.
        tokens: tokens of the probed batch (for the error message only).
        budget_bytes: memory the step may use.
        peak_all_bytes, peak_none_bytes: the two probes' peak allocated bytes.

    Returns:
        k in [0, num_blocks], for ``VideoDiT.set_activation_checkpointing(True, policy, num_blocks=k)``.

    Raises:
        ValueError: even checkpointing every block does not fit.
    """
    if peak_all_bytes > budget_bytes:
        raise ValueError(
            f"a batch of {tokens} tokens needs {peak_all_bytes / 2**30:.1f} GiB with every block checkpointed, "
            f"over the budget of {budget_bytes / 2**30:.1f} GiB; lower max_tokens"
        )
    per_block = max(peak_none_bytes - peak_all_bytes, 0.0) / num_blocks
    if per_block == 0.0:
        return 0
    free_blocks = int((budget_bytes - peak_all_bytes) // per_block)
    return max(0, num_blocks - free_blocks)

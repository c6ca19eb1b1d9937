"""Step-speed switches that work on our ``VideoDiT`` and on users' own DiTs (diffusers' Wan included).

- :func:`compile_blocks`: regional ``torch.compile`` of a model's repeated blocks. One graph serves every
  block (parameters are graph inputs), compile time is that of one block rather than the whole model,
  and the parts that change with the input's shape (RoPE tables, patchify) stay eager. Inductor's mix-order
  reductions are turned off (``safe_reductions``): with torch 2.10 and 2.11 they gave adaLN blocks wrong
  modulation gradients (pytorch/pytorch#193061; ``docs/lab_notebook.md``). The fused
  ``layer_norm_modulate`` op is a ``torch.library`` custom op, so it stays one node in the graph; but
  inductor cannot fuse the gated residual before it into it, and unfused it fuses LayerNorm, modulation and
  residual itself: on an H100, wan-1.3b's clip step is 1.2% faster with our op off inside compiled blocks
  (``docs/lab_notebook.md``). :func:`compile_blocks` logs this when it finds fused sites.
- :func:`set_attention_backend`: the attention-kernel switch. On our model it sets the SDPA kernel order
  (:mod:`lightning_adaptiveload.models.attention`); on a diffusers model it uses diffusers' own setting
  (``ModelMixin.set_attention_backend``) with the matching name.

Recompiles: :func:`compile_blocks` compiles with symbolic sizes (``dynamic=True``) from the first call, so
one graph serves every sequence length and batch size, except that PyTorch specialises a size of 1 apart
from the others: a mix with B = 1 and B > 1 batches compiles two graphs per block mode
(:data:`MAX_GRAPHS_PER_MODE`, checked in ``tests/models/test_acceleration.py``). A mode is one combination of
train/eval, text/no text and checkpoint policy. With ``dynamic=None`` the first shape gets a static graph
of its own (three at most). Every block shares the graph (parameters are graph inputs, and the model
feeds every block a contiguous tensor), so 30 blocks do not mean 30 compiles.

That bound holds for the traced graph (the CPU tests use the ``aot_eager`` backend). Inductor, generating
GPU kernels, adds guards on the symbolic sizes of its own: 32-bit indexing (``4096 <= S``), alignment
(``S % 8 == 0``) and fusion-size thresholds (``1536*S*B >= 5242880``). A length mix then compiles more
graphs per mode: 8 (cuDNN attention) and 9 (FlashAttention-4) over the 12 shapes of a wan21_480p epoch on
an H100 (``docs/lab_notebook.md``), while PyTorch's default recompile limit is 8 and, with
``fullgraph=True``, the ninth raises ``FailOnRecompileLimitHit`` in the middle of training.
:func:`compile_blocks` therefore raises ``torch._dynamo.config.recompile_limit`` to at least
:data:`RECOMPILE_LIMIT` (never lowers it) and logs when it does.

Packs (``VideoDiT``'s list input): a pack of equal token counts calls its blocks as a batch does (the same
graphs); a mixed pack calls them with ``segments=`` (one more graph per mode), whose offsets and segment ids
are tensors and whose longest sample is a symbolic int, so that the pack's composition, which changes at
every step, compiles nothing new: over 12 packs of different compositions the tiny model compiles 3 graphs
(``tests/models/test_packing_compile.py``). :func:`compile_blocks` counts the graphs
(:func:`compiled_graphs`) and logs every new one with the input that made it (:class:`GraphLog`, a forward
hook on the model).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_adaptiveload.models import attention as _attention
from lightning_adaptiveload.models.memory import ActivationMemory, MemoryPoint, blocks_to_checkpoint

_log = logging.getLogger(__name__)

__all__ = [
    "MAX_GRAPHS_PER_MODE",
    "GraphLog",
    "RECOMPILE_LIMIT",
    "checkpoint_blocks_for_budget",
    "compile_blocks",
    "compile_whole",
    "compiled_graphs",
    "cuda_step_peak",
    "ensure_recompile_limit",
    "probe_activation_memory",
    "repeated_blocks",
    "set_attention_backend",
]

MAX_GRAPHS_PER_MODE = 2
#: The recompile limit :func:`compile_blocks` ensures for the shared block graph (see the module docstring):
#: room for inductor's size guards over a length mix, several checkpoint modes and train/eval.
RECOMPILE_LIMIT = 64

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
    options: dict | None = None,
    safe_reductions: bool = True,
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
        options: inductor settings for these blocks only (``torch.compile(options=...)``, e.g.
            ``{"triton.tile_reductions": True}``); combined with ``mode``'s own settings.
        safe_reductions: turn inductor's mix-order reductions off (:data:`SAFE_REDUCTIONS`): with them,
            torch 2.10 and 2.11 give wrong gradients to the slices of a shared modulation table in adaLN
            blocks (pytorch/pytorch#193061). ``options`` may turn them back on.

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
    fused = sum(getattr(m, "fused", False) is True for block in chosen for m in block.modules())
    if fused:
        _log.info(
            "compile_blocks: %d norm-modulate sites use the fused op; inside compiled blocks inductor fuses "
            "them with the gated residual when they are left unfused (wan-1.3b on an H100: 1.2%% faster per "
            "step, docs/lab_notebook.md)",
            fused,
        )
    ensure_recompile_limit(RECOMPILE_LIMIT)
    mode, options = _inductor_settings(backend, mode, options, safe_reductions)
    for block in chosen:
        block.compile(dynamic=dynamic, fullgraph=fullgraph, mode=mode, backend=backend, options=options)
    if not isinstance(getattr(model, "graph_log", None), GraphLog) and all(model is not b for b in chosen):
        model.graph_log = GraphLog()
        model.register_forward_hook(model.graph_log, with_kwargs=True)
    return len(chosen)


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has made in this process so far (dynamo's ``unique_graphs`` counter: one per
    compile or recompile of a frame, whatever module it belongs to)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _describe_input(args: tuple, kwargs: dict) -> str:
    """A short description of a forward's first argument: a batch's shape, or a pack's size and route."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)) and first and all(isinstance(x, torch.Tensor) for x in first):
        shapes = {tuple(x.shape) for x in first}
        n, k = len(first), len(shapes)
        return f"pack of {n} sample{'s' * (n > 1)} ({k} shape{'s' * (k > 1)})"
    if isinstance(first, torch.Tensor):
        return f"batch {tuple(first.shape)}"
    return type(first).__name__


class GraphLog:
    """A forward hook that logs each new compiled graph with the input that made it.

    :func:`compile_blocks` registers one on the model (``model.graph_log``). After every forward it compares
    :func:`compiled_graphs` with the last count (one dictionary read) and, when it grew, logs one INFO line
    (logger ``lightning_adaptiveload.models.acceleration``) and appends ``(graphs, input)`` to ``events``.
    The counter is process-wide: a graph compiled elsewhere between two forwards is attributed to the next.

    Attributes:
        graphs: the count after the last forward.
        events: ``(count, description)`` of every forward that compiled.
    """

    def __init__(self) -> None:
        self.graphs = compiled_graphs()
        self.events: list[tuple[int, str]] = []

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        now = compiled_graphs()
        if now == self.graphs:
            return
        what = _describe_input(args, kwargs)
        _log.info(
            "compiled %d new graph(s) for a %s of %s; %d in this process",
            now - self.graphs,
            what,
            type(module).__name__,
            now,
        )
        self.events.append((now, what))
        self.graphs = now


# Inductor's mix-order reductions (a row and a column reduction of one tensor in one kernel; on by default
# since torch 2.10) dropped the writes of some gradients into a shared buffer: pytorch/pytorch#193061, fixed
# by #193103. Hit: the slices of one modulation table in chained adaLN norms (diffusers' Wan
# scale_shift_table at any batch size; per-sample adaLN at batch 1). We measured it with torch 2.11 on an
# H100: a compiled wan-1.3b block at one 32,760-token clip got modulation gradients 1.2 (relative) away from
# eager mode's (docs/lab_notebook.md); with this setting, 3.3e-3, and the clip step as fast.
SAFE_REDUCTIONS = {"triton.mix_order_reduction": False}


def _inductor_settings(
    backend: str, mode: str | None, options: dict | None, safe_reductions: bool
) -> tuple[str | None, dict | None]:
    """(mode, options) for ``torch.compile``: with ``safe_reductions`` (inductor only, where the setting
    exists) :data:`SAFE_REDUCTIONS` joins the options, and a mode is passed as its options (``torch.compile``
    takes one or the other); the caller's own options win."""
    import torch._inductor.config as inductor_config

    if (
        not safe_reductions
        or backend != "inductor"
        or not hasattr(inductor_config.triton, "mix_order_reduction")
    ):
        return mode, options
    merged = dict(torch._inductor.list_mode_options(mode)) if mode is not None else {}
    merged.update(SAFE_REDUCTIONS)
    merged.update(options or {})
    return None, merged


def ensure_recompile_limit(limit: int) -> int:
    """Raise dynamo's per-code-object recompile limit to at least ``limit`` (never lower it); returns the
    limit in force. One INFO line when it changes."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    current = getattr(dynamo_config, name)
    if current < limit:
        setattr(dynamo_config, name, limit)
        _log.info(
            "compile_blocks: torch._dynamo.config.%s %d -> %d (inductor's size guards compile more than "
            "one graph per block mode over a length mix; see lightning_adaptiveload.models.acceleration)",
            name,
            current,
            limit,
        )
        return limit
    return current


_REGIONS: dict[type, Callable] = {}


def _region_forward(cls: type) -> Callable:
    """``cls.forward`` marked as a nested compile region (one marked function per block class)."""
    if cls not in _REGIONS:

        def forward(self, *args, **kwargs):
            return cls.forward(self, *args, **kwargs)

        _REGIONS[cls] = torch.compiler.nested_compile_region(forward)
    return _REGIONS[cls]


def compile_whole(
    model: nn.Module,
    blocks: Iterable[nn.Module] | None = None,
    *,
    mode: str | None = None,
    dynamic: bool | None = False,
    backend: str = "inductor",
    safe_reductions: bool = True,
) -> Callable:
    """``torch.compile`` the whole forward, each repeated block traced once (a nested compile region).

    With ``mode="reduce-overhead"`` the forward (embeddings, every block, the head) is one CUDA graph and its
    backward another, so a small step (one image) launches two graphs instead of a kernel at a time or a
    graph per block. Marking the blocks as ``torch.compiler.nested_compile_region`` keeps compile time
    near one block's: without it the 30 blocks are inlined and compiled as one long graph.

    Args:
        model: any ``nn.Module`` with repeated blocks (see :func:`repeated_blocks`).
        blocks: the blocks to mark instead of the detected ones.
        mode, dynamic, backend: passed to ``torch.compile`` (``dynamic=False``: one graph per shape, as CUDA
            graphs need fixed shapes anyway).
        safe_reductions: as in :func:`compile_blocks`.

    Returns:
        The compiled callable (call it like the model); the model's own ``forward`` stays eager.

    Raises:
        ValueError: no repeated blocks found.
    """
    chosen = list(blocks) if blocks is not None else repeated_blocks(model)
    if not chosen:
        raise ValueError(f"compile_whole: found no repeated blocks in {type(model).__name__}")
    for block in chosen:
        # The block goes in as an argument of the region (its parameters become the region's inputs); a
        # method bound to it would make dynamo reuse the first block's weights for every block.
        block.forward = functools.partial(_region_forward(type(block)), block)
    mode, options = _inductor_settings(backend, mode, None, safe_reductions)
    return torch.compile(model, mode=mode, dynamic=dynamic, backend=backend, options=options)


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
    if name in ("auto", "fa4", "fa3"):
        # Resolved for the device: "fa4"/"fa3" route PyTorch's FlashAttention backend to that implementation
        # (process-wide) and pick diffusers' "_native_flash", or fall back as "auto" does.
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        order = _attention.resolve_attention_backends(name, dev)
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


def use_expandable_segments() -> str:
    """Turn on the CUDA caching allocator's expandable segments for the rest of the process.

    A length mix allocates activations of changing sizes at every step; with fixed segments the cache
    fragments until a step that fits in the free total still fails or stalls on ``cudaMalloc`` retries.
    Expandable segments grow one mapping instead (PyTorch's ``expandable_segments:True``). This is the
    setting the fast DDP runs used (through ``PYTORCH_CUDA_ALLOC_CONF``), applied from a recipe:
    segments made before the call stay as they were.

    Returns:
        What was done, for the log: ``"on"``, or why not (no CUDA; ``PYTORCH_CUDA_ALLOC_CONF`` already names
        ``expandable_segments``, which then decides; this PyTorch has no runtime setting).
    """
    import os

    if not torch.cuda.is_available():
        return "not applied: no CUDA"
    env = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in env:
        return f"not applied: the environment decides (PYTORCH_CUDA_ALLOC_CONF={env!r})"
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return "not applied: this PyTorch has no torch.cuda.memory._set_allocator_settings"
    setter("expandable_segments:True")
    return "on"


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
    per_block = max(peak_none_bytes - peak_all_bytes, 0.0) / num_blocks
    try:
        return blocks_to_checkpoint(num_blocks, budget_bytes - peak_all_bytes, per_block)
    except ValueError:
        raise ValueError(
            f"a batch of {tokens} tokens needs {peak_all_bytes / 2**30:.1f} GiB with every block checkpointed, "
            f"over the budget of {budget_bytes / 2**30:.1f} GiB; lower max_tokens"
        ) from None


def cuda_step_peak(step: Callable[[tuple[int, ...], int], None]) -> Callable[[tuple[int, ...], int], float]:
    """``peak_of`` for :func:`probe_activation_memory` from a training step on CUDA: the allocator's peak
    bytes while ``step(latent_shape, text_len)`` runs (forward, backward, optimizer, zero grad)."""

    def peak_of(shape: tuple[int, ...], text_len: int) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(shape, text_len)
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated())

    return peak_of


def probe_activation_memory(
    model: nn.Module,
    peak_of: Callable[[tuple[int, ...], int], float],
    batches: Sequence[tuple[tuple[int, ...], int]],
    policy: str = "save_attention",
    counts: Sequence[int] | None = None,
) -> tuple[ActivationMemory, list[MemoryPoint]]:
    """Measure training steps and fit the :class:`~lightning_adaptiveload.models.memory.ActivationMemory`
    that ``VideoDiT.set_activation_checkpointing(num_blocks="auto")`` chooses with.

    Args:
        model: a ``VideoDiT`` (``set_activation_checkpointing``, ``blocks``, ``config.patch_size``).
        peak_of: ``peak_of(latent_shape, text_len)``: the peak bytes of one training step on a batch of that
            (B, C, T, H, W) latent shape with ``text_len`` text tokens per sample, raising
            ``torch.OutOfMemoryError`` when it does not fit; :func:`cuda_step_peak` makes one from a step.
            Run one step before probing, so that the optimizer state exists (it is part of the peak).
        batches: the (latent shape, text length) pairs to measure; at least one long clip (B = 1), one
            batch of many short samples (images) and one smaller batch, so that the fit separates the terms.
        policy: the checkpoint policy the model will train with.
        counts: checkpointed-block counts to measure each batch at (default: all blocks and half of them).
            A count that runs out of memory is retried halfway between it and all blocks.

    Returns:
        (the fitted model, the measured points); the model's checkpointing is restored afterwards.
    """
    blocks = list(model.blocks)
    n = len(blocks)
    saved = [b.checkpoint_policy for b in blocks]
    saved_auto = getattr(model, "_auto_checkpointing", None)
    counts = list(counts) if counts is not None else [n, n // 2]
    pt, ph, pw = model.config.patch_size
    points = []
    try:
        for shape, text in batches:
            b, _, t, h, w = shape
            seq = (t // pt) * (h // ph) * (w // pw)
            for k in counts:
                while True:
                    model.set_activation_checkpointing(True, policy, k)
                    try:
                        peak = peak_of(shape, text)
                    except torch.OutOfMemoryError:
                        # Too few checkpointed blocks for this batch: retry halfway to all of them.
                        model.zero_grad(set_to_none=True)
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                        if k >= n:
                            raise
                        k = (k + n + 1) // 2
                        continue
                    points.append(MemoryPoint(b, seq, text, k, peak))
                    break
    finally:
        for block, p in zip(blocks, saved, strict=True):
            block.checkpoint_policy = p
        if saved_auto is not None:
            model._auto_checkpointing = saved_auto
    return ActivationMemory.fit(n, points), points

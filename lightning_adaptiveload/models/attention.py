"""Which attention kernel runs: a per-device choice of PyTorch's SDPA backends, with a fallback and a log line.

At 32k tokens attention is about 70% of a Wan 1.3B step's FLOPs, so the kernel decides most of the step.
PyTorch's ``scaled_dot_product_attention`` dispatches to one of four kernels (cuDNN, FlashAttention-2,
memory-efficient, math); this module turns a name into an ordered list of them and runs SDPA under
``torch.nn.attention.sdpa_kernel(..., set_priority=True)``, so the first kernel that accepts the inputs
runs and the others remain as fallbacks (math always accepts). The list is the same in the forward and in
an activation-checkpoint recompute, which must pick the same kernel (their saved tensors differ).

Names (``attention_backend`` of :class:`~lightning_adaptiveload.models.VideoDiT` and of the module):

- ``"default"`` (the model's default): PyTorch's own choice, no context manager. On the measured H100
  (torch 2.11) that already ran cuDNN attention for Wan's head dim 128.
- ``"auto"``: cuDNN first on Hopper and newer (compute capability >= 9.0; cuDNN's Hopper kernels use
  wgmma and TMA, FlashAttention-2 does not), FlashAttention-2 first on older GPUs; elsewhere PyTorch's own
  order.
- ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``: that kernel first, the others after it.

Measured on one H100 (``benchmarks/results/bench_step_*``): one clip's self-attention forward + backward
(1 x 12 x 32760 x 128, bf16) takes 40.4 ms on cuDNN (572 TFLOP/s), 69.8 ms on FlashAttention-2 and 165 ms
on the memory-efficient kernel. An explicit list enters ``sdpa_kernel`` at every call in eager mode (under
``torch.compile`` it is resolved while tracing, at no cost per call); an eager step with it was slower on
the host (see ``docs/performance.md``), which is why the model's default is ``"default"``.

FlashAttention-3/4 plug in underneath the ``"flash"`` backend through ``torch.nn.attention``'s registry
(``activate_flash_attention_impl("FA3")``) when their packages are installed; :func:`activate_flash_impl`
does that and says why not when it cannot.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "ATTENTION_BACKENDS",
    "activate_flash_impl",
    "attention_kernel_name",
    "resolve_attention_backends",
    "sdpa",
]

log = logging.getLogger(__name__)

_KERNELS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_LABELS = {
    SDPBackend.CUDNN_ATTENTION: "cuDNN attention",
    SDPBackend.FLASH_ATTENTION: "FlashAttention",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient attention",
    SDPBackend.MATH: "math (unfused) attention",
}
ATTENTION_BACKENDS = ("auto", "default", *_KERNELS)


def resolve_attention_backends(
    name: str, device: torch.device | str | None = None
) -> list[SDPBackend] | None:
    """The SDPA kernels to allow, in priority order, for ``name`` on ``device``.

    Args:
        name: one of :data:`ATTENTION_BACKENDS`.
        device: where attention runs; only its type and (CUDA) compute capability matter.

    Returns:
        A list of ``SDPBackend`` for ``sdpa_kernel(..., set_priority=True)``, always ending in ``MATH`` so
        that any input runs; or None for PyTorch's own choice (``"default"``, and ``"auto"`` off CUDA).

    Raises:
        ValueError: unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
    device = torch.device(device) if device is not None else None
    if name == "default":
        return None
    if name == "auto":
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        major, _ = torch.cuda.get_device_capability(device)
        first = "cudnn" if major >= 9 else "flash"
    else:
        first = name
    order = [first] + [k for k in ("cudnn", "flash", "efficient", "math") if k != first]
    return [_KERNELS[k] for k in order]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    backends: list[SDPBackend] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to ``backends`` (in that priority), or unrestricted.

    Args:
        q: (B, H, S, d); k, v: (B, H, L, d); attn_mask: broadcastable to (B, H, S, L) bool, or None.
        backends: from :func:`resolve_attention_backends`; None for PyTorch's own choice.

    Returns:
        (B, H, S, d) in q's dtype.
    """
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def attention_kernel_name(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    backends: list[SDPBackend] | None = None,
) -> str:
    """Name of the kernel SDPA will run for these inputs: the first of ``backends`` that accepts them.

    Uses PyTorch's own admission checks (``torch.backends.cuda.can_use_*``), the ones SDPA applies, so the
    name is the kernel that runs, not the one asked for. Off CUDA it reports PyTorch's CPU path.
    """
    if q.device.type != "cuda":
        return f"PyTorch SDPA on {q.device.type}"
    order = backends or [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ]
    params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, 0.0, False, False)
    checks = {  # PyTorch's own admission checks, the ones SDPA applies
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention,
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
    }
    if backends is None:
        # PyTorch's own order depends on the GPU and version (on an H100 with torch 2.11 it ran cuDNN, seen in
        # a profile); name what is admissible rather than guess.
        ok = [_LABELS[b] for b in order if checks[b](params, False)]
        return "PyTorch's own choice among " + (", ".join(ok) if ok else _LABELS[SDPBackend.MATH])
    for backend in order:
        if backend == SDPBackend.MATH:
            return _LABELS[backend]
        check = checks.get(backend)
        if check is not None and check(params, False):
            label = _LABELS[backend]
            if backend == SDPBackend.FLASH_ATTENTION:
                impl = (
                    torch.nn.attention.current_flash_attention_impl()
                    if hasattr(torch.nn.attention, "current_flash_attention_impl")
                    else None
                )
                label += f" ({impl or 'FA2, built into PyTorch'})"
            return label
    return _LABELS[SDPBackend.MATH]


def activate_flash_impl(impl: str = "FA3") -> tuple[bool, str]:
    """Route PyTorch's FlashAttention backend to FlashAttention-3 or -4 if its package is installed.

    Returns:
        ``(True, impl)`` or ``(False, why)``; never raises, so callers can fall back to the built-in kernels.
    """
    activate = getattr(torch.nn.attention, "activate_flash_attention_impl", None)
    if activate is None:
        return False, f"torch {torch.__version__} has no flash attention registry"
    try:
        activate(impl)
    except Exception as err:  # a missing package or an unsupported GPU: both mean "use what is built in"
        return False, f"{impl} unavailable: {type(err).__name__}: {err}"
    return True, impl


def log_attention_kernel(where: str, kernel: str) -> None:
    """One INFO line naming the kernel that runs (called once per model and input layout)."""
    log.info("%s: attention runs on %s", where, kernel)

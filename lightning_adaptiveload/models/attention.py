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
- ``"auto"``: on compute capability 9.x and 10.x with flash-attn-4 installed, FlashAttention-4 (as
  ``"fa4"`` below); otherwise cuDNN first on Hopper and newer (cuDNN's Hopper kernels use wgmma and TMA,
  FlashAttention-2 does not) and FlashAttention-2 first on older GPUs; off CUDA, PyTorch's own order.
- ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``: that kernel first, the others after it.
- ``"fa4"``, ``"fa3"``: FlashAttention-4 (``flash-attn-4``, CuTe DSL; compute capability 9.x and 10.x) or
  FlashAttention-3 (``flash-attn-3``; 9.x only) routed under PyTorch's FlashAttention backend through
  ``torch.nn.attention.activate_flash_attention_impl``, then that backend first and cuDNN, the
  memory-efficient kernel and math as fallbacks. The routing is process-wide: from then on every
  FlashAttention call of the process runs the new kernels (PyTorch's registry has no per-call switch).
  Where the package is missing, the GPU is not supported or torch has no registry, a WARNING says why,
  once, and ``"auto"``'s order is used instead.

Measured on one H100 (``benchmarks/results/bench_step_*``, ``bench_attention_*``): one clip's self-attention
forward + backward (1 x 12 x 32760 x 128, bf16) takes 37.6 ms on FlashAttention-4 through this switch
(614 TFLOP/s), 42.6 ms on cuDNN (542), 69.8 ms on FlashAttention-2 and 165 ms on the memory-efficient
kernel; wan-1.3b's compiled clip step is 11% faster with FlashAttention-4 than with cuDNN
(``docs/lab_notebook.md``). An explicit list enters ``sdpa_kernel`` at every call in eager
mode (under ``torch.compile`` it is resolved while tracing, at no cost per call); an eager step with it was
slower on the host (see ``docs/lab_notebook.md``), which is why the model's default is ``"default"``.

The cross-attention of one long sample to a short text has too little parallel work in the kernels'
backward (one thread block per head and block of 128 keys); :func:`sdpa_split_queries` cuts the queries into
``splits`` samples that share the keys (the same result) and :func:`query_splits` picks the count for a GPU.
:class:`~lightning_adaptiveload.models.VideoDiT` does it for batches of one sample on CUDA (8 for wan-1.3b on
an H100: the clip's cross-attention backward 28 -> 13.4 ms per step; ``docs/lab_notebook.md``).

FlashAttention-3/4 plug in underneath the ``"flash"`` backend through ``torch.nn.attention``'s registry
when their packages are installed; :func:`activate_flash_impl` does that and says why not when it cannot.
For FA4 it registers :mod:`._fa4_adapter`, which returns what torch's FA4 dispatcher code unpacks: torch
2.11's expects two values from flash-attn-4's forward, and 4.0.0b36 returns five ("too many values to
unpack" inside every attention call otherwise). Install it with ``pip install
"lightning-adaptiveload[fa4]"`` (``flash-attn-4`` with ``nvidia-cutlass-dsl``, about 270 MB unpacked; with a
CUDA 13 torch also ``"nvidia-cutlass-dsl[cu13]"``).
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
    "fa4_installed",
    "flash_impl_ready",
    "log_kernel_once",
    "query_splits",
    "resolve_attention_backends",
    "sdpa",
    "sdpa_split_queries",
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
# FlashAttention implementations that PyTorch's registry can route its FlashAttention backend to, with the
# compute-capability majors each supports.
_FLASH_IMPLS = {"fa4": ("FA4", (9, 10)), "fa3": ("FA3", (9,))}
ATTENTION_BACKENDS = ("auto", "default", *_KERNELS, *_FLASH_IMPLS)


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
    if name in _FLASH_IMPLS:
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        ok, _ = flash_impl_ready(name, device)
        name = "flash" if ok else "auto"
    if name == "auto":
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        major, _ = torch.cuda.get_device_capability(device)
        if major in _FLASH_IMPLS["fa4"][1] and fa4_installed() and flash_impl_ready("fa4", device)[0]:
            first = "flash"  # FlashAttention-4, installed and routed: the fastest measured on Hopper
        else:
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


# Query splits of a single sample's cross-attention (sdpa_split_queries): enough that the backward's thread
# blocks (heads x blocks of 128 keys x splits) fill the GPU's SMs SPLIT_WAVES times over, at most SPLIT_MAX.
# Measured in benchmarks/model/bench_attention.py --splits on an H100 (docs/lab_notebook.md).
SPLIT_WAVES = 3
SPLIT_MAX = 16


def query_splits(device: torch.device | str, heads: int, keys: int = 512) -> int:
    """The query splits for one long sample's cross-attention with ``heads`` heads to ``keys`` keys on
    ``device`` (1 off CUDA): see :func:`sdpa_split_queries`."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = heads * max(1, -(-int(keys) // 128))
    return max(1, min(SPLIT_MAX, round(SPLIT_WAVES * sms / blocks)))


def sdpa_split_queries(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    backends: list[SDPBackend] | None = None,
    splits: int = 1,
) -> torch.Tensor:
    """:func:`sdpa` with the queries cut into ``splits`` equal chunks, each attending to all the keys as a
    sample of its own: the same result (softmax runs over the keys, per query), more parallel work.

    FlashAttention's and cuDNN's backward passes give one thread block to each (sample, head, block of 128
    keys) and loop over all the queries in it. Cross-attention from 32,760 video tokens to 512 text tokens
    then has 4 x 12 = 48 blocks for one sample, a third of an H100's SMs. Cut into ``splits`` samples (the
    keys and values repeated, their gradients summed back by autograd), the backward has ``splits`` times
    as many blocks. The queries are zero-padded to a multiple of ``splits`` and the padding dropped after
    (under ``torch.compile`` always, so that the length needs no guard).

    Args:
        q: (B, H, S, d); k, v: (B, H, L, d); attn_mask: None, or a mask over the keys that does not vary
            over the queries: (B or 1, H or 1, 1, L), or fewer leading dimensions (taken as 1).
        backends: as for :func:`sdpa`.
        splits: chunks per sample; 1 is :func:`sdpa` itself.

    Returns:
        (B, H, S, d) in q's dtype.
    """
    if splits <= 1:
        return sdpa(q, k, v, attn_mask, backends)
    if attn_mask is not None:
        if attn_mask.dim() > 4:
            raise ValueError(f"sdpa_split_queries: the mask has {attn_mask.dim()} dimensions, at most 4")
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if attn_mask.shape[-2] != 1:
            raise ValueError(
                "sdpa_split_queries: a mask must not vary over the queries (its dimension -2 is 1)"
            )
    b, h, s, d = q.shape
    pad = (-s) % splits
    qs = q.transpose(1, 2)  # (B, S, H, d)
    # Under torch.compile padded even where nothing is missing: a branch on the length would be a recompile.
    if torch.compiler.is_compiling() or pad:
        qs = F.pad(qs, (0, 0, 0, 0, 0, pad))
    qs = qs.reshape(b * splits, (s + pad) // splits, h, d).transpose(1, 2)

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(1).expand(t.shape[0], splits, *t.shape[1:]).flatten(0, 1)

    mask = None if attn_mask is None else repeat(attn_mask.expand(b, *attn_mask.shape[1:]))
    out = sdpa(qs, repeat(k), repeat(v), mask, backends)  # (B * splits, H, S' / splits, d)
    return out.transpose(1, 2).reshape(b, s + pad, h, d)[:, :s].transpose(1, 2)


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


_FA4_ADAPTER = "lightning_adaptiveload.models._fa4_adapter"


def _register_fa4_adapter() -> None:
    """Point PyTorch's FA4 registry entry at :mod:`._fa4_adapter` (flash-attn-4's kernels with the return
    values torch's dispatcher code unpacks). Raises ImportError without flash-attn-4."""
    import functools
    import importlib

    from torch.nn.attention import _fa4, _registry  # present wherever activate_flash_attention_impl is

    importlib.import_module("flash_attn.cute.interface")  # ImportError without flash-attn-4
    _registry.register_flash_attention_impl(
        "FA4", register_fn=functools.partial(_fa4.register_flash_attention_fa4, module_path=_FA4_ADAPTER)
    )


def activate_flash_impl(impl: str = "FA3") -> tuple[bool, str]:
    """Route PyTorch's FlashAttention backend to FlashAttention-3 or -4 if its package is installed.

    Returns:
        ``(True, impl)`` or ``(False, why)``; never raises, so callers can fall back to the built-in kernels.
    """
    activate = getattr(torch.nn.attention, "activate_flash_attention_impl", None)
    if activate is None:
        return False, f"torch {torch.__version__} has no flash attention registry"
    try:
        if impl == "FA4":
            _register_fa4_adapter()
        activate(impl)
    except Exception as err:  # a missing package or an unsupported GPU: both mean "use what is built in"
        return False, f"{impl} unavailable: {type(err).__name__}: {err}"
    return True, impl


_FLASH_READY: dict[tuple[str, int], tuple[bool, str]] = {}


def fa4_installed() -> bool:
    """Whether flash-attn-4 (the ``flash_attn.cute`` package) can be imported; imports nothing of it."""
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # no flash_attn at all, or a broken one
        return False


def flash_impl_ready(name: str, device: torch.device | str) -> tuple[bool, str]:
    """Route PyTorch's FlashAttention backend to ``name`` (``"fa4"`` or ``"fa3"``) for ``device``, once.

    Returns ``(True, impl)`` when the implementation is active, else ``(False, why)``; the first failure per
    (name, capability) logs one WARNING naming the reason and the fallback. Never raises.
    """
    impl, majors = _FLASH_IMPLS[name]
    device = torch.device(device)
    major, minor = torch.cuda.get_device_capability(device)
    key = (name, major)
    if key not in _FLASH_READY:
        current = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
        if major not in majors:
            result = (False, f"{impl} supports compute capability {majors}, this GPU is {major}.{minor}")
        elif current is not None and current != impl:
            result = (False, f"the process already routes FlashAttention to {current}")
        elif current == impl:
            result = (True, impl)
        else:
            result = activate_flash_impl(impl)
        if not result[0]:
            log.warning(
                "attention_backend=%r: %s; using the 'auto' order instead (cuDNN first on Hopper and newer)",
                name,
                result[1],
            )
        _FLASH_READY[key] = result
    return _FLASH_READY[key]


_logged_kernels: set[tuple] = set()


def log_kernel_once(where: str, q, k, v, mask, backends) -> None:
    """One INFO line naming the kernel that runs, once per input layout (device, dtype, head dim, mask or
    not, backend list), not per call."""
    key = (where, q.device.type, q.dtype, q.shape[-1], mask is None, tuple(backends or ()))
    if key in _logged_kernels:
        return
    _logged_kernels.add(key)
    try:
        name = attention_kernel_name(q, k, v, mask, backends)
    except Exception as err:  # a log line must never stop training (the checks' API moves between versions)
        name = f"unknown ({type(err).__name__}: {err})"
    log.info("%s: attention runs on %s", where, name)

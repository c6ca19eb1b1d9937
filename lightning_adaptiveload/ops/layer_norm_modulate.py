"""LayerNorm followed by adaLN modulation: ``y = LN(x) * (1 + scale) + shift``.

This module also holds what :mod:`lightning_adaptiveload.ops.rms_norm_modulate` shares with it (the
layouts, the fallback, the library's loading and the eager fast path). Two implementations of one function:

- :func:`layer_norm_modulate_reference`: plain PyTorch, any device, differentiable by autograd.
- :func:`layer_norm_modulate`: the fused op. On CUDA it runs the kernels in ``csrc/`` (one pass over x
  forward, one pass over x and dy backward) through the custom operator
  ``torch.ops.lightning_adaptiveload.layer_norm_modulate``, in eager mode, under ``torch.compile`` (one
  node) and under activation checkpointing alike: one autograd path. Elsewhere, or where the kernels cannot
  serve the input, it runs the reference and warns once, saying why; with
  ``LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED=1`` that is an error instead.

The operator is registered like PyTorch's own extensions: the C++ library (``csrc/ln_modulate_binding.cpp``)
defines the schemas with ``TORCH_LIBRARY``, the CUDA kernels and the autograd formula (in C++, so that an
eager call pays no Python autograd machinery) with ``TORCH_LIBRARY_IMPL``; this module adds the fake (shape)
implementations and a plain-PyTorch implementation for every other device. The library is loaded when this
module is imported on a machine with a visible GPU (building it on the node's first use); without it (no GPU,
``LIGHTNING_ADAPTIVELOAD_FUSED=0``, a failed build) this module defines the same schemas itself and registers
the same autograd formula with ``torch.library.register_autograd``, so the operator exists everywhere.

Eager calls on CUDA whose argument shapes, dtypes and devices were seen before skip the input checks and
layout analysis: the library's fast path (``csrc/norm_mod_python.cpp``) remembers their outcome and sends
such a call from Python into C++ in one call: the tables viewed below autograd, the operator's CUDA kernel
and one graph node whose backward is the operator's formula, without the schema parsing of a ``torch.ops``
call. Tensor subclasses, torch-function modes, functorch transforms, ``torch.jit.trace`` and
``torch.compile`` take the checked path.

Modulation layouts (``shift`` and ``scale``; fp32 or x's dtype), for x of shape (..., D):

- per sample: (B, 1, D) or (B, D) for x (B, S, D) (Wan 2.1, DiT);
- per token: (B, S, D) for x (B, S, D) (Wan 2.2 TI2V);
- per frame: (B, F, 1, D) for x (B, F, L, D) (causal video and world models);
- generally any shape that broadcasts to x and varies only over a prefix of x's leading dims; each
  modulation row is then shared by a contiguous run of rows of x. A 2-D (B, D) modulation with x of 3 or
  more dims is always read as per sample.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lightning_adaptiveload.ops import _build

__all__ = ["layer_norm_modulate", "layer_norm_modulate_reference", "fused_op_status", "fused_op_paths"]

_NS = "lightning_adaptiveload"
_FWD = f"{_NS}::layer_norm_modulate"
_BWD = f"{_NS}::layer_norm_modulate_backward"
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_D = 16384
_REQUIRE_ENV = "LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED"

_warned: set[str] = set()
# Which implementation the public function has run in this process, with what: "fused" -> the library,
# "reference" -> the reason of the first fallback. Read by fused_op_paths() (the monitor's summary).
_paths: dict[str, str] = {}


def _record_path(path: str, detail: str) -> None:
    # A global write inside a traced region is a side effect torch.compile refuses under activation
    # checkpointing (its higher-order op): record the path from eager calls only; compiled code runs the same
    # path, and the first (eager or warm-up) call records it.
    if not torch.compiler.is_compiling():
        _paths.setdefault(path, detail)


def _warn_once(key: str, message: str) -> None:
    # warnings.warn would break a torch.compile graph; the eager call warns instead. stacklevel: the caller
    # of the public function (through _call and _fallback).
    if key in _warned or torch.compiler.is_compiling():
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=5)


# ---------------------------------------------------------------------------------------------------------
# Shapes


def _check_inputs(x, shift, scale, weight, bias, op: str = "layer_norm_modulate") -> None:
    # Plain shape arithmetic: this runs on every call it is not cached for, so it stays cheap.
    for name, t in (("x", x), ("shift", shift), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim (..., D), got a scalar")
    D = x.shape[-1]
    for name, t in (("shift", shift), ("scale", scale), ("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}; move both to one device")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (D,)):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must have shape ({D},) for x {tuple(x.shape)}, got {shape}")
    for name, t in (("shift", shift), ("scale", scale)):
        if t.dim() < 1 or t.shape[-1] != D:
            raise ValueError(
                f"{op}: {name} {tuple(t.shape)} must end in D = {D} like x {tuple(x.shape)}; "
                "layouts: per sample (B, 1, D) or (B, D), per token (B, S, D), per frame (B, F, 1, D)"
            )
        if t.dim() == 2 and x.dim() >= 3 and _differ(t.shape[0], 1) and _differ(t.shape[0], x.shape[0]):
            raise ValueError(
                f"{op}: {name} {tuple(t.shape)} is read as per sample (B, D) but x {tuple(x.shape)} "
                f"has B = {x.shape[0]}"
            )
        padded = _padded_shape(t, x)
        if len(padded) > x.dim() or any(_differ(m, 1) and _differ(m, n) for m, n in zip(padded, x.shape)):
            raise ValueError(
                f"{op}: {name} {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}; layouts: "
                "per sample (B, 1, D) or (B, D), per token (B, S, D), per frame (B, F, 1, D) for x (B, F, L, D)"
            )


def _differ(a, b) -> bool:
    """``a != b`` for sizes that may be symbolic (torch.compile with dynamic shapes).

    Inside a traced activation-checkpoint region, x and the modulation table carry separate symbols for
    the same batch size, and their equality cannot be guarded there; only a difference that is certain
    counts (eager sizes are plain ints, so eager checks are exact).
    """
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    return guard_or_false(a != b)


def _padded_shape(m: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:
    shape = tuple(m.shape)
    if m.dim() == 2 and x.dim() >= 3:  # (B, D): per sample
        shape = (shape[0],) + (1,) * (x.dim() - 2) + (shape[1],)
    return (1,) * (x.dim() - len(shape)) + shape


def _expand_modulation(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``m`` viewed with x's number of dims, ready to broadcast."""
    return m.reshape(_padded_shape(m, x))


def _as_groups(m: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Returns ``(table (M, D), group_size)`` when each row of ``m`` covers a contiguous run of x's rows.

    None when ``m`` broadcasts inside the prefix of x's dims it varies over (say (1, S, D) for x (B, S, D)),
    which the kernels do not read.
    """
    m = _expand_modulation(m, x)
    lead_m, lead_x = m.shape[:-1], x.shape[:-1]
    k = len(lead_m)
    # A leading size counts as broadcast only when it is certainly 1 (sizes may be symbolic under compile).
    while k > 0 and (
        lead_m[k - 1] == 1 if isinstance(lead_m[k - 1], int) else guard_or_false(lead_m[k - 1] == 1)
    ):
        k -= 1
    if any(_differ(lead_m[i], lead_x[i]) for i in range(k)):
        return None
    # The table's row count from m's own sizes (equal to x's leading sizes, see _differ).
    return m.reshape(-1, x.shape[-1]), math.prod(lead_x[k:])


# ---------------------------------------------------------------------------------------------------------
# Reference


def layer_norm_modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`layer_norm_modulate`: statistics and arithmetic in fp32 or wider.

    Args:
        x: (..., D), bf16, fp16 or fp32 (fp64 is computed in fp64).
        shift, scale: a modulation layout of the module docstring, fp32 or x's dtype.
        weight, bias: optional (D,) affine of the LayerNorm, applied before the modulation.
        eps: added to the variance.

    Returns:
        (..., D) in x's dtype. Under ``torch.compile`` with torch 2.11 on CUDA its backward fails at batch 1
        with a (1, 1, D) modulation (docs/fused_op.md, "Known issues"); batch 8 compiles.
    """
    _check_inputs(x, shift, scale, weight, bias)
    # fp32 math, or fp64 for fp64 inputs (the tests' reference).
    ct = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(x.to(ct), (x.shape[-1],), None, None, eps)
    return _reference_modulate(y, weight, bias, scale, shift, x, ct).to(x.dtype)


def _reference_modulate(y, weight, bias, scale, shift, x, ct):
    """The references' last step, plain autograd: ``(y * weight + bias) * (1 + scale) + shift`` in ``ct``."""
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    return y * (1.0 + _expand_modulation(scale, x).to(ct)) + _expand_modulation(shift, x).to(ct)


# ---------------------------------------------------------------------------------------------------------
# The custom operators. Their inputs are normalized by the public functions: shift and scale are (M, D)
# tables with one dtype, row m serving rows [m * group_size, (m + 1) * group_size) of x viewed as (rows, D);
# weight and bias fp32 (D,). The schemas are the C++ library's (csrc/ln_modulate_binding.cpp); these copies
# define the operators where the library is not loaded, and a test checks that the two agree.

_SCHEMAS = {
    "layer_norm_modulate": "(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
    "SymInt group_size, float eps) -> (Tensor, Tensor, Tensor)",
    "layer_norm_modulate_backward": "(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
    "Tensor mean, Tensor rstd, SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "rms_norm_modulate": "(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
    "SymInt group_size, float eps) -> (Tensor, Tensor)",
    "rms_norm_modulate_backward": "(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
    "Tensor rstd, SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


def _load_kernels() -> tuple[bool, str]:
    """Loads the C++ library where it can serve: ``(True, library path)`` or ``(False, why not)``."""
    if os.environ.get("LIGHTNING_ADAPTIVELOAD_FUSED", "1") == "0":
        return False, "LIGHTNING_ADAPTIVELOAD_FUSED=0"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    path, reason = _build.get_extension()
    return (True, path) if path is not None else (False, reason or "unknown")


_KERNELS_LOADED, _KERNELS_INFO = _load_kernels()
# The library's eager fast path (None without the library): see the module docstring.
_cfast = _build.python_entry(_KERNELS_INFO) if _KERNELS_LOADED else None
for _name, _schema in _SCHEMAS.items():
    # Loading the library defined the schemas; defining them twice is an error.
    if not _KERNELS_LOADED and not hasattr(getattr(torch.ops, _NS), _name):
        torch.library.define(f"{_NS}::{_name}", _schema)


def _fwd_math(x, shift, scale, weight, bias, group_size, eps):
    D = x.shape[-1]
    num_groups = shift.shape[0]
    xf = x.float().reshape(num_groups, group_size, D)
    mean = xf.mean(-1, keepdim=True)
    d = xf - mean
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + eps)
    n = d * rstd
    if weight is not None:
        n = n * weight.float()
    if bias is not None:
        n = n + bias.float()
    y = n * (1.0 + scale.float()[:, None, :]) + shift.float()[:, None, :]
    stat_shape = x.shape[:-1]
    return y.reshape(x.shape).to(x.dtype), mean.reshape(stat_shape), rstd.reshape(stat_shape)


def _bwd_math(dy, x, scale, weight, bias, mean, rstd, group_size):
    D = x.shape[-1]
    num_groups = scale.shape[0]
    shape3 = (num_groups, group_size, D)
    xh = (x.float().reshape(shape3) - mean.reshape(num_groups, group_size, 1)) * rstd.reshape(
        num_groups, group_size, 1
    )
    return _bwd_from_xhat(dy, x, scale, weight, bias, xh, rstd, group_size, center=True)


def _bwd_from_xhat(dy, x, scale, weight, bias, xh, rstd, group_size, center: bool):
    """The gradients of ``norm(x) * (1 + scale) + shift`` from the normalized rows ``xh`` (grouped);
    ``center``: LayerNorm (the row mean is subtracted), else RMSNorm."""
    D = x.shape[-1]
    num_groups = scale.shape[0]
    shape3 = (num_groups, group_size, D)
    dyf = dy.float().reshape(shape3)
    n = xh
    if weight is not None:
        n = n * weight.float()
    if bias is not None:
        n = n + bias.float()
    dshift = dyf.sum(1)
    dscale = (dyf * n).sum(1)
    dn = dyf * (1.0 + scale.float()[:, None, :])
    empty = x.new_empty((0,), dtype=torch.float32)
    dweight = (dn * xh).sum((0, 1)) if weight is not None else empty
    dbias = dn.sum((0, 1)) if bias is not None else empty
    dxh = dn * weight.float() if weight is not None else dn
    proj = dxh - xh * (dxh * xh).mean(-1, keepdim=True)
    if center:
        proj = proj - dxh.mean(-1, keepdim=True)
    dx = rstd.reshape(num_groups, group_size, 1) * proj
    return dx.reshape(x.shape).to(x.dtype), dshift.to(scale.dtype), dscale.to(scale.dtype), dweight, dbias


_fwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate.default
_bwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate_backward.default

# Every device without a kernel of its own (CPU; CUDA when the library is not loaded) runs the math.
torch.library.impl(_FWD, "CompositeExplicitAutograd", _fwd_math)
torch.library.impl(_BWD, "CompositeExplicitAutograd", _bwd_math)


@torch.library.register_fake(_FWD)
def _fwd_fake(x, shift, scale, weight, bias, group_size, eps):
    stat_shape = x.shape[:-1]
    return (
        x.new_empty(x.shape),
        x.new_empty(stat_shape, dtype=torch.float32),
        x.new_empty(stat_shape, dtype=torch.float32),
    )


def _bwd_fake_common(x, scale, weight, bias):
    D = x.shape[-1]
    table = (scale.shape[0], D)
    return (
        x.new_empty(x.shape),
        scale.new_empty(table),
        scale.new_empty(table),
        x.new_empty((D if weight is not None else 0,), dtype=torch.float32),
        x.new_empty((D if bias is not None else 0,), dtype=torch.float32),
    )


@torch.library.register_fake(_BWD)
def _bwd_fake(dy, x, scale, weight, bias, mean, rstd, group_size):
    return _bwd_fake_common(x, scale, weight, bias)


def _setup_context(ctx, inputs, output):
    x, shift, scale, weight, bias, group_size, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
    ctx.group_size = group_size


def _grads(dx, dshift, dscale, dweight, dbias, weight, bias):
    return (
        dx,
        dshift,
        dscale,
        dweight if weight is not None else None,
        dbias if bias is not None else None,
        None,
        None,
    )


def _backward(ctx, dy, _dmean, _drstd):
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dshift, dscale, dweight, dbias = _bwd_op(dy, x, scale, weight, bias, mean, rstd, ctx.group_size)
    return _grads(dx, dshift, dscale, dweight, dbias, weight, bias)


# The autograd formula: in C++ where the library is loaded (csrc/ln_modulate_binding.cpp, the same
# formula), registered here otherwise. Eager calls, torch.compile and checkpointing all take it.
if not _KERNELS_LOADED:
    torch.library.register_autograd(_FWD, _backward, setup_context=_setup_context)


def _kernel_blocker(x: torch.Tensor, mod_dtype: torch.dtype) -> str | None:
    """Why the CUDA kernels cannot take this input (None when they can)."""
    D = x.shape[-1]
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"x has dtype {x.dtype}; the fused kernels take bfloat16, float16 and float32"
    if D % 8 != 0 or D > _MAX_D or D == 0:
        return f"D = {D}; the fused kernels take D a multiple of 8 up to {_MAX_D}"
    if mod_dtype not in _SUPPORTED_DTYPES:
        return f"shift/scale have dtype {mod_dtype}; the fused kernels take float32 or x's dtype"
    return None


def _kernel_mod_dtype(x: torch.Tensor, *mods: torch.Tensor) -> torch.dtype:
    dtypes = {m.dtype for m in mods}
    return x.dtype if dtypes == {x.dtype} else torch.float32


def _require_fused() -> bool:
    return os.environ.get(_REQUIRE_ENV, "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------------------
# The call path shared by both ops


class _Norm:
    """What differs between the ops: names, the forward operator, the reference, and the oldest GPU its
    kernels run on (the RMSNorm op has the bulk-copy kernels only, compute capability 9.0 and newer)."""

    def __init__(
        self,
        name: str,
        op,
        reference,
        rms: bool,
        min_capability: tuple[int, int] = (0, 0),
    ) -> None:
        self.name = name
        self.op = op  # the forward operator; output 0 is y
        self.reference = reference
        self.rms = rms  # which operator the library's fast path calls
        self.min_capability = min_capability


_capabilities: dict[int, tuple[int, int]] = {}


def _capability_blocker(norm: _Norm, x: torch.Tensor) -> str | None:
    if norm.min_capability == (0, 0) or x.device.type != "cuda":
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    cap = _capabilities[index]
    if cap < norm.min_capability:
        need = ".".join(map(str, norm.min_capability))
        return (
            f"the GPU has compute capability {cap[0]}.{cap[1]}; the {norm.name} kernels need {need} or newer"
        )
    return None


def _call(norm: _Norm, x, shift, scale, weight, bias, eps) -> torch.Tensor:
    """The public functions' body: the kernels where they serve, else the reference (see the module doc)."""
    fast = _cfast is not None and not torch.compiler.is_compiling()
    if fast:
        y = _cfast.forward(norm.rms, x, shift, scale, weight, bias, eps)
        if y is not None:
            return y
    _check_inputs(x, shift, scale, weight, bias, norm.name)
    args = (x, shift, scale, weight, bias, eps)
    # Under torch.compile every device takes the custom op (its default implementation is the reference
    # math), so a compiled graph holds the op as one node wherever it is traced.
    if x.device.type != "cuda" and not torch.compiler.is_compiling():
        return _fallback(
            norm, f"device:{x.device.type}", f"x is on {x.device.type}; the fused kernels need CUDA", *args
        )
    sh, sc = shift, scale
    groups_sh, groups_sc = _as_groups(sh, x), _as_groups(sc, x)
    plain = True  # the tables are views of shift and scale as given
    if groups_sh is not None and groups_sc is not None and groups_sh[1] != groups_sc[1]:
        # Different layouts (say shift per sample, scale per token): read both in the finer one.
        common = torch.broadcast_shapes(_padded_shape(sh, x), _padded_shape(sc, x))
        sh, sc = _expand_modulation(sh, x).expand(common), _expand_modulation(sc, x).expand(common)
        groups_sh, groups_sc = _as_groups(sh, x), _as_groups(sc, x)
        plain = False
    if groups_sh is None or groups_sc is None:
        return _fallback(
            norm,
            f"layout:{tuple(shift.shape)}:{tuple(scale.shape)}:{x.dim()}",
            f"shift {tuple(shift.shape)} / scale {tuple(scale.shape)} for x {tuple(x.shape)} broadcast within "
            "the dims they vary over, which the fused kernels do not read",
            *args,
        )
    (table_sh, group_size), (table_sc, _) = groups_sh, groups_sc
    mod_dtype = _kernel_mod_dtype(x, table_sh, table_sc)
    blocker = _kernel_blocker(x, mod_dtype) or _capability_blocker(norm, x)
    if blocker is not None:
        return _fallback(norm, f"shape:{blocker}", blocker, *args)
    if x.device.type == "cuda":
        if not _KERNELS_LOADED:
            return _fallback(norm, "build", f"the CUDA kernels are unavailable ({_KERNELS_INFO})", *args)
        _record_path("fused", f"CUDA kernels ({_KERNELS_INFO})")
    if table_sh.dtype != mod_dtype or table_sc.dtype != mod_dtype:
        table_sh, table_sc = table_sh.to(mod_dtype), table_sc.to(mod_dtype)
        plain = False
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    plain = (
        plain
        and (weight is None or weight.dtype == torch.float32)
        and (bias is None or bias.dtype == torch.float32)
    )
    if fast and plain and isinstance(group_size, int) and x.is_cuda:
        # Calls of this signature can skip everything above (the fast path takes plain types only).
        _cfast.remember(norm.rms, x, shift, scale, weight, bias, eps, table_sh.shape[0], group_size)
    return norm.op(x, table_sh, table_sc, w, b, group_size, float(eps))[0]


def _fallback(norm: _Norm, key: str, reason: str, x, shift, scale, weight, bias, eps) -> torch.Tensor:
    """The plain-PyTorch reference, once the switch allows it: warns once per reason, records the path."""
    if _require_fused():
        raise _build.FusedOpUnavailable(
            f"{norm.name}: {reason}, and {_REQUIRE_ENV}=1 makes the plain-PyTorch fallback (about 9x "
            f"slower) an error. Fix the cause (see docs/fused_op.md), or unset {_REQUIRE_ENV} to allow it"
        )
    _record_path("reference", reason)
    _warn_once(f"{norm.name}:{key}", f"{norm.name}: {reason}; using the plain-PyTorch reference")
    return norm.reference(x, shift, scale, weight, bias, eps)


_LN = _Norm("layer_norm_modulate", _fwd_op, layer_norm_modulate_reference, rms=False)


# ---------------------------------------------------------------------------------------------------------
# Public entry point


def layer_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Fused ``LN(x) * (1 + scale) + shift``, with optional LayerNorm affine before the modulation.

    Args:
        x: (..., D), bfloat16, float16 or float32. Leading dims may be 0 (an empty result).
        shift, scale: the modulation in one of the layouts of the module docstring, float32 or x's dtype
            (other combinations are computed in float32).
        weight, bias: optional (D,) LayerNorm affine, applied before the modulation.
        eps: added to the variance.

    Returns:
        (..., D) in x's dtype. Statistics and arithmetic are fp32. Gradients flow to x, shift, scale,
        weight and bias.

    Raises:
        FusedOpUnavailable: with ``LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED=1``, where the fused kernels cannot
            run (not CUDA, an unsupported shape or dtype, the library unavailable); the message says why.

    On CUDA with D a multiple of 8 up to 16384 this runs the fused kernels; on other devices or shapes it
    runs :func:`layer_norm_modulate_reference` and warns once with the reason. Set
    ``LIGHTNING_ADAPTIVELOAD_FUSED=0`` to force the reference.
    """
    return _call(_LN, x, shift, scale, weight, bias, eps)


def fused_op_status() -> tuple[bool, str]:
    """Whether the fused CUDA kernels are usable in this process (decided when the module was imported).

    Returns:
        ``(True, "<path of the loaded library>")`` or ``(False, "<reason>")``.
    """
    return _KERNELS_LOADED, _KERNELS_INFO


def fused_op_paths() -> str:
    """Which implementation the fused ops (:func:`layer_norm_modulate`, ``rms_norm_modulate``) have run in
    this process, in words.

    Returns:
        ``"fused CUDA kernel"``, ``"PyTorch fallback (<reason>)"``, both joined with ``" and "`` when both
        ran (say CUDA blocks and a CPU evaluation), or ``"not called"``.
    """
    parts = []
    if "fused" in _paths:
        parts.append("fused CUDA kernel")
    if "reference" in _paths:
        parts.append(f"PyTorch fallback ({_paths['reference']})")
    return " and ".join(parts) if parts else "not called"

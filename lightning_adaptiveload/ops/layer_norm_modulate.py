"""LayerNorm followed by adaLN modulation: ``y = LN(x) * (1 + scale) + shift``.

Two implementations of one function:

- :func:`layer_norm_modulate_reference`: plain PyTorch, any device, differentiable by autograd.
- :func:`layer_norm_modulate`: the fused op. On CUDA it runs the kernels in ``csrc/`` (one pass over x
  forward, one pass over x and dy backward). Under ``torch.compile`` it is the custom operator
  ``torch.ops.lightning_adaptiveload.layer_norm_modulate``, kept as a single node; eager calls reach the
  same kernels through a small ``autograd.Function`` that skips the dispatcher's Python round trips. Elsewhere,
  or where the kernels cannot serve the input, it runs the reference and warns once, saying why.

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

__all__ = ["layer_norm_modulate", "layer_norm_modulate_reference", "fused_op_status"]

_NS = "lightning_adaptiveload"
_FWD = f"{_NS}::layer_norm_modulate"
_BWD = f"{_NS}::layer_norm_modulate_backward"
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_D = 16384

# Launch overrides for benchmarks (0: the kernels' own choice). Not part of the API.
_TUNING = {"warps_per_row": 0, "rows_per_cta": 0, "vectors_per_thread": 0, "slots": 0}

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    # warnings.warn would break a torch.compile graph; the eager call, or the op at run time, warns instead.
    if key in _warned or torch.compiler.is_compiling():
        return
    _warned.add(key)
    warnings.warn(f"layer_norm_modulate: {message}", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------------
# Shapes


def _check_inputs(x, shift, scale, weight, bias) -> None:
    # Plain shape arithmetic: this runs on every call, so it stays far cheaper than the kernels.
    for name, t in (("x", x), ("shift", shift), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"layer_norm_modulate: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1:
        raise ValueError("layer_norm_modulate: x must have at least one dim (..., D), got a scalar")
    D = x.shape[-1]
    for name, t in (("shift", shift), ("scale", scale), ("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(
                f"layer_norm_modulate: {name} is on {t.device} but x is on {x.device}; move both to one device"
            )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (D,)):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"layer_norm_modulate: {name} must have shape ({D},) for x {tuple(x.shape)}, got {shape}"
            )
    for name, t in (("shift", shift), ("scale", scale)):
        if t.dim() < 1 or t.shape[-1] != D:
            raise ValueError(
                f"layer_norm_modulate: {name} {tuple(t.shape)} must end in D = {D} like x {tuple(x.shape)}; "
                "layouts: per sample (B, 1, D) or (B, D), per token (B, S, D), per frame (B, F, 1, D)"
            )
        if t.dim() == 2 and x.dim() >= 3 and _differ(t.shape[0], 1) and _differ(t.shape[0], x.shape[0]):
            raise ValueError(
                f"layer_norm_modulate: {name} {tuple(t.shape)} is read as per sample (B, D) but x {tuple(x.shape)} "
                f"has B = {x.shape[0]}"
            )
        padded = _padded_shape(t, x)
        if len(padded) > x.dim() or any(_differ(m, 1) and _differ(m, n) for m, n in zip(padded, x.shape)):
            raise ValueError(
                f"layer_norm_modulate: {name} {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}; layouts: "
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
        (..., D) in x's dtype.
    """
    _check_inputs(x, shift, scale, weight, bias)
    # fp32 math, or fp64 for fp64 inputs (the tests' reference).
    ct = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(x.to(ct), (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    y = y * (1.0 + _expand_modulation(scale, x).to(ct)) + _expand_modulation(shift, x).to(ct)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# The custom operator. Its inputs are normalized by layer_norm_modulate: shift and scale are (M, D)
# tables with one dtype, row m serving rows [m * group_size, (m + 1) * group_size) of x viewed as (rows, D);
# weight and bias fp32 (D,).

torch.library.define(
    _FWD,
    "(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, SymInt group_size, float eps) "
    "-> (Tensor, Tensor, Tensor)",
)
torch.library.define(
    _BWD,
    "(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
    "SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


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
    dx = rstd.reshape(num_groups, group_size, 1) * (
        dxh - dxh.mean(-1, keepdim=True) - xh * (dxh * xh).mean(-1, keepdim=True)
    )
    return dx.reshape(x.shape).to(x.dtype), dshift.to(scale.dtype), dscale.to(scale.dtype), dweight, dbias


_fwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate.default
_bwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate_backward.default

torch.library.impl(_FWD, "default", _fwd_math)
torch.library.impl(_BWD, "default", _bwd_math)


@torch.library.register_fake(_FWD)
def _fwd_fake(x, shift, scale, weight, bias, group_size, eps):
    stat_shape = x.shape[:-1]
    return (
        x.new_empty(x.shape),
        x.new_empty(stat_shape, dtype=torch.float32),
        x.new_empty(stat_shape, dtype=torch.float32),
    )


@torch.library.register_fake(_BWD)
def _bwd_fake(dy, x, scale, weight, bias, mean, rstd, group_size):
    D = x.shape[-1]
    table = (scale.shape[0], D)
    return (
        x.new_empty(x.shape),
        scale.new_empty(table),
        scale.new_empty(table),
        x.new_empty((D if weight is not None else 0,), dtype=torch.float32),
        x.new_empty((D if bias is not None else 0,), dtype=torch.float32),
    )


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


def _extension_or_warn():
    if os.environ.get("LIGHTNING_ADAPTIVELOAD_FUSED", "1") == "0":
        _warn_once("disabled", "LIGHTNING_ADAPTIVELOAD_FUSED=0: using the plain-PyTorch reference")
        return None
    ext, reason = _build.get_extension()
    if ext is None:
        _warn_once("build", f"the CUDA kernels are unavailable, using the plain-PyTorch reference: {reason}")
    return ext


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _aligned_table(m: torch.Tensor) -> torch.Tensor:
    # Rows may stay strided (chunks of a (B, 6, D) table) if each row starts on a 16-byte boundary.
    ok = (
        m.stride(-1) == 1
        and m.data_ptr() % 16 == 0
        and (m.shape[0] <= 1 or (m.stride(0) * m.element_size()) % 16 == 0)
    )
    return m if ok else _aligned(m)


def _kernel_mod_dtype(x: torch.Tensor, *mods: torch.Tensor) -> torch.dtype:
    dtypes = {m.dtype for m in mods}
    return x.dtype if dtypes == {x.dtype} else torch.float32


def _affine_pair(weight, bias, D, device):
    if weight is None and bias is None:
        return None, None
    w = weight.float().contiguous() if weight is not None else torch.ones(D, device=device)
    b = bias.float().contiguous() if bias is not None else torch.zeros(D, device=device)
    return _aligned(w), _aligned(b)


def _fwd_cuda(x, shift, scale, weight, bias, group_size, eps):
    mod_dtype = _kernel_mod_dtype(x, shift, scale)
    blocker = _kernel_blocker(x, mod_dtype)
    if blocker is not None:
        _warn_once(f"shape:{blocker}", f"{blocker}; using the plain-PyTorch reference")
        return _fwd_math(x, shift, scale, weight, bias, group_size, eps)
    ext = _extension_or_warn()
    if ext is None:
        return _fwd_math(x, shift, scale, weight, bias, group_size, eps)
    w, b = _affine_pair(weight, bias, x.shape[-1], x.device)
    return tuple(
        ext.forward(
            _aligned(x),
            _aligned_table(shift.to(mod_dtype)),
            _aligned_table(scale.to(mod_dtype)),
            w,
            b,
            int(group_size),
            float(eps),
            _TUNING["warps_per_row"],
            _TUNING["rows_per_cta"],
        )
    )


def _bwd_cuda(dy, x, scale, weight, bias, mean, rstd, group_size):
    mod_dtype = _kernel_mod_dtype(x, scale)
    blocker = _kernel_blocker(x, mod_dtype)
    ext = _extension_or_warn() if blocker is None else None
    if ext is None:
        return _bwd_math(dy, x, scale, weight, bias, mean, rstd, group_size)
    w, b = _affine_pair(weight, bias, x.shape[-1], x.device)
    dx, dshift, dscale, dweight, dbias = ext.backward(
        _aligned(dy.to(x.dtype)),
        _aligned(x),
        _aligned_table(scale.to(mod_dtype)),
        w,
        b,
        mean.contiguous(),
        rstd.contiguous(),
        int(group_size),
        _TUNING["vectors_per_thread"],
        _TUNING["slots"],
    )
    empty = x.new_empty((0,), dtype=torch.float32)
    return (
        dx,
        dshift.to(scale.dtype),
        dscale.to(scale.dtype),
        dweight if weight is not None else empty,
        dbias if bias is not None else empty,
    )


torch.library.impl(_FWD, "cuda", _fwd_cuda)
torch.library.impl(_BWD, "cuda", _bwd_cuda)


def _setup_context(ctx, inputs, output):
    x, shift, scale, weight, bias, group_size, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
    ctx.group_size = group_size


def _backward(ctx, dy, _dmean, _drstd):
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dshift, dscale, dweight, dbias = _bwd_op(dy, x, scale, weight, bias, mean, rstd, ctx.group_size)
    return (
        dx,
        dshift,
        dscale,
        dweight if weight is not None else None,
        dbias if bias is not None else None,
        None,
        None,
    )


torch.library.register_autograd(_FWD, _backward, setup_context=_setup_context)


class _EagerFused(torch.autograd.Function):
    """The eager path: the same kernels, called straight from autograd.

    Under ``torch.compile`` the custom op above is what gets traced. Eager calls skip its two Python
    round trips through the dispatcher (the autograd and the CUDA kernel), which cost more CPU time per
    call than the kernels take on an H100 at D = 1536. Inputs are prepared by ``layer_norm_modulate``: x
    contiguous and 16-byte aligned, (M, D) tables with aligned rows, weight and bias both fp32 or both None.
    """

    @staticmethod
    def forward(ctx, x, shift, scale, weight, bias, group_size, eps, ext):
        y, mean, rstd = ext.forward(
            x, shift, scale, weight, bias, group_size, eps, _TUNING["warps_per_row"], _TUNING["rows_per_cta"]
        )
        ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
        ctx.group_size = group_size
        ctx.ext = ext
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dshift, dscale, dweight, dbias = ctx.ext.backward(
            _aligned(dy.to(x.dtype)),
            x,
            scale,
            weight,
            bias,
            mean,
            rstd,
            ctx.group_size,
            _TUNING["vectors_per_thread"],
            _TUNING["slots"],
        )
        affine = weight is not None
        return dx, dshift, dscale, dweight if affine else None, dbias if affine else None, None, None, None


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
        x: (..., D), bfloat16, float16 or float32.
        shift, scale: the modulation in one of the layouts of the module docstring, float32 or x's dtype
            (other combinations are computed in float32).
        weight, bias: optional (D,) LayerNorm affine, applied before the modulation.
        eps: added to the variance.

    Returns:
        (..., D) in x's dtype. Statistics and arithmetic are fp32. Gradients flow to x, shift, scale,
        weight and bias.

    On CUDA with D a multiple of 8 up to 16384 this runs the fused kernels; on other devices or shapes it
    runs :func:`layer_norm_modulate_reference` and warns once with the reason. Set
    ``LIGHTNING_ADAPTIVELOAD_FUSED=0`` to force the reference.
    """
    _check_inputs(x, shift, scale, weight, bias)
    # Under torch.compile every device takes the custom op (its default implementation is the reference math),
    # so a compiled graph holds the op as one node wherever it is traced.
    if x.device.type != "cuda" and not torch.compiler.is_compiling():
        _warn_once(
            f"device:{x.device.type}",
            f"x is on {x.device.type}; the fused kernels need CUDA, using the plain-PyTorch reference",
        )
        return layer_norm_modulate_reference(x, shift, scale, weight, bias, eps)
    sh, sc = shift, scale
    groups_sh, groups_sc = _as_groups(sh, x), _as_groups(sc, x)
    if groups_sh is not None and groups_sc is not None and groups_sh[1] != groups_sc[1]:
        # Different layouts (say shift per sample, scale per token): read both in the finer one.
        common = torch.broadcast_shapes(_padded_shape(sh, x), _padded_shape(sc, x))
        sh, sc = _expand_modulation(sh, x).expand(common), _expand_modulation(sc, x).expand(common)
        groups_sh, groups_sc = _as_groups(sh, x), _as_groups(sc, x)
    if groups_sh is None or groups_sc is None:
        _warn_once(
            f"layout:{tuple(shift.shape)}:{tuple(scale.shape)}:{x.dim()}",
            f"shift {tuple(shift.shape)} / scale {tuple(scale.shape)} for x {tuple(x.shape)} broadcast within "
            "the dims they vary over, which the fused kernels do not read; using the plain-PyTorch reference",
        )
        return layer_norm_modulate_reference(x, shift, scale, weight, bias, eps)
    (table_sh, group_size), (table_sc, _) = groups_sh, groups_sc
    mod_dtype = _kernel_mod_dtype(x, table_sh, table_sc)
    blocker = _kernel_blocker(x, mod_dtype)
    if blocker is not None:
        _warn_once(f"shape:{blocker}", f"{blocker}; using the plain-PyTorch reference")
        return layer_norm_modulate_reference(x, shift, scale, weight, bias, eps)
    if table_sh.dtype != mod_dtype or table_sc.dtype != mod_dtype:
        table_sh, table_sc = table_sh.to(mod_dtype), table_sc.to(mod_dtype)
    if not torch.compiler.is_compiling():
        ext = _extension_or_warn()
        if ext is None:
            return layer_norm_modulate_reference(x, shift, scale, weight, bias, eps)
        w, b = _affine_pair(weight, bias, x.shape[-1], x.device)
        return _EagerFused.apply(
            _aligned(x), _aligned_table(table_sh), _aligned_table(table_sc), w, b, group_size, float(eps), ext
        )
    y, _, _ = _fwd_op(
        x.contiguous(),
        table_sh,
        table_sc,
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        group_size,
        float(eps),
    )
    return y


def fused_op_status() -> tuple[bool, str]:
    """Whether the fused CUDA kernels are usable here, building them if needed.

    Returns:
        ``(True, "<build directory>")`` or ``(False, "<reason>")``.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    ext, reason = _build.get_extension()
    if ext is None:
        return False, reason or "unknown"
    return True, getattr(ext, "__file__", ext.__name__)

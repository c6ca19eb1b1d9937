"""RMSNorm followed by adaLN modulation: ``y = RMSNorm(x) * (1 + scale) + shift``.

The RMSNorm counterpart of :mod:`lightning_adaptiveload.ops.layer_norm_modulate` for the DiTs whose blocks
normalise with RMSNorm (LTX-Video; Lumina's ``RMSNorm(x) * (1 + scale)`` with a weight; diffusers'
``RMSNorm`` with ``elementwise_affine``): the same calling convention, layouts, dtypes, fallback and
environment switches, with ``RMSNorm(x) = x * rsqrt(mean(x^2) + eps)`` and the optional affine
``weight`` (and ``bias``) applied before the modulation.

- :func:`rms_norm_modulate_reference`: plain PyTorch, any device, differentiable by autograd.
- :func:`rms_norm_modulate`: the fused op. On CUDA it runs the kernels in ``csrc/`` (the bulk-copy kernels
  of ``norm_mod_tma.cuh``: one pass over x forward, one pass over x and dy backward, fp32 statistics,
  deterministic column sums for the modulation's gradients) through the custom operator
  ``torch.ops.lightning_adaptiveload.rms_norm_modulate``; elsewhere the reference, with one warning.

The operator's schema, CUDA kernel and autograd formula come from the C++ library with the LayerNorm op's;
this module adds its fake implementation and plain-PyTorch math, and, where the library is not loaded, the
schema and the autograd formula (``torch.library.register_autograd``).
"""

from __future__ import annotations

import importlib

import torch

# The module, not the function of the same name that the package exports.
_ln = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")

__all__ = ["rms_norm_modulate", "rms_norm_modulate_reference"]

_FWD = f"{_ln._NS}::rms_norm_modulate"
_BWD = f"{_ln._NS}::rms_norm_modulate_backward"


def rms_norm_modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`rms_norm_modulate`: statistics and arithmetic in fp32 or wider.

    Args:
        x: (..., D), bf16, fp16 or fp32 (fp64 is computed in fp64).
        shift, scale: a modulation layout of :mod:`~lightning_adaptiveload.ops.layer_norm_modulate`, fp32 or
            x's dtype.
        weight, bias: optional (D,) affine of the RMSNorm, applied before the modulation.
        eps: added to the mean square.

    Returns:
        (..., D) in x's dtype (the compile caveat of ``layer_norm_modulate_reference`` applies).
    """
    _ln._check_inputs(x, shift, scale, weight, bias, "rms_norm_modulate")
    ct = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(ct)
    n = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return _ln._reference_modulate(n, weight, bias, scale, shift, x, ct).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# The operator (schemas: layer_norm_modulate._SCHEMAS, defined there where the library is not loaded).


def _fwd_math(x, shift, scale, weight, bias, group_size, eps):
    D = x.shape[-1]
    num_groups = shift.shape[0]
    xf = x.float().reshape(num_groups, group_size, D)
    rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    n = xf * rstd
    if weight is not None:
        n = n * weight.float()
    if bias is not None:
        n = n + bias.float()
    y = n * (1.0 + scale.float()[:, None, :]) + shift.float()[:, None, :]
    return y.reshape(x.shape).to(x.dtype), rstd.reshape(x.shape[:-1])


def _bwd_math(dy, x, scale, weight, bias, rstd, group_size):
    D = x.shape[-1]
    num_groups = scale.shape[0]
    xh = x.float().reshape(num_groups, group_size, D) * rstd.reshape(num_groups, group_size, 1)
    return _ln._bwd_from_xhat(dy, x, scale, weight, bias, xh, rstd, group_size, center=False)


_fwd_op = torch.ops.lightning_adaptiveload.rms_norm_modulate.default
_bwd_op = torch.ops.lightning_adaptiveload.rms_norm_modulate_backward.default

torch.library.impl(_FWD, "CompositeExplicitAutograd", _fwd_math)
torch.library.impl(_BWD, "CompositeExplicitAutograd", _bwd_math)


@torch.library.register_fake(_FWD)
def _fwd_fake(x, shift, scale, weight, bias, group_size, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake(_BWD)
def _bwd_fake(dy, x, scale, weight, bias, rstd, group_size):
    return _ln._bwd_fake_common(x, scale, weight, bias)


def _setup_context(ctx, inputs, output):
    x, shift, scale, weight, bias, group_size, eps = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, scale, weight, bias, rstd)
    ctx.group_size = group_size


def _backward(ctx, dy, _drstd):
    x, scale, weight, bias, rstd = ctx.saved_tensors
    dx, dshift, dscale, dweight, dbias = _bwd_op(dy, x, scale, weight, bias, rstd, ctx.group_size)
    return _ln._grads(dx, dshift, dscale, dweight, dbias, weight, bias)


if not _ln._KERNELS_LOADED:  # otherwise the library's C++ autograd formula (the same) is registered
    torch.library.register_autograd(_FWD, _backward, setup_context=_setup_context)

_RMS = _ln._Norm(
    "rms_norm_modulate",
    _fwd_op,
    rms_norm_modulate_reference,
    rms=True,
    min_capability=(9, 0),
)


def rms_norm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Fused ``RMSNorm(x) * (1 + scale) + shift``, with an optional affine before the modulation.

    The calling convention of :func:`~lightning_adaptiveload.ops.layer_norm_modulate`.

    Args:
        x: (..., D), bfloat16, float16 or float32. Leading dims may be 0 (an empty result).
        shift, scale: per sample (B, 1, D) or (B, D), per token (B, S, D), per frame (B, F, 1, D), or any
            modulation that broadcasts to x and varies over a prefix of its leading dims; float32 or x's
            dtype (other combinations are computed in float32).
        weight, bias: optional (D,) RMSNorm affine (diffusers' ``RMSNorm(elementwise_affine=True)``),
            applied before the modulation.
        eps: added to the mean square.

    Returns:
        (..., D) in x's dtype. Statistics and arithmetic are fp32. Gradients flow to x, shift, scale,
        weight and bias.

    Raises:
        FusedOpUnavailable: with ``LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED=1``, where the fused kernels cannot
            run; the message says why.
    """
    return _ln._call(_RMS, x, shift, scale, weight, bias, eps)

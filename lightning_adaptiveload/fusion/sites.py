"""One norm + modulate site, fused: ``norm(x) * (1 + scale) + shift`` through the fused ops.

:func:`norm_modulate` is what every adapter of a diffusers norm class or block calls in place of the
inline expression. It takes the norm module itself and picks the op from its kind:

- ``nn.LayerNorm`` (and diffusers' ``FP32LayerNorm``, which computes in fp32 as the op does):
  :func:`lightning_adaptiveload.ops.layer_norm_modulate`, with the norm's affine weight, bias and eps;
- ``nn.RMSNorm`` and diffusers' ``RMSNorm`` (LTX-Video, RMSNorm variants of ``AdaLayerNormContinuous``):
  ``lightning_adaptiveload.ops.rms_norm_modulate``, with the norm's weight and eps.

The result has the dtype the inline expression gives (the norm's output dtype promoted with shift's and
scale's), so what follows the site runs in the dtype it ran in before. A modulation the ops cannot read
(one that broadcasts x up, or varies inside the dims it broadcasts over) is computed as the inline
expression, so a fused site never changes a result beyond rounding. :func:`norm_site_reason` says why a
norm module cannot be a fused site (the adapters' checks use it).

Two forms without a shift (Lumina2's and Mochi's norms) run the same ops with a zero shift:
:func:`norm_scale` for ``norm(x) * (1 + scale)``, :func:`norm_times` for ``norm(x) * factor`` (a tanh gate
after a post-norm, or a ``1 + scale`` the caller added), the factor read as the ops' scale ``factor - 1``
in fp32 (in a 16-bit dtype, ``factor - 1`` would lose the digits of a small gate).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_adaptiveload import ops as _ops

__all__ = ["norm_kind", "norm_modulate", "norm_scale", "norm_site_reason", "norm_times", "norm_width"]

# Class names of RMSNorm implementations whose forward is the formula below (x * rsqrt(mean(x^2) + eps),
# then the weight): torch's own and diffusers' (models/normalization.py). A class of another name is not
# taken on trust.
_DIFFUSERS_RMS = ("diffusers.models.normalization", "RMSNorm")
_DIFFUSERS_FP32_LN = ("diffusers.models.normalization", "FP32LayerNorm")


def _is_class(norm: nn.Module, where: tuple[str, str]) -> bool:
    cls = type(norm)
    return cls.__name__ == where[1] and cls.__module__ == where[0]


def norm_kind(norm: object) -> str | None:
    """``"layer_norm"``, ``"rms_norm"``, or None when ``norm`` is neither kind the ops compute."""
    if isinstance(norm, nn.LayerNorm):
        forward = type(norm).forward
        if forward is nn.LayerNorm.forward or _is_class(norm, _DIFFUSERS_FP32_LN):
            return "layer_norm"
        return None
    if isinstance(norm, nn.RMSNorm) and type(norm).forward is nn.RMSNorm.forward:
        return "rms_norm"
    if isinstance(norm, nn.Module) and _is_class(norm, _DIFFUSERS_RMS):
        return "rms_norm"
    return None


def norm_width(norm: nn.Module) -> int | None:
    """The width D a LayerNorm or RMSNorm normalises over (None when it normalises over several dims)."""
    shape = getattr(norm, "normalized_shape", None)
    if shape is None:
        shape = getattr(norm, "dim", None)  # diffusers' RMSNorm
    if shape is None:
        return None
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    return shape[0] if len(shape) == 1 else None


def norm_site_reason(norm: object, name: str, width: int | None = None) -> str | None:
    """Why ``norm`` (the attribute ``name`` of a module) cannot be fused, or None when it can.

    Args:
        norm: the norm module of the site.
        name: its attribute name, for the message.
        width: the width D it must normalise over, when the caller knows it (the modulation's width).
    """
    kind = norm_kind(norm)
    if kind is None:
        what = type(norm).__qualname__ if norm is not None else "None"
        return (
            f"{name} is {what}; a fused site needs an nn.LayerNorm (or diffusers' FP32LayerNorm), an nn.RMSNorm "
            "or diffusers' RMSNorm whose forward is the class's own"
        )
    dim = norm_width(norm)
    if dim is None:
        return f"{name} normalises over {tuple(getattr(norm, 'normalized_shape', ()))}; the ops take one last dim D"
    if width is not None and dim != width:
        return f"{name} normalises D={dim}, but the modulation has width {width}"
    return None


# --------------------------------------------------------------------------------------------------------
# The site


def _norm_out_dtype(norm: nn.Module, kind: str, x: torch.Tensor) -> torch.dtype:
    """The dtype ``norm(x)`` returns (outside autocast)."""
    if kind == "rms_norm" and not isinstance(norm, nn.RMSNorm):
        # diffusers' RMSNorm: x * rsqrt(fp32 variance) is promoted to fp32; a bf16/fp16 weight casts back to
        # its dtype; without a weight the result is cast back to x's dtype.
        weight = getattr(norm, "weight", None)
        if weight is None:
            return x.dtype
        out = (
            weight.dtype
            if weight.dtype in (torch.float16, torch.bfloat16)
            else torch.promote_types(torch.promote_types(x.dtype, torch.float32), weight.dtype)
        )
        bias = getattr(norm, "bias", None)
        return out if bias is None else torch.promote_types(out, bias.dtype)
    return x.dtype


def _aligned(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``m`` with x's number of dims, as broadcasting aligns it; None when the ops cannot take it."""
    if m.dim() > x.dim() or m.shape[-1] != x.shape[-1]:
        return None
    if m.dim() < x.dim():
        m = m.reshape((1,) * (x.dim() - m.dim()) + tuple(m.shape))
    if any(a != 1 and a != b for a, b in zip(m.shape[:-1], x.shape[:-1])):
        return None
    return m


def _inline(norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return norm(x) * (1 + scale) + shift


def norm_modulate(
    norm: nn.Module,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` in one fused op, in the dtype the inline expression gives.

    Args:
        norm: an nn.LayerNorm / FP32LayerNorm or an nn.RMSNorm / diffusers RMSNorm over x's last dim (an
            adapter checks this with :func:`norm_site_reason` before fusing).
        x: (..., D).
        shift, scale: broadcastable to x as the inline expression broadcasts them (standard broadcasting:
            a (B, D) modulation of a (B, S, D) x is aligned right, as ``*`` aligns it).
        out_dtype: the result's dtype, where the caller's code casts it (default: the inline expression's).

    Returns:
        The site's value: x's shape, and the dtype of ``norm(x) * (1 + scale) + shift`` (or ``out_dtype``).
    """
    kind = norm_kind(norm)
    sh, sc = _aligned(shift, x), _aligned(scale, x)
    if kind is None or sh is None or sc is None:
        y = _inline(norm, x, shift, scale)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)
    if out_dtype is None:
        out_dtype = torch.promote_types(
            torch.promote_types(_norm_out_dtype(norm, kind, x), shift.dtype), scale.dtype
        )
    if kind == "layer_norm":
        y = _ops.layer_norm_modulate(x, sh, sc, weight=norm.weight, bias=norm.bias, eps=norm.eps)
    else:
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
        bias = getattr(norm, "bias", None)  # diffusers' RMSNorm(bias=True); nn.RMSNorm has none
        y = _ops.rms_norm_modulate(x, sh, sc, weight=norm.weight, bias=bias, eps=eps)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def norm_scale(
    norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``norm(x) * (1 + scale)``: :func:`norm_modulate` with a zero shift (of scale's shape and dtype, so the
    inline expression's dtype is unchanged)."""
    return norm_modulate(norm, x, torch.zeros_like(scale), scale, out_dtype)


def norm_times(
    norm: nn.Module, x: torch.Tensor, factor: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``norm(x) * factor``: :func:`norm_modulate` with the scale ``factor - 1`` in fp32 and a zero shift, in
    the dtype of the inline product (or ``out_dtype``)."""
    if out_dtype is None:
        kind = norm_kind(norm)
        norm_dtype = _norm_out_dtype(norm, kind, x) if kind is not None else x.dtype
        out_dtype = torch.promote_types(norm_dtype, factor.dtype)
    scale = factor.to(torch.float32) - 1
    return norm_modulate(norm, x, torch.zeros_like(scale), scale, out_dtype)

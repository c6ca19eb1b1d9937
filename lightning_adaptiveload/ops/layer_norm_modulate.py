"""LayerNorm followed by adaLN modulation: ``y = LN(x) * (1 + scale) + shift``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expand_modulation(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # (B, D) for x (B, S, D) is the per-sample layout: give it the token axis.
    if m.dim() == 2 and x.dim() == 3:
        return m.unsqueeze(1)
    return m


def layer_norm_modulate_reference(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain-PyTorch reference: statistics and arithmetic in fp32, output in ``x.dtype``.

    Args:
        x: (..., D), bf16/fp16/fp32.
        shift, scale: broadcastable to x after the (B, D) -> (B, 1, D) expansion: (B, 1, D), (B, D),
            (B, S, D) or (B, F, 1, D) for x (B, F, L, D).
        weight, bias: optional (D,) affine of the LayerNorm, applied before the modulation.
    """
    xf = x.float()
    y = F.layer_norm(xf, (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y * (1.0 + _expand_modulation(scale, x).float()) + _expand_modulation(shift, x).float()
    return y.to(x.dtype)


def layer_norm_modulate(x, shift, scale, weight=None, bias=None, eps: float = 1e-6):
    """``LN(x) * (1 + scale) + shift``; see :func:`layer_norm_modulate_reference` for shapes."""
    return layer_norm_modulate_reference(x, shift, scale, weight, bias, eps)

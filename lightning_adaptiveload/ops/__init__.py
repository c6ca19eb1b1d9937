"""Fused operators. ``layer_norm_modulate`` computes ``LN(x) * (1 + scale) + shift``.

This module starts as the plain-PyTorch reference; the CUDA custom op replaces the dispatch.
"""

from lightning_adaptiveload.ops.layer_norm_modulate import (
    layer_norm_modulate,
    layer_norm_modulate_reference,
)

__all__ = ["layer_norm_modulate", "layer_norm_modulate_reference"]

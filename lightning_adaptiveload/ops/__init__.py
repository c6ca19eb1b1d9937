"""Fused operators. ``layer_norm_modulate`` computes ``LN(x) * (1 + scale) + shift``.

On CUDA it is a ``torch.library`` custom op backed by the kernels in ``csrc/`` (built on first use; prebuild
with ``python -m lightning_adaptiveload build-ops``); elsewhere it falls back to the plain-PyTorch
reference with one warning.
"""

from lightning_adaptiveload.ops.layer_norm_modulate import (
    fused_op_status,
    layer_norm_modulate,
    layer_norm_modulate_reference,
)

__all__ = ["fused_op_status", "layer_norm_modulate", "layer_norm_modulate_reference"]

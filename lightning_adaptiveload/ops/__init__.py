"""Fused operators: ``layer_norm_modulate`` computes ``LN(x) * (1 + scale) + shift`` and
``rms_norm_modulate`` ``RMSNorm(x) * (1 + scale) + shift``, with one calling convention.

On CUDA they are the custom operators ``torch.ops.lightning_adaptiveload.layer_norm_modulate`` and
``rms_norm_modulate``, registered by the C++ library built from ``csrc/`` (built on the node's first use;
prebuild with ``python -m lightning_adaptiveload build-ops``); elsewhere they fall back to the plain-PyTorch
references with one warning, or raise with ``LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED=1``. ``fused_op_paths()``
says which ran.

:mod:`lightning_adaptiveload.ops.norm_kernels` holds Triton kernels for the norms of compiled blocks
(LayerNorm-affine backward, RMSNorm with RoPE), which the model's layers use on CUDA under ``torch.compile``.
:mod:`lightning_adaptiveload.ops.adamw_kernels` holds the one-pass master-weight AdamW kernel of
:class:`~lightning_adaptiveload.models.master_weights.MasterWeightAdamW`.
"""

from lightning_adaptiveload.ops._build import FusedOpUnavailable
from lightning_adaptiveload.ops.layer_norm_modulate import (
    fused_op_paths,
    fused_op_status,
    layer_norm_modulate,
    layer_norm_modulate_reference,
)
from lightning_adaptiveload.ops.rms_norm_modulate import rms_norm_modulate, rms_norm_modulate_reference

__all__ = [
    "FusedOpUnavailable",
    "fused_op_paths",
    "fused_op_status",
    "layer_norm_modulate",
    "layer_norm_modulate_reference",
    "rms_norm_modulate",
    "rms_norm_modulate_reference",
]

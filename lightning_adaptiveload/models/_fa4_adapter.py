"""FlashAttention-4's kernels in the form PyTorch's FA4 registry calls them (``torch.nn.attention._fa4``).

PyTorch's FA4 dispatcher code imports a module and calls its ``_flash_attn_fwd`` (expecting ``(out, lse)``)
and ``_flash_attn_bwd`` (expecting ``(dq, dk, dv)``). flash-attn-4's own functions return more than that
in some releases (4.0.0b36's forward returns five values, against torch 2.11's two), and the unpacking then
fails inside every attention call. This module is what :func:`~lightning_adaptiveload.models.attention.
activate_flash_impl` registers instead of ``flash_attn.cute.interface``: the same kernels, the values PyTorch
expects. flash-attn-4 is imported at the first call, so this module imports anywhere; the registration
checks that flash-attn-4 is there first.
"""

from __future__ import annotations


def _interface():
    from flash_attn.cute import interface

    return interface


def _flash_attn_fwd(*args, **kwargs):
    """flash-attn-4's forward; returns ``(out, lse)`` whatever else the installed release returns."""
    result = _interface()._flash_attn_fwd(*args, **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args, **kwargs):
    """flash-attn-4's backward; returns ``(dq, dk, dv)`` whatever else the installed release returns."""
    result = _interface()._flash_attn_bwd(*args, **kwargs)
    return result[0], result[1], result[2]

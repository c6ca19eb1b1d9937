"""Fusion adapters for facebookresearch/DiT-style blocks, recognised by structure whatever they are called.

A ``DiTBlock`` has exactly the children ``norm1``, ``attn``, ``norm2``, ``mlp`` and ``adaLN_modulation``
(6 chunks); a ``FinalLayer`` has ``norm_final``, ``linear`` and ``adaLN_modulation`` (2 chunks). Their
forwards are replaced by fused ones that compute the same thing with ``layer_norm_modulate`` (or
``rms_norm_modulate`` for a norm that is an RMSNorm). The chunk order is the DiT one (shift, scale, gate):
a block that reads them in another order has the structure but not the computation, and the probe, which
compares on perturbed weights, refuses it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion.adapter import FusionAdapter, ReplaceForward, class_forward
from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn
from lightning_adaptiveload.fusion.sites import norm_modulate, norm_site_reason, norm_width

__all__ = ["builtin_entries"]

_DIT_BLOCK_CHILDREN = frozenset({"norm1", "attn", "norm2", "mlp", "adaLN_modulation"})
_DIT_FINAL_CHILDREN = frozenset({"norm_final", "linear", "adaLN_modulation"})


def _children_names(module: nn.Module) -> frozenset[str]:
    return frozenset(name for name, _ in module.named_children())


def _adaln_check(module: nn.Module, norms: tuple[str, ...], chunks: int, uses: tuple[str, ...]) -> str | None:
    dims = set()
    for n in norms:
        norm = getattr(module, n)
        reason = norm_site_reason(norm, n)
        if reason is not None:
            return reason
        dims.add(norm_width(norm))
    if len(dims) != 1:
        return f"{' and '.join(norms)} normalise different widths {sorted(dims)}"
    dim = dims.pop()
    ada = module.adaLN_modulation
    last = ada[-1] if isinstance(ada, nn.Sequential) and len(ada) else ada
    if not isinstance(last, nn.Linear) or last.out_features != chunks * dim:
        return (
            f"adaLN_modulation should end in nn.Linear(..., {chunks} * {dim}) producing {chunks} chunks, "
            f"found {type(last).__name__}"
            + (f" with out_features={last.out_features}" if isinstance(last, nn.Linear) else "")
        )
    forward = class_forward(module)
    params = list(inspect.signature(forward).parameters)[1:]
    if params != ["x", "c"]:
        return f"forward takes ({', '.join(params)}), the DiT structure takes (x, c)"
    code = getattr(forward, "__code__", None)
    if code is not None:
        missing = [n for n in uses + ("adaLN_modulation", "chunk") if n not in code.co_names]
        if missing:
            return f"forward does not use {missing}, so it is not the DiT adaLN structure"
    return None


def _dit_block_check(block: nn.Module) -> str | None:
    return _adaln_check(block, ("norm1", "norm2"), 6, ("norm1", "norm2", "attn", "mlp"))


def _dit_final_check(layer: nn.Module) -> str | None:
    return _adaln_check(layer, ("norm_final",), 2, ("norm_final", "linear"))


def _dit_block_forward_fused(block: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """DiTBlock.forward with both norm + modulate sites fused. x (B, S, D); c (B, D_c)."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaLN_modulation(c).chunk(6, dim=1)
    h = norm_modulate(block.norm1, x, shift_msa.unsqueeze(1), scale_msa.unsqueeze(1))
    x = x + gate_msa.unsqueeze(1) * block.attn(h)
    h = norm_modulate(block.norm2, x, shift_mlp.unsqueeze(1), scale_mlp.unsqueeze(1))
    return x + gate_mlp.unsqueeze(1) * block.mlp(h)


def _dit_final_forward_fused(layer: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """DiT FinalLayer.forward with its norm + modulate site fused. x (B, S, D); c (B, D_c)."""
    shift, scale = layer.adaLN_modulation(c).chunk(2, dim=1)
    h = norm_modulate(layer.norm_final, x, shift.unsqueeze(1), scale.unsqueeze(1))
    return layer.linear(h)


def _dit_probe(module: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = probe_device_dtype(module)
    norm = module.norm1 if hasattr(module, "norm1") else module.norm_final
    ada = module.adaLN_modulation
    last = ada[-1] if isinstance(ada, nn.Sequential) else ada
    first = next((m for m in ada.modules() if isinstance(m, nn.Linear)), last)
    dim, cond_dim = norm_width(norm), first.in_features
    x = probe_randn((2, 5, dim), generator, device, dtype)
    c = probe_randn((2, cond_dim), generator, device, dtype)
    return [((x, c), {})]


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of this family, in the order the registry tries them."""
    dit_block = ReplaceForward(
        _dit_block_forward_fused, name="dit-block", sites=2, check=_dit_block_check, probe=_dit_probe
    )
    dit_final = ReplaceForward(
        _dit_final_forward_fused, name="dit-final-layer", sites=1, check=_dit_final_check, probe=_dit_probe
    )
    return [
        (lambda m: _children_names(m) == _DIT_BLOCK_CHILDREN, dit_block),
        (lambda m: _children_names(m) == _DIT_FINAL_CHILDREN, dit_final),
    ]

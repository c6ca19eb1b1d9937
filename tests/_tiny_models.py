"""A tiny diffusers ``WanTransformer3DModel`` shared by the tests that need one (flops, fusion, pretrained,
acceleration): one base config, each test's differences as overrides."""

from __future__ import annotations

from typing import Any

import pytest
import torch

# Two blocks, two heads, 4 latent channels: small enough for CPU, every Wan block part present.
TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
)


def tiny_wan_config(**overrides: Any) -> dict[str, Any]:
    """:data:`TINY_WAN` with ``overrides`` applied (the keyword arguments of ``WanTransformer3DModel``)."""
    return {**TINY_WAN, **overrides}


def tiny_wan(seed: int | None = None, **overrides: Any):
    """A tiny ``WanTransformer3DModel`` (test skipped without diffusers); ``seed`` seeds torch first."""
    diffusers = pytest.importorskip("diffusers")
    if seed is not None:
        torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(**tiny_wan_config(**overrides))

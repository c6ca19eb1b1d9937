"""A tiny diffusers ``WanTransformer3DModel`` shared by the tests that need one (flops, fusion, pretrained,
acceleration): one base config, each test's differences as overrides. Also the compiled-against-eager check
of a training step that several tests run over a list of batches."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
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


def assert_same_steps(
    eager: torch.nn.Module,
    compiled: torch.nn.Module,
    batches: Iterable[tuple],
    grads: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Each batch through both models (``grads(model, *batch) -> (output, {name: gradient})``): the outputs
    and every gradient agree within the tolerances (compile warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in batches:
            out_e, g_e = grads(eager, *batch)
            out_c, g_c = grads(compiled, *batch)
            torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
            for name in g_e:
                torch.testing.assert_close(g_c[name], g_e[name], rtol=rtol, atol=atol, msg=name)

"""The fusion probe can fail: it compares on a perturbed copy, so adaLN-Zero initialisation hides nothing.

At adaLN-Zero initialisation every modulation is zero and every block is the identity, so comparing at the
model's own weights passed a block that reads shift and scale the other way round (issue 59). The probe
now randomises a copy's parameters first, compares forward and gradients in fp32 and bf16, and says what
it did in ``FusionReport.probes``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_fusion import DiTBlock, _Attention, modulate
from torch import nn

import lightning_adaptiveload.ops as ops
from lightning_adaptiveload.fusion import (
    fuse_norm_modulate,
    register_fusion_adapter,
    unregister_fusion_adapter,
)
from lightning_adaptiveload.fusion import registry as fusion_registry
from lightning_adaptiveload.fusion.probe import perturb_parameters
from lightning_adaptiveload.fusion.registry import _BUILTINS


@pytest.fixture
def user_adapters():
    before = list(fusion_registry._USER)
    yield
    for entry in list(fusion_registry._USER):
        if entry not in before:
            unregister_fusion_adapter(entry.adapter)


class SwappedDiTBlock(nn.Module):
    """A DiT block by structure (norm1, attn, norm2, mlp, adaLN_modulation of 6 chunks), but it reads each
    (shift, scale) pair as (scale, shift): not the computation the DiT adapter's fused forward does."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim)
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        scale_msa, shift_msa, gate_msa, scale_mlp, shift_mlp, gate_mlp = self.adaLN_modulation(c).chunk(
            6, dim=1
        )
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


def _adaln_zero(block: nn.Module) -> nn.Module:
    """adaLN-Zero initialisation (DiT): the modulation projection zeroed, so every block is the identity."""
    nn.init.zeros_(block.adaLN_modulation[-1].weight)
    nn.init.zeros_(block.adaLN_modulation[-1].bias)
    return block


def _inputs(dim: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, dim, generator=g), torch.randn(2, dim, generator=g)


def test_a_block_reading_shift_and_scale_swapped_is_refused_at_adaln_zero_init():
    torch.manual_seed(0)
    swapped, right = _adaln_zero(SwappedDiTBlock()), _adaln_zero(DiTBlock(16, 2))
    # What fooled the old probe: at this initialisation the wrong fused forward gives the block's output.
    dit_block = next(e.adapter for e in _BUILTINS if e.adapter.name == "dit-block")
    x, c = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(dit_block.forward(swapped, x, c), swapped(x, c), rtol=0, atol=0)

    model = nn.ModuleDict({"swapped": swapped, "right": right})
    report = fuse_norm_modulate(model)
    assert report.modules == {"DiTBlock": 1}  # the right one fuses, at the same initialisation
    (skip,) = report.skipped
    assert skip.name == "swapped" and skip.cls == "SwappedDiTBlock"
    assert "the probe refused it" in skip.reason and "differs from the original" in skip.reason
    assert "float32" in skip.reason and "perturbed copy" in skip.reason
    assert "forward" not in swapped.__dict__

    refused = report.probes["SwappedDiTBlock"]
    assert refused.status == "mismatch" and refused.dtypes == ["float32"]  # stopped at the first dtype
    assert refused.forward_error["float32"] > 0.1  # O(1) against the block's update, not rounding
    accepted = report.probes["DiTBlock"]
    assert accepted.status == "ok" and accepted.dtypes == ["float32", "bfloat16"]
    assert accepted.perturbed == len(list(right.parameters()))
    assert accepted.modulation == ["adaLN_modulation.1.weight", "adaLN_modulation.1.bias"]
    assert accepted.forward_error["float32"] <= 1e-5 and accepted.grad_error["bfloat16"] <= 0.15
    assert accepted.tolerance["float32"] == (1e-4, 1e-3)
    text = report.checks["DiTBlock"]
    assert (
        "perturbed copy (10 parameter tensors randomised, 2 of them modulation (adaLN_modulation.1.weight"
        in text
    )
    assert "float32: forward" in text and "bfloat16: forward" in text
    json.dumps(report.as_dict())  # the probes serialise with the report


def test_the_probe_leaves_the_module_alone():
    torch.manual_seed(0)
    model = nn.Sequential(_adaln_zero(DiTBlock(16, 2)), DiTBlock(16, 2))
    model[1].mlp.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    fuse_norm_modulate(model)
    assert torch.equal(torch.rand(3), expected)  # the global RNG stream is not drawn from
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())  # the copy was perturbed
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == flags


def test_a_wrong_adapter_for_a_diffusers_norm_is_refused(user_adapters):
    normalization = pytest.importorskip("diffusers.models.normalization")

    def swapped(norm, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        scale, shift, gate, shift_mlp, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(6, dim=1)
        y = ops.layer_norm_modulate(x, shift[:, None], scale[:, None], eps=norm.norm.eps)
        return y, gate, shift_mlp, scale_mlp, gate_mlp

    def probe(norm, generator):
        return [
            (
                (
                    torch.randn(2, 4, 16, generator=generator),
                    None,
                    None,
                    None,
                    torch.randn(2, 16, generator=generator),
                ),
                {},
            )
        ]

    register_fusion_adapter(normalization.AdaLayerNormZero, swapped, probe=probe)
    norms = nn.ModuleList(normalization.AdaLayerNormZero(16) for _ in range(2))
    for n in norms:  # adaLN-Zero
        nn.init.zeros_(n.linear.weight), nn.init.zeros_(n.linear.bias)
    report = fuse_norm_modulate(norms, allow_empty=True)
    assert report.num_modules == 0 and len(report.skipped) == 2
    assert all("the probe refused it" in s.reason for s in report.skipped)
    # The built-in adapter (the user's removed) fuses the same modules.
    unregister_fusion_adapter(fusion_registry._USER[0].adapter)
    assert fuse_norm_modulate(norms).modules == {"AdaLayerNormZero": 2}


def test_a_fused_forward_with_the_right_output_but_wrong_gradients_is_refused(user_adapters):
    def detached_shift(block, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaLN_modulation(c).chunk(
            6, dim=1
        )
        h = ops.layer_norm_modulate(
            x, shift_msa.unsqueeze(1).detach(), scale_msa.unsqueeze(1), eps=block.norm1.eps
        )
        x = x + gate_msa.unsqueeze(1) * block.attn(h)
        h = ops.layer_norm_modulate(x, shift_mlp.unsqueeze(1), scale_mlp.unsqueeze(1), eps=block.norm2.eps)
        return x + gate_mlp.unsqueeze(1) * block.mlp(h)

    def probe(block, generator):
        return [(_inputs(), {})]

    register_fusion_adapter(DiTBlock, detached_shift, probe=probe)
    report = fuse_norm_modulate(nn.Sequential(DiTBlock(16, 2)), allow_empty=True)
    (skip,) = report.skipped
    assert "in its gradients" in skip.reason and "float32" in skip.reason
    probe = report.probes["DiTBlock"]
    assert probe.forward_error["float32"] <= 1e-6 < 0.1 < probe.grad_error["float32"]  # outputs agree


def test_perturbation_moves_every_parameter_off_zero():
    torch.manual_seed(0)
    block = _adaln_zero(DiTBlock(16, 2))
    clone = copy.deepcopy(block)
    moved, modulation = perturb_parameters(clone, torch.Generator().manual_seed(0))
    assert moved == len(list(block.parameters()))
    assert modulation == ["adaLN_modulation.1.weight", "adaLN_modulation.1.bias"]
    for (name, p), q in zip(block.named_parameters(), clone.parameters()):
        assert not torch.equal(p, q), name
    assert clone.adaLN_modulation[-1].weight.abs().min() > 0  # zero before: now every chunk is non-zero


# -- bf16, where the original itself is far from fp32 ---------------------------------------------------


def _quantised(u: torch.Tensor, offset: float) -> torch.Tensor:
    """``u`` through a rounding chain: in bf16, ``u * 64 + offset`` keeps few bits (at 3,000 a bf16 step is
    16), so the result is off by up to 8 / 64 of a unit; in fp32 it is exact to 1e-5."""
    return ((u * 64 + offset) - offset) / 64


class RoundingBlock(nn.Module):
    """A modulated norm, a projection, then a chain of rounding: stands for a block (Sana's linear attention
    at full width) whose own bf16 forward is far from its fp32 forward."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mod = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, c):
        shift, scale = self.mod(c).unsqueeze(1).chunk(2, dim=-1)
        return x + _quantised(self.out(self.norm(x) * (1 + scale) + shift), 3000.0)


def _rounded_once(block, x, c, offset: float = 3000.0):
    """The block with its norm and modulation rounded once (as the fused op does), the rest unchanged."""
    shift, scale = block.mod(c).unsqueeze(1).chunk(2, dim=-1)
    h = (
        torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=1e-6) * (1 + scale.float())
        + shift.float()
    )
    return x + _quantised(block.out(h.to(x.dtype)), offset)


def _rounding_probe(block, gen):
    from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn

    device, dtype = probe_device_dtype(block)
    return [((probe_randn((2, 6, 16), gen, device, dtype), probe_randn((2, 16), gen, device, dtype)), {})]


def test_bf16_noise_of_the_original_itself_is_judged_against_fp32():
    from lightning_adaptiveload.fusion.probe import run_probe

    torch.manual_seed(0)
    block = RoundingBlock().to(torch.bfloat16)
    result = run_probe(block, _rounding_probe, RoundingBlock.forward, _rounded_once)
    assert result.status == "ok", result.message
    # the direct bf16 comparison exceeded its tolerance: the verdict came from the fp32 anchor
    assert result.forward_error["bfloat16"] > result.tolerance["bfloat16"][0]
    fused, _, original, _ = result.anchored["bfloat16"]
    assert fused <= 2 * original + result.tolerance["bfloat16"][0]
    assert "from its fp32 forward" in result.message


def test_a_fused_forward_further_from_fp32_than_the_original_is_refused():
    from lightning_adaptiveload.fusion.probe import run_probe

    torch.manual_seed(0)
    block = RoundingBlock().to(torch.bfloat16)

    def coarser(b, x, c):  # exact in fp32 too, but in bf16 a step of 256: 16 times the original's error
        return _rounded_once(b, x, c, offset=60000.0)

    result = run_probe(block, _rounding_probe, RoundingBlock.forward, coarser)
    assert result.status == "mismatch", result.message
    assert "further from the fp32 forward than the original in bfloat16" in result.message

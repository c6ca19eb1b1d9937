"""compile_check.compare_compiled: a compiled module's output and gradients against eager mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_adaptiveload.models import compile_check
from lightning_adaptiveload.models.acceleration import SAFE_REDUCTIONS
from lightning_adaptiveload.models.compile_check import (
    CompileSettings,
    capture_inputs,
    compare_compiled,
    relative_difference,
)
from lightning_adaptiveload.models.layers import rope_3d
from lightning_adaptiveload.models.video_dit import DiTBlock, VideoDiTConfig


def _block_inputs(B=2, grid=(2, 3, 4), text=5):
    torch.manual_seed(0)
    cfg = VideoDiTConfig.preset("tiny")
    block = DiTBlock(cfg).train()
    with torch.no_grad():  # off the init: zero gates would hide the attention and FFN paths
        for p in block.parameters():
            p.add_(0.05 * torch.randn_like(p))
    S = grid[0] * grid[1] * grid[2]
    cos, sin = rope_3d(grid, cfg.head_dim)
    inputs = dict(
        x=torch.randn(B, S, cfg.dim, requires_grad=True),
        e0=(0.3 * torch.randn(B, 6, cfg.dim)).requires_grad_(),
        cos=cos,
        sin=sin,
        context=torch.randn(B, text, cfg.dim),
        context_mask=None,
    )
    return block, inputs


def test_relative_difference():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert relative_difference(ref + torch.tensor([0.0, 0.0, 0.5]), ref) == pytest.approx(0.5 / 4.0)
    assert relative_difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_difference(torch.ones(2, dtype=torch.bfloat16), torch.ones(2)) == 0.0


def test_a_traced_block_matches_eager_and_every_gradient_is_named():
    block, inputs = _block_inputs()
    diffs = compare_compiled(
        block,
        settings=CompileSettings(backend="aot_eager"),
        kwargs=inputs,
        autocast_dtype=None,
        ignore=["k.bias"],
    )
    params = {n for n, p in block.named_parameters() if not n.endswith("k.bias")}
    assert set(diffs) == {"out", "x", "e0"} | params
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    assert not any(n.endswith("k.bias") for n in diffs)
    assert inputs["x"].grad is not None  # the inputs keep the compiled run's gradients
    assert not hasattr(block, "_orig_mod")  # the module itself was not replaced


class _WrongWhenCompiled(nn.Module):
    """Right eagerly; under compile, the second output channel's weight gradient is doubled (what a wrong
    generated kernel looks like to the caller) and the output is left alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x, scale, tag="ignored"):
        y = self.lin(x) * scale
        if torch.compiler.is_compiling():
            y = y + (y[..., 1:2] - y[..., 1:2].detach())  # same value, twice the gradient into channel 1
        return y, tag


def test_a_wrong_compiled_gradient_is_reported():
    torch.manual_seed(0)
    module = _WrongWhenCompiled()
    x = torch.randn(5, 4, requires_grad=True)
    diffs = compare_compiled(
        module, (x, 2.0, "text"), settings=CompileSettings(backend="aot_eager"), autocast_dtype=None
    )
    assert set(diffs) == {"out", "args[0]", "lin.weight", "lin.bias", "unused"}
    assert diffs["out"] < 1e-6  # the forward is right...
    assert diffs["lin.weight"] > 0.2 and diffs["lin.bias"] > 0.2  # ...its gradients are not
    assert diffs["args[0]"] > 0.05
    assert diffs["unused"] == 0.0  # None in both runs


def test_options_follow_compile_blocks(monkeypatch):
    seen = {}

    def fake_compile(module, **kwargs):
        seen.update(kwargs)
        return module

    monkeypatch.setattr(compile_check.torch, "compile", fake_compile)
    module = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    diffs = compare_compiled(
        module, (x,), settings=CompileSettings(options={"triton.tile_reductions": True}), autocast_dtype=None
    )
    assert max(diffs.values()) == 0.0
    assert seen["fullgraph"] is True and seen["dynamic"] is True and seen["backend"] == "inductor"
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction"):
        assert seen["options"] == dict(SAFE_REDUCTIONS, **{"triton.tile_reductions": True})
    seen.clear()
    compare_compiled(module, (x,), settings=CompileSettings(safe_reductions=False), autocast_dtype=None)
    assert seen["options"] is None


def test_a_module_that_returns_no_tensor_is_named():
    class Bad(nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(TypeError, match="compare_compiled: Bad returned dict"):
        compare_compiled(
            Bad(),
            (torch.randn(2, requires_grad=True),),
            settings=CompileSettings(backend="aot_eager"),
            autocast_dtype=None,
        )


def test_a_given_output_gradient_is_used_and_autocast_runs_on_cpu():
    block, inputs = _block_inputs(B=1)
    S = inputs["x"].shape[1]
    dy = torch.randn(1, S, block.self_attn.q.in_features)
    diffs = compare_compiled(
        block, settings=CompileSettings(backend="aot_eager"), kwargs=inputs, grad_output=dy, ignore=["k.bias"]
    )
    assert max(diffs.values()) < 3e-2  # bf16 autocast on CPU: rounding only


def test_inputs_captured_from_our_model_check_its_block():
    from lightning_adaptiveload.models.video_dit import VideoDiT

    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny")).train()
    x, t, ctx = torch.randn(2, 16, 1, 8, 8), torch.rand(2), torch.randn(2, 5, 32)
    args, kwargs = capture_inputs(model.blocks[1], lambda: model(x, t, ctx, None))
    assert args[0].requires_grad and args[0].grad_fn is None  # a leaf copy of the hidden states
    assert args[0].shape == (2, 16, model.config.dim)
    diffs = compare_compiled(
        model.blocks[1], args, kwargs, settings=CompileSettings(backend="aot_eager"), autocast_dtype=None
    )
    assert "args[0]" in diffs and "args[1]" in diffs  # the hidden states and the time embedding
    assert max(diffs.values()) < 1e-4
    with pytest.raises(RuntimeError, match="never called the DiTBlock"):
        capture_inputs(model.blocks[0], lambda: None)


def test_inputs_captured_from_diffusers_wan_check_its_block():
    pytest.importorskip("diffusers")
    from _tiny_models import tiny_wan

    model = tiny_wan(seed=0, attention_head_dim=16, text_dim=8).train()
    cfg = model.config
    x = torch.randn(1, cfg.in_channels, 3, 8, 8)
    ctx = torch.randn(1, 7, cfg.text_dim)
    args, kwargs = capture_inputs(
        model.blocks[0],
        lambda: model(
            hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=ctx, return_dict=False
        ),
    )
    diffs = compare_compiled(
        model.blocks[0],
        args,
        kwargs,
        settings=CompileSettings(backend="aot_eager"),
        autocast_dtype=None,
        ignore=["k.bias"],
    )
    assert "scale_shift_table" in diffs  # the shared modulation table that pytorch/pytorch#193061 hit
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]


# ------------------------------------------------------------------------------------------- CompileSettings


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dynamic="yes"), "dynamic"),
        (dict(backend=""), "backend"),
        (dict(mode="fastest"), "mode"),
        (dict(options={1: True}), "options"),
    ],
)
def test_compile_settings_reject_each_bad_value_once(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        CompileSettings(**kwargs)
    assert err.traceback[-1].name == "__post_init__"  # the one error site
    assert repr(next(iter(kwargs.values()))) in str(err.value)
    with pytest.raises(TypeError, match="unexpected keyword argument"):  # settings=CompileSettings(...) only
        compare_compiled(nn.Linear(2, 2), (torch.randn(1, 2),), autocast_dtype=None, **kwargs)


def test_compile_settings_are_frozen_and_keyword_only():
    settings = CompileSettings(options={"a": 1})
    assert settings.options == {"a": 1} and settings.backend == "inductor" and settings.dynamic is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.backend = "eager"  # type: ignore[misc]
    with pytest.raises(TypeError):
        CompileSettings(True)  # type: ignore[misc]


def test_compare_compiled_takes_its_settings_as_one_object():
    torch.manual_seed(0)
    module = _WrongWhenCompiled()
    x = torch.randn(5, 4, requires_grad=True)
    got = compare_compiled(module, (x, 2.0), settings=CompileSettings(backend="aot_eager"), autocast_dtype=None)
    assert got["lin.weight"] > 0.2
    with pytest.raises(TypeError, match="unexpected keyword argument 'backend'"):
        compare_compiled(module, (x, 2.0), backend="aot_eager")  # type: ignore[call-arg]

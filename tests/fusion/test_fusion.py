"""CPU tests of the fusion pass (fusion/): the swap is exact, reversible, state_dict-neutral and visible in the report.

On CPU ``layer_norm_modulate`` is the plain-PyTorch reference, so fused and original models must agree
within fp32 rounding. Every comparison also counts the calls to the op, so a test cannot pass because the
swap silently did nothing.
"""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from _paths import ROOT
from _tiny_models import tiny_wan
from torch import nn

import lightning_adaptiveload
import lightning_adaptiveload.ops as ops
from lightning_adaptiveload import fusion
from lightning_adaptiveload.fusion import (
    FusedNormModulateMixin,
    FusionAdapter,
    FusionError,
    FusionReport,
    ReplaceForward,
    fuse_norm_modulate,
    register_fusion_adapter,
    unfuse_norm_modulate,
    unregister_fusion_adapter,
)
from lightning_adaptiveload.fusion import registry as fusion_registry

DOCS = ROOT / "docs" / "fusion.md"


# ------------------------------------------------------------------------------------------------------
# A DiT in the style of facebookresearch/DiT (models.py), written for these tests.
# ------------------------------------------------------------------------------------------------------


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, affine: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=affine, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=affine, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim)
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(
            6, dim=1
        )
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class TinyDiT(nn.Module):
    """x (B, S, in_dim), t (B,) -> (B, S, in_dim). adaLN layers keep their random init (not adaLN-Zero), so
    a fused forward that drops a gate or a shift gives a different answer."""

    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 4, in_dim: int = 8, affine: bool = False):
        super().__init__()
        self.x_embedder = nn.Linear(in_dim, dim)
        self.t_embedder = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, affine) for _ in range(depth))
        self.final_layer = FinalLayer(dim, in_dim)

    def forward(self, x, t):
        c = self.t_embedder(t[:, None])
        h = self.x_embedder(x)
        for block in self.blocks:
            h = block(h, c)
        return self.final_layer(h, c)


def _dit_inputs(batch: int = 2, seq: int = 6, in_dim: int = 8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, seq, in_dim, generator=g), torch.rand(batch, generator=g))


# ------------------------------------------------------------------------------------------------------
# A tiny random diffusers Wan (no download).
# ------------------------------------------------------------------------------------------------------

_WAN_SHAPE = (2, 4, 3, 4, 4)  # (B, C, F, H, W) -> S = 3 * 2 * 2 = 12 tokens with patch (1, 2, 2)
_WAN_SEQ = 12


def _tiny_wan(**overrides):
    return tiny_wan(seed=0, **{"rope_max_seq_len": 32, **overrides})


def _wan_inputs(modulation: str = "per_sample", image: bool = False):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*_WAN_SHAPE, generator=g)
    if modulation == "per_token":  # Wan 2.2 TI2V: one timestep per token
        t = torch.randint(0, 1000, (_WAN_SHAPE[0], _WAN_SEQ), generator=g)
    else:
        t = torch.randint(0, 1000, (_WAN_SHAPE[0],), generator=g)
    # The I2V processor assumes the last 512 context tokens are text.
    text = torch.randn(_WAN_SHAPE[0], 512 if image else 5, 16, generator=g)
    kwargs = {"encoder_hidden_states_image": torch.randn(_WAN_SHAPE[0], 3, 8, generator=g)} if image else {}
    return (x, t, text), kwargs


# ------------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------------


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls to ops.layer_norm_modulate (the fused paths look it up at call time)."""
    calls: list[tuple[int, ...]] = []
    real = ops.layer_norm_modulate

    def counting(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(ops, "layer_norm_modulate", counting)
    return calls


@pytest.fixture
def rms_calls(monkeypatch):
    """Counts calls to ops.rms_norm_modulate (the fused RMSNorm sites look it up at call time)."""
    calls: list[tuple[int, ...]] = []
    real = ops.rms_norm_modulate

    def counting(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(ops, "rms_norm_modulate", counting)
    return calls


def _output(out):
    return out.sample if hasattr(out, "sample") else out


def _forward_backward(model: nn.Module, args, kwargs=None):
    """Output and gradients (of parameters and float inputs) of sum(out * fixed random weights)."""
    model.zero_grad(set_to_none=True)
    args = tuple(a.clone().requires_grad_(True) if a.is_floating_point() else a for a in args)
    out = _output(model(*args, **(kwargs or {})))
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input{i}": a.grad.detach().clone() for i, a in enumerate(args) if a.grad is not None})
    return out.detach(), grads


def _assert_same_training_signal(original: nn.Module, fused: nn.Module, args, kwargs=None, tol=1e-5):
    out_o, grads_o = _forward_backward(original, args, kwargs)
    out_f, grads_f = _forward_backward(fused, args, kwargs)
    torch.testing.assert_close(out_f, out_o, rtol=tol, atol=tol)
    assert grads_f.keys() == grads_o.keys() and len(grads_o) > 0
    for name in grads_o:
        torch.testing.assert_close(
            grads_f[name], grads_o[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _instance_dicts(model: nn.Module) -> dict[str, set[str]]:
    return {name: set(m.__dict__) for name, m in model.named_modules()}


@pytest.fixture
def user_adapters():
    """Removes every adapter a test registers."""
    before = list(fusion_registry._USER)
    yield
    for entry in list(fusion_registry._USER):
        if entry not in before:
            unregister_fusion_adapter(entry.adapter)


# ------------------------------------------------------------------------------------------------------
# facebookresearch/DiT-style blocks
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [False, True], ids=["no-affine", "affine"])
def test_dit_style_outputs_and_grads_match(op_calls, affine):
    torch.manual_seed(0)
    original = TinyDiT(affine=affine)
    if affine:  # not the identity affine, so that passing weight and bias to the op is exercised
        with torch.no_grad():
            for m in original.modules():
                if isinstance(m, nn.LayerNorm) and m.weight is not None:
                    m.weight.normal_(1.0, 0.2)
                    m.bias.normal_(0.0, 0.2)
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)

    assert report.modules == {"DiTBlock": 2, "FinalLayer": 1}
    assert report.sites == {"DiTBlock": 4, "FinalLayer": 1}
    assert report.adapters == {"DiTBlock": "dit-block", "FinalLayer": "dit-final-layer"}
    assert report.checks["DiTBlock"].startswith("matches the original")
    assert not report.skipped and not report.unrecognized
    op_calls.clear()
    _assert_same_training_signal(original, fused, _dit_inputs())
    assert len(op_calls) == 5  # 2 blocks x 2 sites + the final layer, all through the op


def test_dit_style_is_recognised_by_structure_not_name(op_calls):
    # Same structure under another class name: still recognised.
    renamed = type("AdaLNZeroBlock", (DiTBlock,), {"forward": DiTBlock.forward})
    model = nn.ModuleList([renamed(16, 2)])
    report = fuse_norm_modulate(model)
    assert report.modules == {"AdaLNZeroBlock": 1}
    x, c = torch.randn(2, 3, 16), torch.randn(2, 16)
    op_calls.clear()
    model[0](x, c)
    assert len(op_calls) == 2


def test_dit_style_lookalikes_are_skipped_with_reasons():
    class FourChunks(DiTBlock):
        def __init__(self):
            super().__init__(16, 2)
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(16, 4 * 16))

    class ExtraArg(DiTBlock):
        def forward(self, x, c, mask=None):
            return super().forward(x, c)

    class Group(DiTBlock):
        def __init__(self):
            super().__init__(16, 2)
            self.norm1 = nn.GroupNorm(1, 16)

    model = nn.ModuleDict({"a": FourChunks(), "b": ExtraArg(16, 2), "c": Group()})
    report = fuse_norm_modulate(model, allow_empty=True)
    reasons = {s.name: s.reason for s in report.skipped}
    assert "6 chunks" in reasons["a"] and "out_features=64" in reasons["a"]
    assert "(x, c, mask)" in reasons["b"]
    assert "norm1 is GroupNorm" in reasons["c"] and "RMSNorm" in reasons["c"]  # says what would do
    assert report.num_modules == 0
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_dit_style_with_rmsnorm_fuses_through_the_rms_op(op_calls, rms_calls):
    class RMS(DiTBlock):
        def __init__(self):
            super().__init__(16, 2)
            self.norm1 = nn.RMSNorm(16, eps=1e-6)

    torch.manual_seed(0)
    block = RMS()
    reference = copy.deepcopy(block)
    report = fuse_norm_modulate(block)
    assert report.sites == {"RMS": 2} and report.probes["RMS"].status == "ok"
    rms_calls.clear(), op_calls.clear()  # the probe's calls
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 5, 16, generator=g), torch.randn(2, 16, generator=g))
    _assert_same_training_signal(reference, block, args)
    assert len(rms_calls) == 1 and len(op_calls) == 1  # norm1 through rms_norm_modulate, norm2 through LN


# ------------------------------------------------------------------------------------------------------
# diffusers WanTransformer3DModel
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "modulation", ["per_sample", "per_token"], ids=["wan2.1-per-sample", "wan2.2-per-token"]
)
def test_wan_outputs_and_grads_match(op_calls, modulation):
    original = _tiny_wan()
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)

    assert report.modules == {"WanTransformerBlock": 2} and report.sites == {"WanTransformerBlock": 4}
    assert report.checks["WanTransformerBlock"].startswith("matches the original")
    assert [s.cls for s in report.skipped] == ["WanTransformer3DModel"]  # the output head, with a reason
    assert "norm_out" in report.skipped[0].reason
    args, kwargs = _wan_inputs(modulation)
    op_calls.clear()
    _assert_same_training_signal(original, fused, args, kwargs)
    layout = (_WAN_SHAPE[0], _WAN_SEQ, 24)
    assert op_calls == [layout] * 4


def test_wan_i2v_image_context_matches(op_calls):
    original = _tiny_wan(image_dim=8, added_kv_proj_dim=24)
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)
    assert report.modules == {"WanTransformerBlock": 2}
    # The image embedder holds LayerNorms without modulation: listed, not touched.
    assert report.unrecognized == {"WanImageEmbedding": 1}
    args, kwargs = _wan_inputs(image=True)
    op_calls.clear()
    _assert_same_training_signal(original, fused, args, kwargs)
    assert len(op_calls) == 4


def _bf16_like_from_pretrained(model: nn.Module) -> nn.Module:
    """bf16 weights, with diffusers' _keep_in_fp32_modules (norms, scale_shift_table, rope) left in fp32."""
    keep = set(model._keep_in_fp32_modules)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.bfloat16()
    return model


def test_wan_bf16_matches_and_keeps_dtypes(op_calls):
    original = _bf16_like_from_pretrained(_tiny_wan())
    assert original.blocks[0].scale_shift_table.dtype == torch.float32
    assert original.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)
    assert report.checks["WanTransformerBlock"].startswith("matches the original")
    op_calls.clear()
    (x, t, text), _ = _wan_inputs()
    args = (x.bfloat16(), t, text.bfloat16())
    with torch.no_grad():
        out_o = _output(original(*args))
        out_f = _output(fused(*args))
    assert out_f.dtype == out_o.dtype == torch.bfloat16
    # Both paths normalise and modulate in fp32 and cast once: the same bf16 result.
    torch.testing.assert_close(out_f, out_o, rtol=1e-2, atol=1e-2)
    assert len(op_calls) == 4


def test_wan_gradient_checkpointing_matches(op_calls):
    original = _tiny_wan()
    original.enable_gradient_checkpointing()
    fused = copy.deepcopy(original)
    fuse_norm_modulate(fused)
    args, kwargs = _wan_inputs("per_token")
    op_calls.clear()
    _assert_same_training_signal(original, fused, args, kwargs)
    assert len(op_calls) == 8  # 4 sites, run again in the backward's recomputation


def test_wan_version_drift_is_skipped_with_reason():
    model = _tiny_wan()
    model.blocks[0].norm3 = nn.Identity()  # what a changed diffusers block could look like
    del model.blocks[1].scale_shift_table
    report = fuse_norm_modulate(model, allow_empty=True)
    reasons = {s.name: s.reason for s in report.skipped}
    assert "diffusers" in reasons["blocks.0"] and "norm3 is Identity" in reasons["blocks.0"]
    assert "scale_shift_table" in reasons["blocks.1"]
    assert report.num_modules == 0
    with pytest.raises(FusionError, match="blocks.0 \\(WanTransformerBlock\\).*norm3"):
        fuse_norm_modulate(model)


def test_wan_subclass_overriding_forward_is_skipped():
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    class MyWanBlock(WanTransformerBlock):
        def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
            return super().forward(hidden_states, encoder_hidden_states, temb, rotary_emb) * 2

    model = _tiny_wan()
    old = model.blocks[1]
    model.blocks[1] = MyWanBlock(24, 32, 2, cross_attn_norm=True)
    model.blocks[1].load_state_dict(old.state_dict())
    report = fuse_norm_modulate(model)
    assert report.modules == {"WanTransformerBlock": 1}
    (skip,) = [s for s in report.skipped if s.cls == "MyWanBlock"]
    assert "overrides forward" in skip.reason


def test_wan_diffusers_hooks_are_respected(op_calls):
    from diffusers.hooks import HookRegistry, ModelHook

    # A hook added before fusing: that block is skipped, since replacing forward would drop the hook.
    model = _tiny_wan()
    HookRegistry.check_if_exists_or_initialize(model.blocks[0]).register_hook(ModelHook(), "before")
    report = fuse_norm_modulate(model)
    assert report.modules == {"WanTransformerBlock": 1}
    assert any(s.name == "blocks.0" and "already replaced" in s.reason for s in report.skipped)

    # A hook added after fusing wraps the fused forward; unfuse waits until the hook is removed.
    model = _tiny_wan()
    fuse_norm_modulate(model)
    registry = HookRegistry.check_if_exists_or_initialize(model.blocks[0])
    registry.register_hook(ModelHook(), "after")
    args, kwargs = _wan_inputs()
    op_calls.clear()
    with torch.no_grad():
        model(*args, **kwargs)
    assert len(op_calls) == 4
    with pytest.warns(UserWarning, match="left fused"):
        assert unfuse_norm_modulate(model).modules == {"WanTransformerBlock": 1}
    registry.remove_hook("after")
    assert unfuse_norm_modulate(model).modules == {"WanTransformerBlock": 1}
    assert all("forward" not in b.__dict__ for b in model.blocks)


# ------------------------------------------------------------------------------------------------------
# Our reference DiT (models/video_dit.py)
# ------------------------------------------------------------------------------------------------------


def _video_dit():
    video_dit = pytest.importorskip(
        "lightning_adaptiveload.models.video_dit", reason="models/video_dit.py (reference DiT) not present"
    )
    if not hasattr(video_dit, "NormModulate"):
        pytest.skip("models/video_dit.py has no NormModulate class: the fusion contract is not implemented")
    torch.manual_seed(0)
    return video_dit.VideoDiT(video_dit.VideoDiTConfig.preset("tiny", num_layers=2))


def _video_inputs():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, 2, 4, 4, generator=g)
    t = torch.rand(2, generator=g) * 1000
    text = torch.randn(2, 3, 32, generator=g)
    return (x, t, text), {}


def test_reference_dit_flags_flip_and_match(op_calls):
    original = _video_dit()
    with torch.no_grad():  # the head starts at zero (predicts 0); give it weights so gradients flow
        original.head.head.weight.normal_(0, 0.05)
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)
    norm_modulates = [m for m in fused.modules() if type(m).__name__ == "NormModulate"]
    assert report.modules == {"NormModulate": len(norm_modulates)} == {"NormModulate": 2 * 2 + 1}
    assert report.adapters == {"NormModulate": "video-dit-norm-modulate"}
    assert all(m.fused for m in norm_modulates)
    assert not report.unrecognized  # the blocks' cross-attention LayerNorm sits beside fused sites
    args, kwargs = _video_inputs()
    op_calls.clear()
    _assert_same_training_signal(original, fused, args, kwargs)
    assert len(op_calls) == 5

    restored = unfuse_norm_modulate(fused)
    assert restored.modules == {"NormModulate": 5}
    assert not any(m.fused for m in norm_modulates)


def test_reference_dit_built_fused_is_left_alone():
    model = _video_dit()
    model.head.norm.fused = True  # built fused by its owner
    report = fuse_norm_modulate(model)
    assert report.modules == {"NormModulate": 4} and report.already_fused == {"NormModulate": 1}
    back = unfuse_norm_modulate(model)
    assert back.modules == {"NormModulate": 4} and back.already_fused == {"NormModulate": 1}
    assert model.head.norm.fused is True and model.blocks[0].norm1.fused is False


# ------------------------------------------------------------------------------------------------------
# Reversibility and state_dict, for every architecture
# ------------------------------------------------------------------------------------------------------

_ARCHITECTURES = {
    "dit-style": (lambda: TinyDiT(), lambda: (_dit_inputs(), {})),
    "diffusers-wan": (lambda: _tiny_wan(), lambda: _wan_inputs("per_token")),
    "reference-dit": (lambda: _video_dit(), _video_inputs),
}


@pytest.mark.parametrize("arch", list(_ARCHITECTURES))
def test_state_dict_round_trip_both_ways(arch):
    build, inputs = _ARCHITECTURES[arch]
    torch.manual_seed(0)
    unfused = build()
    fused = copy.deepcopy(unfused)
    before = unfused.state_dict()
    fuse_norm_modulate(fused)
    after = fused.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)

    # fused -> unfused: a fresh unfused model (other weights) loads the fused model's state strictly.
    torch.manual_seed(123)
    fresh_unfused = build()
    fresh_unfused.load_state_dict(fused.state_dict(), strict=True)
    # unfused -> fused: a fresh model fused first, then loaded from the unfused one.
    torch.manual_seed(456)
    fresh_fused = build()
    fuse_norm_modulate(fresh_fused)
    fresh_fused.load_state_dict(unfused.state_dict(), strict=True)

    args, kwargs = inputs()
    with torch.no_grad():
        ref = _output(unfused(*args, **kwargs))
        for other in (fused, fresh_unfused, fresh_fused):
            torch.testing.assert_close(_output(other(*args, **kwargs)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", list(_ARCHITECTURES))
def test_unfuse_restores_exactly(arch, op_calls):
    build, inputs = _ARCHITECTURES[arch]
    model = build()
    dicts = _instance_dicts(model)
    flags = {n: m.fused for n, m in model.named_modules() if hasattr(m, "fused")}
    fused = fuse_norm_modulate(model)
    restored = unfuse_norm_modulate(model)
    assert restored.modules == fused.modules and restored.sites == fused.sites
    assert _instance_dicts(model) == dicts  # no patched forward, no record left behind
    assert {n: m.fused for n, m in model.named_modules() if hasattr(m, "fused")} == flags
    args, kwargs = inputs()
    op_calls.clear()
    with torch.no_grad():
        model(*args, **kwargs)
    assert op_calls == []
    assert unfuse_norm_modulate(model).num_modules == 0  # nothing left to undo


def test_fuse_is_idempotent():
    model = TinyDiT()
    fuse_norm_modulate(model)
    patched = [m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__]
    again = fuse_norm_modulate(model)
    assert again.num_modules == 0 and again.already_fused == {"DiTBlock": 2, "FinalLayer": 1}
    assert again.found
    assert [m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__] == patched
    assert "already fused: DiTBlock x2, FinalLayer x1" in str(again)


def test_deepcopy_and_pickle_keep_the_swap(op_calls):
    model = TinyDiT()
    fuse_norm_modulate(model)
    args = _dit_inputs()
    with torch.no_grad():
        ref = model(*args)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        block = clone.blocks[0]
        assert block.forward.args[0] is block  # bound to the copy, not to the original
        op_calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(clone(*args), ref)
        assert len(op_calls) == 5
        assert unfuse_norm_modulate(clone).num_modules == 3
    assert "fused forward _dit_block_forward_fused of DiTBlock" in repr(model.blocks[0].forward)


def test_torch_compile_traces_the_fused_forward_without_graph_breaks(op_calls):
    model = TinyDiT()
    fuse_norm_modulate(model)
    args = _dit_inputs()
    with torch.no_grad():
        ref = model(*args)
        op_calls.clear()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(*args), ref)
    assert len(op_calls) == 5  # traced through the op


def test_fusing_after_a_compiled_call_recompiles(op_calls):
    model = TinyDiT()
    args = _dit_inputs()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        ref = compiled(*args)
        fuse_norm_modulate(model)
        op_calls.clear()
        torch.testing.assert_close(compiled(*args), ref)
        assert len(op_calls) == 5  # dynamo's guard on forward saw the swap; no stale graph
        unfuse_norm_modulate(model)
        op_calls.clear()
        torch.testing.assert_close(compiled(*args), ref)
        assert op_calls == []


# ------------------------------------------------------------------------------------------------------
# Guards: things that must be skipped, refused or reported
# ------------------------------------------------------------------------------------------------------


class _PlainBlock(nn.Module):
    """A block with a LayerNorm that no adapter knows."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.ada = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x, c):
        shift, scale, gate = self.ada(c).unsqueeze(1).chunk(3, dim=-1)
        return x + gate * self.mlp(self.ln(x) * (1 + scale) + shift)


def test_nothing_found_raises_naming_block_classes():
    model = nn.Sequential(nn.Linear(16, 16), _PlainBlock(), _PlainBlock())
    with pytest.raises(FusionError) as err:
        fuse_norm_modulate(model)
    message = str(err.value)
    assert "Sequential" in message and "_PlainBlock (x2)" in message
    assert "register_fusion_adapter" in message and "allow_empty=True" in message
    report = fuse_norm_modulate(model, allow_empty=True)
    assert not report.found and report.unrecognized == {"_PlainBlock": 2}
    assert "not recognised" in str(report) and "_PlainBlock x2" in str(report)


def test_nothing_found_without_any_layernorm_names_the_blocks():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.raises(FusionError, match="holds no nn.LayerNorm or RMSNorm module.*Linear"):
        fuse_norm_modulate(model)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        fuse_norm_modulate("model")
    with pytest.raises(TypeError, match="nn.Module"):
        unfuse_norm_modulate(None)
    with pytest.raises(TypeError, match="target must be a class or a predicate"):
        register_fusion_adapter(3, lambda m, x: x)
    with pytest.raises(TypeError, match="adapter must be a fused forward function or a FusionAdapter"):
        register_fusion_adapter(_PlainBlock, "forward")
    with pytest.raises(FusionError, match="not registered"):
        unregister_fusion_adapter(ReplaceForward(lambda m, x: x))


def test_forward_patched_by_someone_else_is_skipped():
    model = TinyDiT()
    hooked = model.blocks[0]
    hooked.forward = lambda x, c: DiTBlock.forward(hooked, x, c)  # e.g. a diffusers or accelerate hook
    report = fuse_norm_modulate(model)
    (skip,) = report.skipped
    assert skip.name == "blocks.0" and "already replaced on this instance" in skip.reason
    assert report.modules == {"DiTBlock": 1, "FinalLayer": 1}


def test_unfuse_leaves_a_rewrapped_forward_and_warns():
    model = TinyDiT()
    fuse_norm_modulate(model)
    block = model.blocks[1]
    inner = block.forward
    block.forward = lambda x, c: inner(x, c)  # wrapped again after fusing
    with pytest.warns(UserWarning, match="blocks.1 \\(DiTBlock\\) left fused"):
        report = unfuse_norm_modulate(model)
    assert [s.name for s in report.skipped] == ["blocks.1"]
    assert report.modules == {"DiTBlock": 1, "FinalLayer": 1}
    assert "forward" in block.__dict__


def test_probe_rejects_a_wrong_fused_forward(user_adapters):
    def forgot_the_gate(block, x, c):
        shift, scale, gate = block.ada(c).unsqueeze(1).chunk(3, dim=-1)
        return x + block.mlp(
            ops.layer_norm_modulate(x, shift, scale, block.ln.weight, block.ln.bias, block.ln.eps)
        )

    def probe(block, generator):
        return [((torch.randn(2, 3, 16, generator=generator), torch.randn(2, 16, generator=generator)), {})]

    register_fusion_adapter(_PlainBlock, forgot_the_gate, sites=1, probe=probe)
    model = nn.Sequential(_PlainBlock(), _PlainBlock())
    report = fuse_norm_modulate(model, allow_empty=True)
    assert report.num_modules == 0 and len(report.skipped) == 2
    assert "differs from the original" in report.skipped[0].reason
    # verify=False trusts the adapter (the user's responsibility).
    assert fuse_norm_modulate(model, verify=False).num_modules == 2


def test_probe_leaves_rng_and_training_flags_alone():
    model = TinyDiT()
    model.blocks[0].mlp.eval()  # a mixed state the probe must restore exactly
    flags = {n: m.training for n, m in model.named_modules()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    fuse_norm_modulate(model)
    assert torch.equal(torch.rand(3), expected)
    assert {n: m.training for n, m in model.named_modules()} == flags


def test_meta_device_model_is_fused_without_probe():
    with torch.device("meta"):
        model = TinyDiT()
    report = fuse_norm_modulate(model)
    assert report.modules == {"DiTBlock": 2, "FinalLayer": 1}
    assert report.checks["DiTBlock"] == "not checked: its parameters are on the meta device (deferred init)"


def test_report_reads_well():
    model = nn.ModuleDict({"dit": TinyDiT(), "plain": _PlainBlock()})
    model["dit"].blocks[1].norm1 = nn.GroupNorm(1, 32)
    report = fuse_norm_modulate(model)
    text = str(report)
    assert text.splitlines()[0] == (
        "fuse_norm_modulate(ModuleDict): 3 norm+modulate site(s) in 2 module(s) now run through the fused ops"
    )
    assert re.search(r"DiTBlock: 1 module\(s\), 2 site\(s\) \[adapter: dit-block; probe: matches", text)
    assert "dit.blocks.1 (DiTBlock): norm1 is GroupNorm" in text
    assert "_PlainBlock x1" in text
    assert isinstance(report, FusionReport) and report.as_dict()["skipped"][0]["name"] == "dit.blocks.1"


# ------------------------------------------------------------------------------------------------------
# User adapters
# ------------------------------------------------------------------------------------------------------


def _plain_fused(block, x, c):
    shift, scale, gate = block.ada(c).unsqueeze(1).chunk(3, dim=-1)
    h = ops.layer_norm_modulate(x, shift, scale, block.ln.weight, block.ln.bias, block.ln.eps)
    return x + gate * block.mlp(h)


def test_register_adapter_for_a_class(user_adapters, op_calls):
    adapter = register_fusion_adapter(_PlainBlock, _plain_fused, name="plain", sites=1)
    assert isinstance(adapter, ReplaceForward) and adapter.name == "plain"
    torch.manual_seed(0)
    original = nn.Sequential(_PlainBlock(), _PlainBlock())
    fused = copy.deepcopy(original)
    report = fuse_norm_modulate(fused)
    assert report.modules == {"_PlainBlock": 2} and report.checks == {"_PlainBlock": "no probe"}
    x, c = torch.randn(2, 5, 16), torch.randn(2, 16)

    class Seq(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, c):
            for block in self.inner:
                x = block(x, c)
            return x

    op_calls.clear()
    _assert_same_training_signal(Seq(original), Seq(fused), (x, c))
    assert len(op_calls) == 2

    class Sub(_PlainBlock):
        def forward(self, x, c):
            return super().forward(x, c) + 1

    report = fuse_norm_modulate(nn.Sequential(Sub()), allow_empty=True)
    assert "Sub overrides forward" in report.skipped[0].reason


def test_register_adapter_with_a_predicate_and_priority(user_adapters):
    # A user adapter wins over the built-in DiT one, the most recent first.
    first = register_fusion_adapter(
        lambda m: isinstance(m, DiTBlock), DiTBlock.forward, name="first", sites=2
    )
    second = register_fusion_adapter(
        lambda m: isinstance(m, DiTBlock), DiTBlock.forward, name="second", sites=2
    )
    report = fuse_norm_modulate(TinyDiT())
    assert report.adapters["DiTBlock"] == "second" and report.adapters["FinalLayer"] == "dit-final-layer"
    unregister_fusion_adapter(second)
    report = fuse_norm_modulate(TinyDiT())
    assert report.adapters["DiTBlock"] == "first"
    unregister_fusion_adapter(first)
    assert fuse_norm_modulate(TinyDiT()).adapters["DiTBlock"] == "dit-block"


def test_register_a_fusion_adapter_subclass(user_adapters):
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(4)
            self.use_kernel = False

    class SwitchAdapter(FusionAdapter):
        name = "switch"

        def fuse(self, module):
            module.use_kernel = True
            return "was off"

        def unfuse(self, module, state):
            assert state == "was off"
            module.use_kernel = False

    register_fusion_adapter(Switch, SwitchAdapter())
    model = nn.Sequential(Switch())
    assert fuse_norm_modulate(model).adapters == {"Switch": "switch"} and model[0].use_kernel
    assert unfuse_norm_modulate(model).modules == {"Switch": 1} and not model[0].use_kernel


def test_docs_custom_adapter_example_runs(user_adapters, op_calls):
    text = DOCS.read_text()
    match = re.search(r"<!-- tested: custom-adapter -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{DOCS} lost its tested custom-adapter example"
    exec(compile(match.group(1), str(DOCS), "exec"), {"__name__": "docs_example"})
    assert len(op_calls) > 0


def test_docs_norm_adapter_example_runs(user_adapters, rms_calls):
    text = DOCS.read_text()
    match = re.search(r"<!-- tested: norm-adapter -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{DOCS} lost its tested norm-adapter example"
    exec(compile(match.group(1), str(DOCS), "exec"), {"__name__": "docs_example"})
    assert len(rms_calls) > 0  # the probe ran the fused forward through the RMSNorm op


# ------------------------------------------------------------------------------------------------------
# FusedNormModulateMixin in Lightning
# ------------------------------------------------------------------------------------------------------

L = pytest.importorskip("lightning")


def _loader():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.randn(4, 6, 8, generator=g), torch.rand(4, generator=g), torch.randn(4, 6, 8, generator=g)
    )
    return DataLoader(data, batch_size=4)


class _PlainLit(L.LightningModule):
    """A LightningModule that builds its DiT in configure_model (the FSDP-friendly way)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed
        self.model = None
        self.configure_calls = 0

    def configure_model(self) -> None:
        self.configure_calls += 1
        if self.model is None:
            torch.manual_seed(self.seed)
            self.model = TinyDiT()

    def training_step(self, batch, batch_idx):
        x, t, y = batch
        return F.mse_loss(self.model(x, t), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return _loader()


class _FusedLit(FusedNormModulateMixin, _PlainLit):
    """Style 1: the mixin in front of an existing module class."""


class _OwnConfigureLit(FusedNormModulateMixin, L.LightningModule):
    """Style 2: the class that uses the mixin defines configure_model itself (and calls super first)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = None

    def configure_model(self) -> None:
        super().configure_model()  # must not fuse yet: the model does not exist
        if self.model is None:
            self.model = TinyDiT()

    training_step = _PlainLit.training_step
    configure_optimizers = _PlainLit.configure_optimizers
    train_dataloader = _PlainLit.train_dataloader


def _fit(module) -> None:
    trainer = L.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)


@pytest.fixture
def logged(monkeypatch):
    import lightning.pytorch.utilities as utilities

    messages: list[str] = []
    monkeypatch.setattr(utilities, "rank_zero_info", lambda msg, *a, **k: messages.append(str(msg)))
    return messages


@pytest.mark.parametrize("cls", [_FusedLit, _OwnConfigureLit], ids=["mixin-first", "own-configure_model"])
def test_mixin_fuses_in_configure_model_during_fit(cls, logged, op_calls):
    module = cls()
    _fit(module)
    report = module.fusion_report
    assert report is not None and report.modules == {"DiTBlock": 2, "FinalLayer": 1}
    assert len(logged) == 1 and logged[0] == str(report)
    assert len(op_calls) >= 5  # the training step ran through the op
    assert all("forward" in b.__dict__ for b in module.model.blocks)


def test_mixin_training_step_equals_unfused(op_calls):
    fused, plain = _FusedLit(seed=3), _PlainLit(seed=3)
    _fit(fused)
    _fit(plain)
    assert len(op_calls) >= 5
    for (name, p_f), (_, p_o) in zip(fused.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p_f, p_o, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_mixin_checkpoint_loads_into_unfused_module_and_back(tmp_path):
    fused = _FusedLit(seed=1)
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(fused)
    path = tmp_path / "fused.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    plain = _PlainLit(seed=2)
    plain.configure_model()
    plain.load_state_dict(state, strict=True)  # fused checkpoint -> unfused module
    refused = _FusedLit(seed=3)
    refused.configure_model()
    refused.load_state_dict(plain.state_dict(), strict=True)  # and back
    args = _dit_inputs()
    with torch.no_grad():
        ref = fused.model(*args)
        torch.testing.assert_close(plain.model(*args), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(refused.model(*args), ref, rtol=1e-5, atol=1e-5)


def test_mixin_configure_model_twice_is_idempotent(logged):
    module = _FusedLit()
    module.configure_model()
    patched = module.model.blocks[0].forward
    module.configure_model()
    assert module.configure_calls == 2
    assert module.model.blocks[0].forward is patched
    assert module.fusion_report.num_modules == 0
    assert module.fusion_report.already_fused == {"DiTBlock": 2, "FinalLayer": 1}


def test_mixin_options_from_class_attributes_and_kwargs():
    class Empty(FusedNormModulateMixin, L.LightningModule):
        def configure_model(self):
            self.net = nn.Sequential(nn.Linear(4, 4), _PlainBlock(4))

    # By default a model with nothing to fuse trains unfused, with a warning naming the classes to adapt.
    module = Empty()
    with pytest.warns(UserWarning, match="trains unfused: .*_PlainBlock \\(x1\\).*fuse_allow_empty = False"):
        module.configure_model()
    assert module.fusion_report.unrecognized == {"_PlainBlock": 1}
    with pytest.raises(FusionError, match="_PlainBlock"):
        Empty(fuse_allow_empty=False).configure_model()

    class Strict(Empty):
        fuse_allow_empty = False

    with pytest.raises(FusionError, match="_PlainBlock"):
        Strict().configure_model()
    off = _FusedLit()
    off.fuse_enabled = False
    off.configure_model()
    assert off.fusion_report is None and "forward" not in off.model.blocks[0].__dict__

    sub = _FusedLit(fuse_submodule="model.blocks")
    sub.configure_model()
    assert sub.fusion_report.model == "ModuleList" and sub.fusion_report.modules == {"DiTBlock": 2}
    with pytest.raises(FusionError, match="fuse_submodule='nope' names no submodule"):
        _FusedLit(fuse_submodule="nope").configure_model()


def test_mixin_composes_with_video_dit_module():
    module_py = pytest.importorskip(
        "lightning_adaptiveload.models.module", reason="module.py (VideoDiTModule) not present"
    )

    class FusedVideoDiTModule(FusedNormModulateMixin, module_py.VideoDiTModule):
        pass

    module = FusedVideoDiTModule(preset="tiny", fuse_verify=False)
    module.configure_model()
    assert module.fusion_report.modules == {"NormModulate": 2 * module.model_config.num_layers + 1}
    assert module.fusion_report.checks == {}
    assert all(m.fused for m in module.model.modules() if type(m).__name__ == "NormModulate")


def test_public_exports():
    for name in (
        "fuse_norm_modulate",
        "unfuse_norm_modulate",
        "FusedNormModulateMixin",
        "register_fusion_adapter",
    ):
        assert getattr(lightning_adaptiveload, name) is getattr(fusion, name)

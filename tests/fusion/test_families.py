"""The fusion pass on the nine diffusers families (tiny random configs, every weight random): exact on CPU.

For Wan, SD3 (and SD3.5 with dual attention), Flux, CogVideoX, LTX-Video (RMSNorm), HunyuanVideo, PixArt,
DiT and Sana: ``fuse_norm_modulate`` fuses sites in the classes expected, the probe ran on perturbed copies
in fp32 and bf16, fused and unfused agree in fp32 (outputs, input and parameter gradients, rtol 1e-5),
``state_dict`` keys and values are unchanged, the fused ops really ran, and ``unfuse_norm_modulate`` gives
back every module's original forward. On CPU the ops are their plain-PyTorch references, so any difference
beyond rounding is the adapter's.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _fusion_families import FAMILIES
from torch import nn

import lightning_adaptiveload.ops as ops
from lightning_adaptiveload.fusion import fuse_norm_modulate, unfuse_norm_modulate

pytest.importorskip("diffusers")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of both fused ops (LayerNorm and RMSNorm), as the fused sites look them up."""
    calls = {"layer_norm": 0, "rms_norm": 0}
    real_ln, real_rms = ops.layer_norm_modulate, ops.rms_norm_modulate

    def ln(*args, **kwargs):
        calls["layer_norm"] += 1
        return real_ln(*args, **kwargs)

    def rms(*args, **kwargs):
        calls["rms_norm"] += 1
        return real_rms(*args, **kwargs)

    monkeypatch.setattr(ops, "layer_norm_modulate", ln)
    monkeypatch.setattr(ops, "rms_norm_modulate", rms)
    return calls


def _signal(model: nn.Module, kwargs: dict, grad_inputs: tuple[str, ...]):
    """Output, and the gradients of the parameters and of ``grad_inputs`` of sum(out * fixed random weights)."""
    model.zero_grad(set_to_none=True)
    kwargs = {k: (v.clone().requires_grad_(True) if k in grad_inputs else v) for k, v in kwargs.items()}
    out = model(**kwargs, return_dict=False)[0]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"input {k}": kwargs[k].grad.clone() for k in grad_inputs})
    return out.detach(), grads


def _assert_same(reference: nn.Module, fused: nn.Module, family) -> None:
    out_r, grads_r = _signal(reference, family.kwargs, family.grad_inputs)
    out_f, grads_f = _signal(fused, family.kwargs, family.grad_inputs)
    # atol: a few gradients are zero in theory and rounding noise in practice (an attention's key bias).
    torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-5)
    assert grads_f.keys() == grads_r.keys()
    assert sum(g.abs().sum().item() > 0 for g in grads_r.values()) > len(grads_r) // 2  # a real signal
    for name, g in grads_r.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _forwards(model: nn.Module) -> dict[str, object]:
    """Each module's forward as an attribute lookup finds it (an instance forward shadows the class's)."""
    return {name: m.__dict__.get("forward", type(m).forward) for name, m in model.named_modules()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_fuses_exactly_and_reversibly(name, op_calls):
    family = FAMILIES[name]()
    model = family.model
    reference = copy.deepcopy(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forwards, attrs = _forwards(model), {n: set(m.__dict__) for n, m in model.named_modules()}

    report = fuse_norm_modulate(model)
    assert report.num_sites > 0
    assert report.sites == family.sites, str(report)
    assert not report.unfused_norms, str(report)  # no block left with a norm its adapter did not cover
    for cls in report.modules:  # every fused class was probed on perturbed copies, in fp32 and bf16
        probe = report.probes[cls]
        assert probe.status == "ok" and probe.dtypes == ["float32", "bfloat16"], report.checks[cls]
        assert probe.forward_error["float32"] <= 1e-4 and probe.grad_error["float32"] <= 1e-3
        assert report.checks[cls].startswith("matches the original forward and gradients on a perturbed copy")
    json.dumps(report.as_dict())

    # State dict: the same keys, the same values, fused.
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], v) for k, v in state.items())

    op_calls.update(layer_norm=0, rms_norm=0)  # the probe's calls
    _assert_same(reference, model, family)
    # The fused sites ran (more calls: shared norms, sites in two calls; fewer: sites the forward skips).
    assert sum(op_calls.values()) >= report.num_sites - family.idle_sites
    assert op_calls["rms_norm"] == family.rms_calls  # the RMSNorm sites (LTX-Video's, Mochi's)

    undone = unfuse_norm_modulate(model)
    assert undone.sites == report.sites
    assert _forwards(model) == forwards  # the original forward objects, nothing left on the instances
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == attrs
    with torch.no_grad():
        torch.testing.assert_close(
            model(**family.kwargs, return_dict=False)[0], reference(**family.kwargs, return_dict=False)[0],
            rtol=0, atol=0,
        )  # fmt: skip


@pytest.mark.parametrize("name", ["sd3", "ltx-video", "sana"])
def test_family_fused_checkpoint_loads_unfused_and_back(name):
    family = FAMILIES[name]()
    fused = family.model
    fuse_norm_modulate(fused, verify=False)
    plain = FAMILIES[name]().model
    moved = {k: v + 0.01 for k, v in fused.state_dict().items() if v.is_floating_point()}
    plain.load_state_dict({**fused.state_dict(), **moved}, strict=True)  # fused keys -> unfused
    fused.load_state_dict(plain.state_dict(), strict=True)  # and back
    with torch.no_grad():
        torch.testing.assert_close(
            fused(**family.kwargs, return_dict=False)[0], plain(**family.kwargs, return_dict=False)[0],
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip


def test_fusing_twice_changes_nothing():
    family = FAMILIES["flux"]()
    first = fuse_norm_modulate(family.model)
    forwards = _forwards(family.model)
    again = fuse_norm_modulate(family.model)
    assert again.num_modules == 0 and again.already_fused == first.modules
    assert _forwards(family.model) == forwards


def test_bf16_family_stays_in_its_dtype_and_close(op_calls):
    # A model in bf16 (weights and inputs): the fused sites return what the inline code returns, in dtype.
    family = FAMILIES["sd3.5"]()
    model = family.model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    kwargs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in family.kwargs.items()}
    report = fuse_norm_modulate(model)
    assert report.num_sites == sum(family.sites.values())
    with torch.no_grad():
        out, ref = model(**kwargs, return_dict=False)[0], reference(**kwargs, return_dict=False)[0]
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=5e-2, atol=5e-2)


def _block_inputs(block: nn.Module, model: nn.Module, family) -> tuple[tuple, dict]:
    """The inputs the model gives its first block, captured by a forward pre-hook."""
    seen: dict = {}

    def capture(module, args, kwargs):
        seen.setdefault("inputs", (args, kwargs))

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        model(**family.kwargs, return_dict=False)
    handle.remove()
    return seen["inputs"]


@pytest.mark.parametrize(
    "name, blocks",
    [("sd3.5", "transformer_blocks"), ("ltx-video", "transformer_blocks"), ("sana", "transformer_blocks"),
     ("flux", "transformer_blocks"), ("pixart", "transformer_blocks"), ("qwen-image-edit", "transformer_blocks"),
     ("flux2", "transformer_blocks"), ("flux2", "single_transformer_blocks"),
     ("hunyuanvideo-i2v", "transformer_blocks"), ("longcat-image", "transformer_blocks"),
     ("bria", "transformer_blocks"), ("motif-video", "transformer_blocks"), ("auraflow", "joint_transformer_blocks"),
     ("auraflow", "single_transformer_blocks"), ("mochi", "transformer_blocks"), ("lumina2", "layers"), ("chroma", "transformer_blocks"), ("skyreels-v2", "blocks"), ("wan-vace", "vace_blocks"), ("sana-video", "transformer_blocks"), ("helios", "blocks")],
)  # fmt: skip
def test_fused_blocks_compile_without_graph_breaks(name, blocks, op_calls):
    family = FAMILIES[name]()
    fuse_norm_modulate(family.model)
    block = getattr(family.model, blocks)[0]
    args, kwargs = _block_inputs(block, family.model, family)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = block(*args, **kwargs)
        op_calls.update(layer_norm=0, rms_norm=0)
        out = torch.compile(block, backend="eager", fullgraph=True)(*args, **kwargs)
    for r, o in zip(ref if isinstance(ref, tuple) else (ref,), out if isinstance(out, tuple) else (out,)):
        if r is not None:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    assert sum(op_calls.values()) > 0  # traced through the ops


def _norm_classes():
    """Norm classes and block variants the nine tiny families do not reach, built on their own."""
    normalization = pytest.importorskip("diffusers.models.normalization")
    attention = pytest.importorskip("diffusers.models.attention")
    hunyuan = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video")
    sd3 = pytest.importorskip("diffusers.models.transformers.transformer_sd3")
    basic = attention.BasicTransformerBlock
    return {
        "token-replace": (lambda: hunyuan.HunyuanVideoTokenReplaceAdaLayerNormZero(16), 2),
        "token-replace-single": (lambda: hunyuan.HunyuanVideoTokenReplaceAdaLayerNormZeroSingle(16), 2),
        "cogview3plus": (lambda: normalization.CogView3PlusAdaLayerNormZeroTextImage(8, 16), 2),
        "ada-layer-norm-dim0": (lambda: normalization.AdaLayerNorm(16, num_embeddings=10), 1),
        "fp32-layer-norm": (lambda: normalization.AdaLayerNormZero(16, norm_type="fp32_layer_norm"), 1),
        "continuous-rms": (
            lambda: normalization.AdaLayerNormContinuous(
                16, 8, elementwise_affine=True, norm_type="rms_norm"
            ),
            1,
        ),
        "sd3-single-block": (lambda: sd3.SD3SingleTransformerBlock(16, 2, 8), 2),
        "basic-ada-norm-zero-cross": (
            lambda: basic(16, 2, 8, norm_type="ada_norm_zero", num_embeds_ada_norm=10, cross_attention_dim=8),
            2,
        ),
        "basic-ada-norm-continuous": (
            lambda: basic(
                16,
                2,
                8,
                norm_type="ada_norm_continuous",
                ada_norm_continous_conditioning_embedding_dim=8,
                ada_norm_bias=True,
            ),
            2,
        ),  # fmt: skip
    }


@pytest.mark.parametrize(
    "case",
    ["token-replace", "token-replace-single", "cogview3plus", "ada-layer-norm-dim0", "fp32-layer-norm",
     "continuous-rms", "sd3-single-block", "basic-ada-norm-zero-cross", "basic-ada-norm-continuous"],
)  # fmt: skip
def test_other_norm_classes_fuse_and_pass_the_probe(case):
    build, sites = _norm_classes()[case]
    torch.manual_seed(0)
    module = build()
    report = fuse_norm_modulate(module)
    assert report.num_sites == sites, str(report)
    for cls in report.modules:  # the probe compared each, forward and gradients, on perturbed copies
        probe = report.probes[cls]
        assert probe.status == "ok" and probe.dtypes == ["float32", "bfloat16"], report.checks[cls]
    assert unfuse_norm_modulate(module).num_sites == sites
    assert all("forward" not in m.__dict__ for m in module.modules())


def test_latte_fuses_its_ada_norm_single_blocks_and_says_why_not_for_plain_ones():
    """Latte's blocks are BasicTransformerBlocks: fused with ada_norm_single (its released config); with the
    class default, plain LayerNorms, the report says there is nothing to fuse instead of asking for an
    adapter."""
    from _fusion_families import _build, _randn

    def latte(norm_type):
        return _build(
            "LatteTransformer3DModel", num_layers=1, num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=8, sample_size=8, patch_size=2, caption_channels=16, cross_attention_dim=16,
            norm_type=norm_type, video_length=2,
        )  # fmt: skip

    plain = fuse_norm_modulate(latte("layer_norm"), allow_empty=True)
    assert plain.num_sites == 0 and not plain.unrecognized and not plain.unfused_norms, str(plain)
    reasons = {s.name: s.reason for s in plain.skipped}
    assert "not modulated" in reasons["transformer_blocks.0"] and "output head" in reasons[""]

    model = latte("ada_norm_single")
    reference = copy.deepcopy(model)
    report = fuse_norm_modulate(model)
    assert report.sites == {"BasicTransformerBlock": 4}, str(report)  # spatial and temporal, norm1 and norm2
    kwargs = dict(hidden_states=_randn(2, 4, 2, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([3, 500]))  # fmt: skip
    out_r, grads_r = _signal(reference, kwargs, ("hidden_states",))
    out_f, grads_f = _signal(model, kwargs, ("hidden_states",))
    torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-5)
    # fp32 rounding only: against float64 the fused and unfused gradients are equally far (checked by hand,
    # 1e-5 of the largest), so a looser element tolerance than the nine families' 1e-5.
    for name, g in grads_r.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

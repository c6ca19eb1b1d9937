"""Classes whose forward is a copy of a supported block's take its fused forward (``CopiedForward``), on CPU.

diffusers copies blocks between families; a copy of ``FluxTransformerBlock.forward`` fuses with Flux's
adapter (after its checks and probe), and a copy with one change does not.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch

from lightning_adaptiveload.fusion import fuse_norm_modulate, unfuse_norm_modulate
from lightning_adaptiveload.fusion.adapter import same_code


def _twice(x):
    """Doubles x."""
    return x * 2  # a comment


def _twice_again(x):
    # no docstring, other comments, other layout
    return (
        x * 2
    )  # fmt: skip


def _thrice(x):
    return x * 3


def _twice_other_name(y):
    return y * 2


def test_same_code_sets_aside_docstrings_comments_and_layout_only():
    assert same_code(_twice, _twice_again)
    assert not same_code(_twice, _thrice)
    assert not same_code(_twice, _twice_other_name)
    assert not same_code(_twice, len)  # no Python source


def _module_with_copies(tmp_path):
    """A module file with two classes: Flux's block forward verbatim, and the same with one change."""
    flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    source = textwrap.dedent(inspect.getsource(flux.FluxTransformerBlock.forward))
    changed = source.replace("gate_mlp.unsqueeze(1) * ff_output", "gate_mlp.unsqueeze(1) * ff_output * 2")
    assert changed != source, "FluxTransformerBlock.forward changed: update the test's one-token edit"
    body = (
        "from diffusers.models.transformers.transformer_flux import *  # noqa\n"
        "from diffusers.models.transformers.transformer_flux import torch, nn, Any\n\n"
        "class CopiedBlock(nn.Module):\n" + textwrap.indent(source, "    ") + "\n\n"
        "class ChangedBlock(nn.Module):\n" + textwrap.indent(changed, "    ")
    )
    path = tmp_path / "la_copied_blocks.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location("la_copied_blocks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return flux, module


def _as(block, cls):
    """A deep copy of ``block`` (its submodules and parameters) as an instance of ``cls``."""
    out = copy.deepcopy(block)
    out.__class__ = cls
    return out


def test_a_copy_of_a_supported_forward_fuses_and_a_changed_copy_does_not(tmp_path):
    flux, module = _module_with_copies(tmp_path)
    try:
        torch.manual_seed(0)
        block = flux.FluxTransformerBlock(dim=16, num_attention_heads=2, attention_head_dim=8)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)  # the modulation included: nothing passes at zero
        x, context, temb = torch.randn(2, 6, 16), torch.randn(2, 4, 16), torch.randn(2, 16)

        copied = _as(block, module.CopiedBlock)
        reference = copy.deepcopy(copied)
        report = fuse_norm_modulate(copied)
        assert report.sites.get("CopiedBlock") == 2, str(report)
        assert "same forward: FluxTransformerBlock" in report.adapters["CopiedBlock"]
        assert report.probes["CopiedBlock"].status == "ok"
        torch.testing.assert_close(
            copied(x, context, temb), reference(x, context, temb), rtol=1e-5, atol=1e-6
        )
        assert unfuse_norm_modulate(copied).sites.get("CopiedBlock") == 2

        changed = _as(block, module.ChangedBlock)
        report = fuse_norm_modulate(changed, allow_empty=True)
        # Its own FFN sites stay as written; the norm modules inside it fuse with their own adapters.
        assert "ChangedBlock" not in report.sites and report.sites.get("AdaLayerNormZero") == 2, str(report)
        # ... and the report names the norms its forward may modulate inline, which stayed unfused.
        assert report.unfused_norms == {"ChangedBlock": ["norm2", "norm2_context"]}, str(report)
        assert "ChangedBlock.{norm2, norm2_context}" in str(report)
    finally:
        sys.modules.pop("la_copied_blocks", None)


def test_chronoedits_copy_of_the_wan_block_fuses_exactly():
    """ChronoEdit defines its own WanTransformerBlock, the same code as Wan's: Wan's adapter takes it."""
    pytest.importorskip("diffusers")
    from _fusion_families import Family, _build, _randn
    from test_families import _assert_same

    model = _build(
        "ChronoEditTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2))  # fmt: skip
    reference = copy.deepcopy(model)
    report = fuse_norm_modulate(model)
    assert report.sites == {"WanTransformerBlock": 4}, str(report)
    assert report.adapters["WanTransformerBlock"] == "diffusers-wan-block (same forward: WanTransformerBlock)"
    assert type(model.blocks[0]).__module__.endswith("transformer_chronoedit")  # its own class, not Wan's
    # Its output head is modulated inline in the model's forward, as Wan's is: left, and named.
    assert report.unfused_norms == {"ChronoEditTransformer3DModel": ["norm_out"]}
    _assert_same(reference, model, Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), {}))


def test_a_copy_of_a_noted_block_takes_the_note():
    """HunyuanVideo 1.5's token refiner is HunyuanVideo's (its norms gated, not modulated): the same note."""
    pytest.importorskip("diffusers")
    from _fusion_families import _build

    model = _build(
        "HunyuanVideo15Transformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
        attention_head_dim=16, num_layers=1, num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=16,
        image_embed_dim=16, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    report = fuse_norm_modulate(model)
    # The copied double-stream block's FFN sites fuse; the copied refiner is noted.
    assert report.sites.get("HunyuanVideo15TransformerBlock") == 2, str(report)
    (refiner,) = [s for s in report.skipped if s.cls == "HunyuanVideo15IndividualTokenRefinerBlock"]
    assert "not modulated" in refiner.reason
    assert "HunyuanVideo15IndividualTokenRefinerBlock" not in report.unrecognized

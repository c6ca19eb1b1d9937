"""Tiny random configs of the nine diffusers DiT / MMDiT families the fusion pass knows, with inputs.

Each builder returns a :class:`Family`: the model (built under a fixed seed, then every floating-point
parameter randomised by :func:`randomise`, adaLN and modulation weights included, none left zero), the
forward's keyword arguments, and the names of the float inputs whose gradients the tests compare. A family
whose class the installed diffusers lacks is skipped. Small enough for CPU: a forward + backward of each
takes well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn


@dataclass
class Family:
    model: nn.Module
    kwargs: dict[str, Any]
    grad_inputs: tuple[str, ...]
    # The sites fuse_norm_modulate fuses with diffusers 0.42, per class (the fused module's class).
    sites: dict[str, int] = field(default_factory=dict)
    # Calls of the RMSNorm op in one forward (the families whose sites are RMSNorms).
    rms_calls: int = 0
    # Fused sites in modules the forward never calls (Mochi's last block keeps a norm4_context it skips).
    idle_sites: int = 0


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every floating-point parameter drawn at random: matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.3^2),
    biases and other vectors N(0, 0.3^2), modulation tables N(0, 0.5^2). Nothing is zero (adaLN-Zero's zeroed
    projections included), so shift, scale and gate all matter."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        noise = torch.randn(p.shape, generator=g)
        if "scale_shift_table" in name:
            value = 0.5 * noise
        elif p.dim() >= 2:
            value = noise * (p[0].numel() ** -0.5)
        elif name.endswith("weight"):
            value = 1 + 0.3 * noise
        else:
            value = 0.3 * noise
        p.copy_(value.to(p.dtype))
    return model


def _cls(name: str) -> Callable[..., nn.Module]:
    diffusers = pytest.importorskip("diffusers")
    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    return cls


def _build(name: str, **config: Any) -> nn.Module:
    cls = _cls(name)
    torch.manual_seed(0)
    return randomise(cls(**config).eval())


def wan() -> Family:
    model = _build(
        "WanTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2))  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), {"WanTransformerBlock": 4})


def wan_animate() -> Family:
    """Wan-Animate: a copy of Wan's block, with a pose embedding and a face path (motion encoder, face
    encoder, face adapters) whose LayerNorms are not modulated."""
    model = _build(
        "WanAnimateTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=12, latent_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        image_dim=None, rope_max_seq_len=32, motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=16, motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8,
        face_encoder_num_heads=2, inject_face_latents_blocks=1,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 12, 3, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2), pose_hidden_states=_randn(2, 4, 2, 4, 4, seed=3),
                  face_pixel_values=_randn(2, 3, 1, 16, 16, seed=4))  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "pose_hidden_states"),
                  {"WanTransformerBlock": 4})  # fmt: skip


_WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                 text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)  # fmt: skip


def skyreels_v2() -> Family:
    """SkyReels-V2 with diffusion forcing: a timestep per latent frame, so each token has its own modulation."""
    model = _build("SkyReelsV2Transformer3DModel", **_WAN_TINY)
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), timestep=torch.tensor([[3, 200, 500], [10, 20, 30]]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2), enable_diffusion_forcing=True)  # fmt: skip
    return Family(
        model, kwargs, ("hidden_states", "encoder_hidden_states"), {"SkyReelsV2TransformerBlock": 4}
    )


def helios() -> Family:
    """Helios: Wan-style blocks with a modulation per token and cross-attention on the current tokens; a
    per-token output norm."""
    tiny = {k: v for k, v in _WAN_TINY.items() if k != "rope_max_seq_len"}
    model = _build("HeliosTransformer3DModel", **tiny, rope_dim=(4, 4, 4))
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2))  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"),
                  {"HeliosTransformerBlock": 4, "HeliosOutputNorm": 1})  # fmt: skip


def wan_vace() -> Family:
    """Wan-VACE: Wan's blocks and a control block beside each of them (a projection in and out)."""
    model = _build("WanVACETransformer3DModel", **_WAN_TINY, vace_layers=[0, 1], vace_in_channels=8)
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  control_hidden_states=_randn(2, 8, 3, 4, 4, seed=3))  # fmt: skip
    sites = {"WanTransformerBlock": 4, "WanVACETransformerBlock": 4}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "control_hidden_states"), sites)


def sd3(dual: bool = False) -> Family:
    config = dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=8,
    )  # fmt: skip
    if dual:  # SD3.5: dual attention in block 0 (SD35AdaLayerNormZeroX), RMS q/k norms
        config.update(dual_attention_layers=(0,), qk_norm="rms_norm")
    model = _build("SD3Transformer2DModel", **config)
    kwargs = dict(hidden_states=_randn(2, 4, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  pooled_projections=_randn(2, 16, seed=3), timestep=torch.tensor([3, 500]))  # fmt: skip
    norm1 = {"SD35AdaLayerNormZeroX": 2, "AdaLayerNormZero": 2} if dual else {"AdaLayerNormZero": 3}
    # Block 1 is the last: context_pre_only, its context norm an AdaLayerNormContinuous and no context FFN.
    sites = {"JointTransformerBlock": 3, **norm1, "AdaLayerNormContinuous": 2}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "pooled_projections"), sites)


def flux() -> Family:
    model = _build(
        "FluxTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    ids = torch.randint(0, 4, (16, 3), generator=torch.Generator().manual_seed(4)).float()
    kwargs = dict(hidden_states=_randn(2, 16, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  pooled_projections=_randn(2, 16, seed=3), timestep=torch.tensor([0.3, 0.7]), img_ids=ids,
                  txt_ids=torch.zeros(5, 3))  # fmt: skip
    sites = {
        "FluxTransformerBlock": 2,
        "AdaLayerNormZero": 2,
        "AdaLayerNormZeroSingle": 1,
        "AdaLayerNormContinuous": 1,
    }
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "pooled_projections"), sites)


def longcat() -> Family:
    """LongCat-Image: its blocks are a copy of Flux's (the same forward code), fused by Flux's adapter."""
    model = _build(
        "LongCatImageTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    ids = torch.randint(0, 4, (16, 3), generator=torch.Generator().manual_seed(4)).float()
    kwargs = dict(hidden_states=_randn(2, 16, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([0.3, 0.7]), img_ids=ids, txt_ids=torch.zeros(5, 3))  # fmt: skip
    sites = {"LongCatImageTransformerBlock": 2, "AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1,
             "AdaLayerNormContinuous": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def flux2() -> Family:
    model = _build(
        "Flux2Transformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=16,
        axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False,
    )  # fmt: skip
    ids = torch.randint(0, 4, (16, 4), generator=torch.Generator().manual_seed(4)).float()
    kwargs = dict(hidden_states=_randn(2, 16, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([0.3, 0.7]), img_ids=ids, txt_ids=torch.zeros(5, 4))  # fmt: skip
    sites = {"Flux2TransformerBlock": 4, "Flux2SingleTransformerBlock": 1, "AdaLayerNormContinuous": 1}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def qwen_image(edit: bool = False) -> Family:
    """Qwen-Image; ``edit``: zero_cond_t (the edit models), a doubled timestep batch picked per token."""
    model = _build(
        "QwenImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
        zero_cond_t=edit,
    )  # fmt: skip
    images = [(1, 4, 4), (1, 4, 4)] if edit else [(1, 4, 4)]
    kwargs = dict(hidden_states=_randn(2, 16 * len(images), 16, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  encoder_hidden_states_mask=torch.ones(2, 5), timestep=torch.tensor([0.3, 0.7]),
                  img_shapes=[images] * 2)  # fmt: skip
    sites = {"QwenImageTransformerBlock": 8, "AdaLayerNormContinuous": 1}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def chroma() -> Family:
    """Chroma: Flux's blocks with the modulation computed once by an approximator and given to pruned norms."""
    model = _build(
        "ChromaTransformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1,
    )  # fmt: skip
    img_ids = torch.zeros(4, 4, 3)
    img_ids[..., 1] = torch.arange(4)[:, None]
    img_ids[..., 2] = torch.arange(4)[None, :]
    kwargs = dict(hidden_states=_randn(2, 16, 16, seed=1), encoder_hidden_states=_randn(2, 5, 24, seed=2),
                  timestep=torch.tensor([0.3, 0.7]), img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3))  # fmt: skip
    sites = {"ChromaTransformerBlock": 2, "ChromaAdaLayerNormZeroPruned": 2, "ChromaAdaLayerNormZeroSinglePruned": 1,
             "ChromaAdaLayerNormContinuousPruned": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def bria() -> Family:
    """Bria: Flux's block with its attention keywords renamed, fused by an adapter of its own."""
    model = _build(
        "BriaTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    ids = torch.randint(0, 4, (16, 3), generator=torch.Generator().manual_seed(4)).float()
    kwargs = dict(hidden_states=_randn(2, 16, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([0.3, 0.7]), img_ids=ids, txt_ids=torch.zeros(5, 3))  # fmt: skip
    sites = {"BriaTransformerBlock": 2, "AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1,
             "AdaLayerNormContinuous": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def auraflow() -> Family:
    model = _build(
        "AuraFlowTransformer2DModel", sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
        num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([3, 500]))  # fmt: skip
    sites = {"AdaLayerNormZero": 3, "AuraFlowJointTransformerBlock": 2, "AuraFlowSingleTransformerBlock": 1}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def motif_video() -> Family:
    """Motif-Video, with the double-stream blocks' text cross-attention on."""
    model = _build(
        "MotifVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, rope_axes_dim=(2, 4, 4),
        enable_text_cross_attention_dual=True,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 2, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2), encoder_attention_mask=torch.ones(2, 5))  # fmt: skip
    sites = {"MotifVideoTransformerBlock": 2, "AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1,
             "AdaLayerNormContinuous": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def cogvideox() -> Family:
    model = _build(
        "CogVideoXTransformer3DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=4, text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8, sample_frames=9,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 3, 4, 8, 8, seed=1), encoder_hidden_states=_randn(2, 8, 16, seed=2),
                  timestep=torch.tensor([3, 500]))  # fmt: skip
    return Family(
        model,
        kwargs,
        ("hidden_states", "encoder_hidden_states"),
        {"CogVideoXLayerNormZero": 4, "AdaLayerNorm": 1},
    )


def ltx() -> Family:
    model = _build(
        "LTXVideoTransformer3DModel", in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
        num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=16,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 32, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([3, 500]), encoder_attention_mask=torch.ones(2, 5), num_frames=2, height=4,
                  width=4)  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), {"LTXVideoTransformerBlock": 2},
                  rms_calls=2)  # fmt: skip


def lumina2() -> Family:
    """Lumina2: RMSNorms scaled without a shift (LuminaRMSNormZero, the FFN's norm), post-norms times tanh
    gates, a LayerNorm head scaled without a shift; context refiner blocks without modulation."""
    model = _build(
        "Lumina2Transformer2DModel", sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
        num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16, norm_eps=1e-5,
        axes_dim_rope=(4, 6, 6), axes_lens=(16, 16, 16), cap_feat_dim=16,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 4, 4, seed=1), timestep=torch.tensor([0.3, 0.7]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))  # fmt: skip
    # The noise refiner and both layers: 1 + 3 sites each; the head.
    sites = {"Lumina2TransformerBlock": 9, "LuminaRMSNormZero": 3, "LuminaLayerNormContinuous": 1}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites, rms_calls=12)


def sana_video() -> Family:
    """Sana-Video: Sana's blocks with a modulation per token, rotary linear attention and a 3-D conv FFN."""
    model = _build(
        "SanaVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=24, sample_size=8, patch_size=(1, 2, 2), rope_max_seq_len=32,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 3, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 24, seed=2),
                  timestep=torch.tensor([3, 500]), encoder_attention_mask=torch.ones(2, 5))  # fmt: skip
    sites = {"SanaVideoTransformerBlock": 4, "SanaModulatedNorm": 1}
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), sites)


def cosmos() -> Family:
    """Cosmos: norms with two projections and an AdaLN-LoRA term (norm1 to norm3 of each block, the head)."""
    model = _build(
        "CosmosTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=24,
        num_layers=2, mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 16, 16), patch_size=(1, 2, 2),
        rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=False,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 2, 8, 8, seed=1), timestep=torch.tensor([0.3, 0.7]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2))  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"),
                  {"CosmosAdaLayerNormZero": 6, "CosmosAdaLayerNorm": 1})  # fmt: skip


def easyanimate() -> Family:
    """EasyAnimate: CogVideoX-style norms (one for the video and the text stream), an AdaLayerNorm head."""
    model = _build(
        "EasyAnimateTransformer3DModel", num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        patch_size=2, sample_width=8, sample_height=8, num_layers=2, mmdit_layers=2, time_embed_dim=16,
        text_embed_dim=24,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 2, 8, 8, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 24, seed=2))  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"),
                  {"EasyAnimateLayerNormZero": 8, "AdaLayerNorm": 1})  # fmt: skip


def mochi() -> Family:
    """Mochi: RMSNorms scaled without a shift (MochiRMSNormZero) and times a factor (MochiModulatedRMSNorm:
    1 + the FFN's scale, or the tanh gates of the attention and FFN outputs), in both streams."""
    model = _build(
        "MochiTransformer3DModel", patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        pooled_projection_dim=12, in_channels=4, text_embed_dim=16, time_embed_dim=16, max_sequence_length=8,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 3, 4, 4, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([3, 500]), encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool))  # fmt: skip
    # Block 0: norm1 and norm1_context (zero), norm2..norm4 of both streams; block 1 (context pre-only): norm1,
    # its context norm's inner modulated norm, norm2..norm4, and a norm4_context it never calls.
    sites = {"MochiRMSNormZero": 3, "MochiModulatedRMSNorm": 11, "AdaLayerNormContinuous": 1}
    return Family(
        model, kwargs, ("hidden_states", "encoder_hidden_states"), sites, rms_calls=13, idle_sites=1
    )


def hunyuan() -> Family:
    model = _build(
        "HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 2, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2), encoder_attention_mask=torch.ones(2, 5),
                  pooled_projections=_randn(2, 8, seed=3), guidance=torch.tensor([3000.0, 3000.0]))  # fmt: skip
    sites = {"HunyuanVideoTransformerBlock": 2, "AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1,
             "AdaLayerNormContinuous": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "pooled_projections"), sites)


def hunyuan_i2v() -> Family:
    """HunyuanVideo I2V with token replace: the first frame's tokens take their own modulation."""
    model = _build(
        "HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type="token_replace", guidance_embeds=False,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 2, 4, 4, seed=1), timestep=torch.tensor([3, 500]),
                  encoder_hidden_states=_randn(2, 5, 16, seed=2), encoder_attention_mask=torch.ones(2, 5),
                  pooled_projections=_randn(2, 8, seed=3))  # fmt: skip
    sites = {"HunyuanVideoTokenReplaceTransformerBlock": 3, "HunyuanVideoTokenReplaceAdaLayerNormZero": 2,
             "AdaLayerNormZero": 1, "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle": 2,
             "AdaLayerNormContinuous": 1}  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states", "pooled_projections"), sites)


def pixart() -> Family:
    model = _build(
        "PixArtTransformer2DModel", sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
        num_attention_heads=2, caption_channels=16, in_channels=4, cross_attention_dim=16, out_channels=8,
        norm_type="ada_norm_single",
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 16, seed=2),
                  timestep=torch.tensor([3, 500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None})  # fmt: skip
    return Family(model, kwargs, ("hidden_states", "encoder_hidden_states"), {"BasicTransformerBlock": 2})


def dit() -> Family:
    model = _build(
        "DiTTransformer2DModel", sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
        num_attention_heads=2, in_channels=4, out_channels=8, num_embeds_ada_norm=10,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 8, 8, seed=1), timestep=torch.tensor([3, 500]),
                  class_labels=torch.tensor([1, 7]))  # fmt: skip
    return Family(model, kwargs, ("hidden_states",), {"BasicTransformerBlock": 1, "AdaLayerNormZero": 1})


def sana() -> Family:
    model = _build(
        "SanaTransformer2DModel", patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4,
        num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8,
        caption_channels=8, sample_size=8,
    )  # fmt: skip
    kwargs = dict(hidden_states=_randn(2, 4, 8, 8, seed=1), encoder_hidden_states=_randn(2, 5, 8, seed=2),
                  timestep=torch.tensor([3, 500]))  # fmt: skip
    return Family(
        model,
        kwargs,
        ("hidden_states", "encoder_hidden_states"),
        {"SanaTransformerBlock": 2, "SanaModulatedNorm": 1},
    )


FAMILIES: dict[str, Callable[[], Family]] = {
    "wan": wan,
    "wan-animate": wan_animate,
    "skyreels-v2": skyreels_v2,
    "wan-vace": wan_vace,
    "helios": helios,
    "sd3": sd3,
    "sd3.5": lambda: sd3(dual=True),
    "flux": flux,
    "longcat-image": longcat,
    "bria": bria,
    "chroma": chroma,
    "auraflow": auraflow,
    "flux2": flux2,
    "qwen-image": qwen_image,
    "qwen-image-edit": lambda: qwen_image(edit=True),
    "cogvideox": cogvideox,
    "ltx-video": ltx,
    "mochi": mochi,
    "sana-video": sana_video,
    "cosmos": cosmos,
    "easyanimate": easyanimate,
    "lumina2": lumina2,
    "hunyuanvideo": hunyuan,
    "hunyuanvideo-i2v": hunyuan_i2v,
    "motif-video": motif_video,
    "pixart": pixart,
    "dit": dit,
    "sana": sana,
}

"""Fusion adapters for the diffusers MMDiT blocks: two streams (image and text) or one, each modulating
its norms inline in its forward (the norm modules they call have their own adapters in
``diffusers_norms.py``).

| block | family | inline sites | norm |
|---|---|---|---|
| ``JointTransformerBlock`` | SD3, SD3.5 | ``norm2``, ``norm2_context`` (none for the last, context-pre-only block's context) | LayerNorm |
| ``SD3SingleTransformerBlock`` | SD3 variants | ``norm2`` | LayerNorm |
| ``FluxTransformerBlock`` | Flux | ``norm2``, ``norm2_context`` | LayerNorm |
| ``AuraFlowJointTransformerBlock``, ``AuraFlowSingleTransformerBlock`` | AuraFlow | ``norm2``, ``norm2_context``; ``norm2`` | LayerNorm |
| ``ChromaTransformerBlock`` | Chroma (Flux's block, its modulation given per block) | ``norm2``, ``norm2_context`` | LayerNorm |
| ``BriaTransformerBlock`` | Bria (Flux's block, ``attention_kwargs``) | ``norm2``, ``norm2_context`` | LayerNorm |
| ``MotifVideoTransformerBlock`` | Motif-Video | ``norm2``, ``norm2_context`` | LayerNorm |
| ``HunyuanVideoTransformerBlock`` | HunyuanVideo | ``norm2``, ``norm2_context`` | LayerNorm |
| ``HunyuanVideoTokenReplaceTransformerBlock`` | HunyuanVideo I2V | ``norm2`` (two modulations), ``norm2_context`` | LayerNorm |
| ``Flux2TransformerBlock``, ``Flux2SingleTransformerBlock`` | FLUX.2 | ``norm1``, ``norm1_context``, ``norm2``, ``norm2_context``; ``norm`` | LayerNorm |
| ``QwenImageTransformerBlock`` | Qwen-Image (and its edit models, per token) | ``img_norm1``, ``img_norm2``, ``txt_norm1``, ``txt_norm2`` | LayerNorm |

HunyuanVideo's token refiner blocks and Chroma's approximator are recognised and left unfused (their norms
are not modulated). The
single-stream blocks of the other families (DiT, PixArt, LTX-Video, Sana) are in ``diffusers_blocks.py``,
with the helpers both modules share.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion.adapter import FusionAdapter, NoteAdapter
from lightning_adaptiveload.fusion.diffusers_blocks import _ATTENTION, feed_forward, inline_block, sites_check
from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn
from lightning_adaptiveload.fusion.sites import norm_modulate, norm_width

__all__ = ["builtin_entries"]

_SD3 = "diffusers.models.transformers.transformer_sd3"
_FLUX = "diffusers.models.transformers.transformer_flux"
_HUNYUAN = "diffusers.models.transformers.transformer_hunyuan_video"
_QWEN = "diffusers.models.transformers.transformer_qwenimage"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
_BRIA = "diffusers.models.transformers.transformer_bria"
_AURA = "diffusers.models.transformers.auraflow_transformer_2d"
_MOTIF = "diffusers.models.transformers.transformer_motif_video"
_CHROMA = "diffusers.models.transformers.transformer_chroma"


# --------------------------------------------------------------------------------------------------------
# MMDiT double-stream blocks: SD3 / SD3.5, Flux, HunyuanVideo


def _joint_sites(block: nn.Module) -> int:
    return 1 if block.context_pre_only else 2


def _joint_check(block: nn.Module) -> str | None:
    norms = ("norm2",) if block.context_pre_only else ("norm2", "norm2_context")
    return sites_check(block, norms)


def _joint_fused(block, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    """JointTransformerBlock (SD3, SD3.5): the FFN sites of both streams fused."""
    kwargs = joint_attention_kwargs or {}
    if block.use_dual_attention:
        norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_h2, gate_msa2 = block.norm1(
            hidden_states, emb=temb
        )
    else:
        norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    if block.context_pre_only:
        norm_e = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
            encoder_hidden_states, emb=temb
        )

    attn_output, context_attn_output = block.attn(
        hidden_states=norm_h, encoder_hidden_states=norm_e, **kwargs
    )
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    if block.use_dual_attention:
        hidden_states = hidden_states + gate_msa2.unsqueeze(1) * block.attn2(hidden_states=norm_h2, **kwargs)

    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp[:, None], scale_mlp[:, None])
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * feed_forward(block, block.ff, norm_h)

    if block.context_pre_only:
        return None, hidden_states
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_e = norm_modulate(
        block.norm2_context, encoder_hidden_states, c_shift_mlp[:, None], c_scale_mlp[:, None]
    )
    context_ff = feed_forward(block, block.ff_context, norm_e)
    return encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff, hidden_states


def _sd3_single_fused(block, hidden_states, temb):
    """SD3SingleTransformerBlock: the FFN site fused."""
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    attn_output = block.attn(hidden_states=norm_h, encoder_hidden_states=None)
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp.unsqueeze(1), scale_mlp.unsqueeze(1))
    return hidden_states + gate_mlp.unsqueeze(1) * block.ff(norm_h)


def _flux_fused(
    block, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
):
    """FluxTransformerBlock: the FFN sites of both streams fused (IP-adapter output and fp16 clipping kept)."""
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    outputs = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_e,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    mods = (gate_msa, shift_mlp, scale_mlp, gate_mlp), (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp)
    return _flux_after_attention(block, hidden_states, encoder_hidden_states, outputs, *mods)


def _flux_after_attention(block, hidden_states, encoder_hidden_states, outputs, mods, c_mods):
    """The rest of Flux's block (and Chroma's) after its attention: the gated attention outputs, both FFN
    sites fused, the IP-adapter output and fp16 clipping kept."""
    (gate_msa, shift_mlp, scale_mlp, gate_mlp), (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) = (
        mods,
        c_mods,
    )
    attn_output, context_attn_output = outputs[0], outputs[1]
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp[:, None], scale_mlp[:, None])
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * block.ff(norm_h)
    if len(outputs) == 3:
        hidden_states = hidden_states + outputs[2]

    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_e = norm_modulate(
        block.norm2_context, encoder_hidden_states, c_shift_mlp[:, None], c_scale_mlp[:, None]
    )
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_e)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _chroma_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    temb,
    image_rotary_emb=None,
    attention_mask=None,
    joint_attention_kwargs=None,
):
    """ChromaTransformerBlock: Flux's block with the modulation given per block ((B, 12, D): the image's six
    vectors, then the text's) and a text mask; the FFN sites of both streams fused."""
    temb_img, temb_txt = temb[:, :6], temb[:, 6:]
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb_img)
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb_txt
    )
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    outputs = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_e,
        image_rotary_emb=image_rotary_emb,
        attention_mask=attention_mask,
        **(joint_attention_kwargs or {}),
    )
    mods = (gate_msa, shift_mlp, scale_mlp, gate_mlp), (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp)
    return _flux_after_attention(block, hidden_states, encoder_hidden_states, outputs, *mods)


def _chroma_approximator_reason(module: nn.Module) -> str:
    return (
        "the approximator's RMSNorms are not modulated (it computes the blocks' modulation): nothing to fuse"
    )


def _chroma_probe(block: nn.Module, generator: torch.Generator):
    device, dtype, dim, x, context = _two_stream_inputs(block, block.norm2, generator)
    return [((x, context, probe_randn((2, 12, dim), generator, device, dtype)), {})]


def _two_stream_ffn(block, hidden_states, encoder_hidden_states, mlp, c_mlp):
    """The FFN half of HunyuanVideo's and Motif-Video's double-stream blocks, both sites fused; ``mlp`` and
    ``c_mlp``: the (shift, scale, gate) of each stream, (B, D)."""
    (shift, scale, gate), (c_shift, c_scale, c_gate) = mlp, c_mlp
    norm_h = norm_modulate(block.norm2, hidden_states, shift[:, None], scale[:, None])
    norm_e = norm_modulate(block.norm2_context, encoder_hidden_states, c_shift[:, None], c_scale[:, None])
    hidden_states = hidden_states + gate.unsqueeze(1) * block.ff(norm_h)
    encoder_hidden_states = encoder_hidden_states + c_gate.unsqueeze(1) * block.ff_context(norm_e)
    return hidden_states, encoder_hidden_states


def _aura_joint_fused(block, hidden_states, encoder_hidden_states, temb, attention_kwargs=None):
    """AuraFlowJointTransformerBlock: the FFN sites of both streams fused (AuraFlow adds the FFN output to the
    block's input, not to the attention's, as diffusers does)."""
    residual, residual_context = hidden_states, encoder_hidden_states
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_h, encoder_hidden_states=norm_e, **(attention_kwargs or {})
    )
    norm_h = norm_modulate(
        block.norm2, residual + gate_msa.unsqueeze(1) * attn_output, shift_mlp[:, None], scale_mlp[:, None]
    )
    hidden_states = residual + gate_mlp.unsqueeze(1) * block.ff(norm_h)
    norm_e = norm_modulate(
        block.norm2_context,
        residual_context + c_gate_msa.unsqueeze(1) * context_attn_output,
        c_shift_mlp[:, None],
        c_scale_mlp[:, None],
    )
    encoder_hidden_states = residual_context + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_e)
    return encoder_hidden_states, hidden_states


def _aura_single_fused(block, hidden_states, temb, attention_kwargs=None):
    """AuraFlowSingleTransformerBlock: the FFN site fused."""
    residual = hidden_states
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    attn_output = block.attn(hidden_states=norm_h, **(attention_kwargs or {}))
    norm_h = norm_modulate(
        block.norm2, residual + gate_msa.unsqueeze(1) * attn_output, shift_mlp[:, None], scale_mlp[:, None]
    )
    return residual + gate_mlp.unsqueeze(1) * block.ff(norm_h)


def _bria_fused(
    block, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_kwargs=None
):
    """BriaTransformerBlock: Flux's block with its attention keywords named ``attention_kwargs``."""
    return _flux_fused(block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs)


def _motif_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    temb,
    attention_mask=None,
    image_rotary_emb=None,
    image_embed_seq_len=0,
):
    """MotifVideoTransformerBlock (Motif-Video): the FFN sites of both streams fused (the text cross-attention
    kept)."""
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_e,
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    hidden_states = hidden_states + attn_output * gate_msa.unsqueeze(1)
    if block.cross_attn is not None:
        hidden_states = hidden_states + block.cross_attn(
            hidden_states=attn_output,
            encoder_hidden_states=norm_e,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
            image_embed_seq_len=image_embed_seq_len,
        )
    encoder_hidden_states = encoder_hidden_states + context_attn_output * c_gate_msa.unsqueeze(1)
    return _two_stream_ffn(
        block, hidden_states, encoder_hidden_states, (shift_mlp, scale_mlp, gate_mlp),
        (c_shift_mlp, c_scale_mlp, c_gate_mlp),
    )  # fmt: skip


def _hunyuan_attention(block, norm_h, norm_e, attention_mask, freqs_cis):
    """The joint attention of HunyuanVideo's double-stream blocks (both kinds), as they call it."""
    return block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_e,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )


def _hunyuan_fused(
    block, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kwargs
):
    """HunyuanVideoTransformerBlock: the FFN sites of both streams fused."""
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attn_output, context_attn_output = _hunyuan_attention(block, norm_h, norm_e, attention_mask, freqs_cis)
    hidden_states = hidden_states + attn_output * gate_msa.unsqueeze(1)
    encoder_hidden_states = encoder_hidden_states + context_attn_output * c_gate_msa.unsqueeze(1)
    return _two_stream_ffn(
        block, hidden_states, encoder_hidden_states, (shift_mlp, scale_mlp, gate_mlp),
        (c_shift_mlp, c_scale_mlp, c_gate_mlp),
    )  # fmt: skip


def _hunyuan_token_replace_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    temb,
    attention_mask=None,
    freqs_cis=None,
    token_replace_emb=None,
    num_tokens=None,
):
    """HunyuanVideoTokenReplaceTransformerBlock (HunyuanVideo I2V): the FFN sites of both streams fused.

    The first ``num_tokens`` tokens (the image frame) take the token-replace modulation, the others the
    timestep's: two fused calls on the two slices, which a LayerNorm (one row at a time) normalises exactly as
    the whole sequence.
    """
    n = num_tokens
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp, *token_replace = block.norm1(
        hidden_states, temb, token_replace_emb, n
    )
    tr_gate_msa, tr_shift_mlp, tr_scale_mlp, tr_gate_mlp = token_replace
    norm_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attn_output, context_attn_output = _hunyuan_attention(block, norm_h, norm_e, attention_mask, freqs_cis)
    hidden_states = torch.cat(
        [
            hidden_states[:, :n] + attn_output[:, :n] * tr_gate_msa.unsqueeze(1),
            hidden_states[:, n:] + attn_output[:, n:] * gate_msa.unsqueeze(1),
        ],
        dim=1,
    )
    encoder_hidden_states = encoder_hidden_states + context_attn_output * c_gate_msa.unsqueeze(1)
    norm_h = torch.cat(
        [
            norm_modulate(block.norm2, hidden_states[:, :n], tr_shift_mlp[:, None], tr_scale_mlp[:, None]),
            norm_modulate(block.norm2, hidden_states[:, n:], shift_mlp[:, None], scale_mlp[:, None]),
        ],
        dim=1,
    )
    norm_e = norm_modulate(
        block.norm2_context, encoder_hidden_states, c_shift_mlp[:, None], c_scale_mlp[:, None]
    )
    ff_output = block.ff(norm_h)
    context_ff_output = block.ff_context(norm_e)
    hidden_states = torch.cat(
        [
            hidden_states[:, :n] + ff_output[:, :n] * tr_gate_mlp.unsqueeze(1),
            hidden_states[:, n:] + ff_output[:, n:] * gate_mlp.unsqueeze(1),
        ],
        dim=1,
    )
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
    return hidden_states, encoder_hidden_states


def _hunyuan_token_replace_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    [((x, context, temb), _)] = _two_stream_probe(block, generator)
    token_replace_emb = probe_randn(temb.shape, generator, device, dtype)
    return [((x, context, temb), {"token_replace_emb": token_replace_emb, "num_tokens": 2})]


def _flux2_split(mod: torch.Tensor, sets: int):
    """diffusers' ``Flux2Modulation.split``: ``sets`` (shift, scale, gate) triples, (B, 1, D) from a (B, 3 sets D)
    modulation, or per token (B, S, D) from (B, S, 3 sets D) (the reference tokens of a KV-cache pass)."""
    return sys.modules[_FLUX2].Flux2Modulation.split(mod, sets)


def _flux2_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    temb_mod_img,
    temb_mod_txt,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
):
    """Flux2TransformerBlock (FLUX.2): its four sites (norm1 and norm2 of both streams) fused."""
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = _flux2_split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _flux2_split(
        temb_mod_txt, 2
    )
    norm_h = norm_modulate(block.norm1, hidden_states, shift_msa, scale_msa)
    norm_e = norm_modulate(block.norm1_context, encoder_hidden_states, c_shift_msa, c_scale_msa)
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_e,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = hidden_states + gate_msa * attn_output
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp, scale_mlp)
    hidden_states = hidden_states + gate_mlp * block.ff(norm_h)

    encoder_hidden_states = encoder_hidden_states + c_gate_msa * context_attn_output
    norm_e = norm_modulate(block.norm2_context, encoder_hidden_states, c_shift_mlp, c_scale_mlp)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp * block.ff_context(norm_e)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux2_single_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    temb_mod,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
    split_hidden_states=False,
    text_seq_len=None,
):
    """Flux2SingleTransformerBlock (FLUX.2): its site fused."""
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = _flux2_split(temb_mod, 1)[0]
    norm_h = norm_modulate(block.norm, hidden_states, shift, scale)
    attn_output = block.attn(
        hidden_states=norm_h, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    hidden_states = hidden_states + gate * attn_output
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def _flux2_probe(block: nn.Module, generator: torch.Generator):
    device, dtype, dim, x, context = _two_stream_inputs(block, block.norm1, generator)
    mod_img, mod_txt = (probe_randn((2, 6 * dim), generator, device, dtype) for _ in range(2))
    per_token = probe_randn((2, 6, 6 * dim), generator, device, dtype)  # reference tokens' own modulation
    return [((x, context, mod_img, mod_txt), {}), ((x, context, per_token, mod_txt), {})]


def _flux2_single_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = norm_width(block.norm)
    x = probe_randn((2, 6, dim), generator, device, dtype)
    context = probe_randn((2, 4, dim), generator, device, dtype)
    mod = probe_randn((2, 3 * dim), generator, device, dtype)
    return [((x, None, mod), {}), ((x, context, mod), {"split_hidden_states": True})]


def _qwen_modulation(mod_params: torch.Tensor, index: torch.Tensor | None):
    """(shift, scale, gate) of a QwenImageTransformerBlock site, as its ``_modulate`` picks them: (B, 1, D)
    per sample, or per token (B, S, D) where ``index`` (B, S) chooses between the two halves of a doubled
    batch (``zero_cond_t``, the edit models: 0 the first half's row, else the second's)."""
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    if index is None:
        return shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1)
    half = shift.size(0) // 2
    first = index.unsqueeze(-1) == 0
    return tuple(
        torch.where(first, t[:half].unsqueeze(1), t[half:].unsqueeze(1)) for t in (shift, scale, gate)
    )


def _qwen_fused(
    block,
    hidden_states,
    encoder_hidden_states,
    encoder_hidden_states_mask,
    temb,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
    modulate_index=None,
):
    """QwenImageTransformerBlock (Qwen-Image): its four sites (norm1 and norm2 of both streams) fused."""
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    if block.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)

    shift, scale, img_gate1 = _qwen_modulation(img_mod1, modulate_index)
    img_modulated = norm_modulate(block.img_norm1, hidden_states, shift, scale)
    shift, scale, txt_gate1 = _qwen_modulation(txt_mod1, None)
    txt_modulated = norm_modulate(block.txt_norm1, encoder_hidden_states, shift, scale)
    img_attn_output, txt_attn_output = block.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = hidden_states + img_gate1 * img_attn_output
    encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output

    shift, scale, img_gate2 = _qwen_modulation(img_mod2, modulate_index)
    img_modulated2 = norm_modulate(block.img_norm2, hidden_states, shift, scale)
    hidden_states = hidden_states + img_gate2 * block.img_mlp(img_modulated2)
    shift, scale, txt_gate2 = _qwen_modulation(txt_mod2, None)
    txt_modulated2 = norm_modulate(block.txt_norm2, encoder_hidden_states, shift, scale)
    encoder_hidden_states = encoder_hidden_states + txt_gate2 * block.txt_mlp(txt_modulated2)

    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _qwen_check(block: nn.Module) -> str | None:
    reason = sites_check(block, ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2"))
    if reason is not None:
        return reason
    dim = norm_width(block.img_norm1)
    for name in ("img_mod", "txt_mod"):
        mod = getattr(block, name, None)
        proj = mod[-1] if isinstance(mod, nn.Sequential) and len(mod) else None
        if not isinstance(proj, nn.Linear) or proj.out_features != 6 * dim:
            return f"QwenImageTransformerBlock.{name} should end in an nn.Linear giving 6 x D={dim}, found {mod!r}"
    return None


def _qwen_probe(block: nn.Module, generator: torch.Generator):
    device, dtype, dim, x, context = _two_stream_inputs(block, block.img_norm1, generator)
    if not block.zero_cond_t:
        return [((x, context, None, probe_randn((2, dim), generator, device, dtype)), {})]
    # The edit models: a doubled timestep batch, each image token picking its half.
    temb = probe_randn((4, dim), generator, device, dtype)
    index = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 0, 1, 0, 0, 0]], device=device)
    return [((x, context, None, temb), {"modulate_index": index})]


def _two_stream_inputs(block: nn.Module, norm: nn.Module, generator: torch.Generator):
    """(device, dtype, D, x (2, 6, D), context (2, 4, D)) for the probe of a two-stream block."""
    device, dtype = probe_device_dtype(block)
    dim = norm_width(norm)
    x = probe_randn((2, 6, dim), generator, device, dtype)
    return device, dtype, dim, x, probe_randn((2, 4, dim), generator, device, dtype)


def _two_stream_probe(block: nn.Module, generator: torch.Generator):
    device, dtype, _, x, context = _two_stream_inputs(block, block.norm2, generator)
    temb = probe_randn((2, block.norm1.linear.in_features), generator, device, dtype)
    return [((x, context, temb), {})]


def _single_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = norm_width(block.norm2)
    x = probe_randn((2, 6, dim), generator, device, dtype)
    temb = probe_randn((2, block.norm1.linear.in_features), generator, device, dtype)
    return [((x, temb), {})]


# --------------------------------------------------------------------------------------------------------
# Blocks recognised and left unfused


def _refiner_reason(block: nn.Module) -> str:
    return "its LayerNorms are not modulated (only gated by HunyuanVideoAdaNorm): nothing to fuse"


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of the MMDiT blocks, in the order the registry tries them."""
    return [
        inline_block(_ATTENTION, "JointTransformerBlock", _joint_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "joint_attention_kwargs"],
               _joint_sites, _joint_check, _two_stream_probe),
        inline_block(_SD3, "SD3SingleTransformerBlock", _sd3_single_fused, ["hidden_states", "temb"],
               1, lambda b: sites_check(b, ("norm2",)), _single_probe),
        inline_block(_FLUX, "FluxTransformerBlock", _flux_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _two_stream_probe),
        inline_block(_HUNYUAN, "HunyuanVideoTransformerBlock", _hunyuan_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis", "args", "kwargs"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _two_stream_probe),
        inline_block(_AURA, "AuraFlowJointTransformerBlock", _aura_joint_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "attention_kwargs"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _two_stream_probe),
        inline_block(_AURA, "AuraFlowSingleTransformerBlock", _aura_single_fused, ["hidden_states", "temb", "attention_kwargs"],
               1, lambda b: sites_check(b, ("norm2",)), _single_probe),
        inline_block(_CHROMA, "ChromaTransformerBlock", _chroma_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "attention_mask",
                "joint_attention_kwargs"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _chroma_probe),
        ((_CHROMA, "ChromaApproximator"), NoteAdapter("diffusers-chroma-approximator", _chroma_approximator_reason)),
        inline_block(_BRIA, "BriaTransformerBlock", _bria_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "attention_kwargs"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _two_stream_probe),
        inline_block(_MOTIF, "MotifVideoTransformerBlock", _motif_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "attention_mask", "image_rotary_emb",
                "image_embed_seq_len"],
               2, lambda b: sites_check(b, ("norm2", "norm2_context")), _two_stream_probe),
        inline_block(_HUNYUAN, "HunyuanVideoTokenReplaceTransformerBlock", _hunyuan_token_replace_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis", "token_replace_emb",
                "num_tokens"],
               3, lambda b: sites_check(b, ("norm2", "norm2_context")), _hunyuan_token_replace_probe),
        inline_block(_FLUX2, "Flux2TransformerBlock", _flux2_fused,
               ["hidden_states", "encoder_hidden_states", "temb_mod_img", "temb_mod_txt", "image_rotary_emb",
                "joint_attention_kwargs"],
               4, lambda b: sites_check(b, ("norm1", "norm1_context", "norm2", "norm2_context")), _flux2_probe),
        inline_block(_FLUX2, "Flux2SingleTransformerBlock", _flux2_single_fused,
               ["hidden_states", "encoder_hidden_states", "temb_mod", "image_rotary_emb", "joint_attention_kwargs",
                "split_hidden_states", "text_seq_len"],
               1, lambda b: sites_check(b, ("norm",)), _flux2_single_probe),
        inline_block(_QWEN, "QwenImageTransformerBlock", _qwen_fused,
               ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
                "joint_attention_kwargs", "modulate_index"],
               4, _qwen_check, _qwen_probe),
        ((_HUNYUAN, "HunyuanVideoIndividualTokenRefinerBlock"),
         NoteAdapter("diffusers-hunyuan-refiner", _refiner_reason)),
    ]  # fmt: skip

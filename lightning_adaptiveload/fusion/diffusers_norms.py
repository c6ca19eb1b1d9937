"""Fusion adapters for diffusers' modulated norm classes, wherever they sit.

diffusers builds the adaLN sites of its DiT and MMDiT blocks from a few norm modules that compute
``norm(x) * (1 + scale) + shift`` themselves and return the remaining modulation (gates, the FFN's shift and
scale) to the block. Fusing those modules, rather than whole blocks, covers every family that uses them:

| class | used by | sites |
|---|---|---|
| ``AdaLayerNormZero`` | SD3, Flux, HunyuanVideo (``norm1``, ``norm1_context``), DiT (``BasicTransformerBlock``) | 1 |
| ``AdaLayerNormZeroSingle`` | Flux, HunyuanVideo single-stream blocks | 1 |
| ``AdaLayerNormContinuous`` | output heads of SD3, Flux, HunyuanVideo; SD3's last context norm | 1 |
| ``SD35AdaLayerNormZeroX`` | SD3.5's dual-attention blocks | 2 |
| ``CogVideoXLayerNormZero`` | CogVideoX (video and text streams) | 2 |
| ``AdaLayerNorm`` | CogVideoX's output head (``chunk_dim=1``), ``ada_norm`` blocks | 1 |
| ``CogView3PlusAdaLayerNormZeroTextImage`` | CogView3-Plus | 2 |
| ``SanaModulatedNorm`` | Sana's output head (and Sana-Video's, per token: a class of its own) | 1 |
| ``HunyuanVideoTokenReplaceAdaLayerNormZero`` (and ``...Single``) | HunyuanVideo I2V (token replace) | 2 |
| ``ChromaAdaLayerNormZeroPruned``, ``...ZeroSinglePruned``, ``...ContinuousPruned`` | Chroma: the modulation given, no projection | 1 |
| ``CosmosAdaLayerNormZero``, ``CosmosAdaLayerNorm`` | Cosmos (``norm1`` to ``norm3``; the head): two projections, an optional AdaLN-LoRA term | 1 |
| ``EasyAnimateLayerNormZero`` | EasyAnimate (video and text, one norm) | 2 |
| ``LuminaRMSNormZero`` | Lumina2 (``norm1``): RMSNorm scaled, no shift | 1 |
| ``LuminaLayerNormContinuous`` | Lumina2's output head: LayerNorm scaled, no shift | 1 |
| ``MochiRMSNormZero`` | Mochi (``norm1``, ``norm1_context``): RMSNorm scaled, no shift | 1 |
| ``MochiModulatedRMSNorm`` | Mochi (``norm2`` to ``norm4``, both streams; the last context norm): RMSNorm times a factor | 1 |

Each fused forward is the class's forward with its site written as one call of
:func:`~lightning_adaptiveload.fusion.sites.norm_modulate` (LayerNorm or RMSNorm, whichever the module holds);
everything else (the SiLU + Linear projection, the chunk order, the ``[:, None]`` layouts, the returned
modulation) is as diffusers computes it. Lumina2's and Mochi's norms scale without a shift: they run the
ops with a zero shift (``sites.norm_scale``), a factor ``f`` (a tanh gate, or ``1 + scale``) as the op's scale
``f - 1`` in fp32 (``sites.norm_times``). The blocks' own inline sites (the FFN's ``norm2``) are fused by
``diffusers_mmdit.py`` and ``diffusers_blocks.py``. Classes are looked up in modules already imported only, so nothing here imports
diffusers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion.adapter import ClassForward, FusionAdapter
from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn
from lightning_adaptiveload.fusion.sites import (
    norm_kind,
    norm_modulate,
    norm_scale,
    norm_site_reason,
    norm_times,
    norm_width,
)

__all__ = ["builtin_entries"]

_NORMS = "diffusers.models.normalization"
_SANA = "diffusers.models.transformers.sana_transformer"
_HUNYUAN = "diffusers.models.transformers.transformer_hunyuan_video"
_MOCHI = "diffusers.models.transformers.transformer_mochi"
_CHROMA = "diffusers.models.transformers.transformer_chroma"
_SANA_VIDEO = "diffusers.models.transformers.transformer_sana_video"
_COSMOS = "diffusers.models.transformers.transformer_cosmos"
_EASYANIMATE = "diffusers.models.transformers.transformer_easyanimate"


# --------------------------------------------------------------------------------------------------------
# Checks


def _projection_check(
    module: nn.Module, chunks: int, linear: str = "linear", norm: str = "norm"
) -> str | None:
    """The norm is fusable and the projection ``linear`` gives ``chunks`` chunks of its width."""
    dim = (
        norm_width(getattr(module, norm, None))
        if isinstance(getattr(module, norm, None), nn.Module)
        else None
    )
    reason = norm_site_reason(getattr(module, norm, None), norm, dim)
    if reason is not None:
        return f"{type(module).__name__}: {reason}"
    proj = getattr(module, linear, None)
    if not isinstance(proj, nn.Linear) or proj.out_features != chunks * dim:
        found = (
            f"nn.Linear(out_features={proj.out_features})"
            if isinstance(proj, nn.Linear)
            else type(proj).__name__
        )
        return (
            f"{type(module).__name__}.{linear} should be an nn.Linear giving {chunks} chunks of D={dim} "
            f"(out_features={chunks * dim}), found {found}"
        )
    return None


def _ada_layer_norm_check(module: nn.Module) -> str | None:
    if getattr(module, "chunk_dim", None) not in (0, 1):
        return f"AdaLayerNorm.chunk_dim is {getattr(module, 'chunk_dim', None)!r}, the fused forward knows 0 and 1"
    return _projection_check(module, 2)


def _mochi_check(module: nn.Module) -> str | None:
    """Mochi's norms hold a weightless diffusers RMSNorm (``RMSNorm(0, eps, False)``), its D taken from x."""
    inner = getattr(module, "norm", None)
    if norm_kind(inner) != "rms_norm" or getattr(inner, "weight", None) is not None:
        found = type(inner).__qualname__ if inner is not None else "None"
        return f"{type(module).__name__}.norm should be diffusers' RMSNorm without a weight, found {found}"
    proj = getattr(module, "linear", None)
    if type(module).__name__ == "MochiRMSNormZero" and (
        not isinstance(proj, nn.Linear) or proj.out_features % 4 != 0
    ):
        return "MochiRMSNormZero.linear should be an nn.Linear giving 4 chunks (scale, gate, scale, gate)"
    return None


def _cogview_check(module: nn.Module) -> str | None:
    return _projection_check(module, 12, norm="norm_x") or _projection_check(module, 12, norm="norm_c")


# --------------------------------------------------------------------------------------------------------
# Fused forwards (each the class's forward with its site(s) through norm_modulate)


def _ada_zero_fused(
    norm: nn.Module,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero: 6 chunks (shift, scale, gate of attention, then of the FFN); attention's site fused."""
    if norm.emb is not None:
        emb = norm.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(
        6, dim=1
    )
    x = norm_modulate(norm.norm, x, shift_msa[:, None], scale_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_zero_single_fused(norm: nn.Module, x: torch.Tensor, emb: torch.Tensor | None = None):
    """AdaLayerNormZeroSingle: 3 chunks (shift, scale, gate)."""
    shift_msa, scale_msa, gate_msa = norm.linear(norm.silu(emb)).chunk(3, dim=1)
    return norm_modulate(norm.norm, x, shift_msa[:, None], scale_msa[:, None]), gate_msa


def _ada_continuous_fused(
    norm: nn.Module, x: torch.Tensor, conditioning_embedding: torch.Tensor
) -> torch.Tensor:
    """AdaLayerNormContinuous: 2 chunks in the order (scale, shift); the condition cast to x's dtype first."""
    emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return norm_modulate(norm.norm, x, shift[:, None, :], scale[:, None, :])


def _sd35_zero_x_fused(norm: nn.Module, hidden_states: torch.Tensor, emb: torch.Tensor | None = None):
    """SD35AdaLayerNormZeroX: 9 chunks; one norm feeds two sites (attention and the second attention)."""
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2) = (
        norm.linear(norm.silu(emb)).chunk(9, dim=1)
    )
    first = norm_modulate(norm.norm, hidden_states, shift_msa[:, None], scale_msa[:, None])
    second = norm_modulate(norm.norm, hidden_states, shift_msa2[:, None], scale_msa2[:, None])
    return first, gate_msa, shift_mlp, scale_mlp, gate_mlp, second, gate_msa2


def _cogvideox_zero_fused(
    norm: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor
):
    """CogVideoXLayerNormZero: one norm and one projection for the video and the text stream (2 sites)."""
    hidden_states, encoder_hidden_states, gate, enc_gate = _video_text_sites(
        norm, hidden_states, encoder_hidden_states, temb
    )
    return hidden_states, encoder_hidden_states, gate[:, None, :], enc_gate[:, None, :]


def _easyanimate_zero_fused(
    norm: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor
):
    """EasyAnimateLayerNormZero: CogVideoX's two sites; its gates are returned as (B, D)."""
    return _video_text_sites(norm, hidden_states, encoder_hidden_states, temb)


def _video_text_sites(norm, hidden_states, encoder_hidden_states, temb):
    """(video, text, gate, text gate): 6 chunks (shift, scale, gate of each stream), one norm for both."""
    shift, scale, gate, enc_shift, enc_scale, enc_gate = norm.linear(norm.silu(temb)).chunk(6, dim=1)
    hidden_states = norm_modulate(norm.norm, hidden_states, shift[:, None, :], scale[:, None, :])
    encoder_hidden_states = norm_modulate(
        norm.norm, encoder_hidden_states, enc_shift[:, None, :], enc_scale[:, None, :]
    )
    return hidden_states, encoder_hidden_states, gate, enc_gate


def _ada_layer_norm_fused(
    norm: nn.Module, x: torch.Tensor, timestep: torch.Tensor | None = None, temb: torch.Tensor | None = None
) -> torch.Tensor:
    """AdaLayerNorm: (shift, scale) along dim 1 (CogVideoX's head) or (scale, shift) along dim 0."""
    if norm.emb is not None:
        temb = norm.emb(timestep)
    temb = norm.linear(norm.silu(temb))
    if norm.chunk_dim == 1:
        shift, scale = temb.chunk(2, dim=1)
        shift, scale = shift[:, None, :], scale[:, None, :]
    else:
        scale, shift = temb.chunk(2, dim=0)
    return norm_modulate(norm.norm, x, shift, scale)


def _cogview_fused(norm: nn.Module, x: torch.Tensor, context: torch.Tensor, emb: torch.Tensor | None = None):
    """CogView3PlusAdaLayerNormZeroTextImage: 12 chunks, image then text; one site per stream."""
    chunks = norm.linear(norm.silu(emb)).chunk(12, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks[:6]
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = chunks[6:]
    x = norm_modulate(norm.norm_x, x, shift_msa[:, None], scale_msa[:, None])
    context = norm_modulate(norm.norm_c, context, c_shift_msa[:, None], c_scale_msa[:, None])
    return (
        x,
        gate_msa,
        shift_mlp,
        scale_mlp,
        gate_mlp,
        context,
        c_gate_msa,
        c_shift_mlp,
        c_scale_mlp,
        c_gate_mlp,
    )


def _sana_modulated_fused(
    norm: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor, scale_shift_table: torch.Tensor
) -> torch.Tensor:
    """SanaModulatedNorm: (shift, scale) from the model's (2, D) table plus the embedded timestep."""
    shift, scale = (scale_shift_table[None] + temb[:, None].to(scale_shift_table.device)).chunk(2, dim=1)
    return norm_modulate(norm.norm, hidden_states, shift, scale)


def _chroma_check(module: nn.Module) -> str | None:
    if getattr(module, "emb", None) is not None:
        return f"{type(module).__name__} with its own label embedding (num_embeddings) is not adapted"
    reason = norm_site_reason(getattr(module, "norm", None), "norm")
    return f"{type(module).__name__}: {reason}" if reason is not None else None


def _chroma_zero_fused(
    norm: nn.Module,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
):
    """ChromaAdaLayerNormZeroPruned: the (B, 6, D) modulation given, flattened and chunked as AdaLayerNormZero's."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.flatten(1, 2).chunk(6, dim=1)
    x = norm_modulate(norm.norm, x, shift_msa[:, None], scale_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _chroma_zero_single_fused(norm: nn.Module, x: torch.Tensor, emb: torch.Tensor | None = None):
    """ChromaAdaLayerNormZeroSinglePruned: (B, 3, D) given (shift, scale, gate)."""
    shift_msa, scale_msa, gate_msa = emb.flatten(1, 2).chunk(3, dim=1)
    return norm_modulate(norm.norm, x, shift_msa[:, None], scale_msa[:, None]), gate_msa


def _chroma_continuous_fused(norm: nn.Module, x: torch.Tensor, emb: torch.Tensor):
    """ChromaAdaLayerNormContinuousPruned: (B, 2, D) given in the order (shift, scale), cast to x's dtype."""
    shift, scale = torch.chunk(emb.flatten(1, 2).to(x.dtype), 2, dim=1)
    return norm_modulate(norm.norm, x, shift[:, None, :], scale[:, None, :])


def _cosmos_modulation(
    norm: nn.Module, embedded_timestep: torch.Tensor, temb: torch.Tensor | None, chunks: int
):
    """Cosmos's norms: SiLU, two projections, the AdaLN-LoRA term added (its first ``chunks`` x D), chunked;
    a per-sample (B, C) modulation gets its token dim."""
    e = norm.linear_2(norm.linear_1(norm.activation(embedded_timestep)))
    if temb is not None:
        e = e + (temb if chunks == 3 else temb[..., : chunks * norm.embedding_dim])
    parts = e.chunk(chunks, dim=-1)
    return [p.unsqueeze(1) for p in parts] if e.ndim == 2 else list(parts)


def _cosmos_zero_fused(
    norm: nn.Module, hidden_states: torch.Tensor, embedded_timestep: torch.Tensor, temb=None
):
    """CosmosAdaLayerNormZero: (shift, scale, gate)."""
    shift, scale, gate = _cosmos_modulation(norm, embedded_timestep, temb, 3)
    return norm_modulate(norm.norm, hidden_states, shift, scale), gate


def _cosmos_fused(norm: nn.Module, hidden_states: torch.Tensor, embedded_timestep: torch.Tensor, temb=None):
    """CosmosAdaLayerNorm (the output head): (shift, scale), the LoRA term's first 2 x D."""
    shift, scale = _cosmos_modulation(norm, embedded_timestep, temb, 2)
    return norm_modulate(norm.norm, hidden_states, shift, scale)


def _lumina_zero_fused(norm: nn.Module, x: torch.Tensor, emb: torch.Tensor | None = None):
    """LuminaRMSNormZero: 4 chunks (scale and gate of attention, then of the FFN); attention's site fused."""
    scale_msa, gate_msa, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(4, dim=1)
    return norm_scale(norm.norm, x, scale_msa[:, None]), gate_msa, scale_mlp, gate_mlp


def _lumina_continuous_fused(norm: nn.Module, x: torch.Tensor, conditioning_embedding: torch.Tensor):
    """LuminaLayerNormContinuous: one chunk, the scale (no shift); the condition cast to x's dtype first, then
    the optional output projection."""
    scale = norm.linear_1(norm.silu(conditioning_embedding).to(x.dtype))
    x = norm_scale(norm.norm, x, scale[:, None, :])
    return norm.linear_2(x) if norm.linear_2 is not None else x


def _mochi_zero_fused(norm: nn.Module, hidden_states: torch.Tensor, emb: torch.Tensor):
    """MochiRMSNormZero: 4 chunks (scale and gate of attention, then of the FFN); attention's site fused."""
    scale_msa, gate_msa, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(4, dim=1)
    # diffusers computes in fp32 and casts back to x's dtype, as the op does.
    x = norm_scale(
        norm.norm, hidden_states, scale_msa[:, None].to(torch.float32), out_dtype=hidden_states.dtype
    )
    return x, gate_msa, scale_mlp, gate_mlp


def _mochi_modulated_fused(norm: nn.Module, hidden_states: torch.Tensor, scale: torch.Tensor | None = None):
    """MochiModulatedRMSNorm: ``RMSNorm(x) * scale`` (the factor: 1 + the FFN's scale, or a tanh gate), in
    x's dtype; without a factor, the plain norm as the class computes it."""
    if scale is None:
        return norm.norm(hidden_states.to(torch.float32)).to(hidden_states.dtype)
    return norm_times(norm.norm, hidden_states, scale, out_dtype=hidden_states.dtype)


def _sana_video_modulated_fused(
    norm: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor, scale_shift_table: torch.Tensor
) -> torch.Tensor:
    """Sana-Video's SanaModulatedNorm: (shift, scale) per token, the (2, D) table plus the (B, S, D) timestep."""
    shift, scale = (scale_shift_table[None, None] + temb[:, :, None].to(scale_shift_table.device)).unbind(
        dim=2
    )
    return norm_modulate(norm.norm, hidden_states, shift, scale)


def _token_replace_sites(norm, hidden_states, first, mods, tr_mods):
    # The first-frame tokens take the token-replace modulation, the others the timestep's; one site each.
    (shift, scale), (tr_shift, tr_scale) = mods, tr_mods
    head = norm_modulate(norm.norm, hidden_states[:, :first], tr_shift[:, None], tr_scale[:, None])
    tail = norm_modulate(norm.norm, hidden_states[:, first:], shift[:, None], scale[:, None])
    return torch.cat([head, tail], dim=1)


def _hunyuan_token_replace_fused(norm, hidden_states, emb, token_replace_emb, first_frame_num_tokens):
    """HunyuanVideoTokenReplaceAdaLayerNormZero: 6 chunks for each of the two embeddings."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(
        6, dim=1
    )
    tr = norm.linear(norm.silu(token_replace_emb)).chunk(6, dim=1)
    tr_shift_msa, tr_scale_msa, tr_gate_msa, tr_shift_mlp, tr_scale_mlp, tr_gate_mlp = tr
    out = _token_replace_sites(
        norm, hidden_states, first_frame_num_tokens, (shift_msa, scale_msa), (tr_shift_msa, tr_scale_msa)
    )
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, tr_gate_msa, tr_shift_mlp, tr_scale_mlp, tr_gate_mlp


def _hunyuan_token_replace_single_fused(norm, hidden_states, emb, token_replace_emb, first_frame_num_tokens):
    """HunyuanVideoTokenReplaceAdaLayerNormZeroSingle: 3 chunks for each of the two embeddings."""
    shift_msa, scale_msa, gate_msa = norm.linear(norm.silu(emb)).chunk(3, dim=1)
    tr_shift_msa, tr_scale_msa, tr_gate_msa = norm.linear(norm.silu(token_replace_emb)).chunk(3, dim=1)
    out = _token_replace_sites(
        norm, hidden_states, first_frame_num_tokens, (shift_msa, scale_msa), (tr_shift_msa, tr_scale_msa)
    )
    return out, gate_msa, tr_gate_msa


# --------------------------------------------------------------------------------------------------------
# Probes: small inputs on the module's device and dtype


def _draw(module: nn.Module, generator: torch.Generator, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    device, dtype = probe_device_dtype(module)
    return [probe_randn(shape, generator, device, dtype) for shape in shapes]


def _dims(module: nn.Module, norm: str = "norm", linear: str = "linear") -> tuple[int, int]:
    return norm_width(getattr(module, norm)), getattr(module, linear).in_features


def _labels(n: int, high: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(0, max(int(high), 1), (n,), generator=generator, device=device)


def _ada_zero_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm)
    if norm.emb is None:
        x, emb = _draw(norm, generator, (2, 5, dim), (2, cond))
        return [((x, None, None, None, emb), {})]
    device, dtype = probe_device_dtype(norm)
    (x,) = _draw(norm, generator, (2, 5, dim))
    t = _labels(2, 1000, generator, device)
    labels = _labels(
        2, getattr(getattr(norm.emb, "class_embedder", None), "num_classes", 1), generator, device
    )
    return [((x, t, labels), {"hidden_dtype": dtype})]


def _x_emb_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm)
    x, emb = _draw(norm, generator, (2, 5, dim), (2, cond))
    return [((x, emb), {})]


def _cogvideox_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm)
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, 3, dim), (2, cond))), {})]


def _ada_layer_norm_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm)
    device, _ = probe_device_dtype(norm)
    (x,) = _draw(norm, generator, (2, 5, dim))
    if norm.emb is not None:
        steps = norm.emb.num_embeddings
        t = (
            _labels(2, steps, generator, device)
            if norm.chunk_dim == 1
            else _labels(1, steps, generator, device)[0]
        )
        return [((x, t), {})]
    (temb,) = _draw(norm, generator, (2, cond) if norm.chunk_dim == 1 else (cond,))
    return [((x, None, temb), {})]


def _cogview_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm, norm="norm_x")
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, 3, dim), (2, cond))), {})]


def _sana_probe(norm: nn.Module, generator: torch.Generator):
    dim = norm_width(norm.norm)
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, dim), (2, dim))), {})]


def _chroma_probe(vectors: int):
    def probe(norm: nn.Module, generator: torch.Generator):
        dim = norm_width(norm.norm)
        x, emb = _draw(norm, generator, (2, 5, dim), (2, vectors, dim))
        return [((x,), {"emb": emb})]

    return probe


def _cosmos_probe(chunks: int):
    def probe(norm: nn.Module, generator: torch.Generator):
        dim = norm_width(norm.norm)
        x, emb, lora = _draw(norm, generator, (2, 5, dim), (2, dim), (2, 3 * dim))
        return [((x, emb), {}), ((x, emb, lora), {})]

    return probe


def _cosmos_check(chunks: int):
    def check(module: nn.Module) -> str | None:
        if chunks == 2 and getattr(module, "embedding_dim", None) != norm_width(
            getattr(module, "norm", None)
        ):
            return "CosmosAdaLayerNorm.embedding_dim differs from its norm's width"
        return _projection_check(module, chunks, linear="linear_2")

    return check


def _lumina_continuous_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm, linear="linear_1")
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, cond))), {})]


def _mochi_zero_probe(norm: nn.Module, generator: torch.Generator):
    dim = norm.linear.out_features // 4
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, norm.linear.in_features))), {})]


def _mochi_modulated_probe(norm: nn.Module, generator: torch.Generator):
    # No parameters: D is free. The factor as the blocks pass it: 1 + a per-sample scale, or a tanh gate.
    x, s = _draw(norm, generator, (2, 5, 16), (2, 1, 16))
    return [((x, 1 + s), {}), ((x, torch.tanh(s)), {})]


def _sana_video_probe(norm: nn.Module, generator: torch.Generator):
    dim = norm_width(norm.norm)
    return [(tuple(_draw(norm, generator, (2, 5, dim), (2, 5, dim), (2, dim))), {})]


def _token_replace_probe(norm: nn.Module, generator: torch.Generator):
    dim, cond = _dims(norm)
    x, emb, tr = _draw(norm, generator, (2, 6, dim), (2, cond), (2, cond))
    return [((x, emb, tr, 2), {})]


# --------------------------------------------------------------------------------------------------------


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of this family, in the order the registry tries them."""
    table = [
        # (module, class, fused forward, forward's parameters, sites, check, probe)
        (_NORMS, "AdaLayerNormZero", _ada_zero_fused, ["x", "timestep", "class_labels", "hidden_dtype", "emb"],
         1, lambda m: _projection_check(m, 6), _ada_zero_probe),
        (_NORMS, "AdaLayerNormZeroSingle", _ada_zero_single_fused, ["x", "emb"],
         1, lambda m: _projection_check(m, 3), _x_emb_probe),
        (_NORMS, "AdaLayerNormContinuous", _ada_continuous_fused, ["x", "conditioning_embedding"],
         1, lambda m: _projection_check(m, 2), _x_emb_probe),
        (_NORMS, "SD35AdaLayerNormZeroX", _sd35_zero_x_fused, ["hidden_states", "emb"],
         2, lambda m: _projection_check(m, 9), _x_emb_probe),
        (_NORMS, "CogVideoXLayerNormZero", _cogvideox_zero_fused, ["hidden_states", "encoder_hidden_states", "temb"],
         2, lambda m: _projection_check(m, 6), _cogvideox_probe),
        (_NORMS, "AdaLayerNorm", _ada_layer_norm_fused, ["x", "timestep", "temb"],
         1, _ada_layer_norm_check, _ada_layer_norm_probe),
        (_NORMS, "CogView3PlusAdaLayerNormZeroTextImage", _cogview_fused, ["x", "context", "emb"],
         2, _cogview_check, _cogview_probe),
        (_SANA, "SanaModulatedNorm", _sana_modulated_fused, ["hidden_states", "temb", "scale_shift_table"],
         1, lambda m: norm_site_reason(m.norm, "norm"), _sana_probe),
        (_SANA_VIDEO, "SanaModulatedNorm", _sana_video_modulated_fused, ["hidden_states", "temb", "scale_shift_table"],
         1, lambda m: norm_site_reason(m.norm, "norm"), _sana_video_probe),
        (_HUNYUAN, "HunyuanVideoTokenReplaceAdaLayerNormZero", _hunyuan_token_replace_fused,
         ["hidden_states", "emb", "token_replace_emb", "first_frame_num_tokens"],
         2, lambda m: _projection_check(m, 6), _token_replace_probe),
        (_HUNYUAN, "HunyuanVideoTokenReplaceAdaLayerNormZeroSingle", _hunyuan_token_replace_single_fused,
         ["hidden_states", "emb", "token_replace_emb", "first_frame_num_tokens"],
         2, lambda m: _projection_check(m, 3), _token_replace_probe),
        (_CHROMA, "ChromaAdaLayerNormZeroPruned", _chroma_zero_fused,
         ["x", "timestep", "class_labels", "hidden_dtype", "emb"], 1, _chroma_check, _chroma_probe(6)),
        (_CHROMA, "ChromaAdaLayerNormZeroSinglePruned", _chroma_zero_single_fused, ["x", "emb"],
         1, _chroma_check, _chroma_probe(3)),
        (_CHROMA, "ChromaAdaLayerNormContinuousPruned", _chroma_continuous_fused, ["x", "emb"],
         1, _chroma_check, _chroma_probe(2)),
        (_COSMOS, "CosmosAdaLayerNormZero", _cosmos_zero_fused, ["hidden_states", "embedded_timestep", "temb"],
         1, _cosmos_check(3), _cosmos_probe(3)),
        (_COSMOS, "CosmosAdaLayerNorm", _cosmos_fused, ["hidden_states", "embedded_timestep", "temb"],
         1, _cosmos_check(2), _cosmos_probe(2)),
        (_EASYANIMATE, "EasyAnimateLayerNormZero", _easyanimate_zero_fused,
         ["hidden_states", "encoder_hidden_states", "temb"], 2, lambda m: _projection_check(m, 6), _cogvideox_probe),
        (_NORMS, "LuminaRMSNormZero", _lumina_zero_fused, ["x", "emb"], 1, lambda m: _projection_check(m, 4),
         _x_emb_probe),
        (_NORMS, "LuminaLayerNormContinuous", _lumina_continuous_fused, ["x", "conditioning_embedding"],
         1, lambda m: _projection_check(m, 1, linear="linear_1"), _lumina_continuous_probe),
        (_MOCHI, "MochiRMSNormZero", _mochi_zero_fused, ["hidden_states", "emb"], 1, _mochi_check, _mochi_zero_probe),
        (_MOCHI, "MochiModulatedRMSNorm", _mochi_modulated_fused, ["hidden_states", "scale"],
         1, _mochi_check, _mochi_modulated_probe),
    ]  # fmt: skip
    entries: list[tuple[Any, FusionAdapter]] = []
    for module, cls, forward, params, sites, check, probe in table:
        adapter = ClassForward(
            forward,
            where=(module, cls),
            params=params,
            name=f"diffusers-{cls}",
            sites=sites,
            check=check,
            probe=probe,
        )
        entries.append(((module, cls), adapter))
    return entries

"""Fusion adapters for the diffusers single-stream DiT blocks that write a norm + modulate site inline in
their forward, and the helpers every inline adapter shares (``diffusers_mmdit.py`` holds the MMDiT blocks).

Most of a diffusers DiT block's adaLN sites sit in its norm modules (``diffusers_norms.py``), but several
blocks modulate a plain norm themselves, ``self.norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]``:

| block | family | inline sites | norm |
|---|---|---|---|
| ``BasicTransformerBlock`` (``ada_norm_zero``) | DiT | ``norm3`` | LayerNorm |
| ``BasicTransformerBlock`` (``ada_norm_single``) | PixArt (and Latte) | ``norm1``, ``norm2`` | LayerNorm |
| ``LTXVideoTransformerBlock`` | LTX-Video | ``norm1``, ``norm2`` | RMSNorm |
| ``SanaTransformerBlock`` | Sana | ``norm1``, ``norm2`` | LayerNorm |
| ``SanaVideoTransformerBlock`` | Sana-Video (per token) | ``norm1``, ``norm2`` | LayerNorm |
| ``Lumina2TransformerBlock`` (``modulation=True``) | Lumina2 | ``ffn_norm1`` (scaled, no shift); ``norm2``, ``ffn_norm2`` (post-norms times a tanh gate) | RMSNorm |

Their forwards are replaced by the same computation with those sites through
:func:`~lightning_adaptiveload.fusion.sites.norm_modulate`; the norm modules they call are left to their own
adapters, so these adapters do not own their subtree. The model-level output heads that modulate inline in
the model's forward (DiT, PixArt, Latte, LTX-Video) and BasicTransformerBlocks with plain LayerNorms are
recognised and left unfused, with the reason in the report.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion.adapter import ClassForward, FusionAdapter, NoteAdapter
from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn
from lightning_adaptiveload.fusion.sites import (
    norm_modulate,
    norm_scale,
    norm_site_reason,
    norm_times,
    norm_width,
)

__all__ = ["builtin_entries", "feed_forward", "inline_block", "sites_check"]

_ATTENTION = "diffusers.models.attention"
_LTX = "diffusers.models.transformers.transformer_ltx"
_SANA = "diffusers.models.transformers.sana_transformer"
_PIXART = "diffusers.models.transformers.pixart_transformer_2d"
_LATTE = "diffusers.models.transformers.latte_transformer_3d"
_DIT = "diffusers.models.transformers.dit_transformer_2d"
_LUMINA2 = "diffusers.models.transformers.transformer_lumina2"
_SANA_VIDEO = "diffusers.models.transformers.transformer_sana_video"


def feed_forward(block: nn.Module, ff: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``ff(hidden_states)``, chunked as the block's ``set_chunk_feed_forward`` asked (diffusers' own helper)."""
    size = getattr(block, "_chunk_size", None)
    if size is None:
        return ff(hidden_states)
    chunked = sys.modules[_ATTENTION]._chunked_feed_forward
    return chunked(ff, hidden_states, block._chunk_dim, size)


def sites_check(block: nn.Module, norms: tuple[str, ...], width: int | None = None) -> str | None:
    """Why the block's norms named ``norms`` cannot be fused sites (of ``width`` features if given), or None."""
    for name in norms:
        reason = norm_site_reason(getattr(block, name, None), name, width)
        if reason is not None:
            return f"{type(block).__name__}: {reason}"
    return None


def inline_block(module: str, cls: str, forward, params: list[str], sites, check, probe):
    """The ``(target, adapter)`` entry of a diffusers block whose forward modulates its norms inline: its
    forward replaced by ``forward``, the norm modules it calls left to their own adapters."""
    adapter = ClassForward(
        forward, where=(module, cls), params=params, owns_subtree=False, name=f"diffusers-{cls}",
        sites=sites, check=check, probe=probe,
    )  # fmt: skip
    return (module, cls), adapter


# --------------------------------------------------------------------------------------------------------
# BasicTransformerBlock: the ada_norm_zero (DiT) and ada_norm_single (PixArt) paths

_BASIC_NORM_TYPES = ("ada_norm_zero", "ada_norm_single")
_basic_logger = logging.getLogger(_ATTENTION)


def _is_basic_adaln(module: nn.Module) -> bool:
    cls = getattr(sys.modules.get(_ATTENTION), "BasicTransformerBlock", None)
    return (
        cls is not None
        and isinstance(module, cls)
        and getattr(module, "norm_type", None) in _BASIC_NORM_TYPES
    )


def _is_basic_unmodulated(module: nn.Module) -> bool:
    """A BasicTransformerBlock whose norms are plain LayerNorms (``norm_type="layer_norm"``, Latte's default)."""
    cls = getattr(sys.modules.get(_ATTENTION), "BasicTransformerBlock", None)
    return (
        cls is not None
        and isinstance(module, cls)
        and getattr(module, "norm_type", None) in ("layer_norm", "layer_norm_i2vgen")
    )


def _basic_unmodulated_reason(block: nn.Module) -> str:
    return f"norm_type={block.norm_type!r}: its LayerNorms are not modulated, nothing to fuse"


def _basic_sites(block: nn.Module) -> int:
    return 1 if block.norm_type == "ada_norm_zero" else 2


def _basic_check(block: nn.Module) -> str | None:
    if block.norm_type == "ada_norm_zero":
        return sites_check(block, ("norm3",), block.dim)
    reason = sites_check(block, ("norm1", "norm2"), block.dim)
    table = getattr(block, "scale_shift_table", None)
    if reason is None and not (isinstance(table, torch.Tensor) and tuple(table.shape) == (6, block.dim)):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        reason = (
            f"BasicTransformerBlock(ada_norm_single).scale_shift_table is {shape}, expected (6, {block.dim})"
        )
    return reason


def _basic_fused(
    block,
    hidden_states,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    timestep=None,
    cross_attention_kwargs=None,
    class_labels=None,
    added_cond_kwargs=None,
):
    """BasicTransformerBlock, norm types ada_norm_zero (the FFN site) and ada_norm_single (both sites) fused."""
    if cross_attention_kwargs is not None and cross_attention_kwargs.get("scale", None) is not None:
        _basic_logger.warning(
            "cross_attention_kwargs['scale'] has no effect on this block (the unfused block ignores it too)"
        )
    single = block.norm_type == "ada_norm_single"
    batch_size = hidden_states.shape[0]
    if single:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            block.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
        ).chunk(6, dim=1)
        norm_h = norm_modulate(block.norm1, hidden_states, shift_msa, scale_msa)
    else:
        norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(
            hidden_states, timestep, class_labels, hidden_dtype=hidden_states.dtype
        )
    if block.pos_embed is not None:
        norm_h = block.pos_embed(norm_h)

    attn_kwargs = dict(cross_attention_kwargs) if cross_attention_kwargs is not None else {}
    gligen = attn_kwargs.pop("gligen", None)
    attn_output = block.attn1(
        norm_h,
        encoder_hidden_states=encoder_hidden_states if block.only_cross_attention else None,
        attention_mask=attention_mask,
        **attn_kwargs,
    )
    attn_output = (gate_msa if single else gate_msa.unsqueeze(1)) * attn_output
    hidden_states = attn_output + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    if gligen is not None:
        hidden_states = block.fuser(hidden_states, gligen["objs"])

    if block.attn2 is not None:
        # PixArt applies no norm before its cross-attention; DiT's ada_norm_zero uses the plain norm2.
        norm_h = hidden_states if single else block.norm2(hidden_states)
        if block.pos_embed is not None and not single:
            norm_h = block.pos_embed(norm_h)
        attn_output = block.attn2(
            norm_h,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
            **attn_kwargs,
        )
        hidden_states = attn_output + hidden_states

    if single:
        norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp, scale_mlp)
    else:
        norm_h = norm_modulate(block.norm3, hidden_states, shift_mlp[:, None], scale_mlp[:, None])
    ff_output = feed_forward(block, block.ff, norm_h)
    ff_output = (gate_mlp if single else gate_mlp.unsqueeze(1)) * ff_output
    hidden_states = ff_output + hidden_states
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.squeeze(1)
    return hidden_states


def _basic_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = block.dim
    x = probe_randn((2, 6, dim), generator, device, dtype)
    kwargs: dict[str, Any] = {}
    if block.attn2 is not None or block.only_cross_attention:
        width = block.cross_attention_dim or dim
        kwargs["encoder_hidden_states"] = probe_randn((2, 4, width), generator, device, dtype)
    if block.norm_type == "ada_norm_single":
        kwargs["timestep"] = probe_randn((2, 6 * dim), generator, device, dtype)
    else:
        emb = block.norm1.emb
        kwargs["timestep"] = torch.randint(0, 1000, (2,), generator=generator, device=device)
        if emb is not None:
            classes = max(int(getattr(getattr(emb, "class_embedder", None), "num_classes", 1)), 1)
            kwargs["class_labels"] = torch.randint(0, classes, (2,), generator=generator, device=device)
    return [((x,), kwargs)]


# --------------------------------------------------------------------------------------------------------
# LTX-Video (RMSNorm) and Sana


def _ltx_check(block: nn.Module) -> str | None:
    table = getattr(block, "scale_shift_table", None)
    if not (isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[0] == 6):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        return f"LTXVideoTransformerBlock.scale_shift_table is {shape}, expected (6, D)"
    return sites_check(block, ("norm1", "norm2"), table.shape[1])


def _ltx_fused(
    block, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, encoder_attention_mask=None
):
    """LTXVideoTransformerBlock: both RMSNorm sites fused; temb (B, T, 6 D), T = 1 or one row per token."""
    batch_size = hidden_states.size(0)
    table = block.scale_shift_table
    ada = table[None, None].to(temb.device) + temb.reshape(batch_size, temb.size(1), table.shape[0], -1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada.unbind(dim=2)
    norm_h = norm_modulate(block.norm1, hidden_states, shift_msa, scale_msa)
    attn = block.attn1(hidden_states=norm_h, encoder_hidden_states=None, image_rotary_emb=image_rotary_emb)
    hidden_states = hidden_states + attn * gate_msa
    attn = block.attn2(
        hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        image_rotary_emb=None,
        attention_mask=encoder_attention_mask,
    )
    hidden_states = hidden_states + attn
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp, scale_mlp)
    return hidden_states + block.ff(norm_h) * gate_mlp


def _ltx_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = block.scale_shift_table.shape[1]
    x = probe_randn((2, 6, dim), generator, device, dtype)
    context = probe_randn((2, 4, block.attn2.cross_attention_dim), generator, device, dtype)
    per_sample = probe_randn((2, 1, 6 * dim), generator, device, dtype)
    per_token = probe_randn((2, 6, 6 * dim), generator, device, dtype)
    return [((x, context, per_sample), {}), ((x, context, per_token), {})]


def _sana_check(block: nn.Module) -> str | None:
    table = getattr(block, "scale_shift_table", None)
    if not (isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[0] == 6):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        return f"{type(block).__name__}.scale_shift_table is {shape}, expected (6, D)"
    return sites_check(block, ("norm1", "norm2"), table.shape[1])


def _sana_fused(
    block,
    hidden_states,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    timestep=None,
    height=None,
    width=None,
):
    """SanaTransformerBlock: both sites fused (the FFN is a convolution over the (height, width) grid)."""
    batch_size = hidden_states.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        block.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
    ).chunk(6, dim=1)
    norm_h = norm_modulate(block.norm1, hidden_states, shift_msa, scale_msa).to(hidden_states.dtype)
    hidden_states = hidden_states + gate_msa * block.attn1(norm_h)
    if block.attn2 is not None:
        attn_output = block.attn2(
            hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask
        )
        hidden_states = attn_output + hidden_states
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp, scale_mlp)
    norm_h = norm_h.unflatten(1, (height, width)).permute(0, 3, 1, 2)
    ff_output = block.ff(norm_h).flatten(2, 3).permute(0, 2, 1)
    return hidden_states + gate_mlp * ff_output


def _sana_video_fused(
    block,
    hidden_states,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    timestep=None,
    frames=None,
    height=None,
    width=None,
    rotary_emb=None,
):
    """SanaVideoTransformerBlock: Sana's block with the modulation per token ((B, S, 6 D)), rotary attention and
    the FFN a convolution over the (frames, height, width) grid; both sites fused."""
    batch_size = hidden_states.shape[0]
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        block.scale_shift_table[None, None] + timestep.reshape(batch_size, timestep.shape[1], 6, -1)
    ).unbind(dim=2)
    norm_h = norm_modulate(block.norm1, hidden_states, shift_msa, scale_msa).to(hidden_states.dtype)
    hidden_states = hidden_states + gate_msa * block.attn1(norm_h, rotary_emb=rotary_emb)
    if block.attn2 is not None:
        attn_output = block.attn2(
            hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask
        )
        hidden_states = attn_output + hidden_states
    norm_h = norm_modulate(block.norm2, hidden_states, shift_mlp, scale_mlp)
    ff_output = block.ff(norm_h.unflatten(1, (frames, height, width))).flatten(1, 3)
    return hidden_states + gate_mlp * ff_output


def _sana_video_probe(block: nn.Module, generator: torch.Generator):
    (x,), kwargs = _sana_probe(block, generator)[0]
    device, dtype = x.device, x.dtype
    dim = block.scale_shift_table.shape[1]
    # 2 frames of 1 x 3 tokens; a modulation per token; the rotary (cos, sin) of Wan's rope, (1, S, 1, head_dim).
    angle = probe_randn((1, 6, 1, dim // block.attn1.heads), generator, device, torch.float32)
    kwargs = {**kwargs, "timestep": probe_randn((2, 6, 6 * dim), generator, device, dtype), "frames": 2,
              "height": 1, "width": 3, "rotary_emb": (angle.cos(), angle.sin())}  # fmt: skip
    return [((x,), kwargs)]


def _sana_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = block.scale_shift_table.shape[1]
    x = probe_randn((2, 6, dim), generator, device, dtype)
    kwargs: dict[str, Any] = {
        "timestep": probe_randn((2, 6 * dim), generator, device, dtype),
        "height": 2,
        "width": 3,
    }
    if block.attn2 is not None:
        kwargs["encoder_hidden_states"] = probe_randn(
            (2, 4, block.attn2.cross_attention_dim), generator, device, dtype
        )
    return [((x,), kwargs)]


# --------------------------------------------------------------------------------------------------------
# Lumina2: scale-only and gated RMSNorm sites (its norm1, a LuminaRMSNormZero, has its own adapter)


def _is_lumina2_block(module: nn.Module, modulated: bool) -> bool:
    cls = getattr(sys.modules.get(_LUMINA2), "Lumina2TransformerBlock", None)
    return (
        cls is not None
        and isinstance(module, cls)
        and bool(getattr(module, "modulation", False)) == modulated
    )


def _lumina2_fused(block, hidden_states, attention_mask, image_rotary_emb, temb=None):
    """Lumina2TransformerBlock with ``modulation=True``: the FFN's scaled norm and both gated post-norms fused."""
    norm_hidden_states, gate_msa, scale_mlp, gate_mlp = block.norm1(hidden_states, temb)
    attn_output = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_hidden_states,
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    hidden_states = hidden_states + norm_times(block.norm2, attn_output, gate_msa.unsqueeze(1).tanh())
    mlp_output = block.feed_forward(norm_scale(block.ffn_norm1, hidden_states, scale_mlp.unsqueeze(1)))
    return hidden_states + norm_times(block.ffn_norm2, mlp_output, gate_mlp.unsqueeze(1).tanh())


def _lumina2_probe(block: nn.Module, generator: torch.Generator):
    device, dtype = probe_device_dtype(block)
    dim = norm_width(block.norm2)
    x = probe_randn((2, 6, dim), generator, device, dtype)
    temb = probe_randn((2, block.norm1.linear.in_features), generator, device, dtype)
    return [((x, None, None, temb), {})]


def _lumina2_unmodulated_reason(block: nn.Module) -> str:
    return "modulation=False (a context refiner block): its RMSNorms are not modulated, nothing to fuse"


def _lumina2_embedding_reason(module: nn.Module) -> str:
    return "the caption embedder's RMSNorm is not modulated: nothing to fuse"


def _cosmos_embedding_reason(module: nn.Module) -> str:
    return "the timestep embedding's RMSNorm is not modulated: nothing to fuse"


# --------------------------------------------------------------------------------------------------------
# Output heads modulated inline in a model's forward: recognised, left unfused


def _head_reason(model_cls: str) -> Any:
    def reason(model: nn.Module) -> str:
        return (
            f"output head (norm_out and the shift / scale computed inline in {model_cls}.forward) left unfused: "
            "fusing it means replacing the whole model forward for one site per model"
        )

    return reason


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of this family, in the order the registry tries them."""

    basic = ClassForward(
        _basic_fused,
        where=(_ATTENTION, "BasicTransformerBlock"),
        params=[
            "hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "timestep",
            "cross_attention_kwargs", "class_labels", "added_cond_kwargs",
        ],
        owns_subtree=False,
        name="diffusers-BasicTransformerBlock-adaln",
        sites=_basic_sites,
        check=_basic_check,
        probe=_basic_probe,
    )  # fmt: skip
    return [
        (_is_basic_adaln, basic),
        inline_block(_LTX, "LTXVideoTransformerBlock", _ltx_fused,
               ["hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "encoder_attention_mask"],
               2, _ltx_check, _ltx_probe),
        inline_block(_SANA, "SanaTransformerBlock", _sana_fused,
               ["hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "timestep",
                "height", "width"],
               2, _sana_check, _sana_probe),
        inline_block(_SANA_VIDEO, "SanaVideoTransformerBlock", _sana_video_fused,
               ["hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "timestep",
                "frames", "height", "width", "rotary_emb"],
               2, _sana_check, _sana_video_probe),
        ((_DIT, "DiTTransformer2DModel"), NoteAdapter("diffusers-dit-head", _head_reason("DiTTransformer2DModel"))),
        ((_PIXART, "PixArtTransformer2DModel"),
         NoteAdapter("diffusers-pixart-head", _head_reason("PixArtTransformer2DModel"))),
        ((_LATTE, "LatteTransformer3DModel"),
         NoteAdapter("diffusers-latte-head", _head_reason("LatteTransformer3DModel"))),
        (lambda m: _is_lumina2_block(m, True), ClassForward(
            _lumina2_fused, where=(_LUMINA2, "Lumina2TransformerBlock"),
            params=["hidden_states", "attention_mask", "image_rotary_emb", "temb"], owns_subtree=False,
            name="diffusers-Lumina2TransformerBlock", sites=3,
            check=lambda b: sites_check(b, ("norm2", "ffn_norm1", "ffn_norm2")), probe=_lumina2_probe)),
        (lambda m: _is_lumina2_block(m, False),
         NoteAdapter("diffusers-lumina2-refiner", _lumina2_unmodulated_reason)),
        (("diffusers.models.transformers.transformer_cosmos", "CosmosEmbedding"),
         NoteAdapter("diffusers-cosmos-embedding", _cosmos_embedding_reason)),
        ((_LUMINA2, "Lumina2CombinedTimestepCaptionEmbedding"),
         NoteAdapter("diffusers-lumina2-embedding", _lumina2_embedding_reason)),
        (_is_basic_unmodulated, NoteAdapter("diffusers-BasicTransformerBlock-plain", _basic_unmodulated_reason)),
        ((_LTX, "LTXVideoTransformer3DModel"),
         NoteAdapter("diffusers-ltx-head", _head_reason("LTXVideoTransformer3DModel"))),
    ]  # fmt: skip

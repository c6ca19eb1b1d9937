"""Fusion adapters for diffusers' Wan transformer (``WanTransformer3DModel``, Wan 2.1 and 2.2).

``WanTransformerBlock``: its norm1 and norm3 sites are fused by a forward replacement, for per-sample
modulation (``temb`` (B, 6, D)) and per-token modulation (``temb`` (B, S, 6, D), Wan 2.2 TI2V). The model's
output head is recognised and deliberately left unfused (the report says why).

Wan-Animate (``WanAnimateTransformer3DModel``) holds a copy of the block, which takes the same adapter; its
face encoder and face adapters, whose LayerNorms are not modulated, are noted as having nothing to fuse.
SkyReels-V2's block (an attention mask, per-token modulation for diffusion forcing) and Wan-VACE's control
blocks (a projection in and out) have adapters of their own that share the block's layers (``_wan_body``).
The heads of all four models are left unfused as Wan's is. Helios's block (the context length passed to
its attention processors, cross-attention on the current tokens only) has its own adapter, and its output
norm (``HeliosOutputNorm``, per token) is fused. diffusers is optional: the classes are looked up only in modules already imported,
so nothing here imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_adaptiveload import ops as _ops
from lightning_adaptiveload.fusion.adapter import ClassForward, FusionAdapter, NoteAdapter, layer_norm_args
from lightning_adaptiveload.fusion.probe import probe_device_dtype, probe_randn

__all__ = ["builtin_entries"]

_WAN_MODULE = "diffusers.models.transformers.transformer_wan"
_ANIMATE_MODULE = "diffusers.models.transformers.transformer_wan_animate"
_SKYREELS_MODULE = "diffusers.models.transformers.transformer_skyreels_v2"
_VACE_MODULE = "diffusers.models.transformers.transformer_wan_vace"
_HELIOS_MODULE = "diffusers.models.transformers.transformer_helios"
_WAN_BLOCK_ATTRS = ("norm1", "norm2", "norm3", "attn1", "attn2", "ffn", "scale_shift_table")
_WAN_FORWARD_PARAMS = ["hidden_states", "encoder_hidden_states", "temb", "rotary_emb"]


def _wan_block_check(block: nn.Module) -> str | None:
    # ClassForward prefixes the installed diffusers version and checks the forward's parameters.
    missing = [a for a in _WAN_BLOCK_ATTRS if not hasattr(block, a)]
    if missing:
        return f"{type(block).__name__} has no {missing}; the fused forward does not fit this version"
    table = block.scale_shift_table
    if not (isinstance(table, torch.Tensor) and table.dim() == 3 and tuple(table.shape[:2]) == (1, 6)):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        return f"scale_shift_table is {shape}, expected (1, 6, D)"
    dim = table.shape[-1]
    for name in ("norm1", "norm3"):
        norm = getattr(block, name)
        if not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (dim,):
            return f"{name} is {type(norm).__name__}, expected a LayerNorm over D={dim}"
    return None


def _wan_block_forward_fused(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: Any,
) -> torch.Tensor:
    """WanTransformerBlock.forward with the norm1 and norm3 sites fused.

    Everything else is as diffusers computes it: modulation vectors in fp32 (table + temb), the attention
    processors, rotary embedding, the cross-attention norm2, the fp32 gated residuals and the casts back.

    Args:
        hidden_states: (B, S, D), the block's dtype.
        encoder_hidden_states: (B, L, D) text (and image) states.
        temb: (B, 6, D) per-sample modulation (Wan 2.1, Wan 2.2 14B) or (B, S, 6, D) per-token (Wan 2.2
            TI2V); any float dtype, used in fp32.
        rotary_emb: (cos, sin), each (1, S, 1, head_dim), as the model passes it.
    """
    return _wan_body(block, hidden_states, encoder_hidden_states, _wan_mods(block, temb), rotary_emb)


def _wan_mods(block: nn.Module, temb: torch.Tensor):
    """The six modulation vectors of Wan's block (and Helios's), the table plus temb in fp32."""
    table = block.scale_shift_table
    if temb.ndim == 4:
        # Per token: each chunk is (B, S, 1, D) -> (B, S, D), the op's per-token layout.
        return [m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    # Per sample: each chunk is (B, 1, D).
    return (table + temb.float()).chunk(6, dim=1)


def _wan_body(
    block, hidden_states, encoder_hidden_states, mods, rotary_emb, attention_mask=None, context_length=None
):
    """The layers of Wan's block (and of its SkyReels-V2, VACE and Helios variants) given the six modulation
    vectors: self-attention, cross-attention, FFN, the norm1 and norm3 sites fused.

    ``context_length`` (Helios) is passed on to both attention processors; with the block's
    ``guidance_cross_attn`` the cross-attention sees only the last ``context_length`` tokens (the history
    before them skips it)."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods
    extra = () if context_length is None else (context_length,)
    norm_hidden_states = _ops.layer_norm_modulate(
        hidden_states, shift_msa, scale_msa, **layer_norm_args(block.norm1)
    )
    attn_output = block.attn1(norm_hidden_states, None, attention_mask, rotary_emb, *extra)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

    history = None
    if getattr(block, "guidance_cross_attn", False):
        history_seq_len = hidden_states.shape[1] - context_length
        history, hidden_states = torch.split(hidden_states, [history_seq_len, context_length], dim=1)
    norm_hidden_states = block.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None, *extra)
    hidden_states = hidden_states + attn_output
    if history is not None:
        hidden_states = torch.cat([history, hidden_states], dim=1)

    norm_hidden_states = _ops.layer_norm_modulate(
        hidden_states, c_shift_msa, c_scale_msa, **layer_norm_args(block.norm3)
    )
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def _wan_block_probe(block: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = probe_device_dtype(block)
    dim = block.scale_shift_table.shape[-1]
    head_dim = dim // block.attn1.heads
    batch, seq = 2, 6
    # The processor splits image context off the front when add_k_proj exists; it assumes 512 text tokens.
    context = 514 if getattr(block.attn2, "add_k_proj", None) is not None else 5
    x = probe_randn((batch, seq, dim), generator, device, dtype)
    enc = probe_randn((batch, context, dim), generator, device, dtype)
    angle = probe_randn((1, seq, 1, head_dim), generator, device, torch.float32)
    rotary = (angle.cos(), angle.sin())
    per_sample = probe_randn((batch, 6, dim), generator, device, dtype)
    per_token = probe_randn((batch, seq, 6, dim), generator, device, dtype)
    return [((x, enc, per_sample, rotary), {}), ((x, enc, per_token, rotary), {})]


def _skyreels_fused(block, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask=None):
    """SkyReelsV2TransformerBlock: Wan's block with an attention mask, and per-token modulation for diffusion
    forcing given as (B, 6, S, D)."""
    table = block.scale_shift_table
    if temb.dim() == 4:
        mods = [m.squeeze(1) for m in (table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
    else:
        mods = (table + temb.float()).chunk(6, dim=1)
    return _wan_body(block, hidden_states, encoder_hidden_states, mods, rotary_emb, attention_mask)


def _skyreels_probe(block: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    (x, enc, per_sample, rotary), _ = _wan_block_probe(block, generator)[0]
    per_token = probe_randn((x.shape[0], 6, x.shape[1], x.shape[2]), generator, x.device, x.dtype)
    return [((x, enc, per_sample, rotary, None), {}), ((x, enc, per_token, rotary, None), {})]


def _vace_fused(block, hidden_states, encoder_hidden_states, control_hidden_states, temb, rotary_emb):
    """WanVACETransformerBlock: Wan's block on the control stream (the first one projects it in and adds the
    video's states), with its output projection."""
    if block.proj_in is not None:
        control_hidden_states = block.proj_in(control_hidden_states) + hidden_states
    mods = (block.scale_shift_table.to(temb.device) + temb.float()).chunk(6, dim=1)
    control_hidden_states = _wan_body(block, control_hidden_states, encoder_hidden_states, mods, rotary_emb)
    conditioning_states = block.proj_out(control_hidden_states) if block.proj_out is not None else None
    return conditioning_states, control_hidden_states


def _vace_probe(block: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    (x, enc, per_sample, rotary), _ = _wan_block_probe(block, generator)[0]
    control = probe_randn(tuple(x.shape), generator, x.device, x.dtype)
    return [((x, enc, control, per_sample, rotary), {})]


def _helios_fused(
    block, hidden_states, encoder_hidden_states, temb, rotary_emb, original_context_length=None
):
    """HeliosTransformerBlock: Wan's block with the context length passed to the attention processors and,
    with ``guidance_cross_attn``, the cross-attention on the current tokens only (not the history)."""
    mods = _wan_mods(block, temb)
    return _wan_body(
        block, hidden_states, encoder_hidden_states, mods, rotary_emb, context_length=original_context_length
    )


def _helios_probe(block: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = probe_device_dtype(block)
    dim = block.scale_shift_table.shape[-1]
    head_dim = dim // block.attn1.heads
    x = probe_randn((2, 6, dim), generator, device, dtype)
    enc = probe_randn((2, 5, dim), generator, device, dtype)
    angle = probe_randn((2, 6, head_dim), generator, device, torch.float32)
    rotary = torch.cat([angle.cos(), angle.sin()], dim=-1)  # as the model passes it: (B, S, 2 head_dim)
    temb = probe_randn((2, 6, 6, dim), generator, device, dtype)
    return [((x, enc, temb, rotary, 4), {})]  # 2 history tokens, 4 current


def _helios_head_check(norm: nn.Module) -> str | None:
    table = getattr(norm, "scale_shift_table", None)
    if not (isinstance(table, torch.Tensor) and table.dim() == 3 and tuple(table.shape[:2]) == (1, 2)):
        return "HeliosOutputNorm.scale_shift_table should be (1, 2, D)"
    inner = getattr(norm, "norm", None)
    if not isinstance(inner, nn.LayerNorm) or tuple(inner.normalized_shape) != (table.shape[-1],):
        return "HeliosOutputNorm.norm should be a LayerNorm over D"
    return None


def _helios_head_fused(
    norm: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor, original_context_length: int
):
    """HeliosOutputNorm: the current tokens' (shift, scale), per token, from the (1, 2, D) table and temb."""
    temb = temb[:, -original_context_length:, :]
    shift, scale = (norm.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
    shift, scale = shift.squeeze(2).to(hidden_states.device), scale.squeeze(2).to(hidden_states.device)
    x = hidden_states[:, -original_context_length:, :]
    return _ops.layer_norm_modulate(x, shift, scale, **layer_norm_args(norm.norm)).type_as(hidden_states)


def _helios_head_probe(norm: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = probe_device_dtype(norm)
    dim = norm.scale_shift_table.shape[-1]
    x, temb = (probe_randn((2, 6, dim), generator, device, dtype) for _ in range(2))
    return [((x, temb, 4), {})]


def _wan_model_head_reason(model: nn.Module) -> str | None:
    if not hasattr(model, "norm_out"):
        return None
    return (
        "output head (norm_out with the model's scale_shift_table) is modulated inline in "
        f"{type(model).__name__}.forward; left unfused, since fusing it means replacing the whole model forward "
        "for one site per model (the blocks hold the other 2 x num_layers)"
    )


def _unmodulated_reason(module: nn.Module) -> str:
    return f"its LayerNorms are not modulated ({type(module).__name__} of Wan-Animate's face path): nothing to fuse"


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of this family, in the order the registry tries them."""
    # A ClassForward, so that the copies of the block in other modules (ChronoEdit's, Wan-Animate's) take it.
    wan_block = ClassForward(
        _wan_block_forward_fused,
        where=(_WAN_MODULE, "WanTransformerBlock"),
        params=_WAN_FORWARD_PARAMS,
        name="diffusers-wan-block",
        sites=2,
        check=_wan_block_check,
        probe=_wan_block_probe,
    )
    variants = [
        (_SKYREELS_MODULE, "SkyReelsV2TransformerBlock", _skyreels_fused, [*_WAN_FORWARD_PARAMS, "attention_mask"],
         _skyreels_probe),
        (_VACE_MODULE, "WanVACETransformerBlock", _vace_fused,
         ["hidden_states", "encoder_hidden_states", "control_hidden_states", "temb", "rotary_emb"], _vace_probe),
        (_HELIOS_MODULE, "HeliosTransformerBlock", _helios_fused, [*_WAN_FORWARD_PARAMS, "original_context_length"],
         _helios_probe),
    ]  # fmt: skip
    blocks = [
        ((module, cls), ClassForward(forward, where=(module, cls), params=params, name=f"diffusers-{cls}", sites=2,
                                     check=_wan_block_check, probe=probe))
        for module, cls, forward, params, probe in variants
    ]  # fmt: skip
    return [
        ((_WAN_MODULE, "WanTransformerBlock"), wan_block),
        *blocks,
        ((_SKYREELS_MODULE, "SkyReelsV2Transformer3DModel"),
         NoteAdapter("diffusers-skyreels-v2-head", _wan_model_head_reason)),
        ((_HELIOS_MODULE, "HeliosOutputNorm"), ClassForward(
            _helios_head_fused, where=(_HELIOS_MODULE, "HeliosOutputNorm"),
            params=["hidden_states", "temb", "original_context_length"], name="diffusers-HeliosOutputNorm", sites=1,
            check=_helios_head_check, probe=_helios_head_probe)),
        ((_VACE_MODULE, "WanVACETransformer3DModel"), NoteAdapter("diffusers-wan-vace-head", _wan_model_head_reason)),
        ((_WAN_MODULE, "WanTransformer3DModel"), NoteAdapter("diffusers-wan-head", _wan_model_head_reason)),
        ((_ANIMATE_MODULE, "WanAnimateTransformer3DModel"),
         NoteAdapter("diffusers-wan-animate-head", _wan_model_head_reason)),
        ((_ANIMATE_MODULE, "WanAnimateFaceEncoder"), NoteAdapter("diffusers-wan-animate-face", _unmodulated_reason)),
        ((_ANIMATE_MODULE, "WanAnimateFaceBlockCrossAttention"),
         NoteAdapter("diffusers-wan-animate-face-adapter", _unmodulated_reason)),
    ]  # fmt: skip

"""Diffusers DiT families x {eager, eager fused, compiled, compiled fused}: one training step each.

Issue 59's table. For each family (Wan, SD3, Flux, CogVideoX, LTX-Video, HunyuanVideo, PixArt, DiT, Sana; and
Mochi and Lumina2, whose norms scale without a shift) it
builds the diffusers model with the block width, heads and embedders of a released model but only
``--layers`` transformer blocks (per block list: Flux and HunyuanVideo get that many double- and
single-stream blocks), random weights (adaLN / modulation weights random too, never zero), batch 1 at one
realistic token count, and times forward + backward of a training step (MSE against a fixed random target,
gradients of every weight) in four variants:

- ``eager``: the model as diffusers builds it;
- ``eager_fused``: after ``fuse_norm_modulate(model)``;
- ``compiled``: every transformer block ``torch.compile``d (``compile_blocks`` of
  ``lightning_adaptiveload.models.acceleration``, regional, with its defaults: dynamic sizes, full graph,
  inductor's safe reductions);
- ``compiled_fused``: fused, then compiled.

With ``--layers 2`` most families compile two graphs per block class, not one: the first block's input
differs from the later blocks' (its strides, dtype or a None argument), so dynamo recompiles for the second
block; a 30-block model compiles the same two. ``graphs_compiled`` records the count per variant.

A family that fusion cannot fuse yet (``FusionError``) gets its fused variants recorded as skipped with the
error; a variant that fails (a graph break under ``fullgraph``, which is retried once without it; out of
memory; anything else) is recorded with its error. Nothing stops the run.

Order and timing. First the eager phase of every family (eager and eager fused side by side), then the
compiled phase (compiled and compiled fused side by side), each family built again from the same seed, so
that a call cut short by the time budget still has the whole eager table. Per variant: the first step
(compiles included) is timed apart (``first_step_s``), then ``--warmup`` untimed steps; then ``--rounds``
rounds in which the variants of the phase alternate, ``--iters`` steps each, timed with CUDA events (one
pair per step, synchronised). Medians with 10th / 90th percentiles in ms. Peak memory per variant is the
allocator's peak during its timed steps above what was allocated before them (activations, gradients,
workspace), and the absolute peak. Weights are fp32 under bf16 autocast (``--dtype bf16``: bf16 weights).

Writes ``families_<device>_<date>.json`` into ``--out`` after every family and phase (a run cut short keeps
what it measured), prints a markdown table last. ``--merge A.json B.json`` combines the results of several
calls (later files fill in or replace variants) into one table and file. Never asserts a time.

Usage::

    python benchmarks/fusion/bench_families.py                        # one H200; see gpu_bench_families.sh
    python benchmarks/fusion/bench_families.py --families wan flux --phases eager
    python benchmarks/fusion/bench_families.py --quick                # CPU, tiny configs, seconds
    python benchmarks/fusion/bench_families.py --quick --compile-quick  # and compiled (aot_eager)
    python benchmarks/fusion/bench_families.py --merge a.json b.json
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cpu_name, cuda_event_times, device_tag, results_dir  # noqa: E402

VARIANTS = ("eager", "eager_fused", "compiled", "compiled_fused")
PHASES = {"eager": ("eager", "eager_fused"), "compiled": ("compiled", "compiled_fused")}


# --------------------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One diffusers model family: the released model's sizes, a realistic input shape, and tiny ones.

    Attributes:
        key: short name (``--families``).
        cls: the diffusers class.
        model: the released model whose sizes ``config`` has, and where they come from.
        config: constructor arguments of the released model, its layer counts left out.
        layer_keys: the constructor's block-count arguments (one per block list), set to ``--layers``.
        full_layers: the released model's block counts.
        block_lists: the model attributes holding the transformer blocks (what ``compiled`` compiles).
        shape: the input shape (latent sizes before patching, text tokens) and what it stands for.
        quick_config, quick_shape: a tiny version for ``--quick``.
        inputs: ``inputs(model.config, shape, batch, device, generator) -> (forward kwargs, image/video
            tokens)``.
    """

    key: str
    cls: str
    model: str
    config: dict[str, Any]
    layer_keys: tuple[str, ...]
    full_layers: dict[str, int]
    block_lists: tuple[str, ...]
    shape: dict[str, Any]
    quick_config: dict[str, Any]
    quick_shape: dict[str, Any]
    inputs: Callable[..., tuple[dict[str, Any], int]]


def _randn(g, dev, *shape):
    return torch.randn(*shape, generator=g, device=dev)


def _steps(g, dev, b):
    return torch.randint(0, 1000, (b,), generator=g, device=dev)


def _wan_inputs(c, s, b, dev, g):
    f, h, w = s["latent"]
    pt, ph, pw = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], f, h, w),
        "timestep": _steps(g, dev, b),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["text_dim"]),
    }
    return kw, (f // pt) * (h // ph) * (w // pw)


def _sd3_inputs(c, s, b, dev, g):
    h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], h, w),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["joint_attention_dim"]),
        "pooled_projections": _randn(g, dev, b, c["pooled_projection_dim"]),
        "timestep": _steps(g, dev, b),
    }
    return kw, (h // p) * (w // p)


def _flux_inputs(c, s, b, dev, g):
    h, w = s["grid"]  # after the pipeline's 2 x 2 packing of the VAE latent
    img_ids = torch.zeros(h, w, 3, device=dev)
    img_ids[..., 1] = torch.arange(h, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(w, device=dev)[None, :]
    kw = {
        "hidden_states": _randn(g, dev, b, h * w, c["in_channels"]),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["joint_attention_dim"]),
        "pooled_projections": _randn(g, dev, b, c["pooled_projection_dim"]),
        # The pipeline passes t / 1000 and the guidance scale; the model multiplies both by 1000.
        "timestep": torch.rand(b, generator=g, device=dev),
        "img_ids": img_ids.reshape(h * w, 3),
        "txt_ids": torch.zeros(s["text"], 3, device=dev),
    }
    if c.get("guidance_embeds"):
        kw["guidance"] = torch.full((b,), 3.5, device=dev)
    return kw, h * w


def _cogvideox_inputs(c, s, b, dev, g):
    f, h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, f, c["in_channels"], h, w),  # (B, F, C, H, W)
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["text_embed_dim"]),
        "timestep": _steps(g, dev, b),
    }
    return kw, f * (h // p) * (w // p)


def _ltx_inputs(c, s, b, dev, g):
    f, h, w = s["latent"]  # patch 1 x 1 x 1: the pipeline packs the latent to (B, F*H*W, C)
    kw = {
        "hidden_states": _randn(g, dev, b, f * h * w, c["in_channels"]),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["caption_channels"]),
        "timestep": _steps(g, dev, b),
        "encoder_attention_mask": torch.ones(b, s["text"], device=dev),
        "num_frames": f,
        "height": h,
        "width": w,
        # (VAE temporal compression / frame rate, spatial compression, spatial compression), as the pipeline.
        "rope_interpolation_scale": (8 / 25, 32, 32),
    }
    return kw, f * h * w


def _hunyuan_inputs(c, s, b, dev, g):
    f, h, w = s["latent"]
    p, pt = c["patch_size"], c["patch_size_t"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], f, h, w),
        "timestep": _steps(g, dev, b),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["text_embed_dim"]),
        "encoder_attention_mask": torch.ones(b, s["text"], device=dev),
        "pooled_projections": _randn(g, dev, b, c["pooled_projection_dim"]),
    }
    if c.get("guidance_embeds"):
        kw["guidance"] = torch.full((b,), 6000.0, device=dev)  # scale 6 x 1000, as the pipeline
    return kw, (f // pt) * (h // p) * (w // p)


def _pixart_inputs(c, s, b, dev, g):
    h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], h, w),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["caption_channels"]),
        "encoder_attention_mask": torch.ones(b, s["text"], device=dev),
        "timestep": _steps(g, dev, b),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }
    return kw, (h // p) * (w // p)


def _dit_inputs(c, s, b, dev, g):
    h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], h, w),
        "timestep": _steps(g, dev, b),
        "class_labels": torch.randint(0, 1000, (b,), generator=g, device=dev),
    }
    return kw, (h // p) * (w // p)


def _sana_inputs(c, s, b, dev, g):
    h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], h, w),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["caption_channels"]),
        "encoder_attention_mask": torch.ones(b, s["text"], device=dev),
        "timestep": _steps(g, dev, b),
    }
    return kw, (h // p) * (w // p)


def _mochi_inputs(c, s, b, dev, g):
    f, h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], f, h, w),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["text_embed_dim"]),
        "timestep": _steps(g, dev, b),
        "encoder_attention_mask": torch.ones(b, s["text"], dtype=torch.bool, device=dev),
    }
    return kw, f * (h // p) * (w // p)


def _lumina2_inputs(c, s, b, dev, g):
    h, w = s["latent"]
    p = c["patch_size"]
    kw = {
        "hidden_states": _randn(g, dev, b, c["in_channels"], h, w),
        # The pipeline passes t in [0, 1] (flow matching), the model embeds it as given.
        "timestep": torch.rand(b, generator=g, device=dev),
        "encoder_hidden_states": _randn(g, dev, b, s["text"], c["cap_feat_dim"]),
        "encoder_attention_mask": torch.ones(b, s["text"], dtype=torch.bool, device=dev),
    }
    return kw, (h // p) * (w // p)


# Sizes from the released models' transformer/config.json on the Hugging Face Hub (the repositories named).
# fmt: off
FAMILIES: dict[str, Family] = {
    f.key: f
    for f in [
        Family(
            key="wan", cls="WanTransformer3DModel",
            model="Wan 2.1 T2V-1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers)",
            config=dict(
                patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-06
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 30},
            block_lists=("blocks",),
            shape=dict(latent=(21, 60, 104), text=512, what="one 81-frame 832 x 480 clip, 512 umT5 tokens"),
            quick_config=dict(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                out_channels=4, text_dim=24, freq_dim=16, ffn_dim=48, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-06, rope_max_seq_len=64
            ),
            quick_shape=dict(latent=(2, 8, 8), text=8), inputs=_wan_inputs,
        ),
        Family(
            key="sd3", cls="SD3Transformer2DModel",
            model="Stable Diffusion 3 medium (stabilityai/stable-diffusion-3-medium-diffusers)",
            config=dict(
                sample_size=128, patch_size=2, in_channels=16, attention_head_dim=64, num_attention_heads=24,
                joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
                out_channels=16, pos_embed_max_size=192
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 24},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(128, 128), text=333, what="one 1024 x 1024 image, 77 CLIP + 256 T5 tokens"),
            quick_config=dict(
                sample_size=16, patch_size=2, in_channels=4, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
                pos_embed_max_size=16
            ),
            quick_shape=dict(latent=(16, 16), text=8), inputs=_sd3_inputs,
        ),
        Family(
            key="flux", cls="FluxTransformer2DModel",
            model="FLUX.1-dev (black-forest-labs/FLUX.1-dev)",
            config=dict(
                patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16,
                56, 56)
            ),
            layer_keys=("num_layers", "num_single_layers"),
            full_layers={"num_layers": 19, "num_single_layers": 38},
            block_lists=("transformer_blocks", "single_transformer_blocks"),
            shape=dict(grid=(64, 64), text=512, what="one 1024 x 1024 image (64 x 64 packed latent), 512 T5"),
            quick_config=dict(
                patch_size=1, in_channels=16, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=24, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6,
                6)
            ),
            quick_shape=dict(grid=(8, 8), text=8), inputs=_flux_inputs,
        ),
        Family(
            key="cogvideox", cls="CogVideoXTransformer3DModel",
            model="CogVideoX-2b (THUDM/CogVideoX-2b)",
            config=dict(
                num_attention_heads=30, attention_head_dim=64, in_channels=16, out_channels=16,
                flip_sin_to_cos=True, freq_shift=0, time_embed_dim=512, text_embed_dim=4096, sample_width=90,
                sample_height=60, sample_frames=49, patch_size=2, max_text_seq_length=226,
                activation_fn="gelu-approximate", timestep_activation_fn="silu", norm_elementwise_affine=True,
                norm_eps=1e-05, use_rotary_positional_embeddings=False
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 30},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(13, 60, 90), text=226, what="one 49-frame 720 x 480 clip, 226 T5 tokens"),
            quick_config=dict(
                num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                time_embed_dim=16, text_embed_dim=24, sample_width=8, sample_height=8, sample_frames=5,
                patch_size=2, max_text_seq_length=8, norm_eps=1e-05
            ),
            quick_shape=dict(latent=(2, 8, 8), text=8), inputs=_cogvideox_inputs,
        ),
        Family(
            key="ltx", cls="LTXVideoTransformer3DModel",
            model="LTX-Video 0.9 (Lightricks/LTX-Video)",
            config=dict(
                in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                attention_head_dim=64, cross_attention_dim=2048, activation_fn="gelu-approximate",
                qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-06,
                caption_channels=4096, attention_bias=True, attention_out_bias=True
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 28},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(21, 22, 38), text=128, what="one 161-frame 1216 x 704 clip, 128 T5 tokens"),
            quick_config=dict(
                in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                cross_attention_dim=32, caption_channels=24
            ),
            quick_shape=dict(latent=(2, 4, 8), text=8), inputs=_ltx_inputs,
        ),
        Family(
            key="hunyuan", cls="HunyuanVideoTransformer3DModel",
            model="HunyuanVideo (hunyuanvideo-community/HunyuanVideo)",
            config=dict(
                in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
                guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
                rope_axes_dim=(16, 56, 56)
            ),
            layer_keys=("num_layers", "num_single_layers"),
            full_layers={"num_layers": 20, "num_single_layers": 40},
            block_lists=("transformer_blocks", "single_transformer_blocks"),
            shape=dict(latent=(16, 68, 120), text=256, what="one 61-frame 960 x 544 clip, 256 LLaMA tokens"),
            quick_config=dict(
                in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=24,
                pooled_projection_dim=16, rope_axes_dim=(4, 6, 6)
            ),
            quick_shape=dict(latent=(2, 8, 8), text=8), inputs=_hunyuan_inputs,
        ),
        Family(
            key="pixart", cls="PixArtTransformer2DModel",
            model="PixArt-Sigma XL 1024 (PixArt-alpha/PixArt-Sigma-XL-2-1024-MS)",
            config=dict(
                num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
                activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                norm_elementwise_affine=False, norm_eps=1e-06, interpolation_scale=2,
                use_additional_conditions=False, caption_channels=4096
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 28},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(128, 128), text=300, what="one 1024 x 1024 image, 300 T5 tokens"),
            quick_config=dict(
                num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                cross_attention_dim=32, sample_size=16, patch_size=2, norm_type="ada_norm_single",
                norm_elementwise_affine=False, norm_eps=1e-06, use_additional_conditions=False,
                caption_channels=24
            ),
            quick_shape=dict(latent=(16, 16), text=8), inputs=_pixart_inputs,
        ),
        Family(
            key="dit", cls="DiTTransformer2DModel",
            model="DiT-XL/2 (facebook/DiT-XL-2-256; released at 256 and 512 px, run here at 4,096 tokens)",
            config=dict(
                num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                attention_bias=True, sample_size=128, patch_size=2, activation_fn="gelu-approximate",
                num_embeds_ada_norm=1000, norm_type="ada_norm_zero", norm_elementwise_affine=False,
                norm_eps=1e-05
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 28},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(128, 128), text=0, what="one 1024 x 1024 image (128 x 128 latent), a class"),
            quick_config=dict(
                num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, sample_size=16,
                patch_size=2, norm_type="ada_norm_zero", norm_elementwise_affine=False
            ),
            quick_shape=dict(latent=(16, 16), text=0), inputs=_dit_inputs,
        ),
        Family(
            key="sana", cls="SanaTransformer2DModel",
            model="Sana 1.6B 2K (Efficient-Large-Model/Sana_1600M_2Kpx_BF16_diffusers)",
            config=dict(
                in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32,
                num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=64, patch_size=1,
                norm_elementwise_affine=False, norm_eps=1e-06
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 20},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(64, 64), text=300, what="one 2048 x 2048 image (32x DC-AE), 300 Gemma tokens"),
            quick_config=dict(
                in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                caption_channels=24, sample_size=8, patch_size=1
            ),
            quick_shape=dict(latent=(8, 8), text=8), inputs=_sana_inputs,
        ),
        Family(
            key="mochi", cls="MochiTransformer3DModel",
            model="Mochi 1 preview (genmo/mochi-1-preview)",
            config=dict(
                patch_size=2, num_attention_heads=24, attention_head_dim=128, pooled_projection_dim=1536,
                in_channels=12, qk_norm="rms_norm", text_embed_dim=4096, time_embed_dim=256,
                activation_fn="swiglu", max_sequence_length=256
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 48},
            block_lists=("transformer_blocks",),
            shape=dict(latent=(28, 60, 106), text=256, what="one 163-frame 848 x 480 clip, 256 T5 tokens"),
            quick_config=dict(
                patch_size=2, num_attention_heads=2, attention_head_dim=16, pooled_projection_dim=24,
                in_channels=4, text_embed_dim=24, time_embed_dim=16, max_sequence_length=8
            ),
            quick_shape=dict(latent=(2, 8, 8), text=8), inputs=_mochi_inputs,
        ),
        Family(
            key="lumina2", cls="Lumina2Transformer2DModel",
            model="Lumina-Image 2.0 (Alpha-VLLM/Lumina-Image-2.0)",
            config=dict(
                sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_refiner_layers=2,
                num_attention_heads=24, num_kv_heads=8, multiple_of=256, norm_eps=1e-05, scaling_factor=1.0,
                axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512), cap_feat_dim=2304
            ),
            layer_keys=("num_layers",), full_layers={"num_layers": 26},
            block_lists=("layers",),
            shape=dict(latent=(128, 128), text=256, what="one 1024 x 1024 image, 256 Gemma-2 tokens"),
            quick_config=dict(
                sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_refiner_layers=1,
                num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                axes_lens=(32, 32, 32), cap_feat_dim=24
            ),
            quick_shape=dict(latent=(16, 16), text=8), inputs=_lumina2_inputs,
        ),
    ]
}
# fmt: on

# --------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument(
        "--phases", nargs="+", default=list(PHASES), help="eager and/or compiled (each runs its two variants)"
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks per block list (default 2)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="weights: fp32 (default) or bf16; bf16 autocast",
    )
    p.add_argument("--no-autocast", action="store_true", help="run without bf16 autocast")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant after its first step")
    p.add_argument("--iters", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds in which a phase's variants alternate")
    p.add_argument(
        "--dynamic",
        default="true",
        choices=["true", "false", "none"],
        help="compile_blocks(dynamic=...): true (its default, what the recipes run), false, none",
    )
    p.add_argument("--no-fullgraph", action="store_true", help="compile with fullgraph=False from the start")
    p.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; --quick: aot_eager)"
    )
    p.add_argument("--mode", default=None, help="torch.compile mode (default: none)")
    p.add_argument(
        "--attention",
        default="default",
        help="attention backend via acceleration.set_attention_backend (default: leave diffusers' own)",
    )
    p.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="turn PyTorch's cuDNN attention off (torch 2.11 on an H200 gave wrong gradients and a crash in "
        "its backward for some diffusers shapes); SDPA then takes flash or memory-efficient attention",
    )
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --quick)")
    p.add_argument(
        "--time-budget-s", type=float, default=0.0, help="skip what starts after this many s (0: none)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=results_dir(), help="folder for the results JSON (default: $OUT or results/)"
    )
    p.add_argument("--filename", default=None, help="JSON file name (default families_<device>_<date>.json)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny configs, 1 step per variant")
    p.add_argument("--compile-quick", action="store_true", help="with --quick: run the compiled phase too")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="combine result files; no run")
    args = p.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    unknown += [v for v in args.variants if v not in VARIANTS]
    unknown += [ph for ph in args.phases if ph not in PHASES]
    if unknown:
        p.error(
            f"unknown family, variant or phase {unknown}; families: {', '.join(FAMILIES)}; "
            f"variants: {', '.join(VARIANTS)}; phases: {', '.join(PHASES)}"
        )
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    if args.quick:
        args.device = args.device or "cpu"
        args.warmup, args.iters, args.rounds = 0, 1, 1
        if not args.compile_quick:
            args.phases = [ph for ph in args.phases if ph != "compiled"]
        args.backend = args.backend or "aot_eager"
    args.device = args.device or "cuda"
    args.backend = args.backend or "inductor"
    return args


# --------------------------------------------------------------------------------------------------------
# Building, stepping, timing
# --------------------------------------------------------------------------------------------------------


def _build(fam: Family, args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any], list[str]]:
    """The family's model on the device, random weights from ``args.seed``; the constructor arguments; the
    parameters :func:`_randomise` changed."""
    import diffusers

    cfg = dict(fam.quick_config if args.quick else fam.config)
    cfg.update({k: args.layers for k in fam.layer_keys})
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = getattr(diffusers, fam.cls)(**cfg)
    changed = _randomise(model, args.seed)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    return model, cfg, changed


def _randomise(model: torch.nn.Module, seed: int) -> list[str]:
    """Give every parameter that diffusers initialises to a constant (zero biases and tables, adaLN-Zero
    linears) random values, so that no modulation is zero; returns their names. Random weights elsewhere
    stay as diffusers draws them (speed does not depend on them)."""
    changed = []
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                base = 1.0 if float(p.flatten()[0]) == 1.0 else 0.0  # norm weights stay near 1
                noise = torch.randn(p.shape, generator=g) * 0.02
                p.copy_((base + noise).to(p.device, p.dtype))
                changed.append(name)
    return changed


def _blocks(model: torch.nn.Module, fam: Family) -> list[torch.nn.Module]:
    return [b for name in fam.block_lists for b in getattr(model, name)]


class _Step:
    """One training step of a model on fixed inputs: forward under autocast, MSE against a fixed random
    target, backward (gradients of every weight; set to None before each step)."""

    def __init__(self, model: torch.nn.Module, kwargs: dict[str, Any], target: torch.Tensor, args) -> None:
        self.model, self.kwargs, self.target = model, kwargs, target
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.autocast = not args.no_autocast
        self.device_type = torch.device(args.device).type

    def __call__(self) -> torch.Tensor:
        for p in self.params:
            p.grad = None
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(**self.kwargs, return_dict=False)[0]
        loss = F.mse_loss(out.float(), self.target)
        loss.backward()
        return loss.detach()

    def release(self) -> None:
        for p in self.params:
            p.grad = None


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], iters: int, device: str) -> list[float]:
    if torch.device(device).type == "cuda":
        return cuda_event_times(fn, iters)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"median": statistics.median(ordered), "p10": pct(0.1), "p90": pct(0.9), "n": len(ordered)}


def _error(exc: BaseException) -> str:
    first = f"{type(exc).__name__}: {exc}".strip()
    return first[:800]


def _graphs() -> int:
    from lightning_adaptiveload.models.acceleration import compiled_graphs

    return compiled_graphs()


def _op_paths_reset() -> None:
    """Forget which implementation the fused op ran so far (benchmark bookkeeping: a private dict)."""
    mod = sys.modules.get("lightning_adaptiveload.ops.layer_norm_modulate")
    paths = getattr(mod, "_paths", None)
    if isinstance(paths, dict):
        paths.clear()


def _op_paths() -> str | None:
    try:
        from lightning_adaptiveload.ops import fused_op_paths

        return fused_op_paths()
    except Exception:  # noqa: BLE001 - bookkeeping only
        return None


# --------------------------------------------------------------------------------------------------------
# One family, one phase
# --------------------------------------------------------------------------------------------------------


# In every "skipped for lack of time" reason: what _unfinished and the table look for.
_NOT_YET = "run it in another call"


class _Stopped(BaseException):
    """SIGTERM arrived (not an ``Exception``: the per-variant handlers must not swallow it)."""


_RUNS: list = []  # the run in progress, for the signal handler


def _on_sigterm(signum, frame) -> None:
    for run in _RUNS:
        run.stopped = True  # holds even where a library turns the exception into another
    raise _Stopped()


class _Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.cuda = torch.device(args.device).type == "cuda"
        self.stopped = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def over_budget(self, expected_s: float = 0.0) -> bool:
        """Whether the budget is spent, or would be by something expected to take ``expected_s``, or the
        run was stopped (SIGTERM)."""
        if self.stopped:
            return True
        return self.args.time_budget_s > 0 and self.elapsed() + expected_s > self.args.time_budget_s

    def budget_reason(self) -> str:
        if self.stopped:
            return (
                f"skipped: stopped by SIGTERM (the call's time limit) at {self.elapsed():.0f} s; {_NOT_YET} "
                "(--families/--phases) and --merge"
            )
        return (
            f"skipped: the time budget (--time-budget-s {self.args.time_budget_s:g}) was spent "
            f"({self.elapsed():.0f} s) before it started; {_NOT_YET} (--families/--phases) and --merge"
        )

    def family_entry(self, fam: Family, cfg: dict[str, Any], model: torch.nn.Module, tokens: int) -> dict:
        attn = cfg.get("num_attention_heads")
        head = cfg.get("attention_head_dim")
        return {
            "class": fam.cls,
            "model": fam.model,
            "config": cfg,
            "layers": {k: cfg[k] for k in fam.layer_keys},
            "full_model_layers": fam.full_layers,
            "dim": attn * head if attn and head else cfg.get("hidden_size"),
            "heads": attn,
            "head_dim": head,
            "shape": {k: v for k, v in (fam.quick_shape if self.args.quick else fam.shape).items()},
            "batch": self.args.batch,
            "tokens": tokens,
            "text_tokens": (fam.quick_shape if self.args.quick else fam.shape)["text"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "compiled_blocks": {name: len(getattr(model, name)) for name in fam.block_lists},
            "variants": {},
        }

    def phase(self, fam: Family, phase: str, entry: dict | None) -> dict:
        """Build the family and run the phase's selected variants; returns the (updated) family entry."""
        args = self.args
        wanted = [v for v in PHASES[phase] if v in args.variants]
        model, cfg, changed = _build(fam, args)
        g = torch.Generator(args.device).manual_seed(args.seed + 2)
        shape = fam.quick_shape if args.quick else fam.shape
        kwargs, tokens = fam.inputs(dict(model.config), shape, args.batch, args.device, g)
        if args.dtype == "bf16":
            kwargs = {
                k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 1 else v
                for k, v in kwargs.items()
            }
        if entry is None:
            entry = self.family_entry(fam, cfg, model, tokens)
        entry["randomised_constant_parameters"] = changed
        if args.attention != "default":
            from lightning_adaptiveload.models.acceleration import set_attention_backend

            entry["attention_backend"] = set_attention_backend(model, args.attention)
        with (
            torch.no_grad(),
            torch.autocast(
                torch.device(args.device).type, dtype=torch.bfloat16, enabled=not args.no_autocast
            ),
        ):
            out_shape = model(**kwargs, return_dict=False)[0].shape
        target = torch.randn(out_shape, generator=g, device=args.device)

        # Copies of the pristine model first: nothing below (fusing, compiling) may reach another variant.
        pristine = {name: copy.deepcopy(model) if name.endswith("_fused") else model for name in wanted}
        models: dict[str, torch.nn.Module] = {}
        for name in wanted:
            if self.over_budget():
                entry["variants"][name] = {"skipped": self.budget_reason()}
                continue
            fused = name.endswith("_fused")
            m = pristine[name]
            rec: dict[str, Any] = {}
            if fused:
                ok, info = self.fuse(m)
                rec["fused_sites"] = info["fused_sites"]
                entry.setdefault("fusion", info)
                if not ok:
                    rec["skipped"] = f"fusion refused: {info['error']}"
                    entry["variants"][name] = rec
                    continue
            if phase == "compiled":
                try:
                    rec["compile"] = self.compile(m, fam)
                except Exception as exc:  # noqa: BLE001 - e.g. no blocks where the family says
                    rec["error"] = f"compile_blocks: {_error(exc)}"
                    entry["variants"][name] = rec
                    continue
            entry["variants"][name] = rec
            models[name] = m
        steps = {name: _Step(m, kwargs, target, args) for name, m in models.items()}

        # First step (compiles included), then warm-up.
        for name in list(steps):
            rec = entry["variants"][name]
            if self.stopped:
                rec["skipped"] = self.budget_reason()
                steps.pop(name)
                continue
            try:
                rec.update(self.first_steps(name, steps[name], fam, models[name], rec))
            except Exception as exc:  # noqa: BLE001 - record and go on
                rec["error"] = _error(exc)
                rec["traceback"] = traceback.format_exc(limit=-4)[-1500:]
                steps.pop(name).release()
                self.free()
        # Timed rounds, the phase's variants alternating.
        times: dict[str, list[float]] = {name: [] for name in steps}
        peaks: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for name in list(steps):
                if self.stopped:
                    break
                try:
                    t, peak = self.timed(steps[name])
                except Exception as exc:  # noqa: BLE001
                    entry["variants"][name]["error"] = _error(exc)
                    steps.pop(name).release()
                    times.pop(name)
                    self.free()
                    continue
                times[name] += t
                if peak:
                    old = peaks.get(name, {})
                    peaks[name] = {k: max(v, old.get(k, 0.0)) for k, v in peak.items()}
                steps[name].release()
        for name, t in times.items():
            if t:
                entry["variants"][name]["ms"] = _summary(t)
                entry["variants"][name].update(peaks.get(name, {}))
        for s in steps.values():
            s.release()
        del steps, models, pristine, model, kwargs, target
        self.free(reset_dynamo=phase == "compiled")
        entry["ratios"] = _ratios(entry["variants"])
        entry["loss_rel_diff_vs_eager"] = _loss_diffs(entry["variants"])
        return entry

    def fuse(self, m: torch.nn.Module) -> tuple[bool, dict[str, Any]]:
        from lightning_adaptiveload.fusion import FusionError, fuse_norm_modulate

        try:
            report = fuse_norm_modulate(m)
        except FusionError as exc:
            return False, {"fused_sites": 0, "error": _error(exc)}
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not stop the table
            return False, {
                "fused_sites": 0,
                "error": _error(exc),
                "traceback": traceback.format_exc(limit=-4),
            }
        info = {
            "fused_sites": report.num_sites,
            "fused_modules": report.num_modules,
            "report": report.as_dict(),
        }
        return True, info

    def compile(self, m: torch.nn.Module, fam: Family) -> dict[str, Any]:
        from lightning_adaptiveload.models.acceleration import compile_blocks

        a = self.args
        settings = {
            "dynamic": {"true": True, "false": False, "none": None}[a.dynamic],
            "fullgraph": not a.no_fullgraph,
            "backend": a.backend,
            "mode": a.mode,
        }
        n = compile_blocks(m, _blocks(m, fam), **settings)
        return dict(settings, blocks=n, how="acceleration.compile_blocks")

    def first_steps(
        self, name: str, step: _Step, fam: Family, m: torch.nn.Module, rec: dict
    ) -> dict[str, Any]:
        """The first step (timed apart: compiles), retried once without fullgraph when it fails compiled;
        then the warm-up steps."""
        out: dict[str, Any] = {}
        if name.endswith("_fused"):
            _op_paths_reset()
        graphs0 = _graphs()
        # The same random draws in every variant's first step (DiT drops class labels at random in training
        # mode), so that the losses compare.
        torch.manual_seed(self.args.seed + 3)
        t0 = time.perf_counter()
        try:
            loss = step()
            _sync(self.args.device)
        except Exception as exc:
            compiled = rec.get("compile")
            if not compiled or not compiled["fullgraph"] or isinstance(exc, torch.OutOfMemoryError):
                raise
            step.release()
            self.free()
            out["fullgraph_error"] = _error(exc)
            rec["compile"] = self.compile_retry(m, fam)
            torch.manual_seed(self.args.seed + 3)
            t0 = time.perf_counter()
            loss = step()
            _sync(self.args.device)
        out["first_step_s"] = round(time.perf_counter() - t0, 3)
        out["loss"] = float(loss)
        for _ in range(self.args.warmup):
            step()
        _sync(self.args.device)
        if rec.get("compile"):
            out["graphs_compiled"] = _graphs() - graphs0
        if name.endswith("_fused"):
            out["fused_op_paths"] = _op_paths()
        step.release()
        return out

    def compile_retry(self, m: torch.nn.Module, fam: Family) -> dict[str, Any]:
        saved = self.args.no_fullgraph
        self.args.no_fullgraph = True
        try:
            return dict(
                self.compile(m, fam), retried="fullgraph=True failed; compiled again with fullgraph=False"
            )
        finally:
            self.args.no_fullgraph = saved

    def timed(self, step: _Step) -> tuple[list[float], dict[str, float]]:
        if not self.cuda:
            return _time(step, self.args.iters, self.args.device), {}
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = _time(step, self.args.iters, self.args.device)
        peak = torch.cuda.max_memory_allocated()
        return t, {
            "peak_step_gib": round((peak - base) / 2**30, 3),
            "peak_allocated_gib": round(peak / 2**30, 3),
        }

    def free(self, reset_dynamo: bool = False) -> None:
        gc.collect()
        if reset_dynamo:
            import torch._dynamo as dynamo

            dynamo.reset()
        if self.cuda:
            torch.cuda.empty_cache()


def _ratios(variants: dict[str, dict]) -> dict[str, float]:
    """Time ratios of the variants that were measured: fused / unfused, compiled / eager."""
    ms = {k: v["ms"]["median"] for k, v in variants.items() if "ms" in v}
    pairs = {
        "eager_fused/eager": ("eager_fused", "eager"),
        "compiled_fused/compiled": ("compiled_fused", "compiled"),
        "compiled/eager": ("compiled", "eager"),
        "compiled_fused/eager": ("compiled_fused", "eager"),
    }
    return {k: round(ms[a] / ms[b], 4) for k, (a, b) in pairs.items() if a in ms and b in ms and ms[b] > 0}


def _loss_diffs(variants: dict[str, dict]) -> dict[str, float]:
    """|loss - eager loss| / |eager loss| of each variant's first step (same weights and inputs): a fused or
    compiled variant that computes something else shows here, far above bf16 rounding."""
    ref = variants.get("eager", {}).get("loss")
    if ref is None or ref == 0:
        return {}
    return {
        k: abs(v["loss"] - ref) / abs(ref)
        for k, v in variants.items()
        if k != "eager" and v.get("loss") is not None
    }


# --------------------------------------------------------------------------------------------------------
# Environment, table, merge
# --------------------------------------------------------------------------------------------------------


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import diffusers

    import lightning_adaptiveload

    cuda = torch.device(args.device).type == "cuda"
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else cpu_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "diffusers": diffusers.__version__,
        "lightning_adaptiveload": lightning_adaptiveload.__version__,
        "python": platform.python_version(),
    }
    try:
        from lightning_adaptiveload.ops import fused_op_status

        loaded, info = fused_op_status()
        env["fused_op"] = {"kernels_loaded": loaded, "info": info}
    except Exception as exc:  # noqa: BLE001
        env["fused_op"] = {"kernels_loaded": False, "info": _error(exc)}
    return env


def _cell(v: dict | None, base: dict | None = None) -> str:
    if v is None:
        return "not run"
    if v.get("skipped", "").startswith("not run"):
        return "not run"
    if "ms" in v:
        text = f"{v['ms']['median']:.1f}"
        if base is not None and "ms" in base and base["ms"]["median"] > 0:
            text += f" ({v['ms']['median'] / base['ms']['median']:.3f}x)"
        return text
    if "error" in v:
        return "error: " + v["error"].split(":")[0]
    if "skipped" in v:
        s = v["skipped"]
        return "no fusion" if s.startswith("fusion refused") else ("no time" if _NOT_YET in s else "skipped")
    return "not run"


def _fmt(x: Any) -> str:
    return "?" if x is None else f"{x:,}" if isinstance(x, int) else str(x)


def table(result: dict) -> str:
    """The markdown table of a result: medians of one training step (forward + backward) in ms, the fused
    variants' ratio to their unfused twin, fused sites, the first compiled step (compiles) and eager peak."""
    lines = [
        "| family | width x heads | tokens + text | eager ms | eager fused ms | compiled ms "
        "| compiled fused ms | fused sites | first compiled step s (unfused / fused) | eager step peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, fam in result["families"].items():
        v = fam.get("variants", {})
        sites = fam.get("fusion", {}).get("fused_sites", "")
        peak = v.get("eager", {}).get("peak_step_gib", "")
        first = " / ".join(
            f"{v[n]['first_step_s']:.0f}" if "first_step_s" in v.get(n, {}) else "-"
            for n in ("compiled", "compiled_fused")
        )
        lines.append(
            f"| {key} | {_fmt(fam.get('dim'))} x {_fmt(fam.get('heads'))} "
            f"| {_fmt(fam.get('tokens'))} + {_fmt(fam.get('text_tokens'))} "
            f"| {_cell(v.get('eager'))} | {_cell(v.get('eager_fused'), v.get('eager'))} "
            f"| {_cell(v.get('compiled'))} | {_cell(v.get('compiled_fused'), v.get('compiled'))} | {sites} "
            f"| {first} | {peak} |"
        )
    return "\n".join(lines)


def _write(result: dict, path: str) -> None:
    from lightning_adaptiveload.monitor.report import jsonable

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(result), f, indent=1)
    os.replace(tmp, path)


def merge(paths: list[str], out_dir: str, filename: str | None) -> int:
    """Combine result files of one device: per family and variant, a later file's measured variant replaces
    an earlier one's; a later file's skipped or failed one replaces only a skipped or missing one. The
    settings of every file are kept in ``merged_from``."""
    merged: dict[str, Any] = {}
    for i, path in enumerate(paths):
        with open(path) as f:
            data = json.load(f)
        device = data.get("environment", {}).get("device")
        source = {"file": os.path.basename(path), "date": data.get("date"), "settings": data.get("settings")}
        if i == 0:
            merged = copy.deepcopy(data)
            merged["merged_from"] = [source]
            continue
        if device != merged.get("environment", {}).get("device"):
            print(
                f"bench_families --merge: {path} ran on {device!r}, {paths[0]} on "
                f"{merged.get('environment', {}).get('device')!r}; merge the results of one device only",
                file=sys.stderr,
            )
            return 2
        merged["merged_from"].append(source)
        for key, fam in data.get("families", {}).items():
            into = merged["families"].setdefault(key, {"variants": {}})
            for k, val in fam.items():  # what only a built family knows (config, tokens, parameters)
                if k not in ("variants", "ratios", "loss_rel_diff_vs_eager") and into.get(k) is None:
                    into[k] = val
            if "fusion" in fam and ("report" in fam["fusion"] or "report" not in into.get("fusion", {})):
                into["fusion"] = fam["fusion"]
            into.setdefault("phase_seconds", {}).update(fam.get("phase_seconds", {}))
            for name, v in fam.get("variants", {}).items():
                old = into["variants"].get(name)
                tried = not v.get("skipped", "").startswith("not run")  # a phase the later call ran
                if old is None or "ms" in v or ("ms" not in old and "skipped" in old and tried):
                    into["variants"][name] = v
            into["ratios"] = _ratios(into["variants"])
            into["loss_rel_diff_vs_eager"] = _loss_diffs(into["variants"])
    merged["table"] = table(merged)
    merged["unfinished"] = _unfinished(merged)
    name = (
        filename or f"families_{device_tag(merged['environment']['device'])}_merged_{_dt.date.today()}.json"
    )
    path = os.path.join(out_dir, name)
    _write(merged, path)
    print(merged["table"])
    print("wrote", path)
    return 0


# --------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, args.filename)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(
            "bench_families: needs a CUDA GPU (torch.cuda.is_available() is False); use --quick on a CPU",
            file=sys.stderr,
        )
        return 2
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print(
            "bench_families: needs diffusers (pip install 'lightning-adaptiveload[diffusers]')",
            file=sys.stderr,
        )
        return 2

    run = _Run(args)
    _RUNS[:] = [run]
    signal.signal(signal.SIGTERM, _on_sigterm)
    env = _environment(args)
    date = _dt.datetime.now(_dt.timezone.utc)
    settings = {k: v for k, v in vars(args).items() if k != "merge"}
    settings["weights"] = "bf16" if args.dtype == "bf16" else "fp32"
    settings["autocast"] = None if args.no_autocast else "bf16"
    result: dict[str, Any] = {
        "benchmark": "fusion_families",
        "description": "diffusers DiT families with --layers blocks at released models' widths, batch 1, one "
        "training step (forward + backward, MSE): eager, eager fused (fuse_norm_modulate), compiled "
        "(compile_blocks), compiled fused; CUDA-event medians in ms",
        "date": date.isoformat(timespec="seconds"),
        "environment": env,
        "settings": settings,
        "timing": "first step (compiles) apart; warm-up; rounds alternating the phase's variants; CUDA "
        "events per step; medians, p10, p90 in ms; peak_step_gib above the memory allocated before the timed "
        "steps",
        "families": {},
    }
    name = args.filename or (
        f"families_{device_tag(env['device'])}_{date.strftime('%Y-%m-%d_%H%M%S')}"
        + ("_quick" if args.quick else "")
        + ".json"
    )
    path = os.path.join(args.out, name)
    print(
        f"bench_families: {env['device']}, torch {env['torch']}, diffusers {env['diffusers']}, "
        f"fused op: {env['fused_op']}"
    )
    longest: dict[str, float] = {}  # phase -> the longest family phase so far (the next one's estimate)
    for phase in args.phases:
        for key in args.families:
            fam = FAMILIES[key]
            entry = result["families"].get(key)
            if run.over_budget(longest.get(phase, 0.0)):
                entry = entry or _stub(fam, args)
                for v in PHASES[phase]:
                    if v in args.variants:
                        entry["variants"].setdefault(v, {"skipped": run.budget_reason()})
                result["families"][key] = entry
                continue
            t0 = time.monotonic()
            try:
                entry = run.phase(fam, phase, entry)
            except _Stopped:
                # SIGTERM (the wrapper's timeout) in the middle of a family: what it had is lost, the rest
                # is marked and the file and table are still written.
                run.stopped = True
                entry = entry or _stub(fam, args)
                for v in PHASES[phase]:
                    if v in args.variants and "ms" not in entry["variants"].get(v, {}):
                        entry["variants"][v] = {"skipped": run.budget_reason()}
                result["families"][key] = entry
                continue
            except Exception as exc:  # noqa: BLE001 - a family that cannot even be built
                entry = entry or _stub(fam, args)
                entry.setdefault("errors", {})[phase] = _error(exc)
                entry["traceback"] = traceback.format_exc(limit=-4)[-1500:]
                for v in PHASES[phase]:
                    if v in args.variants:
                        entry["variants"].setdefault(v, {"error": f"the {phase} phase failed: {_error(exc)}"})
                run.free(reset_dynamo=True)
            took = time.monotonic() - t0
            longest[phase] = max(longest.get(phase, 0.0), took)
            entry.setdefault("phase_seconds", {})[phase] = round(took, 1)
            result["families"][key] = entry
            result["wall_seconds"] = round(run.elapsed(), 1)
            _write(result, path)
            v = entry.get("variants", {})
            print(
                f"[{run.elapsed():6.0f} s] {key:9s} {phase:8s} "
                + "  ".join(f"{n}: {_cell(v.get(n))}" for n in PHASES[phase] if n in args.variants),
                flush=True,
            )
    for key in args.families:  # every family gets all four variants: measured, or why not
        entry = result["families"].setdefault(key, _stub(FAMILIES[key], args))
        for phase, names in PHASES.items():
            for v in names:
                if v not in args.variants:
                    why = f"not run: not in --variants {' '.join(args.variants)}"
                elif phase not in args.phases:
                    why = (
                        "not run: --quick compiles nothing (add --compile-quick)"
                        if args.quick and phase == "compiled"
                        else f"not run: the {phase} phase was not selected (--phases {' '.join(args.phases)})"
                    )
                else:
                    why = "not run"
                entry["variants"].setdefault(v, {"skipped": why})
    result["table"] = table(result)
    result["wall_seconds"] = round(run.elapsed(), 1)
    result["unfinished"] = _unfinished(result)
    _write(result, path)
    print()
    print(result["table"])
    for phase, keys in result["unfinished"].items():
        print(
            f'not measured for lack of time ({phase}): FAMILIES="{" ".join(keys)}" PHASES={phase} bash '
            f"benchmarks/fusion/gpu_bench_families.sh, then --merge the two JSON files"
        )
    print("wrote", path)
    return 0


def _stub(fam: Family, args: argparse.Namespace) -> dict[str, Any]:
    """A family's entry before (or without) building it: what its configuration says."""
    cfg = dict(fam.quick_config if args.quick else fam.config)
    heads, head = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
    shape = fam.quick_shape if args.quick else fam.shape
    try:  # the inputs' shapes alone, on the meta device
        tokens = fam.inputs(cfg, shape, args.batch, "meta", None)[1]
    except Exception:  # noqa: BLE001 - a default the stub's config lacks; the table shows "?"
        tokens = None
    return {
        "class": fam.cls,
        "model": fam.model,
        "dim": heads * head if heads and head else None,
        "heads": heads,
        "head_dim": head,
        "shape": dict(shape),
        "batch": args.batch,
        "tokens": tokens,
        "text_tokens": shape["text"],
        "variants": {},
    }


def _unfinished(result: dict) -> dict[str, list[str]]:
    """Per phase, the families with a variant skipped for lack of time (what a second call should run)."""
    out: dict[str, list[str]] = {}
    for phase, names in PHASES.items():
        keys = [
            k
            for k, fam in result["families"].items()
            if any(_NOT_YET in fam.get("variants", {}).get(n, {}).get("skipped", "") for n in names)
        ]
        if keys:
            out[phase] = keys
    return out


if __name__ == "__main__":
    sys.exit(main())

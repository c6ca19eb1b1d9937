"""Random-weight stand-ins for Wan's VAE and umT5, and generated clips: ``ingest`` on a CPU in a minute.

NOT FOR TRAINING. The encoders here have Wan's architectures (diffusers' ``AutoencoderKLWan``,
transformers' ``UMT5EncoderModel``) at a tiny width and **random weights**: their latents and text states
have the right shapes and dtypes and flow through every stage (decode, size, encode, shards, index,
training), but they encode nothing a model could learn from. They exist so that a newcomer can run the
whole ingest path without downloading ~20 GB of weights, and so that tests and ``benchmarks/data/bench_ingest.py``
measure the pipeline's own overhead with one shared encoder.

Shards written with them are marked: ``index.json``'s ``metadata["demo"]`` and each sample's ``demo: true``
(``AdaptiveLoadDataModule`` warns when it trains on them), and ``ingest`` refuses to mix them with shards
of a real encoder in one folder.

- :func:`tiny_random_vae`: an ``AutoencoderKLWan`` with 16 latent channels (like Wan 2.1's), base width 8.
- :func:`tiny_random_text_encoder`: a one-layer ``UMT5EncoderModel`` of width 32 (the ``tiny`` model
  preset's ``text_dim``) and a character-level tokenizer built offline.
- :func:`write_demo_clips`: a few short mp4 clips (moving colour fields, three aspect ratios, captions in
  ``<clip>.txt``) and one image, for trying ingest without videos of your own.

Pure (no Lightning); diffusers, transformers, tokenizers and PyAV are imported only when used.
"""

from __future__ import annotations

import os
import string
from typing import Any

import numpy as np
import torch

__all__ = [
    "DEMO_BUCKETS",
    "DEMO_ENCODER",
    "DEMO_MAX_FRAMES",
    "DEMO_NOTE",
    "TINY_TEXT_DIM",
    "TINY_VAE_CONFIG",
    "is_demo_encoder",
    "tiny_random_text_encoder",
    "tiny_random_vae",
    "write_demo_clips",
]

# The value of ``--vae`` / ``--text-encoder`` (and ``ingest(vae=...)``) that selects the random stand-ins.
DEMO_ENCODER = "tiny-random"

# What the index and the warnings say about shards written with a stand-in.
DEMO_NOTE = (
    "DEMO DATA, NOT FOR TRAINING: encoded with a random-weight tiny VAE (lightning_adaptiveload.ingest.demo); "
    "the latents have the right shapes but encode nothing. Ingest real data with Wan's VAE (docs/ingest.md)."
)

# Small buckets and short clips keep the tiny VAE at a few seconds per clip on a CPU (it costs the same
# per pixel as the tiny VAE of benchmarks/data/bench_ingest.py: 4.1 s for 17 x 128 x 224 on 2 busy cores).
DEMO_BUCKETS = "128x224,224x128,176x176"
DEMO_MAX_FRAMES = 17

# diffusers' AutoencoderKLWan at base width 8 (Wan 2.1's is 96), one residual block per level, Wan's
# 16 latent channels and its 8x spatial / 4x temporal compression (so the latents have Wan's shapes).
# latents_mean / latents_std stay the class defaults: Wan 2.1's statistics.
TINY_VAE_CONFIG: dict[str, Any] = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}

TINY_TEXT_DIM = 32  # the "tiny" model preset's text_dim: demo shards train with the quickstart settings
_TEXT_CHARS = string.ascii_lowercase + string.digits + " .,;:!?'-"


def is_demo_encoder(value: Any) -> bool:
    """Whether ``value`` (an ``ingest`` encoder argument) names the random-weight stand-in."""
    return isinstance(value, str) and value == DEMO_ENCODER


def tiny_random_vae(seed: int = 0, **overrides: Any):
    """A tiny diffusers ``AutoencoderKLWan`` with random weights (NOT FOR TRAINING), in eval mode.

    The same ``seed`` gives the same weights on every rank and machine; the global RNG is left as it was.

    Args:
        seed: seeds the weight initialisation.
        **overrides: ``AutoencoderKLWan`` config values over :data:`TINY_VAE_CONFIG` (e.g. ``z_dim=4``).

    Returns:
        ``AutoencoderKLWan`` (float32, CPU): pixels (B, 3, 4k + 1, H, W) -> latents
        (B, z_dim, k + 1, H / 8, W / 8).
    """
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(**{**TINY_VAE_CONFIG, **overrides}).eval()


def tiny_random_text_encoder(seed: int = 0, dim: int = TINY_TEXT_DIM):
    """A one-layer umT5 encoder with random weights and its tokenizer (NOT FOR TRAINING).

    The tokenizer splits a caption into characters (lower-cased letters, digits and common punctuation;
    anything else is ``<unk>``) and appends ``</s>``, so a caption of n characters gives n + 1 text states
    of width ``dim``. Built offline: nothing is downloaded.

    Args:
        seed: seeds the weight initialisation (the global RNG is left as it was).
        dim: the text states' width D (``d_model``).

    Returns:
        ``(text_encoder, tokenizer)``: a transformers ``UMT5EncoderModel`` (float32, CPU, eval mode) and a
        ``PreTrainedTokenizerFast``, as :func:`~lightning_adaptiveload.ingest.encode.encode_text` takes them.
    """
    import tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(_TEXT_CHARS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    heads = 4 if dim % 4 == 0 else 1
    config = UMT5Config(
        vocab_size=len(vocab), d_model=dim, d_kv=dim // heads, d_ff=2 * dim, num_layers=1, num_heads=heads
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = UMT5EncoderModel(config).eval()
    return encoder, tokenizer


# (height, width, seconds, caption) of the generated clips: the three demo buckets' aspect ratios and
# several lengths, so that the shards hold samples of different token counts (what the planner balances).
_CLIPS = (
    (128, 224, 2.0, "a red and blue field drifting to the left"),
    (224, 128, 1.2, "a tall green field drifting up"),
    (176, 176, 0.6, "a square of warm colours, short"),
    (144, 256, 1.6, "a wide field of cool colours drifting right"),
    (240, 136, 2.0, "a slow vertical pan over soft colours"),
    (160, 160, 1.0, "orange and purple shapes sliding"),
)


def write_demo_clips(
    folder: str | os.PathLike,
    count: int = 6,
    fps: int = 30,
    seed: int = 0,
    image: bool = True,
    size: tuple[int, int] | None = None,
    seconds: float | None = None,
) -> list[str]:
    """Write ``count`` short mp4 clips (moving colour fields, captions in ``<clip>.txt``) and one image.

    For trying ``ingest`` without videos of your own; the clips mean nothing. They cycle through three
    aspect ratios and 0.6 to 2 s (or all ``size`` and ``seconds``), encoded with PyAV's ``mpeg4`` codec
    (its wheels bundle FFmpeg).

    Args:
        folder: where the files go (created if needed); existing ``demo-*`` files there are replaced.
        count: number of clips.
        fps: their frame rate.
        seed: seeds the colours.
        image: also write ``demo-image.png`` (one frame, with a caption).
        size: (height, width) of every clip, both even; None: the built-in mix of sizes.
        seconds: length of every clip; None: the built-in mix of lengths.

    Returns:
        The paths written (clips, then the image).
    """
    import av

    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if size is not None and (size[0] % 2 or size[1] % 2 or min(size) < 16):
        raise ValueError(f"size must be (height, width), both even and >= 16, got {size!r}")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        h, w, secs, caption = _CLIPS[i % len(_CLIPS)]
        if size is not None:
            h, w = size
        secs = secs if seconds is None else float(seconds)
        # A coarse random colour field (8-pixel cells), scrolled 2 pixels a frame: smooth, decodable motion.
        base = rng.integers(0, 255, size=(-(-h // 8), -(-w // 8), 3)).astype(np.uint8)
        base = base.repeat(8, 0).repeat(8, 1)[:h, :w]
        path = os.path.join(os.fspath(folder), f"demo-{i:02d}.mp4")
        with av.open(path, "w") as out:
            stream = out.add_stream("mpeg4", rate=fps)
            stream.height, stream.width, stream.pix_fmt = h, w, "yuv420p"
            for t in range(max(1, round(secs * fps))):
                frame = av.VideoFrame.from_ndarray(np.roll(base, 2 * t, axis=1), format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        with open(path[: -len(".mp4")] + ".txt", "w", encoding="utf-8") as f:
            f.write(caption + "\n")
        paths.append(path)
    if image:
        from PIL import Image

        h, w = size or (176, 176)
        cells = rng.integers(0, 255, size=(-(-h // 16), -(-w // 16), 3)).astype(np.uint8)
        path = os.path.join(os.fspath(folder), "demo-image.png")
        Image.fromarray(cells.repeat(16, 0).repeat(16, 1)[:h, :w]).save(path)
        with open(os.path.join(os.fspath(folder), "demo-image.txt"), "w", encoding="utf-8") as f:
            f.write("a still mosaic of coloured squares\n")
        paths.append(path)
    return paths

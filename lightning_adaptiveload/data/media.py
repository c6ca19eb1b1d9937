"""Videos and images to pixels and latents, without Lightning: inputs, frame sampling, sizing, decoding, encoding.

Frame sampling. With source rate ``f_src`` and target rate ``f`` (at most ``f_src``: frames are never
duplicated), target frame ``i`` is source frame ``round(i * f_src / f)`` (0-based decode order), for as
many ``i`` as the clip holds, capped at ``max_frames``; the count is then cut down to the largest
``4k + 1`` (Wan's VAE maps 4k + 1 frames to k + 1 latent frames). Images are one frame.

Sizing. ``buckets``: the (height, width) whose aspect ratio is nearest the source's in log scale (the
first listed wins a tie); the frame is scaled (bilinear, antialiased) by ``max(bh / h, bw / w)`` so that
it covers the bucket, then centre-cropped. ``buckets=None``: native size, centre-cropped down to a
multiple of 16 (VAE stride 8 x patch 2) on each side, no resampling.

:mod:`lightning_adaptiveload.data.ingest` runs all of it as ``Trainer.predict``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = [
    "IngestItem",
    "InputError",
    "choose_bucket",
    "decode_input",
    "encode_text",
    "encode_video",
    "find_inputs",
    "parse_buckets",
    "read_manifest",
    "sample_frame_indices",
    "size_plan",
    "wan_frame_count",
]

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".gif")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
SPATIAL_MULTIPLE = 16  # VAE stride 8 x patch 2: latent H, W must split into 2x2 patches
VAE_TEMPORAL_STRIDE = 4
# Wan 2.1 480p buckets (height, width): landscape, portrait, square.
WAN_480P_BUCKETS = ((480, 832), (832, 480), (624, 624))
TEXT_MAX_LENGTH = 512  # Wan's umT5 context length


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclass
class IngestItem:
    """One input file.

    Attributes:
        path: absolute path of the video or image.
        key: the sample key in the shards (unique, no dots).
        caption: text to encode (``""``: none).
        fps: target frame rate for this file, or None for the job's.
    """

    path: str
    key: str
    caption: str = ""
    fps: float | None = None


def _key_for(path: str, root: str) -> str:
    # Stem for readability, plus a hash of the relative path so that a.mp4 and a.mov, or two
    # folders' clip1.mp4, get distinct keys that stay the same across reruns (resume relies on it).
    rel = os.path.relpath(path, root)
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", os.path.splitext(os.path.basename(path))[0])[:48] or "x"
    return f"{stem}-{hashlib.sha1(rel.encode('utf-8')).hexdigest()[:10]}"


def find_inputs(folder: str | os.PathLike) -> list[IngestItem]:
    """Every video and image under ``folder`` (recursively, sorted), without captions.

    A ``<file>.txt`` beside a file is read as its caption.
    """
    root = os.path.abspath(os.fspath(folder))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"ingest: input folder {root} does not exist")
    items = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.lower().endswith(VIDEO_EXTENSIONS + IMAGE_EXTENSIONS):
                path = os.path.join(dirpath, name)
                caption_file = os.path.splitext(path)[0] + ".txt"
                caption = ""
                if os.path.isfile(caption_file):
                    with open(caption_file, encoding="utf-8") as f:
                        caption = f.read().strip()
                items.append(IngestItem(path=path, key=_key_for(path, root), caption=caption))
    return items


def read_manifest(path: str | os.PathLike) -> list[IngestItem]:
    """Inputs listed in a CSV (header row) or JSONL file with fields ``path``, optional ``caption``,
    ``fps`` and ``key``. Relative paths are relative to the manifest's folder.

    Raises:
        ValueError: naming the file, the line and the problem (no ``path``, bad ``fps``, duplicate key).
    """
    path = os.fspath(path)
    root = os.path.dirname(os.path.abspath(path))
    rows: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.lower().endswith((".jsonl", ".json")):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((n, json.loads(line)))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{n}: not a JSON object ({err})") from None
        else:
            rows = [(n, row) for n, row in enumerate(csv.DictReader(f), 2)]
    items, seen = [], set()
    for n, row in rows:
        if not isinstance(row, dict) or not row.get("path"):
            raise ValueError(f"{path}:{n}: every row needs a 'path' (got {row!r})")
        file = row["path"] if os.path.isabs(row["path"]) else os.path.join(root, row["path"])
        fps = row.get("fps")
        try:
            fps = float(fps) if fps not in (None, "") else None
        except ValueError:
            raise ValueError(f"{path}:{n}: fps={fps!r} is not a number") from None
        if fps is not None and not fps > 0:
            raise ValueError(f"{path}:{n}: fps={fps!r} must be > 0")
        key = row.get("key") or _key_for(file, root)
        if key in seen:
            raise ValueError(f"{path}:{n}: key {key!r} appears twice; keys must be unique")
        seen.add(key)
        items.append(
            IngestItem(path=os.path.abspath(file), key=key, caption=row.get("caption") or "", fps=fps)
        )
    return items


# --------------------------------------------------------------------------------------------------
# Frames and sizes (pure)
# --------------------------------------------------------------------------------------------------


def wan_frame_count(available: int, max_frames: int) -> int:
    """The largest ``4k + 1`` not above ``min(available, max_frames)`` (0 if ``available`` is 0)."""
    n = min(int(available), int(max_frames))
    if n < 1:
        return 0
    return (n - 1) // VAE_TEMPORAL_STRIDE * VAE_TEMPORAL_STRIDE + 1


def _frame_step(source_fps: float, target_fps: float | None) -> float:
    # Source frames per target frame; never below 1, so frames are not duplicated.
    return 1.0 if target_fps is None else max(1.0, float(source_fps) / float(target_fps))


def _source_index(i: int, step: float) -> int:
    # The one formula of frame sampling: target frame i is source frame round(i * step).
    return int(round(i * step))


def sample_frame_indices(
    num_source: int, source_fps: float, target_fps: float | None, max_frames: int
) -> list[int]:
    """Source frame indices (0-based decode order) of the frames kept; see the module docstring.

    Args:
        num_source: frames in the clip.
        source_fps: the clip's frame rate.
        target_fps: wanted rate (capped at ``source_fps``), or None for the source's.
        max_frames: at most this many frames (then cut to ``4k + 1``).
    """
    step = _frame_step(source_fps, target_fps)
    available = int(math.floor((num_source - 1) / step + 1e-9)) + 1 if num_source > 0 else 0
    count = wan_frame_count(available, max_frames)
    return [min(num_source - 1, _source_index(i, step)) for i in range(count)]


def parse_buckets(spec: str | Sequence[Sequence[int]] | None) -> list[tuple[int, int]] | None:
    """``"480x832,832x480"`` or ``[(480, 832), ...]`` -> [(height, width), ...]; ``None`` / ``"native"``
    -> None. Each side must be a positive multiple of 16.

    Raises:
        ValueError: naming the bad entry.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "native"):
        return None
    if isinstance(spec, str):
        if spec.strip().lower() == "wan480p":
            return list(WAN_480P_BUCKETS)
        parts = [p.strip().lower().split("x") for p in spec.split(",") if p.strip()]
    else:
        parts = list(spec)
    out = []
    for p in parts:
        try:
            h, w = (int(v) for v in p)
        except (TypeError, ValueError):
            raise ValueError(f"bucket {p!r} is not HEIGHTxWIDTH (e.g. 480x832)") from None
        if h < SPATIAL_MULTIPLE or w < SPATIAL_MULTIPLE or h % SPATIAL_MULTIPLE or w % SPATIAL_MULTIPLE:
            raise ValueError(
                f"bucket {h}x{w}: height and width must be positive multiples of {SPATIAL_MULTIPLE} "
                "(VAE stride 8 x patch 2)"
            )
        out.append((h, w))
    if not out:
        raise ValueError(f"no buckets in {spec!r}")
    return out


def choose_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest ``width / height`` in log scale; the first wins ties."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - aspect))


def size_plan(height: int, width: int, buckets: Sequence[tuple[int, int]] | None) -> dict[str, Any]:
    """How a ``height x width`` frame is sized: ``{"resize": [h, w], "crop": [top, left, h, w]}``.

    ``resize`` is the size after scaling (the source's with ``buckets=None``); ``crop`` is the centre
    window taken from it, whose size is the output's.

    Raises:
        ValueError: a native frame smaller than 16 on a side.
    """
    if buckets is None:
        out_h, out_w = (
            height // SPATIAL_MULTIPLE * SPATIAL_MULTIPLE,
            width // SPATIAL_MULTIPLE * SPATIAL_MULTIPLE,
        )
        if out_h == 0 or out_w == 0:
            raise ValueError(f"frame {height}x{width} is smaller than {SPATIAL_MULTIPLE} on a side")
        rh, rw = height, width
    else:
        out_h, out_w = choose_bucket(height, width, buckets)
        scale = max(out_h / height, out_w / width)
        rh, rw = max(out_h, round(height * scale)), max(out_w, round(width * scale))
    return {"resize": [rh, rw], "crop": [(rh - out_h) // 2, (rw - out_w) // 2, out_h, out_w]}


def to_pixels(frames: torch.Tensor, plan: dict[str, Any]) -> torch.Tensor:
    """Apply a :func:`size_plan` to frames and scale them to [-1, 1].

    Args:
        frames: (T, H, W, 3) uint8 RGB.
        plan: from :func:`size_plan`.

    Returns:
        (3, T, h, w) float32 in [-1, 1], the VAE's input layout without the batch axis.
    """
    x = frames.permute(0, 3, 1, 2).float()  # (T, 3, H, W)
    rh, rw = plan["resize"]
    if (rh, rw) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False).clamp(
            0, 255
        )
    top, left, h, w = plan["crop"]
    x = x[:, :, top : top + h, left : left + w]
    return (x / 127.5 - 1.0).permute(1, 0, 2, 3).contiguous()


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


class InputError(Exception):
    """An input that cannot be decoded; ``reason`` is a short name, the message the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _decode_video(
    path: str, target_fps: float | None, max_frames: int
) -> tuple[torch.Tensor, float, list[int]]:
    import av  # the [ingest] extra

    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError) as err:
        raise InputError("unreadable", f"{path}: cannot open ({err})") from None
    try:
        if not container.streams.video:
            raise InputError("no_video_stream", f"{path}: no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise InputError("no_frame_rate", f"{path}: the video stream reports no frame rate")
        src_fps = float(rate)
        step = _frame_step(src_fps, target_fps)
        # Stream the decode and keep only the sampled frames: memory is bounded by max_frames.
        kept, indices, j = [], [], 0
        try:
            for frame in container.decode(stream):
                if len(kept) >= max_frames:
                    break
                if j == _source_index(len(kept), step):
                    kept.append(frame.to_ndarray(format="rgb24"))
                    indices.append(j)
                j += 1
        except av.error.FFmpegError as err:
            if not kept:
                raise InputError("decode_error", f"{path}: decoding failed at frame {j} ({err})") from None
            log.warning(
                "ingest: %s: decoding stopped at frame %d (%s); using the %d frames before",
                path,
                j,
                err,
                len(kept),
            )
    finally:
        container.close()
    count = wan_frame_count(len(kept), max_frames)
    if count == 0:
        raise InputError("no_frames", f"{path}: no decodable frames")
    return torch.from_numpy(np.stack(kept[:count])), src_fps, indices[:count]


def _decode_image(path: str) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError) as err:
        raise InputError("unreadable", f"{path}: not a readable image ({err})") from None
    return torch.from_numpy(rgb.copy())[None]


def decode_input(
    item: IngestItem, target_fps: float | None, max_frames: int, buckets: Sequence[tuple[int, int]] | None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decode, sample and size one input.

    Returns:
        ``(pixels, meta)``: (3, T, h, w) float32 in [-1, 1] with T = 4k + 1, and the sample's json:
        ``source`` (path), ``caption``, ``fps`` (of the kept frames; None for an image), ``source_fps``,
        ``frame_indices``, ``source_size`` [H, W], ``resize``, ``crop`` [top, left, h, w].

    Raises:
        InputError: the file cannot be decoded (``reason`` says why).
    """
    if not os.path.isfile(item.path):
        raise InputError("missing", f"{item.path}: no such file")
    if item.path.lower().endswith(IMAGE_EXTENSIONS):
        frames, src_fps, indices, fps = _decode_image(item.path), None, [0], None
    else:
        target = item.fps if item.fps is not None else target_fps
        frames, src_fps, indices = _decode_video(item.path, target, max_frames)
        fps = src_fps if target is None else min(src_fps, float(target))
    plan = size_plan(int(frames.shape[1]), int(frames.shape[2]), buckets)
    meta = {
        "source": item.path,
        "caption": item.caption,
        "fps": fps,
        "source_fps": src_fps,
        "frame_indices": indices,
        "source_size": [int(frames.shape[1]), int(frames.shape[2])],
        **plan,
    }
    return to_pixels(frames, plan), meta


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------


def latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), each (1, C, 1, 1, 1) float32, from the VAE config's ``latents_mean``/``latents_std``.

    Raises:
        ValueError: the config lacks them (not a Wan VAE).
    """
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    if mean is None or std is None:
        raise ValueError(
            "the VAE config has no latents_mean / latents_std; ingest needs Wan's AutoencoderKLWan config"
        )
    return (
        torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1, 1),
        torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1, 1),
    )


@torch.no_grad()
def encode_video(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Wan-normalised latents of a clip: ``(posterior mode - latents_mean) / latents_std``.

    The posterior's mode (not a sample) is what Wan's own ``WanVAE.encode`` returns, and the
    normalisation is the inverse of what diffusers' Wan pipelines apply before decoding.

    Args:
        vae: a diffusers ``AutoencoderKLWan``.
        pixels: (B, 3, T, H, W) in [-1, 1], T = 4k + 1, H and W multiples of 8.

    Returns:
        (B, z_dim, 1 + (T - 1) / 4, H / 8, W / 8) float32.
    """
    param = next(vae.parameters())
    z = vae.encode(pixels.to(device=param.device, dtype=param.dtype)).latent_dist.mode().float()
    mean, std = latent_stats(vae)
    return (z - mean.to(z.device)) / std.to(z.device)


@torch.no_grad()
def encode_text(tokenizer, text_encoder, caption: str, max_length: int = TEXT_MAX_LENGTH) -> torch.Tensor:
    """umT5 states of the caption's real tokens (Wan trims padding): (L, D) float32, L <= ``max_length``."""
    tokens = tokenizer(caption, truncation=True, max_length=max_length, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    out = text_encoder(
        input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
    ).last_hidden_state
    return out[0].float()

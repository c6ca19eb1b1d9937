"""Videos and images to latent shards: decode, sample, size, encode with Wan's VAE (and umT5), write.

The pipeline, per input file::

    decode (PyAV / Pillow) -> frames at the target fps, Wan's 4k+1 count, at most max_frames
    -> resize + centre crop to a bucket (or native size rounded to 16) -> pixels in [-1, 1]
    -> AutoencoderKLWan.encode(...).latent_dist.mode() -> (z - latents_mean) / latents_std
    -> <key>.latent.npy (16, 1 + (T-1)/4, H/8, W/8) [+ <key>.text.npy (L, 4096)] + <key>.json

It runs as ``Trainer.predict`` (:func:`ingest`): the inputs still to do are split over the ranks, each
rank's :class:`ShardPredictionWriter` writes its own shards, and rank 0 writes ``index.json`` for all of
them at the end. A rerun skips every input whose sample is in a complete shard (shards are renamed into
place only when complete, so a killed run leaves nothing half-written that counts as done).

Frame sampling. With source rate ``f_src`` and target rate ``f`` (at most ``f_src``: frames are never
duplicated), target frame ``i`` is source frame ``round(i * f_src / f)`` (0-based decode order), for as
many ``i`` as the clip holds, capped at ``max_frames``; the count is then cut down to the largest
``4k + 1`` (Wan's VAE maps 4k + 1 frames to k + 1 latent frames). Images are one frame.

Sizing. ``buckets``: the (height, width) whose aspect ratio is nearest the source's in log scale (the
first listed wins a tie); the frame is scaled (bilinear, antialiased) by ``max(bh / h, bw / w)`` so that
it covers the bucket, then centre-cropped. ``buckets=None``: native size, centre-cropped down to a
multiple of 16 (VAE stride 8 x patch 2) on each side, no resampling.

The decode, frame and sizing functions are plain Python (no Lightning); the Lightning parts are
:class:`IngestModule` and :class:`ShardPredictionWriter`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = [
    "IngestItem",
    "IngestModule",
    "ShardPredictionWriter",
    "choose_bucket",
    "decode_input",
    "done_keys",
    "encode_text",
    "encode_video",
    "find_inputs",
    "ingest",
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


# --------------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------------

_SHARD = re.compile(r"r(\d{3,})a(\d{3,})-\d{6}\.tar")
_STALE_TMP = re.compile(r"\.r\d{3,}a\d{3,}-\d{6}\.tar\.\d+\.tmp")


def _complete_shards(out: str) -> list[str]:
    if not os.path.isdir(out):
        return []
    return sorted(os.path.join(out, n) for n in os.listdir(out) if _SHARD.fullmatch(n))


def done_keys(out: str | os.PathLike) -> set[str]:
    """Keys of the samples in the complete shards of ``out`` (read from tar headers only)."""
    import tarfile

    keys = set()
    for path in _complete_shards(os.fspath(out)):
        with tarfile.open(path, "r:") as tf:
            keys.update(name.split(".", 1)[0] for name in tf.getnames())
    return keys


# --------------------------------------------------------------------------------------------------
# Lightning: dataset, predict module, writer
# --------------------------------------------------------------------------------------------------

import lightning.pytorch as pl  # noqa: E402 - the pure part above does not need Lightning
from lightning.pytorch.callbacks import BasePredictionWriter  # noqa: E402


class IngestDataset(torch.utils.data.Dataset):
    """Decodes one input per item; a failure becomes an error record instead of an exception, so that a
    corrupt file does not kill the data-loader workers (the writer counts it, or raises)."""

    def __init__(self, items: Sequence[IngestItem], fps: float | None, max_frames: int, buckets) -> None:
        self.items, self.fps, self.max_frames, self.buckets = list(items), fps, max_frames, buckets

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        try:
            pixels, meta = decode_input(item, self.fps, self.max_frames, self.buckets)
        except InputError as err:
            return {"key": item.key, "path": item.path, "error": err.reason, "detail": str(err)}
        return {"key": item.key, "path": item.path, "pixels": pixels, "meta": meta, "caption": item.caption}


def _first(batch: list[dict]) -> dict:
    return batch[0]  # batch size 1: every clip has its own shape


class IngestModule(pl.LightningModule):
    """Predict-side module: encodes each decoded clip with the VAE (and the caption with umT5).

    Models are loaded in :meth:`configure_model` from local folders, so that each rank loads its own copy
    on its own device.

    Args:
        vae: folder of a diffusers ``AutoencoderKLWan`` (``config.json`` + weights), or the model itself.
        text_encoder: folder of a transformers ``UMT5EncoderModel``, the model itself, or None (no text).
        tokenizer: folder of its tokenizer (default: ``text_encoder``'s folder) or the tokenizer itself.
        dtype: compute dtype of the encoders (``"float32"`` or ``"bfloat16"``).
    """

    def __init__(self, vae, text_encoder=None, tokenizer=None, dtype: str = "float32") -> None:
        super().__init__()
        self._vae_src, self._text_src, self._tok_src = vae, text_encoder, tokenizer
        self.compute_dtype = getattr(torch, dtype)
        self.vae = self.text_encoder = self.tokenizer = None
        # Set by ingest(): what predict_dataloader splits over the ranks.
        self.items: list[IngestItem] = []
        self.out = ""
        self.decode_args: tuple = (16.0, 81, None)
        self.num_workers = 0
        self.already_done = 0

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's share of the inputs not yet in a complete shard of ``out``.

        Every rank reads the done set from disk, then all wait at a barrier before any writes, so the
        remaining inputs split the same way on every rank, whatever the world size of earlier runs.
        """
        done = done_keys(self.out)
        if self.global_rank == 0:
            # Shards of killed runs left half-written under temp names: their samples are not done. No
            # rank writes before the barrier below, so none of these is in use.
            for name in os.listdir(self.out):
                if _STALE_TMP.fullmatch(name):
                    os.remove(os.path.join(self.out, name))
        self.trainer.strategy.barrier("ingest_done_keys")
        pending = [it for it in self.items if it.key not in done]
        self.already_done = len(self.items) - len(pending)
        mine = pending[self.global_rank :: self.trainer.world_size]
        for cb in self.trainer.callbacks:
            if isinstance(cb, ShardPredictionWriter):
                cb.start_bar(self.global_rank, len(mine))
        return torch.utils.data.DataLoader(
            IngestDataset(mine, *self.decode_args),
            batch_size=1,
            collate_fn=_first,
            num_workers=self.num_workers,
        )

    def configure_model(self) -> None:
        if self.vae is not None:
            return
        if isinstance(self._vae_src, (str, os.PathLike)):
            from diffusers import AutoencoderKLWan

            self.vae = AutoencoderKLWan.from_pretrained(
                os.fspath(self._vae_src), torch_dtype=self.compute_dtype
            )
        else:
            self.vae = self._vae_src
        self.vae.eval().requires_grad_(False)
        if self._text_src is not None:
            if isinstance(self._text_src, (str, os.PathLike)):
                from transformers import UMT5EncoderModel

                self.text_encoder = UMT5EncoderModel.from_pretrained(
                    os.fspath(self._text_src), torch_dtype=self.compute_dtype
                )
            else:
                self.text_encoder = self._text_src
            self.text_encoder.eval().requires_grad_(False)
            tok = self._tok_src if self._tok_src is not None else self._text_src
            if isinstance(tok, (str, os.PathLike)):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(os.fspath(tok))
            self.tokenizer = tok

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        if "error" in batch:
            return batch
        latent = encode_video(self.vae, batch["pixels"][None])[0]
        text = None
        if self.text_encoder is not None and batch["caption"]:
            text = encode_text(self.tokenizer, self.text_encoder, batch["caption"])
        return {
            "key": batch["key"],
            "path": batch["path"],
            "latent": latent.cpu(),
            "text": None if text is None else text.cpu(),
            "meta": batch["meta"],
        }


class ShardPredictionWriter(BasePredictionWriter):
    """Writes each rank's encoded samples into its own shards ``r<rank>a<attempt>-NNNNNN.tar`` in ``out``,
    counts (or raises on) failed inputs, shows a progress bar with samples and hours of video on rank 0,
    and has rank 0 write ``index.json`` over all complete shards at the end.

    Args:
        out: output folder.
        samples_per_shard: samples per shard (a shard is complete, and its samples count as done, only
            when it is full or the job ends).
        latent_dtype: ``"float16"`` (half the bytes) or ``"float32"``.
        on_error: ``"skip"``: count the input and its reason (``ingest-skipped-r<rank>.jsonl``) and go
            on; ``"raise"``: stop with an error naming the file.
        progress: show a tqdm bar on rank 0 (samples, hours of video).
    """

    def __init__(
        self,
        out: str,
        samples_per_shard: int = 100,
        latent_dtype: str = "float16",
        on_error: str = "skip",
        progress: bool = True,
    ) -> None:
        super().__init__(write_interval="batch")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        self.out, self.samples_per_shard, self.on_error, self.progress = (
            out,
            samples_per_shard,
            on_error,
            progress,
        )
        self.total = 0
        self.latent_dtype = np.dtype(latent_dtype)
        self.writer = None
        self.written = 0
        self._in_shard = 0
        self.skipped: dict[str, int] = {}
        self.video_seconds = 0.0
        self._bar = None
        self._rank = 0
        self._t0 = 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        from lightning_adaptiveload.data.writer import ShardWriter

        rank = trainer.global_rank
        os.makedirs(self.out, exist_ok=True)
        attempts = [
            int(m.group(2))
            for n in os.listdir(self.out)
            if (m := _SHARD.fullmatch(n)) and int(m.group(1)) == rank
        ]
        prefix = f"r{rank:03d}a{max(attempts, default=-1) + 1:03d}"
        self.writer = ShardWriter(
            self.out,
            prefix=prefix,
            max_samples_per_shard=self.samples_per_shard,
            max_bytes=None,
            patch_size=None,
            index_name=f".index-{prefix}.json",
        )
        self._rank = rank
        self._skip_log = os.path.join(self.out, f"ingest-skipped-r{rank:03d}.jsonl")
        self._t0 = time.perf_counter()

    def start_bar(self, rank: int, total: int) -> None:
        """Show the progress bar (rank 0 only) over this rank's ``total`` inputs."""
        self.total = total
        if rank == 0 and self.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="ingest (rank 0)", unit="sample")

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if "error" in prediction:
            if self.on_error == "raise":
                raise RuntimeError(
                    f"ingest: {prediction['detail']} (reason: {prediction['error']}); "
                    "fix or remove the file, or run with on_error='skip'"
                )
            self.skipped[prediction["error"]] = self.skipped.get(prediction["error"], 0) + 1
            with open(self._skip_log, "a", encoding="utf-8") as f:
                f.write(json.dumps({k: prediction[k] for k in ("key", "path", "error", "detail")}) + "\n")
            log.warning("ingest: skipped %s", prediction["detail"])
        else:
            meta = prediction["meta"]
            text = prediction["text"]
            self.writer.write(
                prediction["key"],
                prediction["latent"].numpy().astype(self.latent_dtype),
                text=None if text is None else text.numpy().astype(self.latent_dtype),
                meta=meta,
            )
            self.written += 1
            self._in_shard += 1
            if self._in_shard >= self.samples_per_shard:
                # Complete the shard now, not when the next sample comes: a killed run then loses at
                # most the samples of the shard in progress.
                self.writer.finish_shard()
                self._in_shard = 0
            if meta["fps"]:
                self.video_seconds += len(meta["frame_indices"]) / meta["fps"]
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                written=self.written,
                skipped=sum(self.skipped.values()),
                video_h=f"{self.video_seconds / 3600:.3f}",
            )

    def on_predict_end(self, trainer, pl_module) -> None:
        self.writer.close()
        if self._bar is not None:
            self._bar.close()
        trainer.strategy.barrier("ingest_written")
        if trainer.global_rank == 0:
            write_index(self.out)
        trainer.strategy.barrier("ingest_indexed")

    def summary(self) -> dict[str, Any]:
        """This rank's counts: written, skipped by reason, hours of video, seconds, samples/s."""
        seconds = time.perf_counter() - self._t0
        return {
            "rank": self._rank,
            "written": self.written,
            "skipped": dict(self.skipped),
            "video_hours": self.video_seconds / 3600,
            "seconds": seconds,
            "samples_per_s": self.written / seconds if seconds > 0 else 0.0,
        }


def write_index(out: str | os.PathLike):
    """Index every complete shard in ``out`` (headers only) and save ``<out>/index.json``; returns it."""
    from lightning_adaptiveload.data.index import ShardIndex

    out = os.fspath(out)
    index = ShardIndex.build(_complete_shards(out), progress=False, patch_size=None, check_values=False)
    # Every sample was checked finite by ShardWriter when it was written.
    index.values_checked = True
    index.save(os.path.join(out, "index.json"))
    return index


def ingest(
    inputs: str | os.PathLike | Sequence[IngestItem],
    out: str | os.PathLike,
    vae,
    *,
    text_encoder=None,
    tokenizer=None,
    fps: float | None = 16.0,
    max_frames: int = 81,
    buckets: str | Sequence[Sequence[int]] | None = "wan480p",
    samples_per_shard: int = 100,
    latent_dtype: str = "float16",
    on_error: str = "skip",
    num_workers: int = 2,
    dtype: str = "float32",
    trainer_kwargs: dict[str, Any] | None = None,
    callbacks: Iterable[pl.Callback] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Encode videos and images into latent shards under ``out`` with ``Trainer.predict``.

    Args:
        inputs: a folder (see :func:`find_inputs`), a CSV/JSONL manifest (:func:`read_manifest`) or items.
        out: output folder; a rerun into it skips the inputs already in complete shards.
        vae: folder of a diffusers ``AutoencoderKLWan`` (or the model).
        text_encoder, tokenizer: umT5 encoder and tokenizer folders (or objects); None: no ``text.npy``.
        fps: target frame rate (None: the source's); a manifest's per-file ``fps`` wins.
        max_frames: at most this many frames per clip (then cut to 4k + 1); Wan 2.1 trains on 81.
        buckets: ``"wan480p"``, ``"HxW,HxW,..."``, a list of (h, w), or ``None`` / ``"native"``.
        samples_per_shard: samples per shard.
        latent_dtype: ``"float16"`` or ``"float32"`` for the stored arrays.
        on_error: ``"skip"`` (count failed inputs with their reason) or ``"raise"``.
        num_workers: data-loader processes decoding inputs, per rank.
        dtype: encoder compute dtype.
        trainer_kwargs: for ``lightning.Trainer`` (``accelerator``, ``devices``, ``num_nodes``, ``strategy``).
        callbacks: more callbacks for the Trainer.
        progress: show the progress bar on rank 0.

    Returns:
        This rank's summary: ``written``, ``skipped`` (reason -> count), ``video_hours``, ``seconds``,
        ``samples_per_s``, plus ``already_done`` (inputs skipped because they were written before) and
        ``assigned`` (inputs this rank was given).
    """
    import importlib.util

    for module, package in (("av", "av"), ("PIL", "pillow"), ("diffusers", "diffusers")):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"ingest needs {package!r}, which is not installed; pip install 'lightning-adaptiveload[ingest]'"
            )
    out = os.path.abspath(os.fspath(out))
    if isinstance(inputs, (str, os.PathLike)):
        src = os.fspath(inputs)
        items = find_inputs(src) if os.path.isdir(src) else read_manifest(src)
    else:
        items = list(inputs)
    keys = [it.key for it in items]
    if len(set(keys)) != len(keys):
        raise ValueError("ingest: input keys are not unique; give each manifest row its own key")
    bucket_list = parse_buckets(buckets)
    if max_frames < 1:
        raise ValueError(f"ingest: max_frames must be >= 1, got {max_frames}")
    kwargs = dict(
        accelerator="auto",
        devices="auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    kwargs.update(trainer_kwargs or {})
    writer = ShardPredictionWriter(out, samples_per_shard, latent_dtype, on_error, progress)
    trainer = pl.Trainer(callbacks=[writer, *callbacks], **kwargs)
    module = IngestModule(vae, text_encoder, tokenizer, dtype)
    module.items, module.out, module.num_workers = items, out, num_workers
    module.decode_args = (fps, max_frames, bucket_list)
    trainer.predict(module, return_predictions=False)
    return {**writer.summary(), "already_done": module.already_done, "assigned": writer.total}

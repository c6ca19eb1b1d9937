"""Videos and images to pixels, without Lightning: inputs, frame sampling, sizing, decoding.

Frame sampling. With source rate ``f_src`` and target rate ``f`` (at most ``f_src``: frames are never
duplicated), target frame ``i`` is source frame ``round(i * f_src / f)`` (0-based decode order), for as
many ``i`` as the clip holds, capped at ``max_frames``; the count is then cut down to the largest
``4k + 1`` (Wan's VAE maps 4k + 1 frames to k + 1 latent frames). Images are one frame.

Sizing. ``buckets``: the (height, width) whose aspect ratio is nearest the source's in log scale (the
first listed wins a tie); the frame is scaled (bilinear, antialiased) by ``max(bh / h, bw / w)`` so that
it covers the bucket, then centre-cropped. ``buckets=None``: native size, centre-cropped down to a
multiple of 16 (VAE stride 8 x patch 2) on each side, no resampling.

Untrusted files. Scraped videos are the least trusted input the package takes: a 2 KB GIF can declare
81 frames of 4000 x 4000. Every decode is bounded by :class:`DecodeLimits` *before* it allocates: the
size a file declares (one frame, and frames x width x height of the clip) is checked first, FFmpeg is
told the same per-frame cap (``max_pixels``), every decoded frame is checked again (a frame may differ
from the header), and each kept frame is resized to its bucket as soon as it is decoded, so memory
follows the output, not the source. Captions are read with a size cap. Every failure is an
:class:`InputError` whose message names the file and the rule (threat model: ``docs/reliability.md``).

Encoding the pixels is :mod:`~lightning_adaptiveload.ingest.encode`.
:mod:`lightning_adaptiveload.ingest.job` runs all of it as ``Trainer.predict``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lightning_adaptiveload.shards.untrusted import Refused, key_problem, load_json

log = logging.getLogger(__name__)

__all__ = [
    "DecodeLimits",
    "INPUT_REASONS",
    "IngestItem",
    "InputError",
    "choose_bucket",
    "decode_input",
    "find_inputs",
    "parse_buckets",
    "read_caption",
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

# Caps on one input, each far above what a genuine file needs (see DecodeLimits; docs/reliability.md).
MAX_FRAME_PIXELS = 1 << 25  # width x height of one frame: 33.5 M pixels (8K UHD is 33.2 M)
MAX_CLIP_PIXELS = 1 << 28  # width x height x frames kept: 268 M (81 frames of 1080p are 168 M)
MAX_CAPTION_BYTES = 1 << 16  # a caption file: umT5 reads 512 tokens, about 3 KB of text
MAX_MANIFEST_LINE = 1 << 20  # characters in one manifest line (path, caption, fps, key)

# What each skip reason means for the user: reason -> what to do (as the shard reader's REASONS table).
# The keys are the reasons counted in the ingest summary and written to ingest-skipped-r<rank>.jsonl.
INPUT_REASONS: dict[str, str] = {
    "missing": "the file is gone: check the path, or remove it from the manifest",
    "not_a_file": "inputs must be regular files (not FIFOs, devices or directories): copy the data into a file",
    "unreadable": "the file is not a video or image the decoder knows: re-download or re-encode it",
    "no_video_stream": "the container holds no video stream: remove the file or give the video itself",
    "no_frame_rate": "the stream reports no frame rate: remux it with one (ffmpeg -r 24 -i in -c copy out)",
    "decode_error": "the decoder failed on the data: re-encode the file (ffmpeg -i in -c:v libx264 out.mp4)",
    "no_frames": "no frame could be decoded: re-encode the file",
    "too_large": "the file declares (or decodes to) more pixels than DecodeLimits allows: if it is genuine, "
    "scale it down (ffmpeg -vf scale=-2:1080) or raise max_frame_pixels / max_clip_pixels",
    "too_small": "a frame is smaller than 16 pixels on a side in native mode: use buckets, or drop the file",
    "size_changed": "the frame size changes inside the clip: re-encode it at one size (ffmpeg -vf scale=W:H)",
    "bad_caption": "the caption must be UTF-8 text of at most max_caption_bytes in a regular file: fix the "
    "file, or shorten the caption",
}


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
        error: ``(reason, detail)`` when the input is known to be unusable before decoding (a caption
            file that cannot be read); ingest then records it as a skip. None otherwise.
    """

    path: str
    key: str
    caption: str = ""
    fps: float | None = None
    error: tuple[str, str] | None = None


@dataclass(frozen=True)
class DecodeLimits:
    """What one input file may make ingest allocate; checked on what the file declares, before decoding.

    Attributes:
        max_frame_pixels: largest width x height of one frame (declared or decoded). Also given to
            FFmpeg as ``max_pixels``, so that its decoder refuses a larger frame before allocating it.
        max_clip_pixels: largest width x height x frames kept of a clip (with the frame count the
            container declares, capped at ``max_frames``; counted again while decoding).
        max_caption_bytes: largest caption file (``<file>.txt``) or manifest caption, in bytes.

    Raises:
        ValueError: a cap below 1.
    """

    max_frame_pixels: int = MAX_FRAME_PIXELS
    max_clip_pixels: int = MAX_CLIP_PIXELS
    max_caption_bytes: int = MAX_CAPTION_BYTES

    def __post_init__(self) -> None:
        for name in ("max_frame_pixels", "max_clip_pixels", "max_caption_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")


def _key_for(path: str, root: str) -> str:
    # Stem for readability, plus a hash of the relative path so that a.mp4 and a.mov, or two
    # folders' clip1.mp4, get distinct keys that stay the same across reruns (resume relies on it).
    rel = os.path.relpath(path, root)
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", os.path.splitext(os.path.basename(path))[0])[:48] or "x"
    return f"{stem}-{hashlib.sha1(rel.encode('utf-8')).hexdigest()[:10]}"


def read_caption(path: str, max_bytes: int = MAX_CAPTION_BYTES) -> str:
    """The stripped UTF-8 text of a caption file, read with a size cap.

    Raises:
        InputError: ``bad_caption`` naming the file: not a regular file (a FIFO would block), larger than
            ``max_bytes`` (never read whole), unreadable, or not UTF-8.
    """
    from lightning_adaptiveload.shards.paths import open_regular

    try:
        with open_regular(path) as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise InputError("bad_caption", f"{path}: cannot read the caption ({err})") from None
    if len(raw) > max_bytes:
        raise InputError(
            "bad_caption", f"{path}: the caption file is larger than max_caption_bytes={max_bytes}"
        )
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise InputError(
            "bad_caption",
            f"{path}: the caption is not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            "save it as UTF-8",
        ) from None


def find_inputs(folder: str | os.PathLike, max_caption_bytes: int = MAX_CAPTION_BYTES) -> list[IngestItem]:
    """Every video and image under ``folder`` (recursively, sorted).

    A ``<file>.txt`` beside a file is read as its caption (:func:`read_caption`); a caption that cannot
    be read marks its item's ``error``, so that ingest skips (and records) that input, not the run.
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
                caption, error = "", None
                if os.path.lexists(caption_file):
                    try:
                        caption = read_caption(caption_file, max_caption_bytes)
                    except InputError as err:
                        error = (err.reason, str(err))
                items.append(IngestItem(path=path, key=_key_for(path, root), caption=caption, error=error))
    return items


def _manifest_lines(f, path: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of an open manifest, each line at most :data:`MAX_MANIFEST_LINE` characters."""
    n = 0
    while True:
        line = f.readline(MAX_MANIFEST_LINE + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_MANIFEST_LINE:
            raise ValueError(
                f"{path}:{n}: the line is longer than {MAX_MANIFEST_LINE} characters; a manifest row holds a "
                "path, a caption, an fps and a key"
            )
        yield n, line


def _manifest_rows(f, path: str) -> list[tuple[int, Any]]:
    if path.lower().endswith((".jsonl", ".json")):
        rows = []
        for n, line in _manifest_lines(f, path):
            if line.strip():
                try:
                    rows.append((n, load_json(line.encode("utf-8"))))
                except Refused as err:
                    raise ValueError(f"{path}:{n}: not a JSON object: the line {err}") from None
        return rows
    lines = _manifest_lines(f, path)
    numbers: list[int] = []

    def text() -> Iterator[str]:
        for n, line in lines:
            numbers.append(n)
            yield line

    reader = csv.DictReader(text())
    out = []
    try:
        for row in reader:
            out.append((numbers[-1] if numbers else 0, row))
    except csv.Error as err:
        raise ValueError(f"{path}:{numbers[-1] if numbers else 1}: not valid CSV ({err})") from None
    return out


def read_manifest(path: str | os.PathLike, max_caption_bytes: int = MAX_CAPTION_BYTES) -> list[IngestItem]:
    """Inputs listed in a CSV (header row) or JSONL file with fields ``path``, optional ``caption``,
    ``fps`` and ``key``. Relative paths are relative to the manifest's folder.

    The manifest is read as untrusted text: lines are length-capped, JSON nesting is bounded, every field
    is type-checked and keys follow the shard writer's key rules. A caption longer than
    ``max_caption_bytes`` marks that item's ``error`` (ingest skips and records it).

    Raises:
        ValueError: naming the file, the line and the problem (no ``path``, a field of the wrong type, bad
            ``fps``, a key that breaks the key rules or appears twice, a line too long, not UTF-8).
    """
    from lightning_adaptiveload.shards.paths import open_regular

    path = os.fspath(path)
    root = os.path.dirname(os.path.abspath(path))
    try:
        with open_regular(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
            rows = _manifest_rows(f, path)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: the manifest is not UTF-8 ({err.reason} at byte {err.start} of a chunk)"
        ) from None
    items, seen = [], set()
    for n, row in rows:
        if not isinstance(row, dict) or not row.get("path"):
            raise ValueError(f"{path}:{n}: every row needs a 'path' (got {_short(row)})")
        for field in ("path", "caption", "key"):
            if row.get(field) is not None and not isinstance(row[field], str):
                raise ValueError(f"{path}:{n}: {field} must be a string, got {_short(row[field])}")
        if "\x00" in row["path"]:
            raise ValueError(f"{path}:{n}: path {_short(row['path'])} contains a NUL character")
        file = row["path"] if os.path.isabs(row["path"]) else os.path.join(root, row["path"])
        fps = row.get("fps")
        try:
            if isinstance(fps, bool):
                raise ValueError
            fps = float(fps) if fps not in (None, "") else None
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{n}: fps={_short(fps)} is not a number") from None
        if fps is not None and not (fps > 0 and math.isfinite(fps)):
            raise ValueError(f"{path}:{n}: fps={fps!r} must be a finite number > 0")
        key = row.get("key") or _key_for(file, root)
        rule = key_problem(key)
        if rule is not None:
            raise ValueError(
                f"{path}:{n}: key {_short(key)} {rule}; give the row a key of letters, digits, '-' and '_'"
            )
        if key in seen:
            raise ValueError(f"{path}:{n}: key {key!r} appears twice; keys must be unique")
        seen.add(key)
        caption = row.get("caption") or ""
        error = None
        if len(caption.encode("utf-8", "surrogatepass")) > max_caption_bytes:
            error = (
                "bad_caption",
                f"{path}:{n}: the caption is longer than max_caption_bytes={max_caption_bytes}",
            )
            caption = ""
        items.append(IngestItem(path=os.path.abspath(file), key=key, caption=caption, fps=fps, error=error))
    return items


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    """An input that cannot be used; ``reason`` is a key of :data:`INPUT_REASONS`, the message the detail.

    The message names the file and the rule broken; ``hint`` says what to do.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.hint = INPUT_REASONS.get(reason, "")

    def __reduce__(self):
        return (InputError, (self.reason, str(self)))


def _check_frame(path: str, width: int, height: int, limits: DecodeLimits, what: str) -> None:
    if width < 1 or height < 1:
        raise InputError("unreadable", f"{path}: {what} a frame of {width}x{height} pixels")
    if width * height > limits.max_frame_pixels:
        raise InputError(
            "too_large",
            f"{path}: {what} frames of {width}x{height} = {width * height} pixels, more than "
            f"max_frame_pixels={limits.max_frame_pixels}",
        )


def _check_clip(path: str, width: int, height: int, frames: int, limits: DecodeLimits, what: str) -> None:
    if width * height * frames > limits.max_clip_pixels:
        raise InputError(
            "too_large",
            f"{path}: {what} {frames} frames of {width}x{height} = {width * height * frames} pixels, more than "
            f"max_clip_pixels={limits.max_clip_pixels}",
        )


def _plan_for(
    path: str, height: int, width: int, buckets: Sequence[tuple[int, int]] | None
) -> dict[str, Any]:
    try:
        return size_plan(height, width, buckets)
    except ValueError as err:
        raise InputError("too_small", f"{path}: {err}") from None


def _frame_pixels(rgb: np.ndarray, plan: dict[str, Any]) -> torch.Tensor:
    """One (H, W, 3) uint8 frame sized by ``plan``: (3, h, w) float32 in [-1, 1], as :func:`to_pixels`.

    One colour plane at a time: a source frame costs 4 bytes a pixel in float, not 12 (or 24 with the
    copy ``interpolate`` makes of a channels-last input). The planes are resampled independently, so the
    result is :func:`to_pixels`'s.
    """
    rh, rw = plan["resize"]
    top, left, h, w = plan["crop"]
    planes = torch.from_numpy(rgb).permute(2, 0, 1)  # (3, H, W) uint8, a view
    out = torch.empty(3, h, w)
    for c in range(3):
        x = planes[c][None, None].float()
        if (rh, rw) != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False).clamp(
                0, 255
            )
        out[c] = x[0, 0, top : top + h, left : left + w]
    return out / 127.5 - 1.0


def _decode_video(
    path: str,
    target_fps: float | None,
    max_frames: int,
    buckets: Sequence[tuple[int, int]] | None,
    limits: DecodeLimits,
) -> tuple[torch.Tensor, float, list[int], list[int], dict[str, Any]]:
    """Decode, sample and size a clip, one frame at a time: (pixels (3, T, h, w), fps, indices, [H, W], plan)."""
    import av  # the [ingest] extra

    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise InputError("unreadable", f"{path}: cannot open ({err})") from None
    try:
        if not container.streams.video:
            raise InputError("no_video_stream", f"{path}: no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise InputError("no_frame_rate", f"{path}: the video stream reports no frame rate")
        src_fps = float(rate)
        if not (math.isfinite(src_fps) and src_fps > 0):
            raise InputError("no_frame_rate", f"{path}: the video stream reports a frame rate of {src_fps}")
        step = _frame_step(src_fps, target_fps)
        # What the headers declare, checked before the first frame is decoded.
        ctx = stream.codec_context
        width, height, declared = int(ctx.width or 0), int(ctx.height or 0), int(stream.frames or 0)
        if width or height:
            _check_frame(path, width, height, limits, "declares")
            available = int(math.floor((declared - 1) / step + 1e-9)) + 1 if declared > 0 else max_frames
            _check_clip(path, width, height, min(max_frames, available), limits, "declares")
        try:  # FFmpeg refuses a larger frame before allocating it, whatever the headers said
            ctx.options = {**dict(ctx.options or {}), "max_pixels": str(limits.max_frame_pixels)}
        except (AttributeError, TypeError, ValueError):  # pragma: no cover - other PyAV versions
            pass
        # Stream the decode; each kept frame is sized at once: memory follows the output, not the source.
        kept: list[torch.Tensor] = []
        indices: list[int] = []
        plan: dict[str, Any] | None = None
        size: tuple[int, int] | None = None
        j = 0
        try:
            for frame in container.decode(stream):
                if len(kept) >= max_frames:
                    break
                if size is None:
                    size = (int(frame.height), int(frame.width))
                    _check_frame(path, size[1], size[0], limits, "decodes")
                    plan = _plan_for(path, size[0], size[1], buckets)
                elif (int(frame.height), int(frame.width)) != size:
                    raise InputError(
                        "size_changed",
                        f"{path}: frame {j} is {frame.width}x{frame.height}, the clip started at "
                        f"{size[1]}x{size[0]}",
                    )
                if j == _source_index(len(kept), step):
                    _check_clip(path, size[1], size[0], len(kept) + 1, limits, "decodes")
                    kept.append(_frame_pixels(frame.to_ndarray(format="rgb24"), plan))  # type: ignore[arg-type]
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
    if count == 0 or size is None or plan is None:
        raise InputError("no_frames", f"{path}: no decodable frames")
    return torch.stack(kept[:count], dim=1), src_fps, indices[:count], list(size), plan


def _decode_image(
    path: str, buckets: Sequence[tuple[int, int]] | None, limits: DecodeLimits
) -> tuple[torch.Tensor, list[int], dict[str, Any]]:
    """Decode and size an image: (pixels (3, 1, h, w), [H, W], plan)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:  # reads the header only: the size is checked before any pixel
            width, height = img.size
            _check_frame(path, width, height, limits, "declares")
            plan = _plan_for(path, height, width, buckets)
            rgb = np.array(img.convert("RGB"))  # a writable copy: torch.from_numpy needs one
    except Image.DecompressionBombError as err:
        raise InputError("too_large", f"{path}: {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as err:
        raise InputError("unreadable", f"{path}: not a readable image ({err})") from None
    if rgb.shape[:2] != (height, width):
        raise InputError(
            "size_changed", f"{path}: declares {width}x{height} but decodes to {rgb.shape[1]}x{rgb.shape[0]}"
        )
    return _frame_pixels(rgb, plan)[:, None], [height, width], plan


def decode_input(
    item: IngestItem,
    target_fps: float | None,
    max_frames: int,
    buckets: Sequence[tuple[int, int]] | None,
    limits: DecodeLimits | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Decode, sample and size one input, within ``limits``.

    Returns:
        ``(pixels, meta)``: (3, T, h, w) float32 in [-1, 1] with T = 4k + 1, and the sample's json:
        ``source`` (path), ``caption``, ``fps`` (of the kept frames; None for an image), ``source_fps``,
        ``frame_indices``, ``source_size`` [H, W], ``resize``, ``crop`` [top, left, h, w].

    Raises:
        InputError: the file cannot be used (``reason`` says why, the message names the file and rule).
    """
    limits = DecodeLimits() if limits is None else limits
    try:
        mode = os.stat(item.path).st_mode
    except FileNotFoundError:
        raise InputError("missing", f"{item.path}: no such file") from None
    except OSError as err:
        raise InputError("unreadable", f"{item.path}: cannot stat ({err})") from None
    if not stat.S_ISREG(mode):
        raise InputError("not_a_file", f"{item.path}: not a regular file (a FIFO, device or directory)")
    if item.path.lower().endswith(IMAGE_EXTENSIONS):
        pixels, source_size, plan = _decode_image(item.path, buckets, limits)
        src_fps, indices, fps = None, [0], None
    else:
        target = item.fps if item.fps is not None else target_fps
        pixels, src_fps, indices, source_size, plan = _decode_video(
            item.path, target, max_frames, buckets, limits
        )
        fps = src_fps if target is None else min(src_fps, float(target))
    meta = {
        "source": item.path,
        "caption": item.caption,
        "fps": fps,
        "source_fps": src_fps,
        "frame_indices": indices,
        "source_size": source_size,
        **plan,
    }
    return pixels, meta

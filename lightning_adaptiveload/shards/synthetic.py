"""Synthetic shards: random latents whose shapes follow a length mix, deterministic for a seed.

Two kinds of content: ``"noise"`` (the default) draws every latent element independently from N(0, 1),
which exercises the data path but leaves a model nothing to learn beyond the noise statistics;
``"structured"`` draws latents from a low-dimensional, smooth distribution (:func:`structured_latent`),
so that a loss curve says something about learning (``benchmarks/balance/convergence.py``).

The settings are recorded in the index's metadata (``metadata["synthetic"]``), so that a second call
with the same settings reuses the shards instead of writing them again.

Only data this module wrote is ever replaced: a folder that holds anything else (real shards, an index
without synthetic settings, other files) is refused with :class:`NotSyntheticDataError`, whatever
``overwrite`` says. A write is announced (size, folder, free space) and shows a progress bar when it is
over :data:`ANNOUNCE_BYTES`, and refused before it starts when the disk cannot hold it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from tqdm.auto import tqdm

from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    INDEX_NAME,
)
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.mixes import Mix, load_mix
from lightning_adaptiveload.shards.writer import ShardWriter

__all__ = [
    "ANNOUNCE_BYTES",
    "CONTENTS",
    "NotSyntheticDataError",
    "SyntheticShards",
    "estimate_synthetic_bytes",
    "structured_latent",
    "write_synthetic_shards",
]

#: What the latents hold: ``"noise"`` (i.i.d. N(0, 1)) or ``"structured"`` (learnable, :func:`structured_latent`).
Content = Literal["noise", "structured"]
CONTENTS: tuple[str, ...] = get_args(Content)

# A write of more than this many bytes is announced (size, folder) and shows a progress bar even when
# ``progress=False``: a recipe's synthetic block can ask for gigabytes (wan13b_480p_*: 7.5 GiB).
ANNOUNCE_BYTES = 1 << 30

# Written into the folder before the first shard: the folder is this module's, even if the write stops
# before index.json exists (so a rerun replaces the partial write instead of refusing it as foreign data).
MARKER_NAME = ".synthetic-settings.json"


class NotSyntheticDataError(FileExistsError):
    """The folder given to :func:`write_synthetic_shards` holds data it did not write (e.g. real shards).

    Attributes:
        directory: the folder.
        found: what is there, in words (e.g. ``"an index without synthetic settings, 12 shard files ..."``).
        advice: what to do (a caller that knows where the folder came from, such as a recipe, says more).
    """

    def __init__(self, directory: str, found: str, advice: str | None = None, context: str = "") -> None:
        self.directory, self.found = directory, found
        self.advice = advice or (
            "to use the data there, do not ask for synthetic data; to write synthetic data, give an empty or "
            "new folder"
        )
        super().__init__(
            f"{directory} holds data that was not written as synthetic data: {found}.{context} Synthetic "
            "shards never replace other data (not even with overwrite=True), so nothing was changed. What to "
            f"do: {self.advice}"
        )


log = logging.getLogger(__name__)


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float16: np.float16, torch.float32: np.float32}.get(dtype, dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(f"dtype must be float16 or float32, got {dtype!r}")
    return dt


def _shard_sizes(
    num_samples: int, samples_per_shard: int | Sequence[int], uneven: bool, seed: int
) -> list[int]:
    """The shard sizes (``samples_per_shard`` was checked by :class:`SyntheticShards`)."""
    if not isinstance(samples_per_shard, int):
        return [int(v) for v in samples_per_shard]
    sizes = []
    rng = np.random.default_rng([seed, 1])  # its own stream: sizes never change the sample contents
    left = num_samples
    while left > 0:
        if uneven:
            lo, hi = max(1, samples_per_shard // 2), max(1, samples_per_shard + samples_per_shard // 2)
            n = int(rng.integers(lo, hi + 1))
        else:
            n = samples_per_shard
        sizes.append(min(n, left))
        left -= sizes[-1]
    return sizes


@dataclass(frozen=True, kw_only=True)
class SyntheticShards:
    """What :func:`write_synthetic_shards` writes; also the keys of a recipe's ``data.init_args.synthetic``
    block (with ``val_num_samples``, the DataModule's own). Validated once, here.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    mix: str | os.PathLike | Mix = "tiny"
    """A packaged mix name, a mix file path, or a :class:`~lightning_adaptiveload.shards.mixes.Mix`."""

    num_samples: int = 256
    """Samples to write, >= 1."""

    samples_per_shard: int | Sequence[int] = 64
    """Samples per shard, or the list of shard sizes (positive, summing to ``num_samples``)."""

    seed: int = 0
    """Seeds the bucket draws, latents, text lengths and states, and uneven shard sizes."""

    text_len_range: tuple[int, int] | None = (0, 16)
    """(min, max) text length L, inclusive; L = 0 writes no text member; None: no text at all."""

    text_dim: int = 32
    """D_text of the text states, >= 1."""

    dtype: Any = "float16"
    """float16 or float32 (numpy, torch or string); stored as its numpy name."""

    uneven: bool = False
    """Draw shard sizes in [s/2, 1.5 s] for ``samples_per_shard = s`` (deterministic)."""

    prefix: str = "shard"
    """Shard file prefix."""

    key_prefix: str = "sample"
    """Sample keys are ``<key_prefix>NNNNNNNN``."""

    overwrite: bool = False
    """Replace synthetic shards written with other settings (else FileExistsError). Data that
    :func:`write_synthetic_shards` did not write is never replaced."""

    content: Content = "noise"
    """``"noise"`` (i.i.d. N(0, 1) latents) or ``"structured"`` (learnable latents, :func:`structured_latent`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _np_dtype(self.dtype).name)
        if not isinstance(self.num_samples, int | np.integer) or self.num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        sps = self.samples_per_shard
        if isinstance(sps, int | np.integer):
            if sps < 1:
                raise ValueError(f"samples_per_shard must be >= 1, got {sps!r}")
        else:
            sizes = [int(v) for v in sps]
            if sum(sizes) != self.num_samples or any(v < 1 for v in sizes):
                raise ValueError(
                    f"samples_per_shard {sizes} must be positive and sum to num_samples={self.num_samples}"
                )
            object.__setattr__(self, "samples_per_shard", sizes)
        object.__setattr__(self, "text_len_range", _check_text(self.text_len_range, self.text_dim))
        if self.content not in CONTENTS:
            raise ValueError(f"content must be one of {CONTENTS}, got {self.content!r}")


def write_synthetic_shards(
    directory: str | os.PathLike,
    settings: SyntheticShards | None = None,
    *,
    progress: bool = True,
) -> ShardIndex:
    """Write shards of random latents whose shapes follow a length mix; deterministic for a seed.

    If ``directory`` already holds shards written by this function with the same settings (recorded in
    the index's metadata, file sizes intact), they are reused and nothing is written.

    Args:
        directory: where the shards and ``index.json`` go.
        settings: what to write (a :class:`SyntheticShards`; its fields are documented there); None: its
            defaults.
        progress: tqdm bar over samples (always shown for a write over :data:`ANNOUNCE_BYTES`).

    Returns:
        The index of the shards (as saved in ``directory/index.json``).

    Raises:
        TypeError: ``settings`` is not a :class:`SyntheticShards` (a mix is its ``mix`` field).
        NotSyntheticDataError: ``directory`` holds data this function did not write.
        FileExistsError: it holds synthetic shards of other settings and ``overwrite`` is False.
        OSError: the disk holding ``directory`` has less free space than the write needs (checked first).
    """
    if settings is not None and not isinstance(settings, SyntheticShards):
        raise TypeError(
            f"write_synthetic_shards(directory, settings): settings must be a SyntheticShards, got {settings!r}; "
            "a mix goes in it: SyntheticShards(mix=...)"
        )
    cfg = SyntheticShards() if settings is None else settings
    mix_obj = cfg.mix if isinstance(cfg.mix, Mix) else load_mix(cfg.mix)
    dt = np.dtype(cfg.dtype)
    num_samples, seed, text_range, text_dim = cfg.num_samples, cfg.seed, cfg.text_len_range, cfg.text_dim
    prefix, key_prefix, content = cfg.prefix, cfg.key_prefix, cfg.content
    sizes = _shard_sizes(num_samples, cfg.samples_per_shard, cfg.uneven, seed)
    record = {
        "mix": mix_obj.name,
        "buckets": [[list(b.latent_shape), b.p] for b in mix_obj.buckets],
        "num_samples": num_samples,
        "shard_sizes": sizes,
        "seed": seed,
        "text_len_range": None if text_range is None else list(text_range),
        "text_dim": text_dim,
        "dtype": dt.name,
        "prefix": prefix,
        "key_prefix": key_prefix,
    }
    if content != "noise":  # recorded only when set: shards written before the option still reuse
        record["content"] = content
    directory = os.path.abspath(os.fspath(directory))
    index_path = os.path.join(directory, INDEX_NAME)
    foreign = _foreign_content(directory)
    if foreign is not None:
        raise NotSyntheticDataError(directory, foreign)
    if os.path.exists(index_path) and not cfg.overwrite:
        reused = _reuse(directory, index_path, record)
        if reused is not None:
            return reused
    # From here the folder is empty or holds only this module's shards (complete with other settings and
    # overwrite=True, or a write that stopped early): they are replaced.
    rng = np.random.default_rng(seed)
    buckets = mix_obj.sample_buckets(rng, num_samples)
    planned = _planned_bytes(mix_obj, buckets, text_range, text_dim, dt)
    if planned > ANNOUNCE_BYTES:
        _announce(directory, planned, num_samples, mix_obj.name)
        progress = True
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MARKER_NAME), "w", encoding="utf-8") as f:
        json.dump(record, f)
    with ShardWriter(
        directory,
        prefix=prefix,
        max_samples_per_shard=None,
        max_bytes=None,
        patch_size=DEFAULT_PATCH,  # load_mix guarantees even H and W
        overwrite=True,  # past the checks above: whatever is there is this module's own
        metadata={"synthetic": record},
    ) as writer:
        _write_samples(
            writer,
            rng,
            mix_obj,
            buckets,
            sizes,
            seed,
            text_range,
            text_dim,
            dt,
            key_prefix,
            progress,
            content,
        )
    return writer.index


def _write_samples(
    writer: ShardWriter,
    rng: np.random.Generator,
    mix: Mix,
    buckets: np.ndarray,
    sizes: list[int],
    seed: int,
    text_range: tuple[int, int] | None,
    text_dim: int,
    dt: np.dtype,
    key_prefix: str,
    progress: bool,
    content: str = "noise",
) -> None:
    """Draw and write every sample, one shard of ``sizes`` after the other."""
    bar = tqdm(total=sum(sizes), unit="sample", desc="writing synthetic shards", disable=not progress)
    i = 0
    try:
        for size in sizes:
            for _ in range(size):
                bucket = int(buckets[i])
                latent, text = _random_arrays(
                    rng, mix.buckets[bucket].latent_shape, text_range, text_dim, dt, content
                )
                writer.write(f"{key_prefix}{i:08d}", latent, text=text, meta=_sample_meta(mix, bucket, seed))
                i += 1
                bar.update(1)
            writer.finish_shard()
    finally:
        bar.close()


def _check_text(text_len_range: tuple[int, int] | None, text_dim: int) -> tuple[int, int] | None:
    if text_len_range is None:
        return None
    lo, hi = (int(v) for v in text_len_range)
    if lo < 0 or hi < lo:
        raise ValueError(f"text_len_range must be (min, max) with 0 <= min <= max, got {text_len_range!r}")
    if text_dim < 1:
        raise ValueError(f"text_dim must be >= 1, got {text_dim}")
    return lo, hi


def _reuse(directory: str, index_path: str, settings: dict[str, Any]) -> ShardIndex | None:
    """The existing index when it was written with the same settings and its shards are intact; None when
    it is this module's own write with the same settings but damaged (it is then written again)."""
    try:
        old = ShardIndex.load(index_path)
    except (OSError, ValueError):
        return None  # _foreign_content found the folder ours: a damaged index of ours is rewritten
    previous = old.metadata.get("synthetic")
    if previous == settings:
        if all(os.path.exists(s.path) and os.path.getsize(s.path) == s.num_bytes for s in old.shards):
            log.info("reusing synthetic shards in %s (same settings)", directory)
            return old
        log.warning("synthetic shards in %s are incomplete or changed: writing them again", directory)
        return None
    differ = sorted(k for k in {*settings, *(previous or {})} if (previous or {}).get(k) != settings.get(k))
    shown = ", ".join(f"{k} {(previous or {}).get(k)!r} there, {settings.get(k)!r} now" for k in differ[:4])
    raise FileExistsError(
        f"{directory} already holds synthetic shards written with other settings ({shown}); pass "
        "overwrite=True to replace them (in a recipe: `overwrite: true` in data.init_args.synthetic), or "
        "use another directory"
    )


def _index_metadata(directory: str) -> dict[str, Any] | None:
    """The metadata of the folder's index (index.json, else index.npidx); None when there is none or it
    cannot be read."""
    path = os.path.join(directory, INDEX_NAME)
    try:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                meta = json.load(f).get("metadata")
            return meta if isinstance(meta, dict) else {}
        binary = os.path.join(directory, "index.npidx")  # columnar.BINARY_INDEX_NAME
        if os.path.exists(binary):
            from lightning_adaptiveload.shards.columnar import read_columns

            return dict(read_columns(binary).metadata)
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _foreign_content(directory: str) -> str | None:
    """What in ``directory`` this module did not write, in words; None when it is missing, empty or ours.

    Ours: its index records synthetic settings, or the marker of a write that stopped early is there.
    Anything else with a visible name (real shards, an index of other data, other files) is foreign.
    """
    if not os.path.exists(directory):
        return None
    if not os.path.isdir(directory):
        return "it is a file, not a folder"
    if os.path.exists(os.path.join(directory, MARKER_NAME)):
        return None
    meta = _index_metadata(directory)
    if meta is not None and "synthetic" in meta:
        return None
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    if not names:
        return None
    tars = [n for n in names if n.endswith(".tar")]
    what = []
    if meta is not None:
        what.append(f"an index without synthetic settings{' (of a demo ingest)' if meta.get('demo') else ''}")
    elif any(n in (INDEX_NAME, "index.npidx") for n in names):
        what.append("an index that cannot be read")
    if tars:
        what.append(
            f"{len(tars)} shard file{'s' if len(tars) != 1 else ''} ({tars[0]}{', ...' if len(tars) > 1 else ''})"
        )
    others = [n for n in names if n not in tars and n not in (INDEX_NAME, "index.npidx")]
    if others:
        what.append(
            f"{len(others)} other entr{'ies' if len(others) != 1 else 'y'} ({others[0]}{', ...' if len(others) > 1 else ''})"
        )
    return ", ".join(what)


def estimate_synthetic_bytes(
    mix: str | os.PathLike | Mix,
    num_samples: int,
    text_len_range: tuple[int, int] | None = (0, 16),
    text_dim: int = 32,
    dtype: Any = "float16",
) -> int:
    """The expected bytes on disk of :func:`write_synthetic_shards` with these settings (mix probabilities
    and the mean text length; tar headers included), without writing anything."""
    mix_obj = mix if isinstance(mix, Mix) else load_mix(mix)
    dt = _np_dtype(dtype)
    latent = sum(b.p * int(np.prod(b.latent_shape)) for b in mix_obj.buckets) * dt.itemsize
    text = 0.0 if text_len_range is None else (sum(text_len_range) / 2) * text_dim * dt.itemsize
    return int(num_samples * (latent + text + _SAMPLE_OVERHEAD_BYTES))


# Tar headers and padding of a sample's 2-3 members, the .npy headers and the meta JSON (measured on the
# tiny mix: 2.5 to 3.6 KiB a sample).
_SAMPLE_OVERHEAD_BYTES = 3 * 1024


def _planned_bytes(
    mix: Mix, buckets: np.ndarray, text_range: tuple[int, int] | None, text_dim: int, dt: np.dtype
) -> int:
    """The bytes of the drawn buckets' latents, the mean text, and the per-sample overhead."""
    sizes = np.array([int(np.prod(b.latent_shape)) for b in mix.buckets], dtype=np.int64)
    latent = int(sizes[np.asarray(buckets, dtype=np.int64)].sum()) * dt.itemsize
    text = 0.0 if text_range is None else (sum(text_range) / 2) * text_dim * dt.itemsize * len(buckets)
    return int(latent + text + _SAMPLE_OVERHEAD_BYTES * len(buckets))


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _announce(directory: str, planned: int, num_samples: int, mix_name: str) -> None:
    """Say how much is about to be written where; refuse when the disk cannot hold it."""
    probe = directory
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    free = shutil.disk_usage(probe).free
    if planned > free:
        raise OSError(
            f"synthetic data: {num_samples} samples of the {mix_name} mix need about {_gib(planned)} in "
            f"{directory}, but that disk has {_gib(free)} free; lower num_samples, or write elsewhere"
        )
    log.warning(
        "writing about %s of synthetic data (%d samples of the %s mix) to %s (%s free there); lower "
        "num_samples for less (in a recipe: data.init_args.synthetic.num_samples)",
        _gib(planned),
        num_samples,
        mix_name,
        directory,
        _gib(free),
    )


def _random_arrays(
    rng: np.random.Generator,
    latent_shape: Sequence[int],
    text_range: tuple[int, int] | None,
    text_dim: int,
    dt: np.dtype,
    content: str = "noise",
) -> tuple[np.ndarray, np.ndarray | None]:
    """One sample's latent and text states; the draw order is fixed (it defines the data of a seed)."""
    if content == "structured":
        latent = structured_latent(rng, latent_shape).astype(dt)
    else:
        latent = rng.standard_normal(latent_shape, dtype=np.float32).astype(dt)
    text = None
    if text_range is not None:
        length = int(rng.integers(text_range[0], text_range[1] + 1))
        if length:
            text = rng.standard_normal((length, text_dim), dtype=np.float32).astype(dt)
    return latent, text


def _sample_meta(mix: Mix, bucket: int, seed: int) -> dict[str, Any]:
    b = mix.buckets[bucket]
    return {
        "bucket": bucket,
        "frames": b.frames,
        "height": b.height,
        "width": b.width,
        "source": f"synthetic:{mix.name}:seed={seed}",
    }


# The structure of "structured" latents is a property of the data family, not of a seed: train and
# validation shards (written with different seeds) must share it, or there would be nothing to generalise.
_STRUCTURE_SEED = 20_261_123
_SHARED_DIRECTIONS = 2  # channel directions every shape uses
_OWN_DIRECTIONS = 2  # channel directions of one frame count only (an image's differ from a clip's)
_MODES = 4  # smooth waves per direction and sample
_RESIDUAL_STD = 0.1  # unlearnable i.i.d. part


def _channel_basis(channels: int, frames: int) -> np.ndarray:
    """(C, K) channel directions for latents of ``frames`` frames: shared ones, then the frame count's own."""
    shared = np.random.default_rng([_STRUCTURE_SEED, channels]).standard_normal(
        (channels, _SHARED_DIRECTIONS)
    )
    own = np.random.default_rng([_STRUCTURE_SEED, channels, frames]).standard_normal(
        (channels, _OWN_DIRECTIONS)
    )
    # Entries N(0, 1) over K directions of unit-variance fields: divide by sqrt(K) for unit channel variance.
    return np.concatenate([shared, own], axis=1) / np.sqrt(_SHARED_DIRECTIONS + _OWN_DIRECTIONS)


def structured_latent(rng: np.random.Generator, latent_shape: Sequence[int]) -> np.ndarray:
    """One learnable synthetic latent: a few smooth fields mixed into the channels, plus a little noise.

    ``latent[c] = sum_k U[c, k] * z_k + 0.1 * eps``, scaled to unit variance per element, where

    - ``U`` (C, 4) is fixed for the data family (not the seed): 2 channel directions shared by every shape
      and 2 that belong to the frame count T alone, so that images and each clip length have structure of
      their own besides the common one;
    - each field ``z_k`` (T, H, W) is a sum of 4 plane waves ``a cos(2 pi (f_t t + f_h h / H + f_w w / W) +
      phi)`` with a ~ N(0, 1), phase phi ~ U(0, 2 pi), up to 1.5 cycles across the frame and 0.15 cycles
      per latent frame in time (slow motion), scaled to unit variance;
    - ``eps`` is i.i.d. N(0, 1): the part no model can predict.

    A denoiser can learn the channel subspace of each frame count and the spatial and temporal
    smoothness, so its flow-matching loss can fall well below that of i.i.d. noise latents (where the best
    prediction is a per-element linear function of the noisy input).

    Args:
        rng: draws the sample's waves and residual (in a fixed order).
        latent_shape: (C, T, H, W).

    Returns:
        float32 array of ``latent_shape``.
    """
    c, t, h, w = (int(v) for v in latent_shape)
    k = _SHARED_DIRECTIONS + _OWN_DIRECTIONS
    amp = rng.standard_normal((k, _MODES, 1, 1, 1))
    phase = rng.uniform(0.0, 2.0 * np.pi, (k, _MODES, 1, 1, 1))
    f_t = rng.uniform(0.0, 0.15, (k, _MODES, 1, 1, 1))
    f_h = rng.uniform(-1.5, 1.5, (k, _MODES, 1, 1, 1))
    f_w = rng.uniform(-1.5, 1.5, (k, _MODES, 1, 1, 1))
    tt = np.arange(t).reshape(1, 1, t, 1, 1)
    hh = np.arange(h).reshape(1, 1, 1, h, 1) / h
    ww = np.arange(w).reshape(1, 1, 1, 1, w) / w
    # Each wave has variance a^2 / 2 = 1/2 on average: sqrt(2 / modes) makes each field unit-variance.
    fields = (amp * np.cos(2.0 * np.pi * (f_t * tt + f_h * hh + f_w * ww) + phase)).sum(axis=1)
    fields *= np.sqrt(2.0 / _MODES)
    latent = np.einsum("ck,kthw->cthw", _channel_basis(c, t), fields)
    latent += _RESIDUAL_STD * rng.standard_normal((c, t, h, w))
    return (latent / np.sqrt(1.0 + _RESIDUAL_STD**2)).astype(np.float32)

"""Length mixes: the distribution of latent shapes a synthetic data set is drawn from.

A mix is a JSON file with a list of buckets; each bucket is one latent shape (C, T, H, W) and its share
``p`` of the samples. Three mixes ship as package data in ``lightning_adaptiveload/mixes/``:

- ``wan21_480p``: Wan 2.1 geometry (VAE stride 4x8x8, 16 channels, patch 1x2x2, frames 4n+1 up to 81).
  20% images / 80% videos (Open-Sora 1.2 report's split); video clips average ~8.5 s in Panda-70M, so at
  16 fps most clips fill the 81-frame window (65% of the videos here). Aspect shares: landscape 70%,
  portrait 20%, square 10%. 1,521 to 32,760 tokens per sample.
- ``wan21_720p``: the same geometry and shares, for the 14B model: half the samples at 720p landscape,
  15% at 720p portrait, the other 35% at 480p. 1,560 to 75,600 tokens per sample.
- ``tiny``: a scaled-down ``wan21_480p`` for CPU tests and the quickstart (not a real-data
  distribution): same channels, frame rule and shares, latents (16, T, H, W) with T in {1, 3, 5, 9}
  and H x W in {8x12, 12x8, 10x10}, 24 to 225 tokens per sample.

- ``native_480p``: native resolution, no classes: 1,024 shapes of continuous aspect ratio, area and
  duration (``benchmarks/data/make_native_mix.py``), 768 to 32,634 tokens per sample.

``mixes/README.md`` keeps the same provenance notes beside the files.

File format::

    {"name": "...", "note": "provenance",
     "buckets": [{"latent_shape": [C, T, H, W], "p": 0.14,
                  "tokens": 1560,                       # optional; checked for patch (1, 2, 2)
                  "frames": 1, "height": 480, "width": 832}, ...]}   # optional, informative
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.sizing import tokens_per_sample

__all__ = ["Bucket", "Mix", "available_mixes", "load_mix"]

# Probabilities must sum to 1 within this tolerance (they are written with a few decimals).
_P_TOLERANCE = 1e-6
# The "tokens" field of a mix file is the token count under the default patch; other patch sizes are
# computed with Bucket.tokens_for().
_FILE_PATCH = (1, 2, 2)


@dataclass(frozen=True)
class Bucket:
    """One latent shape of a mix.

    Attributes:
        latent_shape: (C, T, H, W) of the VAE latent.
        p: share of the samples drawn from this bucket, in [0, 1].
        tokens: tokens per sample under patch (1, 2, 2): T * (H / 2) * (W / 2).
        frames, height, width: pixel-space clip size the latent stands for (informative, may be None).
    """

    latent_shape: tuple[int, int, int, int]
    p: float
    tokens: int
    frames: int | None = None
    height: int | None = None
    width: int | None = None

    def tokens_for(self, patch_size: tuple[int, int, int] = _FILE_PATCH) -> int:
        """Tokens per sample for ``patch_size`` (pt, ph, pw); the latent must be divisible by it."""
        try:
            return tokens_per_sample(self.latent_shape, patch_size)
        except ValueError as err:
            raise ValueError(f"{err}; or use a mix whose T, H, W are multiples of the patch") from err


@dataclass(frozen=True)
class Mix:
    """A length mix: buckets of latent shapes and their probabilities.

    Attributes:
        name: the mix's name (file stem for packaged mixes).
        buckets: the buckets, in file order.
        note: provenance of the numbers.
        source: the file the mix was read from.
    """

    name: str
    buckets: tuple[Bucket, ...]
    note: str = ""
    source: str = ""

    @property
    def probabilities(self) -> np.ndarray:
        """Bucket probabilities, float64 of shape (num_buckets,), renormalised to sum to exactly 1."""
        p = np.asarray([b.p for b in self.buckets], dtype=np.float64)
        return p / p.sum()

    def sample_buckets(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` bucket indices (int64 array of shape (n,)) with the mix's probabilities."""
        return rng.choice(len(self.buckets), size=n, p=self.probabilities)


def available_mixes() -> list[str]:
    """Names of the mixes shipped with the package."""
    folder = resources.files("lightning_adaptiveload.shards") / "mixes"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def _read_mix_text(name_or_path: str | os.PathLike) -> tuple[str, str]:
    text_path = os.fspath(name_or_path)
    looks_like_path = text_path.endswith(".json") or os.sep in text_path or "/" in text_path
    if os.path.isfile(text_path):
        with open(text_path, encoding="utf-8") as f:
            return f.read(), text_path
    if not looks_like_path:
        packaged = resources.files("lightning_adaptiveload.shards") / "mixes" / f"{text_path}.json"
        if packaged.is_file():
            return packaged.read_text(encoding="utf-8"), str(packaged)
    raise FileNotFoundError(
        f"mix {text_path!r}: no such file and no packaged mix of that name; "
        f"give a path to a mix JSON file or one of {available_mixes()}"
    )


def _int_list(value: Any, n: int) -> list[int] | None:
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return None
    return value


def load_mix(name_or_path: str | os.PathLike) -> Mix:
    """Load and validate a length mix.

    Args:
        name_or_path: a packaged mix name (``"tiny"``, ``"wan21_480p"``, ``"wan21_720p"``) or the path of a
            mix JSON file.

    Returns:
        The validated :class:`Mix`.

    Raises:
        FileNotFoundError: no such file or packaged mix.
        ValueError: the file is not valid JSON, a bucket is malformed, or the probabilities do not sum to
            1 within 1e-6; the message names the file and the key.

    Example:
        >>> mix = load_mix("tiny")
        >>> mix.buckets[0].latent_shape
        (16, 1, 8, 12)
    """
    text, source = _read_mix_text(name_or_path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"mix file {source}: not valid JSON ({err}); fix the file") from None
    if not isinstance(data, dict) or not isinstance(data.get("buckets"), list) or not data["buckets"]:
        raise ValueError(f"mix file {source}: key 'buckets' must be a non-empty list of buckets")
    buckets = []
    for i, raw in enumerate(data["buckets"]):
        where = f"mix file {source}: key buckets[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object with 'latent_shape' and 'p', got {raw!r}")
        shape = _int_list(raw.get("latent_shape"), 4)
        if shape is None:
            raise ValueError(
                f"{where}.latent_shape must be 4 positive integers [C, T, H, W], got {raw.get('latent_shape')!r}"
            )
        p = raw.get("p")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0.0 <= p <= 1.0) or math.isnan(p):
            raise ValueError(f"{where}.p must be a probability in [0, 1], got {p!r}")
        _, t, h, w = shape
        if h % _FILE_PATCH[1] or w % _FILE_PATCH[2]:
            raise ValueError(
                f"{where}.latent_shape {shape}: H and W must be even (patch 1x2x2); fix the bucket"
            )
        expected = t * (h // _FILE_PATCH[1]) * (w // _FILE_PATCH[2])
        tokens = raw.get("tokens", expected)
        if tokens != expected:
            raise ValueError(
                f"{where}.tokens is {tokens!r} but latent_shape {shape} has T*(H/2)*(W/2) = {expected} tokens "
                "under patch (1, 2, 2); fix or remove 'tokens'"
            )
        extras = {k: raw.get(k) for k in ("frames", "height", "width")}
        for k, v in extras.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{where}.{k} must be a positive integer or absent, got {v!r}")
        buckets.append(Bucket(latent_shape=tuple(shape), p=float(p), tokens=expected, **extras))
    total = math.fsum(b.p for b in buckets)
    if abs(total - 1.0) > _P_TOLERANCE:
        raise ValueError(
            f"mix file {source}: key buckets[*].p sums to {total!r}, not 1 (tolerance {_P_TOLERANCE}); "
            "rescale the probabilities"
        )
    name = data.get("name")
    if name is None:
        name = os.path.splitext(os.path.basename(source))[0]
    return Mix(name=str(name), buckets=tuple(buckets), note=str(data.get("note", "")), source=source)

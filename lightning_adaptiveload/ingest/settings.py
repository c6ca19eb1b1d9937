"""The settings of :func:`lightning_adaptiveload.ingest.job.ingest`: how inputs are decoded, bucketed and stored.

One frozen, keyword-only object, validated once in ``__post_init__`` (the message names the field and the value).
The encoders, the input and output folders, the Trainer's keywords and the decode limits stay arguments of
``ingest``; the command line (:mod:`lightning_adaptiveload.cli.ingest`) builds this object from its flags.

Example:
    >>> from lightning_adaptiveload.ingest.settings import IngestSettings
    >>> IngestSettings(buckets="480x832", max_frames=33).max_frames
    33
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["IngestSettings"]

LatentDtype = Literal["float16", "float32"]
ComputeDtype = Literal["float32", "bfloat16"]
OnError = Literal["skip", "raise"]


@dataclass(frozen=True, kw_only=True)
class IngestSettings:
    """How :func:`~lightning_adaptiveload.ingest.job.ingest` decodes, buckets, encodes and stores its inputs.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    fps: float | None = 16.0
    """Target frame rate (None: the source's); a manifest's per-file ``fps`` wins."""

    max_frames: int = 81
    """At most this many frames per clip (then cut to 4k + 1); Wan 2.1 trains on 81."""

    buckets: str | Sequence[Sequence[int]] | None = "wan480p"
    """``"wan480p"``, ``"HxW,HxW,..."``, a list of (h, w) (each side a positive multiple of 16), or ``None`` /
    ``"native"``."""

    samples_per_shard: int = 100
    """Samples per output shard."""

    latent_dtype: LatentDtype = "float16"
    """dtype of the stored latents (float16: half the bytes)."""

    on_error: OnError = "skip"
    """A failed input: ``"skip"`` (count it with its reason, record it, go on) or ``"raise"``."""

    num_workers: int = 2
    """Data-loader processes decoding inputs, per rank."""

    dtype: ComputeDtype = "float32"
    """The encoders' compute dtype."""

    def __post_init__(self) -> None:
        from lightning_adaptiveload.ingest.media import parse_buckets

        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"ingest: fps must be > 0 or None (the source's), got {self.fps!r}")
        if not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"ingest: max_frames must be >= 1, got {self.max_frames!r}")
        try:
            parse_buckets(self.buckets)
        except ValueError as err:
            raise ValueError(f"ingest: buckets {self.buckets!r}: {err}") from None
        if not isinstance(self.samples_per_shard, int) or self.samples_per_shard < 1:
            raise ValueError(f"ingest: samples_per_shard must be >= 1, got {self.samples_per_shard!r}")
        for name, kind in (("latent_dtype", LatentDtype), ("on_error", OnError), ("dtype", ComputeDtype)):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"ingest: {name} must be one of {get_args(kind)}, got {getattr(self, name)!r}"
                )
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"ingest: num_workers must be >= 0, got {self.num_workers!r}")

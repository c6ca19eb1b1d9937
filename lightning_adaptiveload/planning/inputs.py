"""What the planner reads from the index: per shard its latent shapes and sample keys, a fingerprint of
them, and the bucket table (every distinct latent shape sized once, each sample's bucket id).

The input is a ``ShardIndex`` or plain lists of latent shapes (one list per shard). Pure Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_adaptiveload.planning.sizing import BatchSizer

__all__ = ["Bucket", "BucketTable", "PlanInput", "as_input", "bucket_table", "index_fingerprint"]


@dataclass
class PlanInput:
    """Per shard: a name for messages, the sample keys (None: unknown) and the latent shapes."""

    paths: list[str]
    keys: list[Sequence[str] | None]
    shapes: list[Sequence[Sequence[int]]]


def as_input(index_or_shapes: Any) -> PlanInput:
    """A ``ShardIndex`` (``.shards[i].latent_shapes``, ``.keys``, ``.path``) or a list, one per shard, of
    lists of latent shapes -> :class:`PlanInput`.

    Raises:
        TypeError: neither.
    """
    shards = getattr(index_or_shapes, "shards", None)
    if shards is not None:
        return PlanInput(
            paths=[str(getattr(s, "path", f"shard {i}")) for i, s in enumerate(shards)],
            keys=[getattr(s, "keys", None) for s in shards],
            shapes=[s.latent_shapes for s in shards],
        )
    try:
        shapes = [list(s) for s in index_or_shapes]
    except TypeError:
        raise TypeError(
            "plan_epoch needs a ShardIndex or a list (one per shard) of lists of latent shapes (C, T, H, W), "
            f"got {type(index_or_shapes).__name__}"
        ) from None
    return PlanInput(
        paths=[f"shard {i}" for i in range(len(shapes))], keys=[None] * len(shapes), shapes=shapes
    )


def index_fingerprint(index_or_shapes: Any) -> str:
    """A short hash of the shards' keys and latent shapes (not their paths): detects a changed data set."""
    data = as_input(index_or_shapes)
    h = hashlib.sha1()
    for keys, shapes in zip(data.keys, data.shapes):
        h.update(b"|shard|")
        if keys is not None:
            h.update("\x00".join(keys).encode())
        h.update(repr([tuple(int(x) for x in s) for s in shapes]).encode())
    return h.hexdigest()[:16]


@dataclass
class Bucket:
    """One latent shape of the data set and its sizes."""

    shape: tuple[int, ...]
    seq_len: int
    batch_size: int
    cost: float  # of one sample


@dataclass
class BucketTable:
    """The buckets, in order of first appearance, and per shard, per sample, its bucket id (-1: an
    oversize sample, skipped); ``oversize`` counts those."""

    buckets: list[Bucket]
    bucket_of: list[list[int]]
    oversize: int


def _key(data: PlanInput, shard: int, i: int) -> str:
    keys = data.keys[shard]
    return str(keys[i]) if keys is not None and i < len(keys) else f"#{i}"


def bucket_table(data: PlanInput, sizer: BatchSizer, oversize: str) -> BucketTable:
    """Size every distinct latent shape of ``data`` once and give each sample its bucket id.

    Args:
        data: the planner's input.
        sizer: the sizing rule (its compute cap fixed).
        oversize: ``"raise"`` or ``"skip"``: what an oversize sample does.

    Raises:
        ValueError: a shape that is not (C, T, H, W), an oversize sample under ``"raise"``, or two shapes
            of one (T, H, W) bucket with different C (names the shard and key).
    """
    bucket_id: dict[tuple[int, ...], int] = {}
    by_key: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}
    buckets: list[Bucket] = []
    bucket_of: list[list[int]] = []
    n_oversize = 0
    for sid, shapes in enumerate(data.shapes):
        row = []
        for i, raw in enumerate(shapes):
            # Shapes repeat: look the raw tuple up first, converting only unseen ones.
            shape = raw if type(raw) is tuple else tuple(raw)
            b = bucket_id.get(shape)
            if b is None:
                shape = tuple(int(x) for x in shape)
                b = bucket_id.get(shape)
            if b is None:
                b = _new_bucket(data, sid, i, shape, sizer, oversize, buckets, by_key)
                bucket_id[shape] = b
                bucket_id[raw if type(raw) is tuple else tuple(raw)] = b
            if b < 0:
                n_oversize += 1
            row.append(b)
        bucket_of.append(row)
    return BucketTable(buckets, bucket_of, n_oversize)


def _new_bucket(
    data: PlanInput,
    sid: int,
    i: int,
    shape: tuple[int, ...],
    sizer: BatchSizer,
    oversize: str,
    buckets: list[Bucket],
    by_key: dict[tuple[int, ...], tuple[tuple[int, ...], str]],
) -> int:
    """The bucket id of a shape not seen before (appended to ``buckets``), or -1 for a skipped oversize one."""
    where = f"{data.paths[sid]}, key {_key(data, sid, i)!r}"
    if len(shape) != 4:
        raise ValueError(f"{where}: latent shape {list(shape)} must be (C, T, H, W)")
    s, size = sizer.size(shape)
    if size == 0:
        if oversize == "raise":
            raise ValueError(sizer.oversize_message(shape, s, where=f"shard {where}: "))
        return -1
    first = by_key.setdefault(shape[1:], (shape, where))
    if first[0] != shape:
        raise ValueError(
            f"shard {where}: latent shape {list(shape)} differs in C from {list(first[0])} "
            f"(shard {first[1]}) in the same (T, H, W) bucket; all latents must come from one VAE"
        )
    buckets.append(Bucket(shape, s, size, sizer.cost_model.cost(s)))
    return len(buckets) - 1

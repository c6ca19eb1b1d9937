"""What the planner reads from the index: per shard its latent shapes and sample keys, a fingerprint of
them, and the bucket table (every distinct latent shape sized once, each sample's bucket id).

The input is a ``ShardIndex``, a ``CompactIndex`` (its arrays are used directly: no Python object per
sample until the bucket ids are handed to the schedules) or plain lists of latent shapes (one list per shard).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.sizing import BatchSizer

__all__ = [
    "Bucket",
    "BucketTable",
    "PlanInput",
    "as_input",
    "bucket_table",
    "distinct_shapes",
    "index_fingerprint",
]


@dataclass
class PlanInput:
    """Per shard: a name for messages, the sample keys (None: unknown) and the latent shapes."""

    paths: list[str]
    keys: Sequence[Sequence[str] | None]
    shapes: Sequence[Sequence[Sequence[int]]]
    arrays: Any = None  # a CompactIndex (shape_table, shape_ids, shard_offsets, key_offsets, key_blob)


class _Rows(Sequence):
    """Per shard, built on access from a compact index's arrays: that shard's keys or latent shapes."""

    def __init__(self, index: Any, what: str) -> None:
        self._index, self._what = index, what
        self._shapes = [tuple(r) for r in index.shape_table.tolist()]

    def __len__(self) -> int:
        return len(self._index.shard_offsets) - 1

    def __getitem__(self, s):  # type: ignore[override]
        if isinstance(s, slice):
            return [self[j] for j in range(*s.indices(len(self)))]
        if self._what == "keys":
            return self._index.shard_keys(s)
        a, b = int(self._index.shard_offsets[s]), int(self._index.shard_offsets[s + 1])
        return [self._shapes[i] for i in self._index.shape_ids[a:b].tolist()]


def as_input(index_or_shapes: Any) -> PlanInput:
    """A ``ShardIndex`` (``.shards[i].latent_shapes``, ``.keys``, ``.path``) or a list, one per shard, of
    lists of latent shapes -> :class:`PlanInput`.

    Raises:
        TypeError: neither.
    """
    if isinstance(index_or_shapes, PlanInput):
        return index_or_shapes
    if hasattr(index_or_shapes, "shape_table"):  # a CompactIndex: keep its arrays
        index = index_or_shapes
        return PlanInput(
            paths=index.paths, keys=_Rows(index, "keys"), shapes=_Rows(index, "shapes"), arrays=index
        )
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


def distinct_shapes(index_or_shapes: Any) -> Iterable[Sequence[int]]:
    """The latent shapes of the data set, each at least once (a compact index's shape table, else all)."""
    data = index_or_shapes if isinstance(index_or_shapes, PlanInput) else as_input(index_or_shapes)
    if data.arrays is not None:
        return [tuple(r) for r in data.arrays.shape_table.tolist()]
    return (s for shapes in data.shapes for s in shapes)


_FP_CHUNK = 1 << 22


def _hash_arrays(
    shard_offsets: np.ndarray,
    shapes: np.ndarray,
    shape_id: np.ndarray,
    key_offsets: np.ndarray | None,
    key_blob: np.ndarray | None,
    release: Any = None,
) -> str:
    """The fingerprint of the canonical arrays (shapes numbered in order of first use); ``release()``
    (a mapped index's ``release_pages``) runs after each chunk of keys, so the pages read leave the
    resident set as the pass goes (a 100M index's keys and offsets are 2.2 GB)."""
    h = hashlib.sha1(b"adaptiveload-index-fingerprint-2")
    h.update(np.ascontiguousarray(shard_offsets, dtype="<i8"))
    h.update(np.ascontiguousarray(shapes, dtype="<i8").reshape(-1))
    for i in range(0, len(shape_id), _FP_CHUNK):  # ids as int32 whatever their stored width
        h.update(np.ascontiguousarray(shape_id[i : i + _FP_CHUNK], dtype="<i4"))
    if key_offsets is None or key_blob is None:
        h.update(b"|no keys|")
    else:
        h.update(b"|keys|")
        for i in range(0, len(key_offsets), _FP_CHUNK):
            h.update(np.ascontiguousarray(key_offsets[i : i + _FP_CHUNK], dtype="<i8"))
            if release is not None:
                release()
        for i in range(0, len(key_blob), 1 << 26):
            h.update(np.ascontiguousarray(key_blob[i : i + (1 << 26)]))
            if release is not None:
                release()
    return h.hexdigest()[:16]


def _canonical(data: PlanInput) -> tuple[np.ndarray, ...] | None:
    """The arrays :func:`_hash_arrays` takes, from per-shard lists; None when a shape is not 4 integers."""
    ids: dict[tuple[int, ...], int] = {}
    counts, sid = [], []
    for shapes in data.shapes:
        counts.append(len(shapes))
        for raw in shapes:
            t = raw if type(raw) is tuple else tuple(raw)
            b = ids.get(t)
            if b is None:
                if len(t) != 4:
                    return None
                b = ids.setdefault(tuple(int(x) for x in t), len(ids))
                ids[t] = b
            sid.append(b)
    table = {v: k for k, v in ids.items()}
    shapes_arr = np.array([table[i] for i in range(len(table))], dtype=np.int64).reshape(-1, 4)
    off = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    key_off = key_blob = None
    if all(k is not None for k in data.keys):
        keys = [str(k) for ks in data.keys for k in ks]  # type: ignore[union-attr]
        joined = "".join(keys)
        raw = joined.encode("utf-8", "surrogatepass")
        lens = (
            map(len, keys)
            if len(raw) == len(joined)
            else (len(k.encode("utf-8", "surrogatepass")) for k in keys)
        )
        key_off = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(lens, dtype=np.int64, count=len(keys)), out=key_off[1:])
        key_blob = np.frombuffer(raw, dtype=np.uint8)
    return off, shapes_arr, np.array(sid, dtype=np.int32), key_off, key_blob


def index_fingerprint(index_or_shapes: Any) -> str:
    """A short hash of the shards' keys and latent shapes (not their paths): detects a changed data set.

    Computed from one canonical array form (shard sample offsets, the distinct shapes in order of first
    use, each sample's shape id, the keys' UTF-8 bytes and offsets), so an index gives the same
    fingerprint whether it was loaded from ``index.json`` or from the binary ``index.npidx``.
    """
    data = as_input(index_or_shapes)
    if data.arrays is not None:
        a = data.arrays
        release = getattr(a, "release_pages", None)
        fp = _hash_arrays(a.shard_offsets, a.shape_table, a.shape_ids, a.key_offsets, a.key_blob, release)
        if hasattr(a, "release_pages"):  # the pass over the keys faulted them in; the planner needs none
            a.release_pages()
        return fp
    canon = _canonical(data)
    if canon is not None:
        return _hash_arrays(*canon)
    h = hashlib.sha1()  # shapes that are not (C, T, H, W): plan_epoch refuses them; hash them as given
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
    oversize sample, skipped); ``oversize`` counts those.

    From a compact index also the same ids as arrays, for vectorised schedules: ``bucket_ids`` (n,)
    int16 (int32 beyond 32,767 shapes) in index order and ``shard_offsets`` (m + 1,) int64 (shard s: ``bucket_ids[off[s]:off[s+1]]``).
    """

    buckets: list[Bucket]
    bucket_of: list[list[int]]
    oversize: int
    bucket_ids: np.ndarray | None = field(default=None, compare=False)
    shard_offsets: np.ndarray | None = field(default=None, compare=False)


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
    if data.arrays is not None:
        return _bucket_table_arrays(data, sizer, oversize)
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


def _first_uses(shape_id: np.ndarray, n_shapes: int) -> list[int]:
    """Sample position of each shape id's first use (ids numbered in order of first use)."""
    out: list[int] = []
    top = -1
    for i in range(0, len(shape_id), _FP_CHUNK):
        if len(out) == n_shapes:
            break
        part = shape_id[i : i + _FP_CHUNK].astype(np.int64)
        prev = np.maximum.accumulate(np.concatenate(([top], part)))[:-1]
        new = np.flatnonzero(part > prev)
        out.extend((i + new).tolist())
        top = int(prev[-1]) if part.size == 0 else max(top, int(part.max()))
    return out


def _bucket_table_arrays(data: PlanInput, sizer: BatchSizer, oversize: str) -> BucketTable:
    """:func:`bucket_table` of a compact index: each distinct shape sized once (in order of first use,
    which is the order the per-sample loop meets them), then shape id -> bucket id by array indexing."""
    index = data.arrays
    table = [tuple(r) for r in index.shape_table.tolist()]
    ids, off = index.shape_ids, index.shard_offsets
    first = _first_uses(ids, len(table))
    shard_of = (np.searchsorted(off, first, side="right") - 1).tolist()
    buckets: list[Bucket] = []
    by_key: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}
    lut = np.empty(len(table), dtype=np.int16 if len(table) < 1 << 15 else np.int32)  # 2 bytes a sample
    for k, shape in enumerate(table):
        sid = shard_of[k]
        lut[k] = _new_bucket(data, sid, first[k] - int(off[sid]), shape, sizer, oversize, buckets, by_key)
    n_oversize = int(np.bincount(ids, minlength=len(table))[lut < 0].sum()) if len(table) else 0
    bucket_ids = lut[ids]
    bounds = off.tolist()
    bucket_of = [bucket_ids[bounds[s] : bounds[s + 1]].tolist() for s in range(len(bounds) - 1)]
    return BucketTable(buckets, bucket_of, n_oversize, bucket_ids=bucket_ids, shard_offsets=off)

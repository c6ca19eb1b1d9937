"""Building a :class:`~lightning_adaptiveload.shards.compact.CompactIndex` straight from shards.

The scan is :meth:`ShardIndex.build <lightning_adaptiveload.shards.index.ShardIndex.build>`'s (one
checking pass per shard, threads or processes, a progress bar); each shard's record is appended to
growing columns as it arrives, so 100 million samples never exist as Python lists at once. The
cross-shard duplicate-key check compares 64-bit key hashes (a sort of ``n`` integers) and confirms each
collision on the keys themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload.shards.columnar import IndexColumns, decode_keys, shape_id_dtype
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    ShardError,
    ShardInfo,
    check_on_error,
    check_patch,
)
from lightning_adaptiveload.shards.indexing import iter_index_shards, report_skips
from lightning_adaptiveload.shards.paths import expand_paths

__all__ = ["build_compact"]


class _Columns:
    """Columns grown one shard at a time (a list of per-shard arrays, joined once at the end)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.sizes: list[int] = []
        self.counts: list[int] = []
        self.shape_ids: dict[tuple[int, ...], int] = {}
        self.ids: list[np.ndarray] = []
        self.texts: list[np.ndarray] = []
        self.key_lens: list[np.ndarray] = []
        self.blobs: list[bytes] = []
        self.hashes: list[np.ndarray] = []
        self.skipped: dict[int, list[dict[str, Any]]] = {}
        self.ignored: dict[int, dict[str, int]] = {}
        self.spans: list[np.ndarray] = []  # (n_i, 2) per shard, -1 rows for a shard without spans
        self.any_spans = False

    def add(self, info: ShardInfo) -> None:
        sid = len(self.paths)
        self.paths.append(info.path)
        self.sizes.append(info.num_bytes)
        self.counts.append(info.num_samples)
        get = self.shape_ids.get
        ids = []
        for shape in info.latent_shapes:
            shape = shape if type(shape) is tuple else tuple(shape)
            b = get(shape)
            if b is None:
                b = self.shape_ids.setdefault(tuple(int(x) for x in shape), len(self.shape_ids))
                self.shape_ids[shape] = b
            ids.append(b)
        self.ids.append(np.array(ids, dtype=np.int32))
        self.texts.append(np.array(info.text_lengths, dtype="<i4"))
        joined = "".join(info.keys)
        blob = joined.encode("utf-8")
        lens = map(len, info.keys) if len(blob) == len(joined) else (len(k.encode()) for k in info.keys)
        self.key_lens.append(np.fromiter(lens, dtype=np.int64, count=len(info.keys)))
        self.blobs.append(blob)
        # Python's str hash: stable within this process, which is all the duplicate check needs.
        self.hashes.append(np.fromiter(map(hash, info.keys), dtype=np.int64, count=len(info.keys)))
        if info.skipped:
            self.skipped[sid] = [dict(e) for e in info.skipped]
        if info.ignored:
            self.ignored[sid] = dict(info.ignored)
        if info.spans is not None:
            self.any_spans = True
            self.spans.append(np.asarray(info.spans, dtype="<i8").reshape(-1, 2))
        else:
            self.spans.append(np.full((info.num_samples, 2), -1, dtype="<i8"))

    def finish(self) -> tuple[IndexColumns, np.ndarray]:
        table = {v: k for k, v in self.shape_ids.items()}
        shapes = np.array([table[i] for i in range(len(table))], dtype="<i4").reshape(-1, 4)
        shard_offsets = np.zeros(len(self.counts) + 1, dtype="<i8")
        np.cumsum(self.counts, out=shard_offsets[1:])
        key_offsets = np.zeros(int(shard_offsets[-1]) + 1, dtype="<i8")
        np.cumsum(_cat(self.key_lens, np.int64), out=key_offsets[1:])
        cols = IndexColumns(
            paths=self.paths,
            shard_bytes=np.array(self.sizes, dtype="<i8"),
            shard_offsets=shard_offsets,
            shapes=shapes,
            shape_id=_cat(self.ids, np.int32).astype(shape_id_dtype(len(shapes))),
            text_len=_cat(self.texts, np.int32),
            key_offsets=key_offsets,
            key_blob=np.frombuffer(b"".join(self.blobs), dtype="|u1"),
            skipped=self.skipped,
            ignored=self.ignored,
            spans=np.concatenate(self.spans) if self.any_spans else None,
        )
        return cols, _cat(self.hashes, np.int64)


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def build_compact(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    progress: bool = True,
    *,
    patch_size: Sequence[int] | None = DEFAULT_PATCH,
    on_error: str = "raise",
    check_values: bool = True,
    num_workers: int = 1,
    processes: bool = False,
    max_member_bytes: int | None = None,
) -> CompactIndex:
    """Index shards into columns: what :meth:`ShardIndex.build` checks, without per-sample lists.

    Args:
        paths, progress, patch_size, on_error, check_values, num_workers, max_member_bytes: as for
            :meth:`ShardIndex.build <lightning_adaptiveload.shards.index.ShardIndex.build>`.
        processes: scan in ``num_workers`` processes (local shards) instead of threads (remote ones).

    Returns:
        The index (save it with :meth:`CompactIndex.save`); shard order is the order of ``paths``.

    Raises:
        ShardError: under ``on_error="raise"``, naming the shard, key and problem.
    """
    check_on_error(on_error)
    patch = check_patch(patch_size)
    grow = _Columns()
    for info in iter_index_shards(
        expand_paths(paths), patch, on_error, check_values, progress, num_workers, max_member_bytes, processes
    ):
        grow.add(info)
    cols, hashes = grow.finish()
    cols.patch_size, cols.values_checked = patch, check_values
    cols = _drop_cross_duplicates(cols, hashes, on_error)
    index = CompactIndex(cols)
    report_skips(index, on_error)  # type: ignore[arg-type] - it reads skipped() and counts()
    return index


def _drop_cross_duplicates(cols: IndexColumns, hashes: np.ndarray, on_error: str) -> IndexColumns:
    """Keys seen in an earlier shard: raise, or drop them and record ``duplicate_key`` (as the JSON path)."""
    if hashes.size < 2:
        return cols
    ordered = np.sort(hashes)
    twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    if twice.size == 0:
        return cols
    shard_of = np.repeat(np.arange(cols.num_shards), np.diff(cols.shard_offsets))
    owner: dict[str, int] = {}
    drop: dict[int, str] = {}  # sample position -> detail
    for pos in np.flatnonzero(np.isin(hashes, twice)).tolist():  # ascending: shard order, file order
        key = decode_keys(cols.key_blob, cols.key_offsets[pos : pos + 2])[0]
        sid = int(shard_of[pos])
        first = owner.setdefault(key, sid)
        if first != sid:
            detail = f"key {key!r} is also in shard {cols.paths[first]}"
            if on_error == "raise":
                raise ShardError(cols.paths[sid], key, detail, reason="duplicate_key")
            drop[pos] = detail
    if not drop:
        return cols
    for pos, detail in drop.items():
        sid = int(shard_of[pos])
        key = decode_keys(cols.key_blob, cols.key_offsets[pos : pos + 2])[0]
        cols.skipped.setdefault(sid, []).append({"key": key, "reason": "duplicate_key", "detail": detail})
    keep = np.ones(cols.num_samples, dtype=bool)
    keep[list(drop)] = False
    return _keep_samples(cols, keep, shard_of)


def _keep_samples(cols: IndexColumns, keep: np.ndarray, shard_of: np.ndarray) -> IndexColumns:
    """``cols`` with only the samples where ``keep``; shapes renumbered in order of first use."""
    lens = np.diff(cols.key_offsets)
    key_offsets = np.zeros(int(keep.sum()) + 1, dtype="<i8")
    np.cumsum(lens[keep], out=key_offsets[1:])
    shard_offsets = np.zeros(cols.num_shards + 1, dtype="<i8")
    np.cumsum(np.bincount(shard_of[keep], minlength=cols.num_shards), out=shard_offsets[1:])
    ids = cols.shape_id[keep].astype(np.int64)
    used, first = np.unique(ids, return_index=True)
    order = used[np.argsort(first)]  # old ids in order of first use
    renumber = np.zeros(len(cols.shapes), dtype=np.int64)
    renumber[order] = np.arange(len(order))
    cols.key_blob = cols.key_blob[np.repeat(keep, lens)]
    cols.key_offsets, cols.shard_offsets = key_offsets, shard_offsets
    cols.shapes = cols.shapes[order]
    cols.shape_id = renumber[ids].astype(shape_id_dtype(len(order)))
    cols.text_len = cols.text_len[keep]
    if cols.spans is not None:
        cols.spans = cols.spans[keep]
    return cols

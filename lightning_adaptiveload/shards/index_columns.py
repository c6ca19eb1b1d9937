"""Between the binary index's columns and the two index classes, so that neither class needs the other
to read or write the binary format: the checked paths of a loaded file, a shard's :class:`ShardInfo` from
the columns, the columns of a ``ShardIndex`` and their writing with relative paths.

:class:`~lightning_adaptiveload.shards.index.ShardIndex` (lists) and
:class:`~lightning_adaptiveload.shards.compact.CompactIndex` (arrays) both use these; the compact index
imports the list index (to convert to it), never the other way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload.shards.columnar import IndexColumns, columns_from_lists, write_columns
from lightning_adaptiveload.shards.format import ShardError, ShardInfo
from lightning_adaptiveload.shards.key_columns import check_keys, decode_keys
from lightning_adaptiveload.shards.paths import is_url
from lightning_adaptiveload.shards.spans import spans_or_none
from lightning_adaptiveload.shards.untrusted import Refused, check_index_path

__all__ = [
    "checked_keys",
    "columns_of",
    "index_root",
    "resolve_paths",
    "shard_info",
    "span_rows",
    "write_index",
]


def index_root(source: str) -> str:
    """The folder relative shard paths of the index at ``source`` resolve against."""
    if not is_url(source):
        return os.path.dirname(source)
    from lightning_adaptiveload.shards.untrusted import url_folder

    folder = url_folder(source)  # http(s), s3, gs, az: the index's folder
    return folder if folder is not None else os.getcwd()  # e.g. an index read through a pipe


_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(?:/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")


def resolve_paths(
    paths: list[str], source: str, allow_schemes: Collection[str], allow_outside: bool
) -> list[str]:
    """Shard paths as written -> absolute paths or URLs, each checked like an ``index.json`` entry's."""
    if "pipe" in {str(s).lower() for s in allow_schemes}:
        raise ValueError("allow_schemes cannot hold 'pipe': commands are never taken from an index")
    root = index_root(source)
    # A relative path of plain names (letters, digits, '.', '_', '-'; no name starting with '.', so no
    # '.' or '..'; no ':', so no scheme) under a local folder resolves to ``folder/path`` and stays inside
    # it: the result check_index_path gives, without its per-path parsing (100k shards: seconds).
    prefix = os.path.normpath(root) if not is_url(root) and os.path.isabs(root) else None
    if prefix is not None and prefix.startswith("//"):
        prefix = None  # POSIX keeps a leading '//': leave such a folder to the full check
    out = []
    for i, p in enumerate(paths):
        if prefix is not None and type(p) is str and _PLAIN.fullmatch(p):
            out.append(prefix + p if prefix.endswith("/") else f"{prefix}/{p}")
            continue
        try:
            out.append(check_index_path(p, root, allow_schemes=allow_schemes, allow_outside=allow_outside))
        except Refused as err:
            raise ShardError(
                source, None, str(err), reason=err.reason or "bad_index", member=f"shards[{i}].path"
            ) from None
    return out


def columns_of(index: Any) -> IndexColumns:
    """The columns of a ``ShardIndex`` (lossless: keys, shapes, text lengths, sizes, records)."""
    shards = index.shards
    cols = columns_from_lists(
        [s.path for s in shards],
        (s.keys for s in shards),
        (s.latent_shapes for s in shards),
        (s.text_lengths for s in shards),
    )
    cols.shard_bytes = np.array([s.num_bytes for s in shards], dtype="<i8")
    cols.skipped = {i: [dict(e) for e in s.skipped] for i, s in enumerate(shards) if s.skipped}
    cols.ignored = {i: dict(s.ignored) for i, s in enumerate(shards) if s.ignored}
    cols.patch_size = index.patch_size
    cols.values_checked = index.values_checked
    cols.metadata = dict(index.metadata)
    cols.spans = span_rows(shards)
    return cols


def span_rows(shards: Sequence[ShardInfo]) -> np.ndarray | None:
    """The ``(n, 2)`` spans column of the shards: ``-1`` rows for a shard without spans; None when no
    shard has any (the file is then written without the array, readable by older versions)."""
    if not any(s.spans is not None for s in shards):
        return None
    parts = [
        np.asarray(s.spans, dtype="<i8").reshape(-1, 2)
        if s.spans is not None
        else np.full((s.num_samples, 2), -1, dtype="<i8")
        for s in shards
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 2), dtype="<i8")


def write_index(
    columns: IndexColumns, path: str | os.PathLike, progress: Callable[[int], None] | None = None
) -> str:
    """Write the binary index atomically; shard paths under its folder are stored relative to it.

    Returns:
        The absolute path written.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    paths = []
    for p in columns.paths:
        if not is_url(p):
            rel = os.path.relpath(p, folder)
            if not rel.startswith(os.pardir):
                p = rel.replace(os.sep, "/")
        paths.append(p)
    cols = IndexColumns(**{**vars(columns), "paths": paths, "mapping": None})
    write_columns(path, cols, progress)
    return path


def checked_keys(c: IndexColumns, shard: int, source: str) -> list[str]:
    """One shard's keys, checked against the key rules, then decoded.

    Raises:
        ShardError: ``bad_index`` naming ``source`` and ``shards[<shard>].keys``.
    """
    a, b = int(c.shard_offsets[shard]), int(c.shard_offsets[shard + 1])
    off = c.key_offsets[a : b + 1]
    problem = check_keys(c.key_blob, off)
    if problem is not None:
        raise ShardError(
            source,
            None,
            f"shard {shard}: {problem}",
            reason="bad_index",
            member=f"shards[{shard}].keys",
        )
    return decode_keys(c.key_blob, off)


def shard_info(c: IndexColumns, shard: int, shape_tuples: Sequence[tuple], keys: list[str]) -> ShardInfo:
    """The :class:`ShardInfo` of shard ``shard`` (``0 <= shard < c.num_shards``) of the columns ``c``,
    with its ``keys`` (:func:`checked_keys`) and ``shape_tuples`` (the rows of ``c.shapes`` as tuples)."""
    a, b = int(c.shard_offsets[shard]), int(c.shard_offsets[shard + 1])
    return ShardInfo(
        path=c.paths[shard],
        keys=keys,
        latent_shapes=[shape_tuples[i] for i in c.shape_id[a:b].tolist()],  # type: ignore[misc]
        text_lengths=c.text_len[a:b].tolist(),
        num_bytes=int(c.shard_bytes[shard]),
        skipped=[dict(e) for e in c.skipped.get(shard, [])],
        ignored=dict(c.ignored.get(shard, {})),
        spans=None if c.spans is None else spans_or_none(c.spans[a:b]),
    )

"""The binary columnar index (``index.npidx``): the same content as ``index.json``, as flat arrays.

An index of 100 million samples as JSON takes minutes and tens of GiB to parse into Python lists on
every rank. This format stores each field as one little-endian array at an aligned offset, so a rank
maps the file (``mmap``, read-only) and reads its columns without a Python object per sample.

Layout (see ``docs/data_format.md``)::

    bytes 0-7    MAGIC  b"\\x89ALIDX\\r\\n"
    bytes 8-11   format version, uint32 LE (1)
    bytes 12-15  header length H, uint32 LE (at most MAX_HEADER_BYTES)
    bytes 16-    header: UTF-8 JSON object (counts, patch size, values_checked, unique_keys, metadata and the
                 table of arrays: name, dtype, offset, count)
    then         the arrays, each at an offset that is a multiple of ALIGN

The arrays (``n``: samples, ``m``: shards, ``u``: distinct latent shapes):

==================  =========  ========  =================================================
name                dtype      count     meaning
==================  =========  ========  =================================================
``path_offsets``    ``<i8``    m + 1     shard path ``i`` is ``path_blob[off[i]:off[i+1]]``
``path_blob``       ``u1``     ...       shard paths, UTF-8, as written in the index
``shard_bytes``     ``<i8``    m         each shard file's size (-1: unknown)
``shard_offsets``   ``<i8``    m + 1     shard ``i`` holds samples ``off[i]:off[i+1]``
``shapes``          ``<i4``    4u        distinct latent shapes (C, T, H, W), in order of first use
``shape_id``        u1/u2/i4   n         each sample's row of ``shapes`` (u1 when u <= 256, ...)
``text_len``        ``<i4``    n         each sample's text length L (0: no text)
``key_offsets``     ``<i8``    n + 1     sample key ``i`` is ``key_blob[off[i]:off[i+1]]``
``key_blob``        ``u1``     ...       sample keys, UTF-8, concatenated
``extras``          ``u1``     ...       JSON: per shard its ``skipped`` and ``ignored`` records
``spans``           ``<i8``    2n        optional: each sample's (offset, length) in its tar
==================  =========  ========  =================================================

Everything is checked on load as the JSON loader checks its fields (a hostile file cannot index out of
range or allocate beyond its own size); every key is listed once (across and within shards, as in
``index.json``); sample keys follow the writer's key rules, checked per shard when a shard's keys are
first read (:func:`check_keys`).

A file replaced while a job uses it. Rewriting a mapped file in place (``cp new old``) would change the
checked arrays under the job, and truncating it kills the process with SIGBUS at the next access. So an
index of at most :data:`MAX_COPIED_INDEX_BYTES` is read into private memory once (checked there, its
BLAKE2b digest kept for the DataLoader workers that load it again); only a larger one is mapped, and a
mapped index must be replaced by renaming a new file over it (as :func:`write_columns` does), never
rewritten in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.shards.format import REASONS, ShardError
from lightning_adaptiveload.shards.index_file import MAX_DIM, IndexProblem, describe
from lightning_adaptiveload.shards.key_columns import (
    UNIQUE_KEYS,
    check_keys,
    decode_keys,
    duplicate_key,
    key_hashes,
    keys_crc,
    unique_keys_record,
)
from lightning_adaptiveload.shards.spans import span_columns_problem
from lightning_adaptiveload.shards.untrusted import Refused, load_json

log = logging.getLogger(__name__)

__all__ = [
    "ALIGN",
    "BINARY_INDEX_NAME",
    "BINARY_VERSION",
    "IndexColumns",
    "MAGIC",
    "MAX_COPIED_INDEX_BYTES",
    "MAX_HEADER_BYTES",
    "check_keys",
    "duplicate_key",
    "key_hashes",
    "refuse_duplicate_keys",
    "is_binary_index",
    "read_columns",
    "shape_id_dtype",
    "write_columns",
]

MAGIC = b"\x89ALIDX\r\n"  # a high byte and CRLF: a text-mode copy or 7-bit transfer breaks it visibly
BINARY_VERSION = 1
BINARY_INDEX_NAME = "index.npidx"
ALIGN = 64
MAX_HEADER_BYTES = 1 << 24  # counts, metadata and the array table; real headers are a few KiB
# Indexes up to this size are read into private memory (a rewrite of the file cannot reach them); larger
# ones are mapped (shared page cache). ~27 bytes a sample: 1 GiB is ~40 million samples. Settable.
MAX_COPIED_INDEX_BYTES = 1 << 30
_PREFIX = struct.Struct("<8sII")
_CHUNK = 1 << 22  # samples per step of a chunked check: bounds the temporaries to a few tens of MiB

# name -> allowed dtypes; the count each must have is checked in _check
_DTYPES: dict[str, tuple[str, ...]] = {
    "path_offsets": ("<i8",),
    "path_blob": ("|u1",),
    "shard_bytes": ("<i8",),
    "shard_offsets": ("<i8",),
    "shapes": ("<i4",),
    "shape_id": ("|u1", "<u2", "<i4"),
    "text_len": ("<i4",),
    "key_offsets": ("<i8",),
    "key_blob": ("|u1",),
    "extras": ("|u1",),
    "spans": ("<i8",),
}
_OPTIONAL = frozenset({"spans"})  # absent from older files, and from indexes without spans (older readers)


def shape_id_dtype(num_shapes: int) -> np.dtype:
    """The smallest dtype the per-sample shape ids use for ``num_shapes`` distinct shapes."""
    if num_shapes <= 1 << 8:
        return np.dtype("|u1")
    if num_shapes <= 1 << 16:
        return np.dtype("<u2")
    return np.dtype("<i4")


@dataclass
class IndexColumns:
    """An index as arrays (the content of ``index.npidx``); see the module docstring for each field.

    Attributes:
        paths: shard paths as written (relative paths are resolved by the loader, not here).
        shard_bytes: (m,) int64 file sizes, -1 when unknown.
        shard_offsets: (m + 1,) int64 sample offsets of the shards.
        shapes: (u, 4) int32 distinct latent shapes (C, T, H, W) in order of first use.
        shape_id: (n,) uint8/uint16/int32 row of ``shapes`` per sample.
        text_len: (n,) int32 text lengths.
        key_offsets: (n + 1,) int64 byte offsets of the keys in ``key_blob``.
        key_blob: (k,) uint8 UTF-8 keys, concatenated.
        skipped: shard id -> its skipped records (only shards that have some).
        ignored: shard id -> its ignored-member counts (only shards that have some).
        patch_size, values_checked, metadata: as in ``ShardIndex``.
    """

    paths: list[str]
    shard_bytes: np.ndarray
    shard_offsets: np.ndarray
    shapes: np.ndarray
    shape_id: np.ndarray
    text_len: np.ndarray
    key_offsets: np.ndarray
    key_blob: np.ndarray
    skipped: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    ignored: dict[int, dict[str, int]] = field(default_factory=dict)
    patch_size: tuple[int, int, int] | None = None
    values_checked: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)  # the file, when mapped
    digest: str | None = field(default=None, repr=False, compare=False)  # BLAKE2b of a copied file
    unique_keys: dict[str, int] | None = field(
        default=None, repr=False, compare=False
    )  # as read: UNIQUE_KEYS
    spans: np.ndarray | None = None  # (n, 2) int64 (offset, length) per sample, -1 rows: none; or None

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "mapping": None}  # an mmap does not pickle; the arrays are copied

    def release_pages(self) -> None:
        """Drop the mapped file's pages from this process's resident set (``MADV_DONTNEED``).

        A full pass (the checks, the fingerprint) faults every page of the arrays it reads into the
        process; they stay in the page cache (shared by all ranks of the node) and come back on the
        next access as cheap minor faults. A no-op when the index is not a mapped file.
        """
        _release(self.mapping)

    @property
    def num_samples(self) -> int:
        return int(self.shard_offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.paths)

    def keys_of(self, shard: int) -> list[str]:
        """The keys of one shard, decoded and checked against the key rules."""
        a, b = int(self.shard_offsets[shard]), int(self.shard_offsets[shard + 1])
        return decode_keys(self.key_blob, self.key_offsets[a : b + 1])


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------


def _arrays(cols: IndexColumns) -> list[tuple[str, np.ndarray]]:
    path_bytes = [p.encode("utf-8") for p in cols.paths]
    path_offsets = np.zeros(len(path_bytes) + 1, dtype="<i8")
    np.cumsum([len(b) for b in path_bytes], out=path_offsets[1:])
    extras = {
        "skipped": {str(k): v for k, v in sorted(cols.skipped.items()) if v},
        "ignored": {str(k): v for k, v in sorted(cols.ignored.items()) if v},
    }
    sid = np.asarray(cols.shape_id).astype(shape_id_dtype(len(cols.shapes)), copy=False)
    return [
        ("path_offsets", path_offsets),
        ("path_blob", np.frombuffer(b"".join(path_bytes), dtype="|u1")),
        ("shard_bytes", np.asarray(cols.shard_bytes, dtype="<i8")),
        ("shard_offsets", np.asarray(cols.shard_offsets, dtype="<i8")),
        ("shapes", np.asarray(cols.shapes, dtype="<i4").reshape(-1)),
        ("shape_id", sid),
        ("text_len", np.asarray(cols.text_len, dtype="<i4")),
        ("key_offsets", np.asarray(cols.key_offsets, dtype="<i8")),
        ("key_blob", np.asarray(cols.key_blob, dtype="|u1")),
        ("extras", np.frombuffer(json.dumps(extras, separators=(",", ":")).encode(), dtype="|u1")),
    ] + ([] if cols.spans is None else [("spans", np.asarray(cols.spans, dtype="<i8").reshape(-1))])


def write_columns(
    path: str | os.PathLike, cols: IndexColumns, progress: Callable[[int], None] | None = None
) -> str:
    """Write ``cols`` as a binary index, atomically (temp file + rename).

    Args:
        path: the file to write (``index.npidx`` by convention; the format is told by its magic bytes).
        cols: the columns; their shard paths are written as given.
        progress: called with the bytes written after each piece (for a progress bar), or None.

    Returns:
        The absolute path written.
    """
    path = os.path.abspath(os.fspath(path))
    arrays = _arrays(cols)
    table, offset = [], 0
    for name, arr in arrays:
        table.append([name, arr.dtype.str, offset, int(arr.size)])
        offset += -(-arr.nbytes // ALIGN) * ALIGN
    header = {
        "num_shards": cols.num_shards,
        "num_samples": cols.num_samples,
        "num_shapes": int(len(cols.shapes)),
        "patch_size": None if cols.patch_size is None else [int(p) for p in cols.patch_size],
        "values_checked": bool(cols.values_checked),
        "metadata": cols.metadata,
        "arrays": table,
    }
    record = unique_keys_record(cols.key_blob, cols.key_offsets)  # searched here, once, not at every load
    if record is not None:
        header[UNIQUE_KEYS] = record
    # Offsets in the header are absolute, so the header's length depends on them: grow the data start
    # until the header fits before it (a few rounds at most: only digits change), then pad it with
    # spaces (valid JSON) to end exactly there.
    data_start = 0
    while True:
        rows = [[name, dtype, off + data_start, count] for name, dtype, off, count in table]
        head = json.dumps({**header, "arrays": rows}, separators=(",", ":")).encode("utf-8")
        need = -(-(_PREFIX.size + len(head)) // ALIGN) * ALIGN
        if need - _PREFIX.size > MAX_HEADER_BYTES:
            raise ValueError(
                f"the index header is {len(head)} bytes (metadata too large); at most {MAX_HEADER_BYTES}"
            )
        if need <= data_start:
            break
        data_start = need
    head += b" " * (data_start - _PREFIX.size - len(head))
    table = rows
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, BINARY_VERSION, len(head)))
            f.write(head)
            for (_name, arr), row in zip(arrays, table):
                f.write(b"\0" * (row[2] - f.tell()))
                step = max(1, (64 << 20) // max(arr.itemsize, 1))  # 64 MiB writes: no full-size copy
                for i in range(0, arr.size, step):
                    f.write(np.ascontiguousarray(arr[i : i + step]).tobytes())
                    if progress is not None:
                        progress(f.tell())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------


def is_binary_index(path: str | os.PathLike) -> bool:
    """True when the local file starts with :data:`MAGIC` (False for JSON, missing or unreadable files,
    and anything but a regular file: a FIFO would block the read)."""
    from lightning_adaptiveload.shards.paths import open_regular

    try:
        with open_regular(os.fspath(path)) as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_columns(source: str, data: bytes | np.ndarray | None = None) -> IndexColumns:
    """Read (or take) a binary index and check every field (keys unique: :func:`refuse_duplicate_keys`).

    Args:
        source: the file, named in errors; read into private memory when ``data`` is None (mapped
            read-only when larger than :data:`MAX_COPIED_INDEX_BYTES`; see the module docstring).
        data: the file's bytes when already read (a remote index), else None.

    Raises:
        ShardError: ``bad_index`` naming ``source``, the field and the value.
    """
    from lightning_adaptiveload.shards.paths import open_regular

    try:
        mapping = None
        digest = None
        if data is None:
            with open_regular(source) as f:
                size = os.fstat(f.fileno()).st_size
                if size < _PREFIX.size:
                    raise IndexProblem("magic", f"the file is {size} bytes, too short for a binary index")
                if size <= MAX_COPIED_INDEX_BYTES:
                    copy = bytearray(size)
                    got = f.readinto(copy)
                    if got != size:
                        raise IndexProblem(
                            "magic", f"the file shrank while it was read ({got} of {size} bytes)"
                        )
                    digest = hashlib.blake2b(copy, digest_size=16).hexdigest()
                    buf = np.frombuffer(memoryview(copy).toreadonly(), dtype="|u1")
                else:
                    log.warning(
                        "index %s is %d bytes, more than MAX_COPIED_INDEX_BYTES=%d: mapped, not copied; replace it "
                        "only by renaming a new file over it, never by rewriting it in place",
                        source,
                        size,
                        MAX_COPIED_INDEX_BYTES,
                    )
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    buf = np.frombuffer(mapping, dtype="|u1")
        else:
            buf = np.frombuffer(data, dtype="|u1") if isinstance(data, bytes | bytearray) else data
        cols = _check(buf, lambda: _release(mapping))
        cols.mapping, cols.digest = mapping, digest
        cols.release_pages()
    except IndexProblem as err:
        raise ShardError(source, None, err.detail, reason=err.reason, member=err.where) from None
    return cols


def refuse_duplicate_keys(cols: IndexColumns, source: str) -> None:
    """Raise ``duplicate_key`` (naming the key, both shards and ``source``) if a key is listed twice.

    Run by every loader once the shard paths are resolved (so that the message names them as opened).
    Skips the search when the header records it done by the writer (``unique_keys``) for this key column
    (same count, length and CRC-32); an index without the record, or whose keys changed, is searched.
    """
    record = cols.unique_keys
    if (
        record is not None
        and record["keys"] == len(cols.key_offsets) - 1
        and record["key_bytes"] == len(cols.key_blob)
        and record["crc32"] == keys_crc(cols.key_blob, cols.key_offsets, cols.release_pages)
    ):
        cols.release_pages()
        return
    twice = duplicate_key(cols.key_blob, cols.key_offsets, cols.release_pages)
    cols.release_pages()
    if twice is None:
        return
    first, later = twice
    s1, s2 = (int(np.searchsorted(cols.shard_offsets, p, side="right")) - 1 for p in twice)
    key = cols.key_blob[int(cols.key_offsets[later]) : int(cols.key_offsets[later + 1])].tobytes()
    name = key.decode("utf-8", "backslashreplace")
    i1, i2 = first - int(cols.shard_offsets[s1]), later - int(cols.shard_offsets[s2])
    if s1 == s2:
        where = f"twice in this shard (shards[{s2}].keys[{i1}] and [{i2}])"
    else:
        where = f"also in shard {cols.paths[s1]} (shards[{s1}].keys[{i1}] and shards[{s2}].keys[{i2}])"
    raise ShardError(
        cols.paths[s2],
        name,
        f"key {name!r} is listed {where} by the index {source}; an index lists every key once",
        reason="duplicate_key",
        hint="rebuild the index from the shards (`lightning-adaptiveload index <shards> --rebuild`); keys must be "
        "unique in a data set",
    )


def _header(buf: np.ndarray) -> tuple[dict[str, Any], int]:
    if len(buf) < _PREFIX.size:
        raise IndexProblem("magic", f"the file is {len(buf)} bytes, too short for a binary index")
    magic, version, head_len = _PREFIX.unpack(buf[: _PREFIX.size].tobytes())
    if magic != MAGIC:
        raise IndexProblem("magic", f"starts with {magic!r}, not {MAGIC!r}: not a binary index")
    if version != BINARY_VERSION:
        raise IndexProblem("version", f"version {version} is not supported (expected {BINARY_VERSION})")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(buf):
        raise IndexProblem("header", f"header length {head_len} exceeds the file or {MAX_HEADER_BYTES} bytes")
    try:
        head = load_json(buf[_PREFIX.size : _PREFIX.size + head_len].tobytes(), finite=False)
    except Refused as err:
        raise IndexProblem("header", f"not valid JSON: the header {err}") from None
    if not isinstance(head, dict):
        raise IndexProblem("header", f"must be an object, got {describe(head)}")
    return head, -(-(_PREFIX.size + head_len) // ALIGN) * ALIGN


def _count(head: dict[str, Any], name: str, hi: int) -> int:
    v = head.get(name)
    if type(v) is not int or not 0 <= v <= hi:
        raise IndexProblem(name, f"is {describe(v)}; expected an integer in [0, {hi}]")
    return v


def _table(head: dict[str, Any], buf: np.ndarray, data_start: int) -> dict[str, np.ndarray]:
    rows = head.get("arrays")
    if not isinstance(rows, list):
        raise IndexProblem("arrays", f"must be a list, got {describe(rows)}")
    out: dict[str, np.ndarray] = {}
    for j, row in enumerate(rows):
        where = f"arrays[{j}]"
        if not (isinstance(row, list) and len(row) == 4 and all(type(v) is int for v in row[2:])):
            raise IndexProblem(where, f"must be [name, dtype, offset, count], got {describe(row)}")
        name, dtype, offset, count = row
        if not isinstance(name, str) or name not in _DTYPES or name in out:
            raise IndexProblem(where, f"names {describe(name)}: unknown or repeated array")
        if dtype not in _DTYPES[name]:
            raise IndexProblem(
                f"{name}.dtype", f"is {describe(dtype)}; expected one of {list(_DTYPES[name])}"
            )
        dt = np.dtype(dtype)
        if offset % ALIGN or offset < data_start or count < 0 or offset + count * dt.itemsize > len(buf):
            raise IndexProblem(
                f"{name}.offset",
                f"offset {offset} and count {count} do not fit the file ({len(buf)} bytes, data from "
                f"{data_start}, aligned to {ALIGN})",
            )
        out[name] = buf[offset : offset + count * dt.itemsize].view(dt)
    missing = sorted(set(_DTYPES) - set(out) - _OPTIONAL)
    if missing:
        raise IndexProblem("arrays", f"lacks {missing}")
    return out


def _check_offsets(
    name: str,
    off: np.ndarray,
    count: int,
    end: int,
    strict: bool = False,
    release: Callable[[], None] = lambda: None,
) -> None:
    """``off`` has ``count`` entries, starts at 0, ends at ``end`` and never decreases (rises, if strict);
    ``release`` after each step (100M key offsets are 800 MB of mapped pages)."""
    if len(off) != count:
        raise IndexProblem(name, f"has {len(off)} entries, expected {count}")
    if off[0] != 0 or off[-1] != end:
        raise IndexProblem(name, f"runs from {int(off[0])} to {int(off[-1])}, expected 0 to {end}")
    step = 1 if strict else 0
    for i in range(0, len(off) - 1, _CHUNK):
        part = off[i : i + _CHUNK + 1]
        d = np.diff(part)
        if d.size and d.min() < step:
            k = i + int(np.argmin(d))
            raise IndexProblem(
                f"{name}[{k + 1}]", f"is {int(off[k + 1])} after {int(off[k])}: offsets must rise"
            )
        release()


def _check_shape_ids(sid: np.ndarray, n_shapes: int) -> None:
    """Ids in range, every shape used, numbered in order of first use: id 0 first, then each id at most
    one above the largest before it (so one data set has one numbering, and one fingerprint)."""
    if sid.size == 0:
        if n_shapes:
            raise IndexProblem("shapes", f"lists {n_shapes} shapes for no sample")
        return
    top = -1
    for i in range(0, sid.size, _CHUNK):
        part = sid[i : i + _CHUNK].astype(np.int64)
        if part.min() < 0 or part.max() >= n_shapes:
            k = i + int(np.argmax((part < 0) | (part >= n_shapes)))
            raise IndexProblem(f"shape_id[{k}]", f"is {int(sid[k])}, not in [0, {n_shapes})")
        prev = np.maximum.accumulate(np.concatenate(([top], part)))[:-1]
        jump = part > prev + 1
        if jump.any():
            k = i + int(np.argmax(jump))
            raise IndexProblem(
                f"shape_id[{k}]", f"is {int(sid[k])}: shapes must be numbered in order of first use"
            )
        top = max(top, int(part.max()))
    if top != n_shapes - 1:
        raise IndexProblem("shapes", f"lists {n_shapes} shapes but samples use {top + 1}")


def _release(mapping: mmap.mmap | None) -> None:
    if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def _check(buf: np.ndarray, release: Callable[[], None] = lambda: None) -> IndexColumns:
    """Every field of the file in ``buf``; ``release`` after each pass over a large array keeps the
    pages it faulted in from piling up (peak resident: the largest array, not all of them)."""
    head, data_start = _header(buf)
    m = _count(head, "num_shards", 1 << 40)
    n = _count(head, "num_samples", 1 << 40)
    u = _count(head, "num_shapes", 1 << 31)
    arr = _table(head, buf, data_start)
    patch = head.get("patch_size")
    if patch is not None and not (
        isinstance(patch, list)
        and len(patch) == 3
        and all(type(p) is int and 1 <= p <= MAX_DIM for p in patch)
    ):
        raise IndexProblem(
            "patch_size", f"must be 3 integers in [1, {MAX_DIM}] or null, got {describe(patch)}"
        )
    if not isinstance(head.get("values_checked", False), bool):
        raise IndexProblem("values_checked", f"must be true or false, got {describe(head['values_checked'])}")
    metadata = head.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise IndexProblem("metadata", f"must be an object, got {describe(metadata)}")
    record = head.get(UNIQUE_KEYS)
    if record is not None and not (
        isinstance(record, dict)
        and sorted(record) == ["crc32", "key_bytes", "keys"]
        and all(type(v) is int and v >= 0 for v in record.values())
    ):
        raise IndexProblem(
            UNIQUE_KEYS,
            f'must be {{"keys", "key_bytes", "crc32"}} as integers >= 0 or absent, got {describe(record)}',
        )
    _check_offsets("path_offsets", arr["path_offsets"], m + 1, len(arr["path_blob"]))
    _check_offsets("shard_offsets", arr["shard_offsets"], m + 1, n)
    _check_offsets(
        "key_offsets", arr["key_offsets"], n + 1, len(arr["key_blob"]), strict=True, release=release
    )
    release()
    if len(arr["shard_bytes"]) != m or (m and arr["shard_bytes"].min() < -1):
        raise IndexProblem("shard_bytes", f"must hold {m} sizes >= -1")
    if len(arr["shapes"]) != 4 * u:
        raise IndexProblem("shapes", f"has {len(arr['shapes'])} values, expected 4 x {u}")
    shapes = arr["shapes"].reshape(u, 4)
    if u and shapes.min() < 1:
        r = int(np.argmin(shapes.min(axis=1)))
        raise IndexProblem(f"shapes[{r}]", f"is {shapes[r].tolist()}; dimensions must be in [1, {MAX_DIM}]")
    if len({tuple(r) for r in shapes.tolist()}) != u:
        raise IndexProblem("shapes", "lists a shape twice")
    if len(arr["shape_id"]) != n or len(arr["text_len"]) != n:
        raise IndexProblem("shape_id", f"shape_id and text_len must hold {n} entries")
    if arr["shape_id"].dtype != shape_id_dtype(u):
        raise IndexProblem(
            "shape_id.dtype", f"is {arr['shape_id'].dtype.str}; {u} shapes use {shape_id_dtype(u).str}"
        )
    _check_shape_ids(arr["shape_id"], u)
    release()
    for i in range(0, n, _CHUNK):
        part = arr["text_len"][i : i + _CHUNK]
        if part.min() < 0:
            k = i + int(np.argmin(part))
            raise IndexProblem(f"text_len[{k}]", f"is {int(part.min())}; expected [0, {MAX_DIM}]")
    if (spans := arr.get("spans")) is not None:
        if (problem := span_columns_problem(spans, arr["shard_offsets"], arr["shard_bytes"])) is not None:
            raise IndexProblem(*problem)
        spans = spans.reshape(n, 2)
    paths = _paths(arr["path_blob"], arr["path_offsets"])
    skipped, ignored = _extras(arr["extras"], m)
    return IndexColumns(
        paths=paths,
        shard_bytes=arr["shard_bytes"],
        shard_offsets=arr["shard_offsets"],
        shapes=shapes,
        shape_id=arr["shape_id"],
        text_len=arr["text_len"],
        key_offsets=arr["key_offsets"],
        key_blob=arr["key_blob"],
        skipped=skipped,
        ignored=ignored,
        patch_size=None if patch is None else tuple(patch),  # type: ignore[arg-type]
        values_checked=head.get("values_checked", False),
        metadata=dict(metadata),
        unique_keys=record,
        spans=spans,
    )


def _paths(blob: np.ndarray, off: np.ndarray) -> list[str]:
    raw = blob.tobytes()
    bounds = off.tolist()
    out = []
    for i in range(len(bounds) - 1):
        try:
            out.append(raw[bounds[i] : bounds[i + 1]].decode("utf-8"))
        except UnicodeDecodeError:
            raise IndexProblem(f"shards[{i}].path", "is not valid UTF-8") from None
    return out


def _extras(blob: np.ndarray, m: int) -> tuple[dict[int, list[dict[str, Any]]], dict[int, dict[str, int]]]:
    try:
        extras = load_json(blob.tobytes(), finite=False)
    except Refused as err:
        raise IndexProblem("extras", f"not valid JSON: {err}") from None
    if not isinstance(extras, dict):
        raise IndexProblem("extras", f"must be an object, got {describe(extras)}")
    skipped, ignored = {}, {}
    for name, out in (("skipped", skipped), ("ignored", ignored)):
        table = extras.get(name, {})
        if not isinstance(table, dict):
            raise IndexProblem(f"extras.{name}", f"must be an object, got {describe(table)}")
        for k, v in table.items():
            if not (k.isascii() and k.isdigit() and int(k) < m):
                raise IndexProblem(f"extras.{name}", f"names shard {k!r}, not one of the {m} shards")
            where = f"shards[{k}].{name}"
            if name == "skipped":
                if not isinstance(v, list) or not all(_skip_record(e) for e in v):
                    raise IndexProblem(
                        where, f"must be a list of {{'key', 'reason', 'detail'}}, got {describe(v)}"
                    )
                out[int(k)] = [dict(e) for e in v]
            else:
                if not isinstance(v, dict) or not all(type(c) is int and c >= 0 for c in v.values()):
                    raise IndexProblem(where, f"must map reasons to counts, got {describe(v)}")
                out[int(k)] = dict(v)
    return skipped, ignored


def _skip_record(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and (e.get("key") is None or isinstance(e.get("key"), str))
        and e.get("reason") in REASONS
        and isinstance(e.get("detail", ""), str)
    )


# ----------------------------------------------------------------------------------------------------
# From per-shard lists
# ----------------------------------------------------------------------------------------------------


def columns_from_lists(
    paths: Sequence[str],
    keys: Iterable[Sequence[str]],
    shapes: Iterable[Sequence[Sequence[int]]],
    text_lengths: Iterable[Sequence[int]] | None = None,
) -> IndexColumns:
    """Columns of per-shard lists (the ``ShardInfo`` fields); shapes numbered in order of first use."""
    shape_ids: dict[tuple[int, ...], int] = {}
    counts, key_lens, ids, blobs, texts = [], [], [], [], []
    text_iter = iter(text_lengths) if text_lengths is not None else None
    for ks, ss in zip(keys, shapes):
        counts.append(len(ks))
        row = []
        for s in ss:
            t = s if type(s) is tuple else tuple(s)
            b = shape_ids.get(t)
            if b is None:
                b = shape_ids.setdefault(tuple(int(x) for x in t), len(shape_ids))
                shape_ids[t] = b
            row.append(b)
        ids.append(row)
        joined = "".join(ks)
        blob = joined.encode("utf-8")
        blobs.append(blob)
        key_lens.append(list(map(len, ks)) if len(blob) == len(joined) else [len(k.encode()) for k in ks])
        texts.append(next(text_iter) if text_iter is not None else [0] * len(ks))
    uniq = {v: k for k, v in shape_ids.items()}  # id -> one of its tuples (ints)
    table = np.array([uniq[i] for i in range(len(uniq))], dtype="<i4").reshape(-1, 4)
    shard_offsets = np.zeros(len(counts) + 1, dtype="<i8")
    np.cumsum(counts, out=shard_offsets[1:])
    key_offsets = np.zeros(int(shard_offsets[-1]) + 1, dtype="<i8")
    np.cumsum(
        np.fromiter((x for r in key_lens for x in r), dtype=np.int64, count=len(key_offsets) - 1),
        out=key_offsets[1:],
    )
    return IndexColumns(
        paths=list(paths),
        shard_bytes=np.full(len(counts), -1, dtype="<i8"),
        shard_offsets=shard_offsets,
        shapes=table,
        shape_id=np.fromiter(
            (x for r in ids for x in r), dtype=shape_id_dtype(len(table)), count=len(key_offsets) - 1
        ),
        text_len=np.fromiter((x for r in texts for x in r), dtype="<i4", count=len(key_offsets) - 1),
        key_offsets=key_offsets,
        key_blob=np.frombuffer(b"".join(blobs), dtype="|u1"),
    )

"""``CompactIndex``: the shard index as columns (see :mod:`~lightning_adaptiveload.shards.columnar`).

It answers what the rest of the package asks of a :class:`~lightning_adaptiveload.shards.index.ShardIndex`
(``num_samples``, ``paths``, ``shards[i]``, ``latent_shape(ref)``, ``counts()``, ``save``) without a
Python object per sample: ``shards[i]`` builds that one shard's :class:`ShardInfo` when asked, and the
planner reads the arrays (:attr:`shape_table`, :attr:`shape_ids`, :attr:`shard_offsets`) directly.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload.shards import untrusted
from lightning_adaptiveload.shards.columnar import (
    MAGIC,
    IndexColumns,
    check_keys,
    decode_keys,
    is_binary_index,
    read_columns,
    refuse_duplicate_keys,
)
from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    PatchSize,
    ShardError,
    ShardInfo,
    check_on_error,
    check_patch,
    divisibility_problem,
)
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.index_columns import (
    checked_keys,
    columns_of,
    resolve_paths,
    shard_info,
    write_index,
)
from lightning_adaptiveload.shards.index_file import read_index_bytes
from lightning_adaptiveload.shards.paths import is_url, norm_path

__all__ = ["CompactIndex", "load_checked_compact", "load_index"]

log = logging.getLogger(__name__)


class _Shards(Sequence):
    """``index.shards``: each item a fresh :class:`ShardInfo` of that shard (keys decoded and checked)."""

    def __init__(self, index: CompactIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return self._index.num_shards

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._index.shard_info(i)


class CompactIndex:
    """A shard index held as arrays; read-only.

    Args:
        columns: the index's columns, shard paths already resolved (absolute paths or URLs).
        source: the file it was loaded from, or None.

    Attributes:
        patch_size, values_checked, metadata, source: as in ``ShardIndex``.
    """

    def __init__(self, columns: IndexColumns, source: str | None = None) -> None:
        self.columns = columns
        self.patch_size: PatchSize | None = columns.patch_size
        self.values_checked = columns.values_checked
        self.metadata = columns.metadata
        self.source = source
        self._shape_tuples = [tuple(r) for r in columns.shapes.tolist()]
        self._keys_checked = np.zeros(columns.num_shards, dtype=bool)
        self._file_id: tuple[int, int] | None = None  # (size, mtime_ns) of the mapped file

    def __reduce__(self):
        # A DataLoader worker started by spawn gets the index pickled: read (or map) the same file there
        # rather than copy every array through the pipe; it must be the same file (same BLAKE2b digest
        # for a copied index; same size and time for a mapped one).
        if self._file_id is not None and self.source is not None:
            return (_remap, (self.source, self.columns.paths, self._file_id, self.columns.digest))
        return (CompactIndex, (self.columns, self.source))

    # -- what ShardIndex offers ---------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self.columns.num_samples

    @property
    def num_shards(self) -> int:
        return self.columns.num_shards

    @property
    def paths(self) -> list[str]:
        return list(self.columns.paths)

    @property
    def shards(self) -> Sequence[ShardInfo]:
        """Per shard a :class:`ShardInfo`, built on access (for reading a shard, not for whole-index loops)."""
        return _Shards(self)

    def shard_info(self, shard: int) -> ShardInfo:
        """The :class:`ShardInfo` of one shard (its keys decoded and checked against the key rules)."""
        c = self.columns
        if not -c.num_shards <= shard < c.num_shards:
            raise IndexError(f"shard {shard} out of range ({c.num_shards} shards)")
        shard %= max(c.num_shards, 1)
        return shard_info(c, shard, self._shape_tuples, self._keys(shard))

    def _keys(self, shard: int) -> list[str]:
        c = self.columns
        if not self._keys_checked[shard]:
            keys = checked_keys(c, shard, self.source or "<columns>")
            self._keys_checked[shard] = True
            return keys
        a, b = int(c.shard_offsets[shard]), int(c.shard_offsets[shard + 1])
        return decode_keys(c.key_blob, c.key_offsets[a : b + 1])

    def key(self, ref: tuple[int, int]) -> str:
        """The key of the sample ``ref = (shard_id, sample_id)``."""
        shard, i = ref
        c = self.columns
        a, b = int(c.shard_offsets[shard]), int(c.shard_offsets[shard + 1])
        if not 0 <= i < b - a:
            raise IndexError(f"sample {i} out of range (shard {shard} has {b - a})")
        off = c.key_offsets[a + i : a + i + 2]
        problem = check_keys(c.key_blob, off)
        if problem is not None:
            raise ShardError(
                self.source or "<columns>",
                None,
                problem,
                reason="bad_index",
                member=f"shards[{shard}].keys[{i}]",
            )
        return decode_keys(c.key_blob, off)[0]

    def latent_shape(self, ref: tuple[int, int]) -> tuple[int, int, int, int]:
        """The latent shape (C, T, H, W) of the sample ``ref = (shard_id, sample_id)``."""
        shard, i = ref
        a, b = int(self.columns.shard_offsets[shard]), int(self.columns.shard_offsets[shard + 1])
        if not 0 <= i < b - a:
            raise IndexError(f"sample {i} out of range (shard {shard} has {b - a})")
        return self._shape_tuples[int(self.columns.shape_id[a + i])]  # type: ignore[return-value]

    def sample_refs(self) -> list[tuple[int, int]]:
        """All sample references ``(shard_id, sample_id)`` in index order (a list: small indexes only)."""
        off = self.columns.shard_offsets.tolist()
        return [(s, j) for s in range(self.num_shards) for j in range(off[s + 1] - off[s])]

    def first_use(self, row: int) -> tuple[int, int]:
        """The ref ``(shard_id, sample_id)`` of the first sample of shape ``shape_table[row]``."""
        ids = self.columns.shape_id
        for i in range(0, len(ids), 1 << 22):  # shapes appear early: the first chunk nearly always has it
            hit = np.flatnonzero(ids[i : i + (1 << 22)] == row)
            if hit.size:
                pos = i + int(hit[0])
                shard = int(np.searchsorted(self.columns.shard_offsets, pos, side="right")) - 1
                return shard, pos - int(self.columns.shard_offsets[shard])
        raise ValueError(f"shape row {row} is used by no sample")

    def shape_counts(self) -> np.ndarray:
        """(u,) int64: samples per row of :attr:`shape_table`."""
        return np.bincount(self.columns.shape_id, minlength=len(self._shape_tuples)).astype(np.int64)

    def total_tokens(self, patch_size: Sequence[int] = DEFAULT_PATCH) -> int:
        """Sum over samples of T/pt * H/ph * W/pw, in exact integers (dimensions up to 2^31 - 1 make
        products far beyond int64)."""
        pt, ph, pw = patch_size
        counts = self.shape_counts().tolist()
        return sum(
            (t // pt) * (h // ph) * (w // pw) * n
            for (_, t, h, w), n in zip(self.columns.shapes.tolist(), counts)
        )

    def counts(self) -> dict[str, int]:
        """As :meth:`ShardIndex.counts`: skipped and ignored by reason, plus ``empty_shard``."""
        out: Counter[str] = Counter()
        for entries in self.columns.skipped.values():
            out.update(e["reason"] for e in entries)
        for ign in self.columns.ignored.values():
            out.update(ign)
        sizes = np.diff(self.columns.shard_offsets)
        empty = sizes == 0
        for s in self.columns.skipped:
            empty[s] = False
        if empty.any():
            out["empty_shard"] += int(empty.sum())
        return dict(out)

    def skipped(self) -> list[dict[str, Any]]:
        """Every skipped sample or shard: ``{"shard": path, "key", "reason", "detail"}``."""
        c = self.columns
        return [{"shard": c.paths[s], **e} for s in sorted(c.skipped) for e in c.skipped[s]]

    # -- arrays for the planner -----------------------------------------------------------------------------

    @property
    def shape_table(self) -> np.ndarray:
        """(u, 4) int32: the distinct latent shapes (C, T, H, W), in order of first use."""
        return self.columns.shapes

    @property
    def shape_ids(self) -> np.ndarray:
        """(n,) uint8/uint16/int32: each sample's row of :attr:`shape_table`, in index order."""
        return self.columns.shape_id

    @property
    def shard_offsets(self) -> np.ndarray:
        """(m + 1,) int64: shard ``s`` holds samples ``shard_offsets[s]:shard_offsets[s + 1]``."""
        return self.columns.shard_offsets

    @property
    def key_offsets(self) -> np.ndarray:
        """(n + 1,) int64: byte offsets of the sample keys in :attr:`key_blob`."""
        return self.columns.key_offsets

    @property
    def key_blob(self) -> np.ndarray:
        """(k,) uint8: the sample keys, UTF-8, concatenated."""
        return self.columns.key_blob

    def release_pages(self) -> None:
        """Drop the mapped file's pages from this process's resident set (they stay in the page cache)."""
        self.columns.release_pages()

    def shard_keys(self, shard: int) -> list[str]:
        """One shard's keys (decoded and checked)."""
        return self._keys(shard)

    # -- conversion and persistence ---------------------------------------------------------------------

    @classmethod
    def from_shard_index(cls, index: ShardIndex) -> CompactIndex:
        """The columns of a ``ShardIndex`` (lossless: keys, shapes, text lengths, sizes, records)."""
        return cls(columns_of(index), source=index.source)

    def to_shard_index(self) -> ShardIndex:
        """The same index as a ``ShardIndex`` of per-sample lists (every key checked)."""
        return ShardIndex(
            shards=[self.shard_info(i) for i in range(self.num_shards)],
            patch_size=self.patch_size,
            values_checked=self.values_checked,
            metadata=dict(self.metadata),
            source=self.source,
        )

    def save(self, path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> str:
        """Write the binary index atomically; shard paths under its folder are stored relative to it.

        Returns:
            The absolute path written.
        """
        path = write_index(self.columns, path, progress)
        self.source = path
        return path

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> CompactIndex:
        """Load a binary index, mapped read-only (a JSON ``index.json`` is converted); told by magic bytes.

        Shard paths follow the rules of :meth:`ShardIndex.load <lightning_adaptiveload.shards.index.ShardIndex.load>`.

        Raises:
            ShardError: ``bad_index`` / ``unsafe_index_path`` naming the file and the field;
                ``duplicate_key`` for a key listed twice (across shards or within one).
        """
        text = os.fspath(path)
        local = not is_url(text)
        if local:
            text = norm_path(text)
            if not is_binary_index(text):
                return cls.from_shard_index(
                    ShardIndex.load(text, allow_schemes=allow_schemes, allow_outside=allow_outside)
                )
            file_id = _file_id(text)
            cols = read_columns(text)
        else:
            file_id = None
            raw = read_index_bytes(text, untrusted.MAX_INDEX_BYTES)
            if not raw.startswith(MAGIC):
                return cls.from_shard_index(
                    ShardIndex.load(text, allow_schemes=allow_schemes, allow_outside=allow_outside)
                )
            cols = read_columns(text, raw)
        cols.paths = resolve_paths(cols.paths, text, allow_schemes, allow_outside)
        refuse_duplicate_keys(cols, text)
        index = cls(cols, source=text)
        index._file_id = file_id
        return index


def _file_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _changed(source: str, what: str) -> ShardError:
    return ShardError(
        source,
        None,
        f"the index file changed after it was loaded ({what} differ)",
        reason="bad_index",
        hint="do not rewrite an index while a run uses it; restart the run to load the new one",
    )


def _remap(
    source: str, paths: list[str], file_id: tuple[int, int], digest: str | None = None
) -> CompactIndex:
    """Unpickle a :class:`CompactIndex` loaded from a file: read (or map) it again, checked, and refuse
    it unless it is the same file (BLAKE2b digest of a copied index, size and time of a mapped one)."""
    if digest is None and _file_id(source) != file_id:
        raise _changed(source, "size or modification time")
    cols = read_columns(source)
    if digest is not None and cols.digest != digest:
        raise _changed(source, "its content's digests")
    cols.paths = list(paths)
    index = CompactIndex(cols, source=source)
    index._file_id = file_id
    return index


def load_index(
    path: str | os.PathLike, *, allow_schemes: Collection[str] = (), allow_outside: bool = False
) -> CompactIndex | ShardIndex:
    """The index at ``path`` as it is stored: a :class:`CompactIndex` for a binary index, else a
    ``ShardIndex`` (told by the file's first bytes, not its name)."""
    text = os.fspath(path)
    if not is_url(text) and is_binary_index(norm_path(text)):
        return CompactIndex.load(text, allow_schemes=allow_schemes, allow_outside=allow_outside)
    return ShardIndex.load(text, allow_schemes=allow_schemes, allow_outside=allow_outside)


def load_checked_compact(
    path: str,
    *,
    patch_size: Sequence[int] | None = DEFAULT_PATCH,
    on_error: str = "raise",
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> CompactIndex:
    """A binary index for training: loaded as arrays, then checked against the shards and the model.

    What ``ShardIndex.for_paths`` does for a JSON index, without per-sample lists: every local shard's
    size must match the recorded one (else ``stale_index``: a compact index is not patched shard by
    shard; rebuild it), every distinct shape must be divisible by ``patch_size`` (else
    ``not_divisible``), and under ``on_error="raise"`` a skip recorded in the index raises. Duplicate
    keys across shards were checked when the index was built.

    Raises:
        ShardError: as above, naming the shard (and key).
    """
    check_on_error(on_error)
    patch = check_patch(patch_size)
    index = CompactIndex.load(path, allow_schemes=allow_schemes, allow_outside=allow_outside)
    c = index.columns
    for s, p in enumerate(c.paths):
        if is_url(p):
            continue
        try:
            size = os.path.getsize(p)
        except OSError:
            if on_error == "raise":
                raise ShardError(p, None, "the shard file does not exist", reason="missing_shard") from None
            continue  # the reader counts its samples as missing
        if c.shard_bytes[s] >= 0 and size != c.shard_bytes[s]:
            raise ShardError(
                p,
                None,
                f"the index {path} records {int(c.shard_bytes[s])} bytes, the file has {size}",
                reason="stale_index",
            )
    if patch is not None:
        for row, shape in enumerate(index.shape_table.tolist()):
            problem = divisibility_problem(shape, patch)
            if problem is not None:
                ref = index.first_use(row)
                raise ShardError(c.paths[ref[0]], index.key(ref), problem, reason="not_divisible")
    if on_error == "raise":
        for s in sorted(c.skipped):
            e = c.skipped[s][0]
            raise ShardError(
                c.paths[s], e.get("key"), f"{e.get('detail')} (recorded in the index)", reason=e.get("reason")
            )
    if not index.values_checked:
        log.warning("index %s: sample values were not checked finite when it was built", path)
    return index

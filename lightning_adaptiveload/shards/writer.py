"""``ShardWriter``: samples into deterministic, plain tar shards, written atomically, and ``index.json``."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_adaptiveload.shards.format import (
    INDEX_NAME,
    LATENT_EXT,
    META_EXT,
    TEXT_EXT,
    ShardInfo,
    check_patch,
    divisibility_problem,
)
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.npy import (
    count_non_finite,
)
from lightning_adaptiveload.shards.untrusted import (
    key_problem,
)

__all__ = ["ShardWriter"]

log = logging.getLogger(__name__)


def _tar_size(data_len: int) -> int:
    return tarfile.BLOCKSIZE + -(-data_len // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _as_float_array(value: Any, what: str, key: str, ndim: int, layout: str) -> np.ndarray:
    """Validate a latent/text array for writing; returns a C-contiguous little-endian numpy array."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.float16, torch.float32):
            raise ValueError(
                f"key {key!r}: {what} dtype {value.dtype} is not float16 or float32 (numpy cannot store "
                f"bfloat16); convert with .float() or .half()"
            )
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"key {key!r}: {what} must be a numpy.ndarray or torch.Tensor, got {type(value).__name__}"
        )
    if value.dtype.kind != "f" or value.dtype.itemsize not in (2, 4):
        raise ValueError(
            f"key {key!r}: {what} dtype {value.dtype} is not float16 or float32; convert with .astype()"
        )
    if value.ndim != ndim:
        raise ValueError(
            f"key {key!r}: {what} shape {list(value.shape)} has {value.ndim} dims, expected {layout}"
        )
    if (ndim == 4 and min(value.shape) < 1) or (ndim == 2 and value.shape[1] < 1):
        raise ValueError(f"key {key!r}: {what} shape {list(value.shape)} has an empty dimension")
    value = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
    bad = count_non_finite(value.reshape(-1))
    if bad:
        raise ValueError(
            f"key {key!r}: {what} has {bad} NaN/Inf values of {value.size}; fix the data before writing"
        )
    return value


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=(1, 0), allow_pickle=False)
    return buf.getvalue()


class ShardWriter:
    """Write samples into plain tar shards, atomically, and ``index.json`` on close.

    Shards are ``<directory>/<prefix>-NNNNNN.tar``; each is written to a hidden temp file and renamed
    when complete. Headers are deterministic (mtime 0, uid/gid 0, empty owner names, mode 0o644,
    ustar with pax records only for long names), so the same samples give the same bytes, and
    webdataset, Python's tarfile and GNU tar read them the same. A new shard starts when the current one
    has ``max_samples_per_shard`` samples or the next sample would make it exceed ``max_bytes``.

    Args:
        directory: where the shards go (created if needed).
        prefix: shard file name prefix.
        max_samples_per_shard: samples per shard, or None for no limit.
        max_bytes: bytes per shard (a single larger sample still gets its own shard), or None.
        patch_size: if given, latents must be divisible by it (else the reader checks).
        overwrite: replace existing ``<prefix>-NNNNNN.tar`` shards and the index; else refuse.
        index_name: file name of the index.
        metadata: stored in the index's ``metadata``.

    Example:
        >>> with ShardWriter(tmp_dir, max_samples_per_shard=100) as w:  # doctest: +SKIP
        ...     w.write("clip0001", latent, text=text_states, meta={"caption": "a cat"})
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        prefix: str = "shard",
        max_samples_per_shard: int | None = 1000,
        max_bytes: int | None = 1 << 30,
        *,
        patch_size: Sequence[int] | None = None,
        overwrite: bool = False,
        index_name: str = INDEX_NAME,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"prefix must be a non-empty file name part without slashes, got {prefix!r}")
        if max_samples_per_shard is not None and max_samples_per_shard < 1:
            raise ValueError(f"max_samples_per_shard must be >= 1 or None, got {max_samples_per_shard}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.prefix = prefix
        self.max_samples_per_shard = max_samples_per_shard
        self.max_bytes = max_bytes
        self.patch_size = check_patch(patch_size)
        self.index_path = os.path.join(self.directory, index_name)
        self.metadata = dict(metadata or {})
        os.makedirs(self.directory, exist_ok=True)
        pattern = re.compile(rf"{re.escape(prefix)}-\d{{6}}\.tar")
        existing = sorted(n for n in os.listdir(self.directory) if pattern.fullmatch(n))
        if os.path.exists(self.index_path):
            existing.append(index_name)
        if existing:
            if not overwrite:
                raise FileExistsError(
                    f"{self.directory} already holds {existing[:3]}{'...' if len(existing) > 3 else ''}; "
                    "pass overwrite=True to replace them, or write to another directory or prefix"
                )
            for name in existing:
                os.remove(os.path.join(self.directory, name))
        self._keys: set[str] = set()
        self._shards: list[ShardInfo] = []
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._tmp: str | None = None
        self._bytes = 0
        self._current: ShardInfo | None = None
        self._index: ShardIndex | None = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    @property
    def paths(self) -> list[str]:
        """Paths of the completed shards."""
        return [s.path for s in self._shards]

    @property
    def index(self) -> ShardIndex:
        """The index of the written shards (complete after :meth:`close`)."""
        if self._index is not None:
            return self._index
        return ShardIndex(
            shards=list(self._shards), patch_size=self.patch_size, values_checked=True, metadata=self.metadata
        )

    def write(
        self,
        key: str,
        latent: np.ndarray | torch.Tensor,
        text: np.ndarray | torch.Tensor | None = None,
        meta: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """Append one sample.

        Args:
            key: unique sample key: no dots, slashes, backslashes or control characters, not starting
                with ``__``.
            latent: (C, T, H, W) float16/float32, finite.
            text: optional (L, D_text) float16/float32, finite.
            meta: optional JSON-serialisable dict (strict JSON: no NaN).

        Returns:
            The sample's reference ``(shard_id, sample_id)``.

        Raises:
            ValueError / TypeError: naming the key and the problem; nothing is written then.
        """
        if self._index is not None:
            raise RuntimeError("ShardWriter is closed")
        rule = key_problem(key)
        if rule is not None:  # the reader applies the same rules (untrusted.key_problem)
            raise ValueError(f"key {key!r} is invalid: it {rule}")
        if key in self._keys:
            raise ValueError(f"key {key!r} was already written; keys must be unique across all shards")
        lat = _as_float_array(latent, "latent", key, 4, "4 (C, T, H, W)")
        if self.patch_size is not None:
            problem = divisibility_problem(lat.shape, self.patch_size)
            if problem is not None:
                raise ValueError(f"key {key!r}: {problem}")
        members = [(f"{key}.{LATENT_EXT}", _npy_bytes(lat))]
        txt = None
        if text is not None:
            txt = _as_float_array(text, "text", key, 2, "2 (L, D_text)")
            members.append((f"{key}.{TEXT_EXT}", _npy_bytes(txt)))
        if meta is not None:
            if not isinstance(meta, dict):
                raise TypeError(f"key {key!r}: meta must be a dict, got {type(meta).__name__}")
            try:
                blob = json.dumps(meta, sort_keys=True, allow_nan=False, ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError) as err:
                raise ValueError(f"key {key!r}: meta is not strict-JSON serialisable ({err})") from None
            members.append((f"{key}.{META_EXT}", blob))
        size = sum(_tar_size(len(data)) for _, data in members)
        cur = self._current
        if (
            cur is not None
            and cur.num_samples
            and (
                (self.max_samples_per_shard is not None and cur.num_samples >= self.max_samples_per_shard)
                or (self.max_bytes is not None and self._bytes + size > self.max_bytes)
            )
        ):
            self.finish_shard()
        if self._current is None:
            self._start_shard()
        assert self._tar is not None and self._current is not None
        start = self._tar.offset  # the sample's span in the tar, for ranged reads
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(data))
        self._bytes += size
        self._keys.add(key)
        self._current.keys.append(key)
        self._current.latent_shapes.append(tuple(int(v) for v in lat.shape))  # type: ignore[arg-type]
        self._current.text_lengths.append(0 if txt is None else int(txt.shape[0]))
        self._current.spans.append((start, self._tar.offset - start))  # type: ignore[union-attr]
        return len(self._shards), self._current.num_samples - 1

    def _start_shard(self) -> None:
        name = f"{self.prefix}-{len(self._shards):06d}.tar"
        self._tmp = os.path.join(self.directory, f".{name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._current = ShardInfo(
            path=os.path.join(self.directory, name),
            keys=[],
            latent_shapes=[],
            text_lengths=[],
            num_bytes=0,
            spans=[],
        )
        self._bytes = 0

    def finish_shard(self) -> None:
        """Complete the current shard now (the next sample starts a new one); no-op if it is empty."""
        if self._current is None or self._tar is None or self._file is None:
            return
        if not self._current.num_samples:
            return
        self._tar.close()  # writes the end-of-archive blocks
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self._current.path)
        self._current.num_bytes = os.path.getsize(self._current.path)
        self._shards.append(self._current)
        self._current, self._tar, self._file, self._tmp = None, None, None, None

    def close(self) -> ShardIndex:
        """Complete the last shard and write the index; returns it. Idempotent."""
        if self._index is not None:
            return self._index
        self.finish_shard()
        self._discard_tmp()
        index = ShardIndex(
            shards=list(self._shards), patch_size=self.patch_size, values_checked=True, metadata=self.metadata
        )
        index.save(self.index_path)
        self._index = index
        return index

    def _discard_tmp(self) -> None:
        if self._tar is not None:
            try:
                self._tar.close()
            except Exception:  # noqa: BLE001 - best effort on an abandoned temp file
                pass
        if self._file is not None:
            self._file.close()
        if self._tmp is not None and os.path.exists(self._tmp):
            os.remove(self._tmp)
        self._current, self._tar, self._file, self._tmp = None, None, None, None

    def _abort(self) -> None:
        self._discard_tmp()
        if self._index is None:
            log.warning(
                "ShardWriter: stopped by an error; %d complete shards kept in %s, no index written",
                len(self._shards),
                self.directory,
            )

"""A local cache of fetched shard ranges, bounded in bytes per folder, least recently used evicted first.

For data sets read again every epoch from object storage: a range fetched once is kept in a file under
the cache folder, keyed by ``(url, the object's identity (size, ETag) where known, start, length)``, and
the next epoch reads it from disk. Off by default (``RemoteSettings.cache_bytes=0``).

The bound is the folder's, whoever wrote the files: every reader (each epoch's, each loader worker
process's) that opens the folder counts what is there, and a write evicts the folder's least recently
used files (by modification time, which a hit refreshes) until the new one fits. Writers of one folder
take turns under a lock file (``.lock``, ``fcntl.flock``), which also holds a generation number: a
writer rescans the folder only when another one changed it since its own last write. Files written
atomically (temp file + rename), so a killed worker leaves no torn entry, and a file that vanishes
(evicted by another process) is a miss, never an error.

A cached file is checked like a server's answer: its length must be the range's, or it is dropped and
fetched again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: one process per folder
    fcntl = None  # type: ignore[assignment]

__all__ = ["SpanCache"]

_LOCK = ".lock"
_PART = ".part-"


class SpanCache:
    """Fetched ranges on local disk, at most ``max_bytes`` in the folder.

    Args:
        max_bytes: the bound, in bytes (> 0).
        folder: where the files live; None: ``<tmp>/lightning-adaptiveload-spans``.

    Attributes:
        hits, misses, evicted: counts since the cache was made (this process's).
    """

    def __init__(self, max_bytes: int, folder: str | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"SpanCache max_bytes must be an integer > 0, got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self.folder = folder or os.path.join(tempfile.gettempdir(), "lightning-adaptiveload-spans")
        os.makedirs(self.folder, exist_ok=True)
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> size, least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._generation = -1  # the folder's generation this process's account is of
        self.hits = self.misses = self.evicted = 0
        with self._folder_lock() as gen:
            self._rescan()
            self._evict(0)
            self._generation = self._bump(gen)

    @staticmethod
    def _name(url: str, identity: str, start: int, length: int) -> str:
        return hashlib.blake2b(f"{url}\0{identity}\0{start}\0{length}".encode(), digest_size=20).hexdigest()

    @property
    def size(self) -> int:
        """Bytes held in the folder, as of this process's last write or scan."""
        return self._bytes

    def get(self, url: str, identity: str, start: int, length: int) -> bytes | None:
        """The cached bytes of the range, or None."""
        name = self._name(url, identity, start, length)
        path = os.path.join(self.folder, name)
        try:
            with open(path, "rb") as f:
                data = f.read(length + 1)
        except OSError:  # never written, or evicted by another process
            with self._lock:
                self.misses += 1
            return None
        if len(data) != length:  # torn or foreign: drop it, fetch again
            with self._lock:
                self._forget(name)
                self.misses += 1
            _unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the recency every process's eviction goes by
        with self._lock:
            self.hits += 1
            if name in self._entries:
                self._entries.move_to_end(name)
        return data

    def put(self, url: str, identity: str, start: int, length: int, data: bytes) -> None:
        """Keep ``data`` (the range's bytes), evicting the folder's least recently used files so that it
        stays within the bound. A range larger than the whole bound is not kept."""
        if len(data) != length or length > self.max_bytes:
            return
        name = self._name(url, identity, start, length)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=_PART)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except OSError:
            _unlink(tmp)
            return
        with self._lock, self._folder_lock() as gen:
            if gen < 0 or gen != self._generation:  # another process wrote or evicted since our last look
                self._rescan()
            self._forget(name)
            self._evict(length)
            try:
                os.replace(tmp, os.path.join(self.folder, name))
            except OSError:
                _unlink(tmp)
            else:
                self._entries[name] = length
                self._bytes += length
            self._generation = self._bump(gen)

    # -- the folder ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _folder_lock(self) -> Iterator[int]:
        """Hold the folder's lock; yields its generation (-2 without a lock: always rescan)."""
        if fcntl is None:  # pragma: no cover
            yield -2
            return
        fd = os.open(os.path.join(self.folder, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 32, 0).strip()
            self._lock_fd = fd
            yield int(raw) if raw.isdigit() else 0
        finally:
            self._lock_fd = -1
            os.close(fd)  # closing releases the lock

    def _bump(self, gen: int) -> int:
        if gen < 0 or getattr(self, "_lock_fd", -1) < 0:
            return gen
        new = gen + 1
        raw = str(new).encode().ljust(20)
        with contextlib.suppress(OSError):
            os.pwrite(self._lock_fd, raw, 0)
        return new

    def _rescan(self) -> None:
        """Count the folder's files, oldest first (temp files and the lock left out)."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.startswith(".") and not entry.name.startswith(_PART):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # vanished meanwhile
                    continue
                if entry.name.startswith(_PART):  # a killed writer's temp file, after an hour
                    if st.st_mtime_ns < time.time_ns() - 3600 * 10**9:
                        _unlink(entry.path)
                    continue
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        self._entries = OrderedDict((name, size) for _, name, size in found)
        self._bytes = sum(size for _, _, size in found)

    def _evict(self, room: int) -> None:
        while self._bytes + room > self.max_bytes and self._entries:
            old, size = self._entries.popitem(last=False)
            self._bytes -= size
            self.evicted += 1
            _unlink(os.path.join(self.folder, old))

    def _forget(self, name: str) -> None:
        size = self._entries.pop(name, None)
        if size is not None:
            self._bytes -= size


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)

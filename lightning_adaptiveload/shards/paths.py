"""Where shards live: path and brace-pattern expansion, URLs, and opening a shard safely.

Local paths are normalised to absolute paths; URLs (``pipe:``, ``http(s)://``, anything webdataset's
``gopen`` opens) pass unchanged. Local shards are opened only when they are regular files (a FIFO
would block the reader for ever).
"""

from __future__ import annotations

import logging
import os
import stat
import urllib.parse
import urllib.request
from collections.abc import Iterable

__all__ = ["close_quietly", "expand_paths", "is_url", "norm_path", "open_regular", "open_shard"]

log = logging.getLogger(__name__)


def is_url(path: str) -> bool:
    scheme = urllib.parse.urlparse(path).scheme
    # One-letter schemes are Windows drive letters; file:// is handled as a local path.
    return len(scheme) > 1 and scheme != "file"


def norm_path(path: str | os.PathLike) -> str:
    """Absolute local path for local paths and file:// URLs; other URLs unchanged."""
    text = os.fspath(path)
    if text.startswith("file:"):
        text = urllib.request.url2pathname(urllib.parse.urlparse(text).path)
    if is_url(text):
        return text
    return os.path.abspath(os.path.expanduser(text))


def expand_paths(paths_or_pattern: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Expand shard paths: brace patterns, directories (their ``*.tar`` files, sorted), lists of these.

    Args:
        paths_or_pattern: a path, URL (``file://``, ``pipe:``, ``http(s)://``, anything webdataset's
            ``gopen`` opens) or brace pattern (``shards/shard-{000000..000099}.tar``), a directory, or a
            list of these.

    Returns:
        Normalised paths in the given order (local paths absolute, URLs unchanged).

    Raises:
        FileNotFoundError: a directory without ``.tar`` files, or nothing given.
    """
    import braceexpand

    items = [paths_or_pattern] if isinstance(paths_or_pattern, str | os.PathLike) else list(paths_or_pattern)
    out: list[str] = []
    for item in items:
        for one in braceexpand.braceexpand(os.fspath(item)):
            norm = norm_path(one)
            if not is_url(norm) and os.path.isdir(norm):
                tars = sorted(n for n in os.listdir(norm) if n.endswith(".tar") and not n.startswith("."))
                if not tars:
                    raise FileNotFoundError(
                        f"directory {norm} holds no .tar shards; give shard paths or a pattern"
                    )
                out.extend(os.path.join(norm, n) for n in tars)
            else:
                out.append(norm)
    if not out:
        raise FileNotFoundError(f"no shard paths in {paths_or_pattern!r}")
    return out


def open_shard(path: str):
    """Open a shard for streaming; local paths directly, URLs through webdataset's gopen.

    Raises:
        OSError: cannot open it, or (local) it is no regular file: a FIFO would block the reader
            forever and a device has no end.
    """
    if is_url(path):
        from webdataset.gopen import gopen

        try:
            return gopen(path, "rb")
        except ValueError as err:  # an unknown scheme, or webdataset's security switch
            raise OSError(f"cannot open {path!r}: {err}") from None
    return open_regular(path)


def open_regular(path: str):
    # O_NONBLOCK: opening a FIFO for reading must not wait for a writer before the type is checked.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file (a FIFO, device or directory)")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def close_quietly(stream) -> None:
    try:
        stream.close()
    except Exception as err:  # noqa: BLE001 - a pipe closed early exits with SIGPIPE
        log.debug("closing %r after an early stop or an error: %s", stream, err)

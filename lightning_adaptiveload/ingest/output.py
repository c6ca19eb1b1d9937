"""What an ingest output folder holds, read back for a resume: its complete shards, the keys they hold, and
the inputs earlier runs skipped. Read as untrusted (regular files only, size caps, checked records).

Used by :mod:`~lightning_adaptiveload.ingest.job`, which re-exports :func:`done_keys` and
:func:`skipped_inputs`. No Lightning.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import Any

log = logging.getLogger("lightning_adaptiveload.ingest.job")

__all__ = ["DEMO_MARKER", "MAX_SKIP_LOG_BYTES", "done_keys", "skipped_inputs"]


_SHARD = re.compile(r"r(\d{3,})a(\d{3,})-\d{6}\.tar")
_STALE_TMP = re.compile(r"\.r\d{3,}a\d{3,}-\d{6}\.tar\.\d+\.tmp")
# Each rank's writer indexes its own shards under this name; index.json merges them all (write_index).
_WRITER_INDEX = re.compile(r"\.index-r\d{3,}a\d{3,}\.json")
# In an output folder whose shards were encoded with the random-weight demo VAE (ingest/demo.py).
DEMO_MARKER = "ingest-demo.json"
_SKIP_LOG = re.compile(r"ingest-skipped-r(\d{3,})\.jsonl")
MAX_SKIP_LOG_BYTES = 1 << 28  # one rank's skip log: ~300 bytes a record, so ~900k skipped inputs


def _regular_files(out: str, pattern: re.Pattern) -> list[str]:
    """Files of ``out`` whose names match ``pattern``; only regular files (a FIFO would block a read)."""
    if not os.path.isdir(out):
        return []
    found = []
    for name in sorted(os.listdir(out)):
        if pattern.fullmatch(name):
            path = os.path.join(out, name)
            try:
                regular = stat.S_ISREG(os.lstat(path).st_mode)
            except OSError:
                continue
            if regular:
                found.append(path)
            else:
                log.warning("ingest: %s is not a regular file (a FIFO, link or directory); ignored", path)
    return found


def _complete_shards(out: str) -> list[str]:
    return _regular_files(out, _SHARD)


def done_keys(out: str | os.PathLike) -> set[str]:
    """Keys of the samples in the complete shards of ``out`` (read from tar headers only).

    Raises:
        ValueError: a complete shard that is not a readable tar, naming it (delete it: its inputs are
            then encoded again).
    """
    import tarfile

    from lightning_adaptiveload.shards.paths import open_regular
    from lightning_adaptiveload.shards.untrusted import CheckedTarInfo

    keys = set()
    for path in _complete_shards(os.fspath(out)):
        try:
            with (
                open_regular(path) as raw,
                tarfile.open(fileobj=raw, mode="r:", tarinfo=CheckedTarInfo) as tf,
            ):
                for info in tf:
                    keys.add(info.name.split(".", 1)[0])
        except (tarfile.TarError, OSError, ValueError, EOFError) as err:
            raise ValueError(
                f"ingest: {path} is not a readable shard ({err}); delete it and rerun (its inputs are encoded again)"
            ) from None
    return keys


def skipped_inputs(out: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The inputs earlier runs skipped, from ``<out>/ingest-skipped-r*.jsonl``: key -> its record
    (``key``, ``path``, ``error``, ``detail``). A rerun does not try them again.

    The logs are read as untrusted: at most :data:`MAX_SKIP_LOG_BYTES` each, lines that do not parse or
    whose key breaks the key rules are ignored with a warning (they are then retried).
    """
    from lightning_adaptiveload.shards.paths import open_regular
    from lightning_adaptiveload.shards.untrusted import Refused, key_problem, load_json

    records: dict[str, dict[str, Any]] = {}
    for path in _regular_files(os.fspath(out), _SKIP_LOG):
        with open_regular(path) as f:
            raw = f.read(MAX_SKIP_LOG_BYTES + 1)
        if len(raw) > MAX_SKIP_LOG_BYTES:
            raise ValueError(
                f"ingest: {path} is larger than {MAX_SKIP_LOG_BYTES} bytes; it is not a skip log ingest wrote: "
                "move it away (its inputs are then tried again)"
            )
        bad = 0
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            try:
                rec = load_json(line)
            except Refused:
                rec = None
            if (
                not isinstance(rec, dict)
                or key_problem(rec.get("key")) is not None
                or not isinstance(rec.get("error"), str)
            ):
                bad += 1
                continue
            records.setdefault(rec["key"], rec)
        if bad:
            log.warning("ingest: %s: %d lines are not skip records; their inputs are tried again", path, bad)
    return records

"""Bounded readers of user text files (a replay CSV, a step-time JSONL): a regular file, at most
:data:`MAX_TEXT_BYTES` bytes, each line at most :data:`MAX_LINE_BYTES`, UTF-8; every error names the file
and the line. In the shards layer so that tools/ and cli/ can both use it (pure: no torch, no Lightning).

A 2 GiB line fails at its first :data:`MAX_LINE_BYTES` + 1 bytes (it used to raise ``MemoryError`` at
2.3 GB); a CSV field over :data:`MAX_CSV_FIELD` characters, a quoting error or a NUL byte is a
:class:`TextFileError` with the file and the line, not a bare ``_csv.Error``.
"""

from __future__ import annotations

import csv
import os
import stat
from collections.abc import Iterator, Sequence

__all__ = [
    "MAX_CSV_FIELD",
    "MAX_LINE_BYTES",
    "MAX_TEXT_BYTES",
    "TextFileError",
    "file_kind",
    "iter_lines",
    "read_csv",
]

#: The largest file read (a monitor CSV of a long run: about 200 bytes a row and rank).
MAX_TEXT_BYTES = 1 << 30
#: The longest line (a monitor CSV row or a step-time record is a few hundred bytes).
MAX_LINE_BYTES = 1 << 20
#: The longest CSV field, in characters (the csv module's own default limit).
MAX_CSV_FIELD = 1 << 17


class TextFileError(ValueError):
    """A user text file that cannot be read; the message names the file, the line and the rule."""


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words, from its ``st_mode`` (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def iter_lines(
    path: str | os.PathLike,
    *,
    what: str | None = None,
    max_bytes: int = MAX_TEXT_BYTES,
    max_line: int = MAX_LINE_BYTES,
) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of the regular file ``path`` (its newline kept), UTF-8.

    Args:
        path: the file.
        what: how the messages name it (``"--replay ranks.csv"``); default: the path.
        max_bytes: the largest file read.
        max_line: the longest line, in bytes.

    Raises:
        FileNotFoundError: no such file (the message names it).
        TextFileError: not a regular file (a FIFO is refused without waiting on it), larger than
            ``max_bytes``, a line longer than ``max_line``, unreadable, or not UTF-8 (the line named).
    """
    name = what or os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer before its type is known.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: no such file; check the path") from None
    except OSError as err:
        raise TextFileError(f"{name}: cannot be opened ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)
        if kind is not None:
            raise TextFileError(f"{name}: is {kind}, not a regular file; give the path of a file")
        if info.st_size > max_bytes:
            raise TextFileError(
                f"{name}: {info.st_size} bytes, more than the {max_bytes} read; is it the right file?"
            )
        os.set_blocking(fd, True)
        f = open(fd, "rb", closefd=False)  # noqa: SIM115 (closed below, with the descriptor)
    except BaseException:
        os.close(fd)
        raise
    try:
        total = 0
        lineno = 0
        while True:
            try:
                raw = f.readline(max_line + 1)
            except OSError as err:
                raise TextFileError(
                    f"{name}, line {lineno + 1}: cannot be read ({err.strerror or err})"
                ) from None
            if not raw:
                return
            lineno += 1
            if len(raw.rstrip(b"\r\n")) > max_line:  # read max_line + 1 bytes without the newline
                raise TextFileError(
                    f"{name}, line {lineno}: longer than {max_line} bytes (read no further); a line of this "
                    "file is one row or record: is it the right file?"
                )
            total += len(raw)
            if total > max_bytes:
                raise TextFileError(f"{name}: more than the {max_bytes} bytes read; is it the right file?")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise TextFileError(
                    f"{name}, line {lineno}: not UTF-8 text ({err.reason} at byte {err.start} of the line); "
                    "save the file as UTF-8"
                ) from None
            yield lineno, text
    finally:
        f.close()
        os.close(fd)


def read_csv(
    path: str | os.PathLike,
    *,
    what: str | None = None,
    required: Sequence[str] = (),
    max_bytes: int = MAX_TEXT_BYTES,
    max_line: int = MAX_LINE_BYTES,
) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """The header and the rows of a CSV file read through :func:`iter_lines`: ``(fieldnames, [(line, row)])``,
    each row a dict of the header's columns (a short row's missing cells are None).

    Raises:
        FileNotFoundError: no such file.
        TextFileError: as :func:`iter_lines`; an empty file or header; a column of ``required`` missing; a
            CSV error (a field longer than :data:`MAX_CSV_FIELD`, a NUL byte, bad quoting), naming the line.
    """
    name = what or os.fspath(path)
    lines = iter_lines(path, what=what, max_bytes=max_bytes, max_line=max_line)
    where = [0]

    def text() -> Iterator[str]:
        for lineno, line in lines:
            where[0] = lineno
            yield line

    old = csv.field_size_limit(MAX_CSV_FIELD)
    try:
        reader = csv.reader(text())
        try:
            header = next(reader, None)
            if not header:
                raise TextFileError(f"{name}: empty, no CSV header line")
            missing = sorted(set(required) - set(header))
            if missing:
                raise TextFileError(
                    f"{name}, line 1: missing column(s) {missing}; the header has {header[:20]}"
                )
            rows = []
            for cells in reader:
                if not cells:
                    continue
                row = dict(zip(header, cells, strict=False))
                for col in header[len(cells) :]:
                    row[col] = None  # type: ignore[assignment]
                rows.append((where[0], row))
        except csv.Error as err:
            raise TextFileError(f"{name}, line {where[0]}: not readable as CSV ({err})") from None
    finally:
        csv.field_size_limit(old)
        lines.close()
    return header, rows

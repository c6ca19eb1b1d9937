"""A fast reading of the plainest tars: fetched ranges whose every header is a well-formed ustar file.

A ranged read scans a few members at a time (:class:`~lightning_adaptiveload.shards.scan.BytesSource`),
and Python's ``tarfile`` spends more on a header than the rest of the scan spends on a small sample.
:func:`plain_members` parses the headers of such bytes itself, but only where every one is of the one
kind this library and ``tarfile`` write for a plain file, and only where it gives exactly what
``tarfile`` would:

- a full 512-byte block whose unsigned checksum is right;
- type ``"0"`` (a regular file), or the old ``"\\0"`` with a name not ending in ``/``;
- every numeric field plain octal (spaces, digits, then spaces or NULs: no base-256, no sign);
- name and ustar prefix valid UTF-8;
- the member's data, padded to a block, inside the bytes; the bytes end right after a member.

Anything else (pax or GNU long-name headers, links, sparse files, a bad checksum, a member cut off,
trailing blocks) returns None, and the caller scans the bytes with ``tarfile`` and its hostile-input
checks (:class:`~lightning_adaptiveload.shards.untrusted.CheckedTarInfo`) as before. So the refusals
are ``tarfile``'s in every case this parse declines, and it declines every case that is not plain.
"""

from __future__ import annotations

import re
import tarfile

__all__ = ["PlainTar", "plain_members"]

_BLOCK = tarfile.BLOCKSIZE
# What tarfile's nti() reads as a plain octal number: NUL ends the field, spaces are stripped.
_OCTAL = re.compile(rb" *[0-7]* *\0*[ \0]*")
# (start, end) of the numeric fields tarfile parses: mode, uid, gid, size, mtime, devmajor, devminor.
_NUMERIC = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))
_CHKSUM_FIELD = re.compile(rb" *([0-7]+) *\0*[ \0]*")
# The fields as tarfile and GNU tar write them (zero-padded octal, NUL), checked at once: bytes 100-156
# (mode, uid, gid, size, mtime, checksum) and 329-345 (devmajor, devminor, or NULs). Other plain forms
# fall to the field-by-field check above.
_CANONICAL = re.compile(rb"(?:[0-7]{7}\0){3}(?:[0-7]{11}\0){2}[0-7]{6}\0 ")
_CANONICAL_DEV = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")


def _text(field: bytes) -> str | None:
    end = field.find(b"\0")
    if end >= 0:
        field = field[:end]
    try:
        return field.decode(tarfile.ENCODING)  # tarfile.open's default, as the scan opens it
    except UnicodeError:
        return None


def _header(data: memoryview, off: int) -> tarfile.TarInfo | None:
    """The plain regular-file member whose header is at ``off``, or None where it is anything else."""
    buf = bytes(data[off : off + _BLOCK])
    if len(buf) != _BLOCK:
        return None
    canonical = _CANONICAL.fullmatch(buf, 100, 156) is not None and _CANONICAL_DEV.fullmatch(buf, 329, 345)
    if not canonical and any(_OCTAL.fullmatch(buf, lo, hi) is None for lo, hi in _NUMERIC):
        return None
    chk = _CHKSUM_FIELD.fullmatch(buf, 148, 156)
    if chk is None or int(chk.group(1), 8) != sum(buf) - sum(buf[148:156]) + 256:
        return None
    kind = buf[156:157]
    name = _text(buf[0:100])
    prefix = _text(buf[345:500])
    if name is None or prefix is None or kind not in (b"0", b"\0") or (kind == b"\0" and name.endswith("/")):
        return None
    size = int(buf[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    info = tarfile.TarInfo(f"{prefix}/{name}" if prefix else name)
    info.size = size
    info.type = kind
    info.offset = off
    info.offset_data = off + _BLOCK
    return info


def plain_members(data: bytes | bytearray | memoryview) -> list[tarfile.TarInfo] | None:
    """The members of ``data`` in order, if it is a run of plain regular-file members (module doc);
    else None. An empty ``data`` is None too (``tarfile`` reports it)."""
    view = memoryview(data)
    end = len(view)
    out: list[tarfile.TarInfo] = []
    off = 0
    while off < end:
        info = _header(view, off)
        if info is None:
            return None
        off = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
        if off > end:
            return None  # cut off: tarfile names it (truncated_tar)
        out.append(info)
    return out or None


class PlainTar:
    """What :func:`~lightning_adaptiveload.shards.scan.scan_shard` uses of a ``tarfile.TarFile``, over the
    members :func:`plain_members` parsed: ``next()``, ``offset`` (after the last member taken) and
    ``members``."""

    def __init__(self, members: list[tarfile.TarInfo]) -> None:
        self._members = members
        self._i = 0
        self.offset = 0
        self.members: list[tarfile.TarInfo] = []

    def next(self) -> tarfile.TarInfo | None:
        if self._i >= len(self._members):
            return None
        info = self._members[self._i]
        self._i += 1
        self.offset = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
        return info

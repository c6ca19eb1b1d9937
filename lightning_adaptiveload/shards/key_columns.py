"""The key column of the binary index (:mod:`~lightning_adaptiveload.shards.columnar`): sample keys as one
UTF-8 blob and offsets, decoded, checked against the writer's key rules in bytes, and searched for
duplicates by hashing, all without a Python string per key.

The search for duplicates sorts one hash per key (seconds at 100M keys), so the writer runs it once and
records its outcome in the header (:data:`UNIQUE_KEYS`) with a CRC-32 of the key column it checked. A
loader that finds the record and the same CRC skips the search; an index without the record (an older
one, or one whose header was edited) or whose key column changed since is searched in full.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "UNIQUE_KEYS",
    "check_keys",
    "decode_keys",
    "duplicate_key",
    "key_hashes",
    "keys_crc",
    "unique_keys_record",
]

UNIQUE_KEYS = "unique_keys"  # the header's record: {"keys": n, "key_bytes": k, "crc32": c} (see keys_crc)
_CRC_CHUNK = 1 << 26  # bytes per CRC step: bounds the pages a mapped index holds at once

# Bytes a key may not hold: '/', '\\', '.', control characters (the writer's key rules, in bytes).
_BAD_KEY_BYTE = np.zeros(256, dtype=bool)
_BAD_KEY_BYTE[list(range(0x20)) + [0x7F, ord("/"), ord("\\"), ord(".")]] = True


def decode_keys(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    """Keys ``blob[offsets[i]:offsets[i+1]]`` as strings (ASCII keys are cut from one decoded string)."""
    if len(offsets) < 2:
        return []
    lo, hi = int(offsets[0]), int(offsets[-1])
    raw = blob[lo:hi].tobytes()
    text = raw.decode("utf-8")
    rel = (np.asarray(offsets, dtype=np.int64) - lo).tolist()
    source: Any = text if len(text) == len(raw) else raw
    keys = [source[rel[i] : rel[i + 1]] for i in range(len(rel) - 1)]
    return keys if source is text else [k.decode("utf-8") for k in keys]


def check_keys(blob: np.ndarray, offsets: np.ndarray) -> str | None:
    """Which key of ``blob`` (cut at ``offsets``) breaks the writer's key rules, as a sentence, or None.

    The rules of :func:`~lightning_adaptiveload.shards.untrusted.key_problem` in bytes: non-empty, valid
    UTF-8, no '/', '\\\\', '.' or control character, no leading '__'. Vectorised over the keys.
    """
    if len(offsets) < 2:
        return None
    lo, hi = int(offsets[0]), int(offsets[-1])
    part = blob[lo:hi]
    lens = np.diff(offsets)
    if lens.size and lens.min() < 1:
        return f"key #{int(np.argmin(lens))} is empty"
    bad = _BAD_KEY_BYTE[part]
    if bad.any():
        pos = int(np.argmax(bad)) + lo
        k = int(np.searchsorted(offsets, pos, side="right")) - 1
        return f"key #{k} holds the byte 0x{int(blob[pos]):02x} ('/', '\\', '.' and control characters are refused)"
    starts = offsets[:-1] - lo
    long_ = lens >= 2
    dunder = long_ & (part[np.minimum(starts, max(len(part) - 1, 0))] == 0x5F)
    dunder &= part[np.minimum(starts + 1, max(len(part) - 1, 0))] == 0x5F
    if dunder.any():
        return f"key #{int(np.argmax(dunder))} starts with '__', which is reserved"
    try:
        decode_keys(blob, offsets)
    except UnicodeDecodeError as err:
        return f"the keys are not valid UTF-8 ({err.reason} at byte {err.start + lo})"
    return None


# Tabulation hashing of keys: one random 64-bit value per (position mod 64, byte), summed over the key's
# bytes, mixed with its length. Vectorised over keys; equal hashes are confirmed on the bytes, so a
# collision (crafted or not) costs time, never a wrong answer.
_HASH_TABLE = np.random.default_rng(0x5EED_4E42).integers(
    0, 1 << 63, size=64 * 256, dtype=np.uint64
) * np.uint64(2) + np.uint64(1)
_HASH_CHUNK = 1 << 24  # key bytes per step: bounds the temporaries to a few hundred MiB


def key_hashes(
    blob: np.ndarray, offsets: np.ndarray, release: Callable[[], None] | None = None
) -> np.ndarray:
    """(n,) uint64: a hash of each key ``blob[offsets[i]:offsets[i+1]]`` (equal keys, equal hashes).

    ``release``: called after every :data:`_HASH_CHUNK` bytes of keys (a mapped index drops the pages read
    so far from the resident set: at 100M keys they were 2 GB of the load's peak).
    """
    n = len(offsets) - 1
    out = np.zeros(max(n, 0), dtype=np.uint64)
    i = 0
    with np.errstate(over="ignore"):
        while i < n:
            if release is not None:
                release()
            lo = int(offsets[i])
            j = int(np.searchsorted(offsets, lo + _HASH_CHUNK, side="right")) - 1
            j = min(max(j, i + 1), n)
            hi = int(offsets[j])
            if j == i + 1 and hi - lo > _HASH_CHUNK:  # one long key: its bytes in pieces
                acc = np.uint64(0)
                for a in range(lo, hi, _HASH_CHUNK):
                    b = min(hi, a + _HASH_CHUNK)
                    pos = (np.arange(a - lo, b - lo, dtype=np.int64) & 63) << 8
                    acc += _HASH_TABLE[pos + blob[a:b]].sum(dtype=np.uint64)
                out[i] = acc
            else:
                starts = np.asarray(offsets[i:j], dtype=np.int64) - lo
                lens = np.diff(np.asarray(offsets[i : j + 1], dtype=np.int64))
                width = int(lens[0])
                if 0 < width <= 64 and (lens == width).all():  # keys of one length (the usual case)
                    rows = blob[lo:hi].reshape(j - i, width)
                    part = out[i:j]
                    for c in range(width):
                        part += _HASH_TABLE[(c << 8) + rows[:, c].astype(np.int64)]
                    i = j
                    continue
                pos = np.arange(hi - lo, dtype=np.int64) - np.repeat(starts, lens)
                contrib = _HASH_TABLE[((pos & 63) << 8) + blob[lo:hi]]
                full = lens > 0
                if contrib.size:
                    out[i:j][full] = np.add.reduceat(contrib, starts[full])
            i = j
        for a in range(0, n, _HASH_CHUNK):  # in slices: no temporary of n entries
            b = min(n, a + _HASH_CHUNK)
            part = out[a:b]
            part ^= np.diff(np.asarray(offsets[a : b + 1], dtype=np.int64)).astype(np.uint64) * np.uint64(
                0x9E3779B97F4A7C15
            )
            part ^= part >> np.uint64(31)
            part *= np.uint64(0xBF58476D1CE4E5B9)
            part ^= part >> np.uint64(29)
            if release is not None:
                release()
    return out


def duplicate_key(
    blob: np.ndarray, offsets: np.ndarray, release: Callable[[], None] | None = None
) -> tuple[int, int] | None:
    """The first key listed twice, as ``(first position, later position)``, or None when all are unique.

    ``release``: see :func:`key_hashes`."""
    n = len(offsets) - 1
    if n < 2:
        return None
    ordered = key_hashes(blob, offsets, release)
    ordered.sort()  # in place: one array of n hashes, not two
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    del ordered
    if twice.size == 0:
        return None
    hashes = key_hashes(blob, offsets, release)  # a key is listed twice (rare): find it in index order
    first: dict[bytes, int] = {}
    found: tuple[int, int] | None = None
    for pos in np.flatnonzero(np.isin(hashes, twice)).tolist():  # ascending: index order
        key = blob[int(offsets[pos]) : int(offsets[pos + 1])].tobytes()
        earlier = first.setdefault(key, pos)
        if earlier != pos:
            found = (earlier, pos)
            break
    return found


def keys_crc(blob: np.ndarray, offsets: np.ndarray, release: Callable[[], None] | None = None) -> int:
    """CRC-32 of the key column: ``offsets`` as little-endian int64 bytes, then ``blob``.

    Detects an edit of the keys made after the writer checked them (not a forgery: a file that lies in
    its header can lie in its CRC too; see the module docstring). ``release``: as in :func:`key_hashes`.
    """
    crc = 0
    for arr in (np.asarray(offsets, dtype="<i8"), np.asarray(blob, dtype="|u1")):
        flat = arr.reshape(-1).view(np.uint8)
        for a in range(0, flat.size, _CRC_CHUNK):
            crc = zlib.crc32(flat[a : a + _CRC_CHUNK], crc)
            if release is not None:
                release()
    return crc


def unique_keys_record(
    blob: np.ndarray, offsets: np.ndarray, release: Callable[[], None] | None = None
) -> dict[str, int] | None:
    """The header record of a key column searched and found free of duplicates, or None when a key is
    listed twice (then no record is written, and every load searches and refuses the index)."""
    if duplicate_key(blob, offsets, release) is not None:
        return None
    return {
        "keys": max(len(offsets) - 1, 0),
        "key_bytes": int(len(blob)),
        "crc32": keys_crc(blob, offsets, release),
    }

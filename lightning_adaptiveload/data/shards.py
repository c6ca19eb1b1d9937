"""Shard I/O: the writer, the safe streaming reader, the index, synthetic shards.

A shard is a plain tar file in the WebDataset layout: a sample is the run of members sharing a key
(the member name up to its first dot; keys contain no dots):

- ``<key>.latent.npy``: the VAE latent (C, T, H, W), float16 or float32; required;
- ``<key>.text.npy``: text-encoder states (L, D_text), float16 or float32; optional;
- ``<key>.json``: metadata, a JSON object; optional.

``index.json`` beside the shards lists, per shard, its sample keys, latent shapes and text lengths, so
that every rank can plan an epoch without reading data. :class:`ShardWriter` writes it; for shards made
by other tools :meth:`ShardIndex.build` makes it in one streaming pass and :meth:`ShardIndex.for_paths`
uses it when it covers the shards (else builds it).

Untrusted data: nothing is ever unpickled. ``.npy`` headers are parsed without touching the data and
object dtypes are refused; members with pickle extensions (``.pth``, ``.pt``, ``.pyd``, ``.pkl``,
``.pickle``, ``.ckpt``) are refused without being read. No size a file claims is allocated before it is
checked, an index never names a command or a file outside its folder, and every parser is bounded
(:mod:`lightning_adaptiveload.data.untrusted`; threat model in ``docs/reliability.md``).

Bad input gives a :class:`ShardError` naming the shard, the key and the problem (``on_error="raise"``,
the default) or, under ``on_error="skip"``, a skip that is recorded in the index
(``ShardInfo.skipped``), counted by reason (:meth:`ShardIndex.counts`, the ``stats`` dict of
:func:`iter_shard`) and logged. See ``docs/data_format.md`` and ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import re
import stat
import sys
import tarfile
import urllib.parse
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Iterator, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lightning_adaptiveload.data import untrusted as _untrusted
from lightning_adaptiveload.data.mixes import Mix, load_mix
from lightning_adaptiveload.data.untrusted import (
    CheckedTarInfo,
    Refused,
    check_index_path,
    key_problem,
    load_json,
    parse_npy_header,
)

__all__ = [
    "INDEX_NAME",
    "MAX_MEMBER_BYTES",
    "REASONS",
    "ShardError",
    "ShardIndex",
    "ShardInfo",
    "ShardWriter",
    "expand_paths",
    "index_main",
    "iter_shard",
    "synth_main",
    "write_synthetic_shards",
]

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
INDEX_VERSION = 1

_LATENT = "latent.npy"
_TEXT = "text.npy"
_META = "json"
# Extensions whose usual decoders unpickle (torch.load, webdataset's .pyd/.pth handlers, pickle.load).
_PICKLE_SUFFIXES = frozenset({"pth", "pt", "pyd", "pkl", "pickle", "ckpt"})
_PatchSize = tuple[int, int, int]
# The default cap on a member's size, checked before anything is allocated for it. A Wan 2.1 latent of
# an 81-frame 480x832 clip is 4 MiB in float16; 1 GiB leaves room for long, high-resolution clips.
# Settable per call (``max_member_bytes=``, also on AdaptiveLoadDataModule).
MAX_MEMBER_BYTES = 1 << 30
_DEFAULT_PATCH: _PatchSize = (1, 2, 2)

# What each problem means for the user: reason -> what to do. The keys are the stable reason names used
# in ShardInfo.skipped, ShardIndex.counts() and iter_shard's stats.
REASONS: dict[str, str] = {
    "missing_shard": "check the path or pattern (under on_error='skip' the shard is counted and left out)",
    "unreadable_shard": "check the file's permissions or the URL",
    "empty_shard": "the shard holds no samples; remove it or regenerate it",
    "truncated_tar": "the file was cut short (interrupted copy or write): copy or write it again, or use "
    "on_error='skip' to keep the samples before the cut",
    "corrupt_tar": "shards must be plain, uncompressed tar files: re-create the shard",
    "missing_latent": "every sample needs a '<key>.latent.npy' member: add it or remove the sample",
    "bad_ndim": "latents are (C, T, H, W) and text states (L, D_text): re-export the sample",
    "bad_shape": "every latent dimension must be at least 1 (and D_text at least 1): re-export the sample",
    "not_divisible": "T, H and W must be multiples of the patch size (pt, ph, pw): crop or pad the latent, or "
    "use the model's patch size",
    "bad_dtype": "store float16 or float32 arrays (e.g. np.save(f, x.astype(np.float16))); object arrays "
    "need pickle, which is never loaded",
    "non_finite": "the array holds NaN or Inf: re-encode the sample or leave it out (on_error='skip')",
    "bad_npy": "the .npy member is corrupt: re-export it with numpy.save",
    "bad_json": "the .json member must be a UTF-8 JSON object: fix it or remove it",
    "duplicate_key": "keys must be unique in a data set: rename the samples (e.g. prefix the shard name), or "
    "use on_error='skip' to keep only the first occurrence",
    "pickle_member": "pickled members (.pth/.pt/.pyd/.pkl/.pickle/.ckpt) are never loaded: store arrays as "
    ".npy and metadata as .json, or use on_error='skip' to ignore such members",
    "stale_index": "the shard changed after it was indexed: rebuild the index "
    "(`lightning-adaptiveload index <shards> --rebuild`)",
    "unknown_extension": "members with other extensions are ignored",
    "non_file_member": "directories, links and other non-file members are ignored",
    "bad_member_name": "member names need a key and an extension ('<key>.<ext>'); others are ignored",
    "bad_key": "keys follow the writer's rules (no '/', '\\', '..', '.', control characters or leading '__'): "
    "rename the members, or use on_error='skip' to leave such samples out",
    "member_too_large": "a member claims more bytes than max_member_bytes allows: if the data is genuine, raise "
    "max_member_bytes (also on AdaptiveLoadDataModule); else re-create the shard",
    "sparse_member": "GNU sparse members (tar -S/--sparse) are not supported: re-create the shard without "
    "--sparse",
    "bad_index": "the index file is damaged or was edited by hand: rebuild it with "
    "`lightning-adaptiveload index <shards> --rebuild`",
    "unsafe_index_path": "an index may name shards inside its own folder only: rebuild the index there, list the "
    "shards yourself, or opt in with allow_outside=True / allow_schemes=[...] if you trust the index",
}
# Members ignored (counted, never an error); every other reason is a problem for the sample or shard.
_IGNORED_REASONS = frozenset({"unknown_extension", "non_file_member", "bad_member_name"})
# Problems of an index file rather than of a shard.
_INDEX_REASONS = frozenset({"bad_index", "unsafe_index_path"})
#: Reasons that count members, not samples, in iter_shard's stats: ignored members, and members refused
#: under on_error="skip" (a pickle beside a good latent); the sample itself is still read.
MEMBER_REASONS = _IGNORED_REASONS | {"pickle_member"}


class ShardError(ValueError):
    """A bad shard or sample: the message names the shard, the key and the problem, and what to do.

    Args:
        shard: the shard's path or URL (for ``bad_index``/``unsafe_index_path``: the index file).
        key: the sample key, or None when the problem concerns the whole shard.
        problem: what is wrong.
        reason: the stable reason name (a key of :data:`REASONS`), e.g. ``"non_finite"``.
        hint: what to do; defaults to ``REASONS[reason]``.
        member: the tar member (or, for an index, the entry such as ``shards[3].path``), if known.

    Attributes:
        shard, key, problem, reason, hint, member: as given.
    """

    def __init__(
        self,
        shard: str,
        key: str | None = None,
        problem: str | None = None,
        *,
        reason: str | None = None,
        hint: str | None = None,
        member: str | None = None,
    ) -> None:
        self.shard = str(shard)
        self.key = key
        self.problem = problem
        self.reason = reason
        self.member = member
        self.hint = hint if hint is not None else REASONS.get(reason or "")
        if problem is None and key is None:
            # A single preformatted message: torch's DataLoader re-raises worker exceptions as
            # ``type(exc)(message)``, which must not mangle the text.
            message = self.shard
        else:
            if reason in _INDEX_REASONS:
                where = f"index {self.shard}"
            else:
                where = f"shard {self.shard}" + (f", key {key!r}" if key is not None else " (whole shard)")
            if member is not None and member not in (problem or ""):  # details often name it already
                where += f", member {member!r}"
            message = f"{where}: {problem}" + (f" [{reason}]" if reason else "")
            if self.hint:
                message += f". What to do: {self.hint}"
        super().__init__(message)

    def __reduce__(self):
        return (
            _rebuild_shard_error,
            (self.shard, self.key, self.problem, self.reason, self.hint, self.member),
        )


def _rebuild_shard_error(shard, key, problem, reason, hint, member=None) -> ShardError:
    return ShardError(shard, key, problem, reason=reason, hint=hint, member=member)


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _check_patch(patch_size: Sequence[int] | None) -> _PatchSize | None:
    if patch_size is None:
        return None
    ps = tuple(int(p) for p in patch_size)
    if len(ps) != 3 or any(p < 1 for p in ps):
        raise ValueError(f"patch_size must be three positive integers (pt, ph, pw), got {patch_size!r}")
    return ps  # type: ignore[return-value]


def _tokens(shape: Sequence[int], patch_size: Sequence[int]) -> int:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    return (t // pt) * (h // ph) * (w // pw)


def _divisibility_problem(shape: Sequence[int], patch_size: Sequence[int]) -> str | None:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    bad = [
        f"{n}={v} is not a multiple of {p}" for n, v, p in (("T", t, pt), ("H", h, ph), ("W", w, pw)) if v % p
    ]
    if not bad:
        return None
    return f"latent shape {list(shape)} is not divisible by patch size {list(patch_size)} ({', '.join(bad)})"


# ----------------------------------------------------------------------------------------------------
# .npy headers and values
# ----------------------------------------------------------------------------------------------------


class _NpyError(Exception):
    """A malformed .npy member (never escapes this module)."""


@dataclass
class _Npy:
    member: str
    dtype: np.dtype | None  # None: a descr that is no plain scalar type (structured, datetime, ...)
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # where the array data starts in the member
    data: bytearray | None = None  # the whole member, when read
    descr: Any = None  # the header's descr, for messages


# numpy refuses larger headers by default too (they are parsed with a literal evaluator).
_MAX_NPY_HEADER = 10000


def _parse_npy_header(read: Callable[[int], bytes], size: int, member: str) -> _Npy:
    """Parse a .npy header with a strict literal parser, reading only the header bytes.

    Not numpy's reader: it evaluates the header with ``ast.literal_eval``, which recursion and
    tokenizer errors escape (``RecursionError``, ``tokenize.TokenError``).
    """
    magic = read(8)
    if len(magic) < 8 or magic[:6] != b"\x93NUMPY":
        raise _NpyError(f"{member}: not a .npy file (bad magic bytes {bytes(magic[:6])!r})")
    major, minor = magic[6], magic[7]
    if major == 1:
        len_size = 2
    elif major in (2, 3):
        len_size = 4
    else:
        raise _NpyError(f"{member}: unsupported .npy format version {major}.{minor}")
    raw_len = read(len_size)
    header_len = int.from_bytes(raw_len, "little")
    if len(raw_len) < len_size or header_len > _MAX_NPY_HEADER:
        raise _NpyError(f"{member}: .npy header length {header_len} is invalid (at most {_MAX_NPY_HEADER})")
    header = read(header_len)
    if len(header) < header_len:
        raise _NpyError(f"{member}: .npy header is cut short")
    try:
        dtype, descr, fortran, shape = parse_npy_header(bytes(header), major)
    except Refused as err:
        raise _NpyError(f"{member}: malformed .npy header: {err}") from None
    offset = 8 + len_size + header_len
    if dtype is not None and not dtype.hasobject:
        need = offset + math.prod(shape) * dtype.itemsize
        if need != size:
            raise _NpyError(
                f"{member}: .npy member is {size} bytes but its header (shape {list(shape)}, dtype {dtype}) "
                f"needs {need}"
            )
    return _Npy(member=member, dtype=dtype, shape=shape, fortran=fortran, offset=offset, descr=descr)


def _flat_array(npy: _Npy) -> np.ndarray:
    """The member's data as a 1-d array viewing ``npy.data`` (no copy)."""
    count = math.prod(npy.shape)
    if count == 0:
        return np.empty(0, dtype=npy.dtype)
    return np.frombuffer(npy.data, dtype=npy.dtype, count=count, offset=npy.offset)


# Elements per block of the finiteness scan: small enough that the temporaries stay in cache.
_FINITE_BLOCK = 1 << 18


def _count_non_finite(flat: np.ndarray) -> int:
    """Number of NaN/Inf values of a float16/float32 1-d array."""
    if flat.dtype == np.float16 and flat.dtype.isnative:
        # Exponent bits all set <=> NaN or Inf; integer ops are ~5x faster than np.isfinite on float16.
        bits = flat.view(np.uint16)
        bad = 0
        for start in range(0, bits.size, _FINITE_BLOCK):
            block = bits[start : start + _FINITE_BLOCK]
            bad += int(np.count_nonzero((block & 0x7C00) == 0x7C00))
        return bad
    bad = 0
    for start in range(0, flat.size, _FINITE_BLOCK):
        block = flat[start : start + _FINITE_BLOCK]
        if not np.isfinite(block).all():
            bad += int(np.count_nonzero(~np.isfinite(block)))
    return bad


def _to_tensor(npy: _Npy) -> torch.Tensor:
    """Decode a read member into a tensor sharing the member's buffer where the layout allows."""
    arr = _flat_array(npy)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    arr = arr.reshape(npy.shape, order="F" if npy.fortran else "C")
    if npy.fortran:
        arr = np.ascontiguousarray(arr)
    return torch.from_numpy(arr)


def _dtype_problem(npy: _Npy) -> str | None:
    dt = npy.dtype
    if dt is None:
        kind = "structured dtype" if isinstance(npy.descr, list) else "dtype"
        return f"{npy.member}: {kind} {npy.descr!r} is not float16 or float32"
    if dt.hasobject:
        return f"{npy.member}: dtype object stores pickled Python objects; refused (pickles are never loaded)"
    if dt.kind != "f" or dt.itemsize not in (2, 4) or dt.fields is not None:
        return f"{npy.member}: dtype {dt} is not float16 or float32"
    return None


# ----------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------


def _is_url(path: str) -> bool:
    scheme = urllib.parse.urlparse(path).scheme
    # One-letter schemes are Windows drive letters; file:// is handled as a local path.
    return len(scheme) > 1 and scheme != "file"


def _norm_path(path: str | os.PathLike) -> str:
    """Absolute local path for local paths and file:// URLs; other URLs unchanged."""
    text = os.fspath(path)
    if text.startswith("file:"):
        text = urllib.request.url2pathname(urllib.parse.urlparse(text).path)
    if _is_url(text):
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
            norm = _norm_path(one)
            if not _is_url(norm) and os.path.isdir(norm):
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


def _open_shard(path: str):
    """Open a shard for streaming; local paths directly, URLs through webdataset's gopen.

    Raises:
        OSError: cannot open it, or (local) it is no regular file: a FIFO would block the reader
            forever and a device has no end.
    """
    if _is_url(path):
        from webdataset.gopen import gopen

        try:
            return gopen(path, "rb")
        except ValueError as err:  # an unknown scheme, or webdataset's security switch
            raise OSError(f"cannot open {path!r}: {err}") from None
    return _open_regular(path)


def _open_regular(path: str):
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


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except Exception as err:  # noqa: BLE001 - a pipe closed early exits with SIGPIPE
        log.debug("closing %r after an early stop or an error: %s", stream, err)


# ----------------------------------------------------------------------------------------------------
# The streaming scanner shared by the index builder and the reader
# ----------------------------------------------------------------------------------------------------


_STREAM_CHUNK = 1 << 22  # bytes read at a time from a stream
_READS_AT_END = 64  # reads that may return nothing before the stream counts as cut short


class _StreamSource:
    """A non-seekable shard stream (pipe, URL), read with tarfile's stream mode.

    It remembers the last chunks read. Why: tarfile's stream mode ends iteration silently both at the
    end-of-archive marker and at a truncated or garbled header; the bytes at ``TarFile.offset`` tell
    them apart.
    """

    def __init__(self, raw) -> None:
        self.raw = raw
        self.pos = 0
        self.chunks: deque[tuple[int, bytes]] = deque(maxlen=4)
        self.reads_at_end = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        if data:
            self.chunks.append((self.pos, data))
            self.pos += len(data)
        else:
            # tarfile skips a member in stream mode with one read per 10 KiB of its claimed size, even
            # past the end: a header claiming 2**80 bytes would loop for ever. Stop it here.
            self.reads_at_end += 1
            if self.reads_at_end > _READS_AT_END:
                raise EOFError(f"the stream ended at byte {self.pos}; a member claims more data")
        return data

    def open_tar(self) -> tarfile.TarFile:
        return tarfile.open(fileobj=self, mode="r|", tarinfo=CheckedTarInfo)

    def read_member(self, tf: tarfile.TarFile, info: tarfile.TarInfo) -> bytearray:
        # The stream's length is unknown: read in bounded chunks, so that memory follows the bytes
        # that actually arrive, never the size the header claims.
        f = tf.extractfile(info)
        if info.size <= _STREAM_CHUNK:  # the usual latent: one buffer, one copy, as large as a chunk at most
            buf = bytearray(info.size)
            if f.readinto(buf) != info.size:
                raise tarfile.ReadError(f"unexpected end of data in {info.name}")
            return buf
        chunks, got = [], 0
        while got < info.size:
            chunk = f.read(min(_STREAM_CHUNK, info.size - got))
            if not chunk:
                raise tarfile.ReadError(f"unexpected end of data in {info.name}")
            chunks.append(chunk)
            got += len(chunk)
        return bytearray(chunks[0]) if len(chunks) == 1 else bytearray().join(chunks)

    def member_reader(self, tf: tarfile.TarFile, info: tarfile.TarInfo) -> Callable[[int], bytes]:
        return tf.extractfile(info).read

    def block_at(self, offset: int, size: int) -> bytes:
        parts = []
        for start, data in self.chunks:
            lo, hi = max(offset, start), min(offset + size, start + len(data))
            if lo < hi:
                parts.append(data[lo - start : hi - start])
        return b"".join(parts)

    def drain(self) -> int:
        """Read to the end (padding after the end marker); returns the total byte count."""
        while True:
            data = self.raw.read(1 << 20)
            if not data:
                return self.pos
            self.pos += len(data)


class _FileSource:
    """A local shard file, read with tarfile's random-access mode, members in file order.

    Why not stream mode here: a member's data is then read with one ``readinto`` at
    ``TarInfo.offset_data`` (a single copy, ~2x faster for large latents), and data that is not wanted
    is seeked over instead of read.
    """

    def __init__(self, raw) -> None:
        self.raw = raw
        self.pos = os.fstat(raw.fileno()).st_size  # for messages: where the data ends

    def open_tar(self) -> tarfile.TarFile:
        return tarfile.open(fileobj=self.raw, mode="r:", tarinfo=CheckedTarInfo)

    def read_member(self, tf: tarfile.TarFile, info: tarfile.TarInfo) -> bytearray:
        if info.offset_data + info.size > self.pos:  # _scan checks this first; allocate nothing on a lie
            raise tarfile.ReadError(f"unexpected end of data in {info.name}")
        buf = bytearray(info.size)
        self.raw.seek(info.offset_data)
        got = self.raw.readinto(buf)
        if got != info.size:
            raise tarfile.ReadError(f"unexpected end of data in {info.name}")
        return buf

    def member_reader(self, tf: tarfile.TarFile, info: tarfile.TarInfo) -> Callable[[int], bytes]:
        self.raw.seek(info.offset_data)
        left = [info.size]

        def read(n: int) -> bytes:
            data = self.raw.read(min(n, left[0]))
            left[0] -= len(data)
            return data

        return read

    def block_at(self, offset: int, size: int) -> bytes:
        self.raw.seek(offset)
        return self.raw.read(size)

    def drain(self) -> int:
        return self.pos


def _source(path: str, raw) -> _StreamSource | _FileSource:
    if not _is_url(path):
        try:
            if raw.seekable():
                return _FileSource(raw)
        except (AttributeError, OSError):
            pass
    return _StreamSource(raw)


_SKIP, _HEADERS, _DATA = 0, 1, 2  # how much of a sample to read


@dataclass
class _Group:
    """The members of one sample, as far as they were read."""

    key: str
    mode: int
    members: dict[str, str] = field(default_factory=dict)  # extension -> member name
    latent: _Npy | None = None
    text: _Npy | None = None
    meta: Any = None
    problem: tuple[str, str] | None = None  # (reason, detail), the first one found
    problem_member: str | None = None  # the member it concerns, if one

    def fail(self, reason: str, detail: str, member: str | None = None) -> None:
        if self.problem is None:
            self.problem = (reason, detail)
            self.problem_member = member


@dataclass
class _Ignored:
    reason: str
    member: str
    key: str | None


@dataclass
class _ShardProblem:
    reason: str
    detail: str
    key: str | None
    member: str | None = None


class _TarDamage(Exception):
    """tarfile could not parse a header: ends the scan with ``reason``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# What tarfile's header parsing raises on hostile input besides TarError: int() of garbage numbers,
# nti() of cut blocks, GNU sparse maps, recursion on chained headers.
_TAR_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeError, RecursionError)


def _next_member(tf: tarfile.TarFile) -> tarfile.TarInfo | None:
    try:
        return tf.next()
    except Refused as err:
        raise _TarDamage(err.reason or "corrupt_tar", str(err)) from None
    except tarfile.TarError:
        raise
    except _TAR_PARSE_ERRORS as err:
        raise _TarDamage("corrupt_tar", f"unreadable tar header ({type(err).__name__}: {err})") from None


def _human_size(n: int) -> str:
    return f"{n} bytes ({n / (1 << 30):.2f} GiB)" if n >= 1 << 30 else f"{n} bytes"


def _split_member(name: str) -> tuple[str | None, str]:
    """(key, lower-case extension) the way webdataset groups members; key None if there is none.

    The key may still break the key rules (e.g. ``../../evil``); the caller checks with key_problem.
    """
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None, ""
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _read_npy(
    src: _StreamSource | _FileSource, tf: tarfile.TarFile, info: tarfile.TarInfo, want_data: bool
) -> _Npy:
    if want_data:
        data = src.read_member(tf, info)
        view = memoryview(data)
        cursor = [0]

        def read(n: int) -> bytes:
            out = view[cursor[0] : cursor[0] + n]
            cursor[0] += len(out)
            return out

        npy = _parse_npy_header(read, info.size, info.name)
        npy.data = data
        return npy
    return _parse_npy_header(src.member_reader(tf, info), info.size, info.name)


def _finalize(group: _Group, patch_size: _PatchSize | None, check_values: bool) -> None:
    """Structural and value checks of a complete sample; records the first problem on the group."""
    if group.mode == _SKIP or group.problem is not None:
        return
    latent, text = group.latent, group.text
    if latent is None:
        members = sorted(group.members.values())
        dotted = [m for e, m in sorted(group.members.items()) if e.endswith("." + _LATENT)]
        if dotted:  # webdataset's key ends at the first dot: 'clip.v1.latent.npy' is key 'clip'
            group.fail(
                "missing_latent",
                f"member {dotted[0]!r} has a dot in its key: keys cannot contain dots (the key ends at the "
                f"first dot, so this is key {group.key!r} with extension "
                f"{dotted[0].rsplit('/', 1)[-1].partition('.')[2]!r}); rename the sample's members without it",
                dotted[0],
            )
            return
        group.fail(
            "missing_latent",
            f"no '{group.key}.{_LATENT}' member (the sample has {members})",
            members[0] if members else None,
        )
        return
    for npy, ndim, layout in ((latent, 4, "(C, T, H, W)"), (text, 2, "(L, D_text)")):
        if npy is None:
            continue
        problem = _dtype_problem(npy)
        if problem is not None:
            group.fail("bad_dtype", problem, npy.member)
            return
        if len(npy.shape) != ndim:
            group.fail(
                "bad_ndim",
                f"{npy.member}: shape {list(npy.shape)} has {len(npy.shape)} dims, expected {ndim} {layout}",
                npy.member,
            )
            return
    if min(latent.shape) < 1 or (text is not None and text.shape[1] < 1):
        bad = latent if min(latent.shape) < 1 else text
        group.fail("bad_shape", f"{bad.member}: shape {list(bad.shape)} has an empty dimension", bad.member)
        return
    if patch_size is not None:
        problem = _divisibility_problem(latent.shape, patch_size)
        if problem is not None:
            group.fail("not_divisible", f"{latent.member}: {problem}", latent.member)
            return
    if check_values and group.mode == _DATA:
        for npy in (latent, text):
            if npy is None:
                continue
            flat = _flat_array(npy)
            bad = _count_non_finite(flat)
            if bad:
                group.fail(
                    "non_finite", f"{npy.member}: {bad} of {flat.size} values are NaN or Inf", npy.member
                )
                return


def _scan(
    src: _StreamSource | _FileSource,
    mode_for: Callable[[str], int],
    patch_size: _PatchSize | None,
    check_values: bool,
    max_member_bytes: int | None = None,
) -> Iterator[_Group | _Ignored | _ShardProblem]:
    """Stream one tar and yield its samples (checked) and what was ignored, in file order.

    ``mode_for(key)`` is asked when a sample starts: _SKIP passes it over unread, _HEADERS reads the
    .npy headers and the json, _DATA reads everything. Tar-level damage ends the scan with the open
    sample failed as ``truncated_tar``/``corrupt_tar`` (or a _ShardProblem when no sample is open).
    A member is read only after its claimed size was checked against ``max_member_bytes`` (default
    :data:`MAX_MEMBER_BYTES`) and, for local files, against the bytes the file holds.
    """
    cap = MAX_MEMBER_BYTES if max_member_bytes is None else int(max_member_bytes)
    try:
        tf = src.open_tar()
    except OSError as err:  # a pipe or download that failed before the first block
        yield _ShardProblem("unreadable_shard", f"cannot read the shard ({err})", None)
        return
    except Refused as err:
        yield _ShardProblem(err.reason or "corrupt_tar", str(err), None)
        return
    except (tarfile.ReadError, *_TAR_PARSE_ERRORS) as err:
        if src.pos == 0:
            return  # a 0-byte file: an empty shard
        head = src.block_at(0, 4)
        if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:4] == b"\xfd7zX":
            detail = "the file is compressed (gzip/bzip2/xz); shards must be plain tar: decompress it"
        elif src.pos < tarfile.BLOCKSIZE:
            yield _ShardProblem(
                "truncated_tar", f"the file is only {src.pos} bytes, less than one tar header", None
            )
            return
        else:
            detail = f"not a tar file ({err})"
        yield _ShardProblem("corrupt_tar", detail, None)
        return

    seen: set[str] = set()
    group: _Group | None = None
    last_offset = -1
    try:
        while (info := _next_member(tf)) is not None:
            tf.members = []  # tarfile would otherwise keep every TarInfo of the shard
            if info.size < 0 or info.offset <= last_offset:
                # A pax "size" can be negative: tarfile would then read the same headers forever.
                raise _TarDamage(
                    "corrupt_tar", f"tar header of {info.name!r} at byte {info.offset} has size {info.size}"
                )
            last_offset = info.offset
            sparse = info.sparse is not None or info.type == tarfile.GNUTYPE_SPARSE
            if not info.isreg() and not sparse:
                if group is None or group.mode != _SKIP:
                    yield _Ignored("non_file_member", info.name, None)
                continue
            key, ext = _split_member(info.name)
            if key is None:
                yield _Ignored("bad_member_name", info.name, None)
                continue
            if group is None or key != group.key:
                if group is not None:
                    _finalize(group, patch_size, check_values)
                    yield group
                group = _Group(key=key, mode=mode_for(key))
                rule = key_problem(key) if group.mode != _SKIP else None
                if rule is not None:  # such a sample is never read, only reported
                    group.fail("bad_key", f"member {info.name!r}: key {key!r} {rule}", info.name)
                elif key in seen:
                    group.fail(
                        "duplicate_key",
                        f"key {key!r} appears again at member {info.name!r} (non-contiguous)",
                        info.name,
                    )
                seen.add(key)
            if group.mode == _SKIP:
                continue
            if ext in group.members:
                group.fail("duplicate_key", f"member {info.name!r} appears twice in the sample", info.name)
                continue
            group.members[ext] = info.name
            if ext.rsplit(".", 1)[-1] in _PICKLE_SUFFIXES:
                yield _Ignored("pickle_member", info.name, key)
                continue
            if ext not in (_LATENT, _TEXT, _META):
                yield _Ignored("unknown_extension", info.name, key)
                continue
            if sparse:
                group.fail(
                    "sparse_member",
                    f"member {info.name!r} is a GNU sparse file (its data has holes); not read",
                    info.name,
                )
                continue
            if group.problem is not None:
                continue  # refused anyway: do not read the data
            if info.size > cap:
                group.fail(
                    "member_too_large",
                    f"member {info.name!r} claims {_human_size(info.size)}, more than max_member_bytes={cap}",
                    info.name,
                )
                continue
            if isinstance(src, _FileSource) and info.offset_data + info.size > src.pos:
                group.fail(
                    "truncated_tar",
                    f"member {info.name!r} claims {_human_size(info.size)} but the file ends "
                    f"{max(src.pos - info.offset_data, 0)} bytes after its header",
                    info.name,
                )
                break  # no member can follow: the tar ends inside this one
            if ext in (_LATENT, _TEXT):
                try:
                    npy = _read_npy(src, tf, info, want_data=group.mode == _DATA)
                except _NpyError as err:
                    group.fail("bad_npy", str(err), info.name)
                    continue
                if ext == _LATENT:
                    group.latent = npy
                else:
                    group.text = npy
            else:
                json_cap = _untrusted.MAX_JSON_BYTES
                if info.size > json_cap:
                    group.fail(
                        "bad_json",
                        f"{info.name}: {info.size} bytes, more than the {json_cap} allowed",
                        info.name,
                    )
                    continue
                try:
                    meta = load_json(src.read_member(tf, info))
                except Refused as err:
                    group.fail("bad_json", f"{info.name}: JSON {err}", info.name)
                    continue
                if not isinstance(meta, dict):
                    group.fail(
                        "bad_json", f"{info.name}: JSON is a {type(meta).__name__}, not an object", info.name
                    )
                    continue
                group.meta = meta
    except (tarfile.TarError, EOFError, OSError, _TarDamage) as err:
        if isinstance(err, _TarDamage):
            reason, detail = err.reason, err.detail
        else:
            reason, detail = "truncated_tar", f"tar stream ends or breaks ({err})"
        if group is not None and group.mode != _SKIP:
            earlier = group.problem
            group.fail(reason, detail)
            yield group
            if earlier is not None and earlier[0] != reason:
                # The sample failed for its own reason first; the damage that ends the shard (and may
                # hide later samples) is still counted.
                yield _ShardProblem(reason, detail, group.key)
        else:  # a sample the caller does not read still must not hide the damage
            yield _ShardProblem(reason, detail, None if group is None else group.key)
            if group is not None:
                yield group
        return
    if group is not None and group.problem is not None and group.problem[0] == "truncated_tar":
        yield group  # stopped inside a member that runs past the end of the file
        return
    end = src.block_at(tf.offset, 2 * tarfile.BLOCKSIZE)
    problem = None
    if len(end) < tarfile.BLOCKSIZE:
        problem = ("truncated_tar", f"the file ends at byte {src.pos} without the tar end-of-archive marker")
    elif end[: tarfile.BLOCKSIZE].count(0) != tarfile.BLOCKSIZE:
        problem = ("corrupt_tar", f"invalid tar header at byte {tf.offset}")
    elif len(end) == 2 * tarfile.BLOCKSIZE and end[tarfile.BLOCKSIZE :].count(0) != tarfile.BLOCKSIZE:
        # A lone zero block ends tarfile's reading; whatever follows would be hidden from the index.
        problem = ("corrupt_tar", f"a lone zero block at byte {tf.offset} hides the members after it")
    if group is not None and group.mode != _SKIP:
        if problem is not None:
            # The last sample may have lost members after the cut: refuse it rather than guess.
            group.fail(*problem)
        _finalize(group, patch_size, check_values)
        yield group
    else:
        if problem is not None:
            yield _ShardProblem(problem[0], problem[1], None if group is None else group.key)
        if group is not None:
            yield group


# ----------------------------------------------------------------------------------------------------
# The index
# ----------------------------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    """What the index knows of one shard.

    Attributes:
        path: the shard's path (absolute local path) or URL.
        keys: keys of the valid samples, in file order; a sample id is a position in this list.
        latent_shapes: (C, T, H, W) of each valid sample's latent.
        text_lengths: L of each sample's text states, 0 without text.
        num_bytes: the shard file's size in bytes (checked against the file to detect a stale index).
        skipped: samples (or the whole shard, key None) left out under ``on_error="skip"``:
            ``{"key": str | None, "reason": str, "detail": str}``.
        ignored: members ignored but counted, reason -> count (``unknown_extension``, ...).
    """

    path: str
    keys: list[str]
    latent_shapes: list[tuple[int, int, int, int]]
    text_lengths: list[int]
    num_bytes: int
    skipped: list[dict[str, Any]] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        """Number of valid samples."""
        return len(self.keys)

    @property
    def empty(self) -> bool:
        """True when the shard holds no sample at all (neither valid nor skipped)."""
        return not self.keys and not self.skipped

    def _drop(self, positions: Collection[int], reason: str, details: dict[int, str]) -> None:
        for pos in sorted(positions):
            self.skipped.append({"key": self.keys[pos], "reason": reason, "detail": details[pos]})
        keep = [i for i in range(len(self.keys)) if i not in positions]
        self.keys = [self.keys[i] for i in keep]
        self.latent_shapes = [self.latent_shapes[i] for i in keep]
        self.text_lengths = [self.text_lengths[i] for i in keep]


_MAX_DIM = (1 << 31) - 1  # no latent dimension or text length is larger; bigger numbers are damage


def _is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON 1e999 or true must not pass as a number


class _IndexProblem(Exception):
    def __init__(self, where: str, detail: str, reason: str = "bad_index") -> None:
        super().__init__(detail)
        self.where, self.detail, self.reason = where, detail, reason


def _int_list(value: Any, where: str, lo: int, hi: int, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        want = "a list" if n is None else f"a list of {n}"
        raise _IndexProblem(where, f"must be {want} integers, got {_describe(value)}")
    for v in value:
        if not _is_int(v) or not lo <= v <= hi:
            raise _IndexProblem(where, f"holds {_describe(v)}; expected integers in [{lo}, {hi}]")
    return value


def _all_ints_in(rows: list, lo: int, hi: int, n: int) -> bool:
    """True when every row is a list of ``n`` ints in [lo, hi] (one pass over the flattened values)."""
    if not all(type(r) is list and len(r) == n for r in rows):
        return False
    flat = [v for r in rows for v in r]
    return not flat or (set(map(type, flat)) == {int} and lo <= min(flat) and max(flat) <= hi)


def _describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _shard_info_from_json(
    entry: Any,
    i: int,
    root: str | None,
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> ShardInfo:
    """One checked ``shards[i]`` entry; raises _IndexProblem naming the field and the rule."""
    where = f"shards[{i}]"
    if not isinstance(entry, dict):
        raise _IndexProblem(where, f"must be an object, got {_describe(entry)}")
    try:
        path = check_index_path(
            entry.get("path"), root, allow_schemes=allow_schemes, allow_outside=allow_outside
        )
    except Refused as err:
        raise _IndexProblem(f"{where}.path", str(err), err.reason or "bad_index") from None
    keys = entry.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _IndexProblem(f"{where}.keys", f"must be a list of strings, got {_describe(keys)}")
    n = entry.get("num_samples", len(keys))
    if not _is_int(n) or n != len(keys):
        raise _IndexProblem(f"{where}.num_samples", f"is {_describe(n)} but keys has {len(keys)} entries")
    shapes = entry.get("latent_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(keys):
        raise _IndexProblem(
            f"{where}.latent_shapes",
            f"num_samples ({n}), keys ({len(keys)}) and latent_shapes "
            f"({len(shapes) if isinstance(shapes, list) else _describe(shapes)}) disagree",
        )
    if not _all_ints_in(shapes, 1, _MAX_DIM, 4):  # the fast check; the loop names the bad one
        for j, shape in enumerate(shapes):
            _int_list(shape, f"{where}.latent_shapes[{j}]", 1, _MAX_DIM, 4)
    text_lengths = entry.get("text_lengths", [0] * len(keys))
    if not (isinstance(text_lengths, list) and _all_ints_in([text_lengths], 0, _MAX_DIM, len(keys))):
        _int_list(text_lengths, f"{where}.text_lengths", 0, _MAX_DIM, len(keys))
    num_bytes = entry.get("bytes", -1)
    if num_bytes is None:
        num_bytes = -1
    if not _is_int(num_bytes) or not -1 <= num_bytes < 1 << 63:
        raise _IndexProblem(f"{where}.bytes", f"is {_describe(num_bytes)}, not a file size in bytes")
    skipped = entry.get("skipped", [])
    if not isinstance(skipped, list):
        raise _IndexProblem(f"{where}.skipped", f"must be a list, got {_describe(skipped)}")
    for j, e in enumerate(skipped):
        if (
            not isinstance(e, dict)
            or not (e.get("key") is None or isinstance(e.get("key"), str))
            or e.get("reason") not in REASONS
            or not isinstance(e.get("detail", ""), str)
        ):
            raise _IndexProblem(
                f"{where}.skipped[{j}]",
                f"must be {{'key': str | null, 'reason': <a reason of REASONS>, 'detail': str}}, got {_describe(e)}",
            )
    ignored = entry.get("ignored", {})
    if not isinstance(ignored, dict) or not all(_is_int(v) and v >= 0 for v in ignored.values()):
        raise _IndexProblem(f"{where}.ignored", f"must map reasons to counts, got {_describe(ignored)}")
    return ShardInfo(
        path=path,
        keys=list(keys),
        latent_shapes=[tuple(s) for s in shapes],  # type: ignore[misc]
        text_lengths=list(text_lengths),
        num_bytes=num_bytes,
        skipped=[dict(e) for e in skipped],
        ignored=dict(ignored),
    )


def _read_capped(f, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``f``, in chunks: ``read(n)`` would allocate n bytes up front."""
    chunks, got = [], 0
    while got <= limit:
        chunk = f.read(min(_STREAM_CHUNK, limit + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_bytes(path: str, limit: int) -> bytes:
    """The content of a (local or remote) index file, refused beyond ``limit`` bytes."""
    if _is_url(path):
        if urllib.parse.urlparse(path).scheme in ("http", "https"):
            # Not gopen: its curl retries for a minute on a missing file.
            with urllib.request.urlopen(path, timeout=10) as resp:  # noqa: S310 - user-given data URL
                data = _read_capped(resp, limit)
        else:
            from webdataset.gopen import gopen

            with gopen(path, "rb") as f:
                data = _read_capped(f, limit)
    else:
        with _open_regular(path) as f:
            data = _read_capped(f, limit)
    if len(data) > limit:
        raise ShardError(
            path,
            None,
            f"the file is larger than max_index_bytes={limit}",
            reason="bad_index",
            hint="raise lightning_adaptiveload.data.untrusted.MAX_INDEX_BYTES if the index is genuine, else rebuild it",
        )
    return data


@dataclass
class ShardIndex:
    """Per-shard sample keys and latent shapes: what every rank plans an epoch from.

    A sample reference is ``(shard_id, sample_id)``: positions in :attr:`shards` and in that shard's
    ``keys``.

    Attributes:
        shards: one :class:`ShardInfo` per shard, in the order given.
        patch_size: the patch size (pt, ph, pw) the latent shapes were checked against, or None.
        values_checked: True when every listed sample's values were checked finite.
        metadata: free-form extra data saved with the index (e.g. synthetic-data settings).
        source: the file the index was loaded from or last saved to, or None.
    """

    shards: list[ShardInfo]
    patch_size: _PatchSize | None = None
    values_checked: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    # -- summaries -------------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Valid samples in all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def paths(self) -> list[str]:
        """Shard paths or URLs, by shard id."""
        return [s.path for s in self.shards]

    def sample_refs(self) -> list[tuple[int, int]]:
        """All sample references ``(shard_id, sample_id)`` in index order."""
        return [(i, j) for i, s in enumerate(self.shards) for j in range(s.num_samples)]

    def latent_shape(self, ref: tuple[int, int]) -> tuple[int, int, int, int]:
        """The latent shape (C, T, H, W) of the sample ``ref = (shard_id, sample_id)``."""
        return self.shards[ref[0]].latent_shapes[ref[1]]

    def total_tokens(self, patch_size: Sequence[int] = _DEFAULT_PATCH) -> int:
        """Sum over samples of T/pt * H/ph * W/pw."""
        return sum(_tokens(shape, patch_size) for s in self.shards for shape in s.latent_shapes)

    def counts(self) -> dict[str, int]:
        """Problems and ignored members by reason: skipped samples/shards, ``empty_shard``, ignored members."""
        out: Counter[str] = Counter()
        for s in self.shards:
            out.update(entry["reason"] for entry in s.skipped)
            out.update(s.ignored)
            if s.empty:
                out["empty_shard"] += 1
        return dict(out)

    def skipped(self) -> list[dict[str, Any]]:
        """Every skipped sample or shard: ``{"shard": path, "key", "reason", "detail"}``."""
        return [{"shard": s.path, **entry} for s in self.shards for entry in s.skipped]

    # -- persistence -----------------------------------------------------------------------------------

    def to_dict(self, relative_to: str | None = None) -> dict[str, Any]:
        """The ``index.json`` content; shard paths under ``relative_to`` (a directory) are made relative."""
        shards = []
        for s in self.shards:
            path = s.path
            if relative_to is not None and not _is_url(path):
                rel = os.path.relpath(path, relative_to)
                if not rel.startswith(os.pardir):
                    path = rel.replace(os.sep, "/")
            entry: dict[str, Any] = {
                "path": path,
                "num_samples": s.num_samples,
                "bytes": s.num_bytes,
                "keys": s.keys,
                "latent_shapes": [list(x) for x in s.latent_shapes],
                "text_lengths": s.text_lengths,
            }
            if s.skipped:
                entry["skipped"] = s.skipped
            if s.ignored:
                entry["ignored"] = s.ignored
            shards.append(entry)
        return {
            "version": INDEX_VERSION,
            "patch_size": None if self.patch_size is None else list(self.patch_size),
            "values_checked": self.values_checked,
            "metadata": self.metadata,
            "shards": shards,
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write ``index.json`` atomically (temp file + rename); shard paths beside it become relative.

        Returns:
            The absolute path written.
        """
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        data = self.to_dict(relative_to=folder)
        shards = data.pop("shards")
        outside = [e["path"] for e in shards if os.path.isabs(e["path"]) or _is_url(e["path"])]
        if outside:
            log.warning(
                "index %s names %d shards outside its folder (e.g. %s); loading it will need "
                "allow_outside=True or allow_schemes=[...]",
                path,
                len(outside),
                outside[0],
            )
        head = json.dumps(data)[:-1]
        # One shard per line: readable and diffable, still compact for large data sets.
        body = ",\n".join(json.dumps(s, separators=(",", ":")) for s in shards)
        text = f'{head}, "shards": [\n{body}\n]}}\n'
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.source = path
        return path

    @classmethod
    def from_dict(
        cls,
        data: Any,
        source: str = "<dict>",
        root: str | None = None,
        *,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """Validate and convert the ``index.json`` content; relative shard paths resolve against ``root``.

        Every field is type- and range-checked; shard paths follow the rules of :meth:`load` (with
        ``root=None`` local paths are taken as given, as there is no folder to stay in).

        Raises:
            ShardError: ``bad_index`` or ``unsafe_index_path``, naming ``source`` and the entry.
        """
        if "pipe" in {str(s).lower() for s in allow_schemes}:
            raise ValueError("allow_schemes cannot hold 'pipe': commands are never taken from an index")
        try:
            if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
                raise _IndexProblem("shards", "the index must be an object with a 'shards' list")
            if not _is_int(data.get("version")) or data.get("version") != INDEX_VERSION:
                raise _IndexProblem(
                    "version", f"version {data.get('version')!r} is not supported (expected {INDEX_VERSION})"
                )
            patch = data.get("patch_size")
            if patch is not None:
                _int_list(patch, "patch_size", 1, _MAX_DIM, 3)
            if not isinstance(data.get("values_checked", False), bool):
                raise _IndexProblem(
                    "values_checked", f"must be true or false, got {_describe(data['values_checked'])}"
                )
            metadata = data.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise _IndexProblem("metadata", f"must be an object, got {_describe(metadata)}")
            shards = [
                _shard_info_from_json(e, i, root, allow_schemes, allow_outside)
                for i, e in enumerate(data["shards"])
            ]
        except _IndexProblem as err:
            raise ShardError(source, None, err.detail, reason=err.reason, member=err.where) from None
        return cls(
            shards=shards,
            patch_size=_check_patch(patch),
            values_checked=data.get("values_checked", False),
            metadata=dict(metadata),
            source=source,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """Load an ``index.json`` (local path, ``file://`` or URL); relative shard paths resolve beside it.

        An index is data, never a command: its shard paths may name files in its own folder (for a
        remote index, URLs under its folder), nothing else unless you opt in. ``pipe:`` paths are
        always refused; list such shards yourself (``for_paths(["pipe:..."])``, ``train_shards``).

        Args:
            path: the index file (a ``pipe:`` source you write is allowed here, as for shards).
            allow_schemes: URL schemes an entry may name anywhere, e.g. ``["https", "s3"]``.
            allow_outside: accept local paths (and same-scheme URLs) outside the index's folder.

        Raises:
            FileNotFoundError: no such file.
            ShardError: (a ``ValueError``) ``bad_index`` when the file is not a valid version-1 index
                (larger than :data:`~lightning_adaptiveload.data.untrusted.MAX_INDEX_BYTES`, nested too deep,
                wrong types or values), ``unsafe_index_path`` for a path outside what is allowed; the
                message names the file and the entry.
        """
        text = os.fspath(path)
        if not _is_url(text):
            text = _norm_path(text)
        raw = _read_bytes(text, _untrusted.MAX_INDEX_BYTES)
        try:
            data = load_json(raw, finite=False)  # a 1e999 is then named by the field check
        except Refused as err:
            raise ShardError(text, None, f"not valid JSON: the file {err}", reason="bad_index") from None
        if not _is_url(text):
            root = os.path.dirname(text)
        elif urllib.parse.urlparse(text).scheme in urllib.parse.uses_relative:
            root = text.rsplit("/", 1)[0] + "/"
        else:  # e.g. an index read through a pipe: has no folder; relative paths mean the working directory
            root = os.getcwd()
        return cls.from_dict(
            data, source=text, root=root, allow_schemes=allow_schemes, allow_outside=allow_outside
        )

    # -- building ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        progress: bool = True,
        *,
        patch_size: Sequence[int] | None = _DEFAULT_PATCH,
        on_error: str = "raise",
        check_values: bool = True,
        num_workers: int = 1,
        max_member_bytes: int | None = None,
    ) -> ShardIndex:
        """Index shards in one streaming pass, checking every sample.

        Reads tar headers, ``.npy`` headers (dtype and shape, without the data) and the json members;
        with ``check_values`` also the array data, to refuse NaN and Inf. Never unpickles.

        Args:
            paths: shard paths, URLs, brace patterns or directories (see :func:`expand_paths`).
            progress: show a tqdm bar over the shards.
            patch_size: (pt, ph, pw) the latent T, H, W must be divisible by; None to skip that check.
            on_error: ``"raise"`` a :class:`ShardError` at the first problem, or ``"skip"``: leave the
                sample (or shard) out, record it in ``ShardInfo.skipped`` and log a warning.
            check_values: also check that every latent and text array is finite (reads all data).
            num_workers: shards indexed in parallel (threads; helps with remote shards).
            max_member_bytes: the largest member read (``member_too_large`` beyond it); None:
                :data:`MAX_MEMBER_BYTES`.

        Returns:
            The index; shard order is the order of ``paths``.

        Raises:
            ShardError: under ``on_error="raise"``, naming the shard, key and problem.
        """
        _check_on_error(on_error)
        patch = _check_patch(patch_size)
        shard_paths = expand_paths(paths)
        infos = _index_shards(
            shard_paths, patch, on_error, check_values, progress, num_workers, max_member_bytes
        )
        index = cls(shards=infos, patch_size=patch, values_checked=check_values)
        _check_cross_duplicates(index.shards, on_error)
        _report(index, on_error)
        return index

    @classmethod
    def for_paths(
        cls,
        paths_or_pattern: str | os.PathLike | Iterable[str | os.PathLike],
        patch_size: Sequence[int] | None = _DEFAULT_PATCH,
        on_error: str = "raise",
        *,
        check_values: bool = True,
        progress: bool = True,
        save: bool | str | os.PathLike = False,
        index_path: str | os.PathLike | None = None,
        num_workers: int = 1,
        max_member_bytes: int | None = None,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """The index of these shards: from ``index.json`` beside them where it covers them, else built.

        An index entry covers a shard when its path matches and (for local files) its recorded size
        equals the file's size; entries of an index whose patch size or value check differ from the
        request are re-checked in memory or rebuilt. Shards not covered are indexed in one pass
        (:meth:`build`, with a progress bar).

        Args:
            paths_or_pattern: shard paths, URLs, brace patterns or directories, or the path of an
                ``index.json`` (then its shards are used).
            patch_size: (pt, ph, pw) latents must be divisible by, or None.
            on_error: ``"raise"`` or ``"skip"`` (see :meth:`build`); a loaded index's recorded skips
                raise under ``"raise"``.
            check_values: require every sample's values checked finite.
            progress: tqdm bar while building.
            save: True to write the resulting index as ``index.json`` beside the shards (all local, one
                directory), or a path to write it to.
            index_path: an index file to use instead of looking beside the shards.
            num_workers: shards indexed in parallel when building.
            max_member_bytes: see :meth:`build`.
            allow_schemes, allow_outside: what the shard paths of a loaded index may name (see
                :meth:`load`). An index found beside the shards that breaks these rules (or is damaged)
                is ignored with a warning and the shards are indexed again; one you name (an
                ``index.json`` as ``paths_or_pattern``, or ``index_path``) raises.

        Returns:
            The index, shard order as given.

        Raises:
            ShardError: under ``on_error="raise"``.
        """
        _check_on_error(on_error)
        patch = _check_patch(patch_size)
        given = os.fspath(paths_or_pattern) if isinstance(paths_or_pattern, str | os.PathLike) else None
        if index_path is None and given is not None and given.endswith(".json") and "{" not in given:
            index_path = given
            shard_paths = cls.load(given, allow_schemes=allow_schemes, allow_outside=allow_outside).paths
        else:
            shard_paths = expand_paths(paths_or_pattern)
        known = _load_indexes(shard_paths, index_path, allow_schemes, allow_outside)
        infos: list[ShardInfo | None] = []
        todo: list[int] = []
        for i, path in enumerate(shard_paths):
            found = known.get(path)
            info = _usable(found, path, patch, check_values) if found is not None else None
            infos.append(info)
            if info is None:
                todo.append(i)
        if todo:
            if len(todo) < len(shard_paths):
                log.info(
                    "index covers %d of %d shards; indexing the other %d",
                    len(shard_paths) - len(todo),
                    len(shard_paths),
                    len(todo),
                )
            built = _index_shards(
                [shard_paths[i] for i in todo],
                patch,
                on_error,
                check_values,
                progress,
                num_workers,
                max_member_bytes,
            )
            for i, info in zip(todo, built):
                infos[i] = info
        index = cls(shards=[i for i in infos if i is not None], patch_size=patch, values_checked=check_values)
        if patch is not None:
            _apply_patch_check(index.shards, patch, on_error)
        _check_cross_duplicates(index.shards, on_error)
        if on_error == "raise":
            for s in index.shards:
                for entry in s.skipped:
                    raise ShardError(
                        s.path,
                        entry.get("key"),
                        f"{entry.get('detail')} (recorded in the index)",
                        reason=entry.get("reason"),
                    )
        _report(index, on_error)
        if save:
            if save is True:
                folders = {os.path.dirname(p) for p in index.paths if not _is_url(p)}
                if len(folders) != 1 or any(_is_url(p) for p in index.paths):
                    raise ValueError(
                        "save=True needs local shards in one directory; pass the index path as save="
                    )
                target = os.path.join(folders.pop(), INDEX_NAME)
            else:
                target = os.fspath(save)
            index.save(target)
        return index


def _load_indexes(
    shard_paths: list[str],
    index_path: str | os.PathLike | None,
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> dict[str, tuple[ShardInfo, ShardIndex]]:
    """Entries of the index files that may cover ``shard_paths``: normalised path -> (entry, its index)."""
    if index_path is not None:
        candidates = [os.fspath(index_path)]
    else:
        candidates = []
        for p in shard_paths:
            if _is_url(p):
                if urllib.parse.urlparse(p).scheme not in ("http", "https"):
                    continue  # pipe: and friends have no "beside"
                cand = p.rsplit("/", 1)[0] + "/" + INDEX_NAME
            else:
                cand = os.path.join(os.path.dirname(p), INDEX_NAME)
            if cand not in candidates:
                candidates.append(cand)
    known: dict[str, tuple[ShardInfo, ShardIndex]] = {}
    for cand in candidates:
        if not _is_url(cand) and not os.path.exists(cand):
            if index_path is not None:
                raise FileNotFoundError(f"index file {cand} does not exist")
            continue
        try:
            idx = ShardIndex.load(cand, allow_schemes=allow_schemes, allow_outside=allow_outside)
        except (OSError, ValueError) as err:
            if index_path is not None:
                raise
            log.warning("ignoring index %s: %s", cand, err)
            continue
        for info in idx.shards:
            known[info.path] = (info, idx)
    return known


def _usable(
    found: tuple[ShardInfo, ShardIndex], path: str, patch: _PatchSize | None, check_values: bool
) -> ShardInfo | None:
    """A copy of the loaded entry if it can stand for the shard at ``path`` now, else None (rebuild it)."""
    info, owner = found
    if check_values and not owner.values_checked:
        return None
    if not _is_url(path):
        try:
            size = os.path.getsize(path)
        except OSError:
            return None  # gone: building reports it
        if size != info.num_bytes:
            log.warning(
                "index entry for %s is stale (%s bytes recorded, %d on disk); re-indexing it",
                path,
                info.num_bytes,
                size,
            )
            return None
    if owner.patch_size != patch and any(e.get("reason") == "not_divisible" for e in info.skipped):
        return None  # skipped under another patch size: only a rebuild can tell
    return ShardInfo(
        path=info.path,
        keys=list(info.keys),
        latent_shapes=list(info.latent_shapes),
        text_lengths=list(info.text_lengths),
        num_bytes=info.num_bytes,
        skipped=[dict(e) for e in info.skipped],
        ignored=dict(info.ignored),
    )


def _index_one(
    path: str,
    patch: _PatchSize | None,
    on_error: str,
    check_values: bool,
    max_member_bytes: int | None = None,
) -> ShardInfo:
    info = ShardInfo(path=path, keys=[], latent_shapes=[], text_lengths=[], num_bytes=0)

    def problem(reason: str, key: str | None, detail: str, member: str | None = None) -> None:
        if on_error == "raise":
            raise ShardError(path, key, detail, reason=reason, member=member)
        info.skipped.append({"key": key, "reason": reason, "detail": detail})

    try:
        raw = _open_shard(path)
    except FileNotFoundError:
        problem("missing_shard", None, "the shard file does not exist")
        return info
    except OSError as err:
        problem("unreadable_shard", None, f"cannot open the shard ({err})")
        return info
    src = _source(path, raw)
    groups = 0
    finished = damaged = False
    mode = _DATA if check_values else _HEADERS
    try:
        for event in _scan(src, lambda key: mode, patch, check_values, max_member_bytes):
            if isinstance(event, _Group):
                groups += 1
                if event.problem is not None:
                    problem(event.problem[0], event.key, event.problem[1], event.problem_member)
                    continue
                assert event.latent is not None
                info.keys.append(event.key)
                info.latent_shapes.append(event.latent.shape)  # type: ignore[arg-type]
                info.text_lengths.append(event.text.shape[0] if event.text is not None else 0)
            elif isinstance(event, _Ignored):
                if event.reason == "pickle_member" and on_error == "raise":
                    problem(
                        "pickle_member",
                        event.key,
                        f"member {event.member!r} is a pickle; refused, not read",
                        event.member,
                    )
                info.ignored[event.reason] = info.ignored.get(event.reason, 0) + 1
            else:
                damaged = True
                problem(event.reason, event.key, event.detail, event.member)
        finished = True
        try:
            info.num_bytes = src.drain()
            raw.close()
        except Exception as err:  # noqa: BLE001 - e.g. a pipe command that exited with an error
            if not damaged:  # the same failure seen earlier is already recorded
                problem("unreadable_shard", None, f"the shard stream failed ({err})")
    finally:
        if not finished:
            _close_quietly(raw)
    if groups == 0 and not info.skipped:
        log.warning("shard %s is empty (no samples); counted as 'empty_shard'", path)
    return info


def _index_shards(
    paths: list[str],
    patch: _PatchSize | None,
    on_error: str,
    check_values: bool,
    progress: bool,
    num_workers: int,
    max_member_bytes: int | None = None,
) -> list[ShardInfo]:
    bar = tqdm(total=len(paths), unit="shard", desc="indexing shards", disable=not progress)
    out: list[ShardInfo] = []
    samples = 0
    try:
        if num_workers <= 1:
            results: Iterable[ShardInfo] = (
                _index_one(p, patch, on_error, check_values, max_member_bytes) for p in paths
            )
            pool = None
        else:
            pool = ThreadPoolExecutor(max_workers=num_workers)
            results = pool.map(
                lambda p: _index_one(p, patch, on_error, check_values, max_member_bytes), paths
            )
        try:
            for info in results:
                out.append(info)
                samples += info.num_samples
                bar.update(1)
                bar.set_postfix(samples=samples, refresh=False)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    finally:
        bar.close()
    return out


def _apply_patch_check(shards: list[ShardInfo], patch: _PatchSize, on_error: str) -> None:
    for s in shards:
        details = {}
        for pos, shape in enumerate(s.latent_shapes):
            problem = _divisibility_problem(shape, patch)
            if problem is not None:
                if on_error == "raise":
                    raise ShardError(s.path, s.keys[pos], problem, reason="not_divisible")
                details[pos] = problem
        if details:
            s._drop(details.keys(), "not_divisible", details)


def _check_cross_duplicates(shards: list[ShardInfo], on_error: str) -> None:
    first: dict[str, int] = {}
    for sid, s in enumerate(shards):
        details = {}
        for pos, key in enumerate(s.keys):
            owner = first.setdefault(key, sid)
            if owner != sid:
                detail = f"key {key!r} is also in shard {shards[owner].path}"
                if on_error == "raise":
                    raise ShardError(s.path, key, detail, reason="duplicate_key")
                details[pos] = detail
        if details:
            s._drop(details.keys(), "duplicate_key", details)


_MAX_LOGGED_SKIPS = 20


def _report(index: ShardIndex, on_error: str) -> None:
    """Log what was skipped: each of the first few, then a summary by reason."""
    skipped = index.skipped()
    for entry in skipped[:_MAX_LOGGED_SKIPS]:
        log.warning(
            "skipped %s in shard %s: %s (%s)",
            "shard" if entry["key"] is None else f"key {entry['key']!r}",
            entry["shard"],
            entry["reason"],
            entry["detail"],
        )
    counts = index.counts()
    problems = {r: n for r, n in counts.items() if r not in _IGNORED_REASONS}
    if skipped:
        log.warning(
            "index: %d samples/shards skipped (on_error=%r): %s; see ShardIndex.skipped()",
            len(skipped),
            on_error,
            problems,
        )
    ignored = {r: n for r, n in counts.items() if r in _IGNORED_REASONS}
    if ignored:
        log.info("index: members ignored: %s", ignored)


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------


def iter_shard(
    path: str | os.PathLike | ShardInfo,
    shard_id: int = 0,
    select: Collection[int] | None = None,
    on_error: str = "raise",
    stats: MutableMapping[str, int] | None = None,
    *,
    keys: Sequence[str] | None = None,
    patch_size: Sequence[int] | None = _DEFAULT_PATCH,
    max_member_bytes: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream one shard in file order and yield its decoded samples.

    The tar is read as a stream (local file, ``file://``, or any URL webdataset's ``gopen`` opens);
    only the selected samples' data is read and decoded. Every yielded latent and text array is checked
    finite. Never unpickles.

    Sample ids: pass the index's keys for this shard (``keys=index.shards[shard_id].keys``, or pass the
    :class:`ShardInfo` itself as ``path``); then sample ids are exactly the index's positions, samples the
    index left out are passed over unread and uncounted, and reading stops as soon as every wanted
    sample was yielded. Without ``keys``, ids count the samples that pass this reader's checks in file
    order, which equals the index's numbering only when the index skipped nothing in this shard.

    Args:
        path: the shard's path or URL, or its :class:`ShardInfo`.
        shard_id: the shard's position in the index (copied into ``__ref__``).
        select: sample ids to yield (others are not decoded), or None for all.
        keys: the shard's keys in the index (see above).
        on_error: ``"raise"`` a :class:`ShardError`, or ``"skip"`` the sample, count it in ``stats`` and
            log a warning.
        stats: a dict updated in place with counts by reason (skipped samples, ``empty_shard``, ignored
            members such as ``unknown_extension``).
        patch_size: (pt, ph, pw) the latent must be divisible by, or None.
        max_member_bytes: the largest member (bytes) read; a larger claim is refused
            (``member_too_large``) before anything is allocated. None: :data:`MAX_MEMBER_BYTES`.

    Yields:
        ``{"__key__": str, "__shard__": str, "__ref__": (shard_id, sample_id),
        "latent": Tensor (C, T, H, W) float16/float32, "text": Tensor (L, D_text) | None,
        "meta": dict | None}``. Tensors own their memory (one copy out of the tar stream).

    Raises:
        ShardError: under ``on_error="raise"``, naming the shard, key and problem.
    """
    if isinstance(path, ShardInfo):
        keys = path.keys if keys is None else keys
        path = path.path
    _check_on_error(on_error)
    patch = _check_patch(patch_size)
    label = _norm_path(path)
    counts: MutableMapping[str, int] = stats if stats is not None else {}
    wanted: set[int] | None = None if select is None else {int(i) for i in select}
    if wanted is not None and not wanted:
        return
    key_pos = None if keys is None else {k: i for i, k in enumerate(keys)}
    if key_pos is not None and wanted is not None and max(wanted) >= len(key_pos):
        raise ValueError(
            f"select has sample ids up to {max(wanted)} but shard {label} has {len(key_pos)} samples"
        )
    # Ids still to yield; None = read to the end of the shard.
    remaining: set[int] | None = (
        set(wanted) if wanted is not None else (set(range(len(key_pos))) if key_pos is not None else None)
    )
    if remaining is not None and not remaining:
        return
    state = {"count": 0}

    def mode_for(key: str) -> int:
        if key_pos is not None:
            sid = key_pos.get(key)
            return _DATA if sid is not None and sid in remaining else _SKIP
        return _DATA if wanted is None or state["count"] in wanted else _HEADERS

    def problem(reason: str, key: str | None, detail: str, member: str | None = None) -> None:
        if on_error == "raise":
            raise ShardError(label, key, detail, reason=reason, member=member)
        counts[reason] = counts.get(reason, 0) + 1
        log.warning(
            "skipped %s in shard %s: %s (%s)",
            "shard" if key is None else f"key {key!r}",
            label,
            reason,
            detail,
        )

    try:
        raw = _open_shard(label)
    except FileNotFoundError:
        problem("missing_shard", None, "the shard file does not exist")
        return
    except OSError as err:
        problem("unreadable_shard", None, f"cannot open the shard ({err})")
        return
    src = _source(label, raw)
    finished = False  # read to the end or to the last wanted sample, without an exception
    groups = 0
    damaged = False
    scan = _scan(src, mode_for, patch, True, max_member_bytes)
    try:
        for event in scan:
            if isinstance(event, _Ignored):
                if event.reason == "pickle_member" and on_error == "raise":
                    problem(
                        "pickle_member",
                        event.key,
                        f"member {event.member!r} is a pickle; refused, not read",
                        event.member,
                    )
                if event.reason == "pickle_member":
                    # A refused member, not a lost sample: the key's other members are still read.
                    log.warning("refused member %r in shard %s: a pickle, never loaded", event.member, label)
                counts[event.reason] = counts.get(event.reason, 0) + 1
                continue
            if isinstance(event, _ShardProblem):
                damaged = True
                problem(event.reason, event.key, event.detail, event.member)
                continue
            groups += 1
            if event.mode == _SKIP:
                continue
            if key_pos is not None:
                sid = key_pos[event.key]
                remaining.discard(sid)  # type: ignore[union-attr]
            if event.problem is not None:
                problem(event.problem[0], event.key, event.problem[1], event.problem_member)
            else:
                if key_pos is None:
                    sid = state["count"]
                    state["count"] += 1
                if wanted is None or sid in wanted:
                    latent, text = event.latent, event.text
                    assert latent is not None
                    yield {
                        "__key__": event.key,
                        "__shard__": label,
                        "__ref__": (shard_id, sid),
                        "latent": _to_tensor(latent),
                        "text": _to_tensor(text) if text is not None else None,
                        "meta": event.meta,
                    }
                    if key_pos is None and remaining is not None:
                        remaining.discard(sid)
            if remaining is not None and not remaining:
                break  # every wanted sample was yielded
        else:
            finished = True
            try:
                src.drain()  # let a pipe's writer finish cleanly
                raw.close()
            except Exception as err:  # noqa: BLE001 - e.g. a pipe command that exited with an error
                if not damaged:  # the same failure seen earlier is already counted
                    damaged = True
                    problem("unreadable_shard", None, f"the shard stream failed ({err})")
            if groups == 0 and not damaged:
                counts["empty_shard"] = counts.get("empty_shard", 0) + 1
                log.warning("shard %s is empty (no samples); counted as 'empty_shard'", label)
            if remaining:
                if key_pos is not None:
                    inv = {i: k for k, i in key_pos.items()}
                    missing = sorted(inv[i] for i in remaining)
                    detail = f"{len(missing)} samples listed in the index were not found: {missing[:5]}"
                else:
                    detail = f"the shard has no valid samples with ids {sorted(remaining)[:5]}"
                problem("stale_index", None, detail)
    finally:
        scan.close()
        if not finished:
            # After an early stop or an error a pipe's writer may exit with SIGPIPE: not worth reporting.
            _close_quietly(raw)


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------


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
    bad = _count_non_finite(value.reshape(-1))
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
        self.patch_size = _check_patch(patch_size)
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
            problem = _divisibility_problem(lat.shape, self.patch_size)
            if problem is not None:
                raise ValueError(f"key {key!r}: {problem}")
        members = [(f"{key}.{_LATENT}", _npy_bytes(lat))]
        txt = None
        if text is not None:
            txt = _as_float_array(text, "text", key, 2, "2 (L, D_text)")
            members.append((f"{key}.{_TEXT}", _npy_bytes(txt)))
        if meta is not None:
            if not isinstance(meta, dict):
                raise TypeError(f"key {key!r}: meta must be a dict, got {type(meta).__name__}")
            try:
                blob = json.dumps(meta, sort_keys=True, allow_nan=False, ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError) as err:
                raise ValueError(f"key {key!r}: meta is not strict-JSON serialisable ({err})") from None
            members.append((f"{key}.{_META}", blob))
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
        return len(self._shards), self._current.num_samples - 1

    def _start_shard(self) -> None:
        name = f"{self.prefix}-{len(self._shards):06d}.tar"
        self._tmp = os.path.join(self.directory, f".{name}.{os.getpid()}.tmp")
        self._file = open(self._tmp, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._current = ShardInfo(
            path=os.path.join(self.directory, name), keys=[], latent_shapes=[], text_lengths=[], num_bytes=0
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


# ----------------------------------------------------------------------------------------------------
# Synthetic shards
# ----------------------------------------------------------------------------------------------------


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float16: np.float16, torch.float32: np.float32}.get(dtype, dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(f"dtype must be float16 or float32, got {dtype!r}")
    return dt


def _shard_sizes(
    num_samples: int, samples_per_shard: int | Sequence[int], uneven: bool, seed: int
) -> list[int]:
    if not isinstance(samples_per_shard, int):
        sizes = [int(s) for s in samples_per_shard]
        if sum(sizes) != num_samples or any(s < 1 for s in sizes):
            raise ValueError(
                f"samples_per_shard {sizes} must be positive and sum to num_samples={num_samples}"
            )
        return sizes
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    sizes = []
    rng = np.random.default_rng([seed, 1])  # its own stream: sizes never change the sample contents
    left = num_samples
    while left > 0:
        if uneven:
            lo, hi = max(1, samples_per_shard // 2), max(1, samples_per_shard + samples_per_shard // 2)
            n = int(rng.integers(lo, hi + 1))
        else:
            n = samples_per_shard
        sizes.append(min(n, left))
        left -= sizes[-1]
    return sizes


def write_synthetic_shards(
    directory: str | os.PathLike,
    mix: str | os.PathLike | Mix = "tiny",
    num_samples: int = 256,
    samples_per_shard: int | Sequence[int] = 64,
    seed: int = 0,
    text_len_range: tuple[int, int] | None = (0, 16),
    text_dim: int = 32,
    dtype: Any = "float16",
    progress: bool = True,
    *,
    uneven: bool = False,
    prefix: str = "shard",
    key_prefix: str = "sample",
    overwrite: bool = False,
) -> ShardIndex:
    """Write shards of random latents whose shapes follow a length mix; deterministic for a seed.

    If ``directory`` already holds shards written by this function with the same settings (recorded in
    the index's metadata, file sizes intact), they are reused and nothing is written.

    Args:
        directory: where the shards and ``index.json`` go.
        mix: a packaged mix name, a mix file path, or a :class:`Mix`.
        num_samples: samples to write.
        samples_per_shard: samples per shard, or the list of shard sizes (summing to ``num_samples``).
        seed: seeds the bucket draws, latents, text lengths and states, and uneven shard sizes.
        text_len_range: (min, max) text length L, inclusive; L = 0 writes no text member; None for none.
        text_dim: D_text of the text states.
        dtype: float16 or float32 (numpy, torch or string).
        uneven: draw shard sizes in [s/2, 1.5 s] for ``samples_per_shard = s`` (deterministic).
        prefix: shard file prefix; key_prefix: sample keys are ``<key_prefix>NNNNNNNN``.
        progress: tqdm bar over samples.
        overwrite: replace existing shards written with other settings (else FileExistsError).

    Returns:
        The index of the shards (as saved in ``directory/index.json``).
    """
    mix_obj = mix if isinstance(mix, Mix) else load_mix(mix)
    dt = _np_dtype(dtype)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if text_len_range is not None:
        lo, hi = (int(v) for v in text_len_range)
        if lo < 0 or hi < lo:
            raise ValueError(
                f"text_len_range must be (min, max) with 0 <= min <= max, got {text_len_range!r}"
            )
        if text_dim < 1:
            raise ValueError(f"text_dim must be >= 1, got {text_dim}")
    sizes = _shard_sizes(num_samples, samples_per_shard, uneven, seed)
    settings = {
        "mix": mix_obj.name,
        "buckets": [[list(b.latent_shape), b.p] for b in mix_obj.buckets],
        "num_samples": num_samples,
        "shard_sizes": sizes,
        "seed": seed,
        "text_len_range": None if text_len_range is None else [lo, hi],
        "text_dim": text_dim,
        "dtype": dt.name,
        "prefix": prefix,
        "key_prefix": key_prefix,
    }
    directory = os.path.abspath(os.fspath(directory))
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index_path) and not overwrite:
        try:
            old = ShardIndex.load(index_path)
        except (OSError, ValueError):
            old = None
        if (
            old is not None
            and old.metadata.get("synthetic") == settings
            and all(os.path.exists(s.path) and os.path.getsize(s.path) == s.num_bytes for s in old.shards)
        ):
            log.info("reusing synthetic shards in %s (same settings)", directory)
            return old
        raise FileExistsError(
            f"{directory} already holds an index of other data or other settings; pass overwrite=True to "
            "replace it, or use another directory"
        )
    rng = np.random.default_rng(seed)
    buckets = mix_obj.sample_buckets(rng, num_samples)
    bar = tqdm(total=num_samples, unit="sample", desc="writing synthetic shards", disable=not progress)
    i = 0
    try:
        with ShardWriter(
            directory,
            prefix=prefix,
            max_samples_per_shard=None,
            max_bytes=None,
            patch_size=_DEFAULT_PATCH,  # load_mix guarantees even H and W
            overwrite=overwrite,
            metadata={"synthetic": settings},
        ) as writer:
            for size in sizes:
                for _ in range(size):
                    b = mix_obj.buckets[int(buckets[i])]
                    latent = rng.standard_normal(b.latent_shape, dtype=np.float32).astype(dt)
                    text = None
                    if text_len_range is not None:
                        length = int(rng.integers(lo, hi + 1))
                        if length:
                            text = rng.standard_normal((length, text_dim), dtype=np.float32).astype(dt)
                    meta = {
                        "bucket": int(buckets[i]),
                        "frames": b.frames,
                        "height": b.height,
                        "width": b.width,
                        "source": f"synthetic:{mix_obj.name}:seed={seed}",
                    }
                    writer.write(f"{key_prefix}{i:08d}", latent, text=text, meta=meta)
                    i += 1
                    bar.update(1)
                writer.finish_shard()
    finally:
        bar.close()
    return writer.index


# ----------------------------------------------------------------------------------------------------
# Commands (dispatched by cli.py)
# ----------------------------------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _print_bucket_table(index: ShardIndex, patch: Sequence[int], mix: Mix | None, out) -> None:
    counts = Counter(shape for s in index.shards for shape in s.latent_shapes)
    share = {tuple(b.latent_shape): b.p for b in mix.buckets} if mix is not None else {}
    total = sum(counts.values()) or 1
    print(
        f"{'latent (C,T,H,W)':<20} {'tokens/sample':>13} {'samples':>8} {'share':>7}"
        + (f" {'mix p':>7}" if mix else "")
        + f" {'tokens':>12}",
        file=out,
    )
    for shape in sorted(counts, key=lambda s: (_tokens(s, patch), s)):
        n = counts[shape]
        line = f"{'x'.join(map(str, shape)):<20} {_tokens(shape, patch):>13} {n:>8} {n / total:>7.1%}"
        if mix is not None:
            line += f" {share.get(tuple(shape), 0.0):>7.1%}"
        print(line + f" {n * _tokens(shape, patch):>12}", file=out)


def synth_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-adaptiveload synth``: write synthetic shards following a length mix, print a summary.

    Returns:
        The exit status (0 on success).
    """
    parser = argparse.ArgumentParser(
        prog="lightning-adaptiveload synth",
        description="Write synthetic latent shards following a length mix.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--mix", default="tiny", help="packaged mix name or mix JSON path (default: tiny)")
    parser.add_argument("--num-samples", type=int, default=256, help="samples to write (256)")
    parser.add_argument("--samples-per-shard", type=int, default=64, help="samples per shard file (64)")
    parser.add_argument("--seed", type=int, default=0, help="seeds shapes, values and text (0)")
    parser.add_argument("--uneven", action="store_true", help="uneven shard sizes in [s/2, 1.5 s]")
    parser.add_argument(
        "--text-len",
        type=int,
        nargs=2,
        default=(0, 16),
        metavar=("MIN", "MAX"),
        help="text length range, inclusive (0 = no text member)",
    )
    parser.add_argument("--text-dim", type=int, default=32, help="width D of the text states (32)")
    parser.add_argument("--no-text", action="store_true", help="write no text states")
    parser.add_argument(
        "--dtype", choices=("float16", "float32"), default="float16", help="array dtype (float16)"
    )
    parser.add_argument(
        "--patch-size",
        type=int,
        nargs=3,
        default=_DEFAULT_PATCH,
        metavar=("PT", "PH", "PW"),
        help="patch size used for the token counts in the summary",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace shards written with other settings in --out"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        mix = load_mix(args.mix)
        index = write_synthetic_shards(
            args.out,
            mix,
            args.num_samples,
            args.samples_per_shard,
            args.seed,
            text_len_range=None if args.no_text else tuple(args.text_len),
            text_dim=args.text_dim,
            dtype=args.dtype,
            uneven=args.uneven,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    nbytes = sum(s.num_bytes for s in index.shards)
    print(f"{index.num_shards} shards, {index.num_samples} samples, {_human_bytes(nbytes)} in {args.out}")
    print(f"index: {index.source}  mix: {mix.name}  seed: {args.seed}")
    _print_bucket_table(index, args.patch_size, mix, sys.stdout)
    print(f"total tokens (patch {tuple(args.patch_size)}): {index.total_tokens(args.patch_size)}")
    return 0


def _keep_metadata(index: ShardIndex, path: str) -> None:
    """Carry the metadata of the index at ``path`` (e.g. ``synth``'s settings) over to ``index`` when both
    list the same shards with the same sizes, so that re-indexing does not make the data look foreign."""
    try:
        old = ShardIndex.load(path)
    except (OSError, ValueError):
        return
    same = [(s.path, s.num_bytes) for s in old.shards] == [(s.path, s.num_bytes) for s in index.shards]
    if same and old.metadata:
        index.metadata = {**old.metadata, **index.metadata}


def index_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-adaptiveload index``: build or verify the index of existing shards, print counts.

    Returns:
        0 when every sample is valid, 1 when samples or shards were skipped (``--on-error skip``),
        2 on an error (the first problem under ``--on-error raise``, or bad arguments).
    """
    parser = argparse.ArgumentParser(
        prog="lightning-adaptiveload index",
        description="Build or verify index.json for WebDataset latent shards.",
    )
    parser.add_argument("paths", nargs="+", help="shard paths, URLs, brace patterns or directories")
    parser.add_argument(
        "--patch-size",
        type=int,
        nargs=3,
        default=_DEFAULT_PATCH,
        metavar=("PT", "PH", "PW"),
        help="the model's patch size; latents must be divisible by it (default: 1 2 2)",
    )
    parser.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="stop at the first bad sample, or skip and count",
    )
    parser.add_argument(
        "--no-check-values", action="store_true", help="do not read array data (no NaN check)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="ignore any existing index and read every shard"
    )
    parser.add_argument("--output", help="where to write the index (default: index.json beside the shards)")
    parser.add_argument("--no-save", action="store_true", help="verify only; write nothing")
    parser.add_argument("--workers", type=int, default=1, help="shards indexed in parallel")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    paths = args.paths[0] if len(args.paths) == 1 else args.paths
    kwargs = dict(
        patch_size=args.patch_size,
        on_error=args.on_error,
        check_values=not args.no_check_values,
        progress=not args.no_progress,
    )
    try:
        if args.rebuild:
            index = ShardIndex.build(paths, num_workers=args.workers, **kwargs)
        else:
            index = ShardIndex.for_paths(paths, num_workers=args.workers, **kwargs)
        if not args.no_save:
            if args.output:
                _keep_metadata(index, args.output)
                index.save(args.output)
            else:
                folders = {os.path.dirname(p) for p in index.paths if not _is_url(p)}
                if len(folders) == 1 and not any(_is_url(p) for p in index.paths):
                    target = os.path.join(folders.pop(), INDEX_NAME)
                    _keep_metadata(index, target)
                    index.save(target)
                else:
                    print(
                        "note: shards are remote or in several directories; pass --output to save the index",
                        file=sys.stderr,
                    )
    except (ShardError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    nbytes = sum(max(s.num_bytes, 0) for s in index.shards)
    print(
        f"{index.num_shards} shards, {index.num_samples} samples, {_human_bytes(nbytes)}, "
        f"{index.total_tokens(args.patch_size)} tokens (patch {tuple(args.patch_size)})"
    )
    if index.source:
        print(f"index: {index.source}")
    counts = index.counts()
    problems = {r: n for r, n in sorted(counts.items()) if r not in _IGNORED_REASONS and r != "empty_shard"}
    notes = {r: n for r, n in sorted(counts.items()) if r in _IGNORED_REASONS or r == "empty_shard"}
    print("skipped by reason: " + (", ".join(f"{r}={n}" for r, n in problems.items()) or "none"))
    print("warnings: " + (", ".join(f"{r}={n}" for r, n in notes.items()) or "none"))
    _print_bucket_table(index, args.patch_size, None, sys.stdout)
    return 1 if problems else 0

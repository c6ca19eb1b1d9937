"""The streaming tar scan shared by the index builder and the reader.

:func:`scan_shard` walks one tar in file order and yields each sample's members (checked: key rules,
size caps, ``.npy`` headers, dtypes, shapes, patch divisibility, finiteness), the members it ignored,
and tar-level damage, reading only what the caller asks for per sample (skip, headers, or data).

Untrusted data: nothing is ever unpickled. Members with pickle extensions (``.pth``, ``.pt``, ``.pyd``,
``.pkl``, ``.pickle``, ``.ckpt``) are refused without being read, object dtypes are refused, and no size
a member claims is allocated before it was checked (:mod:`lightning_adaptiveload.shards.untrusted`;
threat model in ``docs/reliability.md``).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lightning_adaptiveload.shards import untrusted
from lightning_adaptiveload.shards.format import (
    LATENT_EXT,
    MAX_MEMBER_BYTES,
    META_EXT,
    PICKLE_SUFFIXES,
    TEXT_EXT,
    PatchSize,
    divisibility_problem,
)
from lightning_adaptiveload.shards.npy import (
    Npy,
    NpyError,
    count_non_finite,
    dtype_problem,
    flat_array,
    read_npy_header,
)
from lightning_adaptiveload.shards.paths import (
    is_url,
)
from lightning_adaptiveload.shards.plain_tar import PlainTar, plain_members
from lightning_adaptiveload.shards.untrusted import (
    CheckedTarInfo,
    Refused,
    key_problem,
    load_json,
)

__all__ = [
    "DATA",
    "HEADERS",
    "SKIP",
    "FileSource",
    "Group",
    "Ignored",
    "STREAM_CHUNK",
    "BytesSource",
    "ShardProblem",
    "StreamSource",
    "open_source",
    "scan_shard",
]

STREAM_CHUNK = 1 << 22  # bytes read at a time from a stream
_READS_AT_END = 64  # reads that may return nothing before the stream counts as cut short


class StreamSource:
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
        if info.size <= STREAM_CHUNK:  # the usual latent: one buffer, one copy, as large as a chunk at most
            buf = bytearray(info.size)
            if f.readinto(buf) != info.size:
                raise tarfile.ReadError(f"unexpected end of data in {info.name}")
            return buf
        chunks, got = [], 0
        while got < info.size:
            chunk = f.read(min(STREAM_CHUNK, info.size - got))
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


class FileSource:
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
        if info.offset_data + info.size > self.pos:  # scan_shard checks this first; allocate nothing on a lie
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


class BytesSource(FileSource):
    """Fetched bytes of a shard (a ranged read's samples, a run of whole members) scanned as a tar.

    The bytes are read as if two zero blocks followed them, the end-of-archive marker the range lacks;
    :attr:`pos` stays at the end of the fetched bytes, so that a member claiming more than was fetched
    is ``truncated_tar`` before anything is allocated for it, exactly as for a local file that ends
    early. Where every header is a plain file (:func:`~.plain_tar.plain_members`) they are parsed
    without ``tarfile``; anything else is read by ``tarfile`` with its checks, as a local file is.
    """

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = memoryview(data)
        self.pos = len(data)
        self._raw: io.BytesIO | None = None

    @property
    def raw(self) -> io.BytesIO:  # type: ignore[override]
        """The bytes and the end marker as a file, for ``tarfile`` (made when first asked for)."""
        if self._raw is None:
            self._raw = io.BytesIO(bytes(self.data) + b"\0" * (2 * tarfile.BLOCKSIZE))
        return self._raw

    def open_tar(self) -> tarfile.TarFile | PlainTar:  # type: ignore[override]
        members = plain_members(self.data)
        if members is not None:
            return PlainTar(members)
        return super().open_tar()

    def read_member(self, tf, info: tarfile.TarInfo) -> bytearray:
        if info.offset_data + info.size > self.pos:  # scan_shard checks this first; allocate nothing on a lie
            raise tarfile.ReadError(f"unexpected end of data in {info.name}")
        return bytearray(self.data[info.offset_data : info.offset_data + info.size])

    def member_reader(self, tf, info: tarfile.TarInfo) -> Callable[[int], bytes]:
        cursor = [info.offset_data]
        end = min(info.offset_data + info.size, self.pos)

        def read(n: int) -> bytes:
            lo = cursor[0]
            hi = min(lo + n, end)
            cursor[0] = max(hi, lo)
            return bytes(self.data[lo:hi])

        return read

    def block_at(self, offset: int, size: int) -> bytes:
        hi = min(offset + size, self.pos + 2 * tarfile.BLOCKSIZE)
        head = bytes(self.data[offset : min(hi, self.pos)])
        return head + b"\0" * max(0, hi - max(offset, self.pos))

    def close(self) -> None:
        """Drop the bytes (the scan is over)."""
        self.data = memoryview(b"")
        self._raw = None


def open_source(path: str, raw) -> StreamSource | FileSource:
    if not is_url(path):
        try:
            if raw.seekable():
                return FileSource(raw)
        except (AttributeError, OSError):
            pass
    return StreamSource(raw)


SKIP, HEADERS, DATA = 0, 1, 2  # how much of a sample to read


@dataclass
class Group:
    """The members of one sample, as far as they were read."""

    key: str
    mode: int
    members: dict[str, str] = field(default_factory=dict)  # extension -> member name
    latent: Npy | None = None
    text: Npy | None = None
    meta: Any = None
    problem: tuple[str, str] | None = None  # (reason, detail), the first one found
    problem_member: str | None = None  # the member it concerns, if one
    expect: tuple[tuple[int, ...], int] | None = None  # (latent shape, text length) the index lists
    # Bytes [start, end) of the tar the sample's members take: the first member's header (its pax or
    # GNU long-name header included) through the last member's data padded to a block; a ranged read
    # fetches exactly these (the index records them as spans).
    span_start: int = -1
    span_end: int = -1

    @property
    def span(self) -> tuple[int, int]:
        """``(offset, length)`` of the sample's bytes in the tar."""
        return self.span_start, self.span_end - self.span_start

    def fail(self, reason: str, detail: str, member: str | None = None) -> None:
        if self.problem is None:
            self.problem = (reason, detail)
            self.problem_member = member


@dataclass
class Ignored:
    reason: str
    member: str
    key: str | None


@dataclass
class ShardProblem:
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
    src: StreamSource | FileSource, tf: tarfile.TarFile, info: tarfile.TarInfo, want_data: bool
) -> Npy:
    if want_data:
        data = src.read_member(tf, info)
        view = memoryview(data)
        cursor = [0]

        def read(n: int) -> bytes:
            out = view[cursor[0] : cursor[0] + n]
            cursor[0] += len(out)
            return out

        npy = read_npy_header(read, info.size, info.name)
        npy.data = data
        return npy
    return read_npy_header(src.member_reader(tf, info), info.size, info.name)


def _finalize(group: Group, patch_size: PatchSize | None, check_values: bool) -> None:
    """Structural and value checks of a complete sample; records the first problem on the group."""
    if group.mode == SKIP or group.problem is not None:
        return
    latent, text = group.latent, group.text
    if latent is None:
        members = sorted(group.members.values())
        dotted = [m for e, m in sorted(group.members.items()) if e.endswith("." + LATENT_EXT)]
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
            f"no '{group.key}.{LATENT_EXT}' member (the sample has {members})",
            members[0] if members else None,
        )
        return
    if group.expect is not None and group.expect[1] and text is None:
        group.fail(
            "shape_mismatch",
            f"sample {group.key!r} has no '{TEXT_EXT}' member but the index lists {group.expect[1]} text tokens",
            latent.member,
        )
        return
    for npy, ndim, layout in ((latent, 4, "(C, T, H, W)"), (text, 2, "(L, D_text)")):
        if npy is None:
            continue
        problem = dtype_problem(npy)
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
        problem = divisibility_problem(latent.shape, patch_size)
        if problem is not None:
            group.fail("not_divisible", f"{latent.member}: {problem}", latent.member)
            return
    if check_values and group.mode == DATA:
        for npy in (latent, text):
            if npy is None:
                continue
            flat = flat_array(npy)
            bad = count_non_finite(flat)
            if bad:
                group.fail(
                    "non_finite", f"{npy.member}: {bad} of {flat.size} values are NaN or Inf", npy.member
                )
                return


@dataclass
class _ScanState:
    """What the scan of one tar carries from member to member."""

    src: StreamSource | FileSource
    tf: tarfile.TarFile
    mode_for: Callable[[str], int]
    cap: int  # max_member_bytes
    expect_for: Callable[[str], tuple[tuple[int, ...], int] | None] | None = None
    seen: set[str] = field(default_factory=set)
    group: Group | None = None
    last_offset: int = -1
    stop: bool = False  # the tar ends inside the member just seen


def scan_shard(
    src: StreamSource | FileSource,
    mode_for: Callable[[str], int],
    patch_size: PatchSize | None,
    check_values: bool,
    max_member_bytes: int | None = None,
    expect_for: Callable[[str], tuple[tuple[int, ...], int] | None] | None = None,
) -> Iterator[Group | Ignored | ShardProblem]:
    """Stream one tar and yield its samples (checked) and what was ignored, in file order.

    ``mode_for(key)`` is asked when a sample starts: SKIP passes it over unread, HEADERS reads the
    .npy headers and the json, DATA reads everything. ``expect_for(key)``, if given, is the
    ``(latent shape, text length)`` an index lists for the sample (or None): a latent of another shape,
    or text of another length where the index lists one, fails the sample as ``shape_mismatch`` as soon
    as its ``.npy`` header is parsed, before its values are checked or decoded. Tar-level damage ends the scan with the open
    sample failed as ``truncated_tar``/``corrupt_tar`` (or a ShardProblem when no sample is open).
    A member is read only after its claimed size was checked against ``max_member_bytes`` (default
    :data:`MAX_MEMBER_BYTES`) and, for local files, against the bytes the file holds.
    """
    cap = MAX_MEMBER_BYTES if max_member_bytes is None else int(max_member_bytes)
    tf, problem = _open_tar(src)
    if tf is None:
        if problem is not None:
            yield problem
        return
    state = _ScanState(src=src, tf=tf, mode_for=mode_for, cap=cap, expect_for=expect_for)
    try:
        while (info := _next_member(tf)) is not None:
            tf.members = []  # tarfile would otherwise keep every TarInfo of the shard
            if info.size < 0 or info.offset <= state.last_offset:
                # A pax "size" can be negative: tarfile would then read the same headers forever.
                raise _TarDamage(
                    "corrupt_tar", f"tar header of {info.name!r} at byte {info.offset} has size {info.size}"
                )
            state.last_offset = info.offset
            yield from _member_events(state, info, patch_size, check_values)
            if state.stop:
                break  # no member can follow: the tar ends inside this one
    except (tarfile.TarError, EOFError, OSError, _TarDamage) as err:
        yield from _damage_events(state.group, err)
        return
    yield from _end_events(src, tf, state.group, patch_size, check_values)


def _open_tar(src: StreamSource | FileSource) -> tuple[tarfile.TarFile | None, ShardProblem | None]:
    """The open tar, or (None, the problem); (None, None) for a 0-byte file (an empty shard)."""
    try:
        return src.open_tar(), None
    except OSError as err:  # a pipe or download that failed before the first block
        return None, ShardProblem("unreadable_shard", f"cannot read the shard ({err})", None)
    except Refused as err:
        return None, ShardProblem(err.reason or "corrupt_tar", str(err), None)
    except (tarfile.ReadError, *_TAR_PARSE_ERRORS) as err:
        if src.pos == 0:
            return None, None
        head = src.block_at(0, 4)
        if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:4] == b"\xfd7zX":
            detail = "the file is compressed (gzip/bzip2/xz); shards must be plain tar: decompress it"
        elif src.pos < tarfile.BLOCKSIZE:
            return None, ShardProblem(
                "truncated_tar", f"the file is only {src.pos} bytes, less than one tar header", None
            )
        else:
            detail = f"not a tar file ({err})"
        return None, ShardProblem("corrupt_tar", detail, None)


def _member_events(
    state: _ScanState, info: tarfile.TarInfo, patch_size: PatchSize | None, check_values: bool
) -> Iterator[Group | Ignored]:
    """Place one tar member in its sample: yields the finished previous sample and ignored members."""
    group = state.group
    sparse = info.sparse is not None or info.type == tarfile.GNUTYPE_SPARSE
    if not info.isreg() and not sparse:
        if group is None or group.mode != SKIP:
            yield Ignored("non_file_member", info.name, None)
        return
    key, ext = _split_member(info.name)
    if key is None:
        yield Ignored("bad_member_name", info.name, None)
        return
    if group is None or key != group.key:
        if group is not None:
            _finalize(group, patch_size, check_values)
            yield group
        group = state.group = _start_group(state, key, info.name)
        group.span_start = info.offset
    group.span_end = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    if group.mode == SKIP:
        return
    if ext in group.members:
        group.fail("duplicate_key", f"member {info.name!r} appears twice in the sample", info.name)
        return
    group.members[ext] = info.name
    if ext.rsplit(".", 1)[-1] in PICKLE_SUFFIXES:
        yield Ignored("pickle_member", info.name, key)
        return
    if ext not in (LATENT_EXT, TEXT_EXT, META_EXT):
        yield Ignored("unknown_extension", info.name, key)
        return
    if sparse:
        group.fail(
            "sparse_member",
            f"member {info.name!r} is a GNU sparse file (its data has holes); not read",
            info.name,
        )
        return
    if group.problem is None:  # else refused anyway: do not read the data
        state.stop = _read_member(state, group, info, ext)


def _start_group(state: _ScanState, key: str, member: str) -> Group:
    """A new sample, failed at once when its key breaks the key rules or was seen before."""
    group = Group(key=key, mode=state.mode_for(key))
    if group.mode != SKIP and state.expect_for is not None:
        group.expect = state.expect_for(key)
    rule = key_problem(key) if group.mode != SKIP else None
    if rule is not None:  # such a sample is never read, only reported
        group.fail("bad_key", f"member {member!r}: key {key!r} {rule}", member)
    elif key in state.seen:
        group.fail(
            "duplicate_key", f"key {key!r} appears again at member {member!r} (non-contiguous)", member
        )
    state.seen.add(key)
    return group


def _read_member(state: _ScanState, group: Group, info: tarfile.TarInfo, ext: str) -> bool:
    """Read a latent, text or json member into ``group`` after the size checks; True: the tar ends here."""
    src = state.src
    if info.size > state.cap:
        group.fail(
            "member_too_large",
            f"member {info.name!r} claims {_human_size(info.size)}, more than max_member_bytes={state.cap}",
            info.name,
        )
        return False
    if isinstance(src, FileSource) and info.offset_data + info.size > src.pos:
        group.fail(
            "truncated_tar",
            f"member {info.name!r} claims {_human_size(info.size)} but the file ends "
            f"{max(src.pos - info.offset_data, 0)} bytes after its header",
            info.name,
        )
        return True
    if ext in (LATENT_EXT, TEXT_EXT):
        try:
            npy = _read_npy(src, state.tf, info, want_data=group.mode == DATA)
        except NpyError as err:
            group.fail("bad_npy", str(err), info.name)
            return False
        if ext == LATENT_EXT:
            group.latent = npy
        else:
            group.text = npy
        _check_expected(group, npy, ext)
    else:
        _read_json(src, state.tf, info, group)
    return False


def _check_expected(group: Group, npy: Npy, ext: str) -> None:
    """The index's shape against the ``.npy`` header just parsed (nothing decoded yet)."""
    if group.expect is None:
        return
    shape, text_len = group.expect
    if ext == LATENT_EXT and tuple(npy.shape) != tuple(shape):
        group.fail(
            "shape_mismatch",
            f"{npy.member}: the latent is {list(npy.shape)} but the index lists {list(shape)}",
            npy.member,
        )
    elif ext == TEXT_EXT and text_len and (len(npy.shape) != 2 or npy.shape[0] != text_len):
        group.fail(
            "shape_mismatch",
            f"{npy.member}: the text states are {list(npy.shape)} but the index lists {text_len} tokens",
            npy.member,
        )


def _read_json(
    src: StreamSource | FileSource, tf: tarfile.TarFile, info: tarfile.TarInfo, group: Group
) -> None:
    json_cap = untrusted.MAX_JSON_BYTES  # read now: settable at run time
    if info.size > json_cap:
        group.fail("bad_json", f"{info.name}: {info.size} bytes, more than the {json_cap} allowed", info.name)
        return
    try:
        meta = load_json(src.read_member(tf, info))
    except Refused as err:
        group.fail("bad_json", f"{info.name}: JSON {err}", info.name)
        return
    if not isinstance(meta, dict):
        group.fail("bad_json", f"{info.name}: JSON is a {type(meta).__name__}, not an object", info.name)
        return
    group.meta = meta


def _damage_events(group: Group | None, err: BaseException) -> Iterator[Group | ShardProblem]:
    """Tar damage ends the scan: fail the open sample with it (or report it for the shard)."""
    if isinstance(err, _TarDamage):
        reason, detail = err.reason, err.detail
    else:
        reason, detail = "truncated_tar", f"tar stream ends or breaks ({err})"
    if group is not None and group.mode != SKIP:
        earlier = group.problem
        group.fail(reason, detail)
        yield group
        if earlier is not None and earlier[0] != reason:
            # The sample failed for its own reason first; the damage that ends the shard (and may
            # hide later samples) is still counted.
            yield ShardProblem(reason, detail, group.key)
    else:  # a sample the caller does not read still must not hide the damage
        yield ShardProblem(reason, detail, None if group is None else group.key)
        if group is not None:
            yield group


def _end_events(
    src: StreamSource | FileSource,
    tf: tarfile.TarFile,
    group: Group | None,
    patch_size: PatchSize | None,
    check_values: bool,
) -> Iterator[Group | ShardProblem]:
    """The last sample, after checking that the tar ends with its end-of-archive marker."""
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
    if group is not None and group.mode != SKIP:
        if problem is not None:
            # The last sample may have lost members after the cut: refuse it rather than guess.
            group.fail(*problem)
        _finalize(group, patch_size, check_values)
        yield group
    else:
        if problem is not None:
            yield ShardProblem(problem[0], problem[1], None if group is None else group.key)
        if group is not None:
            yield group

"""Rules and bounded parsers for untrusted shard content: keys, ``.npy`` headers, JSON, tar headers, index paths.

Shards and their ``index.json`` travel between teams and buckets, so everything here assumes a hostile
file: no parser recurses on input nesting, nothing allocates from a size the file claims before that size
is checked, and every refusal says which rule was broken. The scan (:mod:`lightning_adaptiveload.shards.scan`)
and the index reader turn :class:`Refused` into a :class:`~lightning_adaptiveload.shards.format.ShardError`
naming the shard and member.
The threat model is in ``docs/reliability.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import tarfile
import urllib.parse
from collections.abc import Collection
from typing import Any

import numpy as np

__all__ = [
    "MAX_INDEX_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TAR_HEADER_BYTES",
    "Refused",
    "check_index_path",
    "key_problem",
    "load_json",
    "parse_npy_header",
]

# Caps, each far above what a well-formed file needs (documented in docs/reliability.md).
MAX_JSON_BYTES = 1 << 22  # a sample's .json metadata (captions, sources): 4 MiB
MAX_JSON_DEPTH = 64  # nesting of any JSON we parse; real metadata and index.json need < 10
MAX_INDEX_BYTES = 1 << 30  # index.json: ~60 bytes a sample, so ~15 million samples
MAX_TAR_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header's data (real ones are < 10 KiB)
_MAX_TAR_HEADER_CHAIN = 8  # pax/long-name headers in a row before a member (tarfile recurses on them)
_MAX_NPY_DEPTH = 8  # a structured dtype's descr nests 4 deep; plain ones 2
_MAX_NPY_DIMS = 64  # numpy's own limit


class Refused(ValueError):
    """Untrusted input broke a rule; ``reason`` is the shard layer's reason name, ``detail`` the rule."""

    def __init__(self, detail: str, reason: str = "") -> None:
        super().__init__(detail)
        self.detail = detail
        self.reason = reason


# ----------------------------------------------------------------------------------------------------
# Sample keys: one set of rules for the writer and the reader
# ----------------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile("[\ud800-\udfff]")  # tarfile's surrogateescape stand-ins for non-UTF-8 bytes


def key_problem(key: Any) -> str | None:
    """Which key rule ``key`` breaks, as a sentence, or None for a valid key.

    Keys are what a tar member name holds before its first dot, and they become fields of batches
    and of ``index.json``; so a key is a non-empty string that is no path (no '/', '\\' or '..'),
    holds no dot, no control character and only valid UTF-8, and does not start with '__' (reserved
    for fields like ``__key__``).
    """
    if not isinstance(key, str):
        return f"is a {type(key).__name__}, not a string"
    if not key:
        return "is empty"
    if key.startswith(("/", "\\")):
        return "is an absolute path: keys cannot contain '/' or '\\'"
    if ".." in re.split(r"[/\\]", key):
        return "climbs out of its folder with '..': keys cannot contain '/', '\\' or '.'"
    if "/" in key or "\\" in key:
        return "has a path component: keys cannot contain '/' or '\\'"
    if "." in key:
        return "contains '.': a key is the member name up to its first dot, so keys cannot contain dots"
    if m := _CONTROL.search(key):
        return f"contains the control character U+{ord(m.group()):04X}"
    if _SURROGATE.search(key):
        return "is not valid UTF-8"
    if key.startswith("__"):
        return "starts with '__', which is reserved for fields such as '__key__'"
    return None


# ----------------------------------------------------------------------------------------------------
# .npy headers: a strict literal parser without recursion
# ----------------------------------------------------------------------------------------------------

_NPY_TOKEN = re.compile(
    r"""\s*(?:(?P<open>[{(\[])|(?P<close>[})\]])|(?P<comma>,)|(?P<colon>:)"""
    r"""|(?P<str>'[^'\\\n]*'|"[^"\\\n]*")|(?P<int>[+-]?[0-9]{1,30})(?![0-9A-Za-z_.])"""
    r"""|(?P<name>True|False|None)(?![0-9A-Za-z_]))"""
)
_CLOSER = {"{": "}", "(": ")", "[": "]"}
_NOTHING = object()


class _Frame:
    __slots__ = ("opener", "items", "key", "state", "commas")

    def __init__(self, opener: str) -> None:
        self.opener = opener
        self.items: list[Any] = []
        self.key: Any = _NOTHING
        self.state = "start"  # start (after the opener or a comma) | colon | value | sep
        self.commas = 0


def _literal(text: str) -> Any:
    """Parse the Python literal subset numpy writes in ``.npy`` headers, with an explicit stack.

    Accepts dicts, lists, tuples, quoted strings without escapes, integers, True, False and None;
    nesting is capped (a header cannot be made to exhaust the stack, unlike ``ast.literal_eval``).
    """
    stack: list[_Frame] = []
    result: Any = _NOTHING
    pos, end = 0, len(text.rstrip())

    def put(value: Any) -> None:
        nonlocal result
        if not stack:
            if result is not _NOTHING:
                raise Refused("has text after the header dict")
            result = value
            return
        top = stack[-1]
        if top.opener == "{":
            if top.state == "start":
                if not isinstance(value, str | int) or isinstance(value, bool):
                    raise Refused("has a dict key that is not a string")
                top.key, top.state = value, "colon"
            elif top.state == "value":
                top.items.append((top.key, value))
                top.state = "sep"
            else:
                raise Refused("has a value where ':' or ',' belongs")
        else:
            if top.state != "start":
                raise Refused("has a value where ',' belongs")
            top.items.append(value)
            top.state = "sep"

    while pos < end:
        m = _NPY_TOKEN.match(text, pos)
        if m is None:
            raise Refused(f"has an unexpected character {text[pos : pos + 1]!r} at offset {pos}")
        pos = m.end()
        kind = m.lastgroup
        tok = m.group(kind)
        if kind == "open":
            if stack and stack[-1].state not in ("start", "value"):
                raise Refused(f"has {tok!r} where ',' belongs")
            if len(stack) >= _MAX_NPY_DEPTH:
                raise Refused(f"nests deeper than {_MAX_NPY_DEPTH} levels")
            if stack and stack[-1].opener == "{" and stack[-1].state == "start":
                raise Refused("has a dict key that is not a string")
            stack.append(_Frame(tok))
        elif kind == "close":
            if not stack or _CLOSER[stack[-1].opener] != tok:
                raise Refused(f"has an unbalanced {tok!r}")
            top = stack.pop()
            if top.state not in ("start", "sep"):
                raise Refused(f"has {tok!r} after a dict key")
            if top.opener == "{":
                value: Any = dict(top.items)
                if len(value) != len(top.items):
                    raise Refused("repeats a dict key")
            elif top.opener == "[":
                value = list(top.items)
            elif len(top.items) == 1 and not top.commas:
                value = top.items[0]  # "(5)" is 5, as in Python
            else:
                value = tuple(top.items)
            put(value)
        elif kind == "comma":
            if not stack or stack[-1].state != "sep":
                raise Refused(f"has a misplaced ',' at offset {m.start(kind)}")
            stack[-1].state = "start"
            stack[-1].commas += 1
        elif kind == "colon":
            if not stack or stack[-1].opener != "{" or stack[-1].state != "colon":
                raise Refused(f"has a misplaced ':' at offset {m.start(kind)}")
            stack[-1].state = "value"
        elif kind == "str":
            put(tok[1:-1])
        elif kind == "int":
            put(int(tok))
        else:
            put({"True": True, "False": False, "None": None}[tok])
    if stack:
        raise Refused("is cut short (an unclosed bracket)")
    if result is _NOTHING:
        raise Refused("is empty")
    return result


_PLAIN_DESCR = re.compile(r"[<>|=]?[biufcO?][0-9]{0,2}")


#: Headers parsed already, by their bytes: a shard's samples repeat a few headers (one dtype, a few
#: shapes), and the same bytes always parse to the same answer, so each distinct header is checked once.
_NPY_HEADERS: dict[tuple[bytes, int], tuple[np.dtype | None, Any, bool, tuple[int, ...]]] = {}
_NPY_HEADERS_MAX = 4096


def parse_npy_header(header: bytes, major: int) -> tuple[np.dtype | None, Any, bool, tuple[int, ...]]:
    """Parse the dict of a ``.npy`` header (the bytes after the length field).

    A header accepted before (the same bytes) gives its earlier answer; a refused one is refused anew.

    Args:
        header: the header text, at most a few KiB (the caller caps it).
        major: the format's major version (3 allows UTF-8, 1 and 2 are Latin-1).

    Returns:
        ``(dtype, descr, fortran_order, shape)``; ``dtype`` is None for a descr that is not a plain
        scalar type (structured, subarray, datetime), which no shard may hold anyway.

    Raises:
        Refused: naming the broken rule.
    """
    key = (bytes(header), major)
    got = _NPY_HEADERS.get(key)
    if got is None:
        got = _parse_npy_header(key[0], major)
        if isinstance(got[1], str):  # immutable answers only (a list descr is refused later anyway)
            if len(_NPY_HEADERS) >= _NPY_HEADERS_MAX:
                _NPY_HEADERS.clear()
            _NPY_HEADERS[key] = got
    return got


def _parse_npy_header(header: bytes, major: int) -> tuple[np.dtype | None, Any, bool, tuple[int, ...]]:
    try:
        text = header.decode("utf-8" if major >= 3 else "latin-1")
    except UnicodeDecodeError:
        raise Refused("header is not valid UTF-8") from None
    d = _literal(text)
    if not isinstance(d, dict):
        raise Refused(f"header is a {type(d).__name__}, not a dict")
    if set(d) != {"descr", "fortran_order", "shape"}:
        raise Refused(f"header keys are {sorted(map(str, d))}, not ['descr', 'fortran_order', 'shape']")
    fortran, shape, descr = d["fortran_order"], d["shape"], d["descr"]
    if not isinstance(fortran, bool):
        raise Refused(f"fortran_order is {fortran!r}, not True or False")
    if not isinstance(shape, tuple) or not all(type(s) is int for s in shape):
        raise Refused(f"shape {shape!r} is not a tuple of integers")
    if len(shape) > _MAX_NPY_DIMS:
        raise Refused(f"shape has {len(shape)} dimensions (numpy allows {_MAX_NPY_DIMS})")
    if any(s < 0 for s in shape):
        raise Refused(f"shape {list(shape)} has a negative dimension")
    dtype = None
    if isinstance(descr, str) and _PLAIN_DESCR.fullmatch(descr):
        try:
            dtype = np.dtype(descr)
        except (TypeError, ValueError):
            dtype = None
    elif not isinstance(descr, str | list):
        raise Refused(f"descr {descr!r} is not a dtype description")
    return dtype, descr, fortran, shape


# ----------------------------------------------------------------------------------------------------
# JSON with a size and depth bound
# ----------------------------------------------------------------------------------------------------

# Depth is counted on the structure alone: escaped characters (\" among them) dropped, then everything
# but quotes and brackets, then what the (now escape-free) strings held. Three linear passes.
_JSON_ESCAPE = re.compile(rb"\\.", re.S)
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_JSON_QUOTED = re.compile(rb'"[^"]*(?:"|\Z)')
_DEPTH_CHUNK = 1 << 24


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (an upper bound for invalid JSON)."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_JSON_DEPTH:
        return opens  # cannot nest deeper than it opens: the common case costs two counts
    structure = _JSON_ESCAPE.sub(b"", raw).translate(None, _NOT_STRUCTURE)
    bare = np.frombuffer(_JSON_QUOTED.sub(b"", structure), dtype=np.uint8)
    step = np.zeros(256, dtype=np.int8)
    step[[ord("["), ord("{")]] = 1
    step[[ord("]"), ord("}")]] = -1
    deepest, level = 0, 0
    for start in range(0, bare.size, _DEPTH_CHUNK):
        levels = np.cumsum(step[bare[start : start + _DEPTH_CHUNK]], dtype=np.int64) + level
        if levels.size:
            deepest = max(deepest, int(levels.max()))
            level = int(levels[-1])
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of range")
    return value


def load_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH, finite: bool = True) -> Any:
    """Parse strict JSON: UTF-8, nesting at most ``max_depth``, no NaN/Infinity literals.

    With ``finite`` a number beyond the float range (``1e999``) is refused too; without, it becomes
    ``inf`` and the caller's type checks name the field that holds it.

    Raises:
        Refused: too deep (``json.loads`` would recurse), not UTF-8, or not JSON.
    """
    depth = json_depth(raw)
    if depth > max_depth:
        raise Refused(f"nests {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(
            raw.decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_float=_finite_float if finite else float,
        )
    except UnicodeDecodeError as err:
        raise Refused(f"does not parse: not UTF-8 ({err})") from None
    except (ValueError, RecursionError) as err:  # ValueError covers JSONDecodeError and huge integers
        raise Refused(f"does not parse ({err})") from None


# ----------------------------------------------------------------------------------------------------
# Tar headers
# ----------------------------------------------------------------------------------------------------

_META_TYPES = frozenset(
    {
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
    }
)


class CheckedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses negative sizes, oversized pax/long-name headers and long header chains.

    Why: tarfile reads a pax or GNU long-name header's claimed size in one ``read`` (an allocation of
    that size), recurses once per chained header, and moves its offset backwards on a negative size
    (a loop in random-access mode). These checks run before tarfile acts on the header.
    """

    @classmethod
    def frombuf(cls, buf, encoding, errors):  # noqa: D102 - tarfile's hook
        obj = super().frombuf(buf, encoding, errors)
        if obj.size < 0:
            raise Refused(f"tar header of {obj.name!r} claims a negative size ({obj.size})", "corrupt_tar")
        if obj.type in _META_TYPES and obj.size > MAX_TAR_HEADER_BYTES:
            raise Refused(
                f"a pax or GNU long-name header ({obj.name!r}) claims {obj.size} bytes; such headers hold "
                f"at most {MAX_TAR_HEADER_BYTES} here",
                "corrupt_tar",
            )
        return obj

    def _proc_member(self, tarfile_):
        if self.type not in _META_TYPES:
            return super()._proc_member(tarfile_)
        depth = getattr(tarfile_, "_la_header_chain", 0) + 1
        if depth > _MAX_TAR_HEADER_CHAIN:
            raise Refused(f"more than {_MAX_TAR_HEADER_CHAIN} pax/long-name headers in a row", "corrupt_tar")
        tarfile_._la_header_chain = depth
        try:
            return super()._proc_member(tarfile_)
        finally:
            tarfile_._la_header_chain = depth - 1


# ----------------------------------------------------------------------------------------------------
# Paths named by an index
# ----------------------------------------------------------------------------------------------------

# Characters allowed in a URL taken from an index: RFC 3986 without quotes, brackets, braces (curl globs)
# and backslashes, so that no downloader or shell can read a URL as more than one address.
_SAFE_URL = re.compile(r"[A-Za-z0-9._~:/?#@!$&()*+,;=%-]+")


def _scheme(text: str) -> str:
    scheme = urllib.parse.urlparse(text).scheme
    return scheme if len(scheme) > 1 else ""  # one letter: a Windows drive, a local path


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_index_path(
    value: Any,
    base: str | None,
    *,
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> str:
    """The shard location an index entry names, if the index may name it; else :class:`Refused`.

    Args:
        value: the entry's ``path`` as written in the index.
        base: the index's folder: an absolute local directory, a URL ending in '/', or None when the
            index has no folder (an in-memory dict): then local paths are taken as given.
        allow_schemes: URL schemes an entry may name anywhere (e.g. ``{"https", "s3"}``); never ``pipe``.
        allow_outside: accept local paths (and URLs of the index's own scheme) outside its folder.

    Returns:
        The absolute local path or URL.
    """
    if not isinstance(value, str) or not value:
        raise Refused(f"path {value!r} is not a non-empty string", "bad_index")
    if _CONTROL.search(value):
        raise Refused(f"path {value!r} contains a control character", "bad_index")
    scheme = _scheme(value).lower()
    if scheme == "pipe" or value.lower().startswith("pipe:"):
        raise Refused(
            f"path {value!r} is a command (pipe:); commands are run only from shard lists you write, "
            "never from an index",
            "unsafe_index_path",
        )
    base_scheme = _scheme(base).lower() if base else ""
    if scheme and scheme != "file":
        if not _SAFE_URL.fullmatch(value):
            raise Refused(f"URL {value!r} has characters that are unsafe in a URL", "unsafe_index_path")
        if base_scheme == scheme and _url_inside(value, base):  # type: ignore[arg-type]
            return value
        if scheme in {s.lower() for s in allow_schemes} or (allow_outside and base_scheme == scheme):
            return value
        raise Refused(
            f"path {value!r} is a {scheme}: URL outside the index's folder; allow the scheme with "
            f"allow_schemes=[{scheme!r}] if you trust this index",
            "unsafe_index_path",
        )
    if scheme == "file":
        value = urllib.parse.unquote(urllib.parse.urlparse(value).path)
    if base_scheme:  # a remote index: relative paths are URLs in its folder
        if os.path.isabs(value) or value.startswith("\\"):
            raise Refused(f"path {value!r} names a local file, but the index is remote", "unsafe_index_path")
        url = join_url(base, urllib.parse.quote(value))  # type: ignore[arg-type]
        if _url_inside(url, base) or allow_outside:  # type: ignore[arg-type]
            return url
        raise Refused(
            f"path {value!r} climbs out of the index's folder ({base}); pass allow_outside=True if you trust "
            "this index",
            "unsafe_index_path",
        )
    if base is None:
        return os.path.abspath(value)
    path = os.path.normpath(os.path.join(base, value))
    if _inside(path, os.path.normpath(base)) or allow_outside:
        return path
    how = "is an absolute path outside" if os.path.isabs(value) else "climbs out of"
    raise Refused(
        f"path {value!r} {how} the index's folder ({base}); pass allow_outside=True if you trust this index",
        "unsafe_index_path",
    )


#: URL schemes whose paths are folders of objects (object storage): relative index paths join them.
FOLDER_SCHEMES = frozenset({"http", "https", "file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def url_folder(url: str) -> str | None:
    """The folder of ``url`` (up to its last '/', kept) where relative paths resolve, or None for a scheme
    without folders (e.g. ``pipe:``)."""
    if urllib.parse.urlsplit(url).scheme.lower() not in FOLDER_SCHEMES:
        return None
    return url.rsplit("/", 1)[0] + "/"


def join_url(base: str, value: str) -> str:
    """``value`` (quoted, relative) resolved against the folder URL ``base``, dot segments resolved as
    for http, for object-storage schemes too (``urljoin`` leaves ``s3://`` alone)."""
    b = urllib.parse.urlsplit(base)
    if b.scheme.lower() in urllib.parse.uses_relative:
        return urllib.parse.urljoin(base, value)
    joined = urllib.parse.urlsplit(urllib.parse.urljoin(f"http://{b.netloc}{b.path}", value))
    if joined.netloc != b.netloc:  # e.g. '//other/x': another bucket, outside the folder
        return urllib.parse.urlunsplit((b.scheme, joined.netloc, joined.path, joined.query, ""))
    return urllib.parse.urlunsplit((b.scheme, b.netloc, joined.path, joined.query, ""))


def _url_inside(url: str, base: str) -> bool:
    u, b = urllib.parse.urlparse(url), urllib.parse.urlparse(base)
    if (u.scheme.lower(), u.netloc) != (b.scheme.lower(), b.netloc):
        return False
    parts = u.path.split("/")
    if ".." in parts or "." in parts or "%2e" in u.path.lower():
        return False  # urljoin resolved dot segments already; any left (or encoded) is a trick
    return u.path.startswith(b.path if b.path.endswith("/") else b.path + "/")

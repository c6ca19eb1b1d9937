"""Byte ranges of shards where they live: local files, HTTP(S), S3, GCS and Azure, with retries.

:func:`store_for` picks the backend of a URL once; :meth:`RangeStore.get` returns exactly the bytes
``[start, start + length)`` of a shard or raises. Every answer is checked before it is used (a server, a
proxy or a cache may lie): an HTTP answer must be ``206`` with the ``Content-Range`` asked for and a body
of that length (a ``200`` is taken only when the range is the whole file); any backend's body must
have the length asked for. Such a lie is :class:`RangeLie` (reason ``bad_range``). Transient failures
(5xx, 429, resets, timeouts) are :class:`Transient` and :func:`fetch` retries them with exponential
backoff and jitter until :attr:`RemoteSettings.retry_wait_s` is spent, then raises a ``ShardError``
(``unreachable_shard``) naming the URL and the attempts.

Backends:

- local paths and ``file://``: ``os.pread`` on a regular file;
- ``http://``, ``https://``: a lean HTTP/1.1 client (:mod:`~.http_conn`, ``http.client``'s interface and
  errors) with one kept-alive connection per thread and host;
- ``s3://``: boto3 (``get_object(Range=...)``), or s3fs through fsspec when boto3 is missing; the usual
  AWS environment and configuration (``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ``~/.aws``);
- ``gs://``, ``gcs://``, ``az://``, ``abfs://``: fsspec with gcsfs / adlfs and their own credentials.

No shell command is ever run. The optional libraries are imported when a URL needs them; missing, the
error names the ``remote`` extra (``pip install 'lightning-adaptiveload[remote]'``).
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.http_conn import Connection, Response
from lightning_adaptiveload.shards.paths import is_url, norm_path, open_regular

__all__ = [
    "CutShort",
    "RangeLie",
    "RangeStore",
    "RemoteSettings",
    "Transient",
    "cut_short",
    "fetch",
    "judge_range_head",
    "read_object",
    "store_for",
]

#: When a stream reads sample spans with ranged requests instead of streaming whole shards.
RangedMode = Literal["auto", "always", "never"]


@dataclass(frozen=True, kw_only=True)
class RemoteSettings:
    """How shards are read by byte range (``Source.remote``).

    Raises:
        ValueError: in ``__post_init__``, a value out of its range, naming the setting and the value.

    Example:
        >>> RemoteSettings(max_concurrency=4).merge_gap
        0
    """

    ranged: RangedMode = "auto"
    """``"auto"``: ranged reads for remote shards whose index lists sample spans, streaming otherwise;
    ``"always"``: ranged wherever the index lists spans (local files too); ``"never"``: stream every shard
    whole (webdataset's ``gopen``), as before ranged reads."""

    max_concurrency: int = 64
    """Requests in flight at once per loader worker (threads waiting on the network, not busy: enough
    of them hide a per-request latency of tens of milliseconds). The threads, and the connections they
    keep alive, are shared by the readers of one process, so a new epoch's stream starts on warm
    connections."""

    max_bytes_in_flight: int = 256 << 20
    """Bytes fetched ahead (requested and not yet consumed) per loader worker; one request larger than
    this still runs, alone."""

    read_ahead_batches: int = 32
    """Planned batches of the stream whose requests are sent ahead of the one being collated, at first.
    Each time a batch is taken before its bytes arrived (the loader waited on the network), the depth
    grows fourfold, up to ``max_read_ahead_batches`` and within ``max_bytes_in_flight``: a stream whose
    batches are consumed faster than a request's latency reads further ahead, one whose consumer is
    slower (the usual training step) stays at this depth."""

    max_read_ahead_batches: int = 1024
    """The most batches read ahead once the depth has grown (see ``read_ahead_batches``)."""

    merge_gap: int = 0
    """Planned spans of one shard at most this many bytes apart are fetched in one request (the bytes
    between are read and dropped). 0: only adjacent spans merge, and an epoch reads each planned byte
    once."""

    max_request_bytes: int = 64 << 20
    """A merged request stops growing at this size."""

    merge_window_bytes: int = 32 << 20
    """Neighbouring spans of one shard are merged over a window of consecutive planned batches holding
    up to this many bytes, not only within a batch: a stream that takes a shard's samples a few per batch
    fetches them in one request. Samples parsed for a later batch of the window are held until it is
    taken (their bytes count as in flight until then). 0: merge within each batch only. A window's
    requests are sent when its first batch is due, so keep it well below ``max_bytes_in_flight``."""

    timeout_s: float = 30.0
    """Connect and read timeout of one request, in seconds."""

    retry_wait_s: float = 120.0
    """How long a range is retried after transient failures (5xx, resets, timeouts) before the read fails
    with ``unreachable_shard``, naming the URL (seconds, backoff included)."""

    backoff_s: float = 0.2
    """The first retry's wait (seconds); each next doubles, up to ``backoff_max_s``, with jitter."""

    backoff_max_s: float = 10.0
    """The longest wait between two attempts (seconds)."""

    inline_http: bool = True
    """Plain ``http://`` ranges of at most 64 KiB are sent and read by the loader's own thread, over
    non-blocking sockets (:mod:`~.http_pump`), rather than by the fetch threads: no interpreter lock
    changes hands per request, which roughly halves a small request's CPU. Answers are judged as the
    threads judge them (a lie refused at once); a failed attempt is retried through the threads after its
    backoff, and redirects and chunked answers are left to them. ``https://``, the other schemes, larger
    ranges, a configured cache and a custom store always use the threads. False: every range goes
    through the threads."""

    cache_bytes: int = 0
    """A local cache of fetched spans, bounded in bytes (least recently used evicted); 0: no cache."""

    cache_dir: str | None = None
    """The cache's folder (None: a folder under the system's temporary directory)."""

    def __post_init__(self) -> None:
        if not isinstance(self.inline_http, bool):
            raise ValueError(f"RemoteSettings.inline_http must be True or False, got {self.inline_http!r}")
        if self.ranged not in ("auto", "always", "never"):
            raise ValueError(
                f"RemoteSettings.ranged must be 'auto', 'always' or 'never', got {self.ranged!r}"
            )
        for name, low in (
            ("max_concurrency", 1),
            ("max_bytes_in_flight", 1),
            ("read_ahead_batches", 0),
            ("max_read_ahead_batches", 0),
            ("merge_gap", 0),
            ("merge_window_bytes", 0),
            ("max_request_bytes", 1),
            ("cache_bytes", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RemoteSettings.{name} must be an integer >= {low}, got {value!r}")
        for name in ("timeout_s", "retry_wait_s", "backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ValueError(f"RemoteSettings.{name} must be a number of seconds >= 0, got {value!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"RemoteSettings.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.max_read_ahead_batches < self.read_ahead_batches:
            raise ValueError(
                f"RemoteSettings.max_read_ahead_batches ({self.max_read_ahead_batches}) must be >= "
                f"read_ahead_batches ({self.read_ahead_batches})"
            )


class Transient(Exception):
    """A failure worth retrying: a 5xx or 429 answer, a reset or closed connection, a timeout."""


class RangeLie(Exception):
    """An answer that is not the range asked for (never retried: the same server would lie again)."""


class CutShort(Transient):
    """A body that ended before the length its headers promised: a server stopped mid-answer (retried)
    or one that lies (refused as ``bad_range`` after :data:`MAX_CUT_SHORT` such answers in a row)."""


#: Answers cut short in a row after which a range is refused as a lie rather than retried.
MAX_CUT_SHORT = 3


class RangeStore:
    """One backend; :meth:`get` returns exactly ``length`` bytes at ``start`` of ``url`` or raises
    :class:`Transient`, :class:`RangeLie` or ``OSError`` (missing, forbidden: not retried)."""

    def get(self, url: str, start: int, length: int) -> bytes:
        raise NotImplementedError

    def identity(self, url: str) -> str:
        """What identifies the object's content for a cache (size, ETag), cheap; "" when unknown."""
        return ""

    def read_head(self, url: str, limit: int) -> bytes:
        """The object's first ``limit + 1`` bytes at most (all of it when smaller): a whole small object
        such as an index, read without trusting its claimed size (the caller refuses ``> limit``)."""
        raise NotImplementedError


def _checked_length(data: bytes, length: int, url: str, start: int) -> bytes:
    if len(data) != length:
        raise RangeLie(f"{url}: asked for {length} bytes at {start}, got {len(data)}")
    return data


class LocalStore(RangeStore):
    """Regular local files, read with ``os.pread`` (no shared file position: safe from many threads)."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                f = open_regular(path)
                fd = self._fds[path] = os.dup(f.fileno())
                f.close()
            return fd

    def get(self, url: str, start: int, length: int) -> bytes:
        path = norm_path(url)
        fd = self._fd(path)
        parts, got = [], 0
        while got < length:
            chunk = os.pread(fd, length - got, start + got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return _checked_length(b"".join(parts), length, path, start)

    def identity(self, url: str) -> str:
        st = os.fstat(self._fd(norm_path(url)))
        return f"{st.st_size}-{st.st_mtime_ns}"

    def read_head(self, url: str, limit: int) -> bytes:
        with open_regular(norm_path(url)) as f:
            return f.read(limit + 1)


_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})

#: Redirects followed for one request before it fails (``unreadable_shard``), naming the URL.
MAX_REDIRECTS = 5


def judge_range_head(
    url: str, start: int, length: int, status: int, reason: str, header: Callable[[str], str | None]
) -> None:
    """Judge the status and headers of the answer to ``Range: bytes=start-(start+length-1)`` of ``url``;
    returns where its body is to be read (``206`` of exactly that range, or ``200`` whose whole file is
    the range), else raises: :class:`Transient` (5xx, 429: retried), ``FileNotFoundError`` (404, 410),
    :class:`RangeLie` (a ``200`` with the whole file, a ``Content-Range`` or ``Content-Length`` other than
    asked) or ``OSError`` (any other status). ``header(name)`` gives a header's value or None.

    Used by :class:`HttpStore` and by the loader thread's own requests (:mod:`~.http_pump`), so both
    take and refuse the same answers with the same messages.
    """
    if status in _RETRY_STATUS:
        raise Transient(f"HTTP {status} {reason}")
    if status in (404, 410):
        raise FileNotFoundError(f"{url}: HTTP {status} {reason}")
    if status == 200:
        size = header("Content-Length")
        if start == 0 and size is not None and size.isdigit() and int(size) == length:
            return
        raise RangeLie(
            f"{url}: asked for bytes {start}-{start + length - 1}, the server sent 200 with the whole "
            f"file ({size} bytes): it ignores Range requests"
        )
    if status != 206:
        raise OSError(f"{url}: HTTP {status} {reason}")
    got = header("Content-Range") or ""
    unit, _, rest = got.partition(" ")
    span, _, _total = rest.partition("/")
    first, _, last = span.partition("-")
    if (
        unit != "bytes"
        or not (first.isdigit() and last.isdigit())
        or (int(first), int(last)) != (start, start + length - 1)
    ):
        raise RangeLie(
            f"{url}: asked for bytes {start}-{start + length - 1}, the answer's Content-Range is {got!r}"
        )
    size = header("Content-Length")
    if size is not None and (not size.isdigit() or int(size) != length):
        raise RangeLie(f"{url}: asked for {length} bytes at {start}, the answer's Content-Length is {size!r}")


def cut_short(url: str, start: int, length: int, got: int) -> CutShort:
    """The error of a body that ended after ``got`` of the ``length`` bytes asked at ``start``."""
    return CutShort(f"{url}: asked for {length} bytes at {start}, the body ended after {got}")


class HttpStore(RangeStore):
    """``http(s)://`` with ``Range: bytes=a-b``; one kept-alive connection per thread and host."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._moved: dict[str, str] = {}  # URL -> where a permanent redirect (301, 308) sent it

    def _follow(self, url: str, headers: dict[str, str]) -> tuple[Response, urllib.parse.SplitResult]:
        """GET ``url``, following at most :data:`MAX_REDIRECTS` redirects (the ``Range`` header sent again
        each time) to ``http(s)`` URLs only, never from ``https`` down to ``http``.

        Raises:
            OSError: a redirect loop, too many redirects, or one to a URL refused, naming ``url``.
        """
        target = self._moved.get(url, url)
        for _ in range(MAX_REDIRECTS + 1):
            resp, parts = self._request(target, "GET", headers)
            if resp.status not in _REDIRECT_STATUS:
                return resp, parts
            location = resp.getheader("Location") or ""
            resp.read(1 << 16)
            if not resp.isclosed():  # a redirect with a long body: not worth reading
                self._drop(parts)
            new = urllib.parse.urljoin(target, location.strip())
            scheme = urllib.parse.urlsplit(new).scheme.lower()
            if not location or scheme not in ("http", "https") or any(ord(c) < 33 for c in new):
                raise OSError(
                    f"{url}: HTTP {resp.status} redirects to {location!r}, which is not an http(s) URL"
                )
            if parts.scheme == "https" and scheme == "http":
                raise OSError(f"{url}: HTTP {resp.status} redirects from https down to http ({new}): refused")
            if resp.status in (301, 308):
                self._moved[url] = new
            target = new
        raise OSError(f"{url}: more than {MAX_REDIRECTS} redirects (the last to {target})")

    def _conn(self, parts: urllib.parse.SplitResult, fresh: bool = False) -> Connection:
        conns = self._local.__dict__.setdefault("conns", {})
        key = (parts.scheme, parts.netloc)
        conn = conns.get(key)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            try:
                host, port = parts.hostname, parts.port
            except ValueError as err:  # a port that is not a number
                raise OSError(f"{parts.geturl()!r}: {err}") from None
            if not host:
                raise OSError(f"no host in {parts.geturl()!r}")
            conn = conns[key] = Connection(parts.scheme, host, port, self.timeout_s)
        return conn

    def _request(self, url: str, method: str, headers: dict[str, str]) -> tuple[Response, Any]:
        parts = urllib.parse.urlsplit(url)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        try:
            conn = self._conn(parts)
            try:
                conn.request(method, target, headers=headers)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A kept-alive connection the server closed while idle: one fresh try, at once.
                conn = self._conn(parts, fresh=True)
                conn.request(method, target, headers=headers)
                resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            self._drop(parts)
            raise Transient(f"{type(err).__name__}: {err}") from None
        return resp, parts

    def _drop(self, parts: urllib.parse.SplitResult) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((parts.scheme, parts.netloc), None)
        if conn is not None:
            conn.close()

    def get(self, url: str, start: int, length: int) -> bytes:
        end = start + length - 1
        resp, parts = self._follow(url, {"Range": f"bytes={start}-{end}"})
        try:
            return self._body(resp, url, start, length)
        except BaseException:
            self._drop(parts)  # a body left unread would poison the kept-alive connection
            raise

    def read_head(self, url: str, limit: int) -> bytes:
        resp, parts = self._follow(url, {})
        try:
            status = resp.status
            if status in _RETRY_STATUS:
                raise Transient(f"HTTP {status} {resp.reason}")
            if status in (404, 410):
                raise FileNotFoundError(f"{url}: HTTP {status} {resp.reason}")
            if status != 200:
                raise OSError(f"{url}: HTTP {status} {resp.reason}")
            try:
                data = resp.read(limit + 1)
            except (OSError, http.client.HTTPException) as err:
                raise Transient(f"{type(err).__name__} while reading the body: {err}") from None
        finally:
            self._drop(parts)  # a body left unread (larger than the limit) would poison the connection
        return data

    def _body(self, resp: Response, url: str, start: int, length: int) -> bytes:
        if resp.status in _RETRY_STATUS:
            resp.read(1 << 16)  # a short error page; never the whole of a lying body
        judge_range_head(url, start, length, resp.status, resp.reason, resp.getheader)
        return self._read(resp, url, start, length)

    def _read(self, resp: Response, url: str, start: int, length: int) -> bytes:
        try:
            data = resp.read(length + 1)  # one byte more: a body longer than asked for is a lie too
        except http.client.IncompleteRead as err:
            raise cut_short(url, start, length, len(err.partial)) from None
        except (OSError, http.client.HTTPException) as err:
            raise Transient(f"{type(err).__name__} while reading the body: {err}") from None
        if len(data) > length:
            raise RangeLie(f"{url}: asked for {length} bytes at {start}, the body is longer")
        return _checked_length(data, length, url, start)

    def identity(self, url: str) -> str:
        return ""  # a HEAD per shard would cost a request; the cache keys on the URL and span only


_EXTRA = "pip install 'lightning-adaptiveload[remote]'"


class S3Store(RangeStore):
    """``s3://bucket/key`` through boto3 (its usual credentials and ``AWS_ENDPOINT_URL``)."""

    def __init__(self, timeout_s: float) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:  # pragma: no cover - the extra brings it
            raise ImportError(f"reading s3:// shards needs boto3 or s3fs: {_EXTRA}") from None
        # botocore's own "max_attempts" counts retries; total_max_attempts=1 is one attempt and no retry, so
        # every failure reaches fetch(), which counts it and bounds the whole wait by retry_wait_s.
        cfg = Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"total_max_attempts": 1, "mode": "standard"},
        )
        self._client = boto3.session.Session().client("s3", config=cfg)
        from botocore.exceptions import ClientError

        self._client_error = ClientError

    def get(self, url: str, start: int, length: int) -> bytes:
        parts = urllib.parse.urlsplit(url)
        try:
            resp = self._client.get_object(
                Bucket=parts.netloc, Key=parts.path.lstrip("/"), Range=f"bytes={start}-{start + length - 1}"
            )
            got = resp.get("ContentRange") or ""
            data = resp["Body"].read(length + 1)
        except self._client_error as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status in _RETRY_STATUS or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise Transient(f"S3 {code or status}") from None
            if code in ("NoSuchKey", "NoSuchBucket", "404"):
                raise FileNotFoundError(f"{url}: {code}") from None
            raise OSError(f"{url}: S3 {code or status}: {err}") from None
        except Exception as err:  # noqa: BLE001 - botocore's connection errors have no common base
            if isinstance(err, OSError | ValueError) and not _is_network(err):
                raise
            raise Transient(f"{type(err).__name__}: {err}") from None
        if got and not got.startswith(f"bytes {start}-{start + length - 1}/"):
            raise RangeLie(
                f"{url}: asked for bytes {start}-{start + length - 1}, the answer's Content-Range is {got!r}"
            )
        if len(data) > length:
            raise RangeLie(f"{url}: asked for {length} bytes at {start}, the body is longer")
        return _checked_length(data, length, url, start)

    def read_head(self, url: str, limit: int) -> bytes:
        parts = urllib.parse.urlsplit(url)
        try:
            resp = self._client.get_object(
                Bucket=parts.netloc, Key=parts.path.lstrip("/"), Range=f"bytes=0-{limit}"
            )
            return resp["Body"].read(limit + 1)
        except self._client_error as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange":  # an empty object has no byte 0
                return b""
            if code in ("NoSuchKey", "NoSuchBucket", "404"):
                raise FileNotFoundError(f"{url}: {code}") from None
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status in _RETRY_STATUS or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise Transient(f"S3 {code or status}") from None
            raise OSError(f"{url}: S3 {code or status}: {err}") from None
        except Exception as err:  # noqa: BLE001 - botocore's connection errors have no common base
            if isinstance(err, OSError | ValueError) and not _is_network(err):
                raise
            raise Transient(f"{type(err).__name__}: {err}") from None


def _is_network(err: BaseException) -> bool:
    name = type(err).__name__
    return (
        isinstance(err, ConnectionError | TimeoutError | socket.timeout)
        or "Connection" in name
        or "Timeout" in name
    )


class FsspecStore(RangeStore):
    """Any fsspec filesystem (s3fs, gcsfs, adlfs): ``cat_file(path, start, end)``."""

    def __init__(self, protocol: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise ImportError(f"reading {protocol}:// shards needs fsspec: {_EXTRA}") from None
        try:
            self._fs = fsspec.filesystem(protocol)
        except ImportError as err:
            raise ImportError(
                f"reading {protocol}:// shards needs fsspec's backend for it ({err}): {_EXTRA}"
            ) from None

    def get(self, url: str, start: int, length: int) -> bytes:
        try:
            data = self._fs.cat_file(url, start=start, end=start + length)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as err:  # noqa: BLE001 - every fsspec backend raises its own
            raise Transient(f"{type(err).__name__}: {err}") from None
        return _checked_length(bytes(data), length, url, start)

    def read_head(self, url: str, limit: int) -> bytes:
        try:
            with self._fs.open(url, "rb") as f:
                return f.read(limit + 1)
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as err:  # noqa: BLE001 - every fsspec backend raises its own
            raise Transient(f"{type(err).__name__}: {err}") from None


_STORES: dict[
    tuple[int, str, float], RangeStore
] = {}  # by process too: a forked worker makes its own clients
_STORES_LOCK = threading.Lock()


def store_for(url: str, timeout_s: float = 30.0) -> RangeStore:
    """The backend of ``url`` (one per scheme and timeout, per process)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() if is_url(url) else "file"
    key = (os.getpid(), scheme, float(timeout_s))
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            if scheme == "file":
                store = LocalStore()
            elif scheme in ("http", "https"):
                store = HttpStore(timeout_s)
            elif scheme in ("s3", "s3a"):
                try:
                    store = S3Store(timeout_s)
                except ImportError:
                    store = FsspecStore("s3")
            elif scheme in ("gs", "gcs", "az", "abfs", "abfss", "adl"):
                store = FsspecStore(scheme)
            else:
                raise ValueError(
                    f"no ranged reads for {scheme}: URLs ({url}); use http(s)://, s3://, gs://, az:// or local "
                    "paths, or RemoteSettings.ranged='never' to stream the shards"
                )
            _STORES[key] = store
    return store


def read_object(url: str, limit: int, settings: RemoteSettings | None = None) -> bytes:
    """A small whole object (an index file) of any backend: its bytes, at most ``limit + 1`` of them
    (the caller refuses a larger one by that extra byte), retried on transient failures as :func:`fetch`.

    Raises:
        FileNotFoundError: no such object.
        ShardError: ``unreachable_shard`` after ``settings.retry_wait_s`` of transient failures,
            ``unreadable_shard`` for one forbidden or refused (e.g. a redirect to another scheme).
    """
    settings = settings if settings is not None else RemoteSettings(retry_wait_s=30.0)
    store = store_for(url, settings.timeout_s)
    began, attempt = time.monotonic(), 0
    while True:
        attempt += 1
        try:
            return store.read_head(url, limit)
        except FileNotFoundError:
            raise
        except Transient as err:
            spent = time.monotonic() - began
            wait = min(settings.backoff_max_s, settings.backoff_s * 2 ** (attempt - 1))
            wait *= 0.5 + random.random() / 2
            if spent + wait > settings.retry_wait_s:
                raise ShardError(
                    url,
                    None,
                    f"{attempt} attempts over {spent:.1f} s failed, the last with {err}",
                    reason="unreachable_shard",
                ) from None
            time.sleep(wait)
        except OSError as err:
            raise ShardError(url, None, f"cannot read it ({err})", reason="unreadable_shard") from None


def fetch(
    store: RangeStore,
    url: str,
    start: int,
    length: int,
    settings: RemoteSettings,
    *,
    what: Callable[[], tuple[str | None, str | None]] = lambda: (None, None),
    sleep: Callable[[float], None] = time.sleep,
    prior: Exception | None = None,
) -> tuple[bytes, int]:
    """``length`` bytes at ``start`` of ``url``, retried on transient failures; ``(data, attempts)``.

    Args:
        what: ``() -> (key, member)`` named in an error (the samples the range holds).
        prior: how a first attempt made elsewhere failed (a :class:`Transient`, :class:`RangeLie` or
            ``OSError``, as :meth:`RangeStore.get` raises them): judged as if ``store.get`` had raised it,
            counted as attempt 1 (a lie is refused at once, never asked again; a transient failure waits
            its backoff before the store tries).

    Raises:
        ShardError: ``bad_range`` for an answer that lies; ``unreachable_shard`` when
            ``settings.retry_wait_s`` passed with transient failures only (naming the URL and the attempts);
            ``missing_shard`` / ``unreadable_shard`` for a missing or forbidden object.
    """
    began = time.monotonic()
    attempt = cut = 0
    while True:
        attempt += 1
        try:
            if prior is None:
                return store.get(url, start, length), attempt
            failed, prior = prior, None
            raise failed
        except RangeLie as err:
            key, member = what()
            raise ShardError(
                url, key, f"refused the answer to a ranged read: {err}", reason="bad_range", member=member
            ) from None
        except Transient as err:
            cut = cut + 1 if isinstance(err, CutShort) else 0
            if cut >= MAX_CUT_SHORT:
                key, member = what()
                raise ShardError(
                    url,
                    key,
                    f"refused the answer to a ranged read, {cut} times in a row: {err}",
                    reason="bad_range",
                    member=member,
                ) from None
            spent = time.monotonic() - began
            wait = min(settings.backoff_max_s, settings.backoff_s * 2 ** (attempt - 1))
            wait *= 0.5 + random.random() / 2  # jitter: workers that failed together do not retry together
            if spent + wait > settings.retry_wait_s:
                key, member = what()
                raise ShardError(
                    url,
                    key,
                    f"bytes {start}-{start + length - 1}: {attempt} attempts over {spent:.1f} s failed, the last "
                    f"with {err} (RemoteSettings.retry_wait_s={settings.retry_wait_s})",
                    reason="unreachable_shard",
                    member=member,
                ) from None
            sleep(wait)
        except FileNotFoundError as err:
            key, member = what()
            raise ShardError(
                url, key, f"the shard does not exist ({err})", reason="missing_shard", member=member
            ) from None
        except OSError as err:
            key, member = what()
            raise ShardError(
                url, key, f"cannot read the shard ({err})", reason="unreadable_shard", member=member
            ) from None

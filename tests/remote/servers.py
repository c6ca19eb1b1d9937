"""Real servers on the loopback address, for the tests and the benchmark of reads from object storage.

- :class:`Nginx`: the OS's nginx serving a folder (HTTP Range support built in), started from a generated
  config whose every path is under a temporary folder (``daemon off``, one process, a subprocess of the
  test), with an access log of one line per request: the bytes of the body sent and the ``Range`` asked.
  :meth:`Nginx.stop` and :meth:`Nginx.start` take it away and bring it back on the same port.
- :class:`MotoS3`: moto's S3 server in a subprocess (this file run as a script), with a WSGI layer that
  writes the same kind of access log (moto's own log holds no byte counts).
- :class:`FaultProxy`: a threaded HTTP proxy in front of a server that adds latency per request and, on
  the requests a :class:`Fault` picks, answers 5xx, resets the connection, or lies about a range (a short
  body, a wrong ``Content-Range``, a wrong ``Content-Length``, the whole file for a range, other bytes than
  asked); it counts what it forwarded and what it injected. Run in the test's process (its faults change
  while a test runs), or as a script (``proxy``) for the benchmark.

Every server logs :class:`Served` rows; :class:`AccessLog` reads those since a mark, so a test counts the
bytes and requests of one epoch at the server, not at the client. :func:`plan_of` and :func:`read_streams`
are the library's side: an epoch planned and every rank's streams read one after another, with what the
client saw (:class:`EpochRead`) to compare with the server's rows.

Run as a script: ``python servers.py moto PORT LOG`` or ``python servers.py proxy PORT UPSTREAM_PORT
DELAY_MS [LOG]`` (the forms the classes start).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "AccessLog",
    "BUCKET",
    "EpochRead",
    "FAULT_KINDS",
    "Fault",
    "FaultProxy",
    "MAX_TOKENS",
    "MotoS3",
    "Nginx",
    "PREFIX",
    "SCHEDULES",
    "Served",
    "dataset_bytes",
    "every_key_once",
    "free_port",
    "moto_available",
    "nginx_binary",
    "plan_of",
    "read_streams",
    "s3_index_file",
    "span_bytes",
    "start_script",
    "stop_script",
    "total",
    "wait_for_port",
]

HOST = "127.0.0.1"
#: Where the tests put the shards in S3: ``s3://shards/data/``.
BUCKET, PREFIX = "shards", "data"
#: Credentials moto accepts (any non-empty pair); the tests put them in the environment, where boto3,
#: botocore and s3fs look for them.
MOTO_KEY, MOTO_SECRET, MOTO_REGION = "testing", "testing", "us-east-1"


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_port(
    port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "server"
) -> None:
    """Wait until something accepts connections on ``port``.

    Raises:
        RuntimeError: ``proc`` exited first, or ``timeout`` seconds passed (names the server and port).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{what} on port {port} exited with status {proc.returncode} before it listened"
            )
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {HOST}:{port} within {timeout:.0f} s")


def wait_closed(port: int, timeout: float) -> None:
    """Wait until nothing accepts connections on ``port`` any more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                pass
        except OSError:
            return
        time.sleep(0.05)
    raise RuntimeError(
        f"{HOST}:{port} still accepts connections {timeout:.0f} s after the server was stopped"
    )


# -- what a server served ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Served:
    """One request, as the server (or the proxy) logged it: ``bytes`` of response body sent."""

    method: str
    path: str
    status: int
    bytes: int
    range: str | None = None
    fault: str | None = None  # the proxy's injected fault, if any


def total(
    rows: Iterable[Served], method: str | None = "GET", path_suffix: str | Sequence[str] = ""
) -> dict[str, int]:
    """``{"requests": n, "bytes": b}`` of ``rows`` (only ``method``, only paths ending with one of
    ``path_suffix``)."""
    suffixes = (path_suffix,) if isinstance(path_suffix, str) else tuple(path_suffix)
    n = b = 0
    for row in rows:
        if (method is None or row.method == method) and row.path.endswith(suffixes):
            n += 1
            b += row.bytes
    return {"requests": n, "bytes": b}


class AccessLog:
    """A server's access log: one :class:`Served` row per line (nginx's ``counted`` format, or JSON lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def rows(self) -> list[Served]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            return [row for line in f if (row := _parse_line(line)) is not None]

    def mark(self) -> int:
        """A position: :meth:`since` it gives the rows logged afterwards."""
        return len(self.rows())

    def since(self, mark: int, settle: float = 0.3) -> list[Served]:
        """The rows logged after ``mark``, once the log has stopped growing (:func:`settled_rows`)."""
        return settled_rows(self.rows, settle)[mark:]


def settled_rows(read: Callable[[], list[Served]], settle: float = 0.3) -> list[Served]:
    """``read()`` once it has stopped growing for ``settle`` seconds (at most 10 s): a server logs a request
    when its response is done, a moment after the client has the bytes."""
    rows, last = read(), time.monotonic()
    deadline = last + 10
    while time.monotonic() < deadline:
        time.sleep(settle / 3)
        now = read()
        if len(now) != len(rows):
            rows, last = now, time.monotonic()
        elif time.monotonic() - last >= settle:
            break
    return rows


def _parse_line(line: str) -> Served | None:
    line = line.strip()
    if not line:
        return None
    if line.startswith("{"):
        d = json.loads(line)
        return Served(
            d["method"], d["path"], int(d["status"]), int(d["bytes"]), d.get("range"), d.get("fault")
        )
    # nginx: $request_method "$uri" $status $body_bytes_sent "$http_range"
    method, rest = line.split(" ", 1)
    uri, rest = rest[1:].split('" ', 1)
    status, sent, rng = rest.split(" ", 2)
    rng = rng.strip().strip('"')
    return Served(method, uri, int(status), int(sent), None if rng in ("", "-") else rng)


# -- nginx -------------------------------------------------------------------------------------------------


def nginx_binary() -> str | None:
    """The nginx executable, or None (``apt-get install -y nginx``; ``.ci/run`` installs it)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


_NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format counted '$request_method "$uri" $status $body_bytes_sent "$http_range"';
    access_log {work}/access.log counted;
    client_body_temp_path {work}/tmp_body;
    proxy_temp_path {work}/tmp_proxy;
    fastcgi_temp_path {work}/tmp_fastcgi;
    uwsgi_temp_path {work}/tmp_uwsgi;
    scgi_temp_path {work}/tmp_scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    keepalive_timeout 60s;
    server {{
        listen {host}:{port} reuseport;
        server_name localhost;
        root {root};
        autoindex off;
    }}
}}
"""


class Nginx:
    """nginx serving the files of ``root`` at ``http://127.0.0.1:PORT/``, its config, pid and logs in ``work``.

    One process (``master_process off``: as root it then never switches to another user, who could not
    read a private temporary folder), run in the foreground as a subprocess of the test.
    """

    def __init__(self, root: str, work: str, port: int | None = None) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install -y nginx)")
        self.binary, self.root, self.work = binary, os.path.abspath(root), os.path.abspath(work)
        self.port = port or free_port()
        os.makedirs(self.work, exist_ok=True)
        self.conf = os.path.join(self.work, "nginx.conf")
        with open(self.conf, "w", encoding="utf-8") as f:
            f.write(_NGINX_CONF.format(work=self.work, host=HOST, port=self.port, root=self.root))
        self.log = AccessLog(os.path.join(self.work, "access.log"))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 20) -> Nginx:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            [self.binary, "-p", self.work, "-c", self.conf, "-e", os.path.join(self.work, "error.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.work, "stderr.log"), "ab"),  # noqa: SIM115 - the child holds it
        )
        try:
            wait_for_port(self.port, timeout, self.proc, "nginx")
        except RuntimeError as err:
            raise RuntimeError(f"{err}; its error log: {self.error_log()[-2000:]}") from None
        if not self.starts:
            atexit.register(self.stop)  # a script that dies before its cleanup leaves no server behind
        self.starts += 1
        return self

    def stop(self) -> None:
        """Take the server away: SIGTERM (fast shutdown: open connections are closed), then wait."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        wait_closed(self.port, 10)

    def restart_after(self, delay: float) -> threading.Thread:
        """Start the server again ``delay`` seconds from now, in a thread (joined by the caller)."""

        def later() -> None:
            time.sleep(delay)
            self.start()

        t = threading.Thread(target=later, name="nginx-restart", daemon=True)
        t.start()
        return t

    def error_log(self) -> str:
        path = os.path.join(self.work, "error.log")
        return open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else ""

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- moto's S3 server --------------------------------------------------------------------------------------


def moto_available() -> bool:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


class MotoS3:
    """moto's S3 server on ``http://127.0.0.1:PORT`` in a subprocess, logging every request to ``log_path``.

    Clients reach it with the endpoint :attr:`url` and any key pair (:data:`MOTO_KEY`): put
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION`` in the
    environment (:meth:`environ`).
    """

    def __init__(self, work: str, port: int | None = None) -> None:
        self.work = os.path.abspath(work)
        os.makedirs(self.work, exist_ok=True)
        self.port = port or free_port()
        self.log = AccessLog(os.path.join(self.work, "s3-access.jsonl"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def environ(self) -> dict[str, str]:
        """The environment a client of this endpoint needs (boto3, botocore, s3fs read it)."""
        return {
            "AWS_ACCESS_KEY_ID": MOTO_KEY,
            "AWS_SECRET_ACCESS_KEY": MOTO_SECRET,
            "AWS_DEFAULT_REGION": MOTO_REGION,
            "AWS_REGION": MOTO_REGION,
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ENDPOINT_URL_S3": self.url,
        }

    def start(self, timeout: float = 60) -> MotoS3:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "moto", str(self.port), self.log.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.work, "moto-stderr.log"), "ab"),  # noqa: SIM115
        )
        wait_for_port(self.port, timeout, self.proc, "moto's S3 server")
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def client(self):
        """A boto3 S3 client of this endpoint."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=MOTO_KEY,
            aws_secret_access_key=MOTO_SECRET,
            region_name=MOTO_REGION,
        )

    def upload_folder(self, bucket: str, folder: str, prefix: str = "") -> list[str]:
        """Make ``bucket`` (if new) and put every file of ``folder`` under ``prefix``; the keys written."""
        s3 = self.client()
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=bucket)
        keys = []
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                key = f"{prefix.rstrip('/')}/{name}" if prefix else name
                s3.upload_file(path, bucket, key)
                keys.append(key)
        return keys

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _serve_moto(port: int, log_path: str) -> None:
    """The script's ``moto`` command: moto's S3 app behind a WSGI layer that logs body bytes per request."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the server's life

    def counted(environ, start_response):
        status: list[int] = [0]

        def start(st, headers, exc_info=None):
            status[0] = int(st.split(" ", 1)[0])
            return start_response(st, headers, exc_info)

        body = app(environ, start)
        sent = 0
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()
            row = {
                "method": environ.get("REQUEST_METHOD", ""),
                "path": environ.get("PATH_INFO", ""),
                "status": status[0],
                "bytes": sent,
                "range": environ.get("HTTP_RANGE"),
            }
            with lock:
                log.write(json.dumps(row) + "\n")
                log.flush()

    server = make_server(HOST, port, counted, threaded=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    server.serve_forever()


# -- the fault-injecting proxy -----------------------------------------------------------------------------

#: What a :class:`Fault` does to the requests it picks.
FAULT_KINDS = (
    "status",  # answer ``status`` (5xx) with a short text body, nothing forwarded
    "delay",  # wait ``delay_s`` more before answering
    "reset",  # reset the connection (TCP RST) before any response
    "reset_mid_body",  # send the headers and half the body, then reset
    "short_body",  # a range answered with fewer bytes; Content-Length honest, Content-Range claims them all
    "wrong_content_range",  # the asked bytes, but a Content-Range naming other bytes
    "wrong_length",  # a Content-Length larger than the body sent, then the connection closed
    "whole_file",  # a range answered with 200 and the whole file (a server without Range support)
    "other_bytes",  # the right headers over bytes of another part of the file
)


@dataclasses.dataclass
class Fault:
    """Which requests a fault hits and what it does.

    Picks GET requests whose path contains ``match`` (and, with ``ranged``, that carry a Range header):
    lets the first ``skip`` of them pass, then hits the next ``times`` (None: all the rest).
    """

    kind: str
    match: str = ""
    ranged: bool = False
    skip: int = 0
    times: int | None = 1
    status: int = 503
    delay_s: float = 0.0
    seen: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault kind {self.kind!r}: expected one of {FAULT_KINDS}")

    def picks(self, method: str, path: str, has_range: bool) -> bool:
        if method != "GET" or self.match not in path or (self.ranged and not has_range):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.hits >= self.times):
            return False
        self.hits += 1
        return True


class FaultProxy:
    """An HTTP/1.1 proxy on ``http://127.0.0.1:PORT`` in front of ``upstream_port`` (threaded, keep-alive).

    Args:
        upstream_port: the server's port on the loopback address.
        delay_s: latency added to every request before it is forwarded.
        faults: :class:`Fault` s, tried in order (the first that picks a request applies; "delay" faults
            add to the next one).
        log_path: also append every :class:`Served` row to this file as JSON (a proxy run as a script).

    Attributes:
        served: every request answered (thread-safe list).
        counts: ``requests``, ``bytes`` (body bytes sent to clients) and one count per injected fault kind.
    """

    def __init__(
        self,
        upstream_port: int,
        delay_s: float = 0.0,
        faults: Sequence[Fault] = (),
        port: int | None = None,
        log_path: str | None = None,
    ) -> None:
        self.upstream_port = upstream_port
        self.delay_s = float(delay_s)
        self.faults: list[Fault] = list(faults)
        self.port = port or free_port()
        self.served: list[Served] = []
        self.counts: dict[str, int] = {"requests": 0, "bytes": 0}
        self.lock = threading.Lock()
        self.log_path = log_path
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def add(self, *faults: Fault) -> None:
        with self.lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def mark(self) -> int:
        with self.lock:
            return len(self.served)

    def since(self, mark: int, settle: float = 0.3) -> list[Served]:
        """The rows served after ``mark``, once the log has stopped growing: the proxy records a request
        after its response is sent, a moment after the client has the bytes (:func:`settled_rows`)."""

        def read() -> list[Served]:
            with self.lock:
                return list(self.served)

        return settled_rows(read, settle)[mark:]

    def injected(self, kind: str) -> int:
        with self.lock:
            return self.counts.get(kind, 0)

    def start(self) -> FaultProxy:
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        server = _QuietServer((HOST, self.port), handler)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- used by the handler

    def pick(self, method: str, path: str, has_range: bool) -> tuple[list[Fault], Fault | None]:
        """(delay faults that apply, the first other fault that applies)."""
        delays, other = [], None
        with self.lock:
            for f in self.faults:
                if f.kind == "delay":
                    if f.picks(method, path, has_range):
                        delays.append(f)
                elif other is None and f.picks(method, path, has_range):
                    other = f
            for f in [*delays, *([other] if other else [])]:
                self.counts[f.kind] = self.counts.get(f.kind, 0) + 1
        return delays, other

    def record(self, row: Served) -> None:
        with self.lock:
            self.served.append(row)
            self.counts["requests"] += 1
            self.counts["bytes"] += row.bytes
            if self._log is not None:
                self._log.write(json.dumps(dataclasses.asdict(row)) + "\n")
                self._log.flush()


class _QuietServer(http.server.ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a client opening tens of connections at once would see
    # SYNs dropped and retried a second later, which no real object store or CDN does
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up (after a reset the proxy made, or a timeout of its own) is no error here.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"
    # headers and body go out in two writes: with Nagle on, a kept-alive connection's body waits for the
    # client's delayed ACK of the headers (~40 ms on Linux), a stall no real server (nginx: tcp_nodelay) adds
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # counted in FaultProxy.served instead

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def do_GET(self) -> None:
        self._handle(head=False)

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(HOST, self.proxy.upstream_port, timeout=30)
        return conn

    def _forward(self, method: str, headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        for attempt in (0, 1):  # a kept-alive upstream connection may have been closed meanwhile
            conn = self._upstream()
            try:
                conn.request(method, self.path, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                return resp.status, resp.getheaders(), body
            except (ConnectionError, http.client.HTTPException, OSError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _handle(self, head: bool) -> None:
        proxy, method = self.proxy, "HEAD" if head else "GET"
        rng = self.headers.get("Range")
        delays, fault = proxy.pick(method, self.path, rng is not None)
        wait = proxy.delay_s + sum(f.delay_s for f in delays)
        if wait:
            time.sleep(wait)
        kind = fault.kind if fault else ("delay" if delays else None)
        if fault is not None and fault.kind == "status":
            body = f"injected {fault.status}\n".encode()
            self._send(fault.status, [("Content-Type", "text/plain")], body, head)
            proxy.record(Served(method, self.path, fault.status, 0 if head else len(body), rng, "status"))
            return
        if fault is not None and fault.kind == "reset":
            proxy.record(Served(method, self.path, 0, 0, rng, "reset"))
            self._reset()
            return
        headers = {
            k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive", "host")
        }
        if fault is not None and fault.kind == "whole_file":
            headers.pop("Range", None)
        try:
            status, up_headers, body = self._forward(method, headers)
        except OSError as err:
            msg = f"upstream unreachable: {err}\n".encode()
            self._send(502, [("Content-Type", "text/plain")], msg, head)
            proxy.record(Served(method, self.path, 502, len(msg), rng, kind))
            return
        keep = [
            (k, v)
            for k, v in up_headers
            if k.lower()
            not in ("connection", "keep-alive", "content-length", "transfer-encoding", "date", "server")
        ]
        length: int | None = None
        if fault is not None and status == 206:
            keep, body, length = _lie(fault.kind, keep, body)
        if fault is not None and fault.kind == "reset_mid_body" and not head:
            self._send_head(status, keep, len(body))
            half = body[: len(body) // 2]
            with contextlib.suppress(OSError):
                self.wfile.write(half)
            proxy.record(Served(method, self.path, status, len(half), rng, kind))
            self._reset()
            return
        sent = self._send(status, keep, body, head, length)
        proxy.record(Served(method, self.path, status, sent, rng, kind))
        if length is not None and length != len(body):
            self.close_connection = True

    def _send_head(self, status: int, headers: list[tuple[str, str]], length: int) -> None:
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, status: int, headers, body: bytes, head: bool, length: int | None = None) -> int:
        try:
            self._send_head(status, headers, len(body) if length is None else length)
            if head:
                return 0
            self.wfile.write(body)
            return len(body)
        except OSError:  # the client went away
            self.close_connection = True
            return 0

    def _reset(self) -> None:
        """Close the client's connection with a TCP RST (SO_LINGER 0), as a crashed server's kernel does."""
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        self.close_connection = True


def _content_range(headers: list[tuple[str, str]]) -> tuple[int, int, str] | None:
    for k, v in headers:
        if k.lower() == "content-range" and v.startswith("bytes ") and "-" in v:
            span, size = v[6:].split("/", 1)
            a, b = span.split("-", 1)
            return int(a), int(b), size
    return None


def _lie(
    kind: str, headers: list[tuple[str, str]], body: bytes
) -> tuple[list[tuple[str, str]], bytes, int | None]:
    """A 206 response made to lie in the way ``kind`` names: (headers, body, Content-Length to claim)."""
    cr = _content_range(headers)
    others = [(k, v) for k, v in headers if k.lower() != "content-range"]
    if kind == "short_body":
        cut = max(1, len(body) // 3)
        return headers, body[:-cut], None
    if kind == "wrong_content_range" and cr is not None:
        a, b, size = cr
        shift = 512 if a >= 512 else -512 if b + 512 < 0 else 512
        return [*others, ("Content-Range", f"bytes {a + shift}-{b + shift}/{size}")], body, None
    if kind == "wrong_length":
        return headers, body, len(body) + 100
    if kind == "other_bytes":
        # The same length and headers, over bytes starting 512 further on (the next tar block): what a
        # cache or a proxy mixing up two objects would send.
        shifted = body[512:] + body[:512] if len(body) > 512 else bytes(reversed(body))
        return headers, shifted, None
    return headers, body, None


# -- the library's side: reading an epoch through a server ------------------------------------------

MAX_TOKENS = 512

#: The epochs of every schedule (name -> PlanSettings fields); lockstep's packed tail is part of its epoch.
SCHEDULES = {
    "independent": {"schedule": "independent"},
    "lockstep": {"schedule": "lockstep", "lockstep_tail": "packed"},
    "lockstep-bucketed-tail": {"schedule": "lockstep", "lockstep_tail": "bucketed"},
    "packed": {"schedule": "packed"},
}


@dataclasses.dataclass
class EpochRead:
    """What the client saw of one epoch: every key yielded (in order), the batches, the fetch counts
    summed over the streams (``bytes``, ``requests``, ``retries``, ``cache_hits``), and the plan."""

    keys: list[str]
    batches: int
    fetched: dict[str, int]
    plan: Any

    def counts(self) -> collections.Counter:
        return collections.Counter(self.keys)


def plan_of(index, schedule: str, world: int, workers: int, seed: int = 3, epoch: int = 0):
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings

    batcher = DualConstraintBatcher(MAX_TOKENS)
    plan = plan_epoch(index, world, workers, batcher, seed, epoch, PlanSettings(**SCHEDULES[schedule]))
    return plan, batcher


def read_streams(
    index, plan, batcher, remote, streams=None, stop_after: int | None = None, on_batch=None
) -> EpochRead:
    """Read ``streams`` (default: all, in order) of ``plan`` with ``stream_batches``; ``on_batch(n)`` is
    called after the n-th batch (1-based) of the whole read; ``stop_after``: stop after that many batches."""
    from lightning_adaptiveload.loading.stream import stream_batches

    keys: list[str] = []
    fetched = collections.Counter()
    n = 0
    for stream in streams if streams is not None else sorted(plan.streams):
        it = stream_batches(plan, stream, index, batcher, remote=remote)
        try:
            for batch in it:
                keys.extend(batch["keys"])
                fetched.update(batch.get("fetched", {}))
                n += 1
                if on_batch is not None:
                    on_batch(n)
                if stop_after is not None and n >= stop_after:
                    return EpochRead(keys, n, dict(fetched), plan)
        finally:
            it.close()
    return EpochRead(keys, n, dict(fetched), plan)


def every_key_once(read: EpochRead, index) -> None:
    """Every sample of ``index`` exactly once in ``read`` (names the missing and the repeated)."""
    want = [k for s in index.shards for k in s.keys]
    got = read.counts()
    missing = sorted(set(want) - set(got))
    repeated = sorted(k for k, n in got.items() if n > 1)
    extra = sorted(set(got) - set(want))
    assert not missing and not repeated and not extra, (
        f"missing {missing[:5]} ({len(missing)}), repeated {repeated[:5]} ({len(repeated)}), unknown {extra[:5]}"
    )


def span_bytes(index) -> int:
    """The bytes of every sample's span (what an epoch that fetches each sample once fetches)."""
    return sum(length for s in index.shards for _, length in s.spans)


def dataset_bytes(folder: str) -> int:
    """The bytes of the shard files of ``folder`` (what "the dataset's bytes" means in the checks)."""
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".tar"))


def s3_index_file(remote_data: str, folder: str) -> str:
    """An ``index.json`` whose shard paths are the absolute ``s3://shards/data/...`` URLs of the shards."""
    with open(os.path.join(remote_data, "index.json"), encoding="utf-8") as f:
        data = json.load(f)
    for entry in data["shards"]:
        entry["path"] = f"s3://{BUCKET}/{PREFIX}/{os.path.basename(entry['path'])}"
    path = os.path.join(folder, "index.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


# -- the script ----------------------------------------------------------------------------------------------


def _serve_proxy(port: int, upstream_port: int, delay_ms: float, log_path: str | None) -> None:
    proxy = FaultProxy(upstream_port, delay_s=delay_ms / 1000.0, port=port, log_path=log_path)
    proxy.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    proxy.stop()


def _serve_relay(port: int, upstream_port: int, delay_ms: float) -> None:
    """A TCP relay on ``port`` to ``upstream_port`` that holds every byte the client sends for
    ``delay_ms`` before passing it on; the answers pass at once.

    Why, beside the HTTP proxy: it adds the same latency to each request (a request's bytes reach the
    server ``delay_ms`` late, so its answer starts that much later), without parsing HTTP, so that the
    relay spends next to no CPU per request. On a machine of 2 cores, which the client, nginx and the
    latency share, the HTTP proxy's own cost per request (~0.5 ms of Python) lands on the client's
    cores and weighs on a reader that makes many small requests; a real object store costs the client
    nothing of the kind.
    """
    import asyncio

    delay = delay_ms / 1000.0

    async def pump_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                await queue.put((loop.time() + delay, data))
        except (ConnectionError, OSError):
            pass
        await queue.put((0.0, None))
        with contextlib.suppress(ConnectionError, OSError):
            await task

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 18):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(HOST, upstream_port)
        except OSError:
            client_w.close()
            return
        for w in (client_w, up_w):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump_late(client_r, up_w), pump(up_r, client_w))

    async def main() -> None:
        server = await asyncio.start_server(handle, HOST, port, backlog=1024)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())


def start_script(
    args: Sequence[str], port: int, work: str, what: str, timeout: float = 60
) -> subprocess.Popen:
    """Run this file as a script with ``args`` (the benchmark's proxy), wait until ``port`` listens."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, f"{what}-stderr.log"), "ab"),  # noqa: SIM115
    )
    wait_for_port(port, timeout, proc, what)
    return proc


def stop_script(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


_COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "moto": lambda a: _serve_moto(int(a[0]), a[1]),
    "proxy": lambda a: _serve_proxy(int(a[0]), int(a[1]), float(a[2]), a[3] if len(a) > 3 else None),
    "relay": lambda a: _serve_relay(int(a[0]), int(a[1]), float(a[2])),
}

if __name__ == "__main__":
    _COMMANDS[sys.argv[1]](sys.argv[2:])

"""A lean HTTP/1.1 client connection for ranged GETs: what :class:`~.objstore.HttpStore` uses of
``http.client``, at a third of its CPU per request.

Why: a ranged read of small samples makes a request per sample or two, in threads that share one
interpreter lock with the loader. ``http.client`` parses every answer's headers with the ``email``
package (~0.3 ms of Python per request, measured on the benchmark machine); :class:`Connection` reads the
status line and headers itself, with bounds, and the body into one buffer.

It offers the slice of ``http.client``'s interface the store uses, with its exceptions, so that the
store's checks (status, ``Content-Range``, ``Content-Length``, redirects, a body cut short) stay as they
are: :meth:`Connection.request`, :meth:`Connection.getresponse`, :meth:`Connection.close`, and a
:class:`Response` with ``status``, ``reason``, ``getheader``, ``read`` and ``isclosed``. Bodies framed by
``Content-Length``, chunked, or by the connection's end are read; ``https`` runs over :mod:`ssl` with the
default context (certificates and host names verified).
"""

from __future__ import annotations

import http.client
import socket
import ssl

__all__ = ["MAX_HEAD_BYTES", "Connection", "Response", "host_header", "parse_head", "request_head"]

#: Bytes of a status line and headers at most, and headers at most (http.client's limits).
MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 100
_RECV = 1 << 16


def parse_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    """An answer's status line and headers (``head``: the bytes before the blank line), as
    ``(status, reason, headers)`` with lower-cased names (repeated headers joined by ``", "``).

    Raises:
        http.client.BadStatusLine, http.client.HTTPException: a malformed status line or header line,
            or more than :data:`MAX_HEADERS` headers.
    """
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise http.client.BadStatusLine(lines[0][:200])
    if len(lines) - 1 > MAX_HEADERS:
        raise http.client.HTTPException(f"got more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise http.client.HTTPException(f"malformed header line {line[:200]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(code), reason.strip(), headers


def host_header(scheme: str, host: str, port: int) -> str:
    """The ``Host`` header of ``scheme://host:port`` (the port left out where it is the scheme's own)."""
    name = f"[{host}]" if ":" in host else host
    default = (scheme == "https" and port == 443) or (scheme == "http" and port == 80)
    return name if default else f"{name}:{port}"


def request_head(method: str, target: str, host: str, headers: dict[str, str]) -> bytes:
    """The bytes of a request without a body: its line, ``Host: host``, ``Accept-Encoding: identity``
    (bodies as stored, never re-encoded), then ``headers``."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection:
    """One kept-alive connection to ``scheme://netloc`` (``http`` or ``https``), opened when first used."""

    def __init__(self, scheme: str, host: str, port: int | None, timeout: float) -> None:
        self.scheme, self.host, self.timeout = scheme, host, timeout
        self.port = port if port is not None else (443 if scheme == "https" else 80)
        self.host_header = host_header(scheme, host, self.port)
        self.sock: socket.socket | None = None
        self.buf = bytearray()  # bytes received and not yet taken
        self.response: Response | None = None

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        return sock

    def request(self, method: str, target: str, headers: dict[str, str]) -> None:
        """Send a request without a body (a new socket if none is open)."""
        if self.response is not None and not self.response.isclosed():
            self.close()  # the last body was not read to its end: the connection cannot be reused
        if self.sock is None:
            self.sock = self._open()
            self.buf = bytearray()
        self.sock.sendall(request_head(method, target, self.host_header, headers))

    def _fill(self) -> int:
        """Receive more bytes into the buffer; 0 at the connection's end."""
        assert self.sock is not None
        data = self.sock.recv(_RECV)
        self.buf += data
        return len(data)

    def getresponse(self) -> Response:
        """The answer's status and headers (1xx answers skipped); the body is read by the response."""
        while True:
            status, reason, headers = self._read_head()
            if status >= 200:
                break
        self.response = Response(self, status, reason, headers)
        return self.response

    def _read_head(self) -> tuple[int, str, dict[str, str]]:
        start = 0
        while (end := self.buf.find(b"\r\n\r\n", start)) < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                raise http.client.LineTooLong(f"headers of more than {MAX_HEAD_BYTES} bytes")
            start = max(0, len(self.buf) - 3)
            if not self._fill():
                if self.buf:
                    raise http.client.IncompleteRead(bytes(self.buf))
                raise http.client.RemoteDisconnected("Remote end closed connection without response")
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        return parse_head(head)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
        self.buf = bytearray()
        if self.response is not None:
            self.response.closed = True
            self.response = None


class Response:
    """An answer's status, headers and body, read from its :class:`Connection` on demand."""

    def __init__(self, conn: Connection, status: int, reason: str, headers: dict[str, str]) -> None:
        self.conn, self.status, self.reason, self.headers = conn, status, reason, headers
        self.closed = False
        coding = headers.get("transfer-encoding", "").lower()
        self.chunked = coding.endswith("chunked")
        self.chunk_left = 0  # bytes left of the current chunk (chunked bodies)
        length = headers.get("content-length")
        self.left: int | None = None  # body bytes left; None: until the connection ends
        if not self.chunked and length is not None:
            if not length.isdigit():
                raise http.client.HTTPException(f"invalid Content-Length {length[:50]!r}")
            self.left = int(length)
        self.keep = headers.get("connection", "").lower() != "close"
        if status in (204, 304):
            self.left = 0
        if self.left == 0 and not self.chunked:
            self._done()

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    def isclosed(self) -> bool:
        return self.closed

    def _done(self) -> None:
        self.closed = True
        if not self.keep or self.left is None:
            self.conn.close()
        else:
            self.conn.response = None

    def read(self, amt: int | None = None) -> bytes:
        """Up to ``amt`` bytes of the body (all of it when None); ``IncompleteRead`` where the connection
        ends before the ``Content-Length`` it promised."""
        if self.closed:
            return b""
        if self.chunked:
            return self._read_chunked(amt)
        want = self.left if amt is None else (amt if self.left is None else min(amt, self.left))
        conn = self.conn
        if want is None:  # to the connection's end
            out = bytearray()
            while conn.buf or conn._fill():
                out += conn.buf
                conn.buf = bytearray()
        else:  # into one buffer: what was received already, then straight from the socket
            out = bytearray(want)
            got = min(len(conn.buf), want)
            out[:got] = conn.buf[:got]
            del conn.buf[:got]
            view = memoryview(out)
            while got < want:
                assert conn.sock is not None
                n = conn.sock.recv_into(view[got:])
                if not n:
                    break
                got += n
            view.release()
            del out[got:]
        if self.left is not None:
            self.left -= len(out)
            if self.left > 0 and (want is None or len(out) < want):
                partial = bytes(out)
                self.closed = True
                conn.close()
                raise http.client.IncompleteRead(partial, self.left)
            if self.left == 0:
                self._done()
        elif want is None or len(out) < want:
            self._done()  # the connection ended: so did the body
        return bytes(out)

    def _read_chunked(self, amt: int | None) -> bytes:
        conn = self.conn
        out = bytearray()
        while amt is None or len(out) < amt:
            if self.chunk_left == 0:
                while (end := conn.buf.find(b"\r\n")) < 0:
                    if len(conn.buf) > MAX_HEAD_BYTES or not conn._fill():
                        self.closed = True
                        conn.close()
                        raise http.client.IncompleteRead(bytes(out))
                size = bytes(conn.buf[:end]).split(b";", 1)[0].strip()
                del conn.buf[: end + 2]
                try:
                    self.chunk_left = int(size, 16)
                except ValueError:
                    conn.close()
                    raise http.client.IncompleteRead(bytes(out)) from None
                if self.chunk_left == 0:  # the last chunk; skip the trailers
                    while (end := conn.buf.find(b"\r\n")) != 0:
                        if end > 0:
                            del conn.buf[: end + 2]
                        elif len(conn.buf) > MAX_HEAD_BYTES or not conn._fill():
                            break
                    else:
                        del conn.buf[:2]
                    self.left = 0
                    self._done()
                    return bytes(out)
            if not conn.buf and not conn._fill():
                self.closed = True
                conn.close()
                raise http.client.IncompleteRead(bytes(out))
            take = min(len(conn.buf), self.chunk_left, len(conn.buf) if amt is None else amt - len(out))
            out += conn.buf[:take]
            del conn.buf[:take]
            self.chunk_left -= take
            if self.chunk_left == 0:
                while len(conn.buf) < 2:
                    if not conn._fill():
                        break
                del conn.buf[:2]  # the chunk's CRLF
        return bytes(out)

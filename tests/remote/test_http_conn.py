"""The lean HTTP/1.1 connection (``shards/http_conn.py``) against scripted answers on the loopback address:
each framing of a body, keep-alive, and the ``http.client`` exceptions the store relies on."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Sequence

import pytest

from lightning_adaptiveload.shards.http_conn import MAX_HEAD_BYTES, Connection


class Scripted:
    """A TCP server answering the requests it reads (each to its blank line) with ``answers`` in turn; a
    None after an answer closes the connection once that answer is sent. Counts the connections."""

    def __init__(self, answers: Sequence[bytes | None]) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                buf = b""
                while self.answers:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            break
                        buf += data
                    if b"\r\n\r\n" not in buf:
                        break
                    req, _, buf = buf.partition(b"\r\n\r\n")
                    self.requests.append(req)
                    conn.sendall(self.answers.pop(0))
                    if self.answers and self.answers[0] is None:
                        self.answers.pop(0)
                        break

    def close(self) -> None:
        self.sock.close()


def _ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture
def scripted():
    servers: list[Scripted] = []

    def make(answers):
        servers.append(Scripted(answers))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _get(conn: Connection, amt: int | None = None):
    conn.request("GET", "/x", {"Range": "bytes=0-9"})
    resp = conn.getresponse()
    return resp, resp.read(amt)


def test_content_length_bodies_keep_the_connection_and_send_the_headers(scripted):
    srv = scripted([_ok(b"a" * 10), _ok(b"b" * 70000, "X-Dup: 1\r\nX-Dup: 2\r\n")])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    resp, body = _get(conn, 11)
    assert (resp.status, resp.reason, body, resp.isclosed()) == (206, "Partial Content", b"a" * 10, True)
    resp, body = _get(conn, 1 << 20)
    assert body == b"b" * 70000 and resp.getheader("x-dup") == "1, 2"
    assert srv.connections == 1  # kept alive
    assert srv.requests[0].startswith(b"GET /x HTTP/1.1\r\n")
    assert (
        f"Host: 127.0.0.1:{srv.port}".encode() in srv.requests[0] and b"Range: bytes=0-9" in srv.requests[0]
    )


def test_chunked_bodies_with_extensions_and_trailers(scripted):
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nabcd\r\n3\r\nefg\r\n0\r\nT: 1\r\n\r\n"
    srv = scripted([chunked, _ok(b"next")])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    resp, body = _get(conn, 100)
    assert body == b"abcdefg" and resp.isclosed()
    assert _get(conn)[1] == b"next"  # the trailers were consumed: the next answer parses
    assert srv.connections == 1


def test_a_body_framed_by_the_connections_end(scripted):
    srv = scripted([b"HTTP/1.0 200 OK\r\n\r\nall of it", None])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    resp, body = _get(conn)
    assert body == b"all of it" and resp.isclosed() and conn.sock is None


def test_a_body_cut_short_is_incomplete_read_with_the_partial_bytes(scripted):
    srv = scripted([b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n\r\n" + b"z" * 30, None])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    conn.request("GET", "/x", {})
    resp = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read(101)
    assert err.value.partial == b"z" * 30 and conn.sock is None


def test_an_idle_connection_the_server_closed_is_remote_disconnected(scripted):
    srv = scripted([_ok(b"1"), None, _ok(b"2")])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    assert _get(conn)[1] == b"1"
    with pytest.raises(ConnectionError):  # RemoteDisconnected, or a reset or broken pipe on sending
        _get(conn)
    conn.close()
    assert _get(conn)[1] == b"2"  # a fresh connection after close()


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 20x OK\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 206 OK\r\nContent-Length: -5\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 206 OK\r\nno colon here\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 206 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", http.client.HTTPException),
        (b"HTTP/1.1 206 OK\r\nX: " + b"y" * (MAX_HEAD_BYTES + 10), http.client.LineTooLong),
    ],
    ids=["not-http", "bad-code", "negative-length", "bad-header", "too-many-headers", "endless-headers"],
)
def test_malformed_answers_raise_http_client_errors(scripted, answer, error):
    srv = scripted([answer, None])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    conn.request("GET", "/x", {})
    with pytest.raises(error):
        conn.getresponse()


def test_informational_answers_are_skipped(scripted):
    srv = scripted([b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"body")])
    conn = Connection("http", "127.0.0.1", srv.port, 5)
    resp, body = _get(conn)
    assert resp.status == 206 and body == b"body"


def test_a_silent_server_times_out(scripted):
    srv = scripted([b"", b""])  # an empty answer sends nothing: the request is read, never answered
    conn = Connection("http", "127.0.0.1", srv.port, 0.3)
    conn.request("GET", "/x", {})
    with pytest.raises(TimeoutError):
        conn.getresponse()

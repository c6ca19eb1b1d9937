"""The loader thread's own ranged GETs (:mod:`~lightning_adaptiveload.shards.http_pump`), against a scripted
server that answers each request with bytes the test chose.

Each answer is judged as :class:`~lightning_adaptiveload.shards.objstore.HttpStore` judges it: the plain
``206`` is read (framed by ``Content-Length`` or by the connection's end, after a ``100 Continue``), a
body longer than the range or cut short is refused or retried, a redirect or a chunked body is left to
the store; a read through the whole reader fetches the same bytes with the same counts either way.
"""

from __future__ import annotations

import socket
import threading

import pytest

from lightning_adaptiveload.shards import http_pump
from lightning_adaptiveload.shards.http_pump import Pump
from lightning_adaptiveload.shards.objstore import CutShort, RangeLie, Transient

pytestmark = pytest.mark.timeout(60)

BODY = bytes(range(256)) * 40  # the "file": 10,240 bytes


class Scripted:
    """A loopback server: each connection reads one request and sends ``answer(start, end)``, then closes
    unless ``keep``. Records the Range header of every request."""

    def __init__(self, answer, keep: bool = False) -> None:
        self.answer, self.keep = answer, keep
        self.ranges: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/f.tar"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                rng = [ln for ln in head.decode().split("\r\n") if ln.lower().startswith("range:")][0]
                self.ranges.append(rng.split("=", 1)[1])
                a, b = (int(x) for x in self.ranges[-1].split("-"))
                conn.sendall(self.answer(a, b))
                if not self.keep:
                    return

    def close(self) -> None:
        self.sock.close()


def _head(status: str, *headers: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode()


def _range_206(a: int, b: int, body: bytes | None = None, length: int | None = None, extra=()) -> bytes:
    body = BODY[a : b + 1] if body is None else body
    cl = (
        []
        if length is None and extra == "no-length"
        else [f"Content-Length: {len(body) if length is None else length}"]
    )
    return _head("206 Partial Content", f"Content-Range: bytes {a}-{b}/{len(BODY)}", *cl) + body


@pytest.fixture(autouse=True)
def _forget_urls(monkeypatch):
    """Each test's server is new: forget what earlier tests learnt of URLs."""
    monkeypatch.setattr(http_pump, "_DIRECT", set())
    monkeypatch.setattr(http_pump, "_HANDED", set())
    monkeypatch.setattr(http_pump, "_IDLE", {})


def _ask(server: Scripted, ranges, timeout_s: float = 5.0):
    pump = Pump(4, timeout_s)
    try:
        tickets = [pump.start(server.url, a, n) for a, n in ranges]
        for t in tickets:
            pump.wait(t)
        return tickets
    finally:
        pump.close()


def test_plain_ranges_arrive_with_their_bytes_over_kept_connections():
    server = Scripted(lambda a, b: _range_206(a, b), keep=True)
    try:
        ranges = [(0, 512), (1000, 3000), (9000, 1240), (512, 488)]
        tickets = _ask(server, ranges)
        for (a, n), t in zip(ranges, tickets, strict=True):
            assert t.error is None and not t.handed_over
            assert bytes(t.data) == BODY[a : a + n]
        assert len(server.ranges) == len(ranges)  # each asked once
    finally:
        server.close()


def test_a_body_framed_by_the_connections_end_and_a_100_continue_are_read():
    def answer(a: int, b: int) -> bytes:
        cont = _head("100 Continue")
        return cont + _head("206 Partial Content", f"Content-Range: bytes {a}-{b}/*") + BODY[a : b + 1]

    server = Scripted(answer)
    try:
        (t,) = _ask(server, [(100, 900)])
        assert t.error is None and bytes(t.data) == BODY[100:1000]
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer, error, message",
    [
        # framed by the connection's end, one byte more than asked: a lie
        (
            lambda a, b: _head("206 X", f"Content-Range: bytes {a}-{b}/*") + BODY[a : b + 2],
            RangeLie,
            "longer",
        ),
        # an honest Content-Length shorter than the range (Content-Range claims it all)
        (lambda a, b: _range_206(a, b, body=BODY[a:b]), RangeLie, "Content-Length"),
        (lambda a, b: _range_206(a + 512, b + 512), RangeLie, "Content-Range"),
        (lambda a, b: _head("200 OK", f"Content-Length: {len(BODY)}") + BODY, RangeLie, "ignores Range"),
        # the promised length, then the connection's end: cut short (retried by the store, then a lie)
        (
            lambda a, b: _range_206(a, b, body=BODY[a:b]).replace(
                f"Content-Length: {b - a}".encode(), f"Content-Length: {b - a + 1}".encode()
            ),
            CutShort,
            "ended after",
        ),
        (lambda a, b: _head("503 Busy", "Content-Length: 4") + b"busy", Transient, "HTTP 503"),
        (lambda a, b: _head("404 Not Found", "Content-Length: 0"), FileNotFoundError, "404"),
        (lambda a, b: b"garbage\r\n\r\n", Transient, "BadStatusLine"),
    ],
    ids=[
        "longer-than-asked",
        "short-length",
        "other-range",
        "whole-file",
        "cut-short",
        "503",
        "404",
        "garbage",
    ],
)
def test_bad_answers_end_with_the_stores_error_and_are_asked_once(answer, error, message):
    server = Scripted(answer)
    try:
        (t,) = _ask(server, [(1024, 2048)])
        assert t.data is None and not t.handed_over
        assert type(t.error) is error or isinstance(t.error, error), repr(t.error)
        assert message in str(t.error), str(t.error)
        assert len(server.ranges) == 1  # never asked again here: the store's fetch decides what follows
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        lambda a, b: _head("301 Moved", "Location: /elsewhere.tar", "Content-Length: 0"),
        lambda a, b: (
            _head("206 X", f"Content-Range: bytes {a}-{b}/*", "Transfer-Encoding: chunked") + b"0\r\n\r\n"
        ),
    ],
    ids=["redirect", "chunked"],
)
def test_redirects_and_chunks_are_left_to_the_store_once_per_url(answer):
    server = Scripted(answer)
    try:
        tickets = _ask(server, [(0, 100), (200, 100), (400, 100)])
        assert all(t.handed_over and t.data is None and t.error is None for t in tickets)
        assert len(server.ranges) == 1  # the other ranges waited for the first answer
        assert http_pump.left_to_store(server.url)
    finally:
        server.close()


def test_no_answer_ends_with_a_timeout():
    server = Scripted(lambda a, b: b"")  # reads the request, sends nothing...
    server.keep = True
    server.answer = lambda a, b: (threading.Event().wait(3), b"")[1]
    try:
        (t,) = _ask(server, [(0, 10)], timeout_s=0.3)
        assert isinstance(t.error, Transient) and "no answer" in str(t.error)
    finally:
        server.close()


def test_a_refused_connection_is_transient():
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    pump = Pump(2, 2.0)
    try:
        t = pump.start(f"http://127.0.0.1:{port}/x.tar", 0, 10)
        pump.wait(t)
        assert isinstance(t.error, Transient) and "Refused" in str(t.error), repr(t.error)
    finally:
        pump.close()


@pytest.mark.parametrize("schedule", ["independent", "packed"])
def test_an_epoch_through_nginx_reads_the_same_bytes_either_way_and_the_loader_thread_sends_them(
    nginx, schedule, monkeypatch
):
    from servers import every_key_once, plan_of, read_streams, span_bytes, total

    from lightning_adaptiveload.shards.index import ShardIndex
    from lightning_adaptiveload.shards.objstore import RemoteSettings

    served = []
    real_finish = Pump._body_done

    def counting(self, conn):
        real_finish(self, conn)
        served.append(conn.ticket.data is not None)

    monkeypatch.setattr(Pump, "_body_done", counting)
    monkeypatch.setattr(http_pump, "MAX_PUMP_BYTES", 64 << 20)  # every range here, whatever its size
    index = ShardIndex.load(f"{nginx.url}/data/index.json")
    plan, batcher = plan_of(index, schedule, 8, workers=1)
    got = {}
    for inline in (True, False):
        served.clear()
        mark = nginx.log.mark()
        read = read_streams(index, plan, batcher, RemoteSettings(inline_http=inline))
        rows = total(nginx.log.since(mark), path_suffix=".tar")
        every_key_once(read, index)
        assert rows["bytes"] == read.fetched["bytes"] == span_bytes(index)
        assert rows["requests"] == read.fetched["requests"] and read.fetched["retries"] == 0
        got[inline] = (read.keys, read.fetched["requests"], sum(served))
    assert got[True][:2] == got[False][:2]  # the same samples in the same order, the same requests
    assert got[True][2] == got[True][1] > 0  # every request answered on the loader's thread
    assert got[False][2] == 0

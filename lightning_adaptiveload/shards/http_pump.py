"""Ranged GETs of ``http://`` shards driven by the reading thread itself: non-blocking sockets, one selector.

Why: a loader worker parses samples in Python while its fetch threads wait on the network, and all of
them share one interpreter lock. Each blocking socket call of a fetch thread lets go of the lock and then
has to win it back from the busy parser: on the benchmark machine that costs ~150 us of CPU per request
on top of the ~60 us the request itself costs, and a pack of scattered small samples makes a request per
sample. A :class:`Pump` sends the requests and reads the answers from the thread that parses them (between
batches and while it waits), so no lock changes hands.

Every answer is judged here as :class:`~.objstore.HttpStore` judges it, by the same functions
(:func:`~.http_conn.parse_head`, :func:`~.objstore.judge_range_head`, :func:`~.objstore.cut_short`): a
ticket ends with its body, or with the error the store would have raised (:class:`~.objstore.Transient`,
:class:`~.objstore.RangeLie`, ``OSError``) in :attr:`Ticket.error`, which the caller hands to
:func:`~.objstore.fetch` as its first attempt: a lie is refused at once and never asked again, a transient
failure is retried by the store after its backoff. Only answers the pump does not read (a redirect, a
chunked body) are *handed over* unjudged (:attr:`Ticket.handed_over`): the caller asks the store, which
follows redirects and reads any framing.

Idle connections are kept per process and host, for the next pump (the next stream's reader) to reuse.
"""

from __future__ import annotations

import errno
import http.client
import os
import selectors
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable

from lightning_adaptiveload.shards.http_conn import MAX_HEAD_BYTES, host_header, parse_head, request_head
from lightning_adaptiveload.shards.objstore import RangeLie, Transient, cut_short, judge_range_head

__all__ = ["MAX_PUMP_BYTES", "Pump", "Ticket", "left_to_store", "pumpable"]

#: Ranges longer than this go through the fetch threads: the loader's thread reads a body only between
#: the samples it parses, so a large one would wait in the kernel's buffers (and stall its connection),
#: while the threads read it meanwhile; beside a large body a request's own CPU matters little. Measured
#: on 2 cores (bench_remote, 4,800 samples, 20 ms): up to 64 KiB here was faster than the threads for
#: every schedule, up to 256 KiB slower for independent and lockstep reads (requests of 0.3-2 MB).
MAX_PUMP_BYTES = 64 << 10
_RECV = 1 << 16
_IDLE_PER_HOST = 256
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

_Addr = tuple[str, int]
_IDLE: dict[tuple[int, _Addr], list[socket.socket]] = {}  # (process, (host, port)) -> idle sockets
_IDLE_LOCK = threading.Lock()
_ADDRS: dict[_Addr, tuple[int, tuple]] = {}  # (host, port) -> (family, sockaddr), resolved once
# What this process learnt of URLs from their first answer: read here (206 or any judged answer), or
# left to the store (a redirect, a chunked body). A URL in neither is asked once, and its other ranges
# wait for that answer, so a moved shard costs one redirect, not one per range in flight.
_DIRECT: set[str] = set()
_HANDED: set[str] = set()
_MAX_LEARNT = 1 << 20  # URLs remembered at most (then forgotten and learnt again)


def pumpable(url: str, length: int) -> bool:
    """Whether a range of ``url`` of ``length`` bytes may go through a :class:`Pump` (plain ``http://``,
    at most :data:`MAX_PUMP_BYTES`)."""
    return 0 < length <= MAX_PUMP_BYTES and url[:7].lower() == "http://"


def left_to_store(url: str) -> bool:
    """Whether this process learnt that ``url``'s answers are not read by a :class:`Pump` (it redirects,
    or its answers are chunked): its ranges go to the store directly."""
    return url in _HANDED


def _learn(known: set[str], url: str) -> None:
    if len(known) >= _MAX_LEARNT:
        known.clear()
    known.add(url)


class Ticket:
    """One range asked of a :class:`Pump`. Pending until one of: :attr:`data` (the body, exactly the range),
    :attr:`error` (the answer judged bad, or the connection failed: what ``HttpStore.get`` would have
    raised), or :attr:`handed_over` (an answer the pump does not read: a redirect or a chunked body)."""

    __slots__ = (
        "url",
        "host",
        "target",
        "start",
        "length",
        "ctx",
        "data",
        "error",
        "handed_over",
        "sent",
        "fallback",
        "_tries",
    )

    def __init__(self, url: str, start: int, length: int, ctx: object = None) -> None:
        self.url, self.start, self.length, self.ctx = url, start, length, ctx
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or 80
        except ValueError:
            port = -1  # not a number: refused when connecting
        self.host: _Addr = (parts.hostname or "", port)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.data: bytearray | None = None
        self.error: Exception | None = None
        self.handed_over = False
        self.sent = False  # the request reached the socket (the server may have seen it)
        self.fallback = None  # the caller's other read of the range (a Future), once not arrived here
        self._tries = 0

    @property
    def pending(self) -> bool:
        return self.data is None and self.error is None and not self.handed_over

    def done(self) -> bool:
        """Arrived, or ended otherwise and the caller's other read finished (``Future``-like, for the
        read-ahead's checks)."""
        if self.data is not None:
            return True
        return not self.pending and (self.fallback is None or self.fallback.done())


class _Conn:
    __slots__ = (
        "sock",
        "host",
        "reused",
        "ticket",
        "out",
        "head",
        "body",
        "got",
        "closing",
        "deadline",
        "events",
    )

    def __init__(self, sock: socket.socket, host: _Addr, reused: bool, ticket: Ticket) -> None:
        self.sock, self.host, self.reused, self.ticket = sock, host, reused, ticket
        self.out = b""
        self.head: bytearray | None = bytearray()  # None once the head is parsed: reading the body
        self.body: bytearray | None = None
        self.got = 0
        self.closing = False  # the answer ends the connection (``Connection: close``, or framed by its end)
        self.deadline = 0.0
        self.events = 0  # what the selector waits for on this socket (0: not registered)


class Pump:
    """Up to ``max_connections`` ranged GETs in flight at once, advanced by :meth:`run`.

    Args:
        max_connections: connections open at once (requests beyond wait for one).
        timeout_s: a request with no progress for this long ends with a ``Transient`` timeout.
        on_end: called at once with each ticket that ends without its body (to start its other read early).
    """

    def __init__(
        self, max_connections: int, timeout_s: float, on_end: Callable[[Ticket], None] | None = None
    ) -> None:
        self.max_connections = max(1, int(max_connections))
        self.timeout_s = float(timeout_s)
        self.on_end = on_end
        self._sel = selectors.DefaultSelector()
        self._busy: set[_Conn] = set()
        self._queue: deque[Ticket] = deque()
        self._idle: dict[_Addr, list[socket.socket]] = {}
        self._held: dict[str, list[Ticket]] = {}  # URL -> its ranges waiting for its first answer
        self._pid = os.getpid()
        # another thread's wake-up call (wake()): ends a select() of run() at once
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.requests = 0  # requests sent
        self.served = 0  # tickets answered with their body

    @property
    def busy(self) -> bool:
        """Whether requests are in flight or queued."""
        return bool(self._busy or self._queue)

    # -- asking ---------------------------------------------------------------------------------------------

    def start(self, url: str, start: int, length: int, ctx: object = None) -> Ticket:
        """Ask for ``length`` bytes at ``start`` of ``url`` (sent now if a connection is free); ``ctx`` is
        kept on the ticket for the caller."""
        ticket = Ticket(url, start, length, ctx)
        if url in _HANDED:
            ticket.handed_over = True
            self._ended(ticket)
            return ticket
        if url not in _DIRECT:
            held = self._held.get(url)
            if held is not None:  # its first answer is awaited
                held.append(ticket)
                return ticket
            self._held[url] = []
        self._queue.append(ticket)
        self._dispatch()
        return ticket

    def _dispatch(self) -> None:
        while self._queue and len(self._busy) < self.max_connections:
            self._begin(self._queue.popleft())

    def _begin(self, ticket: Ticket, fresh: bool = False) -> None:
        ticket._tries += 1
        sock = None if fresh else self._take_idle(ticket.host)
        reused = sock is not None
        if sock is None:
            try:
                sock = self._connect(ticket.host)
            except OSError as err:
                self._end(ticket, Transient(f"{type(err).__name__}: {err}"))
                return
        conn = _Conn(sock, ticket.host, reused, ticket)
        conn.out = request_head(
            "GET",
            ticket.target,
            host_header("http", *ticket.host),
            {"Range": f"bytes={ticket.start}-{ticket.start + ticket.length - 1}"},
        )
        conn.deadline = time.monotonic() + self.timeout_s
        self._busy.add(conn)
        if reused:
            self._send(conn)
        else:
            self._sel.register(sock, selectors.EVENT_WRITE, conn)  # connecting
            conn.events = selectors.EVENT_WRITE

    def _connect(self, host: _Addr) -> socket.socket:
        addr = _ADDRS.get(host)
        if addr is None:
            if host[1] < 0 or not host[0]:
                raise OSError(f"no host or no port number in the URL ({host[0]!r})")
            info = socket.getaddrinfo(host[0], host[1], type=socket.SOCK_STREAM)[0]
            addr = _ADDRS[host] = (info[0], info[4])
        sock = socket.socket(addr[0], socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(addr[1])
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(err, os.strerror(err))
        except BaseException:
            sock.close()
            raise
        return sock

    def _take_idle(self, host: _Addr) -> socket.socket | None:
        own = self._idle.get(host)
        if own:
            return own.pop()
        with _IDLE_LOCK:
            shared = _IDLE.get((self._pid, host))
            return shared.pop() if shared else None

    # -- advancing --------------------------------------------------------------------------------------------

    def run(self, timeout: float = 0.0) -> None:
        """Advance the requests in flight: wait at most ``timeout`` seconds for the network (0: only what
        has arrived), then end those without progress for ``timeout_s``."""
        if not self._busy:
            self._dispatch()
            if not self._busy:
                return
        now = time.monotonic()
        wait = max(0.0, min(timeout, min(c.deadline for c in self._busy) - now)) if timeout else 0.0
        for key, mask in self._sel.select(wait):
            conn = key.data
            if conn is None:  # woken by wake()
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
                continue
            if conn not in self._busy:
                continue  # ended by an earlier event of this round
            if mask & selectors.EVENT_WRITE:
                if not conn.ticket.sent:  # connected, or not: ask the socket
                    err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        failed = OSError(err, os.strerror(err))
                        self._drop(conn, Transient(f"{type(failed).__name__}: {failed}"))
                        continue
                self._send(conn)
            elif mask & selectors.EVENT_READ:
                self._recv(conn)
        if timeout or len(self._busy) >= self.max_connections:
            now = time.monotonic()
            for conn in [c for c in self._busy if c.deadline < now]:
                self._drop(conn, Transient(f"TimeoutError: no answer for {self.timeout_s:g} s"))
        self._dispatch()

    def wake(self) -> None:
        """End the current or next :meth:`run`'s wait at once (safe from any thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def wait_for(self, done: Callable[[], bool], timeout: float = 1.0) -> None:
        """Run until ``done()`` (another thread's work: it calls :meth:`wake` when it ends)."""
        while not done():
            if not self._busy and not self._queue:
                return  # nothing of the pump's own to advance: the caller waits its own way
            self.run(timeout=timeout)

    def wait(self, ticket: Ticket) -> None:
        """Run until ``ticket`` is no longer pending."""
        while ticket.pending:
            if not self._busy and not self._queue:  # nothing in flight could end it: never wait forever
                raise RuntimeError(f"a ranged read of {ticket.url} is pending with no request in flight")
            self.run(timeout=1.0)

    def _send(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except BlockingIOError:
            n = 0
        except OSError as err:
            self._drop(conn, Transient(f"{type(err).__name__}: {err}"), unanswered=True)
            return
        if n and not conn.ticket.sent:
            conn.ticket.sent = True
            self.requests += 1
        conn.out = conn.out[n:]
        events = selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ
        if not conn.events:
            self._sel.register(conn.sock, events, conn)
        elif events != conn.events:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _recv(self, conn: _Conn) -> None:
        ticket = conn.ticket
        try:
            if conn.head is not None:
                chunk = conn.sock.recv(_RECV)
                if chunk:
                    conn.head += chunk
                    conn.deadline = time.monotonic() + self.timeout_s
                    self._head(conn)
                    return
            else:
                assert conn.body is not None
                with memoryview(conn.body) as view:
                    n = conn.sock.recv_into(view[conn.got :])
                if n:
                    conn.got += n
                    conn.deadline = time.monotonic() + self.timeout_s
                    if conn.got == len(conn.body):
                        self._body_done(conn)
                    return
        except BlockingIOError:
            return
        except OSError as err:
            if conn.head is None:
                self._drop(conn, Transient(f"{type(err).__name__} while reading the body: {err}"))
            else:
                self._drop(conn, Transient(f"{type(err).__name__}: {err}"), unanswered=not conn.head)
            return
        # the connection's end
        if conn.head is not None:
            if conn.head:
                self._drop(conn, Transient("IncompleteRead: the connection closed inside the answer's head"))
            else:
                self._drop(
                    conn,
                    Transient("RemoteDisconnected: Remote end closed connection without response"),
                    unanswered=True,
                )
        elif conn.closing and len(conn.body) == ticket.length + 1:  # framed by the connection's end
            self._body_done(conn)
        else:
            self._drop(conn, cut_short(ticket.url, ticket.start, ticket.length, conn.got))

    def _head(self, conn: _Conn) -> None:
        buf = conn.head
        ticket = conn.ticket
        assert buf is not None
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._drop(conn, Transient(f"LineTooLong: headers of more than {MAX_HEAD_BYTES} bytes"))
                return
            try:
                status, reason, headers = parse_head(bytes(buf[:end]))
            except http.client.HTTPException as err:
                self._drop(conn, Transient(f"{type(err).__name__}: {err}"))
                return
            del buf[: end + 4]
            if status >= 200:
                break  # 1xx answers are skipped
        if status in _REDIRECTS or headers.get("transfer-encoding", "").lower().endswith("chunked"):
            self._release(conn, keep=False)
            _learn(_HANDED, ticket.url)  # not read here: the store follows redirects and reads chunks
            for waiting in [ticket, *self._held.pop(ticket.url, ())]:
                waiting.handed_over = True
                self._ended(waiting)
            return
        if ticket.url not in _DIRECT:
            _learn(_DIRECT, ticket.url)
            self._queue.extend(self._held.pop(ticket.url, ()))  # sent at the end of this round
        try:
            judge_range_head(
                ticket.url,
                ticket.start,
                ticket.length,
                status,
                reason,
                lambda name: headers.get(name.lower()),
            )
        except (Transient, RangeLie, OSError) as err:
            self._drop(conn, err)
            return
        conn.closing = headers.get("connection", "").lower() == "close"
        want = ticket.length
        if "content-length" not in headers:  # a 206 framed by the connection's end: one byte more shows a lie
            conn.closing, want = True, ticket.length + 1
        rest = min(len(buf), want)
        if len(buf) > want:  # more than the body: nothing may follow an answer on this connection
            conn.closing = True
        conn.body = bytearray(want)
        conn.body[:rest] = buf[:rest]
        conn.got, conn.head = rest, None
        if rest == want:
            self._body_done(conn)

    def _body_done(self, conn: _Conn) -> None:
        ticket, body = conn.ticket, conn.body
        assert body is not None
        if conn.got > ticket.length:
            lie = f"{ticket.url}: asked for {ticket.length} bytes at {ticket.start}, the body is longer"
            self._drop(conn, RangeLie(lie))
            return
        if conn.got < ticket.length:
            self._drop(conn, cut_short(ticket.url, ticket.start, ticket.length, conn.got))
            return
        del body[ticket.length :]  # the spare byte of a body framed by the connection's end
        self._release(conn, keep=not conn.closing)
        ticket.data = body
        self.served += 1

    def _release(self, conn: _Conn, keep: bool) -> None:
        self._busy.discard(conn)
        if conn.events:
            self._sel.unregister(conn.sock)
            conn.events = 0
        if keep:
            self._idle.setdefault(conn.host, []).append(conn.sock)
        else:
            conn.sock.close()

    def _drop(self, conn: _Conn, error: Exception, unanswered: bool = False) -> None:
        """End ``conn`` and its ticket with ``error``; ``unanswered``: the connection failed before any byte
        of an answer arrived."""
        ticket = conn.ticket
        self._release(conn, keep=False)
        # A kept-alive connection the server closed while it was idle: ask again on a fresh one, at once
        # (as the store does).
        if unanswered and conn.reused and ticket._tries < 2:
            if ticket.sent:  # most likely unseen by the server: not counted as a request
                ticket.sent = False
                self.requests -= 1
            self._begin(ticket, fresh=True)
            return
        self._end(ticket, error)

    def _end(self, ticket: Ticket, error: Exception) -> None:
        ticket.error = error
        self._queue.extend(self._held.pop(ticket.url, ()))  # a first ask that failed: the others try
        self._ended(ticket)

    def _ended(self, ticket: Ticket) -> None:
        if self.on_end is not None:
            self.on_end(ticket)

    # -- ending -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close what is in flight (its answers cannot be reused), forget what is queued, and leave the idle
        connections to the next pump of this process."""
        for conn in list(self._busy):
            self._release(conn, keep=False)
        self._queue.clear()
        self._held.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        if os.getpid() == self._pid:
            with _IDLE_LOCK:
                for host, socks in self._idle.items():
                    shared = _IDLE.setdefault((self._pid, host), [])
                    room = max(0, _IDLE_PER_HOST - len(shared))
                    shared.extend(socks[:room])
                    for sock in socks[room:]:
                        sock.close()
        else:
            for socks in self._idle.values():
                for sock in socks:
                    sock.close()
        self._idle.clear()

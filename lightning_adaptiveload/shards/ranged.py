"""Reads guided by the plan: each stream fetches exactly its planned samples' bytes, ahead of time.

A plan tells every ``(rank, worker)`` stream, before the epoch starts, which samples it reads in which
order; the index holds each sample's span in its tar (:mod:`~lightning_adaptiveload.shards.spans`). So
:class:`RangedReader` turns the stream's batches into ranged requests (a batch's samples of one shard,
sorted by offset, neighbours at most ``merge_gap`` bytes apart merged into one request of at most
``max_request_bytes``), runs them on a pool of ``max_concurrency`` threads over the next
``read_ahead_batches`` batches with at most ``max_bytes_in_flight`` bytes fetched and not yet consumed,
and parses each answer with the reader's checks (:func:`~lightning_adaptiveload.shards.reader.iter_range`).
The depth adapts: each time a batch is taken before its bytes arrived it grows fourfold, up to
``max_read_ahead_batches``, so a consumer faster than the network's latency is fed from further ahead
while a slow one (a training step) keeps the configured depth. The threads are shared by the readers
of a process (one pool per size), so their kept-alive connections outlive a stream.

Across all streams of an epoch each planned sample's bytes are fetched once (plus, with
``merge_gap > 0``, the gaps merged over), whatever the schedule: a lockstep or packed stream that
takes a few samples of a shard in each bucket fetches those samples, never the shard.

Exactly once: a request is parsed once, after its bytes arrived whole; a retried request replaces
nothing already yielded. A resumed epoch's plan holds only the samples not yet consumed, so its reader
starts where the consumed batches end.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from lightning_adaptiveload.shards.format import ShardError, ShardInfo
from lightning_adaptiveload.shards.http_pump import Pump, Ticket, left_to_store, pumpable
from lightning_adaptiveload.shards.objstore import RangeStore, RemoteSettings, fetch, store_for
from lightning_adaptiveload.shards.paths import is_url
from lightning_adaptiveload.shards.reader import iter_range
from lightning_adaptiveload.shards.span_cache import SpanCache

__all__ = [
    "RANGED_SCHEMES",
    "FetchCounts",
    "RangedReader",
    "SpanRequest",
    "plan_requests",
    "ranged_shards",
    "use_ranged",
]

Ref = tuple[int, int]

log = logging.getLogger(__name__)

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process, size) -> threads: a fork makes its own
_POOLS_LOCK = threading.Lock()


def _shared_pool(size: int) -> ThreadPoolExecutor:
    """This process's pool of ``size`` fetch threads (created on first use, kept for the next reader:
    each thread keeps its connections alive in the backend, so a new stream starts on warm ones)."""
    key = (os.getpid(), size)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(size, thread_name_prefix=f"ranged-read-{size}")
        return pool


#: URL schemes a ranged read serves (besides local paths, under ``ranged="always"``).
RANGED_SCHEMES = frozenset({"http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def use_ranged(info: ShardInfo, settings: RemoteSettings) -> bool:
    """True when the shard of ``info`` is read by ranges under ``settings``: it has spans, and it is a
    remote URL of :data:`RANGED_SCHEMES` (``"auto"``) or any local file or such URL (``"always"``)."""
    if settings.ranged == "never" or info.spans is None or len(info.spans) != info.num_samples:
        return False
    path = info.path
    if not is_url(path):
        return settings.ranged == "always"
    return path.split(":", 1)[0].lower() in RANGED_SCHEMES


@dataclass
class SpanRequest:
    """One ranged GET: ``length`` bytes at ``start`` of shard ``shard``, holding the planned ``ids``;
    fetched for batch ``batch`` (its first), its samples serving batches up to ``last_batch``."""

    shard: int
    start: int
    length: int
    ids: list[int]
    batch: int = 0
    last_batch: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length


def plan_requests(
    batches: Sequence[Sequence[Ref]],
    shards: Callable[[int], ShardInfo],
    ranged: Callable[[int], bool],
    merge_gap: int,
    max_request_bytes: int,
    window_bytes: int = 0,
) -> list[list[SpanRequest]]:
    """The stream's requests, listed under the first batch each serves.

    The batches are taken in groups of consecutive batches (in read order) holding at most
    ``window_bytes`` of ranged spans (at least one batch each; 0: one batch each); within a group
    the refs of a ranged shard are sorted by offset and neighbours merged into one request, so
    samples of the same shard planned for nearby batches (a stream that reads a shard in order, a few
    samples per batch) cost one request, not one per batch. Every planned ref is in exactly one request.

    Args:
        batches: the stream's batches, lists of ``(shard, sample)`` refs, in read order.
        shards: shard id -> its :class:`ShardInfo` (with spans).
        ranged: shard id -> whether it is read by ranges.
        merge_gap: spans at most this many bytes apart share a request.
        max_request_bytes: a request stops growing at this size.
        window_bytes: the bytes of a group of batches merged together.
    """
    out: list[list[SpanRequest]] = [[] for _ in batches]
    j = 0
    while j < len(batches):
        by_shard: dict[int, dict[int, int]] = {}  # shard -> sample -> its batch
        held = 0
        while j < len(batches):
            refs = [(shard, sid) for shard, sid in batches[j] if ranged(shard)]
            size = sum(shards(shard).spans[sid][1] for shard, sid in refs)  # type: ignore[index]
            if by_shard and held + size > window_bytes:
                break
            held += size
            for shard, sid in refs:
                by_shard.setdefault(shard, {}).setdefault(sid, j)
            j += 1
        group: list[SpanRequest] = []
        for shard, ids in by_shard.items():
            spans = shards(shard).spans
            assert spans is not None
            cur: SpanRequest | None = None
            for sid in sorted(ids, key=lambda i: spans[i][0]):
                start, length = spans[sid]
                b = ids[sid]
                if (
                    cur is not None
                    and start - cur.end <= merge_gap
                    and start >= cur.end
                    and start + length - cur.start <= max_request_bytes
                ):
                    cur.length = start + length - cur.start
                    cur.ids.append(sid)
                    cur.batch, cur.last_batch = min(cur.batch, b), max(cur.last_batch, b)
                else:
                    cur = SpanRequest(shard, start, length, [sid], b, b)
                    group.append(cur)
        for req in sorted(group, key=lambda r: (r.batch, r.shard, r.start)):
            out[req.batch].append(req)
    return out


@dataclass
class FetchCounts:
    """What a stream fetched: bytes, requests (answers received), retries, cache hits; ``since_last``
    gives the part new since its previous call (one batch's worth)."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    cache_hits: int = 0
    _seen: dict[str, int] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {
            "bytes": self.bytes,
            "requests": self.requests,
            "retries": self.retries,
            "cache_hits": self.cache_hits,
        }

    def since_last(self) -> dict[str, int]:
        now = self.as_dict()
        delta = {k: v - self._seen.get(k, 0) for k, v in now.items()}
        self._seen = now
        return delta


class RangedReader:
    """The ranged reads of one stream: fetched ahead on a thread pool, parsed when their batch is taken.

    Args:
        index_shards: the index's shards (``index.shards``: a sequence of :class:`ShardInfo`).
        batches: the stream's batches (lists of refs), in order.
        settings: concurrency, bytes in flight, read-ahead, merging, retries, cache.
        ranged: shard id -> whether it is read by ranges (its other refs are left to the caller).
        on_error, stats, patch_size, max_member_bytes: as for ``iter_shard``.
        store: the backend (None: :func:`~.objstore.store_for` of each shard's URL).
    """

    def __init__(
        self,
        index_shards: Sequence[ShardInfo],
        batches: Sequence[Sequence[Ref]],
        settings: RemoteSettings,
        ranged: Callable[[int], bool],
        *,
        on_error: str = "raise",
        stats: MutableMapping[str, int] | None = None,
        patch_size: Sequence[int] | None = (1, 2, 2),
        max_member_bytes: int | None = None,
        store: RangeStore | None = None,
        cache: SpanCache | None = None,
    ) -> None:
        self.settings = settings
        self.on_error, self.patch_size, self.max_member_bytes = on_error, patch_size, max_member_bytes
        self.stats: MutableMapping[str, int] = stats if stats is not None else {}
        self._infos: dict[int, ShardInfo] = {}
        self._key_pos: dict[int, dict[str, int]] = {}
        self._index_shards = index_shards
        self.requests = plan_requests(
            batches,
            self.info,
            ranged,
            settings.merge_gap,
            settings.max_request_bytes,
            window_bytes=settings.merge_window_bytes,
        )
        # the ranged refs of each batch; samples parsed for a later batch wait in _held until it is taken
        self._batch_refs = [[(int(sh), int(i)) for sh, i in refs if ranged(sh)] for refs in batches]
        self._held: dict[Ref, dict[str, Any]] = {}
        self._release: dict[int, int] = {}  # batch -> bytes in flight freed once it is taken
        for reqs in self.requests:
            for req in reqs:
                self._release[req.last_batch] = self._release.get(req.last_batch, 0) + req.length
        self._store = store
        self._cache = cache
        if cache is None and settings.cache_bytes > 0:
            self._cache = SpanCache(settings.cache_bytes, settings.cache_dir)
        self.counts = FetchCounts()
        self._lock = threading.Lock()
        # (batch, request) -> its bytes: a fetch thread's Future, or a Ticket of the pump (inline_http)
        self._futures: dict[tuple[int, int], Future | Ticket] = {}
        self._pump: Pump | None = None
        self._inline = settings.inline_http and store is None and self._cache is None
        self._queue: deque[tuple[int, int]] = deque(
            (j, k) for j, reqs in enumerate(self.requests) for k in range(len(reqs))
        )
        self._in_flight = 0  # bytes submitted and not yet taken
        self._taken = -1  # the last batch taken
        self.depth = settings.read_ahead_batches  # batches read ahead now (grows while the loader waits)
        self.waits = 0  # batches taken before all their bytes had arrived

    def info(self, shard: int) -> ShardInfo:
        got = self._infos.get(shard)
        if got is None:  # a compact index builds a ShardInfo per access: build it once
            got = self._infos[shard] = self._index_shards[shard]
        return got

    # -- fetching (pool threads) -----------------------------------------------------------------------

    def _fetch(self, req: SpanRequest, prior: Exception | None = None) -> bytes:
        info = self.info(req.shard)
        url = info.path
        store = self._store if self._store is not None else store_for(url, self.settings.timeout_s)
        cache, identity = self._cache, ""
        if cache is not None:
            identity = f"{info.num_bytes}:{store.identity(url)}"
            data = cache.get(url, identity, req.start, req.length)
            if data is not None:
                with self._lock:
                    self.counts.cache_hits += 1
                return data

        def what() -> tuple[str | None, str | None]:
            keys = [info.keys[i] for i in req.ids]
            key = keys[0] if len(keys) == 1 else f"{keys[0]} (and {len(keys) - 1} more samples: {keys[1:4]})"
            return key, f"bytes {req.start}-{req.end - 1}"

        data, attempts = fetch(store, url, req.start, req.length, self.settings, what=what, prior=prior)
        with self._lock:
            self.counts.bytes += len(data)
            self.counts.requests += 1
            self.counts.retries += attempts - 1
        if cache is not None:
            cache.put(url, identity, req.start, req.length, data)
        return data

    def _top_up(self, through: int) -> None:
        """Submit queued requests: all of batches ``<= through``, then read-ahead within the byte bound."""
        pool = _shared_pool(self.settings.max_concurrency)
        horizon = self._taken + 1 + self.depth
        while self._queue:
            j, k = self._queue[0]
            req = self.requests[j][k]
            must = j <= through
            fits = self._in_flight == 0 or self._in_flight + req.length <= self.settings.max_bytes_in_flight
            if not must and (j > horizon or not fits):
                break
            self._queue.popleft()
            self._in_flight += req.length
            self._futures[(j, k)] = self._submit(req, pool)

    def _submit(self, req: SpanRequest, pool: ThreadPoolExecutor) -> Future | Ticket:
        if self._inline:
            url = self.info(req.shard).path
            if pumpable(url, req.length) and not left_to_store(url):
                if self._pump is None:
                    self._pump = Pump(
                        self.settings.max_concurrency, self.settings.timeout_s, self._not_arrived
                    )
                return self._pump.start(url, req.start, req.length, req)
        return pool.submit(self._fetch, req)

    def _not_arrived(self, ticket: Ticket) -> None:
        """A range the pump ended without its body: the threads take it on, with the pump's attempt as
        :func:`~.objstore.fetch`'s first (a lie refused at once, a transient failure retried after its
        backoff); an answer the pump does not read (a redirect, chunks) is asked of the store afresh, and
        that URL's next ranges go to the store directly."""
        pool = _shared_pool(self.settings.max_concurrency)
        ticket.fallback = pool.submit(self._fetch, ticket.ctx, ticket.error)

    def _arrived(self, ticket: Ticket) -> None:
        """Count a range the pump read (once: when it is taken, or dropped at :meth:`close`)."""
        with self._lock:
            self.counts.bytes += ticket.length
            self.counts.requests += 1

    def _result(self, got: Future | Ticket) -> bytes | bytearray:
        if isinstance(got, Future):
            return self._thread_result(got)
        if got.pending:
            assert self._pump is not None
            self._pump.wait(got)
        if got.data is not None:
            self._arrived(got)  # taken once: popped from _futures before this call
            return got.data
        assert got.fallback is not None
        return self._thread_result(got.fallback)

    def _thread_result(self, fut: Future) -> bytes:
        """A fetch thread's bytes; while they are awaited, the pump's requests keep going (answers read,
        the queued sent), or the read-ahead would stall behind one large range."""
        pump = self._pump
        if pump is not None and pump.busy and not fut.done():
            fut.add_done_callback(lambda _: pump.wake())
            pump.wait_for(fut.done)
        return fut.result()

    # -- taking (the stream's thread) ------------------------------------------------------------------

    def take(self, j: int) -> dict[Ref, dict[str, Any]]:
        """The decoded samples of batch ``j``'s ranged refs (those the reader did not skip), by ref.

        Batches are taken in order, each once. Raises what :func:`iter_range` and :func:`~.objstore.fetch`
        raise (``ShardError``), after the other requests in flight were cancelled.
        """
        if j <= self._taken:
            raise ValueError(f"batch {j} was taken already (the last taken is {self._taken})")
        first, self._taken = self._taken < 0, j
        self._top_up(j)
        out: dict[Ref, dict[str, Any]] = {}
        try:
            if self._pump is not None:
                self._pump.run(0)  # notice what has arrived before judging whether the loader waits
            if not first and any(not self._futures[(j, k)].done() for k in range(len(self.requests[j]))):
                self.waits += 1  # the network is behind the loader: read further ahead from now on
                grown = min(max(1, 4 * self.depth), self.settings.max_read_ahead_batches)
                if grown > self.depth:
                    self.depth = grown
                    self._top_up(j)
            for k, req in enumerate(self.requests[j]):
                fut = self._futures.pop((j, k))
                try:
                    data = self._result(fut)
                except ShardError as err:
                    if self.on_error != "skip" or err.reason == "unreachable_shard":
                        raise  # a server away for longer than the wait is no bad data: never skipped
                    self.stats[err.reason] = self.stats.get(err.reason, 0) + 1  # type: ignore[index]
                    log.warning("skipped %d samples of shard %s: %s", len(req.ids), err.shard, err.problem)
                    continue
                info = self.info(req.shard)
                pos = self._key_pos.get(req.shard)
                if pos is None:
                    pos = self._key_pos[req.shard] = {key: i for i, key in enumerate(info.keys)}
                for sample in iter_range(
                    info,
                    req.shard,
                    req.ids,
                    data,
                    f"bytes {req.start}-{req.end - 1}",
                    on_error=self.on_error,
                    stats=self.stats,
                    patch_size=self.patch_size,
                    max_member_bytes=self.max_member_bytes,
                    key_pos=pos,
                ):
                    ref = sample["__ref__"]
                    self._held[(int(ref[0]), int(ref[1]))] = sample
                del data
                if self._pump is not None:
                    self._pump.run(0)  # take what has arrived meanwhile and send what is queued
            for ref in self._batch_refs[j]:
                got = self._held.pop(ref, None)
                if got is not None:  # absent: skipped under on_error="skip", counted
                    out[ref] = got
        except BaseException:
            self.close()
            raise
        self._in_flight -= self._release.pop(j, 0)
        self._top_up(j)
        return out

    def close(self) -> None:
        """Cancel what is queued and in flight, and wait for the requests already running (the shared
        threads stay, for the next reader)."""
        self._queue.clear()
        running: list[Future] = []
        for got in self._futures.values():
            if isinstance(got, Future):
                if not got.cancel():
                    running.append(got)
            elif got.data is not None:
                self._arrived(got)  # fetched and never taken: still counted, as the server counted it
            elif got.pending and got.sent:
                with self._lock:
                    self.counts.requests += 1  # asked, its answer dropped unread
            elif got.fallback is not None and not got.fallback.cancel():
                running.append(got.fallback)
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        self._futures.clear()
        self._held.clear()
        if running:
            wait(running)

    def counts_since_last(self) -> dict[str, int]:
        with self._lock:
            return self.counts.since_last()


def ranged_shards(
    index_shards: Sequence[ShardInfo], shard_ids: Sequence[int], settings: RemoteSettings
) -> set[int]:
    """Of ``shard_ids``, the shards read by ranges under ``settings`` (:func:`use_ranged`)."""
    return {s for s in set(shard_ids) if use_ranged(index_shards[s], settings)}

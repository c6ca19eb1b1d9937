"""Ranged reads guided by the plan, against an in-process HTTP server with Range support (loopback, port 0).

Every schedule's epoch read by ranges yields the samples the local stream yields, each once, and the
server serves each planned sample's bytes once across all ranks; adjacent spans merge into one request;
transient 5xx answers are retried; lying answers (short body, wrong Content-Range, 200 with the whole
file) are refused naming the shard and the sample; a server that stays away fails after the bounded wait
naming the URL; the local cache evicts by bytes. (The nginx and moto servers are tests/remote/servers.py's.)
"""

from __future__ import annotations

import dataclasses
import http.server
import os
import re
import socket
import threading
from collections import Counter

import pytest
import torch

from lightning_adaptiveload.loading.loader import PlannedShardDataset
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings
from lightning_adaptiveload.shards.ranged import RangedReader, plan_requests
from lightning_adaptiveload.shards.span_cache import SpanCache

SIZES = [9, 3, 7, 5, 8]
MAX_TOKENS = 768
FAST = dict(backoff_s=0.01, backoff_max_s=0.05, timeout_s=5.0)


class RangeServer:
    """A threaded HTTP server of one folder with Range support, counting what it serves; faults on demand.

    Attributes:
        served: {path: bytes of bodies sent}; requests: {path: count}; ranges: every (path, start, end).
        fail: answer the next this many requests with 503.
        lie: None, "short" (a body one block short), "content_range" (a range shifted by one block),
            "whole" (200 with the whole file), "long" (one byte more than asked for).
        down: answer every request with 503.
        redirects: {path: (status, Location)} answered instead of the file.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.served: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.ranges: list[tuple[str, int, int]] = []
        self.fail = 0
        self.lie: str | None = None
        self.down = False
        self.redirects: dict[str, tuple[int, str]] = {}  # path -> (status, Location)
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.handle(self)

        self.handler = Handler
        self._start(0)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def _start(self, port: int) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), self.handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *args: None  # a client that hung up mid-answer: expected here
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.lock:  # a stopped server keeps no kept-alive connection either
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.sockets.clear()

    def restart_after(self, seconds: float) -> threading.Thread:
        """Stop now (connections refused) and listen again on the same port after ``seconds``."""
        port = self.httpd.server_address[1]
        self.close()
        timer = threading.Timer(seconds, self._start, args=(port,))
        timer.start()
        return timer

    def _send(self, h, status: int, body: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(headers.get("_len", len(body))))
        h.end_headers()
        h.wfile.write(body)

    def handle(self, h) -> None:
        name = h.path.lstrip("/")
        with self.lock:
            self.sockets.add(h.connection)
            self.requests[name] += 1
            failing = self.down or self.fail > 0
            if self.fail > 0:
                self.fail -= 1
        if failing:
            self._send(h, 503, b"busy", {})
            return
        if name in self.redirects:
            status, where = self.redirects[name]
            self._send(h, status, b"moved", {"Location": where})
            return
        path = os.path.join(self.folder, name)
        with open(path, "rb") as f:
            data = f.read()
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range", ""))
        if m is None or self.lie == "whole":
            self.served[name] += len(data)
            self._send(h, 200, data, {})
            return
        start, end = int(m.group(1)), int(m.group(2))
        self.ranges.append((name, start, end))
        body = data[start : end + 1]
        shown = (start, end)
        if self.lie == "short":
            body = body[:-512]
            h.close_connection = True
        elif self.lie == "content_range":
            body = data[start + 512 : end + 513]
            shown = (start + 512, end + 512)
        elif self.lie == "long":
            body = data[start : end + 2]
        self.served[name] += len(body)
        headers = {"Content-Range": f"bytes {shown[0]}-{shown[1]}/{len(data)}", "Accept-Ranges": "bytes"}
        if self.lie == "short":
            headers["_len"] = str(end - start + 1)  # promises the full range, sends less
        h.send_response(206)
        for k, v in headers.items():
            if k != "_len":
                h.send_header(k, v)
        h.send_header("Content-Length", headers.get("_len", str(len(body))))
        h.end_headers()
        h.wfile.write(body)


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=0, name="ranged-shards")


@pytest.fixture()
def server(data):
    srv = RangeServer(data)
    yield srv
    srv.close()


def _local_index(data: str) -> ShardIndex:
    return ShardIndex.load(os.path.join(data, "index.json"))


def _served_index(data: str, url: str) -> ShardIndex:
    index = _local_index(data)
    shards = [dataclasses.replace(s, path=url + os.path.basename(s.path)) for s in index.shards]
    return dataclasses.replace(index, shards=shards)


def _epoch(
    index, schedule: str, world: int, workers: int = 1, remote=None, tail: str = "packed"
) -> list[dict]:
    """Every batch of epoch 0 over all ranks and workers, read one stream after another."""
    out = []
    for rank in range(world):
        ds = PlannedShardDataset(
            index,
            DualConstraintBatcher(MAX_TOKENS),
            settings=PlanSettings(schedule=schedule, lockstep_tail=tail),
            num_workers=workers,
            placement=(rank, world),
            remote=remote,
        )
        plan = ds.begin_epoch(0)
        for w in range(max(1, workers)):
            out.extend(ds._stream(plan, (rank, w)))
    return out


def _samples(batches) -> dict[str, torch.Tensor]:
    got = {}
    for b in batches:
        lat = b["latents"]
        for i, key in enumerate(b["keys"]):
            assert key not in got, f"{key} yielded twice"
            got[key] = lat[i] if not isinstance(lat, list) else lat[i]
    return got


@pytest.mark.parametrize(
    "schedule,tail",
    [("independent", "packed"), ("lockstep", "packed"), ("lockstep", "bucketed"), ("packed", "packed")],
)
def test_a_ranged_epoch_equals_the_local_read_and_serves_each_sample_once(data, server, schedule, tail):
    local = _samples(
        _epoch(_local_index(data), schedule, 3, remote=RemoteSettings(ranged="never"), tail=tail)
    )
    index = _served_index(data, server.url)
    batches = _epoch(index, schedule, 3, remote=RemoteSettings(**FAST), tail=tail)
    got = _samples(batches)
    assert sorted(got) == sorted(local) == sorted(k for s in index.shards for k in s.keys)
    for key, lat in local.items():
        assert torch.equal(got[key], lat), key
    # Each planned sample's bytes were served once over all ranks: the dataset's sample bytes, no more.
    spans = {os.path.basename(s.path): s.spans for s in index.shards}
    want = sum(length for sp in spans.values() for _, length in sp)
    assert sum(server.served.values()) == want
    counted = [b["fetched"] for b in batches]
    assert sum(c["bytes"] for c in counted) == want
    assert sum(c["requests"] for c in counted) == sum(server.requests.values())
    starts = Counter((name, a) for name, sp in spans.items() for a, _ in sp)
    for name, start, _end in server.ranges:
        assert (name, start) in starts  # every request starts at a sample's span


def test_adjacent_spans_merge_into_one_request_and_gaps_split_them(data):
    index = _local_index(data)
    shard = index.shards[0]
    refs = [(0, i) for i in range(shard.num_samples)]
    one = plan_requests([refs], lambda s: index.shards[s], lambda s: True, 0, 1 << 30)
    assert len(one[0]) == 1 and one[0][0].ids == list(range(shard.num_samples))
    assert one[0][0].length == sum(length for _, length in shard.spans)
    every_other = [(0, i) for i in range(0, shard.num_samples, 2)]
    apart = plan_requests([every_other], lambda s: index.shards[s], lambda s: True, 0, 1 << 30)
    assert len(apart[0]) == len(every_other)
    gap = max(length for _, length in shard.spans)
    merged = plan_requests([every_other], lambda s: index.shards[s], lambda s: True, gap, 1 << 30)
    assert len(merged[0]) == 1
    cap = shard.spans[0][1]
    capped = plan_requests([refs], lambda s: index.shards[s], lambda s: True, 0, cap)
    assert len(capped[0]) > 1  # no request grows past max_request_bytes (one sample may be larger alone)
    assert all(r.length <= cap or len(r.ids) == 1 for r in capped[0])
    assert sorted(i for r in capped[0] for i in r.ids) == list(range(shard.num_samples))


def test_spans_merge_across_the_batches_of_a_window_and_each_ref_is_in_one_request(data):
    index = _local_index(data)
    shard = index.shards[0]
    order = list(range(shard.num_samples))[::-1]  # one sample a batch, the shard read backwards
    batches = [[(0, i), (1, i)] if i < index.shards[1].num_samples else [(0, i)] for i in order]
    get = lambda s: index.shards[s]  # noqa: E731
    per_batch = plan_requests(batches, get, lambda s: True, 0, 1 << 30)
    assert [len(reqs) for reqs in per_batch] == [len(b) for b in batches]
    whole = plan_requests(batches, get, lambda s: True, 0, 1 << 30, window_bytes=1 << 30)
    assert sum(map(len, whole)) == 2  # one request per shard, listed under the first batch it serves
    first = next(r for r in whole[0] if r.shard == 0)
    assert (first.batch, first.last_batch, first.ids) == (0, len(batches) - 1, sorted(order))
    window = 4 * max(n for _, n in shard.spans)
    some = plan_requests(batches, get, lambda s: True, 0, 1 << 30, window_bytes=window)
    for reqs in (per_batch, whole, some):
        refs = sorted((r.shard, i) for rs in reqs for r in rs for i in r.ids)
        assert refs == sorted(ref for b in batches for ref in b)  # every planned ref exactly once
        for j, rs in enumerate(reqs):
            assert all(r.batch == j <= r.last_batch for r in rs)
    assert sum(map(len, per_batch)) > sum(map(len, some)) > sum(map(len, whole))


def test_a_reader_holds_samples_for_later_batches_and_frees_their_bytes_when_taken(data):
    index = _local_index(data)
    batches = [[(0, i)] for i in range(index.shards[0].num_samples)]
    remote = RemoteSettings(**FAST, ranged="always", merge_window_bytes=1 << 30, read_ahead_batches=0)
    reader = RangedReader(index.shards, batches, remote, lambda s: True)
    try:
        for j, refs in enumerate(batches):
            got = reader.take(j)
            assert list(got) == refs and got[refs[0]]["__key__"] == index.shards[0].keys[refs[0][1]]
            assert reader.counts.requests == 1  # the window's one request served every batch
            assert len(reader._held) == len(batches) - j - 1
        assert reader._in_flight == 0
    finally:
        reader.close()


def test_merged_requests_are_counted_at_the_server(data, server):
    index = _served_index(data, server.url)
    refs = [[(s, i) for s, info in enumerate(index.shards) for i in range(info.num_samples)]]
    reader = RangedReader(index.shards, refs, RemoteSettings(**FAST), lambda s: True)
    try:
        got = reader.take(0)
    finally:
        reader.close()
    assert len(got) == sum(SIZES)
    assert sum(server.requests.values()) == len(SIZES)  # one request per shard: its samples are adjacent
    assert reader.counts.requests == len(SIZES)


def test_transient_5xx_answers_are_retried_and_nothing_is_yielded_twice(data, server):
    index = _served_index(data, server.url)
    server.fail = 3
    batches = _epoch(index, "lockstep", 2, remote=RemoteSettings(**FAST, max_concurrency=1))
    got = _samples(batches)
    assert sorted(got) == sorted(k for s in index.shards for k in s.keys)
    assert sum(b["fetched"]["retries"] for b in batches) == 3


@pytest.mark.parametrize("lie", ["short", "content_range", "whole", "long"])
def test_a_lying_answer_is_refused_naming_the_shard_and_the_sample(data, server, lie):
    index = _served_index(data, server.url)
    server.lie = lie
    with pytest.raises(ShardError) as info:
        _epoch(index, "independent", 1, remote=RemoteSettings(**FAST))
    err = info.value
    assert err.reason == "bad_range", str(err)
    assert err.shard.startswith(server.url) and err.key is not None
    assert err.key.split(" ")[0] in {k for s in index.shards for k in s.keys}
    assert err.shard in str(err) and err.key.split(" ")[0] in str(err)


def test_a_lying_answer_under_skip_is_counted_not_raised(data, server):
    index = _served_index(data, server.url)
    server.lie = "content_range"
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(MAX_TOKENS), on_error="skip", remote=RemoteSettings(**FAST)
    )
    plan = ds.begin_epoch(0)
    batches = list(ds._stream(plan, (0, 0)))
    assert sum(len(b["keys"]) for b in batches) == 0
    skipped = Counter()
    for b in batches:
        skipped.update(b["skipped"])
    assert skipped["bad_range"] >= 1
    assert skipped["bad_range"] + skipped.get("missing", 0) == sum(SIZES)


def test_a_server_gone_for_longer_than_the_wait_fails_naming_the_url(data, server):
    index = _served_index(data, server.url)
    server.down = True
    settings = RemoteSettings(retry_wait_s=0.3, backoff_s=0.02, backoff_max_s=0.1, timeout_s=2.0)
    with pytest.raises(ShardError) as info:
        _epoch(index, "independent", 1, remote=settings)
    err = info.value
    assert err.reason == "unreachable_shard"
    assert err.shard.startswith(server.url) and err.shard in str(err)
    assert "attempts" in str(err) and "retry_wait_s" in str(err)
    assert sum(server.requests.values()) >= 2


def test_a_connection_refused_is_retried_then_named(data):
    srv = RangeServer(data)
    url = srv.url
    srv.close()  # nothing listens on the port now
    index = _served_index(data, url)
    with pytest.raises(ShardError) as info:
        _epoch(
            index,
            "independent",
            1,
            remote=RemoteSettings(retry_wait_s=0.2, backoff_s=0.02, backoff_max_s=0.05),
        )
    assert info.value.reason == "unreachable_shard" and url in str(info.value)


def test_local_files_stream_unless_ranged_is_forced(data):
    index = _local_index(data)
    streamed = _epoch(index, "lockstep", 2)
    assert all("fetched" not in b for b in streamed)
    forced = _epoch(index, "lockstep", 2, remote=RemoteSettings(ranged="always"))
    assert all("fetched" in b for b in forced)
    assert sum(b["fetched"]["bytes"] for b in forced) == sum(ln for s in index.shards for _, ln in s.spans)
    a, b = _samples(streamed), _samples(forced)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_an_index_without_spans_falls_back_to_streaming(data, server):
    index = _served_index(data, server.url)
    index = dataclasses.replace(index, shards=[dataclasses.replace(s, spans=None) for s in index.shards])
    got = _samples(_epoch(index, "independent", 1, remote=RemoteSettings(**FAST)))
    assert len(got) == sum(SIZES)
    assert set(server.requests) == {os.path.basename(s.path) for s in index.shards}
    assert not server.ranges  # webdataset's gopen streamed the shards whole


def test_a_resumed_epoch_reads_only_the_rest(data, server):
    index = _served_index(data, server.url)
    ds = PlannedShardDataset(index, DualConstraintBatcher(MAX_TOKENS), remote=RemoteSettings(**FAST))
    full = ds.make_plan(0, local=True)
    first = full.streams[(0, 0)][:2]
    consumed = {ref for batch in first for ref in batch}
    rest = ds.make_plan(0, exclude=consumed, local=True)
    ds.begin_epoch(0, plan=rest)
    server.served.clear()
    got = _samples(ds._stream(rest, (0, 0)))
    keys = {index.shards[s].keys[i] for s, i in consumed}
    assert not keys & set(got)
    assert sorted(keys | set(got)) == sorted(k for s in index.shards for k in s.keys)
    left = sum(
        index.shards[s].spans[i][1]
        for s, info in enumerate(index.shards)
        for i in range(info.num_samples)
        if (s, i) not in consumed
    )
    assert sum(server.served.values()) == left


def test_the_cache_serves_a_second_epoch_and_evicts_by_bytes(data, server, tmp_path):
    index = _served_index(data, server.url)
    total = sum(ln for s in index.shards for _, ln in s.spans)
    settings = RemoteSettings(**FAST, cache_bytes=total * 2, cache_dir=str(tmp_path / "c"))
    _epoch(index, "independent", 1, remote=settings)
    first = sum(server.served.values())
    again = _epoch(index, "independent", 1, remote=settings)  # a new reader, the same folder
    assert sum(server.served.values()) == first == total
    assert sum(b["fetched"]["cache_hits"] for b in again) >= 1
    cache = SpanCache(3000, str(tmp_path / "small"))
    for i in range(4):
        cache.put("u", "", i * 1000, 1000, bytes(1000))
    assert cache.size <= 3000 and cache.evicted == 1
    assert cache.get("u", "", 0, 1000) is None  # the least recently used went first
    assert cache.get("u", "", 3000, 1000) == bytes(1000)


def test_a_server_stopped_and_restarted_mid_epoch_still_yields_every_sample_once(data, server):
    index = _served_index(data, server.url)
    settings = RemoteSettings(
        retry_wait_s=20.0, backoff_s=0.05, backoff_max_s=0.2, read_ahead_batches=0, max_concurrency=1
    )
    ds = PlannedShardDataset(index, DualConstraintBatcher(MAX_TOKENS), remote=settings)
    plan = ds.begin_epoch(0)
    stream = ds._stream(plan, (0, 0))
    batches = [next(stream)]
    timer = server.restart_after(0.5)
    batches.extend(stream)
    timer.join()
    assert len(batches) == len(plan.streams[(0, 0)])
    got = _samples(batches)
    assert sorted(got) == sorted(k for s in index.shards for k in s.keys)
    assert sum(b["fetched"]["retries"] for b in batches) >= 1


def test_loader_workers_read_by_ranges_and_the_epoch_report_sums_what_they_fetched(data, server):
    from lightning_adaptiveload.loading.loader import PlannedDataLoader

    index = _served_index(data, server.url)
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(MAX_TOKENS), num_workers=2, remote=RemoteSettings(**FAST)
    )
    loader = PlannedDataLoader(ds, num_workers=2)
    got = _samples(list(loader))
    assert sorted(got) == sorted(k for s in index.shards for k in s.keys)
    total = sum(ln for s in index.shards for _, ln in s.spans)
    assert ds.report["runtime_fetched"]["bytes"] == total == sum(server.served.values())
    assert ds.report["runtime_fetched"]["requests"] == sum(server.requests.values())

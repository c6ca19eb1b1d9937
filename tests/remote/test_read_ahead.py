"""The ranged reader's read-ahead adapts to the consumer, and its threads outlive a stream.

A store that answers after a short sleep stands in for a network's latency: a consumer that takes
batches as fast as it can finds batches not yet arrived, and the depth grows (up to its cap); one that
waits for each batch's bytes before taking it never finds one missing, and the depth stays as
configured. Two readers one after the other run their requests on the same threads (whose kept-alive
connections a backend keeps per thread).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import LocalStore, RangeStore, RemoteSettings
from lightning_adaptiveload.shards.ranged import RangedReader

SIZES = [9, 7, 8]


class SlowStore(RangeStore):
    """Local reads answered after ``delay_s``, recording the thread of each."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.local = delay_s, LocalStore()
        self.threads: list[int] = []
        self.lock = threading.Lock()

    def get(self, url: str, start: int, length: int) -> bytes:
        with self.lock:
            self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        return self.local.get(url, start, length)

    def identity(self, url: str) -> str:
        return self.local.identity(url)

    def read_head(self, url: str, limit: int) -> bytes:
        return self.local.read_head(url, limit)


@pytest.fixture(scope="module")
def index(synthetic_shards) -> ShardIndex:
    return ShardIndex.load(os.path.join(synthetic_shards(SIZES, seed=3, name="read-ahead"), "index.json"))


def _batches(index: ShardIndex) -> list[list[tuple[int, int]]]:
    """One sample a batch, the shards interleaved (no two neighbours in a request)."""
    refs = [(s, i) for i in range(max(SIZES)) for s in range(len(SIZES)) if i < SIZES[s]]
    return [[ref] for ref in refs]


def _reader(index, store, **kw) -> RangedReader:
    settings = RemoteSettings(ranged="always", merge_window_bytes=0, max_concurrency=8, **kw)
    return RangedReader(index.shards, _batches(index), settings, lambda s: True, store=store)


def _arrived(reader: RangedReader, j: int) -> bool:
    return all(reader._futures[(j, k)].done() for k in range(len(reader.requests[j])))


def test_a_consumer_faster_than_the_latency_makes_the_reader_read_further_ahead(index):
    reader = _reader(index, SlowStore(0.02), read_ahead_batches=1, max_read_ahead_batches=16)
    got = [ref for j in range(len(reader.requests)) for ref in reader.take(j)]
    reader.close()
    assert sorted(got) == sorted(r for b in _batches(index) for r in b)
    assert reader.waits >= 1
    assert 1 < reader.depth <= 16


def test_a_consumer_slower_than_the_network_keeps_the_configured_depth(index):
    reader = _reader(index, SlowStore(0.002), read_ahead_batches=1)
    got = []
    for j in range(len(reader.requests)):
        while j > 0 and not _arrived(reader, j):  # the consumer's step outlasts the request
            time.sleep(0.002)
        got.extend(reader.take(j))
    reader.close()
    assert len(got) == sum(SIZES)
    assert reader.waits == 0 and reader.depth == 1


def test_the_cap_holds_the_depth(index):
    reader = _reader(index, SlowStore(0.02), read_ahead_batches=2, max_read_ahead_batches=2)
    for j in range(len(reader.requests)):
        reader.take(j)
    reader.close()
    assert reader.waits >= 1 and reader.depth == 2


def test_a_cap_below_the_start_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"max_read_ahead_batches \(4\) must be >= read_ahead_batches \(8\)"):
        RemoteSettings(read_ahead_batches=8, max_read_ahead_batches=4)


def test_readers_one_after_another_share_the_fetch_threads(index):
    store = SlowStore(0.001)
    first = _reader(index, store, read_ahead_batches=4)
    for j in range(len(first.requests)):
        first.take(j)
    first.close()
    before = set(store.threads)
    store.threads.clear()
    second = _reader(index, store, read_ahead_batches=4)
    got = [ref for j in range(len(second.requests)) for ref in second.take(j)]
    second.close()
    assert len(got) == sum(SIZES)
    assert set(store.threads) & before, "the second reader started threads of its own"
    assert len(before | set(store.threads)) <= 8  # never more than max_concurrency threads in all

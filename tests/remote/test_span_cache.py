"""SpanCache: the bound is the folder's, across readers, epochs and processes; files may vanish."""

from __future__ import annotations

import multiprocessing as mp
import os

from lightning_adaptiveload.shards.span_cache import SpanCache


def _held(folder) -> int:
    return sum(e.stat().st_size for e in os.scandir(folder) if not e.name.startswith("."))


def test_a_new_cache_counts_and_evicts_what_an_earlier_one_left(tmp_path):
    first = SpanCache(1000, str(tmp_path))
    for i in range(8):
        first.put("u", "", i * 100, 100, bytes([i]) * 100)
    assert _held(tmp_path) == 800
    second = SpanCache(300, str(tmp_path))  # a smaller bound: evicts the oldest at once
    assert _held(tmp_path) <= 300 and second.size == _held(tmp_path)
    assert second.get("u", "", 700, 100) == bytes([7]) * 100  # the newest stayed
    assert second.get("u", "", 0, 100) is None  # the oldest went


def test_two_writers_of_one_folder_keep_its_bound(tmp_path):
    a, b = SpanCache(500, str(tmp_path)), SpanCache(500, str(tmp_path))
    for i in range(10):
        (a if i % 2 else b).put("u", "", i * 100, 100, b"x" * 100)
        assert _held(tmp_path) <= 500
    assert a.get("u", "", 900, 100) == b"x" * 100 and b.get("u", "", 900, 100) == b"x" * 100


def test_a_file_that_vanishes_is_a_miss(tmp_path):
    cache = SpanCache(1000, str(tmp_path))
    cache.put("u", "", 0, 10, b"0123456789")
    for e in os.scandir(tmp_path):
        if not e.name.startswith("."):
            os.unlink(e.path)
    assert cache.get("u", "", 0, 10) is None and cache.misses == 1
    cache.put("u", "", 10, 10, b"abcdefghij")  # the account drops the vanished file without error
    assert cache.get("u", "", 10, 10) == b"abcdefghij"


def _writer(folder: str, base: int) -> None:
    cache = SpanCache(2000, folder)
    for i in range(40):
        cache.put("u", "", base + i * 100, 100, b"y" * 100)


def test_worker_processes_sharing_a_folder_keep_its_bound(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), base)) for base in (0, 10**6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert 0 < _held(tmp_path) <= 2000
    assert not [e.name for e in os.scandir(tmp_path) if e.name.startswith(".part-")]

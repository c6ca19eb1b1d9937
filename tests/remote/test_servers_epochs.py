"""Every schedule's epoch read from real servers on the loopback address, counted at the server.

nginx serves the shards over HTTP and moto's server over S3; the index lists each sample's span, so the
plan-guided reader fetches each planned sample's bytes once. At the server: the bytes of the shards served
in one epoch (every rank's streams, read one after another) equal the samples' spans, at most 1.05x the
shard files; one request for the index; no request without a Range; every sample exactly once. The same
epoch streamed whole (``ranged="never"``) shows that the bound can fail.
"""

from __future__ import annotations

import os

import pytest
from servers import (
    SCHEDULES,
    dataset_bytes,
    every_key_once,
    plan_of,
    read_streams,
    s3_index_file,
    span_bytes,
    total,
)

from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings

pytestmark = pytest.mark.timeout(300)

BOUND = 1.05  # bytes served per epoch, at most this many times the dataset's bytes


def _check_served(rows, read, index, data_bytes: int, label: str) -> dict[str, int]:
    """The server's rows of one epoch against the client's read; returns the shards' totals."""
    tars = [r for r in rows if r.path.endswith(".tar")]
    served = total(tars)
    assert served["bytes"] <= BOUND * data_bytes, f"{label}: {served['bytes']} bytes served for {data_bytes}"
    # merge_gap=0: exactly the planned spans, each once
    assert served["bytes"] == span_bytes(index), label
    assert all(r.method == "GET" and r.status == 206 and r.range for r in tars), (
        f"{label}: a request without a range, or not answered 206: {[r for r in tars if r.status != 206][:3]}"
    )
    # the client's counters say what the server logged
    assert read.fetched["bytes"] == served["bytes"] and read.fetched["requests"] == served["requests"], label
    assert served["requests"] <= index.num_samples, f"{label}: more requests than samples"
    every_key_once(read, index)
    return served


@pytest.mark.parametrize("world", [4, 16])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_reads_the_dataset_once_through_nginx(nginx, remote_data, schedule, world):
    mark = nginx.log.mark()
    index = ShardIndex.load(f"{nginx.url}/data/index.json")
    assert all(s.path.startswith(nginx.url) for s in index.shards)
    plan, batcher = plan_of(index, schedule, world, workers=2)
    if schedule == "lockstep":
        assert plan.report["packed_tail_steps"] >= 1, "the lockstep epoch must end in packs here"
    read = read_streams(index, plan, batcher, RemoteSettings())
    rows = nginx.log.since(mark)
    _check_served(rows, read, index, dataset_bytes(remote_data), f"nginx {schedule} x{world}")
    assert total(rows, path_suffix="index.json")["requests"] == 1


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_reads_the_dataset_once_through_s3(moto_s3, remote_data, tmp_path, schedule):
    index = ShardIndex.load(s3_index_file(remote_data, str(tmp_path)), allow_schemes=("s3",))
    assert index.shards[0].path.startswith("s3://shards/data/")
    mark = moto_s3.log.mark()
    plan, batcher = plan_of(index, schedule, 16, workers=1)
    read = read_streams(index, plan, batcher, RemoteSettings())
    rows = moto_s3.log.since(mark)
    _check_served(rows, read, index, dataset_bytes(remote_data), f"s3 {schedule}")


def test_an_s3_index_is_refused_unless_its_scheme_is_allowed(moto_s3, remote_data, tmp_path):
    with pytest.raises(ValueError, match=r"s3://shards/data/shard-000000\.tar"):
        ShardIndex.load(s3_index_file(remote_data, str(tmp_path)))


def test_whole_shard_streaming_breaks_the_bound_that_ranged_reads_keep(nginx, remote_data):
    """The check above can fail: lockstep at 16 ranks, each shard streamed whole by every stream that
    takes a sample of it, serves several times the dataset."""
    index = ShardIndex.load(f"{nginx.url}/data/index.json")
    plan, batcher = plan_of(index, "lockstep", 16, workers=1)
    mark = nginx.log.mark()
    read = read_streams(index, plan, batcher, RemoteSettings(ranged="never"))
    served = total(nginx.log.since(mark), path_suffix=".tar")
    every_key_once(read, index)
    assert served["bytes"] > 2 * dataset_bytes(remote_data), served
    assert "fetched" not in read.fetched or not read.fetched.get("requests")


def test_the_local_cache_serves_a_second_epoch_without_the_server(nginx, remote_data, tmp_path):
    index = ShardIndex.load(f"{nginx.url}/data/index.json")
    remote = RemoteSettings(cache_bytes=64 << 20, cache_dir=str(tmp_path / "cache"))
    plan, batcher = plan_of(index, "lockstep", 4, workers=1)
    mark = nginx.log.mark()
    first = read_streams(index, plan, batcher, remote)
    assert total(nginx.log.since(mark), path_suffix=".tar")["bytes"] == span_bytes(index)
    plan2, _ = plan_of(index, "lockstep", 4, workers=1, epoch=1)
    mark = nginx.log.mark()
    second = read_streams(index, plan2, batcher, remote)
    again = total(nginx.log.since(mark), path_suffix=".tar")
    every_key_once(first, index)
    every_key_once(second, index)
    # another epoch's plan merges other neighbours, so some spans are fetched again; most come from the cache
    assert second.fetched["cache_hits"] > 0 and again["bytes"] < span_bytes(index) // 2, (
        second.fetched,
        again,
    )


def test_a_bounded_cache_evicts_and_stays_under_its_bound(nginx, remote_data, tmp_path):
    index = ShardIndex.load(f"{nginx.url}/data/index.json")
    bound = span_bytes(index) // 4
    folder = tmp_path / "cache"
    remote = RemoteSettings(cache_bytes=bound, cache_dir=str(folder))
    for epoch in (0, 1):
        plan, batcher = plan_of(index, "independent", 2, workers=1, epoch=epoch)
        every_key_once(read_streams(index, plan, batcher, remote), index)
    held = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)
    assert 0 < held <= bound, (held, bound)

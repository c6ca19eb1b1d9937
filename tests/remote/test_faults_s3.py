"""Faults between the reader and an S3 endpoint (moto's server behind the fault-injecting proxy).

The client finds the endpoint where boto3 looks for it, ``AWS_ENDPOINT_URL``; here it names the proxy.
5xx answers (S3's ``SlowDown`` is a 503) and resets are retried, and the epoch holds every sample once;
an answer with a wrong ``Content-Range`` or a short body is refused, naming the shard and the sample.
"""

from __future__ import annotations

import os

import pytest
from servers import Fault, FaultProxy, every_key_once, plan_of, read_streams, s3_index_file, span_bytes, total

from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings

pytestmark = pytest.mark.timeout(180)

_timeouts = iter(range(1, 1000))


@pytest.fixture
def s3_proxy(moto_s3, monkeypatch):
    """A proxy in front of moto, named by ``AWS_ENDPOINT_URL``; and settings whose backend is new (the
    library keeps one backend per scheme and timeout, made with the environment of its first use)."""
    with FaultProxy(moto_s3.port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        timeout = 10.0 + next(_timeouts) / 1000
        yield proxy, RemoteSettings(backoff_s=0.02, backoff_max_s=0.2, retry_wait_s=20.0, timeout_s=timeout)


@pytest.fixture
def s3_index(moto_s3, remote_data, tmp_path) -> ShardIndex:
    return ShardIndex.load(s3_index_file(remote_data, str(tmp_path)), allow_schemes=("s3",))


def test_s3_5xx_and_resets_are_retried(s3_proxy, s3_index):
    proxy, remote = s3_proxy
    proxy.add(
        Fault("status", match=".tar", ranged=True, skip=1, times=3, status=503),
        Fault("status", match=".tar", ranged=True, skip=8, times=1, status=500),
        Fault("reset", match=".tar", ranged=True, skip=12, times=2),
        Fault("reset_mid_body", match=".tar", ranged=True, skip=20, times=1),
    )
    plan, batcher = plan_of(s3_index, "packed", 4, workers=1)
    read = read_streams(s3_index, plan, batcher, remote)
    every_key_once(read, s3_index)
    assert proxy.injected("status") == 4 and proxy.injected("reset") == 2
    assert read.fetched["retries"] >= 1, read.fetched
    good = total([r for r in proxy.since(0) if r.fault is None and r.path.endswith(".tar")])
    assert good["bytes"] == span_bytes(s3_index) == read.fetched["bytes"]
    assert os.environ["AWS_ENDPOINT_URL"] == proxy.url


def test_s3_retries_are_the_librarys_own_and_counted(s3_proxy, s3_index):
    """Every attempt is the library's (its backoff, its ``retry_wait_s``, its counter): the requests the
    endpoint saw are the requests answered plus the retries counted."""
    proxy, remote = s3_proxy
    proxy.add(Fault("status", match=".tar", ranged=True, skip=1, times=3, status=503))
    plan, batcher = plan_of(s3_index, "independent", 2, workers=1)
    read = read_streams(s3_index, plan, batcher, remote)
    every_key_once(read, s3_index)
    seen = total(proxy.since(0), path_suffix=".tar")["requests"]
    assert read.fetched["retries"] == 3 and seen == read.fetched["requests"] + 3, (read.fetched, seen)


@pytest.mark.parametrize("lie", ["wrong_content_range", "short_body"])
def test_an_s3_range_that_lies_is_refused_naming_the_shard_and_the_sample(s3_proxy, s3_index, lie):
    proxy, remote = s3_proxy
    proxy.add(Fault(lie, match=".tar", ranged=True, skip=2, times=None))
    plan, batcher = plan_of(s3_index, "lockstep", 2, workers=1)
    with pytest.raises(ShardError) as info:
        read_streams(s3_index, plan, batcher, remote)
    err = info.value
    assert proxy.injected(lie) >= 1
    assert err.shard.startswith("s3://shards/data/shard-") and err.key, str(err)
    assert err.reason in ("bad_range", "unreadable_shard"), str(err)

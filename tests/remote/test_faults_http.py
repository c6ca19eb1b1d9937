"""Faults on the way to a real server: nginx behind a fault-injecting proxy, or nginx itself stopped.

- 5xx answers, connection resets (before the answer and in the middle of the body) and delays longer
  than the request timeout are retried; the epoch completes with every sample exactly once.
- A server stopped in the middle of an epoch and started again: the epoch completes, exactly once.
- A server gone for longer than ``retry_wait_s``, or one that accepts and never answers: a clear error
  naming the URL after a bounded wait, no hang.
- Each runs with the ranges sent from the loader's thread (``inline_http``, the default) and from the
  fetch threads.
- A range answer that lies (a short body, a wrong ``Content-Range``, a wrong ``Content-Length``, the whole
  file, other bytes under the right headers) is refused, naming the shard and the member; under
  ``on_error="skip"`` its samples are left out and counted.
"""

from __future__ import annotations

import threading

import pytest
from servers import Fault, every_key_once, plan_of, read_streams, span_bytes, total

from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings

pytestmark = pytest.mark.timeout(180)

#: Retries that wait little: the tests do not sleep through the production backoff.
QUICK = dict(backoff_s=0.02, backoff_max_s=0.2, retry_wait_s=20.0, timeout_s=5.0)


def _index(url: str) -> ShardIndex:
    return ShardIndex.load(f"{url}/data/index.json")


def _read_in_thread(fn, timeout: float):
    """Run ``fn()`` in a thread; (result, error); fails the test if it is still running after ``timeout``."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the read still runs after {timeout} s: it hangs"
    return box.get("result"), box.get("error")


@pytest.mark.parametrize("inline", [True, False], ids=["loader-thread", "fetch-threads"])
def test_injected_5xx_and_resets_are_retried(proxy, inline):
    index = _index(proxy.url)
    proxy.add(
        Fault("status", match=".tar", ranged=True, skip=2, times=3, status=503),
        Fault("status", match=".tar", ranged=True, skip=10, times=1, status=500),
        Fault("reset", match=".tar", ranged=True, skip=15, times=2),
        Fault("reset_mid_body", match=".tar", ranged=True, skip=25, times=2),
        Fault("status", match=".tar", ranged=True, skip=35, times=1, status=429),
    )
    plan, batcher = plan_of(index, "lockstep", 4, workers=1)
    mark = proxy.mark()
    # requests merged within each batch only: enough requests (> 36) for every fault's skip to land
    read = read_streams(
        index, plan, batcher, RemoteSettings(**QUICK, merge_window_bytes=0, inline_http=inline)
    )
    every_key_once(read, index)
    rows = proxy.since(mark)
    assert {k: proxy.injected(k) for k in ("status", "reset", "reset_mid_body")} == {
        "status": 5,
        "reset": 2,
        "reset_mid_body": 2,
    }
    # 5xx and cut bodies are retried with backoff; a reset before the answer may be retried at once on a
    # fresh connection: at least the 5xx and the cut bodies count as retries
    assert read.fetched["retries"] >= 7, read.fetched
    good = total([r for r in rows if r.fault is None and r.path.endswith(".tar")])
    assert good["bytes"] == span_bytes(index) == read.fetched["bytes"]


@pytest.mark.parametrize("inline", [True, False], ids=["loader-thread", "fetch-threads"])
def test_delays_are_waited_out_and_a_timeout_is_retried(proxy, inline):
    index = _index(proxy.url)
    # delays under the timeout are waited for; two longer than it time out and are asked again
    proxy.add(Fault("delay", match=".tar", ranged=True, skip=1, times=4, delay_s=0.2))
    proxy.add(Fault("delay", match=".tar", ranged=True, skip=12, times=2, delay_s=3.0))
    plan, batcher = plan_of(index, "independent", 2, workers=1)
    # requests merged within each batch only: enough of them (> 13) for both faults' skips to land
    remote = RemoteSettings(**{**QUICK, "timeout_s": 1.0, "merge_window_bytes": 0}, inline_http=inline)
    read = read_streams(index, plan, batcher, remote)
    every_key_once(read, index)
    assert proxy.injected("delay") == 6
    assert read.fetched["retries"] >= 2, read.fetched


@pytest.mark.parametrize("inline", [True, False], ids=["loader-thread", "fetch-threads"])
def test_a_server_stopped_and_restarted_mid_epoch_completes_it_exactly_once(own_nginx, inline):
    index = _index(own_nginx.url)
    plan, batcher = plan_of(index, "lockstep", 4, workers=1)
    restarted: list[threading.Thread] = []

    def outage(n: int) -> None:
        if n == 6:  # mid-epoch: stop the server, start it again 1.5 s later
            own_nginx.stop()
            restarted.append(own_nginx.restart_after(1.5))

    # little read-ahead, so that requests are still to be made when the server goes away
    remote = RemoteSettings(**QUICK, read_ahead_batches=1, max_concurrency=2, inline_http=inline)
    read = read_streams(index, plan, batcher, remote, on_batch=outage)
    restarted[0].join(30)
    assert own_nginx.starts == 2
    every_key_once(read, index)
    assert read.fetched["retries"] >= 1, "no request met the stopped server: the outage tested nothing"
    assert read.batches > 6


def test_a_server_gone_for_longer_fails_naming_the_url_after_a_bounded_wait(own_nginx):
    index = _index(own_nginx.url)
    plan, batcher = plan_of(index, "lockstep", 4, workers=1)

    def gone(n: int) -> None:
        if n == 3:
            own_nginx.stop()

    remote = RemoteSettings(
        backoff_s=0.05, backoff_max_s=0.5, retry_wait_s=2.0, timeout_s=2.0, read_ahead_batches=1
    )
    _, err = _read_in_thread(lambda: read_streams(index, plan, batcher, remote, on_batch=gone), timeout=60)
    assert isinstance(err, ShardError), repr(err)
    assert err.reason == "unreachable_shard"
    assert f"{own_nginx.url}/data/shard-" in str(err) and "retry_wait_s" in str(err), str(err)


@pytest.mark.parametrize("inline", [True, False], ids=["loader-thread", "fetch-threads"])
def test_a_server_that_never_answers_fails_after_a_bounded_wait(proxy, inline):
    index = _index(proxy.url)
    proxy.add(Fault("delay", match=".tar", ranged=True, skip=2, times=None, delay_s=60.0))
    plan, batcher = plan_of(index, "independent", 2, workers=1)
    remote = RemoteSettings(
        backoff_s=0.05, backoff_max_s=0.2, retry_wait_s=2.0, timeout_s=0.5, inline_http=inline
    )
    _, err = _read_in_thread(lambda: read_streams(index, plan, batcher, remote), timeout=60)
    assert isinstance(err, ShardError) and err.reason == "unreachable_shard", repr(err)
    assert f"{proxy.url}/data/shard-" in str(err)


LIES = [
    "short_body",
    "wrong_content_range",
    "wrong_length",
    "whole_file",
    "other_bytes",
]


@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("inline", [True, False], ids=["loader-thread", "fetch-threads"])
def test_a_lying_range_is_refused_naming_the_shard_and_the_member(proxy, lie, inline):
    index = _index(proxy.url)
    proxy.add(Fault(lie, match=".tar", ranged=True, skip=3, times=None))
    plan, batcher = plan_of(index, "lockstep", 4, workers=1)
    _, err = _read_in_thread(
        lambda: read_streams(index, plan, batcher, RemoteSettings(**QUICK, inline_http=inline)), timeout=60
    )
    assert isinstance(err, ShardError), f"{lie}: {err!r}"
    assert proxy.injected(lie) >= 1
    message = str(err)
    assert f"{proxy.url}/data/shard-" in message, message
    keys = {k for s in index.shards for k in s.keys}
    assert err.key is not None and err.key.split(" ")[0] in keys, message  # the sample it concerns
    assert err.member, message  # the member, or the bytes of the range that lied
    # a lie is not retried: the same server would lie again
    lied = [(r.path, r.range) for r in proxy.since(0) if r.fault == lie]
    assert len(lied) == len(set(lied)), f"a lying answer was asked for again: {lied}"
    if (
        lie != "other_bytes"
    ):  # the right headers: found by the tar scan of the bytes, not by the checks of HTTP
        assert err.reason == "bad_range", message
    print(f"{lie}: {message}")


@pytest.mark.parametrize("lie", ["short_body", "wrong_content_range"])
def test_under_skip_a_lying_range_leaves_its_samples_out_and_counts_them(proxy, lie):
    from lightning_adaptiveload.loading.stream import stream_batches

    index = _index(proxy.url)
    proxy.add(Fault(lie, match=".tar", ranged=True, skip=2, times=1))
    plan, batcher = plan_of(index, "independent", 1, workers=1)
    keys, skipped = [], {}
    for stream in sorted(plan.streams):
        for batch in stream_batches(
            plan, stream, index, batcher, on_error="skip", remote=RemoteSettings(**QUICK)
        ):
            keys += batch["keys"]
            for reason, n in batch["skipped"].items():
                skipped[reason] = skipped.get(reason, 0) + n
    assert proxy.injected(lie) == 1
    lost = index.num_samples - len(keys)
    assert lost >= 1 and len(set(keys)) == len(keys)
    assert sum(skipped.values()) == lost and "bad_range" in skipped, skipped

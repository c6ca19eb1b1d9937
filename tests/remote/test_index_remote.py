"""The index itself read from object storage (s3, http) and HTTP redirects.

``ShardIndex.load`` of an ``s3://`` or ``http(s)://`` index (JSON or the binary ``.npidx``) goes through the
ranged-read backends (no shell command, the size bounded by ``MAX_INDEX_BYTES``), and the index's
relative shard paths resolve against its URL's folder for object-storage schemes too, under the same
untrusted-input rules (a path climbing out of the folder is refused).

Redirects: ``301/302/303/307/308`` are followed (the Range header sent again) at most
``objstore.MAX_REDIRECTS`` times, to ``http(s)`` only and never from ``https`` down to ``http``; beyond,
the read fails naming the URL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from servers import BUCKET, PREFIX, every_key_once, plan_of, read_streams
from test_ranged_reads import RangeServer, _local_index

from lightning_adaptiveload.shards import untrusted
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import MAX_REDIRECTS, RemoteSettings

QUICK = {"backoff_s": 0.02, "backoff_max_s": 0.1, "retry_wait_s": 2.0, "timeout_s": 5.0}


def test_an_s3_index_loads_and_its_relative_paths_resolve_in_its_folder(moto_s3, remote_data):
    index = ShardIndex.load(f"s3://{BUCKET}/{PREFIX}/index.json")
    assert index.shards and all(s.path.startswith(f"s3://{BUCKET}/{PREFIX}/") for s in index.shards)
    assert [os.path.basename(s.path) for s in index.shards] == [
        os.path.basename(s.path) for s in ShardIndex.load(os.path.join(remote_data, "index.json")).shards
    ]
    plan, batcher = plan_of(index, "lockstep", 2, workers=1)
    every_key_once(read_streams(index, plan, batcher, RemoteSettings(**QUICK)), index)


def test_a_binary_s3_index_loads_with_its_spans(moto_s3, remote_data, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(remote_data, folder)
    local = ShardIndex.load(str(folder / "index.json"))
    local.save(str(folder / "index.npidx"))
    os.unlink(folder / "index.json")
    moto_s3.upload_folder(BUCKET, str(folder), "bin")
    index = ShardIndex.load(f"s3://{BUCKET}/bin/index.npidx")
    assert all(s.path.startswith(f"s3://{BUCKET}/bin/") for s in index.shards)
    assert [s.spans for s in index.shards] == [s.spans for s in local.shards]
    plan, batcher = plan_of(index, "packed", 2, workers=1)
    every_key_once(read_streams(index, plan, batcher, RemoteSettings(**QUICK)), index)


def test_an_s3_index_naming_a_path_outside_its_folder_is_refused(moto_s3, remote_data, tmp_path):
    with open(os.path.join(remote_data, "index.json"), encoding="utf-8") as f:
        data = json.load(f)
    data["shards"][0]["path"] = "../elsewhere/" + os.path.basename(data["shards"][0]["path"])
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "index.json").write_text(json.dumps(data))
    moto_s3.upload_folder(BUCKET, str(tmp_path / "up"), "up")
    with pytest.raises(ShardError) as err:
        ShardIndex.load(f"s3://{BUCKET}/up/index.json")
    assert err.value.reason == "unsafe_index_path" and f"s3://{BUCKET}/up/index.json" in str(err.value)


def test_a_missing_s3_index_is_file_not_found(moto_s3):
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/nowhere/index.json"):
        ShardIndex.load(f"s3://{BUCKET}/nowhere/index.json")


@pytest.mark.parametrize("where", ["s3", "nginx"])
def test_an_index_larger_than_the_bound_is_refused_naming_it(where, request, monkeypatch):
    url = (
        f"s3://{BUCKET}/{PREFIX}/index.json"
        if where == "s3"
        else f"{request.getfixturevalue('nginx').url}/{PREFIX}/index.json"
    )
    if where == "s3":
        request.getfixturevalue("moto_s3")
    monkeypatch.setattr(untrusted, "MAX_INDEX_BYTES", 100)
    with pytest.raises(ShardError) as err:
        ShardIndex.load(url)
    assert err.value.reason == "bad_index" and url in str(err.value)


def test_a_binary_index_over_nginx_resolves_beside_it(nginx, www):
    folder = os.path.join(www, "npidx")
    if not os.path.exists(os.path.join(folder, "index.npidx")):
        shutil.copytree(os.path.join(www, PREFIX), folder, dirs_exist_ok=True)
        ShardIndex.load(os.path.join(folder, "index.json")).save(os.path.join(folder, "index.npidx"))
    index = ShardIndex.load(f"{nginx.url}/npidx/index.npidx")
    assert all(s.path.startswith(f"{nginx.url}/npidx/") for s in index.shards)
    plan, batcher = plan_of(index, "independent", 2, workers=1)
    every_key_once(read_streams(index, plan, batcher, RemoteSettings(**QUICK)), index)


# -- redirects -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards([5, 7], seed=2, name="redirect-shards")


@pytest.fixture()
def server(data):
    srv = RangeServer(data)
    yield srv
    srv.close()


def _moved_index(data: str, url: str) -> ShardIndex:
    index = _local_index(data)
    shards = [dataclasses.replace(s, path=url + "old/" + os.path.basename(s.path)) for s in index.shards]
    return dataclasses.replace(index, shards=shards)


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_redirected_shards_and_index_are_followed_and_read_once(data, server, status):
    index = _moved_index(data, server.url)
    for s in index.shards:
        name = os.path.basename(s.path)
        server.redirects[f"old/{name}"] = (status, f"/{name}")  # relative, as servers often answer
    server.redirects["old/index.json"] = (status, f"{server.url}index.json")
    assert ShardIndex.load(f"{server.url}old/index.json").num_samples == index.num_samples
    plan, batcher = plan_of(index, "lockstep", 2, workers=1)
    every_key_once(read_streams(index, plan, batcher, RemoteSettings(**QUICK)), index)
    moved = sum(n for path, n in server.requests.items() if path.startswith("old/") and path.endswith(".tar"))
    served = sum(
        n for path, n in server.requests.items() if not path.startswith("old/") and path.endswith(".tar")
    )
    assert served > 0 and moved > 0
    if status in (301, 308):  # a permanent move is remembered: asked once per shard (and thread)
        assert moved < served, (moved, served)
    assert sum(server.served.values()) >= sum(n for s in index.shards for _, n in s.spans)


def test_a_redirect_loop_fails_naming_the_url(data, server):
    index = _moved_index(data, server.url)
    for s in index.shards:
        name = os.path.basename(s.path)
        server.redirects[f"old/{name}"] = (302, f"/old/{name}")
    plan, batcher = plan_of(index, "independent", 1, workers=1)
    with pytest.raises(ShardError) as err:
        read_streams(index, plan, batcher, RemoteSettings(**QUICK))
    assert err.value.reason == "unreadable_shard"
    assert f"{server.url}old/" in str(err.value) and f"more than {MAX_REDIRECTS} redirects" in str(err.value)


@pytest.mark.parametrize("location", ["file:///etc/passwd", "pipe:cat /etc/passwd", "ftp://127.0.0.1/x.tar"])
def test_a_redirect_to_another_scheme_is_refused_naming_the_url(data, server, location):
    index = _moved_index(data, server.url)
    for s in index.shards:
        server.redirects[f"old/{os.path.basename(s.path)}"] = (302, location)
    plan, batcher = plan_of(index, "independent", 1, workers=1)
    with pytest.raises(ShardError) as err:
        read_streams(index, plan, batcher, RemoteSettings(**QUICK))
    assert err.value.reason == "unreadable_shard" and f"{server.url}old/" in str(err.value)
    assert "not an http(s) URL" in str(err.value)

"""Sample spans in the index: what the scan and the writer record is the tar's reality, both index kinds
keep them alike, an index without them still loads (and is streamed), and hostile spans are refused."""

from __future__ import annotations

import json
import os
import tarfile

import numpy as np
import pytest

from lightning_adaptiveload.shards.columnar import read_columns
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.compact_build import build_compact
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.spans import span_columns_problem, spans_problem

SIZES = [4, 6, 1]


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=3, name="span-shards", text_len_range=(2, 6))


def _tar_spans(path: str) -> dict[str, tuple[int, int]]:
    """Each key's (offset, length) read straight from the tar: first header through last padded data."""
    out: dict[str, list[int]] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key = m.name.split(".", 1)[0]
            end = m.offset_data + -(-m.size // 512) * 512
            if key not in out:
                out[key] = [m.offset, end]
            out[key][1] = end
    return {k: (a, b - a) for k, (a, b) in out.items()}


def test_spans_of_the_writer_and_of_the_scan_equal_the_tar(data):
    written = ShardIndex.load(os.path.join(data, "index.json"))
    built = ShardIndex.build(data, progress=False)
    for w, b in zip(written.shards, built.shards):
        real = _tar_spans(b.path)
        assert w.spans == b.spans == [real[k] for k in b.keys]
    # The spans cover each shard's members end to end: only the end-of-archive blocks follow them.
    for s in built.shards:
        assert s.spans[0][0] == 0
        assert all(a + n == c for (a, n), (c, _) in zip(s.spans, s.spans[1:]))
        assert s.num_bytes - sum(n for _, n in s.spans) >= 1024


def test_both_index_kinds_keep_the_spans(data, tmp_path):
    index = ShardIndex.build(data, progress=False)
    path = index.save(tmp_path / "index.npidx")
    compact = CompactIndex.load(path, allow_outside=True)
    assert [s.spans for s in compact.shards] == [s.spans for s in index.shards]
    assert [s.spans for s in build_compact(data, progress=False).shards] == [s.spans for s in index.shards]
    back = ShardIndex.load(index.save(tmp_path / "index.json"), allow_outside=True)
    assert [s.spans for s in back.shards] == [s.spans for s in index.shards]


def test_an_index_without_spans_loads_and_writes_no_spans(data, tmp_path):
    raw = json.load(open(os.path.join(data, "index.json")))
    for e in raw["shards"]:
        e.pop("spans")
    (tmp_path / "index.json").write_text(json.dumps(raw))
    for name in os.listdir(data):
        if name.endswith(".tar"):
            os.symlink(os.path.join(data, name), tmp_path / name)
    old = ShardIndex.load(tmp_path / "index.json")
    assert all(s.spans is None for s in old.shards)
    assert all("spans" not in e for e in old.to_dict()["shards"])
    binary = old.save(tmp_path / "index.npidx")
    assert read_columns(binary).spans is None  # no array: an older reader still reads the file
    assert all(s.spans is None for s in CompactIndex.load(binary).shards)


@pytest.mark.parametrize(
    "spans,shard_bytes,needle",
    [
        ([[0, 1024], [512, 1024]], 10240, "inside the previous span"),
        ([[0, 1024], [1024, 1000]], 10240, "multiples of 512"),
        ([[0, 1024], [1024, 10240]], 10240, "past the shard"),
        ([[-512, 1024], [1024, 1024]], 10240, "multiples of 512"),
        ([[0, 1024]], 10240, "expected 2 rows"),
    ],
)
def test_hostile_spans_are_refused(spans, shard_bytes, needle):
    problem = spans_problem(spans, 2, shard_bytes)
    assert problem is not None and needle in problem


def test_hostile_spans_in_index_json_are_refused_naming_the_entry(data, tmp_path):
    raw = json.load(open(os.path.join(data, "index.json")))
    raw["shards"][1]["spans"][2] = [0, 512]
    with pytest.raises(ShardError) as err:
        ShardIndex.from_dict(raw, "hostile.json", root=data)
    assert err.value.reason == "bad_index" and "shards[1].spans" in str(err.value)
    raw["shards"][1]["spans"] = "everything"
    with pytest.raises(ShardError, match=r"shards\[1\]\.spans"):
        ShardIndex.from_dict(raw, "hostile.json", root=data)


def test_hostile_spans_in_the_binary_index_are_refused(data):
    offsets = np.array([0, 2, 3], dtype=np.int64)
    sizes = np.array([4096, 4096], dtype=np.int64)
    good = np.array([0, 1024, 1024, 1024, 0, 2048], dtype=np.int64)
    assert span_columns_problem(good, offsets, sizes) is None
    mixed = np.array([0, 1024, -1, -1, -1, -1], dtype=np.int64)
    assert "mixes" in span_columns_problem(mixed, offsets, sizes)[1]
    none = np.array([-1, -1, -1, -1, 0, 2048], dtype=np.int64)
    assert span_columns_problem(none, offsets, sizes) is None  # a shard without spans: streamed
    past = np.array([0, 1024, 1024, 1024, 0, 8192], dtype=np.int64)
    where, detail = span_columns_problem(past, offsets, sizes)
    assert where == "spans[2]" and "past" in detail


def test_an_index_may_name_object_storage_only_when_its_scheme_is_allowed(data):
    raw = json.load(open(os.path.join(data, "index.json")))
    for e in raw["shards"]:
        e["path"] = "s3://bucket/shards/" + os.path.basename(e["path"])
    with pytest.raises(ShardError) as err:
        ShardIndex.from_dict(raw, "remote.json", root=data)
    assert err.value.reason == "unsafe_index_path" and "allow_schemes=['s3']" in str(err.value)
    index = ShardIndex.from_dict(raw, "remote.json", root=data, allow_schemes=["s3"])
    assert index.shards[0].path.startswith("s3://") and index.shards[0].spans is not None


def test_the_fsspec_backend_fetches_exact_ranges_and_refuses_short_ones():
    from lightning_adaptiveload.shards.objstore import FsspecStore, RangeLie, RemoteSettings, fetch

    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/ranged/x.tar", bytes(range(256)) * 8)
    store = FsspecStore("memory")
    assert fetch(store, "memory://ranged/x.tar", 300, 4, RemoteSettings()) == (bytes([44, 45, 46, 47]), 1)
    with pytest.raises(RangeLie):
        store.get("memory://ranged/x.tar", 2040, 100)  # past the end: fewer bytes than asked for
    with pytest.raises(ShardError) as err:
        fetch(store, "memory://ranged/gone.tar", 0, 4, RemoteSettings())
    assert err.value.reason == "missing_shard" and "memory://ranged/gone.tar" in str(err.value)


def test_source_takes_remote_settings_as_a_mapping_and_names_a_wrong_key():
    from lightning_adaptiveload.loading.settings import Source
    from lightning_adaptiveload.shards.objstore import RemoteSettings

    assert Source(remote={"max_concurrency": 3}).remote == RemoteSettings(max_concurrency=3)
    with pytest.raises(ValueError, match="max_concurency"):
        Source(remote={"max_concurency": 3})
    with pytest.raises(ValueError, match="merge_gap"):
        RemoteSettings(merge_gap=-1)
    with pytest.raises(ValueError, match="ranged"):
        RemoteSettings(ranged="sometimes")

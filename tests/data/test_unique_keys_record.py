"""The writer's record of unique keys (issue 40): the search for duplicate keys runs once, when the binary
index is written, and a load skips it only when the record matches the key column it reads. An index
without the record (older, or its header edited) and one whose keys changed after writing are searched."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_adaptiveload.shards import columnar, key_columns
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.writer import ShardWriter


def _index(folder, n_shards=2, per_shard=4):
    rng = np.random.default_rng(0)
    with ShardWriter(folder, prefix="s", max_samples_per_shard=per_shard) as w:
        for i in range(n_shards * per_shard):
            w.write(f"k{i:04d}", rng.standard_normal((4, 1, 2, 2)).astype(np.float16))
    index = ShardIndex.load(folder / "index.json")
    index.save(folder / "index.npidx")
    return folder / "index.npidx"


def _header(raw: bytes) -> tuple[dict, int]:
    n = int.from_bytes(raw[12:16], "little")
    return json.loads(raw[16 : 16 + n]), n


def _with_header(raw: bytes, head: dict) -> bytes:
    """``raw`` with its header replaced (padded with spaces to the same length: the offsets stay valid)."""
    _, n = _header(raw)
    text = json.dumps(head, separators=(",", ":")).encode()
    assert len(text) <= n
    return raw[:16] + text + b" " * (n - len(text)) + raw[16 + n :]


def _key_blob_at(raw: bytes) -> int:
    return {row[0]: row for row in _header(raw)[0]["arrays"]}["key_blob"][2]


@pytest.fixture
def searches(monkeypatch):
    """Counts the full searches for duplicate keys that loads run."""
    calls = []
    real = columnar.duplicate_key

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(columnar, "duplicate_key", counting)
    return calls


def test_the_writer_records_unique_keys_and_a_load_skips_the_search(tmp_path, searches):
    path = _index(tmp_path)
    head, _ = _header(path.read_bytes())
    rec = head[key_columns.UNIQUE_KEYS]
    assert rec["keys"] == 8 and rec["key_bytes"] == 8 * 5
    cols = columnar.read_columns(str(path))
    assert rec["crc32"] == key_columns.keys_crc(cols.key_blob, cols.key_offsets)
    searches.clear()  # the save above searched (the writer's own search)
    index = CompactIndex.load(path)
    assert index.num_samples == 8 and searches == []
    ShardIndex.load(path)
    assert searches == []


def test_an_index_without_the_record_is_searched_and_its_duplicate_refused(tmp_path, searches):
    path = _index(tmp_path)
    raw = path.read_bytes()
    head, _ = _header(raw)
    del head[key_columns.UNIQUE_KEYS]
    path.write_bytes(_with_header(raw, head))  # an older index, or a hand-edited header
    searches.clear()
    CompactIndex.load(path)
    assert searches == [1]
    at = _key_blob_at(raw)
    edited = bytearray(_with_header(raw, head))
    edited[at + 5 : at + 10] = edited[at : at + 5]  # key 1 := key 0
    path.write_bytes(bytes(edited))
    with pytest.raises(ShardError) as err:
        CompactIndex.load(path)
    assert err.value.reason == "duplicate_key" and "'k0000'" in str(err.value) and str(path) in str(err.value)


def test_keys_edited_after_writing_fail_the_crc_and_are_searched(tmp_path, searches):
    path = _index(tmp_path)
    raw = bytearray(path.read_bytes())
    at = _key_blob_at(bytes(raw))
    raw[at + 35 : at + 40] = raw[at + 10 : at + 15]  # key 7 := key 2, the record left as written
    path.write_bytes(bytes(raw))
    searches.clear()
    with pytest.raises(ShardError) as err:
        CompactIndex.load(path)
    assert searches == [1] and err.value.reason == "duplicate_key" and "'k0002'" in str(err.value)
    # a record whose counts do not match is not trusted either
    (tmp_path / "b").mkdir()
    raw = _index(tmp_path / "b").read_bytes()
    head, _ = _header(raw)
    head[key_columns.UNIQUE_KEYS]["keys"] += 1
    (tmp_path / "c.npidx").write_bytes(_with_header(raw, head))
    searches.clear()
    CompactIndex.load(tmp_path / "c.npidx")
    assert searches == [1]


@pytest.mark.parametrize(
    "record", [[1, 2, 3], {"keys": 1, "key_bytes": 2}, {"keys": -1, "key_bytes": 2, "crc32": 3}]
)
def test_a_malformed_record_is_refused_naming_the_field(tmp_path, record):
    path = _index(tmp_path)
    raw = path.read_bytes()
    head, _ = _header(raw)
    head[key_columns.UNIQUE_KEYS] = record
    path.write_bytes(_with_header(raw, head))
    with pytest.raises(ShardError) as err:
        CompactIndex.load(path)
    assert err.value.reason == "bad_index" and "unique_keys" in str(err.value) and str(path) in str(err.value)


def test_no_record_is_written_for_keys_listed_twice():
    keys = [b"a", b"b", b"a"]
    off = np.array([0, 1, 2, 3], dtype=np.int64)
    blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
    assert key_columns.unique_keys_record(blob, off) is None
    rec = key_columns.unique_keys_record(blob[:2], off[:3])
    assert rec == {"keys": 2, "key_bytes": 2, "crc32": key_columns.keys_crc(blob[:2], off[:3])}


def test_keys_crc_is_the_same_in_pieces_and_releases_pages(monkeypatch):
    blob = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    off = np.arange(0, blob.size + 1, 8, dtype=np.int64)
    whole = key_columns.keys_crc(blob, off)
    monkeypatch.setattr(key_columns, "_CRC_CHUNK", 7)
    calls = []
    assert key_columns.keys_crc(blob, off, lambda: calls.append(1)) == whole and len(calls) > 100
    changed = blob.copy()
    changed[100] ^= 1
    assert key_columns.keys_crc(changed, off) != whole

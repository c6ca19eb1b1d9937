"""Indexes that lie (issue 42): shapes checked at read time, unique keys in both index formats, a binary
index replaced while it is loaded, exact token totals. Each case ends in a ``ShardError`` naming the file
(shard or index), the member or field, and the rule; or a counted skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lightning_adaptiveload
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching
from lightning_adaptiveload.shards.compact import CompactIndex, load_checked_compact
from lightning_adaptiveload.shards.format import REASONS, ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.writer import ShardWriter

# The package under test (its folder goes on the subprocesses' PYTHONPATH).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(lightning_adaptiveload.__file__)))


def _shards(folder, n_shards=2, per_shard=4, shape=(16, 9, 16, 16), text=0, prefix="shard"):
    rng = np.random.default_rng(0)
    with ShardWriter(folder, prefix=prefix, max_samples_per_shard=per_shard) as w:
        for i in range(n_shards * per_shard):
            t = rng.standard_normal((text, 8)).astype(np.float16) if text else None
            w.write(f"{prefix}{i:04d}", rng.standard_normal(shape).astype(np.float16), text=t)
    return ShardIndex.load(os.path.join(folder, "index.json"))


def _reason_and_names(err: ShardError, reason: str, *words: str) -> None:
    message = str(err)
    assert err.reason == reason and f"[{reason}]" in message and "What to do: " in message, message
    assert err.hint in message and (err.hint == REASONS[reason] or reason == "duplicate_key"), message
    for w in words:
        assert w in message, message


# ------------------------------------------------------------------------------------------------
# (2) Shapes are checked against the index when a sample is read
# ------------------------------------------------------------------------------------------------


def _lie_about_shapes(index_path, shape, text_len=None):
    data = json.load(open(index_path))
    for entry in data["shards"]:
        entry["latent_shapes"] = [list(shape)] * len(entry["keys"])
        if text_len is not None:
            entry["text_lengths"] = [text_len] * len(entry["keys"])
    json.dump(data, open(index_path, "w"))


@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_index_lying_about_shapes_is_refused_at_read_time(tmp_path, fmt):
    """Samples really (16, 9, 16, 16) indexed as (16, 1, 2, 2): the planner would build batches 576 times
    over max_tokens (an out-of-memory on a GPU). The reader compares each .npy header with the index."""
    _shards(tmp_path)
    _lie_about_shapes(tmp_path / "index.json", (16, 1, 2, 2))
    if fmt == "json":
        index = ShardIndex.load(tmp_path / "index.json")
    else:
        ShardIndex.load(tmp_path / "index.json").save(tmp_path / "index.npidx")
        index = CompactIndex.load(tmp_path / "index.npidx")
    shard = index.shards[0]
    with pytest.raises(ShardError) as err:
        next(iter_shard(shard, 0))
    _reason_and_names(
        err.value, "shape_mismatch", shard.path, "shard0000.latent.npy", "[16, 9, 16, 16]", "[16, 1, 2, 2]"
    )
    assert err.value.key == "shard0000" and err.value.member == "shard0000.latent.npy"
    stats: dict[str, int] = {}
    assert list(iter_shard(shard, 0, on_error="skip", stats=stats)) == []
    assert stats == {"shape_mismatch": 4}
    # Without the index's shapes (a bare path), nothing is compared.
    assert len(list(iter_shard(shard.path, 0))) == 4


def test_text_length_lie_and_missing_text_are_shape_mismatches(tmp_path):
    _shards(tmp_path, n_shards=1, per_shard=2, shape=(4, 1, 2, 2), text=5)
    _lie_about_shapes(tmp_path / "index.json", (4, 1, 2, 2), text_len=7)
    shard = ShardIndex.load(tmp_path / "index.json").shards[0]
    with pytest.raises(ShardError) as err:
        next(iter_shard(shard, 0))
    _reason_and_names(err.value, "shape_mismatch", "shard0000.text.npy", "[5, 8]", "7 tokens")
    # The index lists text the shard does not hold.
    other = tmp_path / "notext"
    _shards(other, n_shards=1, per_shard=2, shape=(4, 1, 2, 2))
    _lie_about_shapes(other / "index.json", (4, 1, 2, 2), text_len=3)
    with pytest.raises(ShardError) as err:
        next(iter_shard(ShardIndex.load(other / "index.json").shards[0], 0))
    _reason_and_names(err.value, "shape_mismatch", "no 'text.npy' member", "3 text tokens")


def test_datamodule_epoch_refuses_a_lying_index(tmp_path):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    _shards(tmp_path, n_shards=2, per_shard=4, shape=(4, 4, 8, 8))
    _lie_about_shapes(tmp_path / "index.json", (4, 1, 2, 2))
    dm = AdaptiveLoadDataModule(
        train_shards=str(tmp_path / "index.json"),
        batching=Batching(max_tokens=64),
        loader=Loader(num_workers=0, seed=0),
    )
    dm.setup("fit")
    with pytest.raises(ShardError, match=r"shape_mismatch"):
        for _ in dm.train_dataloader():
            pass


# ------------------------------------------------------------------------------------------------
# (3) Keys are unique in both index formats; a binary index survives being replaced; exact totals
# ------------------------------------------------------------------------------------------------


def _with_shards(index: ShardIndex, shards) -> ShardIndex:
    return ShardIndex(shards=list(shards), patch_size=index.patch_size, values_checked=index.values_checked)


def test_binary_index_listing_one_shard_twice_is_refused(tmp_path):
    """Before: an epoch of 24 samples trained 8 keys twice; index.json refused the same content."""
    index = _shards(tmp_path, n_shards=2, per_shard=8, shape=(4, 1, 2, 2))
    twice = _with_shards(index, [index.shards[0], index.shards[1], index.shards[0]])
    twice.save(tmp_path / "twice.npidx")
    for load in (
        lambda: CompactIndex.load(tmp_path / "twice.npidx"),
        lambda: load_checked_compact(str(tmp_path / "twice.npidx")),
        lambda: ShardIndex.load(tmp_path / "twice.npidx"),
    ):
        with pytest.raises(ShardError) as err:
            load()
        _reason_and_names(
            err.value,
            "duplicate_key",
            "'shard0000'",
            str(tmp_path / "twice.npidx"),
            f"also in shard {tmp_path / 'shard-000000.tar'}",
            "shards[0].keys[0] and shards[2].keys[0]",
            "rebuild the index",
        )
    # The JSON form of the same content is refused the same way.
    twice.save(tmp_path / "twice.json")
    with pytest.raises(ShardError) as err:
        ShardIndex.load(tmp_path / "twice.json")
    _reason_and_names(err.value, "duplicate_key", "shard0000", "shards[0].keys[0] and shards[2].keys[0]")


@pytest.mark.parametrize("suffix", [".npidx", ".json"])
def test_key_repeated_within_one_shard_is_refused_and_convert_index_fails(tmp_path, suffix, capsys):
    from lightning_adaptiveload.cli.data import convert_index_main

    index = _shards(tmp_path, n_shards=1, per_shard=4, shape=(4, 1, 2, 2))
    s = index.shards[0]
    s.keys[2] = s.keys[0]  # 'shard0000' at positions 0 and 2
    index.save(tmp_path / f"dup{suffix}")
    with pytest.raises(ShardError) as err:
        ShardIndex.load(tmp_path / f"dup{suffix}")
    _reason_and_names(err.value, "duplicate_key", "'shard0000'", "twice in this shard", "keys[0] and [2]")
    out = tmp_path / ("out.json" if suffix == ".npidx" else "out.npidx")
    assert convert_index_main([str(tmp_path / f"dup{suffix}"), str(out), "--no-progress"]) == 2
    assert "duplicate_key" in capsys.readouterr().err and not out.exists()


def test_check_cross_duplicates_catches_a_key_twice_in_one_shard(tmp_path):
    from lightning_adaptiveload.shards.indexing import check_cross_duplicates

    index = _shards(tmp_path, n_shards=1, per_shard=3, shape=(4, 1, 2, 2))
    s = index.shards[0]
    s.keys[2] = s.keys[0]
    with pytest.raises(ShardError, match="listed twice in this shard"):
        check_cross_duplicates(index.shards, "raise")
    check_cross_duplicates(index.shards, "skip")
    assert s.keys == ["shard0000", "shard0001"] and s.skipped[0]["reason"] == "duplicate_key"


def test_key_hashes_and_duplicates_on_odd_keys():
    from lightning_adaptiveload.shards import columnar, key_columns

    keys = [b"a", b"", b"ab", b"ba", b"x" * (key_columns._HASH_CHUNK + 5), b"\xc3\xa9", b"b" + b"a"]
    off = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys], out=off[1:])
    blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
    h = columnar.key_hashes(blob, off)
    assert h[3] == h[6] and len(set(h[:6].tolist())) == 6
    assert columnar.duplicate_key(blob, off) == (3, 6)
    assert columnar.duplicate_key(blob, off[:-1]) is None


def test_key_hashes_release_the_pages_read_as_they_go(monkeypatch):
    """Issue 40: at 100M keys the duplicate check held every mapped key page and two hash arrays (4.6 GB of
    a 100M index's load); it now releases the pages while it hashes and sorts the hashes in place."""
    from lightning_adaptiveload.shards import columnar, key_columns

    monkeypatch.setattr(key_columns, "_HASH_CHUNK", 8)  # many chunks of a small index
    keys = [f"k{i:05d}".encode() for i in range(200)] + [b"k00007"]
    off = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys], out=off[1:])
    blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
    calls = []
    h = columnar.key_hashes(blob, off, lambda: calls.append(1))
    assert len(calls) > 10 and (h == columnar.key_hashes(blob, off)).all()
    calls.clear()
    assert columnar.duplicate_key(blob, off, lambda: calls.append(1)) == (7, 200) and calls
    assert columnar.duplicate_key(blob, off[:-1], lambda: calls.append(1)) is None


_REPLACE_RUNNER = textwrap.dedent("""
    import os, shutil, sys
    from lightning_adaptiveload.shards.reader import iter_shard
    from lightning_adaptiveload.shards.compact import load_checked_compact
    path, other, how = sys.argv[1:4]
    index = load_checked_compact(path)
    n = index.num_samples
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(64)
    else:  # cp other path: the same size, other bytes, written in place
        with open(other, "rb") as src, open(path, "r+b") as dst:
            dst.write(src.read())
    # Everything the loader and planner read, after the file changed under the job.
    seen = [len(index.shard_keys(s)) for s in range(index.num_shards)]
    shapes = [index.latent_shape((s, 0)) for s in range(index.num_shards)]
    read = sum(1 for s in range(index.num_shards) for _ in iter_shard(index.shards[s], s))
    print(n, sum(seen), read, index.total_tokens(), shapes[0])
""")


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_binary_index_rewritten_in_place_while_loaded(tmp_path, how):
    """Before: truncation killed the process with SIGBUS (shard 3 first read as empty); overwriting let
    unchecked values through (IndexError). The index is read into private memory now."""
    index = _shards(tmp_path, n_shards=4, per_shard=3, shape=(4, 1, 2, 2))
    index.save(tmp_path / "index.npidx")
    other = _with_shards(index, index.shards)
    for s in other.shards:
        s.latent_shapes = [(4, 1, 2, 200000)] * len(s.keys)  # same sizes, other bytes
        s.keys = [k.replace("shard", "zhard") for k in s.keys]
    other.save(tmp_path / "other.npidx")
    assert os.path.getsize(tmp_path / "other.npidx") == os.path.getsize(tmp_path / "index.npidx")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _REPLACE_RUNNER,
            str(tmp_path / "index.npidx"),
            str(tmp_path / "other.npidx"),
            how,
        ],
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split()[:4] == ["12", "12", "12", "12"], out.stdout


def test_spawned_worker_refuses_a_binary_index_changed_since_it_was_loaded(tmp_path):
    import pickle

    index = _shards(tmp_path, n_shards=2, per_shard=2, shape=(4, 1, 2, 2))
    index.save(tmp_path / "index.npidx")
    loaded = CompactIndex.load(tmp_path / "index.npidx")
    again = pickle.loads(pickle.dumps(loaded))  # what a spawned DataLoader worker does
    assert again.num_samples == 4 and again.columns.digest == loaded.columns.digest
    data = bytearray((tmp_path / "index.npidx").read_bytes())
    data[data.index(b" ", 16)] = ord("\n")  # header padding: still valid, same size; mtime kept below
    st = os.stat(tmp_path / "index.npidx")
    (tmp_path / "index.npidx").write_bytes(bytes(data))
    os.utime(tmp_path / "index.npidx", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ShardError, match=r"changed after it was loaded \(its content's digests differ\)"):
        pickle.loads(pickle.dumps(loaded))


def test_total_tokens_is_exact_beyond_int64(tmp_path):
    """Before: the `index` command printed -576460752303420698."""

    big = (1, (1 << 31) - 1, (1 << 31) - 2, (1 << 31) - 2)
    index = _shards(tmp_path, n_shards=1, per_shard=8, shape=(4, 1, 2, 2))
    index.shards[0].latent_shapes = [big] * 8
    index.save(tmp_path / "big.npidx")
    compact = CompactIndex.load(tmp_path / "big.npidx")
    want = 8 * ((1 << 31) - 1) * (((1 << 31) - 2) // 2) ** 2
    assert compact.total_tokens() == want == ShardIndex.load(tmp_path / "big.npidx").total_tokens()
    assert want > 1 << 63

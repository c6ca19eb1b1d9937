"""Building the binary index straight from shards (``build_compact``, ``index --format binary``):
the same content as ``ShardIndex.build``, serial or in parallel workers."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_adaptiveload.planning.inputs import index_fingerprint
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.compact_build import build_compact
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.writer import ShardWriter


def _shards(folder, n_samples, per_shard=1, prefix="shard", key="k"):
    rng = np.random.default_rng(len(str(folder)))
    with ShardWriter(folder, prefix=prefix, max_samples_per_shard=per_shard) as w:
        for i in range(n_samples):
            t = int(rng.integers(1, 4))
            text = np.zeros((int(rng.integers(1, 5)), 2), np.float16) if i % 3 else None
            w.write(f"{key}{i:06d}", np.zeros((2, t, 2, 2), np.float16), text=text)
    return str(folder)


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    return _shards(tmp_path_factory.mktemp("many"), 300)


@pytest.mark.timeout(120)
def test_parallel_build_equals_the_serial_build(many_shards):
    serial = ShardIndex.build(many_shards, progress=False, patch_size=None)
    threads = build_compact(many_shards, progress=False, patch_size=None, num_workers=2)
    procs = build_compact(many_shards, progress=False, patch_size=None, num_workers=2, processes=True)
    assert serial.num_shards == 300
    for built in (threads, procs):
        assert built.to_shard_index().to_dict() == serial.to_dict()
        assert index_fingerprint(built) == index_fingerprint(serial)


def test_duplicate_keys_across_shards_raise_or_are_dropped_as_in_the_json_build(tmp_path):
    a = _shards(tmp_path / "a", 6, per_shard=3)
    b = _shards(tmp_path / "b", 4, per_shard=2, prefix="other")  # keys k000000..k000003 again
    paths = [
        f"{a}/shard-000000.tar",
        f"{a}/shard-000001.tar",
        f"{b}/other-000000.tar",
        f"{b}/other-000001.tar",
    ]
    with pytest.raises(ShardError) as err:
        build_compact(paths, progress=False, patch_size=None)
    assert err.value.reason == "duplicate_key" and err.value.key == "k000000"
    expect = ShardIndex.build(paths, progress=False, patch_size=None, on_error="skip")
    got = build_compact(paths, progress=False, patch_size=None, on_error="skip")
    assert got.to_shard_index().to_dict() == expect.to_dict()
    assert got.counts() == expect.counts() == {"duplicate_key": 4}
    # dropping samples renumbers the shapes in order of first use: the saved file loads
    assert CompactIndex.load(got.save(tmp_path / "index.npidx")).num_samples == 6


def test_index_command_writes_the_binary_index(many_shards, tmp_path, capsys):
    from lightning_adaptiveload.cli.data import index_main

    out = tmp_path / "idx.npidx"
    argv = [
        many_shards,
        "--rebuild",
        "--format",
        "binary",
        "--output",
        str(out),
        "--no-progress",
        "--workers",
        "2",
    ]
    assert index_main(argv) == 0
    printed = capsys.readouterr().out
    assert "300 shards, 300 samples" in printed and "2x1x2x2" in printed  # the summary and the bucket table
    built = CompactIndex.load(out, allow_outside=True).to_shard_index()
    assert built.patch_size == (1, 2, 2) and built.values_checked
    assert built.to_dict()["shards"] == ShardIndex.load(f"{many_shards}/index.json").to_dict()["shards"]

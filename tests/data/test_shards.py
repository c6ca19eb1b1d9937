"""Shard writer, reader, index, synthetic shards and mixes (lightning_adaptiveload.shards: writer, reader, index, synthetic, mixes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
import torch

from lightning_adaptiveload.cli.data import index_main, synth_main
from lightning_adaptiveload.shards import indexing as indexing_mod
from lightning_adaptiveload.shards import reader as reader_mod
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.mixes import available_mixes, load_mix
from lightning_adaptiveload.shards.paths import expand_paths
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards
from lightning_adaptiveload.shards.writer import ShardWriter

GNU_TAR = shutil.which("tar")


def _samples(seed: int = 0, n: int = 7) -> list[dict]:
    """Samples with every optional part present or absent, float16 and float32."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        dtype = np.float16 if i % 2 == 0 else np.float32
        shape = (4, 1 + 2 * (i % 3), 2 * (1 + i % 2), 4)
        text = rng.standard_normal((i, 8)).astype(dtype) if i % 3 else None
        meta = {"caption": f"clip {i}", "fps": 16} if i % 2 else None
        out.append(
            {
                "key": f"k{i:03d}",
                "latent": rng.standard_normal(shape).astype(dtype),
                "text": text,
                "meta": meta,
            }
        )
    return out


def _write(directory, samples, **kwargs) -> ShardIndex:
    with ShardWriter(directory, **kwargs) as w:
        for s in samples:
            w.write(s["key"], s["latent"], text=s["text"], meta=s["meta"])
    return w.index


def _members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _assert_same(decoded: dict, sample: dict) -> None:
    assert decoded["__key__"] == sample["key"]
    latent = decoded["latent"]
    assert isinstance(latent, torch.Tensor) and latent.dtype == torch.from_numpy(sample["latent"]).dtype
    np.testing.assert_array_equal(latent.numpy(), sample["latent"])
    if sample["text"] is None:
        assert decoded["text"] is None
    else:
        np.testing.assert_array_equal(decoded["text"].numpy(), sample["text"])
    assert decoded["meta"] == sample["meta"]


def _read_all(index: ShardIndex) -> list[dict]:
    return [x for sid, info in enumerate(index.shards) for x in iter_shard(info, sid)]


# ------------------------------------------------------------------------------------------------
# Writer and reader
# ------------------------------------------------------------------------------------------------


def test_writer_round_trip_and_index_json(tmp_path):
    samples = _samples()
    with ShardWriter(tmp_path, max_samples_per_shard=3) as w:
        refs = [w.write(s["key"], s["latent"], text=s["text"], meta=s["meta"]) for s in samples]
    assert refs == [(i // 3, i % 3) for i in range(len(samples))]
    assert sorted(os.listdir(tmp_path)) == [
        "index.json",
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
    ]

    data = json.loads((tmp_path / "index.json").read_text())
    assert data["version"] == 1
    assert [s["path"] for s in data["shards"]] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert [s["num_samples"] for s in data["shards"]] == [3, 3, 1]
    for entry in data["shards"]:
        assert entry["bytes"] == os.path.getsize(tmp_path / entry["path"])
    flat_keys = [k for s in data["shards"] for k in s["keys"]]
    assert flat_keys == [s["key"] for s in samples]
    assert [tuple(x) for s in data["shards"] for x in s["latent_shapes"]] == [
        s["latent"].shape for s in samples
    ]
    assert [x for s in data["shards"] for x in s["text_lengths"]] == [
        0 if s["text"] is None else s["text"].shape[0] for s in samples
    ]

    decoded = _read_all(ShardIndex.load(tmp_path / "index.json"))
    assert len(decoded) == len(samples)
    for d, s, ref in zip(decoded, samples, refs):
        _assert_same(d, s)
        assert d["__ref__"] == ref
        assert d["__shard__"] == str(tmp_path / f"shard-{ref[0]:06d}.tar")


def test_writer_accepts_torch_tensors_and_rejects_bfloat16(tmp_path):
    with ShardWriter(tmp_path) as w:
        w.write("a", torch.randn(2, 1, 2, 2, dtype=torch.float16), text=torch.randn(3, 4))
        with pytest.raises(ValueError, match="bfloat16"):
            w.write("b", torch.randn(2, 1, 2, 2, dtype=torch.bfloat16))
    (out,) = _read_all(w.index)
    assert out["latent"].dtype == torch.float16 and out["text"].shape == (3, 4)


def test_writer_headers_are_deterministic(tmp_path):
    samples = _samples()
    _write(tmp_path / "a", samples, max_samples_per_shard=4)
    _write(tmp_path / "b", samples, max_samples_per_shard=4)
    for name in ("shard-000000.tar", "shard-000001.tar"):
        assert _sha(tmp_path / "a" / name) == _sha(tmp_path / "b" / name)
        with tarfile.open(tmp_path / "a" / name) as tf:
            for m in tf.getmembers():
                assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.isreg()) == (
                    0,
                    0,
                    0,
                    "",
                    "",
                    0o644,
                    True,
                )
    # atomic writes leave no temp files behind
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".")]


def test_writer_member_order_and_long_keys(tmp_path):
    long_key = "x" * 150  # needs pax records in the tar header
    with ShardWriter(tmp_path) as w:
        w.write(
            long_key, np.zeros((1, 1, 2, 2), np.float32), text=np.zeros((1, 2), np.float32), meta={"a": 1}
        )
    names = [n for n, _ in _members(w.paths[0])]
    assert names == [f"{long_key}.latent.npy", f"{long_key}.text.npy", f"{long_key}.json"]
    assert _read_all(w.index)[0]["__key__"] == long_key


def test_writer_rotates_on_max_bytes(tmp_path):
    latent = np.zeros((4, 1, 8, 8), np.float32)  # 1 KiB data + 128 B npy header: 2 KiB as a tar member
    with ShardWriter(tmp_path, max_samples_per_shard=None, max_bytes=4096) as w:
        for i in range(5):
            w.write(f"s{i}", latent)
    assert [s.num_samples for s in w.index.shards] == [2, 2, 1]
    # a single sample larger than max_bytes still gets written, alone
    with ShardWriter(tmp_path / "big", max_bytes=100) as w:
        w.write("a", latent)
        w.write("b", latent)
    assert [s.num_samples for s in w.index.shards] == [1, 1]


@pytest.mark.parametrize(
    "key, latent, text, meta, match",
    [
        ("a.b", np.zeros((1, 1, 2, 2), np.float16), None, None, "invalid"),
        ("a/b", np.zeros((1, 1, 2, 2), np.float16), None, None, "invalid"),
        ("", np.zeros((1, 1, 2, 2), np.float16), None, None, "invalid"),
        ("__meta__", np.zeros((1, 1, 2, 2), np.float16), None, None, "invalid"),
        ("ok", np.zeros((1, 2, 2), np.float16), None, None, "3 dims"),
        ("ok", np.zeros((1, 1, 2, 2), np.int32), None, None, "int32"),
        ("ok", np.zeros((1, 1, 2, 2), np.float64), None, None, "float64"),
        ("ok", np.zeros((1, 0, 2, 2), np.float16), None, None, "empty"),
        ("ok", np.full((1, 1, 2, 2), np.nan, np.float16), None, None, "NaN"),
        ("ok", np.zeros((1, 1, 2, 2), np.float16), np.zeros((2,), np.float16), None, "text shape"),
        ("ok", np.zeros((1, 1, 2, 2), np.float16), np.full((2, 2), np.inf, np.float32), None, "text has"),
        ("ok", np.zeros((1, 1, 2, 2), np.float16), None, {"x": float("nan")}, "JSON"),
        ("ok", np.zeros((1, 1, 2, 2), np.float16), None, {"x": object()}, "JSON"),
        ("ok", [[[[0.0]]]], None, None, "numpy.ndarray or torch.Tensor"),
    ],
)
def test_writer_rejects_bad_samples(tmp_path, key, latent, text, meta, match):
    with ShardWriter(tmp_path) as w:
        with pytest.raises((ValueError, TypeError), match=match) as err:
            w.write(key, latent, text=text, meta=meta)
        assert repr(key) in str(err.value) or key == ""
        w.write("good", np.zeros((1, 1, 2, 2), np.float16))  # the writer stays usable
    assert [x["__key__"] for x in _read_all(w.index)] == ["good"]


def test_writer_rejects_duplicate_keys_and_patch(tmp_path):
    with ShardWriter(tmp_path, max_samples_per_shard=1, patch_size=(1, 2, 2)) as w:
        w.write("a", np.zeros((1, 1, 2, 2), np.float16))
        with pytest.raises(ValueError, match="already written"):
            w.write("a", np.zeros((1, 1, 2, 2), np.float16))  # in another shard by now
        with pytest.raises(ValueError, match="not divisible"):
            w.write("b", np.zeros((1, 1, 3, 2), np.float16))


def test_writer_refuses_existing_output_unless_overwrite(tmp_path):
    _write(tmp_path, _samples(n=2))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ShardWriter(tmp_path)
    index = _write(tmp_path, _samples(seed=1, n=1), overwrite=True)
    assert index.num_samples == 1 and sorted(os.listdir(tmp_path)) == ["index.json", "shard-000000.tar"]


def test_writer_error_leaves_no_index_and_no_temp_file(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, max_samples_per_shard=2) as w:
            for s in _samples(n=3):
                w.write(s["key"], s["latent"])
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["shard-000000.tar"]  # the complete shard only


# ------------------------------------------------------------------------------------------------
# Interoperability: webdataset, Python tarfile, GNU tar
# ------------------------------------------------------------------------------------------------


def test_webdataset_reads_the_same_bytes(tmp_path):
    import webdataset as wds

    samples = _samples()
    index = _write(tmp_path, samples, max_samples_per_shard=4)
    raw = list(wds.WebDataset([str(p) for p in index.paths], shardshuffle=False))
    assert [r["__key__"] for r in raw] == [s["key"] for s in samples]
    members = dict(m for p in index.paths for m in _members(p))
    for r, s in zip(raw, samples):
        for ext in ("latent.npy", "text.npy", "json"):
            name = f"{s['key']}.{ext}"
            assert (ext in r) == (name in members)
            if ext in r:
                assert r[ext] == members[name]
        np.testing.assert_array_equal(np.load(io.BytesIO(r["latent.npy"]), allow_pickle=False), s["latent"])


@pytest.mark.skipif(GNU_TAR is None, reason="GNU tar not installed")
def test_gnu_tar_lists_and_extracts_the_same(tmp_path):
    index = _write(tmp_path / "shards", _samples(), max_samples_per_shard=10)
    shard = index.paths[0]
    members = _members(shard)
    listed = subprocess.run(
        [GNU_TAR, "-tf", shard], check=True, capture_output=True, text=True
    ).stdout.split()
    assert listed == [name for name, _ in members]
    out = tmp_path / "x"
    out.mkdir()
    result = subprocess.run(
        [GNU_TAR, "-xf", shard, "-C", str(out)], check=True, capture_output=True, text=True
    )
    assert result.stderr == ""  # no warnings (e.g. "A lone zero block")
    for name, data in members:
        assert (out / name).read_bytes() == data


def test_python_tarfile_shard_without_index_gets_one(tmp_path):
    """A shard made by another tool (GNU format, real mtimes, owners) is indexed and read the same."""
    samples = _samples()
    ours = _write(tmp_path / "ours", samples)
    other = tmp_path / "other"
    other.mkdir()
    with tarfile.open(other / "data.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in _members(ours.paths[0]):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.uid, info.uname, info.mode = len(data), 1.7e9, 1000, "alice", 0o600
            tf.addfile(info, io.BytesIO(data))
    assert not (other / "index.json").exists()
    index = ShardIndex.for_paths(other / "data.tar", progress=False, save=True)
    assert (other / "index.json").exists()
    assert index.shards[0].keys == ours.shards[0].keys
    assert index.shards[0].latent_shapes == ours.shards[0].latent_shapes
    assert index.shards[0].text_lengths == ours.shards[0].text_lengths
    for d, s in zip(_read_all(index), samples):
        _assert_same(d, s)


@pytest.mark.skipif(GNU_TAR is None, reason="GNU tar not installed")
def test_gnu_tar_made_shard_reads_the_same(tmp_path):
    samples = _samples()
    ours = _write(tmp_path / "ours", samples)
    files = tmp_path / "files"
    files.mkdir()
    names = []
    for name, data in _members(ours.paths[0]):
        (files / name).write_bytes(data)
        names.append(name)
    shard = tmp_path / "gnu.tar"
    subprocess.run([GNU_TAR, "-cf", str(shard), "-C", str(files), *names], check=True)
    index = ShardIndex.build(shard, progress=False)
    assert index.shards[0].keys == [s["key"] for s in samples]
    for d, s in zip(_read_all(index), samples):
        _assert_same(d, s)


# ------------------------------------------------------------------------------------------------
# The index
# ------------------------------------------------------------------------------------------------


def test_build_equals_writer_index(tmp_path):
    written = _write(tmp_path, _samples(), max_samples_per_shard=3)
    built = ShardIndex.build(tmp_path, progress=False, patch_size=None)
    assert built.to_dict(str(tmp_path))["shards"] == written.to_dict(str(tmp_path))["shards"]
    threaded = ShardIndex.build(written.paths, progress=False, patch_size=None, num_workers=2)
    assert threaded.to_dict()["shards"] == built.to_dict()["shards"]


def test_index_save_load_round_trip_and_relative_paths(tmp_path):
    written = _write(tmp_path / "a", _samples(), max_samples_per_shard=3)
    loaded = ShardIndex.load(tmp_path / "a" / "index.json")
    assert loaded.to_dict() == written.to_dict()
    assert loaded.source == str(tmp_path / "a" / "index.json")
    # the data set moves: relative paths follow it
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = ShardIndex.load(tmp_path / "b" / "index.json")
    assert moved.paths == [str(tmp_path / "b" / os.path.basename(p)) for p in written.paths]
    assert [x["__key__"] for x in _read_all(moved)] == [s["key"] for s in _samples()]
    # saved elsewhere, paths outside the index's folder stay absolute; loading them needs an opt-in
    (tmp_path / "c").mkdir()
    moved.save(tmp_path / "c" / "elsewhere.json")
    with pytest.raises(ShardError, match="unsafe_index_path"):
        ShardIndex.load(tmp_path / "c" / "elsewhere.json")
    assert ShardIndex.load(tmp_path / "c" / "elsewhere.json", allow_outside=True).paths == moved.paths
    assert json.loads((tmp_path / "c" / "elsewhere.json").read_text())["shards"][0]["path"] == moved.paths[0]


def test_index_load_accepts_the_minimal_contract_format(tmp_path):
    written = _write(tmp_path, _samples(n=2))
    entry = written.to_dict(str(tmp_path))["shards"][0]
    minimal = {
        "version": 1,
        "patch_size": None,
        "shards": [{k: entry[k] for k in ("path", "num_samples", "keys", "latent_shapes")}],
    }
    (tmp_path / "min.json").write_text(json.dumps(minimal))
    index = ShardIndex.load(tmp_path / "min.json")
    assert index.shards[0].keys == entry["keys"] and index.shards[0].text_lengths == [0, 0]
    assert index.values_checked is False


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "not valid JSON"),
        ('{"version": 2, "shards": []}', "version 2"),
        ('{"version": 1, "shards": [{"path": "a.tar", "keys": ["a"], "latent_shapes": []}]}', r"shards\[0\]"),
        (
            '{"version": 1, "shards": [{"path": "a.tar", "keys": ["a"], "latent_shapes": [[1, 2]]}]}',
            "4 integers",
        ),
    ],
)
def test_index_load_errors_name_the_file_and_entry(tmp_path, content, match):
    (tmp_path / "index.json").write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        ShardIndex.load(tmp_path / "index.json")
    assert str(tmp_path / "index.json") in str(err.value)


def test_for_paths_uses_the_index_without_reading_shards(tmp_path, monkeypatch):
    written = _write(tmp_path, _samples(), max_samples_per_shard=3)
    calls = []
    real = indexing_mod._index_one
    monkeypatch.setattr(indexing_mod, "_index_one", lambda p, *a: calls.append(p) or real(p, *a))
    for given in (
        tmp_path,
        str(tmp_path / "shard-{000000..000002}.tar"),
        written.paths,
        f"file://{tmp_path}/shard-000001.tar",
        tmp_path / "index.json",
    ):
        index = ShardIndex.for_paths(given, progress=False)
        assert set(index.paths) <= set(written.paths) and index.num_samples > 0
    assert calls == []
    subset = ShardIndex.for_paths(written.paths[1:], progress=False)
    assert subset.paths == written.paths[1:]
    assert subset.shards[0].keys == written.shards[1].keys

    # a shard rewritten after indexing (size differs): only that one is read again
    with open(written.paths[1], "ab") as f:
        f.write(b"\0" * 10240)
    index = ShardIndex.for_paths(tmp_path, progress=False)
    assert calls == [written.paths[1]]
    assert index.shards[1].num_bytes == os.path.getsize(written.paths[1])
    assert index.shards[1].keys == written.shards[1].keys


def test_for_paths_builds_with_the_requested_checks(tmp_path):
    _write(tmp_path, _samples(n=3))
    data = json.loads((tmp_path / "index.json").read_text())
    data["values_checked"] = False  # e.g. made with `index --no-check-values`
    (tmp_path / "index.json").write_text(json.dumps(data))
    calls = []
    real = indexing_mod._index_one
    try:
        indexing_mod._index_one = lambda p, *a: calls.append(p) or real(p, *a)
        ShardIndex.for_paths(tmp_path, progress=False, check_values=False)
        assert calls == []
        ShardIndex.for_paths(tmp_path, progress=False, check_values=True)
        assert len(calls) == 1
    finally:
        indexing_mod._index_one = real


def test_expand_paths(tmp_path):
    _write(tmp_path, _samples(n=4), max_samples_per_shard=1)
    expected = [str(tmp_path / f"shard-{i:06d}.tar") for i in range(4)]
    assert expand_paths(tmp_path) == expected
    assert expand_paths(str(tmp_path / "shard-{000000..000003}.tar")) == expected
    assert expand_paths([expected[2], expected[0]]) == [expected[2], expected[0]]
    assert expand_paths("pipe:cat x.tar") == ["pipe:cat x.tar"]
    assert expand_paths(f"file://{expected[1]}") == [expected[1]]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards"):
        expand_paths(tmp_path / "empty")


def test_index_summaries(tmp_path):
    samples = _samples()
    index = _write(tmp_path, samples, max_samples_per_shard=3)
    assert index.num_samples == len(samples) and index.num_shards == 3
    assert index.sample_refs() == [(i // 3, i % 3) for i in range(len(samples))]
    assert index.latent_shape((1, 2)) == samples[5]["latent"].shape
    expected = sum(t * (h // 2) * (w // 2) for _, t, h, w in (s["latent"].shape for s in samples))
    assert index.total_tokens((1, 2, 2)) == expected
    assert index.counts() == {} and index.skipped() == []


# ------------------------------------------------------------------------------------------------
# Reading: selection, URLs
# ------------------------------------------------------------------------------------------------


def test_iter_shard_select_with_and_without_keys(tmp_path):
    samples = _samples()
    index = _write(tmp_path, samples)
    info = index.shards[0]
    for kwargs in ({}, {"keys": info.keys}):
        got = list(iter_shard(info.path, 5, select={1, 4, 6}, **kwargs))
        assert [g["__ref__"] for g in got] == [(5, 1), (5, 4), (5, 6)]
        for g, i in zip(got, (1, 4, 6)):
            _assert_same(g, samples[i])
    assert list(iter_shard(info, 0, select=set())) == []
    with pytest.raises(ValueError, match="sample ids up to 99"):
        list(iter_shard(info, 0, select={99}))


def test_iter_shard_select_skips_decoding_of_others(tmp_path, monkeypatch):
    index = _write(tmp_path, _samples())
    decoded = []
    real = reader_mod.to_tensor
    monkeypatch.setattr(reader_mod, "to_tensor", lambda npy: decoded.append(npy.member) or real(npy))
    list(iter_shard(index.shards[0], 0, select={2}))
    assert decoded == ["k002.latent.npy", "k002.text.npy"]


def test_iter_shard_reads_through_pipe_and_file_urls(tmp_path):
    samples = _samples()
    index = _write(tmp_path, samples)
    path = index.paths[0]
    for url in (f"pipe:cat {path}", f"file://{path}"):
        got = list(iter_shard(url, 0))
        assert len(got) == len(samples)
        for g, s in zip(got, samples):
            _assert_same(g, s)
        assert [g["__key__"] for g in iter_shard(url, 0, select={3})] == ["k003"]
    built = ShardIndex.build([f"pipe:cat {path}"], progress=False, patch_size=None)
    assert built.shards[0].keys == index.shards[0].keys
    assert built.shards[0].num_bytes == index.shards[0].num_bytes


@pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset's gopen needs curl for http")
@pytest.mark.timeout(60)
def test_http_shards_use_the_index_beside_them(tmp_path, monkeypatch):
    import functools
    import http.server
    import threading

    samples = _samples()
    written = _write(tmp_path, samples, max_samples_per_shard=4)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setattr(
            indexing_mod, "_index_one", lambda *a: pytest.fail("should use the remote index.json")
        )
        index = ShardIndex.for_paths(base + "/shard-{000000..000001}.tar", progress=False)
        assert index.paths == [f"{base}/shard-000000.tar", f"{base}/shard-000001.tar"]
        assert [s.keys for s in index.shards] == [s.keys for s in written.shards]
        got = _read_all(index)
        for g, s in zip(got, samples):
            _assert_same(g, s)
        assert [g["__key__"] for g in iter_shard(index.shards[1], 1, select={1})] == ["k005"]
    finally:
        server.shutdown()
        server.server_close()


def test_iter_shard_handles_fortran_and_big_endian_npy(tmp_path):
    a = np.asfortranarray(np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 2))
    b = np.arange(16, dtype=">f2").reshape(1, 1, 4, 4)
    with tarfile.open(tmp_path / "s.tar", "w") as tf:
        for key, arr in (("f", a), ("be", b)):
            buf = io.BytesIO()
            np.save(buf, arr)
            info = tarfile.TarInfo(f"{key}.latent.npy")
            info.size = len(buf.getvalue())
            tf.addfile(info, io.BytesIO(buf.getvalue()))
    got = {g["__key__"]: g["latent"] for g in iter_shard(tmp_path / "s.tar", 0, patch_size=None)}
    np.testing.assert_array_equal(got["f"].numpy(), a)
    np.testing.assert_array_equal(got["be"].numpy(), b.astype(np.float16))
    assert got["f"].is_contiguous()


# ------------------------------------------------------------------------------------------------
# Synthetic shards and mixes
# ------------------------------------------------------------------------------------------------


def test_synthetic_shards_are_deterministic_and_follow_the_mix(tmp_path):
    def write(folder, seed):
        settings = SyntheticShards(mix="tiny", num_samples=40, samples_per_shard=16, seed=seed)
        return write_synthetic_shards(tmp_path / folder, settings, progress=False)

    a, b, c = write("a", 3), write("b", 3), write("c", 4)
    assert [s.num_samples for s in a.shards] == [16, 16, 8]
    assert [_sha(p) for p in a.paths] == [_sha(p) for p in b.paths]
    assert [_sha(p) for p in a.paths] != [_sha(p) for p in c.paths]
    shapes = {b.latent_shape for b in load_mix("tiny").buckets}
    assert {s for info in a.shards for s in info.latent_shapes} <= shapes
    assert ShardIndex.build(tmp_path / "a", progress=False).to_dict()["shards"] == a.to_dict()["shards"]
    got = _read_all(a)
    assert all(g["latent"].dtype == torch.float16 for g in got)
    lengths = [0 if g["text"] is None else g["text"].shape[0] for g in got]
    assert min(lengths) >= 0 and max(lengths) <= 16 and len(set(lengths)) > 3
    assert all(g["text"] is None or g["text"].shape[1] == 32 for g in got)


def test_synthetic_shard_sizes_uneven_and_explicit(tmp_path):
    uneven = write_synthetic_shards(
        tmp_path / "u",
        settings=SyntheticShards(
            num_samples=60, samples_per_shard=10, uneven=True, seed=1, text_len_range=None
        ),
        progress=False,
    )
    sizes = [s.num_samples for s in uneven.shards]
    assert sum(sizes) == 60 and len(set(sizes)) > 1 and all(1 <= s <= 15 for s in sizes)
    assert all(t == 0 for s in uneven.shards for t in s.text_lengths)
    explicit = write_synthetic_shards(
        tmp_path / "e",
        settings=SyntheticShards(num_samples=6, samples_per_shard=[1, 5], dtype=torch.float32),
        progress=False,
    )
    assert [s.num_samples for s in explicit.shards] == [1, 5]
    assert _read_all(explicit)[0]["latent"].dtype == torch.float32
    with pytest.raises(ValueError, match="sum to num_samples"):
        write_synthetic_shards(
            tmp_path / "x", settings=SyntheticShards(num_samples=6, samples_per_shard=[1, 4]), progress=False
        )


def test_synthetic_shards_reuse_or_refuse_existing(tmp_path):
    first = write_synthetic_shards(
        tmp_path, settings=SyntheticShards(num_samples=8, samples_per_shard=4), progress=False
    )
    stamp = [os.stat(p).st_mtime_ns for p in first.paths]
    again = write_synthetic_shards(
        tmp_path, settings=SyntheticShards(num_samples=8, samples_per_shard=4), progress=False
    )
    assert again.to_dict() == first.to_dict()
    assert [os.stat(p).st_mtime_ns for p in first.paths] == stamp  # nothing rewritten
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_synthetic_shards(
            tmp_path, settings=SyntheticShards(num_samples=8, samples_per_shard=4, seed=1), progress=False
        )
    other = write_synthetic_shards(
        tmp_path,
        settings=SyntheticShards(num_samples=8, samples_per_shard=4, seed=1, overwrite=True),
        progress=False,
    )
    assert [_sha(p) for p in other.paths] != []


def test_mix_sampling_follows_probabilities():
    mix = load_mix("wan21_480p")
    n = 50_000
    draws = mix.sample_buckets(np.random.default_rng(0), n)
    freq = np.bincount(draws, minlength=len(mix.buckets)) / n
    p = mix.probabilities
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-12)


def test_packaged_mixes_load():
    assert {"tiny", "wan21_480p", "wan21_720p"} <= set(available_mixes())
    wan = load_mix("wan21_480p")
    assert (16, 21, 60, 104) in {b.latent_shape for b in wan.buckets}
    assert max(b.tokens for b in wan.buckets) == 32760
    tiny = load_mix("tiny")
    tokens = sorted(b.tokens_for((1, 2, 2)) for b in tiny.buckets)
    assert 10 <= tokens[0] and tokens[-1] <= 400
    assert "wan21_480p" in tiny.note
    assert abs(sum(b.p for b in tiny.buckets) - 1) < 1e-9


@pytest.mark.parametrize(
    "buckets, match",
    [
        ([{"latent_shape": [16, 1, 8, 12], "p": 0.5}], r"buckets\[\*\]\.p sums to 0.5"),
        ([{"latent_shape": [16, 1, 8], "p": 1.0}], r"buckets\[0\]\.latent_shape"),
        ([{"latent_shape": [16, 1, 8, 12], "p": 1.5}], r"buckets\[0\]\.p"),
        ([{"latent_shape": [16, 1, 8, 12], "p": 1.0, "tokens": 5}], r"buckets\[0\]\.tokens"),
        ([{"latent_shape": [16, 1, 7, 12], "p": 1.0}], "even"),
        ([], "non-empty"),
    ],
)
def test_load_mix_errors_name_file_and_key(tmp_path, buckets, match):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "buckets": buckets}))
    with pytest.raises(ValueError, match=match) as err:
        load_mix(path)
    assert str(path) in str(err.value)


def test_load_mix_accepts_rounding_and_rejects_unknown(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "buckets": [
                    {"latent_shape": [1, 1, 2, 2], "p": 0.3333334},
                    {"latent_shape": [1, 2, 2, 2], "p": 0.6666666},
                ]
            }
        )
    )
    assert load_mix(path).name == "m"
    with pytest.raises(FileNotFoundError, match="tiny"):
        load_mix("no_such_mix")


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------


def test_synth_and_index_commands(tmp_path, capsys):
    out = tmp_path / "data"
    assert (
        synth_main(
            [
                "--out",
                str(out),
                "--num-samples",
                "20",
                "--samples-per-shard",
                "8",
                "--seed",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "3 shards, 20 samples" in text and "16x9x8x12" in text and "total tokens" in text
    index = ShardIndex.load(out / "index.json")
    assert f"total tokens (patch (1, 2, 2)): {index.total_tokens()}" in text

    os.remove(out / "index.json")
    assert index_main([str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "3 shards, 20 samples" in text and "skipped by reason: none" in text
    assert ShardIndex.load(out / "index.json").to_dict()["shards"] == index.to_dict()["shards"]

    (out / "shard-000003.tar").write_bytes(b"")  # an empty shard: a warning, still exit 0
    assert index_main([str(out), "--no-progress", "--no-save"]) == 0
    assert "empty_shard=1" in capsys.readouterr().out
    assert index_main([str(out / "missing.tar"), "--no-progress"]) == 2
    assert "[missing_shard]" in capsys.readouterr().err
    assert index_main([str(out / "missing.tar"), "--no-progress", "--on-error", "skip", "--no-save"]) == 1
    assert "missing_shard=1" in capsys.readouterr().out
    assert synth_main(["--out", str(out), "--seed", "2", "--no-progress"]) == 2  # refuses to clobber

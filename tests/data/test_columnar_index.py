"""The binary columnar index (``index.npidx``) and ``CompactIndex``: lossless conversion, format
detection by magic bytes, checks of hostile files, the planner's array path, the convert command."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from _plan_cases import timeless_report

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.inputs import as_input, bucket_table, index_fingerprint
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.shards.columnar import MAGIC, is_binary_index, read_columns
from lightning_adaptiveload.shards.compact import CompactIndex, load_checked_compact, load_index
from lightning_adaptiveload.shards.format import ShardError, ShardInfo
from lightning_adaptiveload.shards.index import ShardIndex

SHAPES = [(16, 1, 8, 12), (16, 5, 8, 12), (16, 9, 12, 8), (16, 3, 8, 8)]


def _index(folder, n_shards=5, per_shard=7, seed=0) -> ShardIndex:
    rng = np.random.default_rng(seed)
    shards = []
    k = 0
    for s in range(n_shards):
        n = 0 if s == 2 else per_shard + s  # one empty shard
        keys = [f"clip_{k + i:09d}" for i in range(n)]
        k += n
        shapes = [SHAPES[int(x)] for x in rng.integers(0, len(SHAPES), n)]
        texts = [int(x) for x in rng.integers(0, 40, n)]
        shards.append(ShardInfo(str(folder / f"shard-{s:06d}.tar"), keys, shapes, texts, 1000 + s))
    shards[1].keys[0] = "clíp_ünïcode"  # non-ASCII keys take the byte path
    shards[3].skipped.append({"key": "bad_one", "reason": "non_finite", "detail": "NaN in latent"})
    shards[4].ignored["unknown_extension"] = 2
    return ShardIndex(
        shards, patch_size=(1, 2, 2), values_checked=True, metadata={"mix": "tiny", "n": [1, 2]}
    )


def test_json_binary_json_round_trip_is_lossless(tmp_path):
    index = _index(tmp_path)
    index.save(tmp_path / "index.json")
    binary = ShardIndex.load(tmp_path / "index.json").save(tmp_path / "index.npidx")
    assert is_binary_index(binary) and not is_binary_index(tmp_path / "index.json")
    back = ShardIndex.load(binary)
    assert back.to_dict() == index.to_dict()
    assert back.counts() == index.counts() and back.skipped() == index.skipped()
    back.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(
        (tmp_path / "index.json").read_text()
    )


def test_compact_index_answers_what_shard_index_does(tmp_path):
    index = _index(tmp_path)
    compact = load_index(index.save(tmp_path / "index.npidx"))
    assert isinstance(compact, CompactIndex)
    assert compact.num_samples == index.num_samples and compact.num_shards == index.num_shards
    assert compact.paths == index.paths
    assert compact.total_tokens((1, 2, 2)) == index.total_tokens((1, 2, 2))
    assert compact.counts() == index.counts() == {"non_finite": 1, "unknown_extension": 2, "empty_shard": 1}
    assert compact.skipped() == index.skipped()
    assert compact.sample_refs() == index.sample_refs()
    for ref in index.sample_refs():
        assert compact.latent_shape(ref) == index.latent_shape(ref)
        assert compact.key(ref) == index.shards[ref[0]].keys[ref[1]]
    assert [vars(s) for s in compact.shards] == [vars(s) for s in index.shards]
    assert compact.shape_table.tolist() == [list(s) for s in dict.fromkeys(
        sh for s in index.shards for sh in s.latent_shapes)]  # fmt: skip
    with pytest.raises(IndexError):
        compact.latent_shape((0, 99))


def test_format_is_told_by_magic_bytes_not_the_name(tmp_path):
    index = _index(tmp_path)
    index.save(tmp_path / "binary.json", format="binary")
    index.save(tmp_path / "text.npidx", format="json")
    assert (tmp_path / "binary.json").read_bytes().startswith(MAGIC)
    assert (tmp_path / "text.npidx").read_bytes().startswith(b"{")
    for name in ("binary.json", "text.npidx"):
        assert ShardIndex.load(tmp_path / name).to_dict() == index.to_dict()
        assert CompactIndex.load(tmp_path / name).to_shard_index().to_dict() == index.to_dict()
    assert isinstance(load_index(tmp_path / "binary.json"), CompactIndex)
    assert isinstance(load_index(tmp_path / "text.npidx"), ShardIndex)


def test_an_old_json_index_still_loads(tmp_path):
    old = {  # version 1 as written before the binary format existed
        "version": 1,
        "patch_size": [1, 2, 2],
        "values_checked": False,
        "metadata": {},
        "shards": [
            {"path": "a.tar", "num_samples": 2, "bytes": 10240, "keys": ["x0", "x1"],
             "latent_shapes": [[4, 1, 2, 2], [4, 3, 2, 2]], "text_lengths": [0, 5]},
        ],
    }  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps(old))
    index = ShardIndex.load(tmp_path / "index.json")
    assert index.shards[0].latent_shapes == [(4, 1, 2, 2), (4, 3, 2, 2)]
    compact = CompactIndex.load(tmp_path / "index.json")
    assert compact.key((0, 1)) == "x1" and compact.latent_shape((0, 1)) == (4, 3, 2, 2)


def test_fingerprint_releases_mapped_pages_as_it_goes(tmp_path, monkeypatch):
    """Issue 40: the fingerprint's pass over a 100M index's keys held all of their pages until its end."""
    from lightning_adaptiveload.planning import inputs

    index = _index(tmp_path)
    index.save(tmp_path / "index.npidx")
    compact = CompactIndex.load(tmp_path / "index.npidx")
    fp = index_fingerprint(compact)
    calls = []
    monkeypatch.setattr(inputs, "_FP_CHUNK", 2)
    monkeypatch.setattr(compact, "release_pages", lambda: calls.append(1), raising=False)
    assert index_fingerprint(compact) == fp and len(calls) > 2


def test_fingerprint_is_the_same_from_json_and_binary_and_sees_changes(tmp_path):
    index = _index(tmp_path)
    index.save(tmp_path / "index.json")
    index.save(tmp_path / "index.npidx")
    fp = index_fingerprint(ShardIndex.load(tmp_path / "index.json"))
    assert fp == index_fingerprint(CompactIndex.load(tmp_path / "index.npidx"))
    assert fp == index_fingerprint(ShardIndex.load(tmp_path / "index.npidx"))
    # shapes without keys: another fingerprint than with keys, the same from lists and arrays
    assert index_fingerprint([s.latent_shapes for s in index.shards]) != fp
    changed = _index(tmp_path)
    changed.shards[0].keys[3] = "clip_renamed"
    assert index_fingerprint(changed) != fp
    changed = _index(tmp_path)
    changed.shards[0].latent_shapes[3] = (16, 7, 8, 12)
    assert index_fingerprint(CompactIndex.from_shard_index(changed)) != fp


@pytest.mark.parametrize("mode", ["independent", "lockstep", "packed"])
def test_plan_from_binary_index_equals_plan_from_json(tmp_path, mode):
    index = _index(tmp_path, n_shards=9, per_shard=11)
    index.save(tmp_path / "index.json")
    index.save(tmp_path / "index.npidx")
    plans = []
    for loaded in (ShardIndex.load(tmp_path / "index.json"), CompactIndex.load(tmp_path / "index.npidx")):
        plan = plan_epoch(
            loaded, 2, 2, DualConstraintBatcher(400), seed=3, epoch=1, settings=PlanSettings(schedule=mode)
        )
        fields = vars(plan).copy()
        fields["report"] = timeless_report(plan.report)
        plans.append(fields)
    assert plans[0] == plans[1]


def test_bucket_table_from_arrays_equals_the_per_sample_loop(tmp_path):
    index = _index(tmp_path, n_shards=6, per_shard=9)
    compact = CompactIndex.from_shard_index(index)
    batcher = DualConstraintBatcher(150)  # (16, 9, 12, 8) has 216 tokens: oversize, skipped
    batcher.resolve_max_compute(SHAPES)
    sizer = batcher.sizer
    a = bucket_table(as_input(index), sizer, "skip")
    b = bucket_table(as_input(compact), sizer, "skip")
    assert a == b and a.oversize > 0
    with pytest.raises(ValueError, match=r"shard-0000\d\d.tar, key 'clip_"):
        bucket_table(as_input(compact), sizer, "raise")


def _rewrite_header(path, edit):
    raw = bytearray(path.read_bytes())
    _, version, n = struct.unpack("<8sII", raw[:16])
    head = json.loads(raw[16 : 16 + n])
    head["metadata"] = {}  # room for the edit: the header keeps its length
    edit(head)
    new = json.dumps(head, separators=(",", ":")).encode()
    assert len(new) <= n
    raw[16 : 16 + n] = new + b" " * (n - len(new))  # JSON allows trailing spaces: the layout stays
    path.write_bytes(bytes(raw))


def _array_at(path, name):
    raw = path.read_bytes()
    n = struct.unpack("<I", raw[12:16])[0]
    for row in json.loads(raw[16 : 16 + n])["arrays"]:
        if row[0] == name:
            return row
    raise KeyError(name)


def _poke(path, name, index, value):
    _, dtype, offset, _count = _array_at(path, name)
    dt = np.dtype(dtype)
    raw = bytearray(path.read_bytes())
    raw[offset + index * dt.itemsize : offset + (index + 1) * dt.itemsize] = np.array([value], dt).tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:40]), "header"),
        (lambda p: p.write_bytes(b"\x89ALIDX\r\n" + struct.pack("<II", 7, 2) + b"{}"), "version"),
        (lambda p: _poke(p, "shard_offsets", 2, 10**12), "shard_offsets[3]"),
        (lambda p: _poke(p, "key_offsets", 5, 3), "key_offsets[5]"),
        (lambda p: _poke(p, "shape_id", 4, 200), "shape_id[4]"),
        (lambda p: _poke(p, "shapes", 6, 0), "shapes[1]"),
        (lambda p: _poke(p, "shapes", 5, -5), "shapes[1]"),
        (lambda p: _poke(p, "text_len", 3, -1), "text_len[3]"),
        (lambda p: _poke(p, "shard_bytes", 0, -7), "shard_bytes"),
        (lambda p: _rewrite_header(p, lambda h: h["arrays"][8].__setitem__(3, 10**9)), "key_blob.offset"),
        (lambda p: _rewrite_header(p, lambda h: h["arrays"][5].__setitem__(1, "<f8")), "shape_id.dtype"),
        (lambda p: _rewrite_header(p, lambda h: h.__setitem__("num_samples", -1)), "num_samples"),
        (lambda p: _rewrite_header(p, lambda h: h.__setitem__("patch_size", [1, 0, 2])), "patch_size"),
        (lambda p: _rewrite_header(p, lambda h: h["arrays"].pop()), "arrays"),
    ],
)
def test_damaged_binary_index_names_the_field(tmp_path, damage, field):
    path = tmp_path / "index.npidx"
    _index(tmp_path).save(path)
    damage(path)
    with pytest.raises(ShardError) as err:
        CompactIndex.load(path)
    assert err.value.reason == "bad_index" and err.value.member == field, str(err.value)
    assert str(path) in str(err.value)


def test_shard_index_from_columns_is_the_compact_index_as_lists(tmp_path):
    index = _index(tmp_path)
    path = tmp_path / "index.npidx"
    index.save(path)
    columns = CompactIndex.load(path).columns
    expect = index.to_dict()
    assert ShardIndex.from_columns(columns, str(path)).to_dict() == expect == ShardIndex.load(path).to_dict()
    assert ShardIndex.from_columns(columns).source is None
    _, _, offset, _ = _array_at(path, "key_blob")
    raw = bytearray(path.read_bytes())
    raw[offset + 2] = ord("/")  # in the first key of shard 0
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shards\[0\].keys") as err:
        ShardIndex.from_columns(read_columns(str(path)), str(path))
    assert str(path) in str(err.value) and err.value.reason == "bad_index"


def test_bad_key_bytes_are_refused_when_the_shard_is_read(tmp_path):
    path = tmp_path / "index.npidx"
    _index(tmp_path).save(path)
    _, _, offset, _ = _array_at(path, "key_blob")
    raw = bytearray(path.read_bytes())
    raw[offset + 2] = ord("/")  # in the first key of shard 0
    path.write_bytes(bytes(raw))
    compact = CompactIndex.load(path)
    compact.shards[1]  # other shards read fine
    with pytest.raises(ShardError, match=r"shards\[0\].keys.*byte 0x2f"):
        compact.shards[0]
    with pytest.raises(ShardError, match="bad_index"):
        ShardIndex.load(path)


def test_shard_paths_of_a_binary_index_stay_in_its_folder(tmp_path):
    index = _index(tmp_path)
    index.shards[0].path = "/etc/passwd"
    index.save(tmp_path / "index.npidx")
    with pytest.raises(ShardError) as err:
        CompactIndex.load(tmp_path / "index.npidx")
    assert err.value.reason == "unsafe_index_path" and err.value.member == "shards[0].path"
    assert CompactIndex.load(tmp_path / "index.npidx", allow_outside=True).paths[0] == "/etc/passwd"


def test_load_checked_compact_refuses_stale_shards_and_recorded_skips(tmp_path):
    index = _index(tmp_path)
    index.shards[3].skipped.clear()
    for s in index.shards:
        with open(s.path, "wb") as f:
            f.write(b"\0" * s.num_bytes)
    path = index.save(tmp_path / "index.npidx")
    assert load_checked_compact(path).num_samples == index.num_samples
    with pytest.raises(ShardError, match="not divisible"):
        load_checked_compact(path, patch_size=(2, 2, 2))
    with open(index.shards[1].path, "ab") as f:
        f.write(b"more")
    with pytest.raises(ShardError) as err:
        load_checked_compact(path)
    assert err.value.reason == "stale_index" and err.value.shard == index.shards[1].path


def test_convert_index_command_both_ways(tmp_path, capsys):
    from lightning_adaptiveload.cli.data import convert_index_main

    index = _index(tmp_path)
    index.save(tmp_path / "index.json")
    assert convert_index_main([str(tmp_path / "index.json"), str(tmp_path / "out.bin"), "--no-progress"]) == 0
    assert is_binary_index(tmp_path / "out.bin")
    assert convert_index_main([str(tmp_path / "out.bin"), str(tmp_path / "back.json"), "--no-progress"]) == 0
    assert ShardIndex.load(tmp_path / "back.json").to_dict() == index.to_dict()
    assert "samples -> JSON index" in capsys.readouterr().out
    (tmp_path / "broken").write_bytes(MAGIC + b"\0" * 8)
    assert convert_index_main([str(tmp_path / "broken"), str(tmp_path / "x.json"), "--no-progress"]) == 2
    assert "bad_index" in capsys.readouterr().err


def test_read_columns_of_bytes_equals_mapped_file(tmp_path):
    path = _index(tmp_path).save(tmp_path / "index.npidx")
    a, b = read_columns(path), read_columns(path, open(path, "rb").read())
    assert (
        a.paths == b.paths
        and np.array_equal(a.key_blob, b.key_blob)
        and np.array_equal(a.shape_id, b.shape_id)
    )
    assert all(_array_at(tmp_path / "index.npidx", name)[2] % 64 == 0 for name in ("shape_id", "key_offsets"))


def test_for_paths_uses_a_binary_index_beside_the_shards(tmp_path, monkeypatch):
    from lightning_adaptiveload.shards import indexing as indexing_mod
    from lightning_adaptiveload.shards.writer import ShardWriter

    with ShardWriter(tmp_path, max_samples_per_shard=2) as w:
        for i in range(5):
            w.write(f"k{i}", np.ones((4, 1, 2, 2), np.float16))
    ShardIndex.load(tmp_path / "index.json").save(tmp_path / "index.npidx")
    (tmp_path / "index.json").unlink()
    calls = []
    real = indexing_mod._index_one
    monkeypatch.setattr(indexing_mod, "_index_one", lambda p, *a: calls.append(p) or real(p, *a))
    index = ShardIndex.for_paths(tmp_path, progress=False, check_values=False)
    assert index.num_samples == 5 and calls == []  # nothing re-read: the binary index covered the shards
    named = ShardIndex.for_paths(tmp_path / "index.npidx", progress=False, check_values=False)
    assert named.to_dict()["shards"] == index.to_dict()["shards"] and calls == []


def test_a_pickled_compact_index_maps_its_file_again(tmp_path):
    import pickle

    index = _index(tmp_path)
    compact = CompactIndex.load(index.save(tmp_path / "index.npidx"))
    data = pickle.dumps(compact)
    assert len(data) < 2000  # the file's name, not its arrays
    back = pickle.loads(data)
    assert back.to_shard_index().to_dict() == index.to_dict() and back.paths == compact.paths
    in_memory = CompactIndex.from_shard_index(index)  # not mapped: the arrays travel
    assert pickle.loads(pickle.dumps(in_memory)).to_shard_index().to_dict() == index.to_dict()
    _index(tmp_path, seed=1).save(tmp_path / "index.npidx")  # rewritten while in use
    os.utime(tmp_path / "index.npidx", ns=(1, 1))
    with pytest.raises(ShardError, match="changed after it was loaded"):
        pickle.loads(data)


def test_simulate_takes_a_binary_index_path_or_a_compact_index(tmp_path):
    from lightning_adaptiveload.planning.cost_model import CostModel
    from lightning_adaptiveload.tools.simulate import simulate
    from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

    index = _index(tmp_path, n_shards=8, per_shard=20)
    path = index.save(tmp_path / "index.npidx")
    cm = CostModel(kind="quadratic", alpha=1e-3, beta=1e-6)
    settings = SimulateSettings(world_sizes=[2], max_tokens=400, recommend=False)

    def comparable(rows):  # wall time aside; NaN (no figure) as None, so that equal rows compare equal
        out = []
        for r in rows:
            r = {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
            r["plan_report"] = timeless_report(r["plan_report"])
            out.append(r)
        return out

    rows = [
        comparable(simulate(src, settings, times=cm, progress=False).rows)
        for src in (index, path, CompactIndex.load(path))
    ]
    assert rows[0] == rows[1] == rows[2] and rows[0][0]["samples"] == index.num_samples


def test_bucket_table_of_a_compact_index_also_gives_the_ids_as_arrays(tmp_path):
    compact = CompactIndex.from_shard_index(_index(tmp_path))
    batcher = DualConstraintBatcher(400)
    batcher.resolve_max_compute(SHAPES)
    table = bucket_table(as_input(compact), batcher.sizer, "skip")
    flat = [b for row in table.bucket_of for b in row]
    assert table.bucket_ids.tolist() == flat and table.bucket_ids.dtype == np.int16
    assert table.shard_offsets.tolist() == np.cumsum([0] + [len(r) for r in table.bucket_of]).tolist()


@pytest.mark.parametrize("pad", range(0, 130, 13))
def test_header_lengths_across_alignment_boundaries_and_an_empty_index(tmp_path, pad):
    index = _index(tmp_path)
    index.metadata = {"pad": "x" * pad}  # moves the header's end across 64-byte boundaries
    path = index.save(tmp_path / "index.npidx")
    assert ShardIndex.load(path).to_dict() == index.to_dict()
    empty = ShardIndex([], metadata={"pad": "y" * pad})
    assert ShardIndex.load(empty.save(tmp_path / "empty.npidx")).to_dict() == empty.to_dict()
    assert index_fingerprint(CompactIndex.load(tmp_path / "empty.npidx")) == index_fingerprint(empty)


@pytest.mark.parametrize("mode", ["independent", "lockstep"])
def test_rank_local_plan_with_exclusions_from_binary_index_equals_plan_from_json(tmp_path, mode):
    """The array paths (bucket ids read from the binary columns, rank-local lockstep on arrays) with
    excluded samples and oversize ones plan as the per-shard lists of a JSON index."""
    index = _index(tmp_path, n_shards=9, per_shard=11)
    index.save(tmp_path / "index.json")
    index.save(tmp_path / "index.npidx")
    exclude = {(s, i) for s in range(0, 9, 2) for i in range(0, 11, 3)}
    plans = []
    for loaded in (ShardIndex.load(tmp_path / "index.json"), CompactIndex.load(tmp_path / "index.npidx")):
        batcher = DualConstraintBatcher(150, oversize="skip")  # (16, 9, 12, 8): 216 tokens, skipped
        plan = plan_epoch(
            loaded,
            3,
            2,
            batcher,
            seed=5,
            epoch=2,
            exclude=exclude,
            rank=1,
            settings=PlanSettings(schedule=mode),
        )
        fields = vars(plan).copy()
        fields["report"] = timeless_report(plan.report)
        plans.append(fields)
    assert plans[0]["report"]["excluded"] > 0 and plans[0]["report"]["skipped"]
    assert plans[0] == plans[1]

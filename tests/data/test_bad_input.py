"""Bad shards and untrusted files: every case raises a ShardError naming shard, key and problem, or, under
on_error="skip", is left out, counted by reason and logged. Nothing is unpickled, ever."""

from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import tarfile

import numpy as np
import pytest

from lightning_adaptiveload.shards.format import REASONS, ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.writer import ShardWriter

LOGGER = "lightning_adaptiveload.shards"  # parent of the shard I/O modules' loggers


def _npy(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def _latent(shape=(4, 1, 2, 2), dtype=np.float16, fill=None) -> np.ndarray:
    arr = np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)
    if fill is not None:
        arr.flat[1] = fill
    return arr


def _good(key: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.latent.npy", _npy(_latent())), (f"{key}.json", b'{"caption": "ok"}')]


def _make_tar(path, members, fmt=tarfile.USTAR_FORMAT) -> str:
    """A tar made with Python's tarfile, bypassing every check of ShardWriter."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            if data is None:
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


def _check_error(err: ShardError, shard: str, key: str | None, reason: str, words: str) -> None:
    message = str(err)
    assert err.shard == shard and err.key == key and err.reason == reason
    assert shard in message and words in message and f"[{reason}]" in message
    assert (repr(key) in message) if key is not None else ("whole shard" in message)
    assert "What to do:" in message and REASONS[reason] in message


# ------------------------------------------------------------------------------------------------
# Sample-level problems: one bad sample between two good ones
# ------------------------------------------------------------------------------------------------

TEXT = np.zeros((3, 8), np.float16)

SAMPLE_CASES = {
    "no latent, json only": ([("bad.json", b"{}")], "missing_latent", "no 'bad.latent.npy'"),
    "no latent, text only": ([("bad.text.npy", _npy(TEXT))], "missing_latent", "no 'bad.latent.npy'"),
    "latent with 3 dims": ([("bad.latent.npy", _npy(np.zeros((4, 2, 2), np.float16)))], "bad_ndim", "3 dims"),
    "latent with 5 dims": (
        [("bad.latent.npy", _npy(np.zeros((1, 4, 1, 2, 2), np.float16)))],
        "bad_ndim",
        "5 dims",
    ),
    "H not divisible": ([("bad.latent.npy", _npy(_latent((4, 1, 3, 2))))], "not_divisible", "H=3"),
    "W not divisible": ([("bad.latent.npy", _npy(_latent((4, 1, 2, 5))))], "not_divisible", "W=5"),
    "empty dimension": ([("bad.latent.npy", _npy(np.zeros((4, 0, 2, 2), np.float16)))], "bad_shape", "empty"),
    "int32 latent": ([("bad.latent.npy", _npy(np.zeros((4, 1, 2, 2), np.int32)))], "bad_dtype", "int32"),
    "uint8 latent": ([("bad.latent.npy", _npy(np.zeros((4, 1, 2, 2), np.uint8)))], "bad_dtype", "uint8"),
    "bool latent": ([("bad.latent.npy", _npy(np.zeros((4, 1, 2, 2), bool)))], "bad_dtype", "bool"),
    "float64 latent": (
        [("bad.latent.npy", _npy(np.zeros((4, 1, 2, 2), np.float64)))],
        "bad_dtype",
        "float64",
    ),
    "object latent": (
        [("bad.latent.npy", _npy(np.array([[[[1]]]], dtype=object), allow_pickle=True))],
        "bad_dtype",
        "pickle",
    ),
    "NaN in float16 latent": ([("bad.latent.npy", _npy(_latent(fill=np.nan)))], "non_finite", "NaN or Inf"),
    "Inf in float32 latent": (
        [("bad.latent.npy", _npy(_latent(dtype=np.float32, fill=-np.inf)))],
        "non_finite",
        "1 of 16 values",
    ),
    "NaN in text": (
        [("bad.latent.npy", _npy(_latent())), ("bad.text.npy", _npy(np.full((2, 3), np.nan, np.float32)))],
        "non_finite",
        "bad.text.npy",
    ),
    "text with 3 dims": (
        [("bad.latent.npy", _npy(_latent())), ("bad.text.npy", _npy(np.zeros((1, 2, 3), np.float16)))],
        "bad_ndim",
        "expected 2",
    ),
    "int text": (
        [("bad.latent.npy", _npy(_latent())), ("bad.text.npy", _npy(np.zeros((2, 3), np.int64)))],
        "bad_dtype",
        "int64",
    ),
    "json does not parse": (
        [("bad.latent.npy", _npy(_latent())), ("bad.json", b'{"caption": ')],
        "bad_json",
        "does not parse",
    ),
    "json not utf-8": (
        [("bad.latent.npy", _npy(_latent())), ("bad.json", b"\xff\xfe{}")],
        "bad_json",
        "parse",
    ),
    "json not an object": (
        [("bad.latent.npy", _npy(_latent())), ("bad.json", b"[1, 2]")],
        "bad_json",
        "not an object",
    ),
    "not an npy": ([("bad.latent.npy", b"hello, world")], "bad_npy", "magic"),
    "npy cut short": ([("bad.latent.npy", _npy(_latent())[:-2])], "bad_npy", "needs"),
    "member twice": (
        [("bad.latent.npy", _npy(_latent())), ("bad.latent.npy", _npy(_latent()))],
        "duplicate_key",
        "appears twice",
    ),
}


@pytest.fixture(params=sorted(SAMPLE_CASES), ids=lambda c: c.replace(" ", "_"))
def bad_sample_shard(request, tmp_path):
    members, reason, words = SAMPLE_CASES[request.param]
    path = _make_tar(tmp_path / "bad.tar", _good("good0") + members + _good("good1"))
    return path, reason, words, (1, 2, 2)


def test_bad_sample_raises_naming_shard_key_and_problem(bad_sample_shard):
    path, reason, words, patch = bad_sample_shard
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False, patch_size=patch)
    _check_error(err.value, path, "bad", reason, words)
    with pytest.raises(ShardError) as err:
        list(iter_shard(path, 0, patch_size=patch))
    _check_error(err.value, path, "bad", reason, words)


def test_bad_sample_is_skipped_counted_and_logged(bad_sample_shard, caplog):
    path, reason, words, patch = bad_sample_shard
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        index = ShardIndex.build(path, progress=False, patch_size=patch, on_error="skip")
    assert index.shards[0].keys == ["good0", "good1"]
    (skipped,) = index.skipped()
    assert (skipped["shard"], skipped["key"], skipped["reason"]) == (
        path,
        "bad",
        reason,
    ) and words in skipped["detail"]
    assert index.counts() == {reason: 1}
    assert any("'bad'" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    # the record survives a save/load: the planner never sees the sample
    index.save(os.path.join(os.path.dirname(path), "index.json"))
    assert ShardIndex.load(os.path.join(os.path.dirname(path), "index.json")).counts() == {reason: 1}

    stats: dict[str, int] = {}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = list(iter_shard(path, 0, on_error="skip", stats=stats, patch_size=patch))
    assert [(g["__key__"], g["__ref__"]) for g in got] == [("good0", (0, 0)), ("good1", (0, 1))]
    assert stats == {reason: 1}
    assert any("'bad'" in r.getMessage() for r in caplog.records)
    # with the index's keys the reader passes the sample over without reading or counting it again
    stats = {}
    got = list(iter_shard(index.shards[0], 0, on_error="raise", stats=stats, patch_size=patch))
    assert [g["__key__"] for g in got] == ["good0", "good1"] and stats == {}


def test_t_not_divisible_by_temporal_patch(tmp_path):
    good = [("good0.latent.npy", _npy(_latent((4, 2, 2, 2))))]
    path = _make_tar(tmp_path / "t.tar", good + [("bad.latent.npy", _npy(_latent((4, 3, 2, 2))))])
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False, patch_size=(2, 2, 2))
    _check_error(err.value, path, "bad", "not_divisible", "T=3")
    assert ShardIndex.build(path, progress=False, patch_size=(1, 2, 2)).num_samples == 2


def test_duplicate_key_within_a_shard(tmp_path):
    path = _make_tar(tmp_path / "d.tar", _good("a") + _good("b") + _good("a"))
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False)
    _check_error(err.value, path, "a", "duplicate_key", "appears again")
    index = ShardIndex.build(path, progress=False, on_error="skip")
    assert index.shards[0].keys == ["a", "b"] and index.counts() == {"duplicate_key": 1}
    stats: dict[str, int] = {}
    assert [g["__key__"] for g in iter_shard(path, 0, on_error="skip", stats=stats)] == ["a", "b"]
    assert stats == {"duplicate_key": 1}


def test_duplicate_key_across_shards(tmp_path):
    first = _make_tar(tmp_path / "a.tar", _good("x") + _good("y"))
    second = _make_tar(tmp_path / "b.tar", _good("y") + _good("z"))
    with pytest.raises(ShardError) as err:
        ShardIndex.build([first, second], progress=False)
    _check_error(err.value, second, "y", "duplicate_key", first)
    index = ShardIndex.build([first, second], progress=False, on_error="skip")
    assert [s.keys for s in index.shards] == [["x", "y"], ["z"]]
    assert index.skipped()[0]["shard"] == second and index.counts() == {"duplicate_key": 1}
    # the reader follows the index: sample 0 of shard 1 is "z"
    assert [g["__key__"] for g in iter_shard(index.shards[1], 1, select={0})] == ["z"]


# ------------------------------------------------------------------------------------------------
# Shard-level problems
# ------------------------------------------------------------------------------------------------


def test_missing_shard(tmp_path, caplog):
    good = _make_tar(tmp_path / "good.tar", _good("a"))
    missing = str(tmp_path / "missing.tar")
    with pytest.raises(ShardError) as err:
        ShardIndex.build([good, missing], progress=False)
    _check_error(err.value, missing, None, "missing_shard", "does not exist")
    with pytest.raises(ShardError) as err:
        ShardIndex.for_paths([good, missing], progress=False)
    _check_error(err.value, missing, None, "missing_shard", "does not exist")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        index = ShardIndex.build([good, missing], progress=False, on_error="skip")
    assert [s.num_samples for s in index.shards] == [1, 0]  # shard ids stay aligned with the paths
    assert index.counts() == {"missing_shard": 1}
    assert any("missing.tar" in r.getMessage() for r in caplog.records)
    with pytest.raises(ShardError, match="does not exist"):
        list(iter_shard(missing, 1))
    stats: dict[str, int] = {}
    assert list(iter_shard(missing, 1, on_error="skip", stats=stats)) == [] and stats == {"missing_shard": 1}


@pytest.mark.timeout(60)
def test_failing_pipe_is_unreadable_not_empty(tmp_path):
    url = f"pipe:cat {tmp_path / 'nope.tar'} 2>/dev/null"
    with pytest.raises(ShardError) as err:
        ShardIndex.build(url, progress=False)
    assert err.value.reason == "unreadable_shard" and err.value.shard == url
    index = ShardIndex.build(url, progress=False, on_error="skip")
    assert index.counts() == {"unreadable_shard": 1}
    stats: dict[str, int] = {}
    assert list(iter_shard(url, 0, on_error="skip", stats=stats)) == [] and stats == {"unreadable_shard": 1}


def test_stats_accumulate_over_shards(tmp_path):
    full, members = _three_sample_shard(tmp_path)
    cut = _cut(full, members[-1].offset_data + 3, tmp_path / "cut.tar")
    empty = _make_tar(tmp_path / "empty.tar", [])
    stats: dict[str, int] = {}
    for sid, path in enumerate([cut, empty, full]):
        list(iter_shard(path, sid, on_error="skip", stats=stats))
    assert stats == {"truncated_tar": 1, "empty_shard": 1}


@pytest.mark.parametrize("kind", ["no members", "zero bytes", "directory only"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_empty_shard_is_a_counted_warning(tmp_path, caplog, kind, on_error):
    path = str(tmp_path / "empty.tar")
    if kind == "zero bytes":
        open(path, "wb").close()
    else:
        _make_tar(path, [("somedir", None)] if kind == "directory only" else [])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        index = ShardIndex.build(path, progress=False, on_error=on_error)
    assert index.num_samples == 0 and index.shards[0].empty
    assert index.counts().get("empty_shard") == 1
    assert any("empty" in r.getMessage() for r in caplog.records)
    stats: dict[str, int] = {}
    assert list(iter_shard(path, 0, on_error=on_error, stats=stats)) == []
    assert stats.get("empty_shard") == 1


def _three_sample_shard(tmp_path) -> tuple[str, list[tarfile.TarInfo]]:
    path = _make_tar(tmp_path / "full.tar", _good("s0") + _good("s1") + _good("s2"))
    with tarfile.open(path) as tf:
        return path, tf.getmembers()


def _cut(path: str, size: int, out) -> str:
    with open(path, "rb") as f:
        data = f.read(size)
    with open(out, "wb") as f:
        f.write(data)
    return str(out)


@pytest.mark.parametrize(
    "where, kept",
    [
        ("inside the last member's data", ["s0", "s1"]),
        ("after the last member, no end marker", ["s0", "s1"]),
        ("inside a header", ["s0"]),
        ("inside the first header", []),
    ],
)
def test_truncated_tar(tmp_path, caplog, where, kept):
    full, members = _three_sample_shard(tmp_path)
    last = members[-1]
    size = {
        "inside the last member's data": last.offset_data + 3,
        "after the last member, no end marker": last.offset_data + 512,
        "inside a header": members[4].offset + 100,  # s2's first header
        "inside the first header": 300,
    }[where]
    path = _cut(full, size, tmp_path / "cut.tar")
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False)
    assert err.value.reason == "truncated_tar" and path in str(err.value)
    with pytest.raises(ShardError, match="truncated_tar"):
        list(iter_shard(path, 0))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        index = ShardIndex.build(path, progress=False, on_error="skip")
    assert index.shards[0].keys == kept
    assert index.counts() == {"truncated_tar": 1}
    assert any("truncated_tar" in r.getMessage() for r in caplog.records)
    stats: dict[str, int] = {}
    assert [g["__key__"] for g in iter_shard(path, 0, on_error="skip", stats=stats)] == kept
    assert stats == {"truncated_tar": 1}
    # following the index, reading stops before the cut
    assert [g["__key__"] for g in iter_shard(index.shards[0], 0)] == kept


def test_damage_after_indexing_is_reported_when_reading_by_index(tmp_path):
    full, members = _three_sample_shard(tmp_path)
    index = ShardIndex.build(full, progress=False)
    _cut(full, members[2].offset_data + 3, full)  # s1's latent is cut after the index was built
    info = index.shards[0]
    with pytest.raises(ShardError) as err:
        list(iter_shard(info, 0))
    assert (err.value.reason, err.value.key) == ("truncated_tar", "s1")
    stats: dict[str, int] = {}
    assert [g["__key__"] for g in iter_shard(info, 0, on_error="skip", stats=stats)] == ["s0"]
    assert stats == {"truncated_tar": 1, "stale_index": 1}
    # the cut lies in a sample the caller does not read: still reported, not hidden
    stats = {}
    assert [
        g["__key__"] for g in iter_shard(full, 0, select={2}, keys=info.keys, on_error="skip", stats=stats)
    ] == []
    assert stats == {"truncated_tar": 1, "stale_index": 1}


@pytest.mark.parametrize("kind", ["gzip", "garbage", "garbage after members"])
def test_corrupt_tar(tmp_path, kind):
    full, members = _three_sample_shard(tmp_path)
    path = str(tmp_path / "corrupt.tar")
    data = open(full, "rb").read()
    if kind == "gzip":
        data, words = gzip.compress(data), "compressed"
    elif kind == "garbage":
        data, words = b"A" * 2048, "not a tar file"
    else:
        end = members[-1].offset_data + 512
        data, words = data[:end] + b"B" * 1024, "invalid tar header"
    open(path, "wb").write(data)
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False)
    assert err.value.reason == "corrupt_tar" and words in str(err.value)
    index = ShardIndex.build(path, progress=False, on_error="skip")
    assert index.counts() == {"corrupt_tar": 1}
    assert index.shards[0].keys == (["s0", "s1"] if kind == "garbage after members" else [])


def test_unknown_extensions_and_odd_members_are_ignored_and_counted(tmp_path):
    members = (
        [("README", b"hi"), ("somedir", None)] + _good("a") + [("a.txt", b"x"), ("a.cls", b"3")] + _good("b")
    )
    path = _make_tar(tmp_path / "u.tar", members)
    index = ShardIndex.build(path, progress=False)  # no error under "raise"
    assert index.shards[0].keys == ["a", "b"]
    assert index.counts() == {"unknown_extension": 2, "non_file_member": 1, "bad_member_name": 1}
    stats: dict[str, int] = {}
    assert [g["__key__"] for g in iter_shard(path, 0, stats=stats)] == ["a", "b"]
    assert stats == {"unknown_extension": 2, "non_file_member": 1, "bad_member_name": 1}


def test_non_finite_values_are_caught_at_read_time(tmp_path):
    path = _make_tar(
        tmp_path / "n.tar", _good("a") + [("b.latent.npy", _npy(_latent(fill=np.inf)))] + _good("c")
    )
    index = ShardIndex.build(path, progress=False, check_values=False)  # headers only: NaN/Inf unseen
    assert index.shards[0].keys == ["a", "b", "c"] and not index.values_checked
    with pytest.raises(ShardError) as err:
        list(iter_shard(index.shards[0], 0))
    _check_error(err.value, path, "b", "non_finite", "NaN or Inf")
    stats: dict[str, int] = {}
    got = list(iter_shard(index.shards[0], 0, on_error="skip", stats=stats))
    assert [(g["__key__"], g["__ref__"]) for g in got] == [("a", (0, 0)), ("c", (0, 2))]
    assert stats == {"non_finite": 1}


def test_stale_index_keys(tmp_path):
    path = _make_tar(tmp_path / "s.tar", _good("a") + _good("b"))
    with pytest.raises(ShardError) as err:
        list(iter_shard(path, 0, keys=["a", "ghost", "b"]))
    _check_error(err.value, path, None, "stale_index", "ghost")
    stats: dict[str, int] = {}
    got = list(iter_shard(path, 0, keys=["a", "ghost", "b"], on_error="skip", stats=stats))
    assert [g["__ref__"] for g in got] == [(0, 0), (0, 2)] and stats == {"stale_index": 1}


def test_recorded_skips_raise_when_the_caller_asks_for_raise(tmp_path):
    path = _make_tar(
        tmp_path / "r.tar", _good("a") + [("b.latent.npy", _npy(np.zeros((4, 2, 2), np.float16)))]
    )
    ShardIndex.for_paths(path, progress=False, on_error="skip", save=True)
    assert os.path.exists(tmp_path / "index.json")
    with pytest.raises(ShardError) as err:
        ShardIndex.for_paths(path, progress=False)
    _check_error(err.value, path, "b", "bad_ndim", "recorded in the index")
    assert ShardIndex.for_paths(path, progress=False, on_error="skip").counts() == {"bad_ndim": 1}


def test_patch_check_applies_to_a_loaded_index(tmp_path):
    with ShardWriter(tmp_path) as w:  # the writer does not know the model's patch size
        w.write("a", _latent())
        w.write("odd", _latent((4, 1, 3, 2)))
    with pytest.raises(ShardError) as err:
        ShardIndex.for_paths(tmp_path, progress=False)
    _check_error(err.value, w.paths[0], "odd", "not_divisible", "H=3")
    skipped = ShardIndex.for_paths(tmp_path, progress=False, on_error="skip")
    assert skipped.shards[0].keys == ["a"] and skipped.counts() == {"not_divisible": 1}
    assert ShardIndex.for_paths(tmp_path, progress=False, patch_size=None).num_samples == 2


# ------------------------------------------------------------------------------------------------
# Untrusted files: pickles are refused, never loaded
# ------------------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this creates the marker file: proof that a pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture()
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_crafted_pickle_payloads_are_refused_not_run(tmp_path, no_unpickling):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(str(marker)))
    evil_npy = _npy(np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)
    members = (
        [("obj.latent.npy", evil_npy)]
        + _good("pyd")
        + [("pyd.cls.pyd", payload)]
        + _good("pth")
        + [("pth.state.pth", payload)]
        + [("pkl.latent.npy", _npy(_latent())), ("pkl.extra.pickle", payload)]
        + _good("clean")
    )
    path = _make_tar(tmp_path / "evil.tar", members)

    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False)
    _check_error(err.value, path, "obj", "bad_dtype", "pickled Python objects")
    only_pyd = _make_tar(tmp_path / "pyd.tar", _good("x") + [("x.cls.pyd", payload)])
    with pytest.raises(ShardError) as err:
        ShardIndex.build(only_pyd, progress=False)
    _check_error(err.value, only_pyd, "x", "pickle_member", "x.cls.pyd")
    with pytest.raises(ShardError, match="pickle_member"):
        list(iter_shard(only_pyd, 0))

    index = ShardIndex.build(path, progress=False, on_error="skip")
    assert index.shards[0].keys == ["pyd", "pth", "pkl", "clean"]
    assert index.counts() == {"bad_dtype": 1, "pickle_member": 3}
    stats: dict[str, int] = {}
    got = list(iter_shard(path, 0, on_error="skip", stats=stats))
    assert [g["__key__"] for g in got] == ["pyd", "pth", "pkl", "clean"]
    assert stats == {"bad_dtype": 1, "pickle_member": 3}
    assert all(set(g) == {"__key__", "__shard__", "__ref__", "latent", "text", "meta"} for g in got)
    assert not marker.exists()


def test_the_payload_is_live(tmp_path):
    """Guard against a vacuous test above: loading the payload does create the marker."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(str(marker)))).close()
    assert marker.exists()


# ------------------------------------------------------------------------------------------------
# The error type
# ------------------------------------------------------------------------------------------------


def test_shard_error_survives_pickling_and_dataloader_reraise():
    err = ShardError("/data/s.tar", "k1", "latent has 3 dims", reason="bad_ndim")
    again = pickle.loads(pickle.dumps(err))
    assert (again.shard, again.key, again.problem, again.reason, str(again)) == (
        err.shard,
        err.key,
        err.problem,
        err.reason,
        str(err),
    )
    # torch's DataLoader re-raises a worker's exception as type(exc)(formatted_message)
    assert str(ShardError(str(err))) == str(err)


def test_on_error_must_be_raise_or_skip(tmp_path):
    path = _make_tar(tmp_path / "g.tar", _good("a"))
    with pytest.raises(ValueError, match="on_error"):
        ShardIndex.build(path, progress=False, on_error="ignore")
    with pytest.raises(ValueError, match="on_error"):
        list(iter_shard(path, 0, on_error="warn"))

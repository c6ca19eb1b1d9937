"""Hostile shards and indexes (issue 21): each ends in a ShardError naming the shard, the member and the rule,
or a counted skip, within bounded memory; nothing runs, nothing outside the data's folder is opened."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tracemalloc

import numpy as np
import pytest

from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching
from lightning_adaptiveload.shards import untrusted
from lightning_adaptiveload.shards.format import REASONS, ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.writer import ShardWriter

LOGGER = "lightning_adaptiveload.shards"  # parent of the shard I/O modules' loggers
MiB = 1 << 20
GNU_TAR = shutil.which("tar")


# ------------------------------------------------------------------------------------------------
# Helpers: tars made byte by byte, bypassing every check of tarfile's writer
# ------------------------------------------------------------------------------------------------


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


GOOD_LATENT = _npy(np.ones((4, 1, 2, 2), np.float16))


def _checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % (sum(block) & 0o777777)


def _header(name: str, size: int, typeflag: bytes = b"0", fmt=tarfile.GNU_FORMAT) -> bytearray:
    """A 512-byte header; ``size`` may be anything (negative, huge: base-256)."""
    info = tarfile.TarInfo(name[:99])
    info.type = typeflag
    block = bytearray(info.tobuf(format=fmt)[:512])
    if 0 <= size < 8**11:
        block[124:136] = b"%011o\0" % size
    else:  # GNU base-256: 0x80 (positive) or 0xff (negative, two's complement) + 11 bytes
        n = size if size >= 0 else (1 << 96) + size
        block[124:136] = bytes([0x80 if size >= 0 else 0xFF]) + (n % (1 << 88)).to_bytes(11, "big")
    _checksum(block)
    return block


def _member(name: str, data: bytes, claimed: int | None = None, typeflag: bytes = b"0") -> bytes:
    size = len(data) if claimed is None else claimed
    pad = -len(data) % 512
    return bytes(_header(name, size, typeflag)) + data + b"\0" * pad


def _pax(records: dict[str, str], claimed: int | None = None) -> bytes:
    body = b""
    for k, v in records.items():
        rec = f" {k}={v}\n".encode()
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n = len(str(n)) + len(rec)
        body += str(n).encode() + rec
    return _member("././@PaxHeader", body, claimed, typeflag=b"x")


def _tar(tmp_path, name: str, *parts: bytes, end: bool = True) -> str:
    path = tmp_path / name
    path.write_bytes(b"".join(parts) + (b"\0" * 1024 if end else b""))
    return str(path)


def _good(key: str) -> bytes:
    return _member(f"{key}.latent.npy", GOOD_LATENT)


def _assert_names(err: ShardError, shard: str, member: str | None, reason: str, words: str = "") -> None:
    message = str(err)
    assert err.shard == shard and shard in message, message
    assert err.reason == reason and f"[{reason}]" in message and REASONS[reason] in message, message
    if member is not None:
        assert err.member == member and (member in message or repr(member) in message), message
    assert words in message, message


class _Peak:
    """Peak Python memory (tracemalloc) of the block, in bytes."""

    def __enter__(self):
        tracemalloc.start()
        return self

    def __exit__(self, *exc):
        self.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _refused(path: str, member: str | None, reason: str, words: str = "", **kwargs) -> None:
    """Index build and reader (file and pipe) raise naming shard, member and rule; skip mode counts it."""
    with _Peak() as mem:
        with pytest.raises(ShardError) as err:
            ShardIndex.build(path, progress=False, **kwargs)
        _assert_names(err.value, path, member, reason, words)
        with pytest.raises(ShardError) as err:
            list(iter_shard(path, 0, **kwargs))
        _assert_names(err.value, path, member, reason, words)
        with pytest.raises(ShardError) as err:
            list(iter_shard(f"pipe:cat {path}", 0, **kwargs))
        assert err.value.reason == reason and (member is None or err.value.member == member), str(err.value)
        index = ShardIndex.build(path, progress=False, on_error="skip", **kwargs)
        assert index.counts().get(reason) == 1, index.counts()
        stats: dict[str, int] = {}
        got = [s["__key__"] for s in iter_shard(path, 0, on_error="skip", stats=stats, **kwargs)]
        assert stats.get(reason) == 1, stats
        assert got == index.shards[0].keys
    assert mem.peak < 64 * MiB, f"peak {mem.peak / MiB:.0f} MiB"


# ------------------------------------------------------------------------------------------------
# 1. An index never runs a command nor names files outside its folder
# ------------------------------------------------------------------------------------------------


@pytest.fixture()
def dataset(tmp_path):
    d = tmp_path / "data"
    with ShardWriter(d, max_samples_per_shard=2) as w:
        for i in range(3):
            w.write(f"k{i}", np.ones((4, 1, 2, 2), np.float16))
    return d


def _edit_index(folder, **fields) -> str:
    path = folder / "index.json"
    data = json.loads(path.read_text())
    data["shards"][0].update(fields)
    # json.dumps writes inf as Infinity; a hostile file says 1e999
    path.write_text(json.dumps(data).replace("Infinity", "1e999"))
    return str(path)


def test_index_with_a_pipe_path_runs_nothing(dataset, tmp_path, caplog):
    marker = tmp_path / "ran"
    index = _edit_index(dataset, path=f"pipe:touch {marker}; cat {dataset}/shard-000000.tar")
    with pytest.raises(ShardError) as err:
        ShardIndex.load(index)
    _assert_names(err.value, index, "shards[0].path", "unsafe_index_path", "is a command (pipe:)")
    for opts in ({"allow_outside": True}, {"allow_schemes": ["https"]}):
        with pytest.raises(ShardError, match="unsafe_index_path"):
            ShardIndex.load(index, **opts)
    with pytest.raises(ValueError, match="never taken from an index"):
        ShardIndex.load(index, allow_schemes=["pipe"])
    with pytest.raises(ShardError, match="unsafe_index_path"):
        ShardIndex.for_paths(index, progress=False)
    # found beside the shards: ignored with a warning, the shards are indexed again
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rebuilt = ShardIndex.for_paths(dataset, progress=False)
    assert [k for s in rebuilt.shards for k in s.keys] == ["k0", "k1", "k2"]
    assert "unsafe_index_path" in caplog.text
    assert not marker.exists()


def test_datamodule_refuses_a_pipe_in_its_index_but_takes_one_it_was_given(dataset, tmp_path):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    marker = tmp_path / "ran"
    shard = f"{dataset}/shard-000000.tar"
    index = _edit_index(dataset, path=f"pipe:touch {marker}; cat {shard}")
    dm = AdaptiveLoadDataModule(
        train_shards=index,
        batching=Batching(max_tokens=64),
        loader=Loader(num_workers=0),
    )
    with pytest.raises(ShardError, match="unsafe_index_path"):
        dm.setup("fit")
    assert not marker.exists()
    # a pipe the user wrote is a source like any other
    dm = AdaptiveLoadDataModule(
        train_shards=[f"pipe:cat {shard}"],
        batching=Batching(max_tokens=64),
        loader=Loader(num_workers=0),
    )
    dm.setup("fit")
    assert dm.train_index.shards[0].keys == ["k0", "k1"]


@pytest.mark.parametrize(
    "path, words",
    [
        ("../../etc/passwd", "climbs out of"),
        ("/etc/passwd", "is an absolute path outside"),
        ("file:///etc/passwd", "is an absolute path outside"),
        ("https://evil.example/x.tar", "allow_schemes=['https']"),
        ("s3://bucket/x.tar", "allow_schemes=['s3']"),
        ("https://h/x'$(touch pwned)'.tar", "unsafe in a URL"),
        ("https://h/x[1-999999999].tar", "unsafe in a URL"),
    ],
)
def test_index_paths_stay_in_the_index_folder_unless_allowed(dataset, path, words):
    index = _edit_index(dataset, path=path)
    with pytest.raises(ShardError) as err:
        ShardIndex.load(index)
    _assert_names(err.value, index, "shards[0].path", "unsafe_index_path", words)


def test_index_options_widen_what_it_may_name(dataset, tmp_path):
    outside = tmp_path / "elsewhere.tar"
    shutil.copy(dataset / "shard-000000.tar", outside)
    index = _edit_index(dataset, path=str(outside))
    assert ShardIndex.load(index, allow_outside=True).paths[0] == str(outside)
    index = _edit_index(dataset, path="../elsewhere.tar")
    assert ShardIndex.load(index, allow_outside=True).paths[0] == str(outside)
    index = _edit_index(dataset, path="https://cdn.example/d/x.tar")
    assert ShardIndex.load(index, allow_schemes=["https"]).paths[0] == "https://cdn.example/d/x.tar"
    index = _edit_index(dataset, path="sub/../shard-000000.tar")  # stays inside: fine without options
    assert ShardIndex.load(index).paths[0] == str(dataset / "shard-000000.tar")


def test_saving_an_index_that_names_shards_elsewhere_warns(dataset, tmp_path, caplog):
    index = ShardIndex.load(dataset / "index.json")
    (tmp_path / "other").mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        index.save(tmp_path / "other" / "elsewhere.json")
    assert "allow_outside=True" in caplog.text
    assert ShardIndex.load(tmp_path / "other" / "elsewhere.json", allow_outside=True).paths == index.paths


@pytest.mark.parametrize(
    "value, ok",
    [
        ("shard-1.tar", "https://h/d/shard-1.tar"),
        ("sub/shard-1.tar", "https://h/d/sub/shard-1.tar"),
        ("https://h/d/shard-1.tar", "https://h/d/shard-1.tar"),
        ("../x.tar", None),
        ("https://h/d/../x.tar", None),
        ("https://h/dd/x.tar", None),
        ("/etc/passwd", None),
        ("pipe:cat x", None),
    ],
)
def test_remote_index_names_urls_under_its_folder_only(value, ok):
    if ok is not None:
        assert untrusted.check_index_path(value, "https://h/d/") == ok
    else:
        with pytest.raises(untrusted.Refused) as err:
            untrusted.check_index_path(value, "https://h/d/")
        assert err.value.reason == "unsafe_index_path"


def test_a_fifo_or_device_is_not_read(tmp_path):
    fifo = tmp_path / "f.tar"
    os.mkfifo(fifo)
    with pytest.raises(ShardError) as err:
        list(iter_shard(str(fifo), 0))  # would block for ever on open() without a writer
    _assert_names(err.value, str(fifo), None, "unreadable_shard", "not a regular file")
    with pytest.raises(ShardError, match="not a regular file"):
        ShardIndex.build("/dev/zero", progress=False)


# ------------------------------------------------------------------------------------------------
# 2. No allocation from a size the file claims
# ------------------------------------------------------------------------------------------------


def test_small_tar_claiming_3_gib_fails_fast_in_bounded_memory(tmp_path):
    path = _tar(tmp_path, "claim.tar", _good("a"), _member("b.latent.npy", GOOD_LATENT, claimed=3 << 30))
    assert os.path.getsize(path) < 4096
    _refused(path, "b.latent.npy", "member_too_large", "max_member_bytes=1073741824")
    # with the cap raised, the claim is checked against what the file holds
    with _Peak() as mem:
        with pytest.raises(ShardError) as err:
            list(iter_shard(path, 0, max_member_bytes=8 << 30))
        _assert_names(err.value, path, "b.latent.npy", "truncated_tar", "the file ends")
        with pytest.raises(ShardError) as err:  # a stream: read in bounded chunks until it ends
            list(iter_shard(f"pipe:cat {path}", 0, max_member_bytes=8 << 30))
        assert err.value.reason == "truncated_tar" and err.value.key == "b"
    assert mem.peak < 64 * MiB


@pytest.mark.parametrize("claimed", [8 << 30, 1 << 80])
def test_base256_sizes_beyond_the_file(tmp_path, claimed):
    path = _tar(tmp_path, "big.tar", _good("a"), _member("b.json", b"{}", claimed=claimed))
    _refused(path, "b.json", "member_too_large")


def test_cap_is_settable_and_applies_to_every_read_member(tmp_path):
    path = _tar(tmp_path, "s.tar", _good("a"))
    with pytest.raises(ShardError) as err:
        list(iter_shard(path, 0, max_member_bytes=100))
    _assert_names(err.value, path, "a.latent.npy", "member_too_large", "max_member_bytes=100")
    assert len(list(iter_shard(path, 0, max_member_bytes=len(GOOD_LATENT)))) == 1


def test_oversized_json_member_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(untrusted, "MAX_JSON_BYTES", 1000)
    path = _tar(tmp_path, "j.tar", _good("a"), _good("b"), _member("b.json", b" " * 2000 + b"{}"))
    _refused(path, "b.json", "bad_json", "more than the 1000 allowed")


@pytest.mark.parametrize(
    "part, words",
    [
        (_pax({"path": "x"}, claimed=3 << 30), "claims 3221225472 bytes"),
        (_member("././@LongLink", b"a" * 100, claimed=3 << 30, typeflag=b"L"), "long-name header"),
        (b"".join(_pax({"comment": str(i)}) for i in range(20)) + _good("z"), "in a row"),
        (_member("neg.latent.npy", b"", claimed=-512), "negative size"),
        (_pax({"size": "-1024"}) + _good("p"), "has size -1024"),
    ],
    ids=["pax_3gib", "longname_3gib", "pax_chain", "negative_size", "pax_negative_size"],
)
def test_hostile_tar_headers_are_corrupt_tar(tmp_path, part, words):
    # tar damage ends the scan; the sample open at that point ("b") may have lost members: left out too
    path = _tar(tmp_path, "h.tar", _good("a"), _good("b"), part, _good("c"))
    with _Peak() as mem:
        with pytest.raises(ShardError) as err:
            ShardIndex.build(path, progress=False)
        _assert_names(err.value, path, None, "corrupt_tar", words)
        with pytest.raises(ShardError, match="corrupt_tar"):
            list(iter_shard(f"pipe:cat {path}", 0))
        index = ShardIndex.build(path, progress=False, on_error="skip")
        assert index.shards[0].keys == ["a"] and index.counts() == {"corrupt_tar": 1}
    assert mem.peak < 64 * MiB


def test_lone_zero_block_cannot_hide_members(tmp_path):
    path = _tar(tmp_path, "z.tar", _good("a"), b"\0" * 512, _good("hidden"))
    with pytest.raises(ShardError) as err:
        ShardIndex.build(path, progress=False)
    _assert_names(err.value, path, None, "corrupt_tar", "lone zero block")


def test_odd_members_are_ignored_not_followed(tmp_path):
    inner = _tar(tmp_path, "inner.tar", _good("x"))
    parts = [
        _good("a"),
        _member("a.sym", b"", typeflag=tarfile.SYMTYPE),
        _member("a.dev", b"", typeflag=tarfile.CHRTYPE),
        _member("a.fifo", b"", typeflag=tarfile.FIFOTYPE),
        _member("a.tar", open(inner, "rb").read()),
        _good("b"),
    ]
    path = _tar(tmp_path, "o.tar", *parts)
    index = ShardIndex.build(path, progress=False)
    assert index.shards[0].keys == ["a", "b"]
    assert index.counts() == {"non_file_member": 3, "unknown_extension": 1}


# ------------------------------------------------------------------------------------------------
# 3. Parser errors become ShardErrors
# ------------------------------------------------------------------------------------------------


def _npy_with_header(header: str, data: bytes = b"") -> bytes:
    raw = header.encode("latin-1")
    return b"\x93NUMPY\x01\x00" + len(raw).to_bytes(2, "little") + raw + data


@pytest.mark.parametrize(
    "header, words",
    [
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (4, 1, 2, 2), ", "cut short"),
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (" + "-" * 3000 + "1,)}", "unexpected character"),
        (
            "{'descr': '<f2', 'fortran_order': False, 'shape': " + "(" * 3000 + ")" * 3000 + "}",
            "nests deeper",
        ),
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (4, -1, 2, 2)}", "negative dimension"),
        ("{'descr': '<f2', 'fortran_order': 0, 'shape': (4, 1, 2, 2)}", "fortran_order is 0"),
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (4, 1, 2, 2), 'x': 1}", "header keys"),
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (1 << 64, 2)}", "unexpected character"),
        (
            "{'descr': '<f2', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296, 2)}",
            "needs",
        ),
        ("__import__('os').system('touch pwned')", "unexpected character"),
        ("[" * 9 + "]" * 9, "nests deeper"),
        ("{'descr': '<f2', 'fortran_order': False, 'shape': (" + "9" * 40 + ",)}", "unexpected character"),
    ],
    ids=[
        "no_closing_brace",
        "nested_signs",
        "nested_parens",
        "negative_dim",
        "fortran_not_bool",
        "extra_key",
        "expression",
        "shape_product_overflow",
        "code",
        "deep_list",
        "huge_int",
    ],
)
def test_hostile_npy_headers_are_bad_npy(tmp_path, header, words):
    path = _tar(tmp_path, "n.tar", _good("a"), _member("b.latent.npy", _npy_with_header(header)), _good("c"))
    _refused(path, "b.latent.npy", "bad_npy", words)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


@pytest.mark.parametrize(
    "descr, words",
    [
        ("[('a', '<f4'), ('b', '|O')]", "structured dtype"),
        ("'<M8[ns]'", "'<M8[ns]' is not float16"),
        ("'>f8'", "dtype >f8 is not float16"),
        ("'|O'", "pickle"),
    ],
)
def test_npy_descr_strings_are_bad_dtype(tmp_path, descr, words):
    header = "{'descr': " + descr + ", 'fortran_order': False, 'shape': (4, 1, 2, 2)}"
    path = _tar(tmp_path, "d.tar", _good("a"), _member("b.latent.npy", _npy_with_header(header, b"\0" * 128)))
    _refused(path, "b.latent.npy", "bad_dtype", words)


def test_fortran_and_big_endian_npy_still_read(tmp_path):
    arr = np.arange(16, dtype=">f4").reshape(1, 4, 2, 2)
    path = _tar(tmp_path, "f.tar", _member("a.latent.npy", _npy(np.asfortranarray(arr))))
    (got,) = iter_shard(path, 0)
    assert got["latent"].numpy().tolist() == arr.astype(np.float32).tolist()


@pytest.mark.parametrize(
    "doc, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nests 5000 levels"),
        (b'{"x": NaN}', "NaN is not a JSON number"),
        (b'{"x": 1e999}', "out of range"),
        (b'{"x": ' + b"9" * 5000 + b"}", "does not parse"),
        (b'{"s": "' + b'\\"' * 3000 + b"[" * 200, "does not parse"),
        (b"[1, 2]", "not an object"),
        (b'"text"', "not an object"),
    ],
    ids=["deep_arrays", "deep_objects", "nan", "huge_float", "huge_int", "open_string", "list", "string"],
)
def test_hostile_json_members_are_bad_json(tmp_path, doc, words):
    path = _tar(tmp_path, "j.tar", _good("a"), _good("b"), _member("b.json", doc), _good("c"))
    _refused(path, "b.json", "bad_json", words)


# A valid index entry, then one field replaced: every wrong value is a bad_index naming the field.
INDEX_CASES = {
    "bytes_1e999": ({"bytes": 1e999}, "shards[0].bytes"),
    "bytes_float": ({"bytes": 20480.0}, "shards[0].bytes"),
    "bytes_string": ({"bytes": "20480"}, "shards[0].bytes"),
    "skipped_int": ({"skipped": 5}, "shards[0].skipped"),
    "skipped_bad_entry": ({"skipped": [{"key": 3, "reason": "x"}]}, "shards[0].skipped[0]"),
    "skipped_unknown_reason": ({"skipped": [{"key": "k9", "reason": "zzz"}]}, "shards[0].skipped[0]"),
    "ignored_list": ({"ignored": [1]}, "shards[0].ignored"),
    "keys_dict": ({"keys": {"a": 1}}, "shards[0].keys"),
    "num_samples_bool": ({"num_samples": True}, "shards[0].num_samples"),
    "shape_nan": ({"latent_shapes": [[4, 1, 2, 2], [4, "NaN", 2, 2]]}, "shards[0].latent_shapes[1]"),
    "shape_negative": ({"latent_shapes": [[4, 1, 2, 2], [4, -1, 2, 2]]}, "shards[0].latent_shapes[1]"),
    "shape_huge": ({"latent_shapes": [[4, 1, 2, 2], [4, 10**40, 2, 2]]}, "shards[0].latent_shapes[1]"),
    "text_lengths_short": ({"text_lengths": [0]}, "shards[0].text_lengths"),
    "path_int": ({"path": 7}, "shards[0].path"),
    "path_nul": ({"path": "a\x00.tar"}, "shards[0].path"),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_index_values_are_named_and_for_paths_rebuilds(dataset, case, caplog):
    fields, member = INDEX_CASES[case]
    index = _edit_index(dataset, **fields)
    with pytest.raises(ShardError) as err:
        ShardIndex.load(index)
    _assert_names(err.value, index, member, "bad_index")
    with pytest.raises(ShardError, match="bad_index"):
        ShardIndex.for_paths(index, progress=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rebuilt = ShardIndex.for_paths(dataset, progress=False)
    assert [k for s in rebuilt.shards for k in s.keys] == ["k0", "k1", "k2"]
    assert "bad_index" in caplog.text


@pytest.mark.parametrize(
    "text, words",
    [
        ("[" * 50_000 + "]" * 50_000, "nests 50000 levels"),
        ('{"version": 1, "shards": [], "x": NaN}', "NaN"),
        ("[1, 2, 3]", "'shards' list"),
        ('{"version": 1e999, "shards": []}', "version inf is not supported"),
        ('{"version": 1, "shards": [], "patch_size": [1, 2]}', "patch_size"),
        ('{"version": 1, "shards": [], "metadata": "x"}', "metadata"),
        ('{"version": 1, "shards": [], "values_checked": "yes"}', "values_checked"),
        ('{"version": 1, "shards": [' + "5," * 100_000 + "5]}", "shards[0]"),
    ],
)
def test_hostile_index_documents_are_bad_index(tmp_path, text, words):
    (tmp_path / "index.json").write_text(text)
    with _Peak() as mem:
        with pytest.raises(ShardError) as err:
            ShardIndex.load(tmp_path / "index.json")
    _assert_names(err.value, str(tmp_path / "index.json"), None, "bad_index", words)
    assert mem.peak < 64 * MiB


def test_index_larger_than_the_cap_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(untrusted, "MAX_INDEX_BYTES", 100)
    (tmp_path / "index.json").write_text('{"version": 1, "shards": []}' + " " * 200)
    with pytest.raises(ShardError, match="larger than max_index_bytes=100"):
        ShardIndex.load(tmp_path / "index.json")


# ------------------------------------------------------------------------------------------------
# 4. Member names follow the writer's key rules
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, words",
    [
        ("../../evil.latent.npy", "climbs out of its folder with '..'"),
        ("/tmp/evil.latent.npy", "is an absolute path"),
        ("dir/evil.latent.npy", "has a path component"),
        ("__meta__.latent.npy", "starts with '__'"),
        ("bad\x01key.latent.npy", "control character U+0001"),
    ],
)
def test_member_names_with_paths_break_the_key_rules(tmp_path, name, words):
    path = _tar(tmp_path, "k.tar", _good("a"), _member(name, GOOD_LATENT), _good("c"))
    cwd_before = set(os.listdir(tmp_path))
    _refused(path, name, "bad_key", words)
    assert set(os.listdir(tmp_path)) == cwd_before  # nothing extracted anywhere


def test_writer_and_reader_share_the_key_rules(tmp_path):
    for key in ("a.b", "../x", "/abs", "a/b", "", "__k", "tab\tkey"):
        with ShardWriter(tmp_path / "w", overwrite=True) as w:
            with pytest.raises(ValueError) as err:
                w.write(key, np.ones((4, 1, 2, 2), np.float16))
            assert untrusted.key_problem(key) in str(err.value)
            w.write("ok", np.ones((4, 1, 2, 2), np.float16))
    assert "keys cannot contain dots" in untrusted.key_problem("a.b")
    assert untrusted.key_problem("clip_0001-v2") is None


# ------------------------------------------------------------------------------------------------
# 5. GNU sparse members
# ------------------------------------------------------------------------------------------------


def _old_gnu_sparse(name: str, data: bytes, realsize: int) -> bytes:
    block = _header(name, len(data), typeflag=tarfile.GNUTYPE_SPARSE)
    block[386:398] = b"%011o\0" % 0  # one sparse struct: data at offset 0 ...
    block[398:410] = b"%011o\0" % len(data)  # ... of len(data) bytes; the rest is a hole
    block[482] = 0  # not extended
    block[483:495] = b"%011o\0" % realsize
    _checksum(block)
    return bytes(block) + data + b"\0" * (-len(data) % 512)


def test_gnu_sparse_member_is_named_as_such(tmp_path):
    sparse = _old_gnu_sparse("b.latent.npy", GOOD_LATENT, realsize=1 << 20)
    path = _tar(tmp_path, "sp.tar", _good("a"), sparse, _good("c"))
    _refused(path, "b.latent.npy", "sparse_member", "GNU sparse")


@pytest.mark.skipif(GNU_TAR is None, reason="GNU tar not installed")
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_gnu_tar_sparse_file_is_named_as_such(tmp_path, fmt):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "b.latent.npy", "wb") as f:
        f.write(GOOD_LATENT)
        f.seek(4 << 20)  # a hole, then data
        f.write(b"x" * 512)
    (src / "a.latent.npy").write_bytes(GOOD_LATENT)
    shard = tmp_path / "sp.tar"
    subprocess.run(
        [
            GNU_TAR,
            "--sparse",
            f"--format={fmt}",
            "-cf",
            str(shard),
            "-C",
            str(src),
            "a.latent.npy",
            "b.latent.npy",
        ],
        check=True,
    )
    with pytest.raises(ShardError) as err:
        ShardIndex.build(str(shard), progress=False)
    assert err.value.reason == "sparse_member" and err.value.member == "b.latent.npy", str(err.value)
    index = ShardIndex.build(str(shard), progress=False, on_error="skip")
    assert index.shards[0].keys == ["a"] and index.counts() == {"sparse_member": 1}


# ------------------------------------------------------------------------------------------------
# The bounded parsers against references
# ------------------------------------------------------------------------------------------------


def _depth(obj) -> int:
    if isinstance(obj, list):
        return 1 + max((_depth(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((_depth(x) for x in obj.values()), default=0)
    return 0


def test_json_depth_ignores_brackets_and_escapes_inside_strings():
    import random

    rng = random.Random(0)
    tricky = ["[", "]", "{", '\\"', '"', "\\", "\\\\", "\n", "é", "x"]

    def gen(level: int):
        r = rng.random()
        if level > 80 or r < 0.3:
            return "".join(rng.choice(tricky) for _ in range(rng.randrange(6)))
        if r < 0.65:
            return [gen(level + 1) for _ in range(rng.randrange(4))]
        return {
            "".join(rng.choice(tricky) for _ in range(3)): gen(level + 1) for _ in range(rng.randrange(3))
        }

    for _ in range(2000):
        obj = gen(0)
        raw = json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
        got = untrusted.json_depth(raw)
        # exact above the cap; below it an upper bound that stays under the cap is enough
        assert got == _depth(obj) or (_depth(obj) <= got <= untrusted.MAX_JSON_DEPTH), raw[:120]


def test_npy_header_parser_agrees_with_numpy_on_what_numpy_writes():
    for arr in (
        np.zeros((4, 1, 2, 2), np.float16),
        np.zeros((3,), ">f4"),
        np.zeros((), np.float32),
        np.asfortranarray(np.zeros((2, 3), np.float64)),
        np.zeros((2, 2), [("a", "<f4"), ("b", "<i2", (2,))]),
    ):
        raw = _npy(arr)
        header_len = int.from_bytes(raw[8:10], "little")
        dtype, descr, fortran, shape = untrusted.parse_npy_header(raw[10 : 10 + header_len], 1)
        assert shape == arr.shape and fortran == (arr.flags.f_contiguous and not arr.flags.c_contiguous)
        assert (
            (dtype == arr.dtype) if arr.dtype.fields is None else (dtype is None and isinstance(descr, list))
        )

"""The fast parse of fetched ranges (``shards/plain_tar.py``) against ``tarfile``.

The property: wherever :func:`plain_members` accepts bytes, it gives exactly the members ``tarfile`` (with
the library's checks) reads from them, and the ranged read yields the same samples or the same refusal as
with the fast parse switched off. Checked on the library's own shards, on tars ``tarfile`` writes in its
other forms, and on thousands of seeded mutations of real ranges.
"""

from __future__ import annotations

import io
import random
import tarfile

import numpy as np
import pytest

from lightning_adaptiveload.shards import scan
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.plain_tar import plain_members
from lightning_adaptiveload.shards.reader import iter_range
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards
from lightning_adaptiveload.shards.untrusted import CheckedTarInfo


def _tarfile_members(data: bytes) -> list[tuple] | None:
    """What tarfile reads: every member's (name, size, offset, offset_data, type), or None when it stops
    before the end of the bytes or fails."""
    try:
        tf = tarfile.open(fileobj=io.BytesIO(bytes(data) + b"\0" * 1024), mode="r:", tarinfo=CheckedTarInfo)
        out = []
        while (info := tf.next()) is not None:
            out.append((info.name, info.size, info.offset, info.offset_data, info.type))
        return out if tf.offset == len(data) else None
    except Exception:  # noqa: BLE001 - any failure: tarfile does not read these bytes as plain members
        return None


def _fast(data: bytes) -> list[tuple] | None:
    got = plain_members(data)
    return None if got is None else [(i.name, i.size, i.offset, i.offset_data, i.type) for i in got]


def _tar(
    members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, kind: bytes = tarfile.REGTYPE
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.type = len(data), kind
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    # without the end-of-archive blocks and the record padding: a fetched range holds members only
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        end = max(m.offset_data + -(-m.size // 512) * 512 for m in tf.getmembers())
    return raw[:end]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardIndex:
    folder = tmp_path_factory.mktemp("plain")
    write_synthetic_shards(
        str(folder),
        settings=SyntheticShards(mix="tiny", num_samples=24, samples_per_shard=[12, 12], seed=5),
        progress=False,
    )
    return ShardIndex.load(str(folder / "index.json"))


def test_the_librarys_shards_parse_as_tarfile_reads_them(shards):
    for info in shards.shards:
        with open(info.path, "rb") as f:
            raw = f.read()
        for start, length in info.spans:
            data = raw[start : start + length]
            fast = _fast(data)
            assert fast is not None, "a span of the library's own shard must take the fast parse"
            # offsets are relative to the fetched bytes
            assert fast == _tarfile_members(data)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tarfiles_plain_forms_match_and_long_names_join_the_prefix(fmt):
    long = "d" * 90 + "/" + "e" * 60 + "/sample.latent.npy"  # over 100 bytes: ustar splits it into a prefix
    members = [("a.latent.npy", b"x" * 700), ("a.json", b"{}"), (long, b"y" * 1024), ("b.text.npy", b"")]
    data = _tar(members, fmt)
    fast, ref = _fast(data), _tarfile_members(data)
    assert ref is not None
    if fmt == tarfile.USTAR_FORMAT:
        assert fast == ref and fast[2][0] == long
    else:  # GNU writes a long-name header, pax an extended header: both declined, tarfile reads them
        assert fast is None


@pytest.mark.parametrize(
    "bytes_of",
    [
        pytest.param(lambda: b"", id="empty"),
        pytest.param(lambda: _tar([("a.latent.npy", b"x" * 10)])[:-1], id="cut-member"),
        pytest.param(lambda: _tar([("a.latent.npy", b"x" * 10)]) + b"\0" * 512, id="trailing-zero-block"),
        pytest.param(lambda: _tar([("a.latent.npy", b"x" * 10)], kind=tarfile.SYMTYPE), id="symlink"),
        pytest.param(lambda: _tar([("a/", b"")], kind=tarfile.DIRTYPE), id="directory"),
        pytest.param(lambda: _tar([("\u00e9t\u00e9.latent.npy", b"x")]), id="pax-non-ascii-name"),
        pytest.param(lambda: _dir_as_areg(), id="old-style-directory"),
    ],
)
def test_anything_but_plain_members_is_declined(bytes_of):
    assert plain_members(bytes_of()) is None


def _dir_as_areg() -> bytes:
    header = bytearray(tarfile.TarInfo("old/").tobuf(tarfile.USTAR_FORMAT))
    header[156:157] = b"\0"
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % (sum(header))
    return bytes(header)


def _bad_checksum() -> bytes:
    data = bytearray(_tar([("a.latent.npy", b"x" * 10)], tarfile.USTAR_FORMAT))
    data[0] ^= 1  # the name changes, the checksum does not
    return bytes(data)


def test_a_bad_checksum_and_base256_sizes_are_declined():
    assert plain_members(_bad_checksum()) is None
    data = bytearray(_tar([("a.latent.npy", b"x" * 10)], tarfile.USTAR_FORMAT))
    data[124:136] = b"\x80" + b"\0" * 10 + b"\x0a"  # base-256 size 10: tarfile reads it, the fast parse not
    data[148:156] = b"        "
    data[148:156] = b"%06o\0 " % sum(data[:512])
    assert _tarfile_members(bytes(data)) is not None
    assert plain_members(bytes(data)) is None


def test_seeded_header_mutations_are_either_declined_or_read_as_tarfile_reads_them(shards):
    info = shards.shards[0]
    with open(info.path, "rb") as f:
        raw = f.read()
    rng = random.Random(11)
    accepted = declined = 0
    for case in range(3000):
        start, length = info.spans[rng.randrange(len(info.spans))]
        data = bytearray(raw[start : start + length])
        headers = [i.offset for i in plain_members(bytes(data))]
        at = rng.choice(headers)
        for _ in range(rng.randint(1, 3)):
            pos = at + rng.choice([rng.randrange(512), *range(100, 156), 156])
            data[pos] = rng.choice([rng.randrange(256), 0, 32, ord("0"), ord("7"), ord("8")])
        if rng.random() < 0.5:  # keep the checksum right, so that the fields themselves are tried
            data[at + 148 : at + 156] = b"        "
            data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])
        fast = _fast(bytes(data))
        if fast is None:
            declined += 1
            continue
        accepted += 1
        assert fast == _tarfile_members(bytes(data)), f"case {case}: the fast parse and tarfile differ"
    assert accepted > 100 and declined > 100  # both sides of the property were exercised


def _outcome(info, shard_id, ids, data):
    try:
        got = list(iter_range(info, shard_id, ids, data, "bytes x-y"))
    except ShardError as err:
        return ("error", err.reason, str(err))
    return [
        (
            s["__key__"],
            s["latent"].numpy().tobytes(),
            None if s["text"] is None else s["text"].numpy().tobytes(),
            s["meta"],
        )
        for s in got
    ]


def test_ranged_reads_of_mutated_bytes_end_as_without_the_fast_parse(shards, monkeypatch):
    info = shards.shards[1]
    with open(info.path, "rb") as f:
        raw = f.read()
    rng = random.Random(3)
    differing = 0
    for case in range(400):
        k = rng.randrange(len(info.spans) - 1)
        start = info.spans[k][0]
        end = info.spans[k + 1][0] + info.spans[k + 1][1]
        data = bytearray(raw[start:end])
        for _ in range(rng.randint(0, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        fast = _outcome(info, 1, [k, k + 1], bytes(data))
        with monkeypatch.context() as m:
            m.setattr(scan, "plain_members", lambda _data: None)
            slow = _outcome(info, 1, [k, k + 1], bytes(data))
        assert fast == slow, f"case {case}"
        differing += fast != _outcome(info, 1, [k, k + 1], raw[start:end])
    assert differing > 50  # the mutations did damage samples: the comparison was not of clean bytes only


def test_a_mutated_latent_is_still_refused_through_the_fast_parse(shards):
    info = shards.shards[0]
    with open(info.path, "rb") as f:
        raw = f.read()
    start, length = info.spans[0]
    data = bytearray(raw[start : start + length])
    members = plain_members(bytes(data))
    latent = next(m for m in members if m.name.endswith(".latent.npy"))
    # the last two bytes of the latent's data: a float16 NaN
    end = latent.offset_data + latent.size
    data[end - 2 : end] = np.array([np.nan], dtype=np.float16).tobytes()
    assert plain_members(bytes(data)) is not None
    with pytest.raises(ShardError) as err:
        list(iter_range(info, 0, [0], bytes(data), "bytes 0-1"))
    assert err.value.reason == "non_finite"

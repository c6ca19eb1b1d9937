"""Fuzzing the shard reader and the index loader with hostile mutations of valid files (issue 21).

Thousands of deterministic cases (a fixed seed per case; a failure names its family and case number):
bit flips, truncations, tar header fields (sizes octal/base-256/negative, types, names, checksums),
inserted pax/GNU long-name/zero blocks, duplicated members, rewritten ``.npy`` headers and ``.json``
members (nesting, huge numbers, NaN, non-objects, bad UTF-8), and ``index.json`` values (wrong types,
missing fields, huge lists, deep nesting, hostile paths). The properties:

- only the documented errors: ``ShardError`` with a reason of ``REASONS`` under ``on_error="raise"``,
  nothing at all under ``on_error="skip"``;
- no file opened outside the test's folder (an audit hook watches ``open`` and ``subprocess``);
- bounded peak memory (tracemalloc, on every 4th case: tracing every allocation triples the run time).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import subprocess
import sys
import tracemalloc

import _paths
import numpy as np
import pytest

from lightning_adaptiveload.shards.format import REASONS, ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.writer import ShardWriter

MiB = 1 << 20
REPO = str(_paths.ROOT)

# ------------------------------------------------------------------------------------------------
# The watch: an audit hook (it cannot be removed, so it only records while a fuzz test runs)
# ------------------------------------------------------------------------------------------------

_WATCH: dict = {"on": False, "root": "", "pipes": False, "seen": []}
_ALLOWED_READS = tuple(
    {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, REPO)} | {"/dev/null"}
)


def _audit(event: str, args: tuple) -> None:
    if not _WATCH["on"]:
        return
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, str | bytes):
            return  # an fd
        path = os.path.realpath(os.fsdecode(path))
        if path.startswith(_WATCH["root"]):
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        if writes or not path.startswith(_ALLOWED_READS):
            _WATCH["seen"].append(("open", path, mode))
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn"):
        if not _WATCH["pipes"]:
            _WATCH["seen"].append((event, repr(args)[:200]))


sys.addaudithook(_audit)


class _Memory:
    """Peak traced memory over the cases it measures."""

    def __init__(self) -> None:
        self.peak = 0
        self.cases = 0

    def measure(self, case: int):
        return _Traced(self) if case % 4 == 0 else _Untraced()


class _Traced:
    def __init__(self, memory: _Memory) -> None:
        self.memory = memory

    def __enter__(self):
        tracemalloc.start()

    def __exit__(self, *exc):
        self.memory.peak = max(self.memory.peak, tracemalloc.get_traced_memory()[1])
        self.memory.cases += 1
        tracemalloc.stop()


class _Untraced:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


@pytest.fixture()
def watch(tmp_path):
    data_log = logging.getLogger("lightning_adaptiveload.shards")  # the shard I/O modules log under it
    level = data_log.level
    data_log.setLevel(logging.ERROR)  # thousands of skip warnings
    _WATCH.update(on=True, root=os.path.realpath(tmp_path), pipes=False, seen=[], memory=_Memory())
    try:
        yield _WATCH
    finally:
        _WATCH["on"] = False
        data_log.setLevel(level)
    memory = _WATCH["memory"]
    assert not _WATCH["seen"], f"touched outside the test folder: {_WATCH['seen'][:5]}"
    assert memory.cases > 100 and memory.peak < 64 * MiB, f"peak traced memory {memory.peak / MiB:.0f} MiB"


# ------------------------------------------------------------------------------------------------
# Building blocks: raw tar members (any claimed size, any name), valid seeds
# ------------------------------------------------------------------------------------------------


def _checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % (sum(block) & 0o777777)


def _header(name: bytes, size: int, typeflag: bytes = b"0") -> bytearray:
    block = bytearray(512)
    block[0:100] = name[:100].ljust(100, b"\0")
    block[100:108] = b"0000644\0"
    block[108:124] = b"0000000\0" * 2
    block[136:148] = b"00000000000\0"
    block[156:157] = typeflag[:1] or b"0"
    block[257:265] = b"ustar  \0"
    _set_size(block, size)
    _checksum(block)
    return block


def _set_size(block: bytearray, size: int) -> None:
    if 0 <= size < 8**11:
        block[124:136] = b"%011o\0" % size
    else:  # GNU base-256
        n = size if size >= 0 else (1 << 96) + size
        block[124:136] = bytes([0x80 if size >= 0 else 0xFF]) + (n % (1 << 88)).to_bytes(11, "big")


def _member(name: bytes, data: bytes, claimed: int | None = None, typeflag: bytes = b"0") -> bytes:
    block = _header(name, len(data) if claimed is None else claimed, typeflag)
    return bytes(block) + data + b"\0" * (-len(data) % 512)


def _pax(records: list[tuple[str, str]]) -> bytes:
    body = b""
    for k, v in records:
        rec = f" {k}={v}\n".encode("utf-8", "surrogateescape")
        n = len(rec) + 1
        while len(str(n)) + len(rec) != n:
            n = len(str(n)) + len(rec)
        body += str(n).encode() + rec
    return _member(b"././@PaxHeader", body, typeflag=b"x")


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _seed_members(rng: random.Random) -> list[tuple[bytes, bytes]]:
    """A valid sample list: latents (float16/32, C- and Fortran-order), text, json."""
    out = []
    for i in range(3):
        key = f"s{i}".encode()
        dt = np.float16 if i % 2 else np.float32
        lat = np.arange(4 * 2 * 2 * 2, dtype=dt).reshape(4, 2, 2, 2) / 7
        out.append((key + b".latent.npy", _npy(np.asfortranarray(lat) if i == 2 else lat)))
        if i != 1:
            out.append((key + b".text.npy", _npy(np.ones((3, 5), dt))))
        out.append((key + b".json", json.dumps({"caption": f"clip {i}", "fps": 24}).encode()))
    return out


def _serialize(members: list[tuple[bytes, bytes]], end: bool = True) -> bytes:
    return b"".join(_member(n, d) for n, d in members) + (b"\0" * 1024 if end else b"")


# ------------------------------------------------------------------------------------------------
# Mutators
# ------------------------------------------------------------------------------------------------

HOSTILE_NAMES = [
    b"../../evil.latent.npy",
    b"/tmp/evil.latent.npy",
    b"./s0.latent.npy",
    b"dir/s0.latent.npy",
    b"s0",
    b".latent.npy",
    b"__key__.latent.npy",
    b"s0.LATENT.NPY",
    b"s0.state.pth",
    b"s0.latent.npy.pyd",
    b"\xff\xfe.latent.npy",
    b"a\x01b.json",
    b"s1.latent.npy",  # a duplicate key elsewhere
    b"x" * 100,
]
TYPEFLAGS = b"0123456789LKxgSXVMNAZ\0"
NPY_TEMPLATES = [
    "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }",
    "{'shape': %s, 'descr': '%s', 'fortran_order': %s}",
]
DESCRS = ["<f2", "<f4", ">f4", "|O", "<i4", "<f8", "<M8[ns]", "|V8", "<U4", "f2", "=f4", "<f2,<f2", "'"]
JSON_ATOMS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "9" * 5000,
    "0.1",
    "null",
    "true",
    '"\\ud800"',
    '"x"',
    "[]",
    "{}",
    '"\\u0000"',
]
PATHS = [
    "../../etc/passwd",
    "/etc/passwd",
    "/dev/zero",
    "file:///etc/passwd",
    "pipe:touch PWNED; cat shard-000000.tar",
    "PIPE:cat shard-000000.tar",
    "https://example.invalid/x.tar",
    "s3://bucket/x.tar",
    "https://h/x'$(touch PWNED)'.tar",
    "a\x00b.tar",
    "~/x.tar",
    "shard-000001.tar",
    "sub/../shard-000000.tar",
    "",
    "x" * 5000,
]


def _random_int(rng: random.Random) -> int:
    return rng.choice(
        [0, 1, -1, -512, 511, 512, 1 << 31, 1 << 33, 3 << 30, 1 << 63, 1 << 80, rng.randrange(1 << 20)]
    )


def _nest(rng: random.Random, depth: int) -> str:
    opener = rng.choice(["[", "(", "{'a': "])
    closer = {"[": "]", "(": ")", "{'a': ": "}"}[opener]
    return opener * depth + "1" + closer * depth


def _npy_header(rng: random.Random) -> str:
    shape = rng.choice(
        [
            "(4, 2, 2, 2)",
            "(4, 2, 2)",
            "(4, -2, 2, 2)",
            "(4294967296, 4294967296, 4294967296, 4294967296)",
            "()",
            "(0, 2, 2, 2)",
            "(" + "1, " * rng.randrange(60, 80) + ")",
            "(" + "-" * rng.randrange(1, 5000) + "1,)",
            _nest(rng, rng.randrange(1, 3000)),
            f"({_random_int(rng)}, 2, 2, 2)",
            "[4, 2, 2, 2]",
            "(4, 2, 2, 2",
            "(True, 2, 2, 2)",
        ]
    )
    fortran = rng.choice(["False", "True", "0", "None", "'no'"])
    descr = rng.choice(DESCRS)
    template = rng.choice(NPY_TEMPLATES)
    text = template % (
        (descr, fortran, shape) if template.startswith("{'descr'") else (shape, descr, fortran)
    )
    for _ in range(rng.choice([0, 0, 1, 3])):  # character edits
        pos = rng.randrange(len(text) + 1)
        text = (
            text[:pos]
            + rng.choice(["", "{", "}", "(", ")", ",", ":", "'", '"', "\\", "\n", "é"])
            + text[pos + 1 :]
        )
    return text


def _npy_member(rng: random.Random, data: bytes) -> bytes:
    header = _npy_header(rng).encode("utf-8")
    major = rng.choice([1, 1, 2, 3, 9])
    size_field = len(header) if rng.random() < 0.8 else _random_int(rng) % (1 << 32)
    length = (
        size_field.to_bytes(2 if major == 1 else 4, "little", signed=False)
        if size_field < (1 << (16 if major == 1 else 32))
        else b"\xff\xff"
    )
    return b"\x93NUMPY" + bytes([major, 0]) + length + header + data[rng.randrange(len(data) + 1) :]


def _json_member(rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        depth = rng.choice([10, 63, 64, 65, 1000, 60_000])
        return (
            (rng.choice(["[", '{"a":']) * depth).encode()
            + b"1"
            + (b"]" * depth if rng.random() < 0.5 else b"")
        )
    if kind == 1:
        return ('{"x": ' + rng.choice(JSON_ATOMS) + "}").encode()
    if kind == 2:
        return rng.choice(JSON_ATOMS).encode()
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if kind == 4:
        return ('{"s": "' + "\\" * rng.randrange(1, 2000) + '"' * rng.randrange(3) + "[" * 100).encode()
    if kind == 5:
        return b'{"caption": "\xff\xfe"}'
    doc = json.dumps({"caption": "ok", "list": list(range(rng.randrange(50)))}).encode()
    return doc[: rng.randrange(len(doc) + 1)]


def mutate_shard(rng: random.Random) -> bytes:
    """A valid shard, changed at the member level and/or the byte level."""
    members = _seed_members(rng)
    parts: list[bytes] = []
    for name, data in members:
        r = rng.random()
        if r < 0.08:
            name = rng.choice(HOSTILE_NAMES)
        if name.endswith(b".npy") and rng.random() < 0.25:
            data = _npy_member(rng, data)
        elif name.endswith(b".json") and rng.random() < 0.3:
            data = _json_member(rng)
        claimed = _random_int(rng) if rng.random() < 0.05 else None
        typeflag = bytes([rng.choice(TYPEFLAGS)]) if rng.random() < 0.04 else b"0"
        if rng.random() < 0.05:
            parts.append(
                _pax(
                    rng.sample(
                        [
                            ("path", rng.choice(HOSTILE_NAMES).decode("utf-8", "surrogateescape")),
                            ("size", str(_random_int(rng))),
                            ("GNU.sparse.map", "0,1,x"),
                            ("GNU.sparse.size", str(_random_int(rng))),
                            ("GNU.sparse.major", "1"),
                            ("GNU.sparse.minor", "0"),
                            ("GNU.sparse.realsize", str(_random_int(rng))),
                            ("hdrcharset", "BINARY"),
                        ],
                        rng.randrange(1, 4),
                    )
                )
            )
        if rng.random() < 0.03:
            parts.append(_member(b"././@LongLink", rng.choice(HOSTILE_NAMES) + b"\0", typeflag=b"L"))
        if rng.random() < 0.02:
            parts.append(b"\0" * 512)
        parts.append(_member(name, data, claimed, typeflag))
        if rng.random() < 0.03:
            parts.append(parts[-1])  # a duplicated member
    raw = bytearray(b"".join(parts) + b"\0" * 1024)
    for _ in range(rng.choice([0, 0, 1, 2, 8])):  # byte-level damage
        if len(raw) < 512:
            break
        op = rng.randrange(4)
        if op == 0:  # bit flips
            pos = rng.randrange(len(raw))
            raw[pos] ^= 1 << rng.randrange(8)
        elif op == 1:  # a header field rewritten, checksum fixed
            block = rng.randrange(len(raw) // 512) * 512
            header = raw[block : block + 512]
            field = rng.choice([(124, 136), (156, 157), (0, 100), (257, 265), (345, 500), (100, 108)])
            header[field[0] : field[1]] = bytes(rng.randrange(256) for _ in range(field[1] - field[0]))
            if field == (124, 136) and rng.random() < 0.7:
                _set_size(header, _random_int(rng))
            _checksum(header)
            raw[block : block + 512] = header
        elif op == 2:  # truncation
            del raw[rng.randrange(len(raw)) :]
        else:  # a block-aligned range duplicated elsewhere
            a = rng.randrange(max(1, len(raw) // 512)) * 512
            b = rng.randrange(max(1, len(raw) // 512)) * 512
            raw[b:b] = raw[a : a + 512 * rng.randrange(1, 4)]
    return bytes(raw)


def _check_reads(path: str, rng: random.Random, seen: set[str]) -> None:
    for call in (
        lambda: ShardIndex.build(path, progress=False, patch_size=None),
        lambda: list(iter_shard(path, 0, patch_size=None)),
    ):
        try:
            call()
        except ShardError as err:
            assert err.reason in REASONS, str(err)
    ShardIndex.build(path, progress=False, on_error="skip", patch_size=None, check_values=rng.random() < 0.5)
    stats: dict[str, int] = {}
    list(iter_shard(path, 0, on_error="skip", stats=stats, patch_size=None, select=None))
    assert set(stats) <= set(REASONS), stats
    seen.update(stats)


SHARD_CASES = 2000
# The mutators must reach every layer: tar headers, member names, sizes, npy headers, json, arrays.
REACHED = {
    "bad_npy",
    "bad_json",
    "bad_key",
    "bad_dtype",
    "bad_ndim",
    "corrupt_tar",
    "truncated_tar",
    "member_too_large",
    "sparse_member",
    "duplicate_key",
    "pickle_member",
    "missing_latent",
    "non_file_member",
}


@pytest.mark.timeout(240)
def test_fuzz_shards_raise_only_shard_errors(tmp_path, watch):
    path = str(tmp_path / "fuzz.tar")
    seen: set[str] = set()
    for case in range(SHARD_CASES):
        rng = random.Random(case)
        data = mutate_shard(rng)
        with open(path, "wb") as f:
            f.write(data)
        try:
            with watch["memory"].measure(case):
                _check_reads(path, rng, seen)
            if case % 100 == 0:  # the stream reader too (a pipe we write)
                watch["pipes"] = True
                try:
                    for on_error in ("raise", "skip"):
                        try:
                            list(iter_shard(f"pipe:cat {path}", 0, on_error=on_error, patch_size=None))
                        except ShardError as err:
                            assert on_error == "raise" and err.reason in REASONS, str(err)
                finally:
                    watch["pipes"] = False
        except Exception as err:
            raise AssertionError(f"shard case {case}: {type(err).__name__}: {err}") from err
    assert REACHED <= seen, f"mutations never reached {REACHED - seen}"


# ------------------------------------------------------------------------------------------------
# Indexes
# ------------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, tmp: str):
    kind = rng.randrange(9)
    if kind == 0:
        return _random_int(rng)
    if kind == 1:
        return rng.choice([True, False, None, 1.5, -0.0])
    if kind == 2:
        return rng.choice(PATHS).replace("PWNED", os.path.join(tmp, "PWNED"))
    if kind == 3:
        return [rng.choice([5, "k", None, [1, 2, 3, 4]])] * rng.choice([1, 4, 1000, 20_000])
    if kind == 4:
        return {"key": rng.choice([None, 3, "k"]), "reason": rng.choice(["non_finite", "zzz", 5])}
    if kind == 5:
        return [[4, 2, 2, 2]] * rng.randrange(5)
    if kind == 6:
        return {}
    if kind == 7:
        return "\x00\x01"
    return _RAW  # replaced in the text by a raw token


_RAW = "__RAW_TOKEN__"


def mutate_index(rng: random.Random, base: dict, tmp: str) -> bytes:
    data = json.loads(json.dumps(base))
    for _ in range(rng.choice([1, 1, 2, 4])):
        target = data
        path = []
        # walk a random way down the structure, then replace, delete or add there
        while isinstance(target, dict | list) and target and rng.random() < 0.7:
            k = rng.choice(list(target)) if isinstance(target, dict) else rng.randrange(len(target))
            if not isinstance(target[k], dict | list):
                break
            path.append(k)
            target = target[k]
        if isinstance(target, dict):
            k = rng.choice(list(target) + ["path", "bytes", "skipped", "extra"]) if target else "x"
            if rng.random() < 0.2:
                target.pop(k, None)
            else:
                target[k] = _random_value(rng, tmp)
        elif isinstance(target, list) and target:
            target[rng.randrange(len(target))] = _random_value(rng, tmp)
    text = json.dumps(data, allow_nan=True)
    text = text.replace(f'"{_RAW}"', rng.choice(["1e999", "NaN", "-Infinity", "9" * 5000, "[" * 5000]))
    raw = bytearray(text.encode())
    r = rng.random() if raw else 1.0
    if r < 0.1:
        del raw[rng.randrange(len(raw)) :]
    elif r < 0.2:
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif r < 0.25:
        raw = bytearray(b"[" * rng.choice([10, 100, 20_000]) + raw)
    return bytes(raw)


INDEX_CASES = 800


@pytest.mark.timeout(240)
def test_fuzz_indexes_raise_only_shard_errors(tmp_path, watch):
    folder = tmp_path / "data"
    with ShardWriter(folder, max_samples_per_shard=2) as w:
        for i in range(3):
            w.write(f"k{i}", np.ones((4, 1, 2, 2), np.float16), meta={"i": i})
    index_path = folder / "index.json"
    base = json.loads(index_path.read_text())
    for case in range(INDEX_CASES):
        rng = random.Random(10**6 + case)
        index_path.write_bytes(mutate_index(rng, base, str(tmp_path)))
        try:
            with watch["memory"].measure(case):
                _check_index(index_path, folder, case)
        except Exception as err:
            raise AssertionError(f"index case {case}: {type(err).__name__}: {err}") from err
        assert not (tmp_path / "PWNED").exists(), f"index case {case} ran a command"


def _check_index(index_path, folder, case: int) -> None:
    try:
        loaded = ShardIndex.load(index_path)
    except ShardError as err:
        assert err.reason in ("bad_index", "unsafe_index_path"), str(err)
    else:
        for sid, info in enumerate(loaded.shards):
            try:
                list(iter_shard(info, sid, on_error="raise"))
            except ShardError as err:
                assert err.reason in REASONS, str(err)
            list(iter_shard(info, sid, on_error="skip"))
    # beside the shards, a bad index is ignored and rebuilt; a readable one may be used
    on_error = ("raise", "skip")[case % 2]
    try:
        index = ShardIndex.for_paths(folder, progress=False, on_error=on_error)
    except ShardError as err:  # e.g. skips the (edited) index records, under "raise"
        assert on_error == "raise" and err.reason in REASONS, str(err)
    else:
        assert index.num_shards == 2


BINARY_INDEX_CASES = 420  # every 4th is traced: the watch wants more than 100 of those


def mutate_binary_index(rng: random.Random, base: bytes) -> bytes:
    """One hostile variant of a valid ``index.npidx``: flipped bits, huge or negative words written over
    the arrays and the header's numbers, a cut, garbage appended, or a rewritten header."""
    raw = bytearray(base)
    r = rng.random()
    if r < 0.25:
        for _ in range(rng.choice([1, 2, 8])):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif r < 0.5:
        pos = rng.randrange(16, len(raw) - 8) & ~7  # an aligned word: offsets, counts, ids
        value = rng.choice([-1, -(1 << 62), 1 << 31, (1 << 63) - 1, 255, 256, 0, 1, len(raw)])
        raw[pos : pos + 8] = value.to_bytes(8, "little", signed=True)
    elif r < 0.6:
        del raw[rng.randrange(len(raw)) :]
    elif r < 0.65:
        raw += bytes(rng.randrange(256) for _ in range(rng.choice([1, 64, 4096])))
    else:
        n = int.from_bytes(raw[12:16], "little")
        head = json.loads(raw[16 : 16 + n])
        target = rng.choice(["count", "arrays", "top"])
        if target == "count":
            row = rng.choice(head["arrays"])
            row[rng.choice([2, 3])] = rng.choice([-64, 0, 64, 1 << 40, 10**30, "1", None, 1.5])
        elif target == "arrays":
            row = rng.choice(head["arrays"])
            row[rng.choice([0, 1])] = rng.choice(["shapes", "<f8", "|u1", "<i8", "", ["x"], {}])
        else:
            key = rng.choice(["num_shards", "num_samples", "num_shapes", "patch_size", "metadata", "arrays"])
            head[key] = rng.choice([-1, 0, 10**12, [1, 0, 2], "x", None, [[]], {"a": 1}])
        text = json.dumps(head).encode()
        raw = bytearray(raw[:12] + len(text).to_bytes(4, "little") + text) if rng.random() < 0.5 else raw
        if len(text) <= n:
            raw[16 : 16 + n] = text + b" " * (n - len(text))
    return bytes(raw)


@pytest.mark.timeout(120)
def test_fuzz_binary_indexes_raise_only_shard_errors(tmp_path, watch):
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.inputs import as_input, bucket_table, index_fingerprint
    from lightning_adaptiveload.shards.compact import CompactIndex

    folder = tmp_path / "data"
    with ShardWriter(folder, max_samples_per_shard=3) as w:
        for i in range(7):
            w.write(f"k{i}", np.ones((4, 1 + 2 * (i % 3), 2, 2), np.float16), meta={"i": i})
    path = folder / "index.npidx"
    ShardIndex.load(folder / "index.json").save(path)
    base = path.read_bytes()
    batcher = DualConstraintBatcher(64)
    batcher.resolve_max_compute([(4, 1, 2, 2)])
    loaded = 0
    for case in range(BINARY_INDEX_CASES):
        rng = random.Random(2 * 10**6 + case)
        path.write_bytes(mutate_binary_index(rng, base))
        try:
            with watch["memory"].measure(case):
                try:
                    index = CompactIndex.load(path)
                except ShardError as err:
                    assert err.reason in ("bad_index", "unsafe_index_path", "duplicate_key"), str(err)
                    continue
                loaded += 1
                index_fingerprint(index)
                try:  # names the first sample of each shape: reads that shard's keys
                    bucket_table(as_input(index), batcher.sizer, "skip")
                except ShardError as err:
                    assert err.reason == "bad_index", str(err)
                keys: list[str] = []
                for sid in range(index.num_shards):
                    try:
                        info = index.shards[sid]
                    except ShardError as err:  # a key that breaks the key rules
                        assert err.reason == "bad_index", str(err)
                        continue
                    keys += info.keys
                    for j in range(info.num_samples):
                        assert index.latent_shape((sid, j)) == info.latent_shapes[j]
                assert len(keys) == len(set(keys)), "a loaded index lists a key twice"
        except Exception as err:
            raise AssertionError(f"binary index case {case}: {type(err).__name__}: {err}") from err
    # both outcomes occur: the mutations are neither all fatal nor all benign
    assert 0 < loaded < BINARY_INDEX_CASES
    # Issue 42: a key copied over another (within a shard or across shards) is always refused.
    head = json.loads(base[16 : 16 + int.from_bytes(base[12:16], "little")])
    table = {row[0]: row for row in head["arrays"]}
    blob_at = table["key_blob"][2]
    for case in range(40):
        rng = random.Random(3 * 10**6 + case)
        i, j = rng.sample(range(7), 2)  # keys 'k0'..'k6', two bytes each
        raw = bytearray(base)
        raw[blob_at + 2 * j : blob_at + 2 * j + 2] = raw[blob_at + 2 * i : blob_at + 2 * i + 2]
        path.write_bytes(bytes(raw))
        with pytest.raises(ShardError) as info:
            CompactIndex.load(path)
        assert info.value.reason == "duplicate_key" and f"'k{i}'" in str(info.value), str(info.value)


def test_the_watch_sees_a_file_outside_the_folder(tmp_path):
    """Guard against a vacuous watch: opening a file outside the test folder is recorded."""
    outside = os.path.join(REPO, "..", "_fuzz_watch_probe")
    _WATCH.update(on=True, root=os.path.realpath(tmp_path), pipes=False, seen=[])
    try:
        try:
            open(outside, "rb").close()
        except OSError:
            pass
        subprocess.run(["true"], check=False)
    finally:
        _WATCH["on"] = False
    kinds = [s[0] for s in _WATCH["seen"]]
    assert "open" in kinds and "subprocess.Popen" in kinds

"""Ingest of hostile inputs (issue 42): decode bounds, per-file failures as skips, captions, manifests.

Each case is a file a scraper or a careless pipeline could produce; each must give an ``InputError``
naming the file and the rule (a counted skip under ``on_error="skip"``), in bounded memory and time.
The Lightning run over such a folder (recorded skips, resume) is in ``tests/data/test_ingest.py``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import lightning_adaptiveload

av = pytest.importorskip("av")
pytest.importorskip("PIL")

from _hostile_media import gif_bomb, png_header_only, write_video  # noqa: E402

from lightning_adaptiveload.ingest import media  # noqa: E402
from lightning_adaptiveload.ingest.job import IngestDataset  # noqa: E402

# The package under test (its folder goes on the subprocesses' PYTHONPATH).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(lightning_adaptiveload.__file__)))
WAN480P = media.parse_buckets("wan480p")


def refused(path, *, fps=16.0, max_frames=81, buckets=WAN480P, limits=None) -> media.InputError:
    with pytest.raises(media.InputError) as info:
        media.decode_input(media.IngestItem(str(path), "k"), fps, max_frames, buckets, limits)
    assert str(path) in str(info.value)  # every error names its file
    assert info.value.reason in media.INPUT_REASONS
    return info.value


# -- decode bounds -----------------------------------------------------------------------------------


def test_gif_declaring_81_frames_of_4000x4000_is_refused_before_decoding(tmp_path):
    path = tmp_path / "bomb.gif"
    path.write_bytes(gif_bomb(4000, 4000, 81))
    assert path.stat().st_size < 2000
    t0 = time.perf_counter()
    err = refused(path, fps=None)  # every frame kept: 81 x 16 M pixels
    assert err.reason == "too_large" and "max_clip_pixels" in str(err) and "4000x4000" in str(err)
    assert time.perf_counter() - t0 < 1.0  # refused from the header, nothing decoded
    # The per-frame cap is settable, and applies to what the header declares.
    err = refused(path, limits=media.DecodeLimits(max_frame_pixels=1000))
    assert err.reason == "too_large" and "max_frame_pixels=1000" in str(err)


def test_large_frames_are_resized_as_they_are_decoded_memory_follows_the_output(tmp_path):
    """9 frames of 2000x2000 kept: before, ~650 MB (uint8 frames, their stack, then float); now one frame."""
    path = tmp_path / "big.gif"
    path.write_bytes(gif_bomb(2000, 2000, 9))
    code = textwrap.dedent(f"""
        import resource, torch
        import torch.nn.functional as F
        from lightning_adaptiveload.ingest import media
        F.interpolate(torch.zeros(1, 1, 64, 64), size=(32, 32), mode="bilinear", antialias=True)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        px, meta = media.decode_input(media.IngestItem({str(path)!r}, "k"), None, 9, media.parse_buckets("wan480p"))
        assert tuple(px.shape) == (3, 9, 624, 624), px.shape
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib = float(out.stdout.strip().splitlines()[-1])
    assert grown_mib < 300, f"decoding grew the process by {grown_mib:.0f} MiB"


def test_png_decompression_bomb_is_an_input_error(tmp_path):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_header_only(60000, 60000))  # Pillow's own guard raises DecompressionBombError
    err = refused(path)
    assert err.reason == "too_large" and "pixels" in str(err)
    path = tmp_path / "large.png"
    path.write_bytes(png_header_only(8000, 8000))  # under Pillow's guard, over max_frame_pixels
    err = refused(path)
    assert err.reason == "too_large" and "8000x8000" in str(err) and "max_frame_pixels" in str(err)


def test_one_pixel_video_in_native_mode_is_too_small(tmp_path):
    path = tmp_path / "tiny.mp4"
    write_video(path, (1, 1))
    err = refused(path, buckets=None)
    assert err.reason == "too_small" and "smaller than 16" in str(err)


def test_frame_size_changing_mid_clip_is_refused(tmp_path):
    write_video(tmp_path / "a.ts", (32, 48), codec="mpeg2video", fmt="mpegts")
    write_video(tmp_path / "b.ts", (64, 96), codec="mpeg2video", fmt="mpegts")
    path = tmp_path / "change.mp4"  # the name says mp4; the content is probed
    path.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    err = refused(path, fps=None, max_frames=81)
    assert err.reason == "size_changed" and "96x64" in str(err) and "48x32" in str(err)


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)
    assert refused(fifo).reason == "not_a_file"
    assert refused(tmp_path / "gone.mp4").reason == "missing"


def test_decode_limits_are_checked():
    with pytest.raises(ValueError, match="max_clip_pixels must be a positive int"):
        media.DecodeLimits(max_clip_pixels=0)


# -- captions ---------------------------------------------------------------------------------------


def _image(path):
    from PIL import Image

    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(path)


def test_captions_bad_in_every_way_mark_their_item_and_name_the_file(tmp_path):
    for name in ("good", "latin1", "huge", "fifo"):
        _image(tmp_path / f"{name}.png")
    (tmp_path / "good.txt").write_text("a red cat\n")
    (tmp_path / "latin1.txt").write_bytes("un caf\xe9".encode("latin-1"))
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(6 << 30)  # a 6 GB sparse file: must not be read whole
    os.mkfifo(tmp_path / "fifo.txt")
    t0 = time.perf_counter()
    items = {os.path.basename(it.path): it for it in media.find_inputs(tmp_path)}
    assert time.perf_counter() - t0 < 2.0
    assert items["good.png"].caption == "a red cat" and items["good.png"].error is None
    for name, words in (
        ("latin1", "not UTF-8"),
        ("huge", "max_caption_bytes"),
        ("fifo", "not a regular file"),
    ):
        reason, detail = items[f"{name}.png"].error
        assert reason == "bad_caption" and f"{name}.txt" in detail and words in detail, detail
    # The dataset turns the marked item into a skip record, without decoding it.
    ds = IngestDataset([items["latin1.png"]], 16.0, 81, None)
    rec = ds[0]
    assert rec["error"] == "bad_caption" and "latin1.txt" in rec["detail"]


# -- every per-file failure is a record --------------------------------------------------------------


@pytest.mark.parametrize(
    "exc", [MemoryError("Unable to allocate 2.55 GiB"), ValueError("all input arrays"), KeyError("x")]
)
def test_any_exception_of_one_decode_is_that_files_record(tmp_path, monkeypatch, exc):
    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr("lightning_adaptiveload.ingest.job.decode_input", boom)
    item = media.IngestItem(str(tmp_path / "x.mp4"), "x")
    rec = IngestDataset([item], 16.0, 81, None)[0]
    assert rec["error"] == "decode_error" and type(exc).__name__ in rec["detail"] and "x.mp4" in rec["detail"]


# -- manifests -------------------------------------------------------------------------------------


def test_manifest_nested_100000_deep_is_a_value_error_naming_the_line(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "a.mp4"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object: the line nests 100000 levels"):
        media.read_manifest(m)


@pytest.mark.parametrize(
    "row, words",
    [
        ({"path": "a.mp4", "key": "../../evil"}, "climbs out of its folder"),
        ({"path": "a.mp4", "key": "/etc/x"}, "absolute path"),
        ({"path": "a.mp4", "key": "a.b"}, "contains '.'"),
        ({"path": "a.mp4", "key": "__key__"}, "reserved"),
        ({"path": ["a.mp4"]}, "path must be a string"),
        ({"path": "a.mp4", "caption": 5}, "caption must be a string"),
        ({"path": "a.mp4", "fps": "nan"}, "must be a finite number"),
        ({"path": "a.mp4", "fps": True}, "is not a number"),
    ],
)
def test_manifest_rows_are_checked_before_any_work(tmp_path, row, words):
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1: ") as info:
        media.read_manifest(m)
    assert words in str(info.value)


def test_manifest_long_line_long_caption_and_bad_csv(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"path": "a.mp4", "caption": "x" * (media.MAX_MANIFEST_LINE + 10)}) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:1: the line is longer than"):
        media.read_manifest(m)
    m.write_text(json.dumps({"path": "a.mp4", "caption": "x" * 70_000}) + "\n")
    (item,) = media.read_manifest(m)
    assert item.error[0] == "bad_caption" and "m.jsonl:1" in item.error[1]  # a skip of that input only
    c = tmp_path / "m.csv"
    c.write_bytes(b"path,caption\na.mp4," + b"x" * 200_000 + b"\n")  # over csv's field limit
    with pytest.raises(ValueError, match=r"m\.csv:2: not valid CSV"):
        media.read_manifest(c)
    c.write_bytes(b"path,caption\n\0.mp4,x\n")
    with pytest.raises(ValueError, match=r"m\.csv:2: path '\\x00.mp4' contains a NUL"):
        media.read_manifest(c)
    c.write_bytes(b"path,caption\na.mp4,caf\xe9\n")
    with pytest.raises(ValueError, match=r"m\.csv: the manifest is not UTF-8"):
        media.read_manifest(c)
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        media.read_manifest(fifo)


# -- fuzz ------------------------------------------------------------------------------------------

_FIELD_VALUES = [
    None,
    "",
    "a.mp4",
    "../../evil",
    "/abs/x.png",
    "k",
    "k.k",
    "__k",
    "a\x00b",
    "\ud800",
    0,
    -1,
    1.5,
    "nan",
    "inf",
    "1e999",
    True,
    [],
    {},
    [[[]]],
    "x" * 5000,
    "caf\xe9",
]


def _mutate_manifest(rng, rows: list[dict], csv_: bool) -> bytes:
    rows = [dict(r) for r in rows]
    for _ in range(rng.choice([1, 2, 3])):
        row = rng.choice(rows)
        key = rng.choice(["path", "caption", "fps", "key", "extra"])
        if rng.random() < 0.15:
            row.pop(key, None)
        else:
            row[key] = rng.choice(_FIELD_VALUES)
    if csv_:
        lines = ["path,caption,fps,key"] + [
            ",".join(str(r.get(k, "")).replace("\n", " ") for k in ("path", "caption", "fps", "key"))
            for r in rows
        ]
        raw = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    else:
        raw = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    r = rng.random()
    if r < 0.1:
        depth = rng.choice([63, 65, 100_000])
        raw += b"[" * depth + b"]" * depth + b"\n"
    elif r < 0.2:
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif r < 0.3:
        pos = rng.randrange(len(raw) + 1)
        raw = raw[:pos] + bytes([rng.randrange(256)]) + raw[pos:]
    elif r < 0.33:
        raw += b"x" * (media.MAX_MANIFEST_LINE + 2)
    return raw


@pytest.mark.timeout(120)
def test_fuzz_manifests(tmp_path):
    """Mutated CSV and JSONL manifests: a ValueError naming the file and line, or items with valid keys."""
    from lightning_adaptiveload.shards.untrusted import key_problem

    rows = [{"path": f"v{i}.mp4", "caption": "a red cat", "fps": 8, "key": f"k{i}"} for i in range(4)]
    outcomes = {"refused": 0, "read": 0}
    t0 = time.perf_counter()
    for case in range(600):
        rng = random.Random(6 * 10**6 + case)
        csv_ = case % 2 == 0
        path = tmp_path / ("m.csv" if csv_ else "m.jsonl")
        path.write_bytes(_mutate_manifest(rng, rows, csv_))
        try:
            items = media.read_manifest(path)
        except ValueError as err:
            assert str(path) in str(err), (case, str(err))
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001
            raise AssertionError(f"manifest case {case}: {type(err).__name__}: {err}") from err
        outcomes["read"] += 1
        assert all(key_problem(it.key) is None for it in items), case
        assert len({it.key for it in items}) == len(items), case
        assert all(it.fps is None or (it.fps > 0 and it.fps < float("inf")) for it in items), case
    assert time.perf_counter() - t0 < 60
    assert outcomes["refused"] > 100 and outcomes["read"] > 100, outcomes


def _seeds(tmp_path) -> dict[str, bytes]:
    from PIL import Image

    write_video(tmp_path / "seed.mp4", (32, 48), frames=6)
    Image.fromarray(np.full((24, 40, 3), 90, np.uint8)).save(tmp_path / "seed.png")
    Image.fromarray(np.full((24, 40, 3), 90, np.uint8)).save(tmp_path / "seed.jpg")
    return {
        ".mp4": (tmp_path / "seed.mp4").read_bytes(),
        ".png": (tmp_path / "seed.png").read_bytes(),
        ".jpg": (tmp_path / "seed.jpg").read_bytes(),
        ".gif": gif_bomb(64, 48, 12),
    }


def _mutate_media(rng, raw: bytes) -> bytes:
    raw = bytearray(raw)
    r = rng.random()
    if r < 0.4:
        for _ in range(rng.choice([1, 4, 16])):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif r < 0.6:
        del raw[rng.randrange(len(raw)) :]
    elif r < 0.8:  # a size field of the header (GIF screen, PNG IHDR) or any 4 bytes: huge values
        pos = rng.choice([6, 16, 20, rng.randrange(max(1, len(raw) - 4))])
        raw[pos : pos + 4] = rng.choice(
            [b"\xff\xff\xff\x7f", b"\x00\x00\x00\x00", b"\x0f\xa0\x0f\xa0", b"\xff\xff\xff\xff"]
        )
    else:
        pos = rng.randrange(len(raw))
        raw[pos:pos] = raw[pos : pos + rng.choice([16, 512])] * rng.choice([2, 20])
    return bytes(raw)


@pytest.mark.timeout(180)
def test_fuzz_media_files_are_records_never_exceptions(tmp_path):
    """Mutated videos and images through the ingest dataset: a sample or a skip record with a known reason,
    never an exception; the (few) decoded samples are bounded by the limits."""
    seeds = _seeds(tmp_path)
    limits = media.DecodeLimits(max_frame_pixels=1 << 22, max_clip_pixels=1 << 24)
    outcomes: dict[str, int] = {}
    t0 = time.perf_counter()
    for case in range(160):
        rng = random.Random(7 * 10**6 + case)
        ext = rng.choice(sorted(seeds))
        path = tmp_path / f"case{ext}"
        path.write_bytes(_mutate_media(rng, seeds[ext]))
        ds = IngestDataset([media.IngestItem(str(path), "k")], 8.0, 9, WAN480P, limits)
        rec = ds[0]  # must not raise
        if "error" in rec:
            assert rec["error"] in media.INPUT_REASONS and str(path) in rec["detail"], (case, rec)
            outcomes[rec["error"]] = outcomes.get(rec["error"], 0) + 1
        else:
            assert rec["pixels"].shape[0] == 3 and rec["pixels"].shape[1] <= 9, case
            outcomes["ok"] = outcomes.get("ok", 0) + 1
    assert time.perf_counter() - t0 < 60, outcomes
    assert outcomes.get("ok", 0) > 10 and sum(v for k, v in outcomes.items() if k != "ok") > 30, outcomes

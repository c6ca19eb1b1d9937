"""Where synthetic data may be written, and how a large write is announced (issue 38, items 5 and 9).

A `synthetic:` block left in a recipe beside real `train_shards` must never advise (or perform) an
overwrite of data the library did not write; a write over 1 GiB says its size and folder and shows a bar.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import pytest

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.shards import synthetic as syn
from lightning_adaptiveload.shards.synthetic import (
    NotSyntheticDataError,
    SyntheticShards,
    estimate_synthetic_bytes,
    write_synthetic_shards,
)
from lightning_adaptiveload.shards.writer import ShardWriter

SMALL = {"mix": "tiny", "num_samples": 8, "samples_per_shard": 4, "seed": 0}


def _real_shards(folder) -> dict[str, str]:
    """Shards written as a user's own data (ShardWriter, no synthetic settings); name -> sha1."""
    rng = np.random.default_rng(0)
    with ShardWriter(folder, prefix="shard", max_samples_per_shard=2) as w:
        for i in range(4):
            w.write(f"clip{i}", rng.standard_normal((16, 1, 4, 4)).astype(np.float16), meta={"caption": "x"})
    return _digests(folder)


def _digests(folder) -> dict[str, str]:
    return {
        n: hashlib.sha1(open(os.path.join(folder, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(folder))
    }


def test_synthetic_block_beside_real_shards_says_remove_the_block_and_touches_nothing(tmp_path):
    folder = tmp_path / "train"
    before = _real_shards(folder)
    for extra in ({}, {"overwrite": True}):
        data = AdaptiveLoadDataModule(
            str(folder),
            synthetic={**SMALL, **extra},
            loader=Loader(num_workers=0),
        )
        with pytest.raises(NotSyntheticDataError) as err:
            data.prepare_data()
        text = str(err.value)
        assert "remove the `synthetic:` block" in text and "--data.init_args.synthetic=null" in text, text
        assert "train_shards" in text and str(folder) in text and "index without synthetic settings" in text
        assert "pass overwrite=True" not in text and "not even with overwrite=True" in text
        assert isinstance(err.value, FileExistsError)  # callers that caught FileExistsError still do
        assert _digests(folder) == before  # not one byte changed, even with overwrite=True


def test_shards_without_an_index_or_other_files_are_not_synthetic_either(tmp_path):
    folder = tmp_path / "train"
    _real_shards(folder)
    os.remove(folder / "index.json")  # shards of the user's own, not yet indexed
    with pytest.raises(NotSyntheticDataError, match=r"2 shard files \(shard-000000.tar, ...\)"):
        write_synthetic_shards(
            folder,
            SyntheticShards(**{k: v for k, v in SMALL.items() if k != "mix"}, overwrite=True),
            progress=False,
        )
    other = tmp_path / "notes"
    other.mkdir()
    (other / "README.txt").write_text("my data goes here")
    with pytest.raises(NotSyntheticDataError, match=r"1 other entry \(README.txt\)"):
        write_synthetic_shards(other, settings=SyntheticShards(num_samples=4), progress=False)
    assert (other / "README.txt").read_text() == "my data goes here"


def test_own_synthetic_data_is_still_reused_or_replaced(tmp_path):
    first = write_synthetic_shards(tmp_path, SyntheticShards(**SMALL), progress=False)
    assert (
        write_synthetic_shards(tmp_path, SyntheticShards(**SMALL), progress=False).to_dict()
        == first.to_dict()
    )
    with pytest.raises(FileExistsError, match="overwrite=True") as err:
        write_synthetic_shards(tmp_path, SyntheticShards(**{**SMALL, "num_samples": 12}), progress=False)
    assert "num_samples 8 there, 12 now" in str(err.value)
    assert not isinstance(err.value, NotSyntheticDataError)
    again = write_synthetic_shards(
        tmp_path, SyntheticShards(**{**SMALL, "num_samples": 12}, overwrite=True), progress=False
    )
    assert again.num_samples == 12


def test_a_write_that_stopped_early_is_written_again_not_refused(tmp_path):
    write_synthetic_shards(tmp_path, SyntheticShards(**SMALL), progress=False)
    os.remove(tmp_path / "index.json")  # as if killed before the index: complete shards, the marker
    index = write_synthetic_shards(tmp_path, SyntheticShards(**SMALL), progress=False)
    assert index.num_samples == 8 and (tmp_path / "index.json").exists()
    # Same settings, a shard truncated since: written again.
    with open(index.shards[0].path, "r+b") as f:
        f.truncate(100)
    assert (
        write_synthetic_shards(tmp_path, SyntheticShards(**SMALL), progress=False).shards[0].num_bytes
        == index.shards[0].num_bytes
    )


def test_large_write_is_announced_with_size_folder_and_a_bar(tmp_path, monkeypatch, caplog):
    bars = []

    class Bar:
        def __init__(self, *args, disable=False, **kwargs):
            bars.append(disable)

        def update(self, n):
            pass

        def close(self):
            pass

    monkeypatch.setattr(syn, "tqdm", Bar)
    monkeypatch.setattr(syn, "ANNOUNCE_BYTES", 100_000)  # the tiny mix: ~22 KiB a sample
    with caplog.at_level(logging.WARNING, logger=syn.__name__):
        write_synthetic_shards(
            tmp_path / "big", SyntheticShards(**{**SMALL, "num_samples": 16}), progress=False
        )
    announced = [r.getMessage() for r in caplog.records if "writing about" in r.getMessage()]
    assert len(announced) == 1 and str(tmp_path / "big") in announced[0] and "GiB" in announced[0]
    assert "16 samples of the tiny mix" in announced[0] and "free there" in announced[0]
    assert bars == [False]  # the bar is shown although progress=False
    caplog.clear()
    bars.clear()
    write_synthetic_shards(tmp_path / "small", SyntheticShards(**{**SMALL, "num_samples": 2}), progress=False)
    assert bars == [True] and not [r for r in caplog.records if "writing about" in r.getMessage()]


def test_write_larger_than_the_free_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "ANNOUNCE_BYTES", 0)
    monkeypatch.setattr(syn.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(OSError, match=r"need about .* GiB in .*, but that disk has 0.0 GiB free"):
        write_synthetic_shards(tmp_path / "out", SyntheticShards(**SMALL), progress=False)
    assert not (tmp_path / "out").exists()


def test_size_estimate_matches_what_is_written(tmp_path):
    index = write_synthetic_shards(
        tmp_path, settings=SyntheticShards(mix="tiny", num_samples=256, samples_per_shard=64), progress=False
    )
    written = sum(s.num_bytes for s in index.shards)
    assert 0.85 < estimate_synthetic_bytes("tiny", 256) / written < 1.15
    # The wan13b_480p recipes' block: the 7.5 GB the issue met, announced before it is written.
    wan = estimate_synthetic_bytes("wan21_480p", 2048, (16, 256), 4096)
    assert 6.5 < wan / 2**30 < 8.5
    assert json.loads((tmp_path / syn.MARKER_NAME).read_text())["num_samples"] == 256

"""Soak: many short epochs of real CPU DDP (gloo), with and without a kill + resume, 0 and 2 workers.

Every epoch must see every sample exactly once and every rank the same number of steps; nothing may hang
(every launch has a timeout). The default run keeps a short version; the long one (2 and 4 processes, 60
epochs each) is marked ``slow``:

    python -m pytest tests/test_soak.py -m slow        # about 10-20 minutes on 2 CPU cores
"""

from __future__ import annotations

import collections
import glob
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import launch, read_records  # noqa: E402

from lightning_adaptiveload.data import ShardIndex, write_synthetic_shards  # noqa: E402

SIZES = [13, 2, 9, 17, 5, 11, 3, 8]  # uneven, 68 samples


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("soak-shards"))
    write_synthetic_shards(
        d, mix="tiny", num_samples=sum(SIZES), samples_per_shard=SIZES, seed=11, progress=False
    )
    return d


def _check(rows_by_rank: list[list[dict]], keys: list[str], epochs: int, label: str) -> None:
    for epoch in range(epochs):
        per = [[r for r in rows if r["epoch"] == epoch] for rows in rows_by_rank]
        assert len({len(x) for x in per}) == 1 and per[0], (
            f"{label} epoch {epoch}: steps {[len(x) for x in per]}"
        )
        seen = collections.Counter(k for x in per for r in x for k in r["keys"])
        assert sorted(seen) == sorted(keys), (
            f"{label} epoch {epoch}: missing {sorted(set(keys) - set(seen))[:5]}"
        )
        assert max(seen.values()) == 1, f"{label} epoch {epoch}: repeated"


def soak(shards: str, out: str, world: int, epochs: int, resume: bool, timeout: float) -> None:
    keys = [k for s in ShardIndex.load(os.path.join(shards, "index.json")).shards for k in s.keys]
    runs = []
    for schedule in ("independent", "lockstep"):
        for workers in (0, 2):
            name = f"{schedule}-w{workers}-r{world}"
            run = {
                "name": name,
                "schedule": schedule,
                "num_workers": workers,
                "max_epochs": epochs,
                "max_tokens": 1024,
                "seed": world,
            }
            if resume:  # crash two steps after a checkpoint about halfway through the run
                run.update(ckpt_every=max(3, epochs * 2), kill_at=max(3, epochs * 2) + 2)
            runs.append(run)
    launch({"data": shards, "out": out, "world": world, "runs": runs}, out, timeout=timeout)
    if not resume:
        for run in runs:
            _check(read_records(out, run["name"], world), keys, epochs, run["name"])
        return
    resumed = []
    for run in runs:
        assert os.path.exists(os.path.join(out, run["name"] + ".crashed")), run["name"]
        ckpt = glob.glob(os.path.join(out, run["name"] + "-ckpt", f"at-{run['ckpt_every']}.ckpt"))
        assert ckpt
        resumed.append(
            {
                **run,
                "name": run["name"] + "-b",
                "num_workers": 2 - run["num_workers"],
                "kill_at": None,
                "ckpt_every": None,
                "resume": ckpt[0],
            }
        )
    launch({"data": shards, "out": out, "world": world, "runs": resumed}, out, timeout=timeout)
    for run in runs:
        before = read_records(out, run["name"], world)
        after = read_records(out, run["name"] + "-b", world)
        rows = [
            [r for r in before[x] if r["global_step"] < run["ckpt_every"]] + after[x] for x in range(world)
        ]
        _check(rows, keys, epochs, run["name"] + " (killed and resumed)")


@pytest.mark.timeout(400)
def test_soak_short_two_ranks_with_resume(shards, tmp_path):
    soak(shards, str(tmp_path), world=2, epochs=4, resume=True, timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("resume", [False, True])
def test_soak_long(shards, tmp_path, world, resume):
    soak(shards, str(tmp_path), world=world, epochs=60, resume=resume, timeout=1500)

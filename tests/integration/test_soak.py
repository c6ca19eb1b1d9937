"""Soak: many short epochs of real CPU DDP (gloo), with and without a kill + resume, 0 and 2 workers.

Schedules: independent, lockstep with its bucketed tail, lockstep with its packed tail (a module that runs
packs) and packed (issue 40).

Every epoch must see every sample exactly once and every rank the same number of steps; nothing may hang
(every launch has a timeout). The default run keeps a short version; the long one (2 and 4 processes, 60
epochs each) is marked ``slow``:

    python -m pytest tests/integration/test_soak.py -m slow        # about 10-20 minutes on 2 CPU cores
"""

from __future__ import annotations

import glob
import os

import pytest
from _ddp_data_runner import launch, read_records
from _fixtures import assert_each_key_once, epoch_rows, index_keys, resumed_run

SIZES = [13, 2, 9, 17, 5, 11, 3, 8]  # uneven, 68 samples
# (schedule, whether the module runs packs): lockstep's bucketed tail, its packed tail, and packed.
SCHEDULES = [("independent", False), ("lockstep", False), ("lockstep", True), ("packed", True)]


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=11, name="soak-shards")


def _check(rows_by_rank: list[list[dict]], keys: list[str], epochs: int, label: str) -> None:
    for epoch in range(epochs):
        per = epoch_rows(rows_by_rank, epoch)
        assert len({len(x) for x in per}) == 1 and per[0], (
            f"{label} epoch {epoch}: steps {[len(x) for x in per]}"
        )
        assert_each_key_once(per, keys, f"{label} epoch {epoch}")


def soak(shards: str, out: str, world: int, epochs: int, resume: bool, timeout: float) -> None:
    keys = index_keys(shards)
    runs = []
    for schedule, packs in SCHEDULES:
        for workers in (0, 2):
            name = f"{schedule}{'-packs' if packs else ''}-w{workers}-r{world}"
            run = {
                "name": name,
                "schedule": schedule,
                "num_workers": workers,
                "max_epochs": epochs,
                "max_tokens": 1024,
                "seed": world,
                # The module runs packs: lockstep then plans its packed tail (the packed schedule needs it).
                "runs_packs": packs,
            }
            if resume:  # crash two steps after a checkpoint about halfway through the run
                run.update(ckpt_every=max(3, epochs * 2), kill_at=max(3, epochs * 2) + 2)
            runs.append(run)
    launch({"data": shards, "out": out, "world": world, "runs": runs}, out, timeout=timeout)
    if not resume:
        for run in runs:
            rows = read_records(out, run["name"], world)
            _check(rows, keys, epochs, run["name"])
            _check_packs(rows, run)
        return
    resumed = []
    for run in runs:
        assert os.path.exists(os.path.join(out, run["name"] + ".crashed")), run["name"]
        ckpt = glob.glob(os.path.join(out, run["name"] + "-ckpt", f"at-{run['ckpt_every']}.ckpt"))
        assert ckpt
        resumed.append(resumed_run(run, ckpt[0], run["name"] + "-b", 2 - run["num_workers"]))
    launch({"data": shards, "out": out, "world": world, "runs": resumed}, out, timeout=timeout)
    for run in runs:
        before = read_records(out, run["name"], world)
        after = read_records(out, run["name"] + "-b", world)
        rows = [
            [r for r in before[x] if r["global_step"] < run["ckpt_every"]] + after[x] for x in range(world)
        ]
        _check(rows, keys, epochs, run["name"] + " (killed and resumed)")
        _check_packs([after[x] for x in range(world)], run)


def _check_packs(rows_by_rank: list[list[dict]], run: dict) -> None:
    """Packs where the schedule makes them: every step of the packed schedule, some steps of lockstep's
    packed tail, none otherwise (so that each run covers what it names)."""
    packed = [r["packed"] for rows in rows_by_rank for r in rows]
    if run["schedule"] == "packed":
        assert all(packed), run["name"]
    elif run["runs_packs"]:
        assert any(packed) and not all(packed), f"{run['name']}: no packed tail step"
    else:
        assert not any(packed), run["name"]


@pytest.mark.timeout(800)
def test_soak_short_two_ranks_with_resume(shards, tmp_path):
    soak(shards, str(tmp_path), world=2, epochs=4, resume=True, timeout=360)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("resume", [False, True])
def test_soak_long(shards, tmp_path, world, resume):
    soak(shards, str(tmp_path), world=world, epochs=60, resume=resume, timeout=1500)

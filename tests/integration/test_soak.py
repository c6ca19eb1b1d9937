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

from lightning_adaptiveload import Batching, Loader, PlanSettings
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

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
        tails = []
        for run in runs:
            rows = read_records(out, run["name"], world)
            _check(rows, keys, epochs, run["name"])
            tails.append(_check_packs(rows, run, shards))
        assert any(tails)  # some run took lockstep's packed tail: the soak covers it
        return
    resumed = []
    for run in runs:
        assert os.path.exists(os.path.join(out, run["name"] + ".crashed")), run["name"]
        ckpt = glob.glob(os.path.join(out, run["name"] + "-ckpt", f"at-{run['ckpt_every']}.ckpt"))
        assert ckpt
        resumed.append(resumed_run(run, ckpt[0], run["name"] + "-b", 2 - run["num_workers"]))
    launch({"data": shards, "out": out, "world": world, "runs": resumed}, out, timeout=timeout)
    for run, again in zip(runs, resumed):
        before = read_records(out, run["name"], world)
        after = read_records(out, run["name"] + "-b", world)
        rows = [
            [r for r in before[x] if r["global_step"] < run["ckpt_every"]] + after[x] for x in range(world)
        ]
        _check(rows, keys, epochs, run["name"] + " (killed and resumed)")
        # The resumed run's own settings (its worker count differs); its first epoch continues a plan.
        _check_packs([after[x] for x in range(world)], again, shards, resumed=True)


def _planned_tail(shards: str, run: dict, world: int, epochs: set[int]) -> bool:
    """Whether the lockstep plan of ``run`` has a packed tail in any of ``epochs`` (the plan, made here as the
    ranks make it). Some layouts need none: 68 samples on 2 ranks without workers share every class evenly."""
    dm = AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=run["max_tokens"], sizing="dual"),
        plan=PlanSettings(schedule="lockstep", lockstep_tail="packed"),
        loader=Loader(num_workers=run["num_workers"], seed=run["seed"]),
    )
    dm.setup("fit")
    ds = dm.train_dataset.on_ranks(0, world)
    return any(ds.make_plan(epoch).report.get("packed_tail_steps", 0) > 0 for epoch in sorted(epochs))


def _check_packs(rows_by_rank: list[list[dict]], run: dict, shards: str, resumed: bool = False) -> bool:
    """Packs where the schedule makes them: every step of the packed schedule, the steps of lockstep's packed
    tail where its plan has one, none otherwise. Returns whether the run had a packed tail step. ``resumed``:
    the first epoch continued another plan, so lockstep's tail is checked on the whole epochs after it (on
    that one where there is no other)."""
    packed = [r["packed"] for rows in rows_by_rank for r in rows]
    if run["schedule"] == "packed":
        assert all(packed), run["name"]
    elif run["runs_packs"]:
        epochs = sorted({r["epoch"] for rows in rows_by_rank for r in rows})
        if resumed and len(epochs) > 1:
            epochs = epochs[1:]
            packed = [r["packed"] for rows in rows_by_rank for r in rows if r["epoch"] in epochs]
        planned = _planned_tail(shards, run, len(rows_by_rank), set(epochs))
        assert any(packed) == planned and not all(packed), (
            f"{run['name']}: packed tail steps planned: {planned}"
        )
        return planned
    else:
        assert not any(packed), run["name"]
    return False


@pytest.mark.timeout(800)
def test_soak_short_two_ranks_with_resume(shards, tmp_path):
    soak(shards, str(tmp_path), world=2, epochs=4, resume=True, timeout=360)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("resume", [False, True])
def test_soak_long(shards, tmp_path, world, resume):
    soak(shards, str(tmp_path), world=world, epochs=60, resume=resume, timeout=1500)

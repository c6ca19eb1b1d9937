"""Mid-epoch resume of AdaptiveLoadDataModule: every sample of the epoch exactly once across the kill.

Unit tests drive the DataModule without a trainer (the consumed count is then what the caller took from the
loader); the DDP tests kill a real 2-process fit after a checkpoint and resume it from that checkpoint with a
different number of workers.
"""

from __future__ import annotations

import collections
import glob
import os

import pytest
from _ddp_data_runner import launch, read_records
from _fixtures import assert_each_key_once, index_keys, resumed_run

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.index import ShardIndex

SIZES = [21, 4, 15, 9, 30, 7, 12, 18]


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=5, name="resume-shards")


def make_dm(
    data: str, rank: int, world: int, workers: int, schedule: str, monkeypatch, chunk: int | None = None
) -> AdaptiveLoadDataModule:
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule=schedule, chunk_samples=chunk if chunk is not None else 1_000_000),
        loader=Loader(num_workers=workers, seed=7),
    )
    dm.setup("fit")
    return dm


def take(dm: AdaptiveLoadDataModule, n: int | None, monkeypatch, rank: int, world: int) -> list[list[str]]:
    """Iterate the training loader of ``dm`` (as ``rank`` of ``world``), taking ``n`` batches (None: all)."""
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    out = []
    it = iter(dm.train_dataloader())
    for batch in it:
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
@pytest.mark.parametrize(
    ("world", "new_world", "workers", "new_workers"), [(2, 2, 0, 2), (2, 3, 2, 0), (3, 1, 0, 0)]
)
def test_resume_without_trainer(shards, monkeypatch, schedule, world, new_world, workers, new_workers):
    _kill_and_resume(shards, monkeypatch, schedule, world, new_world, workers, new_workers, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
@pytest.mark.parametrize(("world", "new_world", "workers", "new_workers"), [(2, 2, 0, 2), (2, 3, 0, 0)])
def test_resume_of_a_chunked_epoch(shards, monkeypatch, schedule, world, new_world, workers, new_workers):
    # 116 samples in segments of about 40 (issue 16): each rank plans only its own streams, the resume
    # replays every rank's plan to find what was consumed.
    _kill_and_resume(shards, monkeypatch, schedule, world, new_world, workers, new_workers, 40)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "new_world", "workers", "new_workers"), [(2, 2, 0, 2), (2, 3, 2, 0)])
def test_resume_of_a_packed_epoch_planned_on_counts(
    shards, monkeypatch, world, new_world, workers, new_workers
):
    # 116 samples over a template of 30 samples (planning/packed_counts.py): the loaders read rank-local
    # plans made on counts, and the resume replays them.
    from lightning_adaptiveload.planning import packed_counts

    monkeypatch.setattr(packed_counts, "TEMPLATE_SAMPLES", 30)
    dm = make_dm(shards, 0, world, workers, "packed", monkeypatch)
    take(dm, 1, monkeypatch, 0, world)
    assert dm.epoch_report["planned_on_counts"]["parts"] >= 2
    assert dm.train_dataset.plan.rank == 0
    _kill_and_resume(shards, monkeypatch, "packed", world, new_world, workers, new_workers, None)


def _kill_and_resume(shards, monkeypatch, schedule, world, new_world, workers, new_workers, chunk):
    keys = index_keys(shards)
    dms = [make_dm(shards, r, world, workers, schedule, monkeypatch, chunk) for r in range(world)]
    firsts = [take(dm, 3, monkeypatch, r, world) for r, dm in enumerate(dms)]
    steps = dms[0].epoch_report["steps"]
    assert all(len(f) == 3 for f in firsts) and steps > 3
    if chunk is not None:
        # (The packed schedule never plans in segments: a large epoch is planned on counts instead.)
        assert dms[0].epoch_report.get("segments", 1) > 1 or schedule == "packed"
        assert dms[0].train_dataset.plan.rank == 0 and dms[-1].train_dataset.plan.rank == world - 1
    state = dms[0].state_dict()
    assert state["epoch"] == 0 and state["segments"][-1]["consumed"] == [3] * world
    resumed = []
    for r in range(new_world):
        dm = make_dm(shards, r, new_world, new_workers, schedule, monkeypatch, chunk)
        dm.load_state_dict(state)
        resumed.append(take(dm, None, monkeypatch, r, new_world))
        assert dm.epoch_report["steps"] == len(resumed[-1])
    assert len({len(x) for x in resumed}) == 1, "resumed ranks must have equal step counts"
    if new_world == world:  # continuation: the same batches as the uninterrupted epoch
        assert len(resumed[0]) == steps - 3
    seen = collections.Counter(k for part in firsts + resumed for b in part for k in b)
    assert sorted(seen) == sorted(keys) and max(seen.values()) == 1


@pytest.mark.timeout(120)
def test_resume_twice_in_one_epoch(shards, monkeypatch):
    keys = index_keys(shards)
    dm = make_dm(shards, 0, 1, 0, "independent", monkeypatch)
    first = take(dm, 2, monkeypatch, 0, 1)
    state = dm.state_dict()
    dm2 = make_dm(shards, 0, 1, 2, "independent", monkeypatch)
    dm2.load_state_dict(state)
    second = take(dm2, 3, monkeypatch, 0, 1)
    state2 = dm2.state_dict()
    assert [s["consumed"] for s in state2["segments"]] == [[2], [3]]
    dm3 = make_dm(shards, 0, 1, 0, "independent", monkeypatch)
    dm3.load_state_dict(state2)
    rest = take(dm3, None, monkeypatch, 0, 1)
    seen = collections.Counter(k for b in first + second + rest for k in b)
    assert sorted(seen) == sorted(keys) and max(seen.values()) == 1


@pytest.mark.timeout(60)
def test_resume_state_of_finished_epoch_starts_next_epoch_afresh(shards, monkeypatch):
    dm = make_dm(shards, 0, 1, 0, "independent", monkeypatch)
    all0 = take(dm, None, monkeypatch, 0, 1)
    state = dm.state_dict()
    assert state["segments"][-1]["consumed"] == [len(all0)]
    dm2 = make_dm(shards, 0, 1, 0, "independent", monkeypatch)
    dm2.load_state_dict(state)
    assert take(dm2, None, monkeypatch, 0, 1) == []  # epoch 0 again: nothing left
    nxt = take(dm2, None, monkeypatch, 0, 1)  # epoch 1: everything
    assert sorted(k for b in nxt for k in b) == sorted(index_keys(shards))


def test_resume_rejects_other_data(shards, synthetic_shards, monkeypatch):
    dm = make_dm(shards, 0, 1, 0, "independent", monkeypatch)
    take(dm, 1, monkeypatch, 0, 1)
    state = dm.state_dict()
    other = synthetic_shards([10] * 4, seed=1, name="other")
    dm2 = make_dm(other, 0, 1, 0, "independent", monkeypatch)
    dm2.load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint"):
        take(dm2, 1, monkeypatch, 0, 1)
    with pytest.raises(ValueError, match="version"):
        dm2.load_state_dict({**state, "version": 99})


def _epoch_steps(data: str, world: int, workers: int, schedule: str, epoch: int) -> int:
    index = ShardIndex.load(os.path.join(data, "index.json"))
    return plan_epoch(
        index,
        world,
        workers,
        DualConstraintBatcher(512),
        seed=0,
        epoch=epoch,
        settings=PlanSettings(schedule=schedule),
    ).steps


@pytest.mark.timeout(300)
def test_ddp_kill_and_resume_with_other_worker_count(shards, tmp_path):
    """2-process fit, checkpoint every k steps, crash 2 steps after a checkpoint, resume with other workers.

    Run c checkpoints right after the last batch of epoch 0: Lightning then restarts an epoch with nothing
    left, which must not make it skip the next epoch (regression test).
    """
    out = str(tmp_path)
    s0 = _epoch_steps(shards, 2, 2, "independent", 0)
    s0_lock = _epoch_steps(shards, 2, 0, "lockstep", 0)
    k_a = 3  # checkpoint inside epoch 0
    k_b = s0_lock + 2  # checkpoint inside epoch 1
    assert k_a + 2 < s0
    k_c = _epoch_steps(shards, 2, 0, "independent", 0)  # checkpoint after the last batch of epoch 0
    runs = [
        {
            "name": "a",
            "schedule": "independent",
            "num_workers": 2,
            "max_epochs": 2,
            "ckpt_every": k_a,
            "kill_at": k_a + 2,
        },
        {
            "name": "b",
            "schedule": "lockstep",
            "num_workers": 0,
            "max_epochs": 2,
            "ckpt_every": k_b,
            "kill_at": k_b + 2,
        },
        {
            "name": "c",
            "schedule": "independent",
            "num_workers": 0,
            "max_epochs": 2,
            "ckpt_every": k_c,
            "kill_at": k_c + 2,
        },
    ]
    launch({"data": shards, "out": out, "world": 2, "runs": runs}, out, timeout=140)
    assert os.path.exists(os.path.join(out, "a.crashed")) and os.path.exists(os.path.join(out, "b.crashed"))
    resumes = []
    for run, k, workers in ((runs[0], k_a, 0), (runs[1], k_b, 2), (runs[2], k_c, 2)):
        ckpt = glob.glob(os.path.join(out, f"{run['name']}-ckpt", f"at-{k}.ckpt"))
        assert ckpt, os.listdir(os.path.join(out, f"{run['name']}-ckpt"))
        resumes.append(resumed_run(run, ckpt[0], run["name"] + "-resumed", workers))
    launch({"data": shards, "out": out, "world": 2, "runs": resumes}, out, timeout=140)
    keys = index_keys(shards)
    for run, k in ((runs[0], k_a), (runs[1], k_b), (runs[2], k_c)):
        before = read_records(out, run["name"], 2)
        after = read_records(out, run["name"] + "-resumed", 2)
        for epoch in (0, 1):
            # batches in the checkpoint (global step < k) + every batch of the resumed run
            rows = [
                [r for r in before[x] if r["global_step"] < k and r["epoch"] == epoch]
                + [r for r in after[x] if r["epoch"] == epoch]
                for x in range(2)
            ]
            assert len(rows[0]) == len(rows[1]), f"{run['name']} epoch {epoch}: unequal steps"
            assert_each_key_once(rows, keys, f"{run['name']} epoch {epoch}")
        # The resumed run starts at the checkpoint's global step: nothing in flight was repeated.
        assert min(r["global_step"] for r in after[0]) == k

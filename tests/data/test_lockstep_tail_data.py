"""Lockstep's packed tail on the data path: the loader collates packs and bucketed batches each the right
way, the DataModule falls back to a bucketed tail for a module that cannot run packs, and a 2-process gloo
fit of the tiny VideoDiT runs an epoch that ends in packs (CPU)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
from _ddp_data_runner import launch, read_records
from _fixtures import assert_each_key_once, epoch_rows, index_keys
from _recording import fit_two_ranks

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.loader import PlannedShardDataset
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.index import ShardIndex

SIZES = [9, 3, 7, 5, 8]
MAX_TOKENS = 768


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    # seed 0: the lockstep epoch at 2 ranks has a packed tail step (asserted below, not assumed)
    return synthetic_shards(SIZES, seed=0, name="tail-shards")


def _keys(data: str) -> list[str]:
    return [k for s in ShardIndex.load(os.path.join(data, "index.json")).shards for k in s.keys]


def test_loader_collates_packs_and_bucketed_batches_each_their_way(data):
    index = ShardIndex.load(os.path.join(data, "index.json"))
    taken, kinds = [], {True: 0, False: 0}
    for rank in range(2):
        ds = PlannedShardDataset(
            index,
            DualConstraintBatcher(MAX_TOKENS),
            settings=PlanSettings(schedule="lockstep"),
            placement=(rank, 2),
        )
        plan = ds.begin_epoch(0)
        assert plan.report["packed_tail_steps"] >= 1
        for batch in ds._stream(plan, (rank, 0)):
            w, j = plan.step_order[rank][batch["step"]]
            pack = plan.is_pack((rank, w), j)
            kinds[pack] += 1
            assert bool(batch.get("packed")) == pack
            if pack:  # a list of latents of any shapes within the token cap
                assert isinstance(batch["latents"], list) and batch["num_tokens"] <= MAX_TOKENS
            else:
                assert batch["latents"].dim() == 5
            assert batch["global_tokens"] == plan.global_tokens[batch["step"]]
            taken.extend(batch["keys"])
    assert kinds[True] >= 2 and kinds[False] >= 2
    assert sorted(taken) == sorted(_keys(data))


class _NoPacks(pl.LightningModule):
    pass


class _FakeTrainer:
    def __init__(self, module) -> None:
        self.lightning_module = module


def test_datamodule_falls_back_to_a_bucketed_tail_for_a_module_without_packs(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=MAX_TOKENS),
        plan=PlanSettings(schedule="lockstep"),
        loader=Loader(num_workers=0),
    )
    dm.trainer = _FakeTrainer(_NoPacks())
    with pytest.warns(UserWarning, match="runs_packed_batches"):
        assert dm._train_lockstep_tail() == "bucketed"
    dm.trainer = _FakeTrainer(VideoDiTModule(preset="tiny"))
    assert dm._train_lockstep_tail() == "packed"
    quiet = AdaptiveLoadDataModule(
        train_shards=data,
        plan=PlanSettings(schedule="lockstep", lockstep_tail="bucketed"),
        loader=Loader(num_workers=0),
    )
    quiet.trainer = _FakeTrainer(_NoPacks())
    assert quiet._train_lockstep_tail() == "bucketed"
    with pytest.raises(ValueError, match="lockstep_tail"):
        AdaptiveLoadDataModule(
            train_shards=data,
            plan=PlanSettings(schedule="lockstep", lockstep_tail="packs"),
        )


@pytest.mark.timeout(240)
def test_lockstep_fit_with_packed_tail_two_ranks(data, tmp_path):
    base = str(tmp_path / "rec.rank{}.jsonl")
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=MAX_TOKENS),
        plan=PlanSettings(schedule="lockstep"),
        loader=Loader(num_workers=0),
    )
    rows = fit_two_ranks(dm, base)
    assert len(rows[0]) == len(rows[1]) > 0  # equal steps
    for a, b in zip(*rows):  # aligned: both ranks at one plan step, both packs or both bucketed
        assert a["step"] == b["step"] and a["packed"] == b["packed"]
    packed = [r for r in rows[0] if r["packed"]]
    assert packed and len(packed) < len(rows[0])  # lockstep steps first, then the packed tail
    assert all(r["packed"] for r in rows[0][-len(packed) :]), "the packs end the epoch"
    taken = [k for rank in rows for r in rank for k in r["keys"]]
    assert sorted(taken) == sorted(_keys(data))  # every sample exactly once


def test_datamodule_resume_of_a_mixed_plan_continues_or_replans_exactly_once(data):
    from lightning_adaptiveload.loading.resume import digest_text, resume_plan
    from lightning_adaptiveload.planning.resume import consumed_digest

    index = ShardIndex.load(os.path.join(data, "index.json"))

    def dataset(world: int, workers: int, rank: int = 0) -> PlannedShardDataset:
        ds = PlannedShardDataset(
            index,
            DualConstraintBatcher(MAX_TOKENS),
            num_workers=workers,
            settings=PlanSettings(schedule="lockstep"),
            placement=(rank, world),
        )
        return ds

    first = dataset(2, 0)
    plan = first.make_plan(0)
    assert plan.report["packed_tail_steps"] >= 1
    keys = {(s, i): k for s, shard in enumerate(index.shards) for i, k in enumerate(shard.keys)}
    first_pack = next(k for k in range(plan.steps) if plan.is_pack((0, 0), plan.step_order[0][k][1]))
    for done in (first_pack - 1, first_pack):  # stopped just before the packed tail, and at its start
        state = {
            "version": 1,
            "fingerprint": first.fingerprint,
            "epoch": 0,
            "segments": [
                {
                    "kind": "fresh",
                    **first.plan_settings(),
                    "consumed": [done, done],
                    # the digest a saved state carries, so that the replay is verified (else it is refused)
                    "digest": digest_text(consumed_digest(plan, {0: done, 1: done})),
                }
            ],
        }
        gone = {
            ref for r in range(2) for w, j in plan.step_order[r][:done] for ref in plan.streams[(r, w)][j]
        }
        for world, workers, kind in ((2, 3, "continue"), (3, 1, "replan")):
            left = []
            for r in range(world):  # each rank resumes its own rank-local plan
                resumed = resume_plan(dataset(world, workers, r), state)
                assert resumed.kind == kind
                rest = resumed.plan
                assert rest.rank == r and len(rest.step_order[r]) == rest.steps
                left += [ref for v in rest.streams.values() for bt in v for ref in bt]
                if kind == "continue":  # the tail is still packs, at the same steps
                    for k in range(rest.steps):
                        w, j = rest.step_order[r][k]
                        assert rest.is_pack((r, w), j) == (done + k >= first_pack)
            assert sorted(keys[x] for x in list(gone) + left) == sorted(_keys(data))  # exactly once


def test_a_state_saved_before_the_packed_tail_replays_with_the_bucketed_tail(data):
    index = ShardIndex.load(os.path.join(data, "index.json"))
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(MAX_TOKENS), settings=PlanSettings(schedule="lockstep"), placement=(0, 2)
    )
    from lightning_adaptiveload.loading.resume import read_state

    # A segment saved before the packed tail existed (0.1.0's layout, version 2): no lockstep_tail, the
    # schedule under "mode". The state's migration reads it as planned then: with the bucketed tail.
    seg = {k: v for k, v in ds.plan_settings().items() if k != "lockstep_tail"}
    seg["mode"] = seg.pop("schedule")
    state = {"version": 2, "fingerprint": ds.fingerprint, "epoch": 0, "segments": [{"kind": "fresh", **seg, "consumed": [0, 0]}]}
    (old,) = read_state(state)["segments"]
    assert old["lockstep_tail"] == "bucketed"
    assert ds.make_plan(0, old).report["packed_tail_steps"] == 0
    assert ds.make_plan(0).report["packed_tail_steps"] >= 1


@pytest.mark.timeout(240)
def test_ddp_runner_two_ranks_two_workers_packed_tail_stays_aligned(synthetic_shards, tmp_path):
    """DataLoader workers interleave the lockstep batches and the tail packs (round robin): the ranks stay
    at the same plan step, take packs at the same steps, and every sample comes once, for two epochs."""
    shards = synthetic_shards([29, 3, 17, 11, 5, 23, 8, 14, 20, 6], seed=3, name="tail-ddp")
    run = {"name": "tail", "schedule": "lockstep", "num_workers": 2, "max_epochs": 2, "max_tokens": 512}
    run["runs_packs"] = True  # KeyRecorder declares runs_packed_batches: the DataModule plans a packed tail
    out = str(tmp_path)
    launch({"data": shards, "out": out, "world": 2, "runs": [run]}, out, timeout=220)
    rows = read_records(out, "tail", 2)
    for epoch in range(2):
        per_rank = epoch_rows(rows, epoch)
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        assert_each_key_once(per_rank, index_keys(shards), f"epoch {epoch}")
        for a, b in zip(*per_rank):
            assert a["step"] == b["step"] and a["packed"] == b["packed"]
            assert a["global_tokens"] == b["global_tokens"] == a["num_tokens"] + b["num_tokens"]
        assert any(r["packed"] for r in per_rank[0]), f"epoch {epoch} has no packed tail"

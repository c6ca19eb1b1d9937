"""Resume by position (issue 40): a rank continues its own plan at its position; another world size
replays the saved ranks one at a time into one flag per sample; every sample once across the kills."""

from __future__ import annotations

import collections
import copy
import os

import pytest
from _fixtures import index_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading import loader as loader_module
from lightning_adaptiveload.loading.resume import ResumeStateError, digest_text
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import ConsumedMask, consumed_refs, mark_consumed
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.index import ShardIndex

SIZES = [21, 4, 15, 9, 30, 7, 12, 18]  # 116 samples


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=5, name="resume-position-shards")


def make_dm(data, mp, rank, world, workers, schedule, chunk=None) -> AdaptiveLoadDataModule:
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule=schedule, chunk_samples=chunk if chunk is not None else 1_000_000),
        loader=Loader(num_workers=workers, seed=7),
    )
    dm.setup("fit")
    return dm


def take(dm, n, mp, rank, world) -> list[list[str]]:
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    out = []
    for batch in dm.train_dataloader():
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


def gathered_state(dms, mp) -> dict:
    """The state every rank's ``state_dict`` would give after the collective: each rank's count and part."""
    states = []
    for r, dm in enumerate(dms):
        mp.setattr(_dist, "rank_and_world", lambda trainer=None, r=r: (r, len(dms)))
        states.append(dm.state_dict())
    state = copy.deepcopy(states[0])
    seg = state["segments"][-1]
    seg["consumed"] = [s["segments"][-1]["consumed"][r] for r, s in enumerate(states)]
    seg["digests"] = [s["segments"][-1]["digests"][r] for r, s in enumerate(states)]
    parts = seg["digests"]
    seg["digest"] = None if None in parts else digest_text(sum(int(d, 16) for d in parts))
    return state


# -- ConsumedMask and mark_consumed ------------------------------------------------------------------


def test_consumed_mask_reads_as_a_dict_of_sets():
    mask = ConsumedMask([0, 3, 3, 7])
    assert len(mask) == 0 and not mask and mask.total() == 0 and list(mask) == []
    mask.mark(2, [1, 3])
    mask.mark(0, [0])
    assert dict(mask) == {0: {0}, 2: {1, 3}} and len(mask) == 2 and mask.total() == 3
    assert 2 in mask and 1 not in mask and "x" not in mask and mask.get(1) is None
    twin = mask.copy()
    twin.mark(1, [])
    mask.mark(2, [0])
    assert twin[2] == {1, 3} and mask[2] == {0, 1, 3}
    with pytest.raises(ValueError, match="shard 0 has 3 samples"):
        mask.mark(0, [3])
    with pytest.raises(ValueError, match="non-decreasing"):
        ConsumedMask([0, 5, 2])


@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
def test_consumed_mask_excludes_as_the_refs_do(shards, schedule):
    index = ShardIndex.load(os.path.join(shards, "index.json"))
    batcher = DualConstraintBatcher(512)
    plan = plan_epoch(index, 3, 2, batcher, 7, 0, settings=PlanSettings(schedule=schedule))
    refs = consumed_refs(plan, [2, 1, 3])
    mask = ConsumedMask.of_index(index)
    for r, k in enumerate([2, 1, 3]):
        mark_consumed(mask, plan, r, 0, k)
    assert {(s, i) for s, ids in mask.items() for i in ids} == refs
    a = plan_epoch(
        index,
        2,
        1,
        DualConstraintBatcher(512),
        7,
        0,
        exclude=refs,
        settings=PlanSettings(schedule=schedule, underfull="pad"),
    )
    b = plan_epoch(
        index,
        2,
        1,
        DualConstraintBatcher(512),
        7,
        0,
        exclude=mask,
        settings=PlanSettings(schedule=schedule, underfull="pad"),
    )
    assert a.streams == b.streams and a.step_order == b.step_order and a.report["excluded"] == len(refs)


def test_consumed_mask_excludes_from_a_plan_on_counts(shards, monkeypatch):
    from lightning_adaptiveload.planning import packed_counts

    monkeypatch.setattr(packed_counts, "TEMPLATE_SAMPLES", 30)
    index = ShardIndex.load(os.path.join(shards, "index.json"))
    plan = plan_epoch(index, 2, 0, DualConstraintBatcher(512), 7, 0, settings=PlanSettings(schedule="packed"))
    assert plan.report["planned_on_counts"]
    refs = consumed_refs(plan, 2)
    mask = ConsumedMask.of_index(index)
    for r in range(2):
        mark_consumed(mask, plan, r, 0, 2)
    a = plan_epoch(
        index,
        2,
        0,
        DualConstraintBatcher(512),
        7,
        0,
        exclude=refs,
        rank=1,
        settings=PlanSettings(schedule="packed"),
    )
    b = plan_epoch(
        index,
        2,
        0,
        DualConstraintBatcher(512),
        7,
        0,
        exclude=mask,
        rank=1,
        settings=PlanSettings(schedule="packed"),
    )
    assert a.streams == b.streams and a.report["excluded"] == b.report["excluded"] == len(refs)


def test_mark_consumed_refuses_another_ranks_plan(shards):
    index = ShardIndex.load(os.path.join(shards, "index.json"))
    plan = plan_epoch(index, 2, 0, DualConstraintBatcher(512), 7, 0, rank=1)
    mask = ConsumedMask.of_index(index)
    with pytest.raises(ValueError, match="no streams of rank 0"):
        mark_consumed(mask, plan, 0, 0, 1)
    with pytest.raises(ValueError, match="outside 0.."):
        mark_consumed(mask, plan, 1, 0, plan.steps + 1)


# -- the DataModule's resume ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
def test_a_continuation_plans_only_its_own_rank(shards, monkeypatch, schedule):
    """Before: every rank's plan was made (``rank=None``) and every consumed ref held as a tuple."""
    world = 4
    dms = [make_dm(shards, monkeypatch, r, world, 0, schedule) for r in range(world)]
    for r, dm in enumerate(dms):
        take(dm, 2, monkeypatch, r, world)
    state = gathered_state(dms, monkeypatch)
    ranks = []
    real = loader_module.plan_epoch

    def spy(*args, **kw):
        ranks.append(kw.get("rank"))
        return real(*args, **kw)

    monkeypatch.setattr(loader_module, "plan_epoch", spy)
    dm = make_dm(shards, monkeypatch, 2, world, 1, schedule)
    dm.load_state_dict(state)
    take(dm, None, monkeypatch, 2, world)
    assert ranks == [2] and dm._segments[-1]["kind"] == "continue"


def test_a_continuation_checks_its_own_part_of_the_digest(shards, monkeypatch):
    world = 2
    dms = [make_dm(shards, monkeypatch, r, world, 0, "lockstep") for r in range(world)]
    for r, dm in enumerate(dms):
        take(dm, 2, monkeypatch, r, world)
    state = gathered_state(dms, monkeypatch)
    assert None not in state["segments"][0]["digests"]
    state["segments"][0]["digests"][1] = "0" * 16
    dm = make_dm(shards, monkeypatch, 0, world, 0, "lockstep")
    dm.load_state_dict(copy.deepcopy(state))
    take(dm, 1, monkeypatch, 0, world)  # rank 0's part is intact
    dm = make_dm(shards, monkeypatch, 1, world, 0, "lockstep")
    dm.load_state_dict(copy.deepcopy(state))
    with pytest.raises(
        ResumeStateError, match=r"segments\[0\] consumed other samples.*0000000000000000 saved"
    ):
        take(dm, 1, monkeypatch, 1, world)


def test_another_world_size_checks_every_ranks_part(shards, monkeypatch):
    dms = [make_dm(shards, monkeypatch, r, 2, 0, "independent") for r in range(2)]
    for r, dm in enumerate(dms):
        take(dm, 2, monkeypatch, r, 2)
    state = gathered_state(dms, monkeypatch)
    state["segments"][0]["digests"][1] = "0" * 16
    dm = make_dm(shards, monkeypatch, 0, 3, 0, "independent")
    dm.load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"segments\[0\] consumed other samples"):
        take(dm, 1, monkeypatch, 0, 3)


_SEGMENT = st.tuples(
    st.integers(1, 4),  # world size
    st.integers(0, 2),  # workers
    st.floats(0.0, 0.9),  # share of the rest of the epoch each rank takes before the kill
    st.booleans(),  # ranks stop at different steps
)


@pytest.mark.timeout(600)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=st.sampled_from(["independent", "lockstep", "packed"]),
    chunk=st.sampled_from([None, 40]),
    kills=st.lists(_SEGMENT, min_size=1, max_size=3),
    last=st.tuples(st.integers(1, 4), st.integers(0, 2)),
)
def test_kill_and_resume_anywhere_reads_every_sample_once(shards, schedule, chunk, kills, last):
    keys = index_keys(shards)
    mp = pytest.MonkeyPatch()
    try:
        taken: list[list[str]] = []
        state = None
        for world, workers, share, uneven in kills:
            dms = [make_dm(shards, mp, r, world, workers, schedule, chunk) for r in range(world)]
            loaders = []
            for r, dm in enumerate(dms):
                if state is not None:
                    dm.load_state_dict(copy.deepcopy(state))
                mp.setattr(_dist, "rank_and_world", lambda trainer=None, r=r, w=world: (r, w))
                loaders.append(dm.train_dataloader())
                len(loaders[-1])  # plans this rank's (rest of the) epoch, as Lightning's len() does
            steps = dms[0].train_dataset.plan.steps
            # Each rank takes a share of the rest, then all are killed (uneven: rank r stops r steps earlier).
            counts = [max(0, int(share * steps) - (r if uneven else 0)) for r in range(world)]
            for r, loader in enumerate(loaders):
                got = _first(loader, counts[r])
                assert len(got) == counts[r]
                taken += got
            state = gathered_state(dms, mp)
        world, workers = last
        rests = []
        for r in range(world):
            dm = make_dm(shards, mp, r, world, workers, schedule, chunk)
            dm.load_state_dict(copy.deepcopy(state))
            rests.append(take(dm, None, mp, r, world))
        assert len({len(x) for x in rests}) == 1, "resumed ranks must have equal step counts"
        seen = collections.Counter(k for b in taken + [b for x in rests for b in x] for k in b)
        assert sorted(seen) == sorted(keys) and max(seen.values()) == 1, (schedule, chunk, kills, last)
    finally:
        mp.undo()


def _first(loader, n: int) -> list[list[str]]:
    out: list[list[str]] = []
    if n:
        for batch in loader:
            out.append(batch["keys"])
            if len(out) == n:
                break
    return out

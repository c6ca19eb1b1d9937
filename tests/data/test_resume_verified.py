"""Every resume verified or refused (issue 63): a saved position whose replay cannot be checked against a
digest is refused naming the field, or resumed with ``Loader(resume_unverified=True)`` and a warning; a
version 2 state of several ranks is checked by its whole digest; a state of a later epoch is refused."""

from __future__ import annotations

import collections
import copy

import pytest
from _fixtures import index_keys

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.resume import ResumeStateError, digest_text, read_state
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching

SIZES = [9, 4, 7, 12, 10, 6]  # 48 samples


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=11, name="resume-verified-shards")


def make_dm(data, mp, rank, world, seed=7, unverified=False) -> AdaptiveLoadDataModule:
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0, seed=seed, resume_unverified=unverified),
    )
    dm.setup("fit")
    return dm


def take(dm, n, mp, rank, world):
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    out = []
    for batch in dm.train_dataloader():
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def two_ranks(shards):
    """A state two ranks saved after 2 steps each (as the collective gathers it), and what they read."""
    mp = pytest.MonkeyPatch()
    try:
        dms = [make_dm(shards, mp, r, 2) for r in range(2)]
        first = [take(dm, 2, mp, r, 2) for r, dm in enumerate(dms)]
        states = []
        for r, dm in enumerate(dms):
            mp.setattr(_dist, "rank_and_world", lambda trainer=None, r=r: (r, 2))
            states.append(dm.state_dict())
        state = copy.deepcopy(states[0])
        seg = state["segments"][0]
        seg["digests"] = [s["segments"][0]["digests"][r] for r, s in enumerate(states)]
        seg["digest"] = digest_text(sum(int(d, 16) for d in seg["digests"]))
        return state, first
    finally:
        mp.undo()


def _as_v2(state):
    """``state`` as version 2 wrote it: the whole digest, no per-rank parts, the schedule under ``mode``."""
    old = copy.deepcopy(state)
    old["version"] = 2
    for seg in old["segments"]:
        seg["mode"] = seg.pop("schedule")
        del seg["digests"]
    return old


def _resume_all(shards, state, mp, seed=7, unverified=False):
    rest = []
    for r in range(2):
        dm = make_dm(shards, mp, r, 2, seed=seed, unverified=unverified)
        dm.load_state_dict(copy.deepcopy(state))
        rest.append(take(dm, None, mp, r, 2))
    return rest


def _once(shards, first, rest):
    seen = collections.Counter(k for part in first + rest for b in part for k in b)
    return sorted(seen) == sorted(index_keys(shards)) and max(seen.values()) == 1


def test_a_version_2_state_of_two_ranks_with_a_changed_seed_is_refused(shards, two_ranks, monkeypatch):
    """Before: 11 of 48 samples read twice and 9 never, silently (the whole digest was checked only on one
    rank)."""
    state, first = two_ranks
    v2 = _as_v2(state)
    assert _once(shards, first, _resume_all(shards, v2, monkeypatch))  # unchanged: exactly once
    edited = copy.deepcopy(v2)
    edited["segments"][0]["seed"] = 8
    for r in range(2):
        dm = make_dm(shards, monkeypatch, r, 2)
        dm.load_state_dict(copy.deepcopy(edited))
        with pytest.raises(ResumeStateError, match=r"segments\[0\] consumed other samples.*seed 8"):
            take(dm, 1, monkeypatch, r, 2)


def test_null_per_rank_digests_are_checked_by_the_whole_digest(shards, two_ranks, monkeypatch):
    state, first = two_ranks
    nulls = copy.deepcopy(state)
    nulls["segments"][0]["digests"] = [None, None]
    assert _once(shards, first, _resume_all(shards, nulls, monkeypatch))
    nulls["segments"][0]["seed"] = 8
    dm = make_dm(shards, monkeypatch, 1, 2)
    dm.load_state_dict(copy.deepcopy(nulls))
    with pytest.raises(ResumeStateError, match="consumed other samples"):
        take(dm, 1, monkeypatch, 1, 2)


def test_every_digest_null_is_refused_naming_the_fields(shards, two_ranks, monkeypatch):
    state, _ = two_ranks
    nulls = copy.deepcopy(state)
    nulls["segments"][0]["digests"] = [None, None]
    nulls["segments"][0]["digest"] = None
    nulls["segments"][0]["seed"] = 8
    for r in range(2):
        dm = make_dm(shards, monkeypatch, r, 2)
        dm.load_state_dict(copy.deepcopy(nulls))
        with pytest.raises(ResumeStateError) as err:
            take(dm, 1, monkeypatch, r, 2)
        text = str(err.value)
        assert "segments[0].digest and segments[0].digests hold no digest" in text
        assert "Loader(resume_unverified=True)" in text and "What to do" in text


def test_another_world_size_with_no_digest_is_refused(shards, two_ranks, monkeypatch):
    """The replan path (another world size) refuses a segment with no digest too."""
    state, _ = two_ranks
    nulls = copy.deepcopy(state)
    nulls["segments"][0]["digests"] = None
    nulls["segments"][0]["digest"] = None
    dm = make_dm(shards, monkeypatch, 0, 1)
    dm.load_state_dict(nulls)
    with pytest.raises(ResumeStateError, match=r"segments\[0\]\.digest and segments\[0\]\.digests"):
        take(dm, 1, monkeypatch, 0, 1)


def test_one_rank_with_null_digests_is_refused_and_resumes_with_the_opt_in(shards, monkeypatch, caplog):
    """Before: one rank, digests null, seed changed: 6 repeated and 4 missing, silently."""
    dm = make_dm(shards, monkeypatch, 0, 1)
    first = take(dm, 2, monkeypatch, 0, 1)
    state = dm.state_dict()
    state["segments"][0]["digest"] = None
    state["segments"][0]["digests"] = [None]
    dm = make_dm(shards, monkeypatch, 0, 1)
    dm.load_state_dict(copy.deepcopy(state))
    with pytest.raises(ResumeStateError, match="hold no digest that the replay on rank 0 can check"):
        take(dm, 1, monkeypatch, 0, 1)
    dm = make_dm(shards, monkeypatch, 0, 1, unverified=True)
    dm.load_state_dict(copy.deepcopy(state))
    with caplog.at_level("WARNING"):
        rest = take(dm, None, monkeypatch, 0, 1)
    assert "resume_unverified" in caplog.text and "not verified" in caplog.text
    assert "2 consumed batches" in caplog.text
    seen = collections.Counter(k for b in first + rest for k in b)
    assert sorted(seen) == sorted(index_keys(shards)) and max(seen.values()) == 1  # settings unchanged


def test_a_state_of_a_later_epoch_is_refused(shards, monkeypatch):
    """Before: dropped with an information line ("starting fresh"): epochs 0-4 trained again silently."""
    dm = make_dm(shards, monkeypatch, 0, 1)
    take(dm, 2, monkeypatch, 0, 1)
    state = dm.state_dict()
    state["epoch"] = 5
    dm = make_dm(shards, monkeypatch, 0, 1)
    dm.load_state_dict(state)
    with pytest.raises(ResumeStateError) as err:
        take(dm, 1, monkeypatch, 0, 1)
    text = str(err.value)
    assert "epoch is 5, but training is at epoch 0" in text and "key 'AdaptiveLoadDataModule'" in text


def test_a_wrong_consumed_length_names_the_rank_count_and_the_key(two_ranks):
    state = copy.deepcopy(two_ranks[0])
    state["segments"][0]["consumed"] = [2, 2, 2]
    with pytest.raises(ResumeStateError) as err:
        read_state(state, "checkpoint last.ckpt, key 'AdaptiveLoadDataModule'")
    text = str(err.value)
    assert text.startswith("checkpoint last.ckpt, key 'AdaptiveLoadDataModule': ")
    assert "segments[0].consumed is list [2, 2, 2]; expected a list of 2 batch counts" in text
    assert "segments[0].world_size = 2" in text
    dm = AdaptiveLoadDataModule(train_shards="unused", loader=Loader(num_workers=0))
    with pytest.raises(
        ResumeStateError, match=r"^checkpoint, key 'AdaptiveLoadDataModule': .*world_size = 2"
    ):
        dm.load_state_dict(state)


def test_resume_unverified_must_be_a_bool():
    with pytest.raises(ValueError, match="resume_unverified must be True or False, got 'yes'"):
        Loader(resume_unverified="yes")

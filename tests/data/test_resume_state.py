"""A checkpoint's data position as untrusted input (issue 42): its schema, its bounds, and the digest of
the consumed samples that the replayed epoch must reproduce. Plus a fuzz of mutated states."""

from __future__ import annotations

import collections
import copy
import random
import time

import pytest
from _fixtures import index_keys

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.resume import STATE_VERSION, ResumeStateError, check_state, read_state
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching

SIZES = [9, 4, 7, 12]


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards(SIZES, seed=3, name="resume-state-shards")


def make_dm(data: str, monkeypatch, rank: int = 0, world: int = 1, seed: int = 7) -> AdaptiveLoadDataModule:
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0, seed=seed),
    )
    dm.setup("fit")
    return dm


def take(dm, n):
    out = []
    for batch in dm.train_dataloader():
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def saved(shards):
    mp = pytest.MonkeyPatch()
    try:
        dm = make_dm(shards, mp)
        first = take(dm, 2)
        return dm.state_dict(), first
    finally:
        mp.undo()


def test_state_holds_a_digest_the_resume_verifies(shards, saved, monkeypatch):
    state, first = saved
    assert state["version"] == STATE_VERSION == 4 and len(state["segments"][0]["digest"]) == 16
    assert state["segments"][0]["digests"] == [state["segments"][0]["digest"]]  # one rank: its part is all
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(copy.deepcopy(state))
    rest = take(dm, None)
    seen = collections.Counter(k for b in first + rest for k in b)
    assert sorted(seen) == sorted(index_keys(shards)) and max(seen.values()) == 1


def test_changed_seed_is_refused_not_replayed(shards, saved, monkeypatch):
    """Before: the replay used the edited seed silently (1 sample repeated, 1 missing)."""
    state = copy.deepcopy(saved[0])
    state["segments"][0]["seed"] = 8
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(state)
    with pytest.raises(ResumeStateError) as err:
        take(dm, 1)
    message = str(err.value)
    assert "segments[0] consumed other samples than its replay gives" in message
    assert "seed 8" in message and "What to do" in message and saved[0]["segments"][0]["digest"] in message


def test_planner_change_is_refused(shards, saved, monkeypatch):
    """A planner that deals the same epoch differently (as a new version might) is caught by the digest."""
    from lightning_adaptiveload.loading import loader

    real = loader.plan_epoch

    def other_planner(index, world, workers, batcher, seed, epoch, *args, **kw):
        return real(index, world, workers, batcher, seed + 1, epoch, *args, **kw)

    monkeypatch.setattr(loader, "plan_epoch", other_planner)
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(copy.deepcopy(saved[0]))
    with pytest.raises(ResumeStateError, match="consumed other samples"):
        take(dm, 1)


def test_version_1_state_without_digest_is_refused_or_resumed_with_the_opt_in(
    shards, saved, monkeypatch, caplog
):
    """Before: a version 1 state (no digest) resumed with a bare "not verified" warning; now it is refused
    naming the fields, and resumes only with ``Loader(resume_unverified=True)``, which says what may repeat."""
    state = copy.deepcopy(saved[0])
    state["version"] = 1
    del state["segments"][0]["digest"], state["segments"][0]["digests"]  # layout 1 had neither
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(copy.deepcopy(state))
    with pytest.raises(
        ResumeStateError, match=r"segments\[0\]\.digest and segments\[0\]\.digests hold no digest"
    ):
        take(dm, 1)
    monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (0, 1))
    dm = AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0, seed=7, resume_unverified=True),
    )
    dm.setup("fit")
    dm.load_state_dict(state)
    with caplog.at_level("WARNING"):
        rest = take(dm, None)
    assert rest and "resume_unverified" in caplog.text and "2 consumed batches" in caplog.text


def _as_0_1_0(state: dict) -> dict:
    """``state`` in the layout 0.1.0 wrote (version 3): each segment's schedule under ``mode``."""
    old = copy.deepcopy(state)
    old["version"] = 3
    for seg in old["segments"]:
        seg["mode"] = seg.pop("schedule")
    return old


def test_a_0_1_0_state_is_read_through_the_one_migration(saved):
    state = saved[0]
    old = _as_0_1_0(state)
    before = copy.deepcopy(old)
    assert read_state(old) == state  # the current layout, key for key
    assert old == before  # the saved state itself is left as it was
    # Older still: the batcher's sizing rule under "mode", no lockstep tail or chunking saved (version 1).
    older = copy.deepcopy(old)
    older["version"] = 1
    seg = older["segments"][0]
    seg["batcher"]["mode"] = seg["batcher"].pop("sizing")
    for key in ("lockstep_tail", "chunk_samples", "digest", "digests"):
        seg.pop(key)
    (got,) = read_state(older)["segments"]
    assert got["schedule"] == state["segments"][0]["schedule"] and "mode" not in got
    assert got["batcher"]["sizing"] == state["segments"][0]["batcher"]["sizing"] and "mode" not in got["batcher"]
    assert (got["lockstep_tail"], got["chunk_samples"]) == ("bucketed", None)
    # The current layout is not migrated: a version-4 state with the old key lacks the new one.
    mixed = copy.deepcopy(old)
    mixed["version"] = STATE_VERSION
    with pytest.raises(ResumeStateError, match=r"segments\[0\] lacks \['schedule'\]"):
        check_state(mixed)


def test_a_0_1_0_state_resumes_every_sample_once(shards, saved, monkeypatch):
    state, first = saved
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(_as_0_1_0(state))
    rest = take(dm, None)
    seen = collections.Counter(k for b in first + rest for k in b)
    assert sorted(seen) == sorted(index_keys(shards)) and max(seen.values()) == 1
    assert dm.state_dict()["segments"][-1]["schedule"] == state["segments"][0]["schedule"]


def test_the_0_1_0_quickstart_checkpoints_state_is_read():
    """The DataModule state of the quickstart checkpoint 0.1.0 wrote (``tests/assets``), read as this
    release's layout (the whole resume of it: ``tests/cli/test_resume_v010.py``)."""
    import torch
    from _paths import ASSETS

    saved = torch.load(ASSETS / "quickstart_v0.1.0_step30.ckpt", map_location="cpu", weights_only=True)
    old = saved["AdaptiveLoadDataModule"]
    assert old["version"] == 3 and "mode" in old["segments"][0]
    state = read_state(old)
    (seg,) = state["segments"]
    assert state["version"] == STATE_VERSION and seg["schedule"] == "lockstep" and "mode" not in seg
    assert seg["consumed"] == [30, 30] and seg["digests"] == old["segments"][0]["digests"]


def _edit(state, path, value):
    target = state
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, words",
    [
        # Before: AttributeError, a bare AssertionError, KeyError: 'kind', invalid literal for int().
        ((), None, "the state is NoneType None, not a dict"),
        (("segments",), [], "segments is list []; expected a list of 1 to"),
        (("segments", 0, "kind"), _DELETE, "segments[0] lacks ['kind']"),
        (
            ("segments", 0, "consumed"),
            [1, 2],
            "segments[0].consumed is list [1, 2]; expected a list of 1 batch counts, one per rank of "
            "segments[0].world_size = 1",
        ),
        (("segments", 0, "consumed", 0), "x", "segments[0].consumed[0] is str 'x'"),
        (
            ("segments", 0, "world_size"),
            10**9,
            "segments[0].world_size is int 1000000000; expected an integer in [1, 65536]",
        ),
        (("segments", 0, "num_workers"), 10**6, "segments[0].num_workers is int 1000000"),
        (("segments", 0, "seed"), True, "segments[0].seed is bool True"),
        (("segments", 0, "lockstep_tolerance"), float("nan"), "lockstep_tolerance is float nan"),
        (("segments", 0, "digest"), "zz", "segments[0].digest is str 'zz'; expected 16 hex digits"),
        (("epoch",), -1, "epoch is int -1"),
        (("fingerprint",), 5, "fingerprint is int 5, not a string"),
        (("segments", 0), "fresh", "segments[0] is str 'fresh', not a dict"),
    ],
)
def test_malformed_state_is_refused_on_load_naming_the_field(saved, path, value, words):
    state = copy.deepcopy(saved[0])
    if path:
        _edit(state, path, value)
    else:
        state = value
    with pytest.raises(ResumeStateError) as err:
        check_state(state)
    assert words in str(err.value) and "What to do" in str(err.value), str(err.value)


def test_replay_errors_name_the_segment(shards, saved, monkeypatch):
    state = copy.deepcopy(saved[0])
    state["segments"][0]["schedule"] = "sideways"
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(state)
    with pytest.raises(
        ResumeStateError, match=r"segments\[0\] cannot be replayed \(ValueError: schedule must be one of"
    ):
        take(dm, 1)
    state["segments"][0]["schedule"] = saved[0]["segments"][0]["schedule"]
    state["segments"][0]["batcher"] = {"max_tokenz": 5}
    dm = make_dm(shards, monkeypatch)
    dm.load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"segments\[0\] cannot be replayed \(TypeError"):
        take(dm, 1)


# ------------------------------------------------------------------------------------------------
# Fuzz: mutated states give a ValueError naming the problem, or resume every sample exactly once
# ------------------------------------------------------------------------------------------------

_VALUES = [
    None,
    -1,
    0,
    1,
    2,
    3,
    10**9,
    2**63,
    -(2**63),
    1.5,
    float("nan"),
    float("inf"),
    True,
    "",
    "x",
    "fresh",
    "continue",
    "replan",
    "lockstep",
    [],
    [0],
    [1, 2],
    {},
    {"a": 1},
    [[[]]],
]


def _mutate(rng: random.Random, state: dict) -> dict:
    state = copy.deepcopy(state)
    for _ in range(rng.choice([1, 1, 2, 3])):
        segs = state.get("segments")
        seg = rng.choice(segs) if isinstance(segs, list) and segs else None
        seg = seg if isinstance(seg, dict) else None
        r = rng.random()
        if r < 0.5 and seg is not None:
            key = rng.choice(sorted(seg) + ["extra"])
            if rng.random() < 0.15:
                seg.pop(key, None)
            else:
                seg[key] = copy.deepcopy(rng.choice(_VALUES))
        elif r < 0.65 and seg is not None and isinstance(seg.get("batcher"), dict):
            key = rng.choice(sorted(seg["batcher"]) + ["extra"])
            seg["batcher"][key] = copy.deepcopy(rng.choice(_VALUES))
        elif r < 0.8:
            key = rng.choice(["version", "fingerprint", "epoch", "segments"])
            state[key] = copy.deepcopy(rng.choice(_VALUES))
        elif r < 0.9 and seg is not None:
            segs.append(copy.deepcopy(seg))
        elif seg is not None and isinstance(seg.get("consumed"), list):
            seg["consumed"] = [rng.choice([0, 1, 2, 3, 50, -1]) for _ in seg["consumed"]]
    return state


@pytest.mark.timeout(120)
def test_fuzz_resume_states(shards, saved, monkeypatch):
    base, first = saved
    keys = sorted(index_keys(shards))
    dm = make_dm(shards, monkeypatch)
    outcomes = collections.Counter()
    t0 = time.perf_counter()
    for case in range(1000):
        state = _mutate(random.Random(4 * 10**6 + case), base)
        try:
            dm.load_state_dict(state)
            ds = dm.train_dataset
            dm._resume, resume = None, dm._resume
            if resume is None or int(resume["epoch"]) != 0:
                outcomes["other epoch"] += 1
                continue
            dm._resume_plan(ds, resume)
        except ValueError as err:  # ResumeStateError or the fingerprint refusal: a clear message
            assert (
                "resume" in str(err).lower() or "checkpoint" in str(err).lower() or "version" in str(err)
            ), (case, err)
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001
            raise AssertionError(f"resume state case {case}: {type(err).__name__}: {err}") from err
        outcomes["resumed"] += 1
        # What resumed is the true remainder: every sample once with what was consumed.
        seg = resume["segments"][0]
        if len(resume["segments"]) == 1 and seg["consumed"] == [2] and seg.get("digest"):
            assert dm._segments[0]["digest"] == base["segments"][0]["digest"]
    assert time.perf_counter() - t0 < 60
    assert outcomes["refused"] > 500 and outcomes["resumed"] > 20, outcomes
    del keys, first

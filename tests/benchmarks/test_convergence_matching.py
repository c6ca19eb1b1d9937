"""``benchmarks/balance/convergence.py --match-tokens``: the packed cap it picks gives the tokens per step
of ``independent``, and the training loader at that cap yields what the plans promised."""

import argparse
import os

import pytest
from _paths import ROOT

from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

BALANCE = str(ROOT / "benchmarks" / "balance")


@pytest.fixture(scope="module")
def conv():
    import sys

    sys.path.insert(0, os.path.abspath(BALANCE))
    try:
        import convergence
    finally:
        sys.path.remove(os.path.abspath(BALANCE))
    return convergence


@pytest.fixture(scope="module")
def train(synthetic_shards):
    return synthetic_shards([16] * 6, seed=0, name="train", text_len_range=None)


@pytest.mark.parametrize("world_size", [1, 2])
def test_matched_packed_cap_meets_independent_tokens_per_step(conv, train, world_size):
    probe = conv.PlanProbe(world_size=world_size, seeds=(0, 1), epochs=2)
    independent = conv.planned_tokens_per_step(train, "independent", 1024, probe)
    unmatched = conv.planned_tokens_per_step(train, "packed", 1024, probe)
    # The premise: at one cap, packs fill it better and take fewer, larger steps.
    assert unmatched["tokens_per_step"] > 1.05 * independent["tokens_per_step"]
    # Every sample once per epoch in both: the same tokens per epoch whatever the cap.
    assert unmatched["tokens_per_epoch"] == independent["tokens_per_epoch"]
    matched = conv.match_max_tokens(train, "packed", independent["tokens_per_step"], probe, (256, 1024))
    assert 256 <= matched["max_tokens"] < 1024
    assert abs(matched["relative_gap"]) <= 0.02
    assert matched["relative_gap"] == pytest.approx(
        matched["tokens_per_step"] / independent["tokens_per_step"] - 1.0
    )
    assert abs(matched["steps_per_epoch"] / independent["steps_per_epoch"] - 1.0) <= 0.02
    # The reported figures are those of a fresh plan at the chosen cap.
    again = conv.planned_tokens_per_step(train, "packed", matched["max_tokens"], probe)
    assert again["tokens_per_step"] == matched["tokens_per_step"]


def test_planned_tokens_per_step_is_what_the_training_loader_yields(conv, train):
    from lightning_adaptiveload import AdaptiveLoadDataModule

    probe = conv.PlanProbe(world_size=1, seeds=(3,), epochs=1)
    planned = conv.planned_tokens_per_step(train, "packed", 600, probe)
    dm = AdaptiveLoadDataModule(
        train_shards=train,
        batching=Batching(max_tokens=600, sizing="equal_tokens"),
        plan=PlanSettings(schedule="packed"),
        loader=Loader(num_workers=0, seed=3),
    )
    dm.setup("fit")
    tokens = [int(b["num_tokens"]) for b in dm.train_dataloader()]
    assert len(tokens) == planned["steps_per_epoch"]
    assert sum(tokens) == planned["tokens_per_epoch"]
    assert max(tokens) <= 600


def test_matched_max_tokens_leaves_the_bucketed_schedules_at_the_given_cap(conv, train):
    args = argparse.Namespace(
        devices=1,
        seeds=[0],
        match_epochs=1,
        schedules="independent,lockstep,packed",
        max_tokens=1024,
        match_tokens=True,
        match_min_tokens=256,
    )
    caps, planned = conv.matched_max_tokens(train, args)
    assert caps["independent"] == caps["lockstep"] == 1024 and caps["packed"] < 1024
    assert set(planned["per_schedule"]) == {"independent", "lockstep", "packed"}
    args.match_tokens = False
    caps, _ = conv.matched_max_tokens(train, args)
    assert caps == {"independent": 1024, "lockstep": 1024, "packed": 1024}


def test_match_max_tokens_refuses_empty_bounds(conv, train):
    probe = conv.PlanProbe(world_size=1, seeds=(0,), epochs=1)
    with pytest.raises(ValueError, match="1 <= low <= high"):
        conv.match_max_tokens(train, "packed", 500.0, probe, (900, 300))


def test_validation_batches_keep_their_cap_when_training_is_matched(conv, train, tmp_path):
    dm = conv._ValidationAtCap(
        val_max_tokens=1024,
        train_shards=train,
        val_shards=train,
        batching=Batching(max_tokens=600, sizing="equal_tokens"),
        plan=PlanSettings(schedule="packed"),
        loader=Loader(num_workers=0),
    )
    dm.setup("fit")
    assert dm.train_dataset.batcher.max_tokens == 600
    assert dm.val_dataset.batcher.max_tokens == 1024
    assert dm.batcher.max_tokens == 600  # the training batcher is put back


RESULTS = str(ROOT / "benchmarks" / "results")
MATCHED = os.path.join(RESULTS, "convergence_matched_cpu_2026-11-27.json")
UNMATCHED = os.path.join(RESULTS, "convergence_cpu_2026-11-23.json")


def _packed_only(path):
    import json

    with open(path) as f:
        result = json.load(f)
    result["runs"] = [r for r in result["runs"] if r["schedule"] == "packed"]
    result["settings"]["schedules"] = ["packed"]
    return result


def test_reused_runs_are_the_runs_a_fresh_matched_run_made(conv):
    """The recorded matched run trained all three schedules; its independent and lockstep runs (same cap
    as the unmatched run) equal the unmatched run's, which is what lets ``--reuse`` skip them."""
    import json

    with open(MATCHED) as f:
        full = json.load(f)
    merged = _packed_only(MATCHED)
    conv.merge_reused(merged, UNMATCHED)
    assert merged["settings"]["schedules"] == ["independent", "lockstep", "packed"]
    assert merged["settings"]["max_tokens_per_schedule"]["independent"] == 1024
    for schedule in ("independent", "lockstep"):
        fresh = {
            r["seed"]: [e["val_loss"] for e in r["epochs"]] for r in full["runs"] if r["schedule"] == schedule
        }
        reused = [r for r in merged["runs"] if r["schedule"] == schedule]
        assert [r["seed"] for r in reused] == full["settings"]["seeds"]
        assert all(r["reused_from"].endswith("convergence_cpu_2026-11-23.json") for r in reused)
        got = {r["seed"]: [e["val_loss"] for e in r["epochs"]] for r in reused}
        assert got.keys() == fresh.keys()
        for seed, curve in fresh.items():  # float32 rounding: equal to ~1e-7
            assert got[seed] == pytest.approx(curve, abs=1e-6)
    paired = conv.summarise(merged["runs"])["packed"]["paired_final_minus_independent"]
    want = full["summary"]["packed"]["paired_final_minus_independent"]
    assert paired["per_seed"] == pytest.approx(want["per_seed"], abs=1e-6)


def test_reuse_refuses_a_result_with_other_settings(conv):
    merged = _packed_only(MATCHED)
    merged["settings"]["epochs"] = 3
    with pytest.raises(ValueError, match="'epochs'"):
        conv.merge_reused(merged, UNMATCHED)
    merged = _packed_only(MATCHED)
    merged["settings"]["seeds"] = [0, 9]
    with pytest.raises(ValueError, match=r"seeds \[9\]"):
        conv.merge_reused(merged, UNMATCHED)

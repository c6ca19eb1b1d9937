"""A validation set with fewer samples than ranks (issue 13): padded with a zero-weight step, or refused.

Two real processes (gloo, CPU) through the real DataModule; the launcher kills them on a hang.
"""

from __future__ import annotations

import json
import os

import pytest
from _ddp_data_runner import launch
from _paths import TESTS

from lightning_adaptiveload.planning.plan import PlanError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.reader import iter_shard
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

RUNNER = str(TESTS / "_ddp_val_runner.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("underfull")
    train, val = str(root / "train"), str(root / "val")
    write_synthetic_shards(
        train,
        settings=SyntheticShards(mix="tiny", num_samples=8, samples_per_shard=4, seed=0),
        progress=False,
    )
    write_synthetic_shards(
        val, settings=SyntheticShards(mix="tiny", num_samples=1, samples_per_shard=1, seed=1), progress=False
    )
    return {"train": train, "val": val}


def test_one_validation_sample_on_two_ranks_pads_a_zero_weight_step(data, tmp_path):
    out = str(tmp_path)
    cfg = {**data, "out": out, "world": 2, "val_underfull": "pad"}
    launch(cfg, out, timeout=240, script=RUNNER)
    ranks = [json.load(open(os.path.join(out, f"val.rank{r}.json"))) for r in range(2)]
    assert all("error" not in r for r in ranks), ranks
    seen = sorted((b["batch_size"], b["num_tokens"] > 0) for r in ranks for b in r["seen"])
    assert seen == [(0, False), (1, True)], "one rank takes the sample, the other one empty batch"
    # The right metric: the one sample's own value, not its average with the empty rank's zero.
    shard = ShardIndex.load(os.path.join(data["val"], "index.json")).shards[0]
    (sample,) = list(iter_shard(shard))
    expected = float(sample["latent"].double().square().mean())
    assert ranks[0]["probe"] == ranks[1]["probe"] == pytest.approx(expected, rel=1e-5)
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"] and ranks[0]["val_loss"] > 0


def test_error_policy_refuses_a_validation_set_smaller_than_the_world(data):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule, PlannedShardDataset
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.settings import PlanSettings

    index = ShardIndex.load(os.path.join(data["val"], "index.json"))
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(512), PlanSettings(underfull="error"), placement=(0, 2)
    )
    with pytest.raises(
        PlanError, match=r"world size 2: 1 samples in 1 shards leave 1 rank\(s\) without any sample"
    ):
        ds.begin_epoch(0)
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(512), PlanSettings(underfull="pad"), placement=(0, 2)
    )
    assert ds.begin_epoch(0).report["empty_batches"] == 1
    with pytest.raises(ValueError, match=r"underfull must be one of \('error', 'pad'\), got 'skip'"):
        AdaptiveLoadDataModule(train_shards=data["train"], val_underfull="skip")


def test_rest_of_a_resumed_epoch_with_fewer_samples_than_ranks_is_padded(data):
    """Resuming near the end of an epoch on more ranks leaves fewer samples than ranks: planned, not refused."""
    from lightning_adaptiveload.datamodule import PlannedShardDataset
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    index = ShardIndex.load(os.path.join(data["train"], "index.json"))
    ds = PlannedShardDataset(
        index, DualConstraintBatcher(512), num_workers=2, placement=(0, 4)
    )  # underfull="error"
    refs = [(s, i) for s, shard in enumerate(index.shards) for i in range(len(shard.keys))]
    plan = ds.make_plan(0, exclude=set(refs[:-2]))  # two samples left for four ranks
    assert plan.report["samples"] == 2 and plan.report["empty_batches"] == 2
    assert all(len(order) == plan.steps for order in plan.step_order)

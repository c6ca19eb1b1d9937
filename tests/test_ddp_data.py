"""Real multi-process DDP on CPU (gloo): no hang, equal steps, every sample exactly once.

The runs are launched as separate processes (``tests/_ddp_data_runner.py``, torchrun-style environment), so
that one launch runs several fits; one test also uses Lightning's own ``ddp_spawn``.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import launch, read_records  # noqa: E402

from lightning_adaptiveload.data import ShardIndex, write_synthetic_shards  # noqa: E402

# Uneven shard sizes: from 3 to 29 samples.
SIZES = [29, 3, 17, 11, 5, 23, 8, 14, 20, 6]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("ddp-shards"))
    write_synthetic_shards(
        d, mix="tiny", num_samples=sum(SIZES), samples_per_shard=SIZES, seed=3, progress=False
    )
    return d


def all_keys(data: str) -> list[str]:
    return [k for s in ShardIndex.load(os.path.join(data, "index.json")).shards for k in s.keys]


def check_epochs(rows: list[list[dict]], keys: list[str], epochs: range, lockstep: bool) -> None:
    world = len(rows)
    for epoch in epochs:
        per_rank = [[r for r in rank_rows if r["epoch"] == epoch] for rank_rows in rows]
        steps = [len(x) for x in per_rank]
        assert len(set(steps)) == 1 and steps[0] > 0, f"epoch {epoch}: unequal step counts {steps}"
        seen = collections.Counter(k for x in per_rank for r in x for k in r["keys"])
        assert sorted(seen) == sorted(keys), f"epoch {epoch}: missing {set(keys) - set(seen)}"
        assert max(seen.values()) == 1, f"epoch {epoch}: repeated {[k for k, n in seen.items() if n > 1]}"
        for k in range(steps[0]):
            at = [x[k] for x in per_rank]
            assert len({r["step"] for r in at}) == 1, "ranks are at different plan steps"
            assert len({r["global_tokens"] for r in at}) == 1
            assert at[0]["global_tokens"] == sum(r["num_tokens"] for r in at)
        if lockstep and world > 1:
            equal = sum(
                len({(r["batch_size"], r["seq_len"]) for r in (x[k] for x in per_rank)}) == 1
                for k in range(steps[0])
            )
            assert equal >= 0.8 * steps[0], f"epoch {epoch}: only {equal}/{steps[0]} lockstep steps equal"


@pytest.mark.timeout(240)
def test_ddp_two_ranks_both_schedules_0_and_2_workers(shards, tmp_path):
    runs = [
        {"name": f"{sched}-w{w}", "schedule": sched, "num_workers": w, "max_epochs": 2, "max_tokens": 512}
        for sched in ("independent", "lockstep")
        for w in (0, 2)
    ]
    out = str(tmp_path)
    launch({"data": shards, "out": out, "world": 2, "runs": runs}, out, timeout=220)
    keys = all_keys(shards)
    for run in runs:
        rows = read_records(out, run["name"], 2)
        check_epochs(rows, keys, range(2), lockstep=run["schedule"] == "lockstep")
        report = json.load(open(os.path.join(out, run["name"] + ".report.json")))
        assert report["samples"] == len(keys) and report["padding_tokens"] == 0
        assert report["steps"] == len([r for r in rows[0] if r["epoch"] == 1])


@pytest.mark.timeout(180)
def test_ddp_spawn_two_ranks(shards, tmp_path):
    """Lightning's own ddp_spawn launcher (the data module and model are pickled to the workers)."""
    import lightning.pytorch as pl
    from _ddp_data_runner import KeyRecorder

    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

    base = str(tmp_path / "spawn")
    dm = AdaptiveLoadDataModule(train_shards=shards, max_tokens=512, schedule="lockstep", num_workers=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = KeyRecorder(base + ".rank{}.jsonl")
    trainer.fit(model, datamodule=dm)
    rows = [[json.loads(line) for line in open(base + f".rank{r}.jsonl")] for r in range(2)]
    check_epochs(rows, all_keys(shards), range(1), lockstep=True)

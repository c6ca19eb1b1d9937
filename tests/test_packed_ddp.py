"""A 2-process gloo fit of the tiny VideoDiT with schedule="packed" through the DataModule (CPU)."""

from __future__ import annotations

import os
import sys

from lightning_adaptiveload.data import ShardIndex, write_synthetic_shards
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

sys.path.insert(0, os.path.dirname(__file__))
from _recording import fit_two_ranks  # noqa: E402

SIZES = [9, 3, 7, 5]
MAX_TOKENS = 768


def test_packed_fit_two_ranks(tmp_path):
    data = str(tmp_path / "shards")
    write_synthetic_shards(
        data, mix="tiny", num_samples=sum(SIZES), samples_per_shard=SIZES, seed=5, progress=False
    )
    base = str(tmp_path / "rec.rank{}.jsonl")
    dm = AdaptiveLoadDataModule(train_shards=data, max_tokens=MAX_TOKENS, schedule="packed", num_workers=0)
    rows = fit_two_ranks(dm, base)
    assert len(rows[0]) == len(rows[1]) > 0  # equal steps
    assert all(r["packed"] for rank in rows for r in rank)
    taken = [k for rank in rows for r in rank for k in r["keys"]]
    keys = [k for s in ShardIndex.load(os.path.join(data, "index.json")).shards for k in s.keys]
    assert sorted(taken) == sorted(keys)  # every sample exactly once
    for rank in rows:
        for r in rank:
            assert r["num_tokens"] <= MAX_TOKENS
            assert r["cu_seqlens"][-1] == r["num_tokens"]
    # Packs mix shapes (what the bucketed schedules never do).
    assert any(len({tuple(s) for s in r["shapes"]}) > 1 for rank in rows for r in rank)

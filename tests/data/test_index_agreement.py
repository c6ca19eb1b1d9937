"""Ranks whose shard indexes differ fail in the DataModule's setup, naming what differs, instead of hanging."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.index_agreement import index_disagreement
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching


def _worker(rank: int, world: int, init_file: str, dirs: dict[str, list[str]], out_dir: str) -> None:
    torch.set_num_threads(1)
    # A collective that waits longer than this fails instead of hanging.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        for case, per_rank in dirs.items():
            dm = AdaptiveLoadDataModule(
                train_shards=per_rank[rank],
                batching=Batching(max_tokens=512),
                loader=Loader(num_workers=0),
            )
            try:
                dm.setup("fit")
                outcome = "ok"
            except RuntimeError as err:
                outcome = f"error: {err}"
            with open(os.path.join(out_dir, f"{case}.rank{rank}.txt"), "w") as f:
                f.write(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_with_different_indexes_fail_naming_what_differs(synthetic_shards, tmp_path):
    same = synthetic_shards([10, 10], seed=1)
    # One more sample, in a third shard: what a shard added at start-up gives.
    more = synthetic_shards([10, 10, 1], seed=1)
    # The same keys and counts, other latent shapes: only the fingerprint differs.
    shapes = synthetic_shards([10, 10], seed=2)
    dirs = {"same": [same, same], "more": [same, more], "shapes": [same, shapes]}
    out = tmp_path / "out"
    out.mkdir()
    context = mp.spawn(_worker, args=(2, str(tmp_path / "init"), dirs, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 100
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2-process gloo run did not finish within 100 s")
    read = {(case, r): (out / f"{case}.rank{r}.txt").read_text() for case in dirs for r in range(2)}
    assert read[("same", 0)] == read[("same", 1)] == "ok"
    for case in ("more", "shapes"):
        # Every rank raises the same finding (each then names its own shard paths).
        assert read[(case, 0)].split(". Every rank")[0] == read[(case, 1)].split(". Every rank")[0]
        assert read[(case, 0)].startswith("error: the train index differs between ranks")
    assert "(shards, samples)" in read[("more", 0)]
    assert "rank 0: 2 shards, 20 samples" in read[("more", 0)]
    assert "rank 1: 3 shards, 21 samples" in read[("more", 0)]
    assert "(fingerprint)" in read[("shapes", 0)] and shapes in read[("shapes", 1)]


def test_disagreement_names_each_differing_index_only():
    a, b = [2.0, 20.0, 1.0, 2.0], [2.0, 20.0, 1.0, 3.0]
    assert index_disagreement(["train"], [a, a]) is None
    msg = index_disagreement(["train", "validation"], [a + a, a + b])
    assert msg is not None and "validation index differs" in msg and "train" not in msg
    assert "rank 1: 2 shards, 20 samples, fingerprint 0000000100000003" in msg

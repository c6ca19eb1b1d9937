"""AdaptiveLoadDataModule without multi-process DDP: contract, workers, bad data at read time, worker death."""

from __future__ import annotations

import collections
import io
import os
import tarfile

import pytest
import torch
from _timing import scaled

from lightning_adaptiveload.datamodule import (
    AdaptiveLoadDataModule,
    PlannedDataLoader,
    PlannedShardDataset,
)
from lightning_adaptiveload.loading.settings import Loader, Source
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.planning.sizing import tokens_per_sample
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards([30, 7, 25, 28], seed=2, name="dm")


def keys_of(d: str) -> list[str]:
    return [k for s in ShardIndex.load(os.path.join(d, "index.json")).shards for k in s.keys]


def epoch_keys(dm) -> tuple[list[list[str]], list[dict]]:
    batches = list(dm.train_dataloader())
    return [b["keys"] for b in batches], batches


@pytest.mark.timeout(scaled(120))
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("schedule", ["independent", "lockstep"])
def test_every_sample_once_per_epoch_and_batch_contract(data, workers, schedule):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=600, cost_model={"kind": "power", "p": 1.5}),
        plan=PlanSettings(schedule=schedule),
        loader=Loader(num_workers=workers),
    )
    dm.setup("fit")
    cm = CostModel(kind="power", p=1.5)
    orders = []
    for epoch in range(2):
        keys, batches = epoch_keys(dm)
        flat = [k for b in keys for k in b]
        assert sorted(flat) == sorted(keys_of(data)) and len(flat) == len(set(flat))
        report = dm.epoch_report
        assert report["epoch"] == epoch and report["steps"] == len(batches) == report["batches_yielded"]
        assert report["samples"] == 90 and report["padding_tokens"] == 0 and report["runtime_skipped"] == {}
        assert report["tokens"] == sum(b["num_tokens"] for b in batches)
        assert [b["step"] for b in batches] == list(range(len(batches)))
        for b in batches:
            n, c, t, h, w = b["latents"].shape
            assert b["batch_size"] == n == len(b["keys"]) == len(b["meta"])
            assert b["seq_len"] == tokens_per_sample((c, t, h, w)) and b["num_tokens"] == n * b["seq_len"]
            assert b["num_tokens"] <= 600 and b["global_tokens"] == b["num_tokens"]  # one rank
            assert b["cost"] == pytest.approx(cm.batch_cost(n, b["seq_len"]))
            assert b["latents"].dtype == torch.float16
            if b["text"] is not None:
                assert b["text"].shape[:2] == b["text_mask"].shape and b["text_mask"].dtype == torch.bool
                assert b["text"][~b["text_mask"]].abs().sum() == 0
            assert b["skipped"] == {}
        orders.append(flat)
    assert orders[0] != orders[1], "the shard order is reseeded every epoch"


@pytest.mark.timeout(scaled(60))
def test_synthetic_prepare_data_and_validation(tmp_path):
    train, val = str(tmp_path / "train"), str(tmp_path / "val")
    dm = AdaptiveLoadDataModule(
        train_shards=train,
        val_shards=val,
        synthetic={"mix": "tiny", "num_samples": 64, "samples_per_shard": 16, "val_num_samples": 20},
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0),
    )
    dm.prepare_data()
    assert os.path.exists(os.path.join(train, "index.json")) and os.path.exists(
        os.path.join(val, "index.json")
    )
    dm.prepare_data()  # idempotent: reuses the shards
    dm.setup("fit")
    val_keys = [k for b in dm.val_dataloader() for k in b["keys"]]
    assert sorted(val_keys) == sorted(keys_of(val)) and len(val_keys) == 20
    assert [k for b in dm.val_dataloader() for k in b["keys"]] == val_keys  # the same every time
    with pytest.raises(ValueError, match="one directory"):
        AdaptiveLoadDataModule(
            train_shards=str(tmp_path / "x-{0..3}.tar"), synthetic={"mix": "tiny"}
        ).prepare_data()


def test_bad_settings_fail_at_construction(data):
    with pytest.raises(ValueError, match="schedule"):
        AdaptiveLoadDataModule(train_shards=data, plan=PlanSettings(schedule="sync"))
    with pytest.raises(ValueError, match="on_error"):
        AdaptiveLoadDataModule(train_shards=data, source=Source(on_error="ignore"))
    with pytest.raises(ValueError, match="cost_model"):
        AdaptiveLoadDataModule(train_shards=data, batching=Batching(max_compute=3.0))
    with pytest.raises(ValueError, match="persistent_workers"):
        dm = AdaptiveLoadDataModule(train_shards=data, loader=Loader(num_workers=0))
        dm.setup("fit")
        PlannedDataLoader(dm.train_dataset, num_workers=1, persistent_workers=True)


def test_jsonargparse_builds_the_datamodule_from_config(data):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(AdaptiveLoadDataModule, "data")
    cfg = parser.parse_object(
        {
            "data": {
                "train_shards": data,
                "batching": {
                    "max_tokens": 700,
                    "max_compute": "auto",
                    "sizing": "dual",
                    "cost_model": {"kind": "quadratic", "alpha": 1.0, "beta": 0.01},
                    "patch_size": [1, 2, 2],
                },
                "plan": {"schedule": "lockstep"},
                "loader": {"num_workers": 0},
                "synthetic": None,
            }
        }
    )
    dm = parser.instantiate(cfg)["data"]
    assert (
        isinstance(dm, AdaptiveLoadDataModule) and dm.batcher.max_tokens == 700 and dm.schedule == "lockstep"
    )
    # A recipe's plan group starts from the DataModule's defaults (chunked planning on), not PlanSettings'.
    assert dm.plan_settings.chunk_samples == 500_000 and dm.num_workers == 0 and dm.batcher.sizing == "dual"


def _poison(path: str, key: str) -> None:
    """Write NaN over the first value of ``key``'s latent, keeping the file size (the index stays valid)."""
    with tarfile.open(path) as tf:
        info = tf.getmember(f"{key}.latent.npy")
        offset = info.offset_data
    with open(path, "r+b") as f:
        f.seek(offset + 8)
        header_len = int.from_bytes(f.read(2), "little")
        f.seek(offset + 10 + header_len)
        f.write(b"\x00\x7e")  # float16 NaN


@pytest.fixture()
def poisoned(tmp_path) -> tuple[str, str]:
    d = str(tmp_path / "poisoned")
    index = write_synthetic_shards(
        d, settings=SyntheticShards(mix="tiny", num_samples=40, samples_per_shard=20, seed=4), progress=False
    )
    key = index.shards[1].keys[3]
    _poison(index.shards[1].path, key)
    return d, key


@pytest.mark.timeout(scaled(60))
@pytest.mark.parametrize("workers", [0, 1])
def test_sample_bad_at_read_time_raises_naming_shard_and_key(poisoned, workers):
    d, key = poisoned
    dm = AdaptiveLoadDataModule(
        train_shards=d,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=workers),
    )
    dm.setup("fit")
    with pytest.raises(ShardError, match=rf"shard-000001\.tar, key '{key}'.*NaN"):
        list(dm.train_dataloader())


@pytest.mark.timeout(scaled(60))
def test_sample_bad_at_read_time_is_skipped_and_counted(poisoned):
    d, key = poisoned
    dm = AdaptiveLoadDataModule(
        train_shards=d,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0),
        source=Source(on_error="skip"),
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    keys = collections.Counter(k for b in batches for k in b["keys"])
    assert key not in keys and sorted(keys) == sorted(set(keys_of(d)) - {key})
    assert sum(b["skipped"].get("non_finite", 0) for b in batches) == 1
    assert dm.epoch_report["runtime_skipped"] == {"non_finite": 1}
    assert len(batches) == dm.epoch_report["steps"], "the step count is kept: equal steps on every rank"
    for b in batches:
        if b["batch_size"] == 0:  # every member failed: an empty batch keeps the step
            assert b["latents"].shape[0] == 0 and b["num_tokens"] == 0


class _DyingDataset(PlannedShardDataset):
    """Worker 1 dies (os._exit, as on an OOM kill) after its first batch."""

    def _stream(self, plan, stream):
        for j, batch in enumerate(super()._stream(plan, stream)):
            if stream[1] == 1 and j == 1:
                os._exit(3)
            yield batch


@pytest.mark.timeout(scaled(90))
def test_worker_death_is_an_error_not_a_hang(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=256),
        loader=Loader(num_workers=2),
    )
    dm.setup("fit")
    ds = dm.train_dataset
    dying = _DyingDataset(ds.index, ds.batcher, num_workers=2)
    loader = PlannedDataLoader(dying, num_workers=2)
    it = iter(loader)
    try:
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for _ in it:
                pass
    finally:
        # Stop the other worker now, while this test runs: left to the garbage collector, the iterator (held
        # by the exception's traceback) would shut it down at a random later point, inside another test or
        # pytest's own code, where torch's SIGCHLD check may raise.
        it._it._shutdown_workers()  # the DataLoader's own iterator inside the counting one


def test_loader_with_other_worker_count_than_planned_is_refused(data):
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=2),
    )
    dm.setup("fit")
    ds = dm.train_dataset
    ds.begin_epoch(0)
    with pytest.raises(RuntimeError, match="planned for 2 DataLoader workers"):
        next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)))


def _add_pickle_member(path: str, key: str) -> None:
    """Rewrite the shard with a ``<key>.extra.pth`` member (a pickle, refused) right after the key's members."""
    with tarfile.open(path) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    last = max(i for i, (m, _) in enumerate(members) if m.name.startswith(key + "."))
    extra = tarfile.TarInfo(f"{key}.extra.pth")
    payload = b"not unpickled"
    extra.size = len(payload)
    members.insert(last + 1, (extra, payload))
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data))


@pytest.mark.timeout(scaled(60))
def test_refused_member_beside_a_good_sample_is_not_a_skipped_sample(tmp_path, caplog):
    """A pickle member is refused, but its sample's latent is good: the sample is read and nothing counts
    it as lost; the refused member is counted apart."""
    d = str(tmp_path / "pickled")
    index = write_synthetic_shards(
        d, settings=SyntheticShards(mix="tiny", num_samples=24, samples_per_shard=12, seed=3), progress=False
    )
    key = index.shards[0].keys[2]
    _add_pickle_member(index.shards[0].path, key)
    os.remove(os.path.join(d, "index.json"))  # index the changed shards afresh
    dm = AdaptiveLoadDataModule(
        train_shards=d,
        batching=Batching(max_tokens=512),
        loader=Loader(num_workers=0),
        source=Source(on_error="skip"),
    )
    dm.setup("fit")
    with caplog.at_level("WARNING"):
        batches = list(dm.train_dataloader())
    written = [k for s in index.shards for k in s.keys]
    assert sorted(k for b in batches for k in b["keys"]) == sorted(written) and key in written
    assert all(b["skipped"] == {} for b in batches)
    assert sum(b["ignored_members"].get("pickle_member", 0) for b in batches) == 1
    assert dm.epoch_report["runtime_skipped"] == {}
    assert dm.epoch_report["runtime_ignored_members"] == {"pickle_member": 1}
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "skipped" in r.getMessage()]


@pytest.mark.timeout(scaled(120))
@pytest.mark.parametrize("schedule, workers", [("independent", 0), ("lockstep", 2)])
def test_binary_index_gives_the_same_epoch_as_the_json_index(data, tmp_path, schedule, workers):
    from lightning_adaptiveload.shards.compact import CompactIndex

    binary = ShardIndex.load(os.path.join(data, "index.json")).save(tmp_path / "index.npidx")
    epochs = []
    for shards in (data, binary):
        dm = AdaptiveLoadDataModule(
            train_shards=shards,
            batching=Batching(max_tokens=600),
            plan=PlanSettings(schedule=schedule),
            loader=Loader(num_workers=workers),
            source=Source(index_allow_outside=True),
        )
        dm.setup("fit")
        epochs.append([(b["keys"], b["step"], b["latents"].shape) for b in dm.train_dataloader()])
    assert isinstance(dm.train_index, CompactIndex)  # kept as arrays, not converted to lists
    assert epochs[0] == epochs[1] and sum(len(k) for k, _, _ in epochs[1]) == 90


@pytest.mark.timeout(scaled(60))
def test_a_folder_with_only_the_binary_index_trains_from_it(tmp_path):
    from lightning_adaptiveload.shards.compact import CompactIndex

    folder = tmp_path / "d"
    write_synthetic_shards(
        folder,
        settings=SyntheticShards(mix="tiny", num_samples=12, samples_per_shard=6, seed=1),
        progress=False,
    )
    ShardIndex.load(folder / "index.json").save(folder / "index.npidx")
    os.unlink(folder / "index.json")
    dm = AdaptiveLoadDataModule(
        train_shards=str(folder),
        batching=Batching(max_tokens=600),
        loader=Loader(num_workers=0),
    )
    dm.prepare_data()
    assert not (folder / "index.json").exists()  # the binary index counts as the index beside the shards
    dm.setup("fit")
    assert isinstance(dm.train_index, CompactIndex)
    assert sorted(k for b in dm.train_dataloader() for k in b["keys"]) == sorted(
        k for s in dm.train_index.shards for k in s.keys
    )


def test_an_evaluation_split_never_changes_the_training_cap(tmp_path):
    """Each split resolves ``max_compute="auto"`` on its own batcher: validation shards of other shapes
    leave training's cap (the one saved in the checkpoint) as the training shards set it, whatever split
    is set up last."""
    from lightning_adaptiveload.shards.mixes import Mix, load_mix

    tiny = load_mix("tiny")
    longest = max(tiny.buckets, key=lambda b: b.tokens)
    write_synthetic_shards(
        tmp_path / "train", settings=SyntheticShards(mix="tiny", num_samples=24, samples_per_shard=12, seed=5),
        progress=False,
    )  # fmt: skip
    write_synthetic_shards(
        tmp_path / "val",
        settings=SyntheticShards(mix=Mix("longest", (longest,)), num_samples=4, samples_per_shard=4, seed=5),
        progress=False,
    )

    def own_cap(split: str) -> float:
        dm = AdaptiveLoadDataModule(
            str(tmp_path / split),
            batching=Batching(max_tokens=512, max_compute="auto"),
            loader=Loader(num_workers=0),
        )
        dm.setup("fit")
        return dm.batcher.max_compute

    train_cap, val_cap = own_cap("train"), own_cap("val")
    assert train_cap != val_cap  # the two splits alone resolve different caps: the check below can fail
    for stages in (["fit"], ["validate", "fit"], ["fit", "validate"]):
        dm = AdaptiveLoadDataModule(
            str(tmp_path / "train"),
            val_shards=str(tmp_path / "val"),
            batching=Batching(max_tokens=512, max_compute="auto"),
            loader=Loader(num_workers=0),
        )  # fmt: skip
        for stage in stages:
            dm.setup(stage)
        assert dm.batcher.max_compute == train_cap, stages
        assert dm.val_dataset.batcher is not dm.batcher


@pytest.mark.timeout(scaled(120))
def test_the_plan_line_of_a_resumed_epoch_counts_batches_as_steps_times_ranks(data, monkeypatch, caplog):
    """Issue 60: a resumed epoch's line said "27 steps x 2 ranks, 27 batches" (the rank-local plan counted
    this rank's batches only); everywhere else batches = steps x ranks."""
    import logging

    from lightning_adaptiveload import _dist

    def dm_of(rank: int) -> AdaptiveLoadDataModule:
        monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, 2))
        dm = AdaptiveLoadDataModule(
            train_shards=data, batching=Batching(max_tokens=256), loader=Loader(num_workers=0, seed=3)
        )
        dm.setup("fit")
        return dm

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[adaptiveload] epoch 0:")]

    first = [dm_of(r) for r in range(2)]
    with caplog.at_level(logging.INFO):
        for r, dm in enumerate(first):
            monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None, r=r: (r, 2))
            it = iter(dm.train_dataloader())
            for _ in range(3):
                next(it)
    steps = first[0].epoch_report["steps"]
    fresh = lines()[0]
    assert f"{steps} steps x 2 ranks, {2 * steps} batches" in fresh and "on this rank" not in fresh
    caplog.clear()
    state = first[0].state_dict()
    resumed = dm_of(0)
    resumed.load_state_dict(state)
    with caplog.at_level(logging.INFO):
        rest = list(resumed.train_dataloader())
    assert len(rest) == steps - 3
    assert resumed.epoch_report["batches"] == steps - 3  # the report counts this rank's (what the line said)
    line = lines()[0]
    assert f"{steps - 3} steps x 2 ranks, {2 * (steps - 3)} batches" in line, line
    assert f"{sum(len(b['keys']) for b in rest)} samples on this rank" in line, line

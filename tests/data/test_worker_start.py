"""How loader workers start (``Loader.start_method``): the choice, its refusals, and a forkserver epoch that
equals a forked one batch for batch.

Why the choice exists: under a gloo process group, a worker forked while a gloo thread was creating its
Python thread state blocked forever inside ``os.fork`` (CPU DDP, Python 3.11; ``docs/ci_flake.md``).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.loader import check_picklable, worker_start_method, workers_context
from lightning_adaptiveload.loading.settings import Loader


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards([12, 9, 15], seed=4, name="start")


def transform(sample: dict) -> dict:  # module level: picklable
    return sample


def test_a_bad_start_method_is_refused_naming_it():
    with pytest.raises(
        ValueError, match=r"start_method must be one of 'fork', 'forkserver', 'spawn'.*'threads'"
    ):
        Loader(start_method="threads")
    assert Loader(start_method="spawn").start_method == "spawn"
    assert Loader().start_method is None


def test_the_choice_without_a_process_group():
    assert not dist.is_initialized()
    assert worker_start_method(None, 2) is None  # the platform's default
    assert worker_start_method("spawn", 2) == "spawn"
    assert worker_start_method("spawn", 0) is None  # no workers: nothing starts
    assert workers_context(None) is None
    assert workers_context("spawn").get_start_method() == "spawn"


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_the_fork_server_is_announced_once_per_process(monkeypatch):
    from lightning_adaptiveload.loading import loader

    monkeypatch.setattr(loader, "_preload_set", False)
    said: list[str] = []
    for _ in range(3):
        assert workers_context("forkserver", said.append).get_start_method() == "forkserver"
    assert len(said) == 1 and "fork server" in said[0]


def test_a_method_the_platform_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(
        ValueError, match=r"start_method='fork' is not available on this platform; it has 'spawn'"
    ):
        worker_start_method("fork", 2)


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_a_gloo_group_chooses_the_fork_server(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert worker_start_method(None, 2) == "forkserver"
        assert worker_start_method("fork", 2) == "fork"  # an explicit choice wins
        assert worker_start_method(None, 0) is None
    finally:
        dist.destroy_process_group()


def test_the_default_method_is_the_platforms(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    check_picklable(lambda s: s, "sample_transform", None)  # Linux: forked
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn", "fork"])
    with pytest.raises(ValueError, match=r"sample_transform .* cannot be pickled.*'spawn'"):
        check_picklable(lambda s: s, "sample_transform", None)  # macOS: spawned


def test_an_unpicklable_transform_is_refused_before_any_worker_starts(data):
    check_picklable(lambda s: s, "sample_transform", "fork")  # forked workers inherit it
    check_picklable(transform, "sample_transform", "forkserver")
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching={"max_tokens": 600},
        loader=Loader(num_workers=2, start_method="spawn"),
        sample_transform=lambda s: s,
    )
    dm.setup("fit")
    with pytest.raises(
        ValueError, match=r"sample_transform .* cannot be pickled.*'spawn'.*start_method='fork'"
    ):
        dm.train_dataloader()


@pytest.mark.timeout(180)
@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_a_forkserver_epoch_equals_a_forked_one(data):
    """The dataset reaches workers pickled (plan, index, transform) and streams the same batches."""
    epochs = {}
    for method in ("fork", "forkserver"):
        dm = AdaptiveLoadDataModule(
            train_shards=data,
            batching={"max_tokens": 600},
            loader=Loader(num_workers=2, start_method=method),
            sample_transform=transform,
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert loader.multiprocessing_context.get_start_method() == method
        epochs[method] = list(loader)
    fork, server = epochs["fork"], epochs["forkserver"]
    assert [b["keys"] for b in server] == [b["keys"] for b in fork] and len(fork) > 3
    for a, b in zip(fork, server):
        assert torch.equal(a["latents"], b["latents"])

"""The LoadBalanceMonitor counts what a fit fetched from object storage, per epoch, and says it.

A small CPU fit reads its index and shards from the in-process HTTP server (``test_ranged_reads``'s
RangeServer, which counts what it serves); the monitor's summary (and ``load_balance.json``) carry
``fetched``: per epoch the bytes and requests of the ranged reads, summed over the loader workers, which
must equal what the server counted; the step table keeps its data share (the time waiting for batches,
remote reads included).
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from test_ranged_reads import RangeServer

from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader, Source
from lightning_adaptiveload.monitor.fetched import FetchTally, merge_tallies
from lightning_adaptiveload.monitor.report import format_summary
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings

pytestmark = pytest.mark.timeout(300)


class _Mean(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.keys: list[str] = []

    def training_step(self, batch, batch_idx):
        self.keys.extend(batch["keys"])
        return self.w * batch["latents"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def data(synthetic_shards) -> str:
    return synthetic_shards([9, 7, 11], seed=4, name="monitor-remote-shards")


@pytest.fixture()
def server(data):
    srv = RangeServer(data)
    yield srv
    srv.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fit_from_a_server_reports_the_bytes_and_requests_fetched_per_epoch(
    data, server, tmp_path, workers
):
    url = f"{server.url}index.json"
    dm = AdaptiveLoadDataModule(
        train_shards=url,
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule="lockstep"),
        loader=Loader(num_workers=workers, seed=2),
        source=Source(remote=RemoteSettings(backoff_s=0.02, retry_wait_s=10.0)),
    )
    monitor = LoadBalanceMonitor(dirpath=tmp_path, count_flops=False, plots=False, print_summary=False)
    model = _Mean()
    trainer = quiet_cpu_trainer(
        tmp_path, max_epochs=2, callbacks=[monitor], reload_dataloaders_every_n_epochs=1
    )
    trainer.fit(model, datamodule=dm)

    index = ShardIndex.load(url)
    keys = [k for s in index.shards for k in s.keys]
    assert sorted(model.keys) == sorted(keys * 2)  # every sample once per epoch
    fetched = monitor.summary["fetched"]
    assert [row["epoch"] for row in fetched["per_epoch"]] == [0, 1]
    spans = sum(n for s in index.shards for _, n in s.spans)
    tar_requests = sum(n for path, n in server.requests.items() if path.endswith(".tar"))
    tar_bytes = sum(n for path, n in server.served.items() if path.endswith(".tar"))
    for row in fetched["per_epoch"]:
        assert row["bytes"] == spans and row["requests"] > 0  # each planned byte once per epoch
    # What the server served is what the trainer's batches counted, with workers too: Lightning's loop
    # makes a second iterator of a reloaded loader and advances only that one; the unused one starts no
    # workers, so nothing is read ahead for it.
    assert fetched["total"]["requests"] == tar_requests and fetched["total"]["bytes"] == tar_bytes
    assert tar_bytes == 2 * spans
    with open(tmp_path / "load_balance.json", encoding="utf-8") as f:
        saved = json.load(f)["summary"]
    assert saved["fetched"] == fetched
    assert "data_share" in saved["table"] and math.isfinite(saved["table"]["data_share"]["mean"])
    assert "fetched per epoch" in format_summary(monitor.summary)


def test_local_batches_leave_the_tally_empty_and_the_summary_silent():
    tally = FetchTally()
    tally.add({"keys": ["a"]}, 0)
    tally.add(["not", "a", "mapping"], 0)
    assert tally.epochs == {} and merge_tallies([tally.epochs, {}]) == {}
    tally.add({"fetched": {"bytes": torch.tensor(10), "requests": 2}}, 1)
    merged = merge_tallies([tally.epochs, {1: {"bytes": 5, "requests": 1}}])
    assert merged["per_epoch"] == [{"epoch": 1, "bytes": 15, "requests": 3, "retries": 0, "cache_hits": 0}]
    assert merged["bytes_per_request"] == 5.0

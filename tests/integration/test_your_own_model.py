"""A user's own LightningModule (diffusers Wan + the fusion mixin) through the CLI, as docs/your_own_model.md
tells it: 2-process DDP from the user's YAML, fit / validate / test / predict; OneCycleLR sized from
``trainer.estimated_stepping_batches``; and a compiled module under the default monitor still compiles."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from _paths import ROOT

from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.synthetic import SyntheticShards

pytest.importorskip("diffusers")

EXAMPLE = ROOT / "examples" / "your_own_model"


def _run(cmd: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", cmd, "--config", "wan_flow.yaml", *extra],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env=env,
    )


@pytest.mark.timeout(900)
def test_own_wan_module_fits_validates_tests_and_predicts_under_ddp(tmp_path):
    work = tmp_path / "mine"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "data", "__pycache__"))
    small = ["--data.init_args.synthetic.num_samples=24", "--data.init_args.synthetic.samples_per_shard=6"]

    fit = _run("fit", work, *small, "--trainer.log_every_n_steps=1")
    assert fit.returncode == 0, fit.stderr[-4000:]
    out = fit.stdout + fit.stderr
    assert "FLOPs by flops_per_batch" in out  # the module gives the Wan's FLOPs: no counter runs
    # The example runs packs (lockstep's packed tail): no warning that it does not, at every run.
    assert "runs_packed_batches" not in out and "packed tail steps" in out
    assert "fused" in out.lower() or "WanTransformerBlock" in out  # the mixin's report
    metrics = next((work / "runs" / "wan_flow" / "logs").rglob("metrics.csv"))
    rows = list(csv.DictReader(open(metrics)))
    lrs = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    steps = max(int(r["step"]) for r in rows if r.get("train/lr")) + 1
    planned = int(out.split(" steps x 2 ranks")[0].rsplit(" ", 1)[-1])
    # The loader's length is the plan's: the trainer ran exactly the planned steps, OneCycleLR was sized
    # from estimated_stepping_batches = that count (it raises when stepped past its total), and the bar
    # showed n/N.
    assert steps == planned and f"{planned}/{planned}" in out
    # One cycle, ending exactly at the last step: max_lr / div_factor / final_div_factor (defaults 25, 1e4).
    assert len(lrs) == steps and lrs[0] < max(lrs)
    assert lrs[-1] == pytest.approx(1e-3 / 25 / 1e4, rel=1e-3)

    for cmd in ("validate", "test"):
        proc = _run(cmd, work, *small)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"{'val' if cmd == 'validate' else 'test'}/loss" in proc.stdout

    pred = _run("predict", work, *small)
    assert pred.returncode == 0, pred.stderr[-4000:]
    keys = []
    for path in sorted((work / "runs" / "wan_flow" / "predictions").glob("predictions_rank*.jsonl")):
        keys += [json.loads(line)["key"] for line in open(path)]
    index = json.load(open(work / "data" / "wan_flow" / "val" / "index.json"))
    expected = [k for shard in index["shards"] for k in shard["keys"]]
    assert len(keys) == len(expected) and sorted(keys) == sorted(expected)  # each sample once, both ranks


@pytest.mark.timeout(300)
def test_own_wan_module_fits_and_validates_under_fsdp2(tmp_path):
    # The example shards itself under ModelParallelStrategy. One validation sample on two ranks: rank 1
    # validates an empty step, and must still run the model (FSDP gathers in every forward) and weigh 0.
    work = tmp_path / "mine"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "data", "__pycache__"))
    (work / "fsdp2.yaml").write_text(
        "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.ModelParallelStrategy\n"
    )
    fit = _run(
        "fit",
        work,
        "--config=fsdp2.yaml",
        "--data.init_args.synthetic.num_samples=12",
        "--data.init_args.synthetic.samples_per_shard=6",
        "--data.init_args.synthetic.val_num_samples=1",
    )
    assert fit.returncode == 0, fit.stderr[-4000:]
    assert "compute time by fsdp2_post_backward" in fit.stdout + fit.stderr  # the monitor saw FSDP2
    metrics = next((work / "runs" / "wan_flow" / "logs").rglob("metrics.csv"))
    val = [float(r["val/loss"]) for r in csv.DictReader(open(metrics)) if r.get("val/loss")]
    # The one sample's loss: self.log(sync_dist=True) with the empty step's batch size 0 gave inf.
    assert len(val) == 1 and 0 < val[0] < 10


class _CompiledMLP(L.LightningModule):
    """No flops_per_batch, no analytic flops, no Wan: the monitor's fallback counts on a meta copy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.compiled = torch.compile(self.net)

    def training_step(self, batch, batch_idx):
        loss = self.compiled(batch["latents"]).square().mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "latents": torch.randn(4, 8, generator=g),
            "cost": 1.0,
            "num_tokens": 4,
            "batch_size": 4,
            "seq_len": 1,
        }
        for _ in range(n)
    ]


@pytest.mark.timeout(300)
def test_compiled_module_under_default_monitor_compiles(tmp_path):
    from torch._dynamo.utils import counters

    from lightning_adaptiveload import LoadBalanceMonitor

    torch._dynamo.reset()
    counters.clear()
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        default_root_dir=tmp_path,
    )
    trainer.fit(_CompiledMLP(), train_dataloaders=torch.utils.data.DataLoader(_batches(3), batch_size=None))
    assert sum(counters["frames"].values()) > 0  # FlopCounterMode on the live module would leave this at 0
    meta = monitor.summary["meta"]
    assert meta["flops_source"] == "flop_counter"
    assert meta["steps_compiling"] >= 1  # the first step compiled: a warm-up step, kept out of the balance
    steps = json.load(open(tmp_path / "load_balance.json"))["steps"]
    assert steps[0]["counted"] == 1
    assert steps[0]["flops"] == 3 * 2 * 4 * (8 * 16 + 16 * 8)  # counted on the meta copy, 3x forward


def test_cli_takes_any_lightning_module_and_model_class(tmp_path, monkeypatch):
    from lightning_adaptiveload.cli import main as cli
    from lightning_adaptiveload.models.module import VideoDiTModule
    from lightning_adaptiveload.shards.synthetic import write_synthetic_shards

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    write_synthetic_shards(
        tmp_path / "d", settings=SyntheticShards(num_samples=4, samples_per_shard=4), progress=False
    )
    base = ["--trainer.logger=false", "--trainer.callbacks=[]", f"--data.train_shards={tmp_path / 'd'}"]
    # A module that is no VideoDiTModule, named in the recipe ("does not correspond to a subclass" before).
    built = cli.build_cli(["--model=wan_flow.WanFlowModule", *base], run=False)
    assert type(built.model).__name__ == "WanFlowModule"
    # A recipe that names no model keeps the VideoDiTModule default.
    assert type(cli.build_cli(base, run=False).model) is VideoDiTModule
    # model_class passes through ("got multiple values for argument 'model_class'" before).
    built = cli.build_cli(["--model=VideoDiTModule", *base], run=False, model_class=VideoDiTModule)
    assert type(built.model) is VideoDiTModule


def _example_module():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from wan_flow import WanFlowModule
    finally:
        sys.path.remove(str(EXAMPLE))
    module = WanFlowModule(num_layers=1, text_dim=16)
    module.configure_model()
    return module


def test_example_module_runs_a_pack_as_its_samples():
    from lightning_adaptiveload.loading.packed_collate import collate_packed

    module = _example_module()
    assert module.runs_packed_batches is True
    g = torch.Generator().manual_seed(0)
    samples = [
        {"__key__": f"k{i}", "latent": torch.randn(16, *thw, generator=g), "text": torch.randn(n, 16, generator=g),
         "meta": {}}
        for i, (thw, n) in enumerate([((1, 4, 6), 3), ((3, 4, 4), 5), ((2, 2, 6), 1)])
    ]  # fmt: skip
    pack = collate_packed(samples, text_pad_to=12)
    module._noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        err = module._pack_error(pack)
    # The same draws, sample by sample as batches of one with the pack's padded text rows.
    module._noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        alone = [
            module._velocity_error({"latents": x.unsqueeze(0), "text": pack["text"][i : i + 1]})
            for i, x in enumerate(pack["latents"])
        ]
    assert err.shape == (3,) and torch.allclose(err, torch.cat(alone))


@pytest.mark.timeout(300)
def test_example_module_fits_the_packed_schedule(tmp_path):
    # Before, both ranks failed in the first step: "'list' object has no attribute 'float'".
    from lightning_adaptiveload import AdaptiveLoadDataModule, LoadBalanceMonitor
    from lightning_adaptiveload.shards.synthetic import write_synthetic_shards

    data = tmp_path / "d"
    write_synthetic_shards(data, settings=SyntheticShards(mix="tiny", num_samples=16, samples_per_shard=8, text_len_range=(1, 12), text_dim=16), progress=False)  # fmt: skip
    dm = AdaptiveLoadDataModule(
        train_shards=str(data),
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule="packed"),
        loader=Loader(num_workers=0, text_pad_to=12),
    )  # fmt: skip
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_example_module(), datamodule=dm)
    assert trainer.global_step == dm.epoch_report["steps"] > 0
    steps = json.load(open(tmp_path / "load_balance.json"))["steps"]
    assert monitor.summary["meta"]["flops_source"] == "flops_per_batch" and all(s["flops"] > 0 for s in steps)

import csv
import json
import math
import os
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload import _dist, stats
from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.monitor import steps as monitor_mod

D_IN, D_OUT = 8, 16

# Known work per rank and step: (batch_size, seq_len). Every rank runs the same number of steps.
PLAN = {
    0: [(1, 16), (2, 16), (3, 8), (4, 8), (1, 32), (2, 4), (3, 4), (4, 16)],
    1: [(4, 4), (3, 4), (2, 8), (1, 16), (1, 16), (1, 32), (2, 8), (2, 8)],
}
STEPS = len(PLAN[0])


def _cost(b, s):
    return float(b * s**1.5)


def _batch(b, s):
    return {
        "latents": torch.randn(b, D_IN),
        "seq_len": s,
        "batch_size": b,
        "num_tokens": b * s,
        "cost": _cost(b, s),
        "global_tokens": -1,
    }


class KnownBatches(IterableDataset):
    """Yields the batches of PLAN for this process's rank (rank 0 when not distributed)."""

    def __iter__(self):
        rank, _ = _dist.rank_and_world()
        torch.manual_seed(rank)
        for b, s in PLAN[rank]:
            yield _batch(b, s)


class TupleBatches(IterableDataset):
    def __iter__(self):
        for _ in range(4):
            yield (torch.randn(2, D_IN),)


class TinyModule(L.LightningModule):
    def __init__(self, dataset_cls=KnownBatches, register_user_hook=False):
        super().__init__()
        self.lin = torch.nn.Linear(D_IN, D_OUT)
        self.dataset_cls = dataset_cls
        self.register_user_hook = register_user_hook

    def on_fit_start(self):
        if self.register_user_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # Runs before the callbacks' on_train_start: the monitor must see it and fall back.
            self.trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

    def training_step(self, batch, batch_idx):
        x = batch["latents"] if isinstance(batch, dict) else batch[0]
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.dataset_cls(), batch_size=None)


class Analytic(torch.nn.Module):
    """A submodule with an analytic forward `flops(batch_size, seq_len, text_len)`."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.lin(x)

    def flops(self, batch_size, seq_len, text_len):
        return 1000.0 * batch_size * seq_len + text_len


class AnalyticModule(TinyModule):
    def __init__(self):
        super().__init__()
        self.net = Analytic()

    def training_step(self, batch, batch_idx):
        return self.net(batch["latents"]).pow(2).mean()


class FlopsPerBatchModule(TinyModule):
    def flops_per_batch(self, batch):
        return 7.0 * batch["num_tokens"]


def _trainer(tmp_path, monitor, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=3,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=[monitor], **defaults)


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _expected_step_cvs():
    """compute_cv and token_cv of every step, from the known per-rank batches (numpy, population std)."""
    cost = np.array([[_cost(b, s) for b, s in PLAN[r]] for r in (0, 1)])
    tokens = np.array([[b * s for b, s in PLAN[r]] for r in (0, 1)], dtype=float)
    return cost.std(axis=0) / cost.mean(axis=0), tokens.std(axis=0) / tokens.mean(axis=0)


# ------------------------------------------------------------------ 2-process DDP on CPU (gloo)


@pytest.mark.timeout(240)
def test_ddp_cvs_equal_known_batches(tmp_path):
    # a fixed version: the main process would otherwise pick the next free one after the spawned fit
    logger = CSVLogger(tmp_path, name="lb", version=0)
    monitor = LoadBalanceMonitor(print_summary=False)
    trainer = _trainer(tmp_path, monitor, strategy="ddp_spawn", devices=2, logger=logger)
    trainer.fit(TinyModule())

    outdir = tmp_path / "lb" / "version_0"
    compute_cv, token_cv = _expected_step_cvs()

    steps = _read_csv(os.path.join(outdir, "load_balance_steps.csv"))
    assert [int(s["batch_idx"]) for s in steps] == list(range(STEPS))  # every step, not only logged ones
    assert [float(s["compute_cv"]) for s in steps] == pytest.approx(compute_cv.tolist(), rel=1e-9)
    assert [float(s["token_cv"]) for s in steps] == pytest.approx(token_cv.tolist(), rel=1e-9)
    assert [float(s["tokens"]) for s in steps] == [
        PLAN[0][i][0] * PLAN[0][i][1] + PLAN[1][i][0] * PLAN[1][i][1] for i in range(STEPS)
    ]

    ranks = _read_csv(os.path.join(outdir, "load_balance_ranks.csv"))
    assert len(ranks) == 2 * STEPS
    for row in ranks:
        r, i = int(row["rank"]), int(row["batch_idx"])
        b, s = PLAN[r][i]
        assert (int(row["batch_size"]), int(row["seq_len"]), int(row["num_tokens"])) == (b, s, b * s)
        assert float(row["cost"]) == pytest.approx(_cost(b, s))
        # FlopCounterMode: a Linear's forward is one addmm of 2 * B * D_IN * D_OUT; training = 3x forward
        assert float(row["flops"]) == 3 * 2 * b * D_IN * D_OUT
        # timed to the end of the backward (an engine callback), within the step
        assert row["backward_timed"] == "1"
        assert 0 < float(row["compute_time_s"]) <= float(row["step_time_s"]) <= float(row["iter_time_s"])
        # no CUDA: memory fields absent
        assert row["peak_allocated_bytes"] == "" and row["peak_reserved_bytes"] == ""

    # logged through the trainer's logger, at its cadence: steps 3 and 6 (8 steps, every 3)
    logged = [r for r in _read_csv(os.path.join(outdir, "metrics.csv")) if r.get("balance/token_cv")]
    assert [int(r["step"]) for r in logged] == [2, 5]
    for r, window in zip(logged, (range(0, 3), range(3, 6))):
        assert float(r["balance/token_cv"]) == pytest.approx(token_cv[list(window)].mean(), rel=1e-6)
        assert float(r["balance/compute_cv"]) == pytest.approx(compute_cv[list(window)].mean(), rel=1e-6)
        assert float(r["balance/tokens_per_s"]) > 0
        assert "balance/vram_efficiency_mean" not in r or r["balance/vram_efficiency_mean"] == ""
    # time-balance statistics leave out steps where a rank ran FlopCounterMode (every step of the first
    # window: each rank meets new batch shapes there), so they first appear in the second window
    assert logged[0].get("balance/straggler_wait", "") == ""
    assert 0 <= float(logged[1]["balance/straggler_wait"]) < 1
    assert float(logged[1]["balance/step_time_cv"]) >= 0
    # values spawned ranks logged come back to the main process
    assert trainer.callback_metrics["balance/token_cv"].item() == pytest.approx(
        token_cv[3:6].mean(), rel=1e-6
    )

    payload = json.load(open(os.path.join(outdir, "load_balance.json")))
    meta = payload["summary"]["meta"]
    assert meta["world_size"] == 2
    assert meta["timing_method"] == "backward_end"
    assert meta["flops_source"] == "flop_counter"
    assert meta["num_collectives"] == 3  # steps 3 and 6, then the 2 remaining steps at the end of fit
    assert len(payload["steps"]) == STEPS
    for name in ("cv", "throughput", "compute_time"):
        assert os.path.getsize(os.path.join(outdir, f"load_balance_{name}.png")) > 0
    assert not os.path.exists(os.path.join(outdir, "load_balance_memory.png"))


@pytest.mark.timeout(240)
def test_ddp_user_comm_hook_keeps_the_timing(tmp_path):
    # A user's own communication hook (compression, PowerSGD) no longer costs the timing: the monitor marks
    # the end of the backward with an engine callback, not with a hook of its own.
    monitor = LoadBalanceMonitor(dirpath=tmp_path / "out", print_summary=False, plots=False)
    trainer = _trainer(tmp_path, monitor, strategy="ddp_spawn", devices=2, log_every_n_steps=4)
    trainer.fit(TinyModule(register_user_hook=True))

    ranks = _read_csv(tmp_path / "out" / "load_balance_ranks.csv")
    assert len(ranks) == 2 * STEPS
    assert {row["backward_timed"] for row in ranks} == {"1"}
    for row in ranks:
        assert 0 < float(row["compute_time_s"]) <= float(row["step_time_s"])
        assert float(row["sync_wait_s"]) >= 0
    meta = json.load(open(tmp_path / "out" / "load_balance.json"))["summary"]["meta"]
    assert meta["timing_method"] == "backward_end"
    assert meta["num_collectives"] == 2  # steps 4 and 8
    _, token_cv = _expected_step_cvs()
    assert trainer.callback_metrics["balance/token_cv"].item() == pytest.approx(
        token_cv[4:8].mean(), rel=1e-6
    )


class _SleepInBackward(torch.autograd.Function):
    """Identity forward; the backward sleeps: a rank made deliberately slow by a known amount."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.seconds)
        return grad, None


SLOW_RANK_SLEEP_S = 0.5


class SlowRankModule(TinyModule):
    """Rank 1's backward takes SLOW_RANK_SLEEP_S longer than rank 0's at every step."""

    def training_step(self, batch, batch_idx):
        y = self.lin(batch["latents"])
        if self.global_rank == 1:
            y = _SleepInBackward.apply(y, SLOW_RANK_SLEEP_S)
        return y.pow(2).mean()


@pytest.mark.timeout(240)
def test_ddp_compute_time_excludes_the_wait_for_a_slow_rank(tmp_path):
    """The no-wait rule: the fast rank's compute time ends at its own backward, not at the all-reduce that
    waits for the slow rank; the wait appears in its measured synchronisation wait instead."""
    monitor = LoadBalanceMonitor(
        dirpath=tmp_path / "out", print_summary=False, plots=False, count_flops=False
    )
    trainer = _trainer(tmp_path, monitor, strategy="ddp_spawn", devices=2, log_every_n_steps=4)
    trainer.fit(SlowRankModule())

    rows = _read_csv(tmp_path / "out" / "load_balance_ranks.csv")
    by_step: dict[int, dict[int, dict]] = {}
    for row in rows:
        by_step.setdefault(int(row["batch_idx"]), {})[int(row["rank"])] = row
    assert len(by_step) == STEPS
    for step, pair in by_step.items():
        fast, slow = pair[0], pair[1]
        assert fast["backward_timed"] == slow["backward_timed"] == "1"
        c_fast, c_slow = float(fast["compute_time_s"]), float(slow["compute_time_s"])
        w_fast, w_slow = float(fast["sync_wait_s"]), float(slow["sync_wait_s"])
        # The slow rank's compute holds its sleep; the fast rank's does not hold the wait for it.
        assert c_slow >= SLOW_RANK_SLEEP_S, (step, c_slow)
        assert c_fast < c_slow - SLOW_RANK_SLEEP_S / 2, (step, c_fast, c_slow)
        # The fast rank waited for the slow one, measured on its own clock; the slow rank hardly waited.
        assert w_fast > w_slow + SLOW_RANK_SLEEP_S / 2, (step, w_fast, w_slow)
    summary = json.load(open(tmp_path / "out" / "load_balance.json"))["summary"]
    overall = summary["overall"]
    # Two ranks, one idle for most of the slow rank's step: the wait is near 1 - mean/max, i.e. well above
    # the 0.2 that a run folding the wait into compute time could never reach.
    assert overall["straggler_wait"] > 0.2
    # The measured wait tells the same story as the compute times (the monitor checks itself).
    assert overall["measured_straggler_wait"] == pytest.approx(overall["straggler_wait"], abs=0.1)


# ------------------------------------------------------------------ single process


def _count_gathers(monkeypatch):
    calls = []
    real = _dist.all_gather_floats

    def counting(values):
        calls.append(len(values))
        return real(values)

    monkeypatch.setattr(_dist, "all_gather_floats", counting)
    return calls


def test_one_collective_per_logged_step_and_files_cover_every_step(tmp_path, monkeypatch, capsys):
    calls = _count_gathers(monkeypatch)
    monitor = LoadBalanceMonitor(dirpath=tmp_path / "out")
    trainer = _trainer(tmp_path, monitor, log_every_n_steps=3)
    trainer.fit(TinyModule())

    # flushes at steps 3 and 6 (logged) and at the end of fit (2 left); each a few floats per step
    header, per_step = len(monitor_mod.HEADER), monitor_mod.NUM_FIELDS
    assert calls == [header + 3 * per_step, header + 3 * per_step, header + 2 * per_step]
    steps = _read_csv(tmp_path / "out" / "load_balance_steps.csv")
    assert len(steps) == STEPS
    # one rank: nothing to be imbalanced against
    assert {float(s["token_cv"]) for s in steps} == {0.0}
    m = trainer.callback_metrics
    assert m["balance/token_cv"].item() == 0.0
    assert m["balance/tokens_per_s"].item() > 0
    # CPU: memory statistics absent, no crash
    assert not any("vram" in k or "gib" in k for k in m)
    assert "balance/mfu" not in m  # no peak FLOP/s on CPU
    out = capsys.readouterr().out
    assert "LoadBalanceMonitor: 8 steps x 1 ranks" in out
    # the ten-second table: planned and measured CVs named apart, the steps counted, where the files are
    assert "planned compute CV" in out and "measured step-time CV" in out and "whole job:" not in out
    assert "4 in the measured times; left out: 4 warm-up" in out
    assert f"files: {os.path.abspath(tmp_path / 'out')}: load_balance_ranks.csv" in out
    assert max(len(line) for line in out.splitlines() if not line.lstrip().startswith("files:")) < 120
    summary = monitor.summary
    assert summary["meta"]["num_steps"] == STEPS
    assert summary["overall"]["tokens"] == sum(b * s for b, s in PLAN[0])


def test_gradient_accumulation_logs_at_optimizer_steps(tmp_path, monkeypatch):
    calls = _count_gathers(monkeypatch)
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = _trainer(tmp_path, monitor, log_every_n_steps=2, accumulate_grad_batches=2)
    trainer.fit(TinyModule())
    # 8 batches = 4 optimizer steps; logged at optimizer steps 2 and 4, each window 4 batches
    per_step = monitor_mod.NUM_FIELDS
    assert calls == [len(monitor_mod.HEADER) + 4 * per_step] * 2
    steps = _read_csv(tmp_path / "load_balance_steps.csv")
    assert [int(s["step"]) for s in steps] == [0, 1, 1, 2, 2, 3, 3, 4]


def test_csv_logger_single_process(tmp_path):
    logger = CSVLogger(tmp_path, name="lb")
    monitor = LoadBalanceMonitor(print_summary=False, plots=False)
    trainer = _trainer(tmp_path, monitor, logger=logger, log_every_n_steps=4)
    trainer.fit(TinyModule())
    rows = [r for r in _read_csv(os.path.join(trainer.log_dir, "metrics.csv")) if r.get("balance/token_cv")]
    assert [int(r["step"]) for r in rows] == [3, 7]
    assert os.path.exists(os.path.join(trainer.log_dir, "load_balance.json"))


def test_flop_counter_counts_each_shape_once(tmp_path):
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = _trainer(tmp_path, monitor)
    trainer.fit(TinyModule())
    steps = json.load(open(tmp_path / "load_balance.json"))["steps"]
    flops = [s["flops"] for s in steps]
    assert flops == [3 * 2 * b * D_IN * D_OUT for b, _ in PLAN[0]]
    # batch sizes 1, 2, 3, 4 are new at steps 0-3 only; later steps reuse the cached count
    assert [s["counted"] for s in steps] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert monitor.summary["meta"]["steps_with_flop_counting"] == 4


def test_flops_sources_in_order_of_preference(tmp_path):
    def run(module, **kwargs):
        monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False, **kwargs)
        _trainer(tmp_path, monitor).fit(module)
        payload = json.load(open(tmp_path / "load_balance.json"))
        return payload["summary"]["meta"]["flops_source"], [s["flops"] for s in payload["steps"]]

    source, flops = run(FlopsPerBatchModule())
    assert source == "flops_per_batch"
    assert flops == [7.0 * b * s for b, s in PLAN[0]]

    source, flops = run(AnalyticModule())
    assert source == "analytic"
    assert flops == [3 * 1000.0 * b * s for b, s in PLAN[0]]  # 3x the forward, text_len 0

    source, flops = run(AnalyticModule(), flops_fn=lambda batch: 5.0)
    assert source == "flops_fn"
    assert flops == [5.0] * STEPS

    source, flops = run(TinyModule(), count_flops=False)
    assert source is None
    assert flops == [None] * STEPS


def test_summary_says_where_the_flops_came_from_or_that_they_were_not_counted():
    from lightning_adaptiveload.monitor.report import format_summary

    meta = {"num_steps": 3, "world_size": 2, "device": "cpu", "timing_method": "step"}
    for source in ("flops_per_batch", None):
        text = format_summary({"meta": {**meta, "flops_source": source}, "overall": {}, "table": {}})
        first = text.splitlines()[0]
        assert "None" not in first  # "FLOPs by None" before
        assert first.endswith(
            "FLOPs by flops_per_batch" if source else "FLOPs not counted (no TFLOP/s or MFU)"
        )


def test_batches_without_work_keys_warn_and_do_not_crash(tmp_path):
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=True, print_summary=False)
    trainer = _trainer(tmp_path, monitor, log_every_n_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModule(dataset_cls=TupleBatches))
    assert any("not a dict" in str(w.message) for w in caught)
    m = trainer.callback_metrics
    assert "balance/token_cv" not in m and "balance/tokens_per_s" not in m
    assert "balance/step_time_cv" in m  # times are still measured
    ranks = _read_csv(tmp_path / "load_balance_ranks.csv")
    assert len(ranks) == 4 and {r["num_tokens"] for r in ranks} == {""}


def test_max_buffered_steps_bounds_the_buffer_without_logging(tmp_path, monkeypatch):
    calls = _count_gathers(monkeypatch)
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False, max_buffered_steps=3)
    _trainer(tmp_path, monitor, log_every_n_steps=0).fit(TinyModule())
    per_step, h = monitor_mod.NUM_FIELDS, len(monitor_mod.HEADER)
    assert calls == [h + 3 * per_step, h + 3 * per_step, h + 2 * per_step]
    assert len(_read_csv(tmp_path / "load_balance_steps.csv")) == STEPS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_buffered_steps": 0}, "max_buffered_steps"),
        ({"peak_flops": 0.0}, "peak_flops"),
        ({"flops_fn": 3}, "flops_fn"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoadBalanceMonitor(**kwargs)


def test_split_blocks_checks_that_ranks_line_up():
    f = monitor_mod.NUM_FIELDS
    header = [math.nan, math.nan]  # peak FLOP/s, device memory
    row0, row1 = [float(i) for i in range(f)], [float(i) for i in range(f)]
    row0[monitor_mod.FIELD_INDEX["cost"]], row1[monitor_mod.FIELD_INDEX["cost"]] = 3.0, 5.0
    steps = monitor_mod.split_blocks([[1.0, *header, *row0], [1.0, *header, *row1]])
    assert steps.shape == (1, 2, f)  # (steps, ranks, fields)
    assert steps[0, :, monitor_mod.FIELD_INDEX["cost"]].tolist() == [3.0, 5.0]
    with pytest.raises(RuntimeError, match=r"different step counts \[1, 2\]"):
        monitor_mod.split_blocks([[1.0, *header, *row0], [2.0, *header, *row0, *row0]])
    shifted = list(row0)
    shifted[monitor_mod.FIELD_INDEX["batch_idx"]] = 5.0
    with pytest.raises(RuntimeError, match=r"out of step: batch indices \[0.0, 5.0\]"):
        monitor_mod.split_blocks([[1.0, *header, *row0], [1.0, *header, *shifted]])


def test_balance_figures_are_the_simulators():
    """Issue 13: the monitor's whole-run and window figures are stats.balance_summary of the compute times
    (timed steps only): the simulator's names and definitions; straggler_wait is time-weighted."""
    from lightning_adaptiveload.tools.replay import balance_metrics

    rng = np.random.default_rng(2)
    k, world, f = 6, 3, monitor_mod.NUM_FIELDS
    steps = rng.random((k, world, f)) + 0.1
    steps[:, :, monitor_mod.FIELD_INDEX["batch_idx"]] = np.arange(k)[:, None]
    steps[:, :, monitor_mod.FIELD_INDEX["flags"]] = 2.0
    steps[0, 1, monitor_mod.FIELD_INDEX["flags"]] = (
        3.0  # FLOPs counted on a rank at step 0: its times are left out
    )
    comp = steps[:, :, monitor_mod.FIELD_INDEX["compute_time_s"]]
    comp[3] *= 10.0  # a long step: the time-weighted wait differs from the per-step mean
    table = monitor_mod.step_table(steps, np.full(world, 1e12), np.full(world, 10.0))
    figures = monitor_mod.balance_figures(table)
    assert figures == pytest.approx(stats.balance_summary(comp[1:]), rel=1e-12)
    simulated = balance_metrics(comp[1:], np.ones((k - 1, world), dtype=int))
    assert {key: simulated[key] for key in stats.BALANCE_FIGURES} == pytest.approx(figures, rel=1e-12)
    assert figures["straggler_wait"] != pytest.approx(figures["step_wait_mean"])


def test_step_table_matches_scalar_statistics():
    rng = np.random.default_rng(1)
    k, world, f = 5, 3, monitor_mod.NUM_FIELDS
    steps = rng.random((k, world, f)) + 0.1
    steps[:, :, monitor_mod.FIELD_INDEX["batch_idx"]] = np.arange(k)[:, None]
    steps[:, :, monitor_mod.FIELD_INDEX["flags"]] = 2.0
    totals = np.array([10.0, 20.0, 40.0])
    table = monitor_mod.step_table(steps, np.array([1e12, 1e12, 2e12]), totals)
    for i in range(k):
        cost = steps[i, :, monitor_mod.FIELD_INDEX["cost"]].tolist()
        comp = steps[i, :, monitor_mod.FIELD_INDEX["compute_time_s"]].tolist()
        assert table["compute_cv"][i] == pytest.approx(stats.cv(cost))
        assert table["compute_imbalance"][i] == pytest.approx(stats.imbalance(cost))
        assert table["step_time_cv"][i] == pytest.approx(stats.cv(comp))
        assert table["straggler_wait"][i] == pytest.approx(stats.straggler_wait(comp))
        wall = steps[i, :, monitor_mod.FIELD_INDEX["iter_time_s"]].max()
        tokens = steps[i, :, monitor_mod.FIELD_INDEX["num_tokens"]].sum()
        assert table["tokens_per_s"][i] == pytest.approx(tokens / wall)
        flops = steps[i, :, monitor_mod.FIELD_INDEX["flops"]].sum()
        assert table["mfu"][i] == pytest.approx(flops / wall / 4e12)
        eff = steps[i, :, monitor_mod.FIELD_INDEX["peak_allocated_bytes"]] / totals
        assert table["vram_efficiency_mean"][i] == pytest.approx(eff.mean())
        assert table["vram_efficiency_min"][i] == pytest.approx(eff.min())
    assert table["hook_timed"].tolist() == [1.0] * k and table["counted"].tolist() == [0.0] * k


@pytest.mark.cuda
def test_cuda_memory_and_mfu(tmp_path):
    monitor = LoadBalanceMonitor(dirpath=tmp_path, print_summary=False)
    trainer = _trainer(tmp_path, monitor, accelerator="cuda", log_every_n_steps=2, precision="bf16-mixed")
    trainer.fit(TinyModule())
    m = trainer.callback_metrics
    for key in ("vram_efficiency_mean", "vram_efficiency_min", "peak_vram_util_eff", "peak_allocated_gib"):
        assert f"balance/{key}" in m
    assert 0 < m["balance/vram_efficiency_min"].item() <= m["balance/vram_efficiency_mean"].item() < 1
    ranks = _read_csv(tmp_path / "load_balance_ranks.csv")
    assert all(int(r["peak_allocated_bytes"]) > 0 for r in ranks)
    assert all(0 < float(r["compute_time_s"]) <= float(r["step_time_s"]) for r in ranks)
    assert os.path.exists(tmp_path / "load_balance_memory.png")
    if monitor.summary["meta"]["peak_flops_per_device"][0] is not None:
        assert "balance/mfu" in m

"""The LoadBalanceMonitor's end of fit (issue 60, 3; issue 63, 4-5): the ten-second summary, each epoch's last step
told apart, fast_dev_run, where the files are for a Python fit, files that cannot be written, the counts of the
steps the measured times used and left out, and the monitor's checkpoint state."""

from __future__ import annotations

import csv
import errno
import logging
import math
import os
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from torch.utils.data import DataLoader, Dataset

from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor
from lightning_adaptiveload.monitor import loop_state, report
from lightning_adaptiveload.monitor import steps as st

BATCHES = 4  # per epoch


class Sized(Dataset):
    """A map-style dataset of BATCHES batches (a loader with a length: Lightning knows the epoch's last batch)."""

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        b, s = (1, 16) if i < BATCHES - 1 else (3, 8)
        return {"latents": torch.ones(b, 4), "seq_len": s, "batch_size": b, "num_tokens": b * s, "cost": 1.0}


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch["latents"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Sized(), batch_size=None)


def _fit(tmp_path, monitor, **kwargs):
    kwargs.setdefault("max_epochs", 2)
    trainer = quiet_cpu_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=2, **kwargs)
    trainer.fit(Tiny())
    return trainer


def _steps_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ the summary, from a known table


def _block(tokens: list[list[float]], ends: list[int], packed: list[int]) -> np.ndarray:
    """Gathered steps (K, 2 ranks, FIELDS) with these per-rank tokens, epoch-end and packed steps."""
    k, world = len(tokens), 2
    steps = np.ones((k, world, st.NUM_FIELDS))
    steps[:, :, st.FIELD_INDEX["batch_idx"]] = np.arange(k)[:, None]
    steps[:, :, st.FIELD_INDEX["step"]] = np.arange(1, k + 1)[:, None]
    steps[:, :, st.FIELD_INDEX["epoch"]] = (np.arange(k) // (k // max(1, len(ends))))[:, None]
    steps[:, :, st.FIELD_INDEX["num_tokens"]] = tokens
    steps[:, :, st.FIELD_INDEX["cost"]] = tokens
    steps[:, :, st.FIELD_INDEX["compute_time_s"]] = np.asarray(tokens) / 100.0
    flags = np.full((k, world), float(st.FLAG_HOOK))
    flags[ends] += st.FLAG_EPOCH_END
    flags[packed] += st.FLAG_PACKED
    steps[:, :, st.FIELD_INDEX["flags"]] = flags
    return steps


def _summary(steps: np.ndarray) -> dict:
    nan = np.full(steps.shape[1], np.nan)
    table = st.step_table(steps, nan, nan, 1024.0)
    described, overall = st.summarize_table(
        table, steps.shape[1], nan, [st.rank_band(steps, "peak_allocated_bytes")], 1.0
    )
    meta = {
        "num_steps": len(steps),
        "world_size": 2,
        "device": "cpu",
        "timing_method": "backward_end",
        "flops_source": None,
    }
    return {
        "meta": meta,
        "overall": overall,
        "table": described,
        "rows": st.step_rows(table),
        "epoch_ends": st.epoch_ends(table),
        "files": "/runs/x: load_balance_ranks.csv",
    }


def test_the_summary_is_a_short_table_naming_planned_and_measured_apart():
    # 2 epochs of 5 steps; each epoch's last step is lockstep's packed tail, 125 tokens against 25
    tokens = [[480, 470]] * 4 + [[125, 25]] + [[441, 450]] * 4 + [[125, 25]]
    summary = _summary(_block(tokens, ends=[4, 9], packed=[4, 9]))
    text = report.format_summary(summary)
    lines = text.splitlines()
    assert lines[0] == (
        "LoadBalanceMonitor: 10 steps x 2 ranks on cpu; compute time by backward_end, FLOPs not counted (no "
        "TFLOP/s or MFU)"
    )
    labels = [line[2:24].strip() for line in lines[1:8]]
    assert labels == [
        "steps",
        "tokens/s",
        "MFU",
        "planned compute CV",
        "measured step-time CV",
        "straggler wait",
        "VRAM efficiency",
    ]
    assert "whole job:" not in text and "cv_mean" not in text  # no key=value line
    planned = summary["table"]["compute_cv"]["mean"]
    assert f"planned compute CV      {100 * planned:5.1f}%" in text
    assert "of the compute time, ranks waiting for the slowest" in text
    # the epoch's last step, explained: the remainder packed after the equal steps
    ends = summary["epoch_ends"]
    assert ends["stands_out"] and ends["steps"] == 2 and ends["worst"]["rank_tokens_max"] == 125
    assert (
        "  last step of each epoch (2 steps): up to 125 tokens vs 25 on the ranks, token CV 66.7% (the other steps "
        "1.0%)\n    a pack of the samples left over after the epoch's equal steps (lockstep's packed tail)"
    ) in text
    assert lines[-1] == "  files: /runs/x: load_balance_ranks.csv"
    assert all(len(line) < 120 for line in lines)


def test_a_last_step_like_the_others_is_not_called_out():
    tokens = [[480, 470]] * 4 + [[450, 455]]
    summary = _summary(_block(tokens, ends=[4], packed=[]))
    assert summary["epoch_ends"]["stands_out"] is False
    assert "last step of each epoch" not in report.format_summary(summary)
    # the same spike on a step that is not packed: the remainder, in general words
    spike = _summary(_block([[480, 470]] * 4 + [[125, 25]], ends=[4], packed=[]))
    assert "the epoch's remainder, the samples its plan could not pair" in report.format_summary(spike)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, 5e-324])
def test_the_counts_of_steps_used_and_left_out_add_up(bad):
    steps = _block([[100, 90]] * 6, ends=[], packed=[])
    steps[0, :, st.FIELD_INDEX["flags"]] += st.FLAG_COUNTED  # a warm-up step
    steps[3, 1, st.FIELD_INDEX["compute_time_s"]] = bad
    summary = _summary(steps)
    rows = summary["rows"]
    reason = {-1.0: "negative", 5e-324: "subnormal"}.get(bad, "nan" if math.isnan(bad) else "inf")
    assert rows["steps"] == 6 and rows["used"] == 4
    assert rows["left_out"]["warm_up"] == 1 and rows["left_out"][reason] == 1
    assert rows["used"] + sum(rows["left_out"].values()) == rows["steps"]
    assert rows["cost_left_out"] == 0
    steps[4, 0, st.FIELD_INDEX["cost"]] = -1e9  # a cost model that prices a sample below zero
    assert _summary(steps)["rows"]["cost_left_out"] == 1
    assert "(1 steps without a usable cost left out)" in report.format_summary(_summary(steps))
    assert summary["overall"]["skipped_time_readings"] == 1.0
    assert (
        f"4 in the measured times; left out: 1 warm-up (FLOPs counted or compiling), 1 {reason} time reading"
        in (report.format_summary(summary))
    )


# ------------------------------------------------------------------ fits


def test_each_epochs_last_step_is_marked_and_a_python_fit_says_where_the_files_are(tmp_path, caplog):
    monitor = LoadBalanceMonitor(
        dirpath=tmp_path / "out", count_flops=False, plots=False, print_summary=False
    )
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, monitor)
    rows = _steps_csv(tmp_path / "out" / "load_balance_steps.csv")
    assert [int(r["epoch_end"]) for r in rows] == [0, 0, 0, 1] * 2
    assert [int(r["epoch"]) for r in rows] == [0] * 4 + [1] * 4
    assert {r["packed"] for r in rows} == {"0"}
    # print_summary=False: the monitor still says, once, where its files went (rank 0, Lightning's INFO log)
    said = [r.getMessage() for r in caplog.records if "LoadBalanceMonitor: files:" in r.getMessage()]
    assert said == [
        f"LoadBalanceMonitor: files: {os.path.abspath(tmp_path / 'out')}: load_balance_ranks.csv, "
        "load_balance_steps.csv, load_balance.json"
    ]
    assert monitor.summary["files"] == said[0].split("files: ", 1)[1]


def test_fast_dev_run_writes_nothing_where_the_next_run_would_overwrite_it(tmp_path, capsys):
    monitor = LoadBalanceMonitor(count_flops=False)
    trainer = quiet_cpu_trainer(tmp_path, callbacks=[monitor], fast_dev_run=True)
    trainer.fit(Tiny())
    assert not [f for f in os.listdir(tmp_path) if f.startswith("load_balance")]
    assert monitor.outdir is None
    out = capsys.readouterr().out
    assert "LoadBalanceMonitor: 1 steps x 1 ranks" in out  # the steps that ran, not the epoch's
    assert "files: none under fast_dev_run" in out
    assert monitor.summary["epoch_ends"] == {}  # one batch is no epoch's remainder
    # an explicit folder is still written
    kept = LoadBalanceMonitor(dirpath=tmp_path / "kept", count_flops=False, plots=False, print_summary=False)
    quiet_cpu_trainer(tmp_path, callbacks=[kept], fast_dev_run=True).fit(Tiny())
    assert len(_steps_csv(tmp_path / "kept" / "load_balance_steps.csv")) == 1


def _raise(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def test_a_file_that_cannot_be_written_is_reported_once_and_training_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "append_rank_rows", _raise(errno.EFBIG))
    monkeypatch.setattr(report, "write_steps_csv", _raise(errno.ENOSPC))
    monitor = LoadBalanceMonitor(dirpath=tmp_path, count_flops=False, plots=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, monitor)
    assert trainer.global_step == 2 * BATCHES  # every step ran
    said = [str(w.message) for w in caught if "could not write" in str(w.message)]
    ranks, steps = str(tmp_path / "load_balance_ranks.csv"), str(tmp_path / "load_balance_steps.csv")
    assert len(said) == 2, said  # four flushes, one warning for the ranks' CSV
    assert said[0].startswith(f"LoadBalanceMonitor: could not write {ranks} ([Errno {errno.EFBIG}]")
    assert said[1].startswith(f"LoadBalanceMonitor: could not write {steps} ([Errno {errno.ENOSPC}]")
    assert "training goes on" in said[0]
    assert os.path.exists(tmp_path / "load_balance.json")  # the other files are still written
    out = capsys.readouterr().out
    assert "not written: load_balance_ranks.csv (OSError: [Errno 27]" in out
    assert "load_balance_steps.csv (OSError: [Errno 28]" in out


def test_a_folder_that_cannot_be_written_at_the_start_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "write_ranks_header", _raise(errno.EROFS))
    monitor = LoadBalanceMonitor(dirpath=tmp_path / "ro", count_flops=False)
    with pytest.raises(OSError, match=r"LoadBalanceMonitor cannot write its files in .*ro .*dirpath="):
        _fit(tmp_path, monitor, max_epochs=1)


# ------------------------------------------------------------------ the monitor's checkpoint state


@pytest.mark.parametrize(
    ("state", "words"),
    [
        ([1, 2], "is list [1, 2], not a dict"),
        ({"steps": 3}, "has key(s) ['steps']: the monitor keeps no state"),
        (
            {"cost_refit": {"version": 1, "model": None}},
            "cost_refit lacks the key(s) ['applied', 'measurements']",
        ),
    ],
)
def test_the_monitors_state_is_checked(state, words):
    with pytest.raises(loop_state.LoopStateError) as err:
        LoadBalanceMonitor().load_state_dict(state)
    assert words in str(err.value) and "checkpoint['callbacks']['LoadBalanceMonitor']" in str(err.value)
    LoadBalanceMonitor().load_state_dict({})  # this release's (empty) state

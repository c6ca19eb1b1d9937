"""benchmarks/balance/closed_loop_report.py: each epoch's wait and the refits, from a run's monitor files."""

from __future__ import annotations

import csv
import json
import os
import sys

import _paths
import pytest

ROOT = str(_paths.ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "balance"))
import closed_loop_report as clr  # noqa: E402

sys.path.pop(0)

FIELDS = ["rank", "step", "epoch", "compute_time_s", "sync_wait_s"]


def _run(tmp_path, epochs: list[list[tuple[float, float]]], refits: list[dict] | None = None) -> str:
    """A run folder: per epoch, per step, two ranks' compute times (each waits for the slower)."""
    d = tmp_path / "run" / "logs" / "version_0"
    d.mkdir(parents=True)
    step = 0
    with open(d / "load_balance_ranks.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for e, epoch in enumerate(epochs):
            for times in epoch:
                step += 1
                for r, t in enumerate(times):
                    w.writerow([r, step, e, t, max(times) - t])
    if refits is not None:
        with open(d / "cost_refit.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in refits)
    return str(tmp_path / "run")


def test_each_epoch_has_its_own_wait_and_the_refits_are_read(tmp_path):
    first = [(1.0, 2.0)] * 6  # the fast rank waits 1 of every 2 s: 25% of the ranks' time
    second = [(1.9, 2.0)] * 4  # after the refit: 2.5%
    refit = {"epoch": 0, "step": 6, "status": "fitted", "reason": "", "clamped": False, "change": 1.3,
             "applied": True, "terms": {"after": {"alpha": 1.0}}, "error": {"all": {"n": 12, "mean": 0.01,
             "max": 0.02}}, "prior_error": {"all": {"n": 12, "mean": 0.2, "max": 0.5}}}  # fmt: skip
    out = clr.run_summary(_run(tmp_path, [first, second], [refit]), warmup=2)
    e0, e1 = out["epochs"]
    assert (e0["steps"], e1["steps"]) == (4, 4)  # the first epoch's warm-up steps left out, not the second's
    assert e0["straggler_wait"] == pytest.approx(0.25) and e0["measured_wait"] == pytest.approx(0.25)
    assert e1["straggler_wait"] == pytest.approx(0.025) and e1["measured_wait"] == pytest.approx(0.025)
    (r,) = out["refits"]
    assert r["status"] == "fitted" and r["error"]["mean"] == 0.01 and r["prior_error"]["max"] == 0.5


def test_replan_lines_are_read_apart_from_the_refits(tmp_path):
    refit = {"epoch": 0, "step": 3, "status": "fitted", "applied": True}
    replan = {"event": "replan", "epoch": 0, "step": 3, "window_wait": 0.2, "steps_left_before": 3,
              "steps_left_after": 4}  # fmt: skip
    out = clr.run_summary(_run(tmp_path, [[(1.0, 2.0)] * 6], [refit, replan]), warmup=0)
    assert [r["status"] for r in out["refits"]] == ["fitted"]
    assert out["replans"] == [replan]


def test_main_writes_json_and_refuses_a_folder_without_the_monitor(tmp_path, capsys):
    run = _run(tmp_path, [[(1.0, 1.0)] * 3])
    out = tmp_path / "cl.json"
    assert clr.main([f"on={run}", "--warmup", "0", "--out", str(out)]) == 0
    data = json.load(open(out))
    assert data["runs"]["on"]["epochs"][0]["straggler_wait"] == 0.0 and data["runs"]["on"]["refits"] == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert clr.main([f"off={empty}"]) == 2
    assert "no load_balance_ranks.csv" in capsys.readouterr().err

"""A quickstart checkpoint written by 0.1.0 resumes under this version, with the losses of an uninterrupted run.

The asset (``tests/assets/quickstart_v0.1.0_step30.ckpt``, how it was made: ``tests/assets/README.md``) holds
the DataModule's resume state and the monitor's closed-loop state in 0.1.0's shapes: the state keys this
release renamed are read through the one versioned migration of each state.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _timing import scaled

ASSET = Path(__file__).resolve().parents[1] / "assets" / "quickstart_v0.1.0_step30.ckpt"
STEPS = 40  # the asset stopped after step 30 of epoch 0 (67 steps per epoch)


def _fit(cwd: Path, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", "fit", "--config", "quickstart",
         f"--trainer.max_steps={STEPS}", "--trainer.log_every_n_steps=1", *extra],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(900),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out.stdout + out.stderr


def _losses(cwd: Path) -> dict[int, float]:
    (metrics,) = sorted(cwd.glob("runs/quickstart/logs/version_*/metrics.csv"))
    found = {}
    with open(metrics) as f:
        for row in csv.DictReader(f):
            loss = row.get("train/loss") or row.get("train_loss") or row.get("loss")
            if loss:
                found[int(row["step"])] = float(loss)
    return found


def test_the_asset_is_a_0_1_0_checkpoint():
    state = torch.load(ASSET, map_location="cpu", weights_only=False)
    assert state["global_step"] == 30
    segment = state["AdaptiveLoadDataModule"]["segments"][0]
    assert "mode" in segment and "schedule" not in segment  # written before the rename
    assert "cost_refit" in state["callbacks"]["LoadBalanceMonitor"]  # the closed loop's state, 0.1.0's place


@pytest.mark.timeout(scaled(1800))
def test_a_0_1_0_checkpoint_resumes_with_the_uninterrupted_losses(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    _fit(whole)
    log = _fit(resumed, f"--ckpt_path={ASSET}")
    assert "Restoring states from the checkpoint" in log or "Restored all states" in log, log[-3000:]
    assert "starting fresh" not in log
    want, got = _losses(whole), _losses(resumed)
    after = sorted(s for s in got if s >= 30)
    assert after and min(got) >= 30, sorted(got)  # it went on from step 30, not from scratch
    for step in after:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), (step, got[step], want[step])

"""Mid-epoch replanning on 2 gloo processes, with the injected step timer of ``tests/_refit_runner.py``.

The run starts from a deliberately wrong cost model (linear in tokens) under the lockstep schedule, whose
straggler wait grows towards the epoch's end. With ``RefitConfig(replan_wait=0.005, replan_window=20)`` the
monitor refits the model when a window's wait passes 0.5% and the rest of the epoch is replanned with it.
The step times are the true cost without noise here, so the measured wait is the true one. Checked:

- the replan happened once (``cost_refit.jsonl``), from a fitted model, and was the same on both ranks (the
  same new segment and the same per-step global token counts of the new plan);
- after it, the wait of the rest of the epoch is below that of the window that triggered it, and at most half
  that of the same steps of the same run without replanning;
- every sample of the epoch is read once, the ranks ran the same number of steps;
- a run resumed in fresh processes from a checkpoint saved after the replan continues the replanned plan:
  the same batches as the run that went on, and every sample once over the two.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pytest
from _fixtures import assert_each_key_once, index_keys
from _paths import TESTS
from _refit_runner import launch

from lightning_adaptiveload import stats

RUNNER = str(TESTS / "_refit_runner.py")
TRUE = {"kind": "quadratic", "alpha": 1e-3, "beta": 2e-5, "gamma": 0.0, "c0": 0.4}
LINEAR = {"kind": "quadratic", "alpha": 1.0, "beta": 0.0, "gamma": 0.0}  # deliberately wrong: cost = tokens
REPLAN = {"resize_batches": True, "replan_wait": 0.005, "replan_window": 20}


def _rows(out: str, name: str) -> list[list[dict]]:
    return [[json.loads(line) for line in open(os.path.join(out, f"{name}.rank{r}.jsonl"))] for r in range(2)]


def _steps(rows: list[list[dict]]) -> list[list[dict]]:
    return [[x for x in r if "true_cost" in x] for r in rows]


def _costs(rows: list[list[dict]]) -> np.ndarray:
    """(steps, ranks) true costs of the steps each rank ran."""
    per_rank = _steps(rows)
    assert len({len(x) for x in per_rank}) == 1, "ranks ran different step counts"
    return np.array([[s["true_cost"] for s in x] for x in per_rank]).T


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_shards) -> dict:
    data = synthetic_shards([40] * 12, seed=5, name="replan-shards")
    out = str(tmp_path_factory.mktemp("replan-out"))
    common = {"schedule": "lockstep", "max_epochs": 1, "cost_model": LINEAR, "noise": False, "num_workers": 2}
    first = [
        {**common, "name": "replan", "refit": REPLAN, "ckpt_every": 5},
        {**common, "name": "plain", "refit": {"resize_batches": True}},
    ]
    cfg = {"data": data, "out": out, "world": 2, "true": TRUE}
    launch({**cfg, "runs": first}, out, timeout=400, script=RUNNER)
    events = [json.loads(x) for x in open(os.path.join(out, "replan-monitor", "cost_refit.jsonl"))]
    replans = [e for e in events if e.get("event") == "replan"]
    assert replans, events  # the wrong model's wait passed 0.5%: the check below needs a replan
    at = replans[0]["step"]
    ckpts = {
        int(re.search(r"at-(\d+)", p).group(1)): p
        for p in glob.glob(os.path.join(out, "replan-ckpt", "*.ckpt"))
    }
    after = min(s for s in ckpts if s > at)  # saved after the replan, with steps of the new plan consumed
    resumed = [{**first[0], "name": "resumed", "ckpt_every": None, "resume": ckpts[after]}]
    launch({**cfg, "runs": resumed}, out, timeout=300, script=RUNNER)  # fresh processes
    return {"out": out, "keys": index_keys(data), "events": events, "replans": replans, "ckpt_step": after}


@pytest.mark.timeout(600)
def test_replan_lowers_the_wait_of_the_rest_of_the_epoch(runs):
    (replan,) = runs["replans"]  # max_replans_per_epoch=1
    refit = [e for e in runs["events"] if e.get("event") is None and e["step"] == replan["step"]]
    assert refit and refit[0]["status"] == "fitted" and refit[0]["applied"], refit
    assert replan["window_wait"] > REPLAN["replan_wait"]
    assert replan["consumed_steps"] == replan["step"] and replan["steps_left_after"] > 0
    with_replan, without = _costs(_rows(runs["out"], "replan")), _costs(_rows(runs["out"], "plain"))
    at = replan["consumed_steps"]
    assert len(with_replan) == at + replan["steps_left_after"]  # the fit loop ran the replanned epoch whole
    assert len(without) == at + replan["steps_left_before"]
    np.testing.assert_array_equal(with_replan[:at], without[:at])  # the same run up to the replan
    after, same_steps_unreplanned = stats.straggler_wait(with_replan[at:]), stats.straggler_wait(without[at:])
    assert same_steps_unreplanned > 0.01, same_steps_unreplanned  # the wrong model's tail waits: can fail
    assert after <= 0.5 * same_steps_unreplanned, (after, same_steps_unreplanned)
    logged = json.load(open(os.path.join(runs["out"], "replan.metrics.json")))
    assert logged["balance/replan/window_wait"] == pytest.approx(replan["window_wait"])
    assert logged["balance/replan/steps_left_before"] == replan["steps_left_before"]
    assert logged["balance/replan/steps_left_after"] == replan["steps_left_after"]
    window = stats.straggler_wait(with_replan[at - REPLAN["replan_window"] : at])
    assert window == pytest.approx(replan["window_wait"])  # the monitor's window: the true costs, no noise
    assert after < window, (after, window)  # the wait fell after the replan


@pytest.mark.timeout(600)
def test_replanned_epoch_is_exact_and_the_same_on_both_ranks(runs):
    rows = _rows(runs["out"], "replan")
    assert_each_key_once(_steps(rows), runs["keys"], "replanned epoch")
    segments = [[x for x in r if "segment" in x] for r in rows]
    assert [s["segment"]["kind"] for s in segments[0]] == ["fresh", "refit"]
    assert segments[0] == segments[1]  # settings (the refit model), start step and the plan's global tokens
    assert segments[0][1]["segment"]["batcher"]["cost_model"] != LINEAR
    assert segments[0][1]["global_step"] == runs["replans"][0]["step"]


@pytest.mark.timeout(600)
def test_resume_after_a_replan_continues_the_replanned_plan(runs):
    whole, resumed = _steps(_rows(runs["out"], "replan")), _steps(_rows(runs["out"], "resumed"))
    k = runs["ckpt_step"]
    for r in range(2):
        assert [s["keys"] for s in resumed[r]] == [s["keys"] for s in whole[r][k:]]
    assert_each_key_once([whole[r][:k] + resumed[r] for r in range(2)], runs["keys"], "killed and resumed")

"""The closed loop on 2 gloo processes: the plan learns the true cost from the run's own (injected) step times.

The step times come from a known cost function (``tests/_refit_runner.py``: ``c0 + sum(alpha*S + beta*S^2)``
with +-2% noise and x3 outliers), unlike the starting model (linear in tokens). Checked (issue 41):

- epoch 2's straggler wait, from the true costs of the planned batches, is within 1.5x of planning with the
  true model, and the wrong model's epoch 1 is far from it (so the check can fail);
- the fitted terms are within 5% of the true ones (bucketed batches and packs);
- every rank plans with the same model, bit for bit, and the plans stay exact (every sample once, equal steps);
- a run killed after epoch 1 and resumed from its checkpoint in fresh processes plans epoch 2 with the
  learned model: the same batches as the run that was not interrupted.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _fixtures import assert_each_key_once, index_keys
from _paths import TESTS
from _refit_runner import launch

from lightning_adaptiveload import stats

RUNNER = str(TESTS / "_refit_runner.py")
TRUE = {"kind": "quadratic", "alpha": 1e-3, "beta": 2e-5, "gamma": 0.0, "c0": 0.4}
LINEAR = {"kind": "quadratic", "alpha": 1.0, "beta": 0.0, "gamma": 0.0}  # deliberately wrong: cost = tokens


def _records(out: str, name: str) -> list[list[dict]]:
    return [[json.loads(line) for line in open(os.path.join(out, f"{name}.rank{r}.jsonl"))] for r in range(2)]


def _steps(rows: list[list[dict]], epoch: int) -> list[list[dict]]:
    return [[x for x in r if x.get("epoch") == epoch and "true_cost" in x] for r in rows]


def _planned_model(rows: list[list[dict]], epoch: int) -> list[dict]:
    """Per rank, the data module's cost model when ``epoch`` started (the model its plan was made with)."""
    return [next(x["model"] for x in r if x.get("epoch_start") == epoch) for r in rows]


def _wait(rows: list[list[dict]], epoch: int) -> float:
    """The straggler wait of ``epoch`` from the true costs of the batches each rank ran."""
    per_rank = _steps(rows, epoch)
    assert len({len(x) for x in per_rank}) == 1, "ranks ran different step counts"
    return stats.straggler_wait(np.array([[s["true_cost"] for s in x] for x in per_rank]).T)


def _close(fitted: dict, rtol: float) -> list[str]:
    return [
        f"{t}: {fitted.get(t, 0.0)!r} vs {TRUE[t]!r}"
        for t in ("c0", "alpha", "beta")
        if abs(fitted.get(t, 0.0) / TRUE[t] - 1) > rtol
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_shards) -> dict:
    data = synthetic_shards([40] * 12, seed=5, name="refit-shards")
    out = str(tmp_path_factory.mktemp("refit-out"))
    first = [
        {"name": "lockstep", "schedule": "lockstep", "max_epochs": 2, "cost_model": LINEAR, "ckpt": True},
        {"name": "truth", "schedule": "lockstep", "max_epochs": 2, "cost_model": TRUE, "refit": False},
        {"name": "packed", "schedule": "packed", "max_epochs": 2, "cost_model": LINEAR},
    ]
    cfg = {"data": data, "out": out, "world": 2, "true": TRUE}
    launch({**cfg, "runs": first}, out, timeout=400, script=RUNNER)
    ckpt = os.path.join(out, "lockstep-ckpt", "epoch0.ckpt")
    assert os.path.exists(ckpt), os.listdir(os.path.join(out, "lockstep-ckpt"))
    resumed = [{**first[0], "name": "resumed", "ckpt": False, "resume": ckpt}]
    launch({**cfg, "runs": resumed}, out, timeout=300, script=RUNNER)  # fresh processes
    return {"out": out, "keys": index_keys(data)}


@pytest.mark.timeout(600)
def test_refit_brings_epoch_2_wait_to_the_true_models(runs):
    rows, truth = _records(runs["out"], "lockstep"), _records(runs["out"], "truth")
    assert _planned_model(rows, 0)[0] == LINEAR
    wrong, learned, best = _wait(rows, 0), _wait(rows, 1), _wait(truth, 1)
    assert wrong > 10 * best, (wrong, best)  # the wrong model costs the balance: the check below can fail
    assert learned <= 1.5 * best, (learned, best, wrong)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["lockstep", "packed"])
def test_fitted_terms_within_5_percent_and_equal_on_every_rank(runs, name):
    rows = _records(runs["out"], name)
    models = _planned_model(rows, 1)
    assert models[0] == models[1]  # bit for bit: the same gathered rows, the same fit
    assert not _close(models[0], 0.05), _close(models[0], 0.05)
    refits = [
        json.loads(line) for line in open(os.path.join(runs["out"], f"{name}-monitor", "cost_refit.jsonl"))
    ]
    assert [r["epoch"] for r in refits] == [0, 1]
    first = refits[0]
    assert first["status"] == "fitted" and first["applied"] and not first["clamped"]
    assert first["points_rejected"] > 0  # the injected x3 outliers were seen and left out
    assert first["error"]["all"]["mean"] <= 0.05 and first["error"]["all"]["max"] <= 0.15
    assert first["prior_error"]["all"]["mean"] > first["error"]["all"]["mean"]
    for epoch in (0, 1):
        per_rank = _steps(rows, epoch)
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        assert_each_key_once(per_rank, runs["keys"], f"{name} epoch {epoch}")


@pytest.mark.timeout(600)
def test_resume_after_epoch_1_plans_with_the_learned_model(runs):
    whole, resumed = _records(runs["out"], "lockstep"), _records(runs["out"], "resumed")
    assert _planned_model(resumed, 1) == _planned_model(whole, 1)
    assert _planned_model(resumed, 1)[0] != LINEAR
    for r in range(2):
        assert [s["keys"] for s in _steps(resumed, 1)[r]] == [s["keys"] for s in _steps(whole, 1)[r]]

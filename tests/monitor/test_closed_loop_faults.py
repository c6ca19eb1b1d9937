"""The ClosedLoop against hostile states and readings (issue 63, 4-5): its checkpoint state checked field by
field, a cost model it cannot use refused naming where it came from, a refit that never raises from numerical
trouble and says what it left out, and a cost_refit.jsonl that cannot be written."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
from test_closed_loop import SHAPES, TRUE, Recording, _fit, _models

from lightning_adaptiveload.callbacks.closed_loop import ClosedLoop
from lightning_adaptiveload.monitor import cost_refit, loop_state, report
from lightning_adaptiveload.monitor.cost_refit import CostRefitter, describe_dropped, format_refit
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import RefitConfig, StepMeasurements, refit_cost_model

WHERE = "checkpoint['callbacks']['ClosedLoop']"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written after one epoch with the closed loop (its learned model applied)."""
    tmp = tmp_path_factory.mktemp("saved")
    trainer, closed, _ = _fit(tmp / "run", 1, True)
    path = str(tmp / "a.ckpt")
    trainer.save_checkpoint(path)
    return path, closed._refitter.model


def _state(saved) -> dict:
    return copy.deepcopy(torch.load(saved[0], weights_only=False)["callbacks"]["ClosedLoop"])


def _set(state: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = state
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return state


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("cost_refit.measurements", _DELETE, "cost_refit lacks the key(s) ['measurements']"),
        ("cost_refit.model.alpha", "abc", "cost_refit.model.alpha is str 'abc'; expected a finite number"),
        ("cost_refit.model.alpha", True, "cost_refit.model.alpha is bool True; expected a finite number"),
        (
            "cost_refit.model.beta",
            math.inf,
            "cost_refit.model.beta is inf; a cost-model coefficient must be finite",
        ),
        (
            "cost_refit.model.c0",
            math.nan,
            "cost_refit.model.c0 is nan; a cost-model coefficient must be finite",
        ),
        (
            "cost_refit.model.beta",
            -1.0,
            "cost_refit.model.beta is -1.0; a cost-model coefficient beta must be >= 0",
        ),
        (
            "cost_refit.model.kind",
            "cubic",
            "cost_refit.model is not a cost model (CostModel kind must be one of",
        ),
        ("cost_refit.applied", "yes", "cost_refit.applied is str 'yes'; expected true or false"),
        (
            "cost_refit.version",
            "1",
            "cost refit state has version '1' (cost_refit.version is str '1'); this release reads version 1",
        ),
        (
            "cost_refit.measurements.seconds.0",
            "abc",
            "cost_refit.measurements.seconds[0] is str 'abc'; expected a number",
        ),
        (
            "cost_refit.measurements.rank.0",
            -1.0,
            "cost_refit.measurements.rank[0] is -1.0; expected a whole number",
        ),
        ("cost_refit.window.rank", "abc", "cost_refit.window.rank is str 'abc'; expected a list of at most"),
        (
            "cost_refit.measurements.warmup.0",
            0.5,
            "cost_refit.measurements.warmup[0] is 0.5; expected 0 or 1",
        ),
        (
            "cost_refit.measurements.count",
            [1.0],
            "cost_refit.measurements.count has 1 rows, the columns before it",
        ),
        (
            "cost_refit.seen.0",
            [0, 5, 1],
            "cost_refit.seen[0] is list [0, 5, 1]; expected [rank (integer >= 0)",
        ),
        (
            "cost_refit.history",
            {"a": 1},
            "cost_refit.history is dict {'a': 1}; expected a list of refit records",
        ),
        ("replan.epoch", -1, "replan.epoch is int -1; expected an integer >= 0 or null"),
        ("replan.replans", 1.5, "replan.replans is float 1.5; expected an integer >= 0"),
        ("extra", 1, "the state has unknown key(s) ['extra']"),
        ("version", 7, "has version 7"),
    ],
)
def test_a_bad_field_of_the_state_is_refused_naming_it_and_the_rule(saved, path, value, words):
    state = _set(_state(saved), path, value)
    closed = ClosedLoop()
    before = closed._refitter.state_dict()
    with pytest.raises(loop_state.LoopStateError) as err:  # a ValueError: never a bare KeyError
        closed.load_state_dict(state)
    message = str(err.value)
    assert words in message and WHERE in message, message
    assert closed._refitter.state_dict() == before  # nothing restored from a state that failed a check


def test_a_bad_state_in_a_checkpoint_stops_the_resume_naming_the_key(saved, tmp_path):
    checkpoint = torch.load(saved[0], weights_only=False)
    checkpoint["callbacks"]["ClosedLoop"]["cost_refit"]["model"]["alpha"] = True
    bad = str(tmp_path / "bad.ckpt")
    torch.save(checkpoint, bad)
    with pytest.raises(
        loop_state.LoopStateError, match=r"\['ClosedLoop'\]: cost_refit.model.alpha is bool True"
    ):
        _fit(tmp_path / "b", 2, True, ckpt=bad)
    # the same state where 0.1.0 kept it: named under the monitor's key
    state = checkpoint["callbacks"].pop("ClosedLoop")
    state.pop("version")
    checkpoint["callbacks"]["LoadBalanceMonitor"] = state
    old = str(tmp_path / "old.ckpt")
    torch.save(checkpoint, old)
    with pytest.raises(loop_state.LoopStateError, match=r"\['LoadBalanceMonitor'\]: cost_refit.model.alpha"):
        _fit(tmp_path / "c", 2, True, ckpt=old)


class Planning(Recording):
    """A data module whose batcher checks a cost model against its lengths, as AdaptiveLoadDataModule's does."""

    def set_cost_model(self, model) -> None:
        shapes = [(4, 1, 2 * s, 2) for s in sorted({s for _, s in SHAPES})]  # latent shapes of S tokens
        self.batcher.set_cost_model(model, shapes)
        super().set_cost_model(model)


def test_a_restored_model_the_data_module_cannot_plan_with_is_dropped_naming_the_checkpoint(saved, tmp_path):
    checkpoint = torch.load(saved[0], weights_only=False)
    checkpoint["callbacks"]["ClosedLoop"]["cost_refit"]["model"]["gamma"] = -1e9
    bad = str(tmp_path / "gamma.ckpt")
    torch.save(checkpoint, bad)
    dm = Planning()
    own = dm.batcher.cost_model
    with pytest.warns(UserWarning) as caught:
        trainer, closed, _ = _fit(tmp_path / "b", 2, True, ckpt=bad, dm=dm)
    said = [str(w.message) for w in caught if "is not used" in str(w.message)]
    assert len(said) == 1
    assert f"the cost model in {WHERE}['cost_refit']['model']" in said[0]
    assert "the data module refused it" in said[0] and "gamma=-1000000000.0" in said[0]
    assert "plans with its own cost model" in said[0]
    # not applied: epoch 1 was planned with the data module's own model; the run went on and refitted
    assert dm.events[0] == ("loader", 1) and trainer.current_epoch == 2
    assert all(m.gamma == 0 for m in _models(dm)) and own.gamma == 0


def test_a_refit_the_data_module_refuses_is_logged_not_applied(tmp_path, monkeypatch):
    refuse = Recording()
    monkeypatch.setattr(
        refuse, "set_cost_model", lambda model: (_ for _ in ()).throw(ValueError("no, thanks"))
    )
    with pytest.warns(
        UserWarning, match="cost model refitted, not applied: the data module refused it: no, thanks"
    ):
        _fit(tmp_path, 1, {"warmup_steps_per_class": 0}, dm=refuse)
    line = json.loads(open(tmp_path / "cost_refit.jsonl").read().splitlines()[-1])
    assert not line["applied"] and line["not_applied_because"] == "the data module refused it: no, thanks"


# ------------------------------------------------------------------ the refit never raises


def _rows(seconds: list[float]) -> StepMeasurements:
    """Bucketed steps of TRUE's cost, with these times in place of the first ones."""
    b = np.array([b for b, _ in SHAPES], dtype=np.float64)
    s = np.array([s for _, s in SHAPES], dtype=np.float64)
    y = np.array([TRUE.batch_cost(int(bi), int(si)) for bi, si in zip(b, s)])
    y[: len(seconds)] = seconds
    n = len(b)
    return StepMeasurements(np.zeros(n), np.arange(n), b, b * s, b * s * s, s, np.zeros(n), y, np.zeros(n))


@pytest.mark.parametrize(
    ("seconds", "reason"),
    [
        ([5e-324], "subnormal_time"),
        ([-1.0], "negative_time"),
        ([math.nan], "nan_time"),
        ([math.inf], "inf_time"),
        ([0.0], "zero_time"),
    ],
)
def test_a_reading_that_is_no_measurement_is_left_out_and_counted(seconds, reason):
    rows = _rows(seconds)
    # 5e-324 raised LinAlgError (SVD did not converge) before
    result = refit_cost_model(CostModel.default(), rows, RefitConfig(min_points_per_term=4))
    assert result.status == "fitted" and result.points_dropped == {reason: 1}
    assert abs(result.model.beta / TRUE.beta - 1) < 1e-6  # the others still give the true model
    total = (
        result.points_used
        + result.points_rejected
        + result.points_warmup
        + sum(result.points_dropped.values())
    )
    assert total == len(rows)
    assert "1 left out (1 compute time" in format_refit(result)


def test_numerical_trouble_in_the_fit_keeps_the_prior_and_says_so(monkeypatch):
    def no_svd(*args, **kwargs):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(np.linalg, "svd", no_svd)
    prior = CostModel.default()
    result = refit_cost_model(prior, _rows([]), RefitConfig())
    assert result.status == "kept" and result.model == prior
    assert "the fit failed numerically" in result.reason and "SVD did not converge" in result.reason
    assert result.points_dropped == {"fit_failed": len(SHAPES)}
    assert describe_dropped(result) == f"{len(SHAPES)} left out ({len(SHAPES)} the fit failed)"
    # and whatever the fit raises, the refitter keeps the prior
    monkeypatch.setattr(cost_refit, "refit_cost_model", lambda *a: 1 / 0)
    refitter = CostRefitter(RefitConfig())
    refitter._window = [_rows([])]
    kept = refitter.refit(prior, 0, 10)
    assert kept.status == "kept" and "ZeroDivisionError" in kept.reason and refitter.model == prior


def _module_with_times(times: dict[int, float]):
    """The test_closed_loop module, whose step i takes times[i] seconds where given."""
    from test_closed_loop import Timed

    class Odd(Timed):
        def training_step(self, batch, batch_idx):
            if batch_idx in times:
                self.clock.advance(times[batch_idx])
                return self.lin(batch["latents"]).pow(2).mean()
            return super().training_step(batch, batch_idx)

    return Odd


def test_a_bad_step_time_in_a_fit_is_left_out_of_the_refit_with_a_warning(tmp_path, monkeypatch):
    from test_closed_loop import LoadBalanceMonitor, ManualClock, quiet_cpu_trainer

    clock = ManualClock()
    monitor = LoadBalanceMonitor(
        dirpath=tmp_path, clock=clock, count_flops=False, plots=False, print_summary=False
    )
    closed = ClosedLoop(refit={"warmup_steps_per_class": 0})
    trainer = quiet_cpu_trainer(tmp_path, max_epochs=1, log_every_n_steps=4, callbacks=[monitor, closed])
    module = _module_with_times({5: 0.0, 9: 0.0})(clock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=Recording())
    said = [str(w.message) for w in caught if "left out" in str(w.message)]
    assert len(said) == 1 and "2 left out (2 compute time zero) of the window's 24 rows" in said[0]
    line = json.loads(open(tmp_path / "cost_refit.jsonl").read().splitlines()[-1])
    assert line["points_dropped"] == {"zero_time": 2} and line["status"] == "fitted"
    assert line["points_used"] + line["points_rejected"] + line["points_warmup"] + 2 == len(SHAPES)


def test_cost_refit_jsonl_that_cannot_be_written_is_reported_once(tmp_path, monkeypatch):
    real = report.append_json_line

    def full(path, payload):
        if os.path.basename(path) == "cost_refit.jsonl":
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        return real(path, payload)

    monkeypatch.setattr(report, "append_json_line", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, closed, dm = _fit(tmp_path, 2, {"every_n_steps": 8, "warmup_steps_per_class": 0})
    said = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        f"ClosedLoop: could not write {tmp_path / 'cost_refit.jsonl'}"
    )
    assert trainer.current_epoch == 2 and len(closed._refitter.history) == 6  # steps 8, 16, 24 of both epochs
    assert len(_models(dm)) >= 2


def test_the_monitors_state_of_0_1_0_is_checked_through_the_same_schema():
    good = CostRefitter(RefitConfig()).state_dict()
    assert (
        loop_state.read_loop_state({"cost_refit": good, "replan": {"epoch": 0, "replans": 0}})["version"] == 2
    )
    with pytest.raises(
        loop_state.LoopStateError, match=r"\['LoadBalanceMonitor'\]: replan.replans is bool True"
    ):
        loop_state.check_monitor_state({"cost_refit": good, "replan": {"epoch": 0, "replans": True}})

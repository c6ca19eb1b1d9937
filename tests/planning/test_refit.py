"""The cost-model refit (planning/refit.py) and its shell pieces (monitor/cost_refit.py): pure, milliseconds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.monitor.cost_refit import (
    CostRefitter,
    apply_to_datamodule,
    measurements_from_steps,
    refit_metrics,
)
from lightning_adaptiveload.monitor.steps import FIELD_INDEX, FLAG_COUNTED, FLAG_HOOK, FLAG_PACKED, NUM_FIELDS
from lightning_adaptiveload.monitor.timing import ManualClock
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import (
    RefitConfig,
    RefitResult,
    StepMeasurements,
    mark_warmup,
    refit_cost_model,
    shape_classes,
)

TRUE = CostModel(kind="quadratic", alpha=1e-3, beta=2e-5, c0=0.4)
LINEAR = CostModel(kind="quadratic", alpha=1.0)
LENGTHS = np.array([24, 72, 100, 120, 150, 225])


def packs(n: int, seed: int = 0, noise: float = 0.02, outlier_every: int = 0, model: CostModel = TRUE):
    """``n`` packs of 1-6 samples of the tiny mix's lengths, timed by ``model`` with noise and outliers."""
    rng = np.random.default_rng(seed)
    lens = [rng.choice(LENGTHS, int(c)).astype(float) for c in rng.integers(1, 7, n)]
    sec = np.array([model.pack_cost(x) for x in lens]) * (1 + noise * rng.uniform(-1, 1, n))
    if outlier_every:
        sec[::outlier_every] *= 3.0
    return StepMeasurements(
        rank=np.arange(n) % 2,
        batch_idx=np.arange(n) // 2,
        count=[len(x) for x in lens],
        token_sum=[x.sum() for x in lens],
        square_sum=[(x * x).sum() for x in lens],
        seq_len=[x.max() for x in lens],
        packed=np.ones(n),
        seconds=sec,
        warmup=np.zeros(n),
    )


def buckets(batches: list[tuple[int, int]], model: CostModel = TRUE) -> StepMeasurements:
    """Bucketed batches (B, S), one per row, timed exactly by ``model``."""
    b = np.array([x[0] for x in batches], dtype=float)
    s = np.array([x[1] for x in batches], dtype=float)
    return StepMeasurements(
        rank=np.zeros(len(b)),
        batch_idx=np.arange(len(b)),
        count=b,
        token_sum=b * s,
        square_sum=b * s * s,
        seq_len=s,
        packed=np.zeros(len(b)),
        seconds=[model.batch_cost(int(x), y) for x, y in zip(b, s)],
        warmup=np.zeros(len(b)),
    )


def rel(a: float, b: float) -> float:
    return abs(a / b - 1)


# ---------------------------------------------------------------------- the fit


def test_refit_recovers_the_true_terms_through_noise_and_outliers():
    result = refit_cost_model(LINEAR, packs(300, outlier_every=19), RefitConfig())
    assert result.status == "fitted" and result.reason == ""
    m = result.model
    assert rel(m.c0, 0.4) < 0.05 and rel(m.alpha, 1e-3) < 0.05 and rel(m.beta, 2e-5) < 0.05
    assert result.points_rejected >= 300 // 19  # every x3 outlier is out
    assert result.error["all"]["mean"] < 0.02 and result.error["all"]["max"] < 0.05
    assert result.prior_error["all"]["mean"] > 5 * result.error["all"]["mean"]
    assert result.terms()["before"] == {"alpha": 1.0, "beta": 0.0, "gamma": 0.0, "c0": 0.0}


def test_without_outlier_rejection_the_outliers_bias_the_fit():
    # The regression this guards: a plain least-squares fit is pulled by the x3 steps.
    data = packs(300, outlier_every=7)
    robust = refit_cost_model(LINEAR, data, RefitConfig()).model
    plain = refit_cost_model(LINEAR, data, RefitConfig(max_outlier_rounds=1, outlier_threshold=1e9)).model

    def worst(m: CostModel) -> float:
        return max(rel(m.c0, 0.4), rel(m.alpha, 1e-3), rel(m.beta, 2e-5))

    assert worst(robust) < 0.05
    assert worst(plain) > 0.1


def test_bucketed_batches_fit_the_same_model_with_b():
    # Bucketed batches: B samples of S tokens; B varies between classes, so c0 is told apart.
    batches = [(b, s) for s in (24, 72, 120, 225) for b in (1, 2, 4, 7)] * 2
    result = refit_cost_model(LINEAR, buckets(batches), RefitConfig())
    assert result.status == "fitted"
    assert rel(result.model.c0, 0.4) < 1e-6 and rel(result.model.beta, 2e-5) < 1e-6
    assert set(result.error) == {"S=24", "S=72", "S=120", "S=225", "all"}
    assert result.error["S=225"]["n"] == 8


def test_one_shape_class_only_fits_the_priors_scale():
    # One (B, S): c0, alpha and beta cannot be told apart; the prior's shape is kept, its unit fitted.
    prior = CostModel(kind="quadratic", alpha=2.0, beta=0.01, c0=5.0)
    result = refit_cost_model(prior, buckets([(4, 100)] * 20), RefitConfig())
    assert result.status == "scaled" and "tell c0, alpha and beta apart" in result.reason
    k = result.model.alpha / prior.alpha
    assert result.model.beta / prior.beta == pytest.approx(k) and result.model.c0 / prior.c0 == pytest.approx(
        k
    )
    assert result.model.batch_cost(4, 100) == pytest.approx(TRUE.batch_cost(4, 100))


def test_too_few_steps_keep_the_prior_and_say_why():
    result = refit_cost_model(LINEAR, buckets([(1, 24), (2, 72)]), RefitConfig(min_points_per_term=4))
    assert result.status == "kept" and result.model is LINEAR
    assert "fewer than min_points_per_term=4" in result.reason
    few = refit_cost_model(LINEAR, buckets([(1, 24), (2, 72), (3, 120), (1, 225)] * 2), RefitConfig())
    assert few.status == "scaled" and "fewer than 12" in few.reason


def test_warmup_rows_are_left_out():
    data = packs(60, noise=0.0)
    slow = StepMeasurements(
        **{**data.__dict__, "seconds": data.seconds * np.where(np.arange(60) < 6, 50.0, 1.0)}
    )
    flagged, _ = mark_warmup(slow, steps_per_class=3)  # 2 ranks x 3 first packs
    result = refit_cost_model(LINEAR, flagged, RefitConfig())
    assert result.points_warmup == 6 and result.points_rejected == 0
    assert rel(result.model.beta, 2e-5) < 1e-6


def test_mark_warmup_counts_per_rank_and_class_across_windows():
    data = buckets([(1, 24), (1, 24), (2, 72), (1, 24)])
    first, seen = mark_warmup(data.take(np.arange(2)), 1)
    assert first.warmup.tolist() == [1.0, 0.0] and seen == {(0, "S=24"): 2}
    rest, seen = mark_warmup(data.take(np.arange(2, 4)), 1, seen)
    assert rest.warmup.tolist() == [1.0, 0.0]  # in batch order: S=72 is new, S=24 was seen before
    assert shape_classes(rest) == ["S=72", "S=24"]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 1000), st.integers(0, 3), st.integers(1, 60))
def test_mark_warmup_matches_a_row_by_row_reference(seed, k, n):
    rng = np.random.default_rng(seed)
    data = packs(n, seed=seed)
    data = StepMeasurements(
        **{
            **data.__dict__,
            "packed": rng.integers(0, 2, n),
            "rank": rng.integers(0, 3, n),
            "seq_len": rng.choice(LENGTHS, n),
        }
    )
    seen = {(0, "pack"): int(rng.integers(0, 3)), (1, "S=72"): 1}
    got, counts = mark_warmup(data, k, seen)
    expected, ref = [], dict(seen)
    for rank, cls in zip(got.rank, shape_classes(got)):  # got is in batch order already
        key = (int(rank), cls)
        expected.append(1.0 if ref.get(key, 0) < k else 0.0)
        ref[key] = ref.get(key, 0) + 1
    assert got.warmup.tolist() == expected and counts == ref


def test_a_large_change_is_clamped_and_reported():
    result = refit_cost_model(LINEAR, packs(200, noise=0.0), RefitConfig(max_change=1.2))
    assert result.clamped and result.change > 1.2
    ratio = np.array([result.model.pack_cost([s]) / LINEAR.pack_cost([s]) for s in LENGTHS])
    assert ratio.max() / ratio.min() <= 1.2**2 * (1 + 1e-9)  # each step within 1.2x of the rescaled prior
    unclamped = refit_cost_model(LINEAR, packs(200, noise=0.0), RefitConfig(max_change=100.0))
    assert not unclamped.clamped and unclamped.change == pytest.approx(result.change)


def test_a_change_of_unit_alone_is_not_clamped():
    # Planning needs the ratios between costs only: a prior in other units is not a change of shape.
    prior = CostModel(kind="quadratic", alpha=1e3, beta=20.0, c0=4e5)
    result = refit_cost_model(prior, packs(100, noise=0.0), RefitConfig(max_change=1.01))
    assert not result.clamped and result.change == pytest.approx(1.0)


@settings(max_examples=25, deadline=None)
@given(st.permutations(list(range(40))), st.integers(0, 5))
def test_the_fit_does_not_depend_on_row_order(order, seed):
    data = packs(40, seed=seed, outlier_every=9)
    a = refit_cost_model(LINEAR, data, RefitConfig())
    b = refit_cost_model(LINEAR, data.take(np.array(order)), RefitConfig())
    assert a.model.to_dict() == b.model.to_dict()  # bit for bit: every rank gets the same model
    assert a.points_rejected == b.points_rejected


def test_config_validates_and_reads_a_dict():
    assert RefitConfig.from_dict({"max_change": 3.0}).max_change == 3.0
    with pytest.raises(ValueError, match="unknown keys \\['max_chnage'\\]"):
        RefitConfig.from_dict({"max_chnage": 3.0})
    for bad in (
        {"max_change": 1.0},
        {"every_n_steps": 0},
        {"min_points_per_term": 0},
        {"outlier_threshold": 0},
    ):
        with pytest.raises(ValueError, match="RefitConfig"):
            RefitConfig(**bad)


def test_measurements_round_trip_and_check_lengths():
    data = packs(10)
    back = StepMeasurements.from_dict(data.to_dict())
    assert all(np.array_equal(getattr(back, c), getattr(data, c)) for c in data.to_dict())
    assert len(StepMeasurements.concat([data, data])) == 20 and len(StepMeasurements.concat([])) == 0
    with pytest.raises(ValueError, match="column 'batch_idx' has 2 rows"):
        StepMeasurements(*([np.zeros(3)] + [np.zeros(2)] + [np.zeros(3)] * 7))
    with pytest.raises(ValueError, match="missing columns \\['warmup'\\]"):
        StepMeasurements.from_dict({k: v for k, v in data.to_dict().items() if k != "warmup"})


def test_result_to_dict_is_plain():
    result = refit_cost_model(LINEAR, packs(60), RefitConfig())
    d = result.to_dict()
    assert d["model"] == result.model.to_dict() and d["terms"]["after"]["c0"] == result.model.c0
    assert isinstance(result, RefitResult)
    metrics = refit_metrics(result)
    assert metrics["refit/c0"] == result.model.c0 and metrics["refit/clamped"] == 0.0


# ---------------------------------------------------------------------- the shell pieces


def _gathered(batches: list[list[tuple[int, int, float, int]]]) -> np.ndarray:
    """A monitor block (K, world, FIELDS) from per step, per rank (B, S, seconds, flags)."""
    steps = np.full((len(batches), len(batches[0]), NUM_FIELDS), np.nan)
    for k, ranks in enumerate(batches):
        for r, (b, s, sec, flags) in enumerate(ranks):
            row = steps[k, r]
            row[FIELD_INDEX["batch_idx"]] = k
            row[FIELD_INDEX["batch_size"]] = b
            row[FIELD_INDEX["seq_len"]] = s
            row[FIELD_INDEX["num_tokens"]] = b * s
            row[FIELD_INDEX["compute_time_s"]] = sec
            row[FIELD_INDEX["flags"]] = flags
    return steps


def test_measurements_from_steps_flags_warmup_and_untimed_rows():
    hook = FLAG_HOOK
    steps = _gathered(
        [
            [(2, 10, 1.0, hook | FLAG_COUNTED), (1, 20, 2.0, hook)],
            [(3, 5, 1.5, 0), (1, 8, 1.0, hook | FLAG_PACKED)],
        ]
    )
    m = measurements_from_steps(steps)
    assert m.rank.tolist() == [0, 1, 0, 1] and m.batch_idx.tolist() == [0, 0, 1, 1]
    assert m.warmup.tolist() == [
        1,
        0,
        1,
        0,
    ]  # FLOPs counted; compute not timed to the backward's end (2 ranks)
    assert m.square_sum[:3].tolist() == [200.0, 400.0, 75.0]  # B * S^2 for a bucketed batch
    assert np.isnan(m.square_sum[3]) and m.packed.tolist() == [0, 0, 0, 1]  # a pack must say its sum


def test_refitter_refits_its_window_and_restores_from_its_state():
    refitter = CostRefitter(RefitConfig(warmup_steps_per_class=0))
    classes = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)]
    steps = _gathered([[(b, s, TRUE.batch_cost(b, s), FLAG_HOOK)] * 2 for b, s in classes * 2])
    refitter.add_steps(steps)
    assert refitter.window_rows == 48
    result = refitter.refit(LINEAR, epoch=0, step=24)
    assert result.status == "fitted" and refitter.window_rows == 0
    assert rel(refitter.model.beta, 2e-5) < 1e-6
    refitter.add_steps(steps[:5])  # a window in progress at the checkpoint
    again = CostRefitter(RefitConfig(warmup_steps_per_class=0))
    again.load_state_dict(refitter.state_dict())
    assert again.window_rows == refitter.window_rows == 10
    assert again.refit(LINEAR, 1, 29).model == refitter.refit(LINEAR, 1, 29).model
    assert again.model == refitter.model and again.history == refitter.history
    assert len(again.state_dict()["measurements"]["seconds"]) == 10
    with pytest.raises(ValueError, match="cost refit state has version 7"):
        again.load_state_dict({**refitter.state_dict(), "version": 7})


def test_refitter_keeps_the_agreed_result_not_its_own():
    """Across ranks every refitter keeps what ``agree`` returns (rank 0's fit, broadcast by the monitor),
    even where this rank's own fit rounded otherwise."""
    classes = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)]
    steps = _gathered([[(b, s, TRUE.batch_cost(b, s), FLAG_HOOK)] * 2 for b, s in classes * 2])
    rank0, rank1 = (CostRefitter(RefitConfig(warmup_steps_per_class=0)) for _ in range(2))
    rank0.add_steps(steps)
    rank1.add_steps(steps)
    from_rank0 = rank0.refit(LINEAR, epoch=0, step=24)

    def agree(own):
        assert own.model == from_rank0.model  # the same rows fit the same here; elsewhere they may not
        return dataclasses.replace(from_rank0, model=dataclasses.replace(from_rank0.model, beta=3e-5))

    kept = rank1.refit(LINEAR, epoch=0, step=24, agree=agree)
    assert kept.model.beta == rank1.model.beta == 3e-5
    assert rank1.history[-1]["model"]["beta"] == 3e-5


class _DataModule:
    def __init__(self, batcher: DualConstraintBatcher) -> None:
        self.batcher = batcher
        self.models: list[CostModel] = []

    def set_cost_model(self, model: CostModel) -> None:
        self.models.append(model)


def test_apply_to_datamodule_only_where_the_cap_follows_the_model():
    auto = _DataModule(DualConstraintBatcher(max_tokens=512))
    # In mode "dual" the model sizes the batches: applied only on request (resize_batches).
    assert "resize_batches" in apply_to_datamodule(auto, TRUE) and auto.models == []
    assert apply_to_datamodule(auto, TRUE, resize_batches=True) == "" and auto.models == [TRUE]
    packs = _DataModule(DualConstraintBatcher(max_tokens=512))
    packs.schedule = "packed"  # packs are sized by max_tokens alone: applied by default
    assert apply_to_datamodule(packs, TRUE) == "" and packs.models == [TRUE]
    tokens = _DataModule(DualConstraintBatcher(max_tokens=512, sizing="equal_tokens"))
    assert apply_to_datamodule(tokens, TRUE) == "" and tokens.models == [TRUE]
    fixed = _DataModule(DualConstraintBatcher(max_tokens=512, max_compute=300.0, cost_model=LINEAR.to_dict()))
    assert "max_compute=300.0" in apply_to_datamodule(fixed, TRUE) and fixed.models == []
    assert "has no set_cost_model" in apply_to_datamodule(object(), TRUE)


def test_batcher_set_cost_model_resolves_the_auto_cap_again():
    shapes = [(16, 1, 8, 12), (16, 9, 10, 10)]
    batcher = DualConstraintBatcher(max_tokens=512, cost_model=LINEAR.to_dict())
    batcher.resolve_max_compute(shapes)
    before = batcher.batch_size((16, 1, 8, 12))
    batcher.set_cost_model(TRUE, shapes)
    assert batcher.cost_model == TRUE and batcher.config()["cost_model"] == TRUE.to_dict()
    assert batcher.max_compute == pytest.approx(min(TRUE.batch_cost(512 // s, s) for s in (24, 225)))
    assert batcher.batch_size((16, 1, 8, 12)) != before  # the cheap short samples: fewer per batch now
    fixed = DualConstraintBatcher(max_tokens=512, max_compute=300.0, cost_model=LINEAR.to_dict())
    assert not fixed.cap_follows_cost_model
    with pytest.raises(ValueError, match="max_compute=300.0 is in the unit of the current cost model"):
        fixed.set_cost_model(TRUE, shapes)


def test_manual_clock_moves_only_when_told():
    clock = ManualClock()
    a = clock.mark()
    clock.advance(1.5)
    assert clock.seconds(a, clock.mark()) == 1.5 and clock.seconds(a, a) == 0.0
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        clock.advance(-1.0)


def _ranks_csv(tmp_path, classes) -> str:
    from lightning_adaptiveload.monitor import report

    path = str(tmp_path / "load_balance_ranks.csv")
    report.write_ranks_header(path)
    steps = _gathered([[(b, s, TRUE.batch_cost(b, s), FLAG_HOOK)] * 2 for b, s in classes])
    b, s = steps[:, :, FIELD_INDEX["batch_size"]], steps[:, :, FIELD_INDEX["seq_len"]]
    steps[:, :, FIELD_INDEX["token_sq_sum"]] = b * s * s
    report.append_rank_rows(path, steps)
    return path


def test_a_run_is_replayed_from_its_ranks_csv(tmp_path):
    from lightning_adaptiveload.monitor.cost_refit import format_refit, measurements_from_ranks_csv

    classes = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)] * 2
    m = measurements_from_ranks_csv(_ranks_csv(tmp_path, classes), warmup_steps_per_class=1)
    assert len(m) == 48 and m.warmup.sum() == 2 * 4  # the first step of each class on each rank
    result = refit_cost_model(LINEAR, m, RefitConfig())
    assert rel(result.model.c0, 0.4) < 1e-6
    text = format_refit(result)
    assert "cost model refit: fitted" in text and text.index("S=24") < text.index("S=225")
    with pytest.raises(ValueError, match="missing column\\(s\\) \\['compute_time_s'"):
        (tmp_path / "bad.csv").write_text("rank,batch_idx,batch_size,num_tokens,seq_len\n0,0,1,24,24\n")
        measurements_from_ranks_csv(tmp_path / "bad.csv")
    with pytest.raises(FileNotFoundError, match="no such file"):
        measurements_from_ranks_csv(tmp_path / "none.csv")


def test_simulate_replay_command(tmp_path, capsys):
    import json

    from lightning_adaptiveload.cli.simulate import main

    classes = [(b, s) for s in (24, 72, 120, 225) for b in (1, 3, 6)] * 2
    path = _ranks_csv(tmp_path, classes)
    start = tmp_path / "linear.json"
    start.write_text(json.dumps(LINEAR.to_dict()))
    assert main(["--replay", path, "--times", str(start), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "before: 1*S + 0*S^2 + 0" in printed and "replay.json" in printed
    saved = json.load(open(tmp_path / "out" / "replay.json"))
    assert saved["status"] == "fitted" and saved["prior"] == LINEAR.to_dict()
    assert main(["--replay", path, "--times", "trace.jsonl", "--out", str(tmp_path / "out")]) == 2
    assert "give the starting cost model as a JSON file" in capsys.readouterr().err

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload import stats


def test_cv_hand_computed():
    # mean 2, population std 1
    assert stats.cv([1.0, 3.0]) == pytest.approx(0.5)
    # mean 2.5, variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    assert stats.cv([1, 2, 3, 4]) == pytest.approx(math.sqrt(1.25) / 2.5)
    assert stats.cv([7.0]) == 0.0
    assert stats.cv([2.0, 2.0, 2.0]) == 0.0
    assert stats.cv([0.0, 0.0]) == 0.0
    assert math.isnan(stats.cv([1.0, math.nan]))


def test_imbalance_and_straggler_wait_hand_computed():
    assert stats.imbalance([1.0, 3.0]) == pytest.approx(0.5)  # 3 / 2 - 1
    assert stats.straggler_wait([1.0, 3.0]) == pytest.approx(1 / 3)  # 1 - 2 / 3
    assert stats.imbalance([1, 2, 3, 4]) == pytest.approx(0.6)  # 4 / 2.5 - 1
    assert stats.straggler_wait([1, 2, 3, 4]) == pytest.approx(0.375)  # 1 - 2.5 / 4
    assert stats.imbalance([5, 5]) == 0.0
    assert stats.straggler_wait([5, 5]) == 0.0
    assert stats.imbalance([0, 0]) == 0.0
    assert stats.straggler_wait([0, 0]) == 0.0


def test_straggler_wait_is_the_waiting_share():
    # Each rank waits for the slowest: sum of waits over world * max.
    times = [0.8, 1.0, 1.3, 0.9]
    waits = sum(max(times) - t for t in times)
    assert stats.straggler_wait(times) == pytest.approx(waits / (len(times) * max(times)))


@pytest.mark.parametrize("fn", [stats.cv, stats.imbalance, stats.straggler_wait])
def test_bad_input_raises(fn):
    with pytest.raises(ValueError, match="no values"):
        fn([])
    with pytest.raises(ValueError, match="-1.0"):
        fn([1.0, -1.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=1e-3, max_value=1e6), min_size=1, max_size=64))
def test_against_numpy(x):
    a = np.asarray(x)
    assert stats.cv(x) == pytest.approx(a.std() / a.mean(), rel=1e-9, abs=1e-12)
    assert stats.imbalance(x) == pytest.approx(a.max() / a.mean() - 1, rel=1e-9, abs=1e-12)
    assert stats.straggler_wait(x) == pytest.approx(1 - a.mean() / a.max(), rel=1e-9, abs=1e-12)
    assert 0.0 <= stats.straggler_wait(x) <= 1.0 - 1.0 / len(x)
    assert 0.0 <= stats.imbalance(x) <= len(x) - 1
    assert 0.0 <= stats.cv(x) <= math.sqrt(len(x) - 1)
    # imbalance and straggler wait describe the same gap: s = i / (1 + i)
    i = stats.imbalance(x)
    assert stats.straggler_wait(x) == pytest.approx(i / (1 + i), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1.1, 2.3, 1e-3, 123.456])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 64])
def test_equal_values_give_exactly_zero(value, n):
    """Issue 13: the mean of equal values can round above their max (0.1 three times), which gave -2.2e-16."""
    x = [value] * n
    assert stats.cv(x) == 0.0 and stats.imbalance(x) == 0.0 and stats.straggler_wait(x) == 0.0
    c, i, w = stats.balance_rows(np.array([x, x]))
    assert c.tolist() == i.tolist() == w.tolist() == [0.0, 0.0]
    assert stats.straggler_wait(np.array([x, x])) == 0.0 and stats.step_wait_mean(np.array([x, x])) == 0.0


def test_two_waits_time_weighted_and_per_step_mean():
    # a long unbalanced step and a short balanced one
    x = np.array([[1.0, 3.0], [0.5, 0.5]])
    assert stats.straggler_wait(x) == pytest.approx((3.0 - 2.0) / (3.0 + 0.5))  # sum(max - mean) / sum(max)
    assert stats.step_wait_mean(x) == pytest.approx((1 / 3 + 0.0) / 2)  # mean of 1 - mean / max
    s = stats.balance_summary(x)
    assert set(s) == set(stats.BALANCE_FIGURES)
    assert s["straggler_wait"] == stats.straggler_wait(x) and s["step_wait_mean"] == stats.step_wait_mean(x)
    assert s["cv_mean"] == pytest.approx(np.mean([stats.cv(r) for r in x.tolist()]))
    assert s["imbalance_p95"] == pytest.approx(np.percentile([stats.imbalance(r) for r in x.tolist()], 95))
    assert all(math.isnan(v) for v in stats.summarize_steps([], [], [], []).values())


def test_vram_efficiency():
    assert stats.vram_efficiency(40 * 2**30, 80 * 2**30) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_bytes"):
        stats.vram_efficiency(1, 0)
    with pytest.raises(ValueError, match="peak_bytes"):
        stats.vram_efficiency(-1, 10)


def test_peak_vram_utilisation_efficiency():
    assert stats.peak_vram_utilisation_efficiency([2.0, 4.0]) == pytest.approx(0.75)
    assert stats.peak_vram_utilisation_efficiency([2.0, 4.0], high_water=8.0) == pytest.approx(3 / 8)
    assert stats.peak_vram_utilisation_efficiency([5.0, 5.0, 5.0]) == 1.0
    assert stats.peak_vram_utilisation_efficiency([0.0]) == 0.0
    with pytest.raises(ValueError, match="high_water"):
        stats.peak_vram_utilisation_efficiency([2.0, 4.0], high_water=3.0)


def test_mfu_and_flops_per_s():
    assert stats.achieved_flops_per_s(6e12, 2.0) == pytest.approx(3e12)
    assert stats.mfu(1e15, 2.0, 1e15) == pytest.approx(0.5)
    assert math.isnan(stats.mfu(1e15, 2.0, None))
    assert math.isnan(stats.mfu(1e15, 0.0, 1e15))
    assert math.isnan(stats.achieved_flops_per_s(1.0, 0.0))


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA GH200 480GB", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", None),
        ("NVIDIA GeForce RTX 3090", None),
        ("Tesla T4", None),
    ],
)
def test_resolve_device(name, key):
    assert stats.resolve_device(name) == key


def test_peak_flops_dense_values():
    # Dense figures: half of the datasheets' "with sparsity" numbers.
    assert stats.peak_flops("NVIDIA H200") == pytest.approx(989.5e12)
    assert stats.peak_flops("NVIDIA H200 NVL", torch.bfloat16) == pytest.approx(835.5e12)
    assert stats.peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == pytest.approx(989.4e12)
    assert stats.peak_flops("NVIDIA H100 PCIe", "16-mixed") == pytest.approx(756e12)
    assert stats.peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.7e12)
    assert stats.peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == pytest.approx(19.5e12)
    assert stats.peak_flops("NVIDIA L40S", "fp64") is None  # not in the table for that part
    assert stats.peak_flops("NVIDIA GeForce RTX 3090") is None


@pytest.mark.parametrize(
    ("dtype", "key"),
    [
        (torch.bfloat16, "bf16"),
        (torch.float16, "fp16"),
        (torch.float32, "fp32"),
        (torch.float64, "fp64"),
        ("bf16-mixed", "bf16"),
        ("bf16-true", "bf16"),
        ("16-mixed", "fp16"),
        ("32-true", "fp32"),
        ("64-true", "fp64"),
        ("transformer-engine", "fp8"),
        ("TF32", "tf32"),
    ],
)
def test_normalize_dtype(dtype, key):
    assert stats.normalize_dtype(dtype) == key


def test_normalize_dtype_unknown():
    with pytest.raises(ValueError, match="int4"):
        stats.normalize_dtype("int4")


def test_percentile_and_describe():
    assert stats.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert stats.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)  # 3 + 0.85 * (4 - 3)
    assert stats.percentile([4, 1, 3, 2], 0) == 1
    rng = np.random.default_rng(0)
    x = rng.random(37).tolist()
    for q in (5, 50, 95, 99):
        assert stats.percentile(x, q) == pytest.approx(np.percentile(x, q))
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError, match="101"):
        stats.percentile([1.0], 101)
    d = stats.describe([1.0, math.nan, 3.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p95": pytest.approx(2.9), "min": 1.0, "max": 3.0, "n": 2}
    assert stats.describe([math.nan])["n"] == 0


def test_stats_does_not_import_lightning():
    import subprocess
    import sys

    code = (
        "import sys, lightning_adaptiveload.stats; print('lightning' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "False"


def test_balance_rows_matches_scalar_functions():
    rng = np.random.default_rng(0)
    x = rng.random((20, 7)) * 10
    x[3] = 0.0  # a step without work
    x[4] = 2.5  # a balanced step
    x[5, 2] = math.nan  # an unknown value
    c, i, w = stats.balance_rows(x)
    for r in range(x.shape[0]):
        if r == 5:
            assert math.isnan(c[r]) and math.isnan(i[r]) and math.isnan(w[r])
            continue
        assert c[r] == pytest.approx(stats.cv(x[r].tolist()), rel=1e-12, abs=1e-15)
        assert i[r] == pytest.approx(stats.imbalance(x[r].tolist()), rel=1e-12, abs=1e-15)
        assert w[r] == pytest.approx(stats.straggler_wait(x[r].tolist()), rel=1e-12, abs=1e-15)
    assert (c[3], i[3], w[3]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="shape"):
        stats.balance_rows(np.ones(3))
    with pytest.raises(ValueError, match=r"row 0 holds \[1.0, -2.0\]: a negative value"):
        stats.balance_rows(np.array([[1.0, -2.0]]), strict=True)


# -- bad readings (issue 63): flagged, counted and left out, never raised ---------------------------------


@pytest.mark.parametrize(
    "bad, reason",
    [(-1.0, "negative"), (-1e-9, "negative"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "negative"),
     (5e-324, "subnormal"), (1e-310, "subnormal")],
)  # fmt: skip
def test_one_bad_reading_is_flagged_counted_and_left_out(bad, reason):
    """Issue 63: one negative step time raised at the monitor's first flush and killed the run."""
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 2.0, size=(8, 4))
    x[5] = 0.0  # no work: a good row
    good = stats.balance_rows(x)
    assert good.skipped_rows == 0 and not good.bad.any() and good.describe_skipped() == ""
    x[3, 2] = bad
    rows = stats.balance_rows(x)
    c, i, w = rows  # unpacks as the three arrays it always gave
    assert rows.skipped == {r: int(r == reason) for r in stats.BAD_READINGS}
    assert rows.skipped_rows == 1 and rows.bad.tolist() == [r == 3 for r in range(8)]
    assert math.isnan(c[3]) and math.isnan(i[3]) and math.isnan(w[3])
    keep = np.arange(8) != 3
    for got, want in zip(rows, good):
        assert got[keep] == pytest.approx(want[keep], rel=1e-12, abs=0)  # the other rows as before
    assert rows.describe_skipped("steps") == f"1 steps left out (1 {reason})"
    # The summaries leave the row out, as if the step had not run.
    assert stats.balance_summary(x) == pytest.approx(stats.balance_summary(x[keep]), rel=1e-12)
    share, _ = stats.measured_wait_rows(np.zeros_like(x), x)
    assert math.isnan(share[3]) and not np.isnan(share[keep & (np.arange(8) != 5)]).any()  # 5: 0 / 0
    with pytest.raises(
        ValueError, match=f"row 3 holds .*: {'a nan' if reason == 'nan' else 'an? ' + reason[:3]}"
    ):
        stats.balance_rows(x, strict=True)


def test_a_row_counts_once_under_its_first_reason():
    x = np.array([[-1.0, math.nan], [math.inf, 5e-324], [1.0, 1.0], [5e-324, 0.0]])
    rows = stats.balance_rows(x)
    assert rows.skipped == {"negative": 1, "nan": 0, "inf": 1, "subnormal": 1}
    assert rows.bad.tolist() == [True, True, False, True]
    assert [rows[k][2] for k in range(3)] == [0.0, 0.0, 0.0]  # the balanced row
    everything = stats.balance_rows(np.full((3, 2), math.nan))
    assert everything.skipped_rows == 3 and np.isnan(everything[0]).all()
    assert math.isnan(stats.balance_summary(np.full((3, 2), -1.0))["straggler_wait"])  # nothing left: nan


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, 5e-324])
def test_the_monitors_flush_survives_a_bad_step_time_and_counts_it(bad):
    """The monitor's path (monitor/steps.py: step_table, window_metrics, summarize_table) on one bad rank
    reading: no exception, the step left out of the time statistics, the count in the summary."""
    import warnings

    from lightning_adaptiveload.monitor import steps as st

    rng = np.random.default_rng(0)
    k, world = 6, 2
    steps = rng.uniform(0.5, 1.0, size=(k, world, st.NUM_FIELDS))
    steps[:, :, st.FIELD_INDEX["batch_idx"]] = np.arange(k)[:, None]
    steps[:, :, st.FIELD_INDEX["flags"]] = 0
    clean = steps.copy()
    steps[2, 1, st.FIELD_INDEX["compute_time_s"]] = bad
    nan = np.full(world, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not even a numpy warning
        table = st.step_table(steps, nan, nan, 100.0)
        window = st.window_metrics(steps, table, nan, 1.0)
        _, overall = st.summarize_table(table, world, nan, [st.rank_band(steps, "peak_allocated_bytes")], 1.0)
    assert table["bad_time_reading"].tolist() == [0, 0, 1, 0, 0, 0] and math.isnan(table["straggler_wait"][2])
    assert overall["skipped_time_readings"] == 1.0
    keep = np.arange(k) != 2
    clean_table = st.step_table(clean[keep], nan, nan, 100.0)
    assert window["straggler_wait"] == pytest.approx(st.balance_figures(clean_table)["straggler_wait"])
    band = [st.rank_band(clean[keep], "peak_allocated_bytes")]
    _, clean_overall = st.summarize_table(clean_table, world, nan, band, 1.0)
    assert clean_overall["skipped_time_readings"] == 0.0


# -- a cost model it cannot use (issue 63): refused, naming the coefficient --------------------------------


@pytest.mark.parametrize("sizing", ["dual", "equal_tokens"])
def test_set_cost_model_refuses_a_model_that_costs_nothing_on_the_data_and_keeps_the_old(sizing):
    """Issue 63: a restored cost model with gamma = -1e9 was applied; the next epoch died in balance_rows."""
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    batcher = DualConstraintBatcher(max_tokens=1000, sizing=sizing)
    shapes = [(16, 1, 8, 8), (16, 2, 8, 8)]
    if sizing == "dual":
        batcher.resolve_max_compute(shapes)
    before, cap = batcher.cost_model, batcher.max_compute
    bad = {"kind": "quadratic", "alpha": 1e-3, "beta": 0.0, "gamma": -1e9}
    with pytest.raises(ValueError, match=r"gamma=-1000000000.0, the cost per sample, is negative"):
        batcher.set_cost_model(bad, iter(shapes))
    assert batcher.cost_model == before and batcher.max_compute == cap  # the old model kept
    batcher.set_cost_model({**bad, "gamma": -0.001}, iter(shapes))  # a fitted small negative gamma is fine
    assert batcher.cost_model.gamma == -0.001
    if sizing == "dual":
        assert batcher.max_compute is not None  # the "auto" cap resolved from the same (iterated) shapes


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("gamma", math.inf, "CostModel gamma must be finite, got inf"),
        ("alpha", math.nan, "CostModel alpha must be finite, got nan"),
        ("alpha", -1.0, "alpha >= 0"),
        ("beta", -1.0, "beta >= 0"),
        ("c0", -1.0, "CostModel c0 (cost per pack) must be >= 0"),
        ("alpha", True, "CostModel alpha must be a number, got True"),
        ("gamma", "abc", "CostModel gamma must be a number, got 'abc'"),
    ],
)
def test_a_cost_model_with_a_bad_coefficient_is_refused_by_name(key, value, words):
    from lightning_adaptiveload.planning.cost_model import CostModel

    with pytest.raises(ValueError) as err:
        CostModel.from_dict({"kind": "quadratic", "alpha": 1.0, "beta": 0.0, "gamma": 0.0, key: value})
    assert words in str(err.value), str(err.value)


def test_measured_wait_rows_equals_the_derived_wait_when_waits_are_exact():
    rng = np.random.default_rng(3)
    compute = rng.uniform(0.5, 3.0, size=(6, 4))
    tail = rng.uniform(0.0, 0.05, size=(6, 1))  # the collective's own tail, paid by every rank
    sync_wait = compute.max(axis=1, keepdims=True) - compute + tail
    share, got_tail = stats.measured_wait_rows(sync_wait, compute)
    assert share == pytest.approx(stats.balance_rows(compute)[2], rel=1e-12)
    assert got_tail == pytest.approx(tail[:, 0])
    # a wait folded into compute time (every rank reports the slowest time) shows as no derived wait, while
    # the measured wait still sees it
    folded = np.repeat(compute.max(axis=1, keepdims=True), 4, axis=1)
    assert stats.balance_rows(folded)[2] == pytest.approx(np.zeros(6))
    share_nan, _ = stats.measured_wait_rows(np.full((2, 2), np.nan), np.ones((2, 2)))
    assert np.isnan(share_nan).all()
    with pytest.raises(ValueError, match="shapes"):
        stats.measured_wait_rows(np.ones((2, 3)), np.ones((3, 2)))

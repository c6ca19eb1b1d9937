import math

import numpy as np
import pytest

from lightning_adaptiveload.planning.cost_model import CostModel


def test_cost_forms():
    q = CostModel(kind="quadratic", alpha=2.0, beta=0.5, gamma=1.0)
    assert q.cost(10) == pytest.approx(2 * 10 + 0.5 * 100 + 1)
    assert q.batch_cost(3, 10) == pytest.approx(3 * q.cost(10))
    p = CostModel(kind="power", p=1.5)
    assert p.cost(100) == pytest.approx(1000.0)
    assert p(4) == pytest.approx(8.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "cubic"},
        {"kind": "quadratic", "alpha": -1.0},
        {"kind": "quadratic", "alpha": 0.0, "beta": 0.0},
        {"kind": "power", "p": 0.0},
        {"kind": "power", "p": 1.0, "scale": -2.0},
        {"kind": "quadratic", "alpha": math.nan},
    ],
)
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError):
        CostModel(**kwargs)


def test_quadratic_fit_recovers_trace_coefficients():
    # The shape of the anchors' H100 trace: 0.0344 ms/token, 1.51e-6 ms/token^2, -3.6 ms per sample.
    s = np.array([1521, 1560, 7800, 14040, 20280, 26520, 32760], dtype=float)
    t = 3.44e-5 * s + 1.51e-9 * s**2 - 3.6e-3
    m = CostModel.fit(s, t)
    assert (m.alpha, m.beta, m.gamma) == pytest.approx((3.44e-5, 1.51e-9, -3.6e-3), rel=1e-6)
    assert m.fit_info["rmse"] < 1e-9 and m.fit_info["max_rel_error"] < 1e-6 and m.fit_info["n"] == 7


def test_quadratic_fit_with_batch_sizes_and_noise():
    rng = np.random.default_rng(0)
    s = np.repeat([1560.0, 7800.0, 14040.0, 20280.0, 32760.0], 4)
    b = np.repeat([21, 4, 2, 1, 1], 4)
    true = CostModel(kind="quadratic", alpha=3e-5, beta=1.5e-9, gamma=0.0)
    per_batch = b * np.array([true.cost(x) for x in s]) * (1 + 0.01 * rng.standard_normal(len(s)))
    m = CostModel.fit(s, per_batch, batch_sizes=b, fit_gamma=False)
    assert m.alpha == pytest.approx(3e-5, rel=0.05) and m.beta == pytest.approx(1.5e-9, rel=0.05)
    assert m.gamma == 0.0
    assert 0.0 < m.fit_info["mean_rel_error"] < 0.03
    # per-batch seconds mean the per-sample cost is divided by B: fitting them as per-sample would differ
    wrong = CostModel.fit(s, per_batch, fit_gamma=False)
    assert abs(wrong.cost(1560) - m.cost(1560)) > 0.5 * m.cost(1560)


def test_quadratic_fit_keeps_coefficients_non_negative():
    s = np.array([100.0, 200.0, 300.0, 400.0])
    t = np.array([1.0, 1.9, 2.7, 3.4])  # concave: unconstrained least squares gives beta < 0
    m = CostModel.fit(s, t)
    assert m.alpha >= 0 and m.beta >= 0
    unconstrained = np.polyfit(s, t, 2)
    assert unconstrained[0] < 0


def test_power_fit_recovers_exponent():
    s = np.array([100.0, 400.0, 1600.0, 6400.0])
    m = CostModel.fit(s, 2e-6 * s**1.7, kind="power")
    assert m.p == pytest.approx(1.7, rel=1e-9) and m.scale == pytest.approx(2e-6, rel=1e-6)
    m2 = CostModel.fit(s, 3 * 2e-6 * s**1.7, kind="power", batch_sizes=[3] * 4)
    assert m2.scale == pytest.approx(2e-6, rel=1e-6)


@pytest.mark.parametrize(
    ("s", "t", "kw", "match"),
    [
        ([1, 2], [1.0], {}, "equal length"),
        ([1, 2, 3], [1.0, -1.0, 2.0], {}, "positive"),
        ([5, 5, 5], [1.0, 1.0, 1.0], {"kind": "power"}, "distinct"),
        ([5, 5], [1.0, 1.0], {}, "distinct"),
        ([1, 2, 3], [3.0, 2.0, 1.0], {"kind": "power"}, "p ="),
    ],
)
def test_fit_errors(s, t, kw, match):
    with pytest.raises(ValueError, match=match):
        CostModel.fit(s, t, **kw)


def test_dict_round_trip_and_errors():
    m = CostModel.fit([100, 200, 300], [1.0, 2.5, 4.5])
    back = CostModel.from_dict(m.to_dict())
    assert back == m and back.fit_info == m.fit_info
    assert CostModel.from_dict({"kind": "power", "p": 2}).cost(3) == 9
    assert CostModel.from_dict(back) is back
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_dict({"kind": "power", "alpha": 1.0})
    with pytest.raises(ValueError, match="mapping"):
        CostModel.from_dict([1, 2])


def test_default_and_positivity_check():
    d = CostModel.default()
    assert d.cost(32760) / d.cost(1560) > 20  # attention makes long clips superlinear
    CostModel(kind="quadratic", alpha=1.0, gamma=-5.0).check_positive([10, 20])
    with pytest.raises(ValueError, match="tokens"):
        CostModel(kind="quadratic", alpha=1.0, gamma=-5.0).check_positive([3])

"""The per-pack term of the cost model: evaluation, persistence, and the joint fit over packs."""

import numpy as np
import pytest

from lightning_adaptiveload.planning.cost_model import CostModel


def test_pack_cost_adds_c0_once_per_pack():
    m = CostModel(kind="quadratic", alpha=2.0, beta=0.5, gamma=1.0, c0=10.0)
    assert m.pack_cost([2, 4]) == pytest.approx(10.0 + (4 + 2 + 1) + (8 + 8 + 1))
    assert m.batch_cost(3, 2) == pytest.approx(m.pack_cost([2, 2, 2]))
    assert m.pack_cost([]) == 0.0 and m.batch_cost(0, 5) == 0.0
    np.testing.assert_allclose(m.costs([2, 4]), [m.cost(2), m.cost(4)])


def test_c0_round_trips_and_defaults_keep_old_dicts():
    m = CostModel(kind="power", p=1.5, c0=0.25)
    assert CostModel.from_dict(m.to_dict()) == m
    assert "c0" not in CostModel.default().to_dict()
    with pytest.raises(ValueError, match="c0"):
        CostModel(c0=-1.0)


def test_fit_packs_recovers_all_terms_from_packs_and_singles():
    truth = CostModel(kind="quadratic", alpha=3e-5, beta=1.5e-9, c0=0.4)
    rng = np.random.default_rng(0)
    packs = [[int(s)] for s in rng.integers(1000, 30000, 8)]
    packs += [list(rng.integers(500, 8000, int(n))) for n in rng.integers(2, 12, 8)]
    seconds = [truth.pack_cost(p) for p in packs]
    fit = CostModel.fit_packs(packs, seconds)
    assert fit.c0 == pytest.approx(0.4, rel=1e-6)
    assert fit.alpha == pytest.approx(3e-5, rel=1e-6)
    assert fit.beta == pytest.approx(1.5e-9, rel=1e-6)
    assert fit.fit_info["max_rel_error"] < 1e-9


def test_fit_packs_beats_per_sample_fit_when_steps_have_a_fixed_cost():
    # With a real per-step constant, a per-sample fit must smear it over samples and err on small packs.
    truth = CostModel(kind="quadratic", alpha=3e-5, beta=1.5e-9, c0=0.4)
    packs = [[1560], [1560] * 21, [7800], [7800] * 4, [14040], [14040] * 2, [32760]]
    seconds = [truth.pack_cost(p) for p in packs]
    per_sample = CostModel.fit([p[0] for p in packs], seconds, batch_sizes=[len(p) for p in packs])
    packed = CostModel.fit_packs(packs, seconds)
    assert per_sample.fit_info["max_rel_error"] > 0.2
    assert packed.fit_info["max_rel_error"] < 1e-9


def test_fit_packs_rejects_bad_input():
    with pytest.raises(ValueError, match="packs\\[1\\]"):
        CostModel.fit_packs([[10], [], [3]], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="equal length"):
        CostModel.fit_packs([[10]], [1.0, 2.0])

"""The dual batch size under a pack cost model (``c0`` per step): the largest B with c0 + B*cost(S) <= cap."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import BatchSizer, BucketSize

SHAPES = [(4, t, h, w) for t in (1, 3, 5, 9) for h, w in ((4, 6), (6, 4), (4, 4), (8, 12))]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    max_tokens=st.integers(1, 2000),
    alpha=st.floats(1e-3, 1.0),
    beta=st.floats(0.0, 1e-2),
    c0=st.floats(0.0, 50.0),
    cap=st.floats(1.0, 1e4),
)
def test_dual_batch_size_takes_the_per_step_constant_off_the_cap(shape, max_tokens, alpha, beta, c0, cap):
    model = CostModel(kind="quadratic", alpha=alpha, beta=beta, c0=c0)
    sizer = BatchSizer(max_tokens, sizing="dual", max_compute=cap, cost_model=model)
    s, b = sizer.size(shape)
    if s > max_tokens:
        assert b == 0
        return
    assert b >= 1 and b * s <= max_tokens
    if b > 1:
        assert model.batch_cost(b, s) <= cap * (1 + 1e-9)
    # size() and satisfies() are one rule: the size is allowed and one more sample is not.
    assert sizer.satisfies(b, s)
    assert not sizer.satisfies(b + 1, s)


def test_auto_cap_with_c0_keeps_the_cheapest_bucket_full():
    # cost(S) = S, c0 = 10: the cheapest full bucket at 100 tokens is 4 x 24 (10 + 96 = 106) against
    # 2 x 50 (10 + 100 = 110). Ignoring c0 in the size would let the 50-token bucket take 2 (110 > 106).
    model = CostModel(kind="quadratic", alpha=1.0, beta=0.0, c0=10.0)
    sizer = BatchSizer(100, max_compute=None, cost_model=model)
    cap = sizer.auto_max_compute([(4, 1, 8, 12), (4, 2, 10, 10)])
    assert cap == 106.0
    sized = BatchSizer(100, max_compute=cap, cost_model=model)
    assert sized.size((4, 1, 8, 12)) == BucketSize(24, 4)
    assert sized.size((4, 2, 10, 10)) == BucketSize(50, 1)


def test_budget_candidates_are_the_break_points_of_the_pack_cost():
    from lightning_adaptiveload.tools.replay import budget_candidates

    model = CostModel(kind="quadratic", alpha=1.0, beta=0.0, c0=10.0)
    shares = {(4, 1, 8, 12): 0.5, (4, 2, 10, 10): 0.5}  # (C, T, H, W): S = 24 and 50
    points = budget_candidates(shares, 100, model, (1, 2, 2), limit=100)
    # c0 + b * S for b up to max_tokens // S: 34, 58, 82, 106 and 60, 110.
    assert points == [34.0, 58.0, 60.0, 82.0, 106.0, 110.0]
    for cap in points:  # at each candidate some bucket's batch is exactly full
        sizer = BatchSizer(100, max_compute=cap, cost_model=model)
        assert any(model.batch_cost(sizer.size(x).batch_size, sizer.size(x).seq_len) == cap for x in shares)

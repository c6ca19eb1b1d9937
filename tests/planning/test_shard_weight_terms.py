"""``shard_weight_terms`` (issue 40): a shard's summed weight from a few terms per bucket is bit for bit the
exactly rounded sum of its per-sample weights (the LPT orders pieces by it, so a rounding difference would
change the plan), and shards where that cannot hold are named for the per-sample sum."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.planning.assign import shard_weight_terms

_WEIGHTS = st.lists(
    st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(
    weights=_WEIGHTS,
    lens=st.lists(st.integers(0, 60), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_terms_sum_to_the_per_sample_sum_bit_for_bit(weights, lens, seed):
    rng = np.random.default_rng(seed)
    w = np.asarray(weights, dtype=np.float64)
    offsets = np.r_[0, np.cumsum(lens)].astype(np.int64)
    bk = rng.integers(0, len(w), size=int(offsets[-1]))
    terms, inexact = shard_weight_terms(bk, offsets, w)
    assert inexact == set() and len(terms) == len(lens)
    for s in range(len(lens)):
        expect = math.fsum(w[bk[offsets[s] : offsets[s + 1]]].tolist())
        assert math.fsum(terms[s]) == expect  # the same float, not merely close


def test_sums_that_need_many_terms_agree_and_large_counts_go_to_the_per_sample_sum():
    w = np.array([0.1, 1 / 3, 2.0**-30 + 1.0, 12345.678901234], dtype=np.float64)
    offsets = np.array([0, 2047 * 4, 2047 * 4 + 2048], dtype=np.int64)
    bk = np.r_[np.repeat(np.arange(4), 2047), np.zeros(2048, dtype=np.int64)]
    terms, inexact = shard_weight_terms(bk, offsets, w)
    assert math.fsum(terms[0]) == math.fsum(w[bk[: offsets[1]]].tolist())
    assert inexact == {1}  # 2**11 samples of one bucket: the split no longer multiplies exactly


def test_a_weight_that_is_not_finite_sends_every_shard_to_the_per_sample_sum():
    terms, inexact = shard_weight_terms(np.array([0, 1]), np.array([0, 1, 2]), np.array([1.0, np.inf]))
    assert inexact == {0, 1}
    assert shard_weight_terms(np.zeros(0, dtype=np.int64), np.array([0, 0]), np.zeros(0)) == ([[]], set())

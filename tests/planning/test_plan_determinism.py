"""Plans must not depend on the Python version: the planner's float sums are exactly rounded.

CPython 3.12 changed ``sum()`` of floats to a compensated sum, so a planner summing costs with ``sum()``
planned other epochs on 3.11 than on 3.12 (2 of the 12 pinned ``independent`` cases and 3 lockstep ones),
and a run's ranks or its resumed continuation on another Python would disagree. ``math.fsum`` is exactly
rounded everywhere.
"""

from __future__ import annotations

import math

import numpy as np

from lightning_adaptiveload.planning.assign import _split_piece, assign, shard_pieces


def test_piece_costs_are_exactly_rounded_whatever_the_python():
    # Ten samples of weight 0.1: 3.11's sum() gives 0.9999999999999999; 3.12's and fsum give 1.0.
    assert math.fsum([0.1] * 10) == 1.0
    bucket_of = [[0] * 10, [0] * 3]
    for arrays in (None, (np.zeros(13, dtype=np.int64), np.array([0, 10, 13]))):
        pieces, _ = shard_pieces(bucket_of, 0, 0, None, [0.1], arrays=arrays)
        costs = {p.shard: p.cost for p in pieces}
        assert costs == {0: 1.0, 1: math.fsum([0.1] * 3)}, arrays
        halves = _split_piece(next(p for p in pieces if p.shard == 0), [0.1])
        assert [h.cost for h in halves] == [math.fsum([0.1] * 5)] * 2


def test_assignment_follows_the_exact_costs():
    # Two shards whose exact costs tie (1.0 each), where a plain left-to-right sum would make the first
    # cheaper (0.9999999999999999): the LPT must order them by their shard order, not by rounding noise.
    pieces, _ = shard_pieces([[0] * 10, [1]], 0, 0, None, [0.1, 1.0])
    assert sorted(p.cost for p in pieces) == [1.0, 1.0]
    streams, _ = assign(pieces, 2, 1, [0.1, 1.0], lockstep=False)
    per_rank = sorted(len(ps) for ps in streams.values())
    assert per_rank == [1, 1]

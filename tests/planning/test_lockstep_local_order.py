"""Issue 40: ``lockstep_local``'s class balancing and worker arrays place samples from counts instead of
sorting and gathering every column; the arrays are the same as the sort's (the plan digests pin the
plans; this pins the two functions on random streams, with moves)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.planning import lockstep_local as ll
from lightning_adaptiveload.planning.assign import Piece


def _balance_by_sort(shard, sid, stream, bucket, world, class_of, n_classes):
    """The sort-and-gather version: the same moves, then a stable sort of (staying, moved) by new chain."""
    counts = {"moved_samples": 0}
    got = ll._balance(shard, sid, stream, bucket, world, class_of, n_classes, counts)
    if not counts["moved_samples"]:
        return got, got
    n_b = len(class_of)
    # which samples moved where: the new arrays hold every (shard, sid) pair once, so map back
    new_stream_of = {(a, b): s for a, b, s in zip(got[0].tolist(), got[1].tolist(), got[2].tolist())}
    new_stream = np.array([new_stream_of[(a, b)] for a, b in zip(shard.tolist(), sid.tolist())])
    moved_mask = new_stream != stream
    moved = np.flatnonzero(moved_mask)
    moved = moved[np.lexsort((sid[moved], shard[moved], bucket[moved]))]
    by_seq = np.concatenate([np.flatnonzero(~moved_mask), moved])
    order = by_seq[np.argsort((new_stream * n_b + bucket)[by_seq], kind="stable")]
    return got, (shard[order], sid[order], new_stream[order], bucket[order])


def _skewed(world, n_b, n, seed):
    """Random streams of unique (shard, sid) pairs (so a moved sample can be told from the arrays), skewed to
    the low ranks so that classes are unequal and samples move; sorted as the planner keeps them."""
    rng = np.random.default_rng(seed)
    pairs = rng.choice(50 * 1000, size=n, replace=False)
    shard, sid = pairs // 1000, pairs % 1000
    stream = np.minimum(rng.geometric(0.5, size=n) - 1, world - 1)
    bucket = rng.integers(0, n_b, size=n)
    order = np.lexsort((sid, shard, bucket, stream))
    class_of = [int(c) for c in rng.integers(0, 2, size=n_b)]
    return shard[order], sid[order], stream[order], bucket[order], class_of


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 9), n_b=st.integers(1, 5), n=st.integers(1, 400), seed=st.integers(0, 2**32 - 1))
def test_balance_places_samples_as_the_stable_sort_does(world, n_b, n, seed):
    shard, sid, stream, bucket, class_of = _skewed(world, n_b, n, seed)
    n_classes = max(class_of) + 1
    got, expect = _balance_by_sort(shard, sid, stream, bucket, world, class_of, n_classes)
    for a, b in zip(got, expect):
        assert a.dtype == np.int64 and (a == b).all()


def test_a_skewed_case_moves_samples_and_still_equals_the_sort():
    # The property test above need not move anything (a draw may already be balanced); this case does.
    shard, sid, stream, bucket, class_of = _skewed(world=4, n_b=3, n=400, seed=0)
    got, expect = _balance_by_sort(shard, sid, stream, bucket, 4, class_of, max(class_of) + 1)
    assert not (got[2] == stream).all()  # samples did move
    for a, b in zip(got, expect):
        assert (a == b).all()


def test_worker_arrays_stream_and_bucket_columns_are_the_sorted_ones():
    rng = np.random.default_rng(0)
    offsets = np.arange(0, 6 * 20 + 1, 20, dtype=np.int64)
    bucket_ids = rng.integers(0, 4, size=int(offsets[-1]))
    pieces = [
        [Piece(s, s, list(range(20)), bucket_ids[offsets[s] : offsets[s + 1]].tolist(), 1.0, np.arange(20))]
        for s in range(6)
    ]
    shard, sid, stream, bucket = ll._worker_arrays(pieces, bucket_ids, offsets)
    assert (bucket == bucket_ids[offsets[shard] + sid]).all() and (stream == shard).all()
    key = stream * 4 + bucket
    assert (np.diff(key) >= 0).all() and len(shard) == 120

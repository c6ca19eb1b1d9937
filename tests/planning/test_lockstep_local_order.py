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


def _pops_by_loop(lens, pops):
    """One pop at a time from the longest chain, the first on ties."""
    lens = list(lens)
    for _ in range(pops):
        j = max(range(len(lens)), key=lambda x: (lens[x], -x))
        lens[j] -= 1
    return lens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=5), min_size=1, max_size=6), st.data())
def test_after_pops_per_row_matches_the_pop_loop(rows, data):
    width = len(rows[0])
    lens = np.array([(r * width)[:width] for r in rows], dtype=np.int64)
    pops = np.array([data.draw(st.integers(1, max(1, int(x.sum())))) for x in lens], dtype=np.int64)
    pops = np.minimum(pops, lens.sum(axis=1))
    got = ll._after_pops(lens, pops)
    assert got.tolist() == [_pops_by_loop(x.tolist(), int(p)) for x, p in zip(lens, pops)]


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 7), n_b=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_chains_hold_the_balanced_arrays(world, n_b, seed):
    """Issue 40: _Chains (counts, a per-stream sort order, the balance as trims and appends) finds at every
    chain position the sample the balanced arrays hold there, and counts the reads of chain prefixes as
    runs of one shard in those arrays."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 30, size=8)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    bucket_ids = rng.integers(0, n_b, size=int(offsets[-1])).astype(np.int16)
    pieces = [[] for _ in range(world)]
    for s in range(len(lens)):  # skewed to low ranks; some shards in two pieces, some partial
        ids = np.arange(int(lens[s]), dtype=np.int64)
        if rng.random() < 0.4:
            ids = np.sort(rng.choice(ids, size=int(rng.integers(1, len(ids) + 1)), replace=False))
        cut = int(rng.integers(0, len(ids)))
        r = min(int(rng.geometric(0.5)) - 1, world - 1)
        for part in [ids[:cut], ids[cut:]] if cut else [ids]:
            pieces[r].append(Piece(s, s, part.tolist(), bucket_ids[offsets[s] + part].tolist(), 1.0, part))
    class_of = [int(c) for c in rng.integers(0, 2, size=n_b)]
    n_classes = max(class_of) + 1
    # The reference: the chain-order arrays by a plain sort, balanced in full.
    shard = np.concatenate([[p.shard] * len(p.ids) for ps in pieces for p in ps]).astype(np.int64)
    sid = np.concatenate([p.id_array for ps in pieces for p in ps]).astype(np.int64)
    stream = np.concatenate([[r] * len(p.ids) for r, ps in enumerate(pieces) for p in ps]).astype(np.int64)
    bucket = bucket_ids[offsets[shard] + sid].astype(np.int64)
    by = np.lexsort((sid, shard, bucket, stream))  # pieces of a stream come in shard order here
    shard, sid, stream, bucket = shard[by], sid[by], stream[by], bucket[by]
    want_counts = {"moved_samples": 0}
    bs, bi, bst, bb = ll._balance(shard, sid, stream, bucket, world, class_of, n_classes, want_counts)
    chains = ll._Chains.of_pieces(pieces, bucket_ids, offsets, n_b)
    counts = {"moved_samples": 0}
    chains.balance(class_of, n_classes, counts)
    assert counts == want_counts
    length = chains.lengths()
    chain = bst * n_b + bb
    assert length.tolist() == np.bincount(chain, minlength=world * n_b).tolist()
    pos = np.arange(len(chain)) - (np.cumsum(length) - length)[chain]
    got_shard, got_sid = chains.refs(chain, pos)
    assert got_shard.tolist() == bs.tolist() and got_sid.tolist() == bi.tolist()
    taken = np.array([int(rng.integers(0, x + 1)) for x in length], dtype=np.int64)
    new = np.ones(len(chain), dtype=bool)
    new[1:] = (bs[1:] != bs[:-1]) | (chain[1:] != chain[:-1])
    want_reads = np.bincount(bst[new & (pos < taken[chain])], minlength=world)
    assert chains.prefix_reads(taken).tolist() == want_reads.tolist()

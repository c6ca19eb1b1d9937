"""The planner's array kernels against the plain per-sample definitions they replace."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_adaptiveload.planning.independent import _items, _simulate, _unbounded
from lightning_adaptiveload.planning.packing_kernels import greedy_cores, pack_sums


def _greedy_reference(tokens: np.ndarray, cores_asc: list[int], capacity: int) -> list[list[int]]:
    """Open a pack with the last core left (the largest), then take, while any fits, the last core left
    among the largest that fit."""
    alive = list(cores_asc)
    packs = []
    while alive:
        pack, room = [], capacity
        j = len(alive) - 1
        while j >= 0:
            i = alive.pop(j)
            pack.append(i)
            room -= int(tokens[i])
            j = max((k for k, x in enumerate(alive) if tokens[x] <= room), default=-1)
        packs.append(pack)
    return packs


@pytest.mark.parametrize("seed", range(12))
def test_greedy_cores_matches_the_per_sample_definition(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    values = rng.choice([7, 13, 20, 33, 50, 64, 99], size=int(rng.integers(1, 7)), replace=False)
    tokens = rng.choice(values, size=n).astype(np.int64)
    cores_asc = np.lexsort((rng.permutation(n), tokens))  # ascending tokens, ties in a random order
    capacity = int(max(tokens.max(initial=1), rng.integers(60, 400)))
    got = greedy_cores(tokens, cores_asc, capacity)
    assert got == _greedy_reference(tokens, cores_asc.tolist(), capacity)
    assert sorted(i for p in got for i in p) == list(range(n))


def test_pack_sums_are_bit_identical_to_numpy_sums():
    rng = np.random.default_rng(0)
    values = rng.random(5000) ** 3 * 1e3
    ints = rng.integers(1, 70000, 5000)
    packs = [rng.integers(0, 5000, int(rng.integers(0, 150))).tolist() for _ in range(400)]
    f, i = pack_sums(packs, values, ints)
    assert f.tolist() == [values[p].sum() if p else 0.0 for p in packs]
    assert i.tolist() == [int(ints[p].sum()) if p else 0 for p in packs]


@pytest.mark.parametrize("seed", range(20))
def test_unbounded_simulation_matches_the_loop_or_defers_to_it(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
    bucket_of = [[rng.randrange(len(sizes)) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    reads = [
        (s, sorted(rng.sample(range(len(row)), rng.randint(1, len(row))))) for s, row in enumerate(bucket_of)
    ]
    rng.shuffle(reads)
    bound = rng.randint(max(sizes), 4 * max(sizes) + 10)
    want_counts = {"partial_batches": 0, "bound_partial_batches": 0}
    want = _simulate(_items(reads, bucket_of), sizes, bound, want_counts)
    counts = {"partial_batches": 0, "bound_partial_batches": 0}
    got = _unbounded(reads, bucket_of, sizes, bound, counts)
    if want_counts["bound_partial_batches"]:
        assert got is None and counts == {"partial_batches": 0, "bound_partial_batches": 0}
    else:
        assert got.batches() == want and counts == want_counts


def _lockstep_loop_reference(avail, class_of, class_size, sizes):
    """The lockstep step loop with no shortcut: every step chosen from the streams' counts."""
    from lightning_adaptiveload.planning import lockstep_schedule as ls

    counts = {"reduced_steps": 0, "tail_batches": 0}
    shortcut = ls._full_steps
    try:
        ls._full_steps = lambda a, m, c: (
            np.zeros((a.shape[0], 0), dtype=np.int64),
            np.zeros(0, dtype=np.int64),
        )
        got = ls.schedule_takes(avail, class_of, class_size, sizes, counts)
    finally:
        ls._full_steps = shortcut
    return got, counts


@pytest.mark.parametrize("seed", range(30))
def test_lockstep_full_steps_match_the_step_loop(seed):
    """The closed form of the full-class steps gives the loop's steps, step for step."""
    from lightning_adaptiveload.planning.lockstep_schedule import schedule_takes

    rng = np.random.default_rng(seed)
    n_r = int(rng.integers(1, 9))
    n_b = int(rng.integers(1, 9))
    n_c = int(rng.integers(1, n_b + 1))
    class_of = rng.permutation(np.r_[np.arange(n_c), rng.integers(0, n_c, n_b - n_c)]).tolist()
    class_size = rng.integers(1, 6, n_c).tolist()
    sizes = [class_size[c] + int(rng.integers(0, 3)) for c in class_of]
    # Streams with near-equal class counts (as after the class balance), sometimes with ties.
    base = rng.integers(0, 40, n_b)
    avail = np.maximum(base[None, :] + rng.integers(-3, 4, (n_r, n_b)), 0).astype(np.int64)
    if seed % 3 == 0:
        avail[:] = avail[0]
    want, want_counts = _lockstep_loop_reference(avail.copy(), class_of, class_size, sizes)
    counts = {"reduced_steps": 0, "tail_batches": 0}
    got = schedule_takes(avail.copy(), class_of, class_size, sizes, counts)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert counts == want_counts
    assert got[1].sum() == avail.sum()  # every sample taken once


@pytest.mark.parametrize("seed", range(16))
def test_unbounded_all_matches_each_stream_alone(seed, monkeypatch):
    """Issue 40: the streams simulated together on arrays (in groups, refs gathered when used) give each
    stream the batches of the per-sample loop, or None where its buffer reaches the bound."""
    from lightning_adaptiveload.planning import independent as ind
    from lightning_adaptiveload.planning.assign import Piece, StreamReads, read_arrays, reads_of

    monkeypatch.setattr(ind, "_GROUP_SAMPLES", 50)  # several groups
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=int(rng.integers(1, 6))).tolist()
    lens = rng.integers(1, 40, size=12)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    bucket_ids = rng.integers(0, len(sizes), size=int(offsets[-1])).astype(np.int16)
    bucket_of = [bucket_ids[offsets[s] : offsets[s + 1]].tolist() for s in range(len(lens))]
    pieces = {}
    for st in [(r, w) for r in range(4) for w in range(2)]:
        ps = []
        for s in sorted(rng.choice(len(lens), size=int(rng.integers(0, 4)), replace=False).tolist()):
            n = int(lens[s])
            if rng.random() < 0.5:
                ids = np.arange(n, dtype=np.int64)  # a whole shard: read as a slice
            else:
                ids = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
            cut = int(rng.integers(0, len(ids)))  # sometimes two pieces of one shard, read as one
            for part in [ids[:cut], ids[cut:]] if cut else [ids]:
                ps.append(Piece(s, s, part.tolist(), [bucket_of[s][i] for i in part], 1.0, part))
        pieces[st] = ps
    bound = int(rng.integers(max(sizes), 3 * max(sizes) + 8))
    counts = {"partial_batches": 0, "bound_partial_batches": 0}
    got = ind._unbounded_all(
        {st: read_arrays(ps) for st, ps in pieces.items()}, bucket_ids, offsets, sizes, bound, counts
    )
    want_counts = {"partial_batches": 0, "bound_partial_batches": 0}
    reads = StreamReads(pieces)
    for st, ps in pieces.items():
        assert reads.count(st) == len(reads_of(ps)) and reads[st] == reads_of(ps)
        one = {"partial_batches": 0, "bound_partial_batches": 0}
        want = _simulate(_items(reads_of(ps), bucket_of), sizes, bound, one)
        if one["bound_partial_batches"]:
            assert got[st] is None
            continue
        assert got[st].batches() == want
        want_counts["partial_batches"] += one["partial_batches"]
    assert counts == want_counts


def _split_by_heap(n, rows, need):
    """BatchArrays.split's former loop: split the batch with the largest pieces (latest row on ties)."""
    import heapq

    pieces = dict.fromkeys(rows.tolist(), 1)
    heap = [(-int(x), -int(j)) for x, j in zip(n, rows)]
    heapq.heapify(heap)
    size = dict(zip(rows.tolist(), n.tolist()))
    added = 0
    while added < need and heap:
        _, j = heapq.heappop(heap)
        pieces[-j] += 1
        added += 1
        if size[-j] > pieces[-j]:
            heapq.heappush(heap, ((-size[-j]) // pieces[-j], j))  # (-ceil(n / k), -row)
    return [pieces[j] for j in rows.tolist()]


@pytest.mark.parametrize("seed", range(40))
def test_split_pieces_match_the_heap(seed):
    from lightning_adaptiveload.planning.batch_arrays import _split_pieces

    rng = np.random.default_rng(seed)
    for _ in range(50):
        m = int(rng.integers(1, 25))
        rows = rng.permutation(rng.choice(200, size=m, replace=False)).astype(np.int64)
        n = rng.integers(2, int(rng.integers(3, 80)), size=m).astype(np.int64)
        need = int(rng.integers(1, int((n - 1).sum()) + 4))
        assert _split_pieces(n, rows, need).tolist() == _split_by_heap(n, rows, need)

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

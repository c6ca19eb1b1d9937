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
        assert got == want and counts == want_counts

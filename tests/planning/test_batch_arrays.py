"""The independent schedule's batches as arrays (planning/batch_arrays.py) make exactly the edits the list
version makes: split, pack, take out, tail counts, partial spots, and the whole equal-steps pass."""

from __future__ import annotations

import copy
import random

import pytest

from lightning_adaptiveload.planning import reshape
from lightning_adaptiveload.planning.batch_arrays import BatchArrays
from lightning_adaptiveload.planning.equalise import _equal_counts, apply_moves
from lightning_adaptiveload.planning.plan import Batch


def _stream(rng: random.Random, sizes: list[int], shard: int) -> list[Batch]:
    """Random batches of one stream: full, partial and (rarely) empty ones, some emitted at the bound."""
    out, next_id = [], 0
    for _ in range(rng.randint(0, 14)):
        b = rng.randrange(len(sizes))
        n = rng.choice([sizes[b], rng.randint(0, sizes[b])])
        refs = [(shard, next_id + i) for i in range(n)]
        next_id += n
        out.append(Batch(b, refs, bound=rng.random() < 0.15))
    return out


def _same(arrays: BatchArrays, batches: list[Batch]) -> None:
    assert arrays.batches() == batches
    assert len(arrays) == len(batches)


@pytest.mark.parametrize("seed", range(60))
def test_each_edit_matches_the_list_version(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
    batches = _stream(rng, sizes, shard=seed)
    arrays = BatchArrays.from_batches(batches)
    _same(arrays, batches)
    assert reshape.pack_start(arrays, sizes) == reshape.pack_start(batches, sizes)
    assert reshape.capacity(arrays) == reshape.capacity(batches)
    assert reshape.last_nonempty(arrays) == reshape.last_nonempty(batches)
    for partial in (False, True):
        assert reshape.tail_samples(arrays, partial, sizes) == reshape.tail_samples(batches, partial, sizes)
    for _ in range(6):
        op = rng.choice(["split", "merge", "take", "set", "append"])
        if op == "split":
            need = rng.randint(0, 6)
            assert reshape.split_batches(arrays, need) == reshape.split_batches(batches, need)
        elif op == "merge":
            need = rng.randint(0, 4)
            assert reshape.merge_batches(arrays, need, sizes) == reshape.merge_batches(batches, need, sizes)
        elif op == "take":
            b, k, partial = rng.randrange(len(sizes)), rng.randint(0, 5), rng.random() < 0.5
            assert reshape.take(arrays, b, k, partial, sizes) == reshape.take(batches, b, k, partial, sizes)
        elif op == "set" and batches:
            j = rng.randrange(len(batches))
            new = Batch(batches[j].bucket, batches[j].refs + [(999, rng.randint(0, 10**6))])
            arrays[j], batches[j] = new, copy.deepcopy(new)
        else:
            new = Batch(rng.randrange(len(sizes)), [(998, rng.randint(0, 10**6))])
            arrays.append(new)
            batches.append(copy.deepcopy(new))
        _same(arrays, batches)
        assert reshape.pack_start(arrays, sizes) == reshape.pack_start(batches, sizes)
        assert reshape.last_nonempty(arrays) == reshape.last_nonempty(batches)
        assert [reshape.batch_len(arrays, j) for j in range(len(arrays))] == [len(bt.refs) for bt in batches]
        assert sorted(arrays.ref_keys().tolist()) == sorted(
            (s << 32) | i for bt in batches for s, i in bt.refs
        )


@pytest.mark.parametrize("seed", range(40))
def test_the_equal_steps_pass_matches_the_list_version(seed):
    rng = random.Random(1000 + seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
    world, workers = rng.randint(2, 5), rng.randint(1, 2)
    sim = {(r, w): _stream(rng, sizes, shard=r * 10 + w) for r in range(world) for w in range(workers)}
    arrays = {st: BatchArrays.from_batches(v) for st, v in sim.items()}
    slots = [[(r, w) for w in range(workers)] for r in range(world)]
    # Every stream reads its own shard: the ids of its batches.
    reads0 = {(r, w): [(r * 10 + w, [i for bt in v for _, i in bt.refs])] for (r, w), v in sim.items()}
    results = []
    for streams in (sim, arrays):
        counts = dict.fromkeys(("split_batches", "merged_batches", "empty_batches", "moved_batches"), 0)
        moves: list = []
        short = _equal_counts(streams, slots, sizes, counts, moves, pad_bucket=0)
        reads = copy.deepcopy(reads0)
        apply_moves(reads, moves, streams)
        results.append((short, counts, moves, streams, reads))
    (short_l, counts_l, moves_l, lists, reads_l), (short_a, counts_a, moves_a, arrs, reads_a) = results
    assert short_a == short_l and counts_a == counts_l and moves_a == moves_l
    assert reads_a == reads_l
    for st in lists:
        _same(arrs[st], lists[st])
    if short_l is None:  # the pass reached a common count: every rank takes the same number of steps
        assert len({sum(len(arrs[st]) for st in slot) for slot in slots}) == 1


def test_apply_moves_reads_the_same_from_arrays():
    sizes = [4]
    batches = {
        (0, 0): [Batch(0, [(0, 0), (0, 1), (0, 2)]), Batch(0, [(0, 3)])],
        (1, 0): [Batch(0, [(1, 0)])],
    }
    arrays = {st: BatchArrays.from_batches(v) for st, v in batches.items()}
    got = []
    for sim in (batches, arrays):
        refs = reshape.take(sim[(0, 0)], 0, 1, True, sizes)
        sim[(1, 0)].append(Batch(0, refs))
        reads = {(0, 0): [(0, [0, 1, 2, 3])], (1, 0): [(1, [0])]}
        apply_moves(reads, [((0, 0), (1, 0), refs)], sim)
        got.append(reads)
    assert got[0] == got[1] == {(0, 0): [(0, [0, 1, 2])], (1, 0): [(1, [0]), (0, [3])]}


def test_ref_columns_from_a_source_are_the_columns_given():
    """Issue 40: a stream whose refs come from a RefSource gathers them on first use, and reads and edits
    as the same stream with its columns given."""
    import numpy as np

    from lightning_adaptiveload.planning.batch_arrays import RefSource

    read_lo = np.array([0, 3, 7], dtype=np.int64)
    read_shard = np.array([4, 9], dtype=np.int64)
    ids = np.array([0, 1, 2, 5, 6, 8, 9], dtype=np.int64)
    at = np.array([6, 0, 3, 1, 5, 2, 4], dtype=np.int64)
    cols = dict(
        bucket=np.array([0, 1, 0]), n=np.array([3, 2, 2]), bound=np.zeros(3, bool), start=np.array([0, 3, 5])
    )
    lazy = BatchArrays(
        **{k: v.copy() for k, v in cols.items()},
        shard=None,
        ids=None,
        source=RefSource(read_lo, read_shard, ids, at),
    )
    shard = np.array([9, 4, 9, 4, 9, 4, 9])
    eager = BatchArrays(**{k: v.copy() for k, v in cols.items()}, shard=shard, ids=ids[at])
    assert lazy.batches() == eager.batches()
    assert lazy.split(2) == eager.split(2) and lazy.batches() == eager.batches()
    lazy.append(Batch(1, [(4, 7)]))
    eager.append(Batch(1, [(4, 7)]))
    assert lazy.batches() == eager.batches() and lazy.ref_keys().tolist() == eager.ref_keys().tolist()

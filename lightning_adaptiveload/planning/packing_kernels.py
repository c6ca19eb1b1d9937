"""Array kernels of the ``packed`` schedule (:mod:`.packed`): per-pack sums and the greedy core packing
on counts of equal-token samples instead of one sample at a time.

Both return exactly what the per-sample loops they replace returned
(``tests/planning/test_plan_identity.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["greedy_cores", "pack_costs", "pack_sums"]


def _by_length(packs: list[list[int]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The non-empty packs grouped by length n: (their positions in ``packs``, their members (count, n))."""
    if not packs:
        return
    lens = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter(itertools.chain.from_iterable(packs), dtype=np.int64, count=int(lens.sum()))
    first = np.cumsum(lens) - lens  # where each pack starts in flat
    for n in np.unique(lens).tolist():
        if n:
            rows = np.flatnonzero(lens == n)
            yield rows, flat[first[rows][:, None] + np.arange(n, dtype=np.int64)]


def pack_sums(packs: list[list[int]], *values: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per array v of ``values``: ``v[p].sum()`` for every pack p (0 for an empty pack), as one array.

    The packs are grouped by length and each group summed row by row: NumPy sums each contiguous row as it
    sums a 1-D array of that length (pairwise summation), so float results are bit-identical to
    ``v[p].sum()``.
    """
    out = tuple(np.zeros(len(packs), dtype=v.dtype) for v in values)
    for rows, members in _by_length(packs):
        for o, v in zip(out, values):
            o[rows] = v[members].sum(axis=1)
    return out


def pack_costs(packs: list[list[int]], tokens: np.ndarray, cost_model: Any) -> np.ndarray:
    """``cost_model.pack_cost(tokens[p])`` for every pack p (0.0 for an empty pack), as one array: the
    per-sample costs are evaluated on each length group's (count, n) token array and summed by rows."""
    out = np.zeros(len(packs), dtype=np.float64)
    for rows, members in _by_length(packs):
        out[rows] = cost_model.c0 + cost_model.costs(tokens[members]).sum(axis=1)
    return out


def greedy_cores(tokens: np.ndarray, cores_asc: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack cores (ascending by tokens) into packs of at most ``capacity`` tokens: each pack opens with the
    largest core left and then takes, while any fits, the largest core that fits its room; among cores of
    equal tokens, the last in ``cores_asc`` first.

    Cores of equal tokens are interchangeable for the choices, so the packing runs on their counts: a
    pack's *pattern* (which token values it takes, in order) is worked out once and repeated while every
    value it takes has enough cores left (the choices depend only on which values are left, and on the
    room, which the pattern fixes); each repetition takes, per value, the next cores from the end.
    """
    a = tokens[cores_asc]
    n = len(a)
    if n == 0:
        return []
    values, start, count = np.unique(a, return_index=True, return_counts=True)
    vals = values.tolist()
    # Per value g: its cores left (alive: positions start[g] .. start[g] + left[g] - 1), and the last of them.
    left = count.tolist()
    top = (start + count - 1).tolist()
    n_left = n
    packs: list[list[int]] = []
    while n_left:
        # The pattern: values taken in order (largest alive value first, then the largest alive that fits).
        pattern: list[int] = []
        used = {}
        room = int(capacity)
        g = len(vals) - 1
        while g >= 0 and left[g] == 0:
            g -= 1
        while g >= 0:
            pattern.append(g)
            used[g] = used.get(g, 0) + 1
            room -= vals[g]
            # the largest value <= room with cores left (counting those this pack took)
            g = int(np.searchsorted(values, room, side="right")) - 1
            while g >= 0 and left[g] - used.get(g, 0) == 0:
                g -= 1
        reps = min(left[v] // u for v, u in used.items())
        # Position of pick s in repetition j: top[g_s] - j * used[g_s] - (earlier picks of g_s in the pattern).
        seen: dict[int, int] = {}
        base, step = [], []
        for v in pattern:
            base.append(top[v] - seen.get(v, 0))
            step.append(used[v])
            seen[v] = seen.get(v, 0) + 1
        rep = np.arange(reps, dtype=np.int64)[:, None]
        pos = np.asarray(base, dtype=np.int64)[None, :] - rep * np.asarray(step, dtype=np.int64)
        packs.extend(cores_asc[pos].tolist())
        for v, u in used.items():
            left[v] -= reps * u
            top[v] -= reps * u
        n_left -= reps * len(pattern)
    return packs

"""The ``packed`` schedule of a large epoch, planned on counts of equal-token samples.

Two samples with the same token count are interchangeable for packing: they cost the same, take the same
room, and the exact planner (:func:`~.packed.pack_steps`) breaks ties between them only by read order. So
an epoch of N samples over K distinct token counts is planned from the K counts, not sample by sample:

1. **Template.** With ``m = ceil(N / TEMPLATE_SAMPLES)``, a *template* population holds ``n_v // m``
   samples of each token count v; :func:`~.packed.pack_steps` plans it exactly (balanced steps of one pack
   per rank). The epoch takes the template's steps ``m - 1`` times. What is left (one copy's worth and the
   remainder of the division, fewer than ``m`` samples of each count) is planned the same way, as the next
   *part*, until a part has at most 1.5 x ``TEMPLATE_SAMPLES`` samples and is planned as it is (a remainder
   alone could be too few samples to give every rank a pack). A template step costs what a step of the exact
   planner costs (the same algorithm on the same mix), so the balance and the fill are the template's.
2. **Slots.** A pack holds *slots* ``(v, ordinal)``: copy j of a part takes ordinals
   ``base_v + j * per_rep_v + (template ordinal)`` of count v, so every ordinal of every count is taken once.
   The ordinal-th sample of count v is the ordinal-th of that count in the seeded read order (shards in the
   schedule's seeded order, samples by id), as the exact planner's tie-break would take them: consecutive
   ordinals (the samples of one pack, mostly) come from the same shards.
3. **Steps.** Steps are shuffled (seeded by seed and epoch) and each step's packs rotated over the ranks,
   as in the exact planner. The step count, every step's global tokens and costs, and the report are
   computed from the template packs for every rank alike; only the kept rank's slots are *resolved* to
   samples, by one pass over the shards in read order (a stable sort of each chunk's token counts), in
   bounded memory.

Exactly once: the slots are a partition of every count's ordinals, and the ordinals of a count are its
samples. Deterministic and identical on every rank: the counts, the templates and the shuffle depend on
the index, the settings, the seed and the epoch only. The packed schedule (:class:`~.schedules.Packed`)
plans epochs of more than ``TEMPLATE_SAMPLES`` samples here, smaller ones exactly
(:func:`~.packed.plan_packed`). Pure NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.packed import _TARGET_FILL, hash_seed, pack_steps, shard_read_order
from lightning_adaptiveload.planning.packed_report import bucket_dicts, packed_plan, packed_report
from lightning_adaptiveload.planning.packing_kernels import pack_costs, pack_sums
from lightning_adaptiveload.planning.resume import ConsumedMask
from lightning_adaptiveload.planning.sizing import tokens_per_sample

__all__ = ["TEMPLATE_SAMPLES", "CountPlan", "plan_counts", "plan_on_counts", "resolve_slots"]

# An epoch of more samples than this is planned on counts (a template of about this many samples, copied);
# up to this many, exactly. 100k samples plan in about a second on one core.
TEMPLATE_SAMPLES = 100_000
# Samples per chunk of the resolving pass over the shards (its working memory: about 100 bytes a sample;
# small enough that its arrays reuse freed memory instead of faulting in fresh pages every chunk).
_CHUNK = 1 << 18


@dataclass
class _Part:
    """One part of the epoch: a template planned once and taken ``reps`` times."""

    n_steps: int  # template steps
    reps: int
    base: np.ndarray  # (K,) the first ordinal of each count this part takes
    per_rep: np.ndarray  # (K,) samples of each count per copy
    first_step: int  # global id of its first step (copy 0); copy j's step t is first_step + j * n_steps + t
    first_pack: int  # index of its first template pack in CountPlan's pack arrays
    pack_of_member: np.ndarray  # (sum(per_rep),) template pack (t * world + q) of each template member


@dataclass
class CountPlan:
    """An epoch planned on counts: the template packs of every part and the step order.

    Template pack ``P`` (over all parts) holds the members ``member_value[s], member_ordinal[s]`` for
    ``s in pack_start[P] : pack_start[P + 1]`` (ordinals within one copy of its part).
    """

    world: int
    values: np.ndarray  # (K,) the distinct token counts, ascending
    parts: list[_Part]
    pack_start: np.ndarray
    member_value: np.ndarray
    member_ordinal: np.ndarray
    pack_tokens: np.ndarray  # per template pack
    pack_cost: np.ndarray  # per template pack (c0 included; 0 for an empty pack)
    pack_len: np.ndarray  # per template pack
    order: np.ndarray  # (S,) the global step taken at each position of the epoch

    @property
    def steps(self) -> int:
        return len(self.order)

    @cached_property
    def _table(self) -> dict[str, np.ndarray]:
        """The parts' fields as arrays (index: part), built once."""
        per_rep = np.stack([p.per_rep for p in self.parts])  # (parts, K)
        pom = [p.pack_of_member for p in self.parts]
        return {
            "first_step": np.array([p.first_step for p in self.parts], dtype=np.int64),
            "n_steps": np.array([p.n_steps for p in self.parts], dtype=np.int64),
            "first_row": np.array([p.first_pack // self.world for p in self.parts], dtype=np.int64),
            "base": np.stack([p.base for p in self.parts]),
            "per_rep": per_rep,
            "member_start": np.cumsum(per_rep, axis=1) - per_rep,  # the template members are count-major
            "pom_offset": np.cumsum([0] + [len(x) for x in pom[:-1]]).astype(np.int64),
            "pack_of_member": np.concatenate(pom),
        }

    @cached_property
    def _positions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every position of the epoch: its part, its copy and its template step within the part."""
        tb = self._table
        p = np.searchsorted(tb["first_step"], self.order, side="right") - 1
        local = self.order - tb["first_step"][p]
        n_steps = tb["n_steps"][p]
        return p, local // n_steps, local % n_steps

    def template_rows(self) -> np.ndarray:
        """The template step (a row of the pack arrays reshaped to (-1, world)) taken at every position."""
        p, _, t = self._positions
        return self._table["first_row"][p] + t

    def packs_at(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every position of the epoch, rank ``rank``'s template pack, its part and its copy."""
        p, rep, _ = self._positions
        # The step's packs are rotated by its global id, as the exact planner rotates them.
        return self.template_rows() * self.world + (rank + self.order) % self.world, p, rep

    def at_positions(self, rank: int, values: np.ndarray) -> np.ndarray:
        """``values`` (per template pack) of rank ``rank``'s pack at every position of the epoch."""
        return values[self.packs_at(rank)[0]]

    def slots_of(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rank ``rank``'s slots: (position in the epoch, count index v, global ordinal of v), by position."""
        pack, part, rep = self.packs_at(rank)
        lens = self.pack_len[pack]
        ends = np.cumsum(lens)
        within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(ends - lens, lens)
        member = np.repeat(self.pack_start[pack], lens) + within
        v = self.member_value[member].astype(np.int64)
        part_s, rep_s = np.repeat(part, lens), np.repeat(rep, lens)
        tb = self._table
        ordinal = self.member_ordinal[member] + tb["base"][part_s, v] + rep_s * tb["per_rep"][part_s, v]
        position = np.repeat(np.arange(len(pack), dtype=np.int64), lens)
        return position, v, ordinal

    def pack_ids(self, v: np.ndarray, ordinal: np.ndarray) -> np.ndarray:
        """The global pack (``step * world + q``, before the rotation) holding ordinal ``ordinal`` of count
        ``v``, for arrays of slots."""
        tb = self._table
        # The part of a slot: the last whose first ordinal of v is at most the slot's (a part without
        # samples of v starts where the next one does, so it is never the last such).
        p = np.zeros(len(v), dtype=np.int64)
        for j in range(1, len(self.parts)):
            p += ordinal >= tb["base"][j][v]
        local = ordinal - tb["base"][p, v]
        per = tb["per_rep"][p, v]
        rep, tord = local // per, local % per
        tpack = tb["pack_of_member"][tb["pom_offset"][p] + tb["member_start"][p, v] + tord]
        return (tb["first_step"][p] + rep * tb["n_steps"][p]) * self.world + tpack


def plan_counts(
    values: np.ndarray,
    counts: np.ndarray,
    cost_model: Any,
    max_tokens: int,
    world: int,
    rng: np.random.Generator,
    template: int = TEMPLATE_SAMPLES,
) -> CountPlan:
    """Plan an epoch of ``counts[v]`` samples of ``values[v]`` tokens each (``values`` ascending, each at
    most ``max_tokens``) into steps of ``world`` packs, and shuffle the steps with ``rng``.

    Each part's template is planned by :func:`~.packed.pack_steps` with its tie-break order the ordinal
    within each count, so that a pack's samples of one count are consecutive in the read order.
    """
    values = np.asarray(values, dtype=np.int64)
    costs_v = np.asarray(cost_model.costs(values), dtype=np.float64) if len(values) else np.zeros(0)
    left = np.asarray(counts, dtype=np.int64).copy()
    base = np.zeros_like(left)
    parts: list[_Part] = []
    mvals, mords, ptoks, pcosts, plens = [], [], [], [], []
    first_step = first_pack = 0
    while left.sum() > 0:
        n = int(left.sum())
        reps = math.ceil(n / template)
        per_rep = left // reps
        steps: list[list[list[int]]] = []
        if n > template * 3 // 2 and per_rep.sum() > 0:
            # All copies but one; the last copy's worth and the remainder of the division plan next.
            reps -= 1
            per_rep = _whole_steps(per_rep, values, max_tokens, world)
            if per_rep.sum() > 0:
                member_v, ordinal = _members(per_rep)
                steps = pack_steps(
                    values[member_v], costs_v[member_v], cost_model.c0, max_tokens, world, ordinal
                )
                # A copied template leaves its underfilled last steps to the next part.
                steps, per_rep, member_v, ordinal = _full_steps(steps, values, member_v, per_rep, ordinal)
        if not steps:  # the last part: everything left, planned as it is (also where no template fits)
            reps, per_rep = 1, left.copy()
            member_v, ordinal = _members(per_rep)
            steps = pack_steps(values[member_v], costs_v[member_v], cost_model.c0, max_tokens, world, ordinal)
        tokens = values[member_v]
        packs = [pack for st in steps for pack in st]
        pack_of_member = np.empty(len(member_v), dtype=np.int64)
        lens = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
        flat = np.fromiter((i for pack in packs for i in pack), dtype=np.int64, count=int(lens.sum()))
        pack_of_member[flat] = np.repeat(np.arange(len(packs), dtype=np.int64), lens)
        mvals.append(member_v[flat])
        mords.append(ordinal[flat])
        ptoks.append(pack_sums(packs, tokens)[0])
        pcosts.append(pack_costs(packs, tokens, cost_model))
        plens.append(lens)
        parts.append(_Part(len(steps), reps, base.copy(), per_rep, first_step, first_pack, pack_of_member))
        first_step += reps * len(steps)
        first_pack += len(packs)
        base += reps * per_rep
        left -= reps * per_rep
    lens = np.concatenate(plens) if plens else np.zeros(0, dtype=np.int64)
    return CountPlan(
        world=int(world),
        values=values,
        parts=parts,
        pack_start=np.concatenate(([0], np.cumsum(lens))).astype(np.int64),
        member_value=np.concatenate(mvals).astype(np.int32) if mvals else np.zeros(0, dtype=np.int32),
        member_ordinal=np.concatenate(mords) if mords else np.zeros(0, dtype=np.int64),
        pack_tokens=np.concatenate(ptoks) if ptoks else np.zeros(0, dtype=np.int64),
        pack_cost=np.concatenate(pcosts) if pcosts else np.zeros(0),
        pack_len=lens,
        order=rng.permutation(first_step).astype(np.int64),
    )


def _members(per_rep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A population of ``per_rep[v]`` samples of each count v, numbered value-major: (count, ordinal)."""
    member_v = np.repeat(np.arange(len(per_rep), dtype=np.int64), per_rep)
    vstart = np.cumsum(per_rep) - per_rep
    return member_v, np.arange(len(member_v), dtype=np.int64) - vstart[member_v]


def _whole_steps(per_rep: np.ndarray, values: np.ndarray, max_tokens: int, world: int) -> np.ndarray:
    """``per_rep`` scaled down (each count alike) to the tokens of a whole number of steps filled to the
    exact planner's target: a template of 22.6 steps' tokens would spread the missing 0.4 of a step over
    all its packs (the step count is a whole number), in every copy."""
    step = world * max_tokens * _TARGET_FILL
    tokens = float(per_rep @ values)
    whole = math.floor(tokens / step)
    if whole < 1:
        return per_rep
    return np.floor(per_rep * (whole * step / tokens)).astype(np.int64)


def _full_steps(
    steps: list[list[list[int]]],
    values: np.ndarray,
    member_v: np.ndarray,
    per_rep: np.ndarray,
    ordinal: np.ndarray,
) -> tuple[list[list[list[int]]], np.ndarray, np.ndarray, np.ndarray]:
    """A template without its underfilled steps (an empty pack, or tokens below 95% of the median step's:
    the end of its leftovers), renumbered: ``(steps, per_rep, member_v, ordinal)``. Copied, such steps
    would repeat in every copy; left to the next part, their samples fill its packs instead. All steps are
    kept if more than half would go."""
    world = len(steps[0]) if steps else 1
    packs = [pack for st in steps for pack in st]
    lens = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs)).reshape(len(steps), world)
    tok = pack_sums(packs, values[member_v])[0].reshape(len(steps), world).sum(axis=1)
    keep = (lens > 0).all(axis=1) & (tok >= 0.95 * np.median(tok))
    if keep.all() or keep.sum() * 2 < len(steps):
        return steps, per_rep, member_v, ordinal
    kept = [st for st, k in zip(steps, keep.tolist()) if k]
    old = np.fromiter((i for st in kept for pack in st for i in pack), dtype=np.int64)
    old.sort()  # by value, then ordinal: the members are numbered value-major
    new_v = member_v[old]
    per_rep = np.bincount(new_v, minlength=len(values)).astype(np.int64)
    renumber = np.full(len(member_v), -1, dtype=np.int64)
    renumber[old] = np.arange(len(old), dtype=np.int64)
    vstart = np.cumsum(per_rep) - per_rep
    steps = [[renumber[pack].tolist() for pack in st] for st in kept]
    return steps, per_rep, new_v, np.arange(len(old), dtype=np.int64) - vstart[new_v]


def _chunks(sizes: np.ndarray, order: list[int], chunk: int) -> list[tuple[int, int]]:
    """``order`` split into consecutive runs ``[a, b)`` of shards holding about ``chunk`` samples each."""
    c = np.cumsum(sizes[order]) if order else np.zeros(0, dtype=np.int64)
    cuts = np.searchsorted(c, np.arange(chunk, int(c[-1]) if len(c) else 0, chunk), side="left") + 1
    edges = [0, *sorted(set(int(x) for x in cuts if 0 < x < len(order))), len(order)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def resolve_slots(
    plan: CountPlan,
    value_of_shape: np.ndarray,
    shape_ids: np.ndarray,
    offsets: np.ndarray,
    order: list[int],
    exclude: Mapping[int, Collection[int]],
    v: np.ndarray,
    ordinal: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The samples of slots ``(v, ordinal)``: their shard ids and sample ids, and the epoch's reads.

    One pass over the shards in read order ``order``, a chunk of shards at a time: a stable sort of the
    chunk's token-count indices (``value_of_shape[shape_ids]``; ``len(plan.values)`` for samples left out:
    oversize or in ``exclude``) lists each count's samples in read order, so the ordinals of count v in this
    chunk are the next ``bincount[v]`` after those of earlier chunks.

    Also counts the reads of every stream of every rank: the distinct (pack, shard) pairs over all samples
    (a pack reads each shard it draws from once).
    """
    k = len(plan.values)
    sizes = np.diff(offsets)
    seen = np.zeros(k + 1, dtype=np.int64)
    span = int(ordinal.max()) + 1 if len(ordinal) else 1
    by_key = np.argsort(v * span + ordinal, kind="stable")
    skey = (v * span + ordinal)[by_key]
    shard_out = np.empty(len(v), dtype=np.int64)
    id_out = np.empty(len(v), dtype=np.int64)
    reads = 0
    for a, b in _chunks(sizes, order, _CHUNK):
        shards = order[a:b]
        lo, hi = offsets[shards], offsets[np.asarray(shards) + 1]
        vals = np.concatenate([value_of_shape[shape_ids[x:y]] for x, y in zip(lo.tolist(), hi.tolist())])
        chunk_off = np.concatenate(([0], np.cumsum(hi - lo)))
        for j, s in enumerate(shards):
            gone = exclude.get(s)
            if gone:
                vals[chunk_off[j] + np.fromiter(gone, dtype=np.int64, count=len(gone))] = k
        cnt = np.bincount(vals, minlength=k + 1)
        by_value = np.argsort(vals, kind="stable")
        group = np.cumsum(cnt) - cnt
        # The requested slots whose ordinal falls in this chunk: per count v, [seen[v], seen[v] + cnt[v]).
        vs = np.arange(k, dtype=np.int64)
        first = np.searchsorted(skey, vs * span + seen[:k], side="left")
        last = np.searchsorted(skey, vs * span + np.minimum(seen[:k] + cnt[:k], span), side="left")
        n_here = last - first
        if n_here.sum():
            rows = np.repeat(first - np.cumsum(n_here) + n_here, n_here) + np.arange(int(n_here.sum()))
            req = by_key[rows]
            pos = by_value[group[v[req]] + ordinal[req] - seen[v[req]]]
            j = np.searchsorted(chunk_off, pos, side="right") - 1
            shard_out[req] = np.asarray(shards, dtype=np.int64)[j]
            id_out[req] = pos - chunk_off[j]
        # Every stream's reads: the distinct (pack, shard) pairs of every sample the epoch takes here.
        kept = by_value[: int(cnt[:k].sum())]  # every sample of this chunk that the epoch takes
        cv = vals[kept].astype(np.int64)
        cord = seen[cv] + (np.arange(len(kept), dtype=np.int64) - group[cv])
        shard_local = np.searchsorted(chunk_off, kept, side="right") - 1
        pairs = plan.pack_ids(cv, cord) * len(shards) + shard_local
        pairs.sort()
        reads += int(np.count_nonzero(np.diff(pairs))) + (1 if len(pairs) else 0)
        seen += cnt
    return shard_out, id_out, reads


@dataclass
class _IndexArrays:
    """The index as arrays: distinct latent shapes (in order of first use), each sample's shape id, and
    shard offsets (shard s: ``shape_ids[offsets[s] : offsets[s + 1]]``). A compact index's own arrays;
    a list index converted once (only when its epoch is planned on counts)."""

    data: Any
    _built: tuple[list[tuple[int, ...]], np.ndarray, np.ndarray] | None = None

    def arrays(self) -> tuple[list[tuple[int, ...]], np.ndarray, np.ndarray]:
        if self._built is None:
            a = self.data.arrays
            if a is not None:
                table = [tuple(int(x) for x in r) for r in np.asarray(a.shape_table).tolist()]
                self._built = (table, np.asarray(a.shape_ids), np.asarray(a.shard_offsets, dtype=np.int64))
            else:
                ids: dict[tuple[int, ...], int] = {}
                flat = [
                    ids.setdefault(tuple(int(x) for x in raw), len(ids))
                    for row in self.data.shapes
                    for raw in row
                ]
                lens = np.fromiter(map(len, self.data.shapes), dtype=np.int64, count=len(self.data.shapes))
                self._built = (
                    list(ids),
                    np.asarray(flat, dtype=np.int32),
                    np.concatenate(([0], np.cumsum(lens))),
                )
        return self._built

    def first_use(self, shape: int, excluded: Mapping[int, Collection[int]]) -> tuple[int, int]:
        """(shard, sample id) of the first sample of ``shape`` in index order that is not excluded."""
        _, ids, off = self.arrays()
        for pos in np.flatnonzero(ids == shape).tolist():
            s = int(np.searchsorted(off, pos, side="right")) - 1
            if pos - int(off[s]) not in excluded.get(s, ()):
                return s, pos - int(off[s])
        return -1, -1


def plan_on_counts(
    data: Any,
    world: int,
    num_workers: int,
    batcher: Any,
    seed: int,
    epoch: int,
    exclude: Mapping[int, Collection[int]],
    underfull: str,
    t0: float,
    rank: int | None,
    keep_costs: bool,
) -> Any:
    """:func:`~.packed.plan_packed` of an epoch of more than ``TEMPLATE_SAMPLES`` samples, planned on counts
    of equal-token samples; only the kept rank's slots (every rank's for ``rank=None``) become samples."""
    from lightning_adaptiveload.planning.plan import PlanError, underfull_message

    index = _IndexArrays(data)
    workers, max_tokens = max(1, int(num_workers)), int(batcher.max_tokens)
    shapes, shape_ids, offsets = index.arrays()
    per_shape = np.bincount(shape_ids, minlength=len(shapes)).astype(np.int64)
    gone = np.zeros(len(shapes), dtype=np.int64)
    if isinstance(exclude, ConsumedMask):  # one flag per sample in index order
        gone += np.bincount(shape_ids[exclude.flags], minlength=len(shapes))
    for s, ids in () if isinstance(exclude, ConsumedMask) else exclude.items():
        if ids:
            pos = int(offsets[s]) + np.fromiter(ids, dtype=np.int64, count=len(ids))
            gone += np.bincount(shape_ids[pos], minlength=len(shapes))
    live = per_shape - gone
    for b, shape in enumerate(shapes):
        if len(shape) != 4:
            s, i = index.first_use(b, {})
            raise ValueError(f"{data.paths[s]}, sample #{i}: latent shape {list(shape)} must be (C, T, H, W)")
    seq_len = np.array([tokens_per_sample(shape, batcher.patch_size) for shape in shapes], dtype=np.int64)
    big = seq_len > max_tokens
    if batcher.oversize == "raise" and (live[big] > 0).any():
        b = int(np.flatnonzero(big & (live > 0))[0])
        s, i = index.first_use(b, exclude)
        raise ValueError(
            f"{data.paths[s]}, sample #{i}: latent shape {list(shapes[b])} has {int(seq_len[b])} tokens, more "
            f"than max_tokens={max_tokens}; raise max_tokens or set oversize='skip'"
        )
    values = np.unique(seq_len[~big])
    value_of_shape = np.where(big, len(values), np.searchsorted(values, seq_len)).astype(np.int32)
    counts = np.bincount(value_of_shape, weights=live, minlength=len(values) + 1)[: len(values)].astype(
        np.int64
    )
    if counts.sum():
        batcher.cost_model.check_positive(values[counts > 0].tolist())
    rng = np.random.default_rng(abs(hash_seed(seed, epoch)))  # the exact planner's step shuffle
    cp = plan_counts(values, counts, batcher.cost_model, max_tokens, world, rng, TEMPLATE_SAMPLES)
    rows = cp.template_rows()
    tokens, cost, lens = (x.reshape(-1, world) for x in (cp.pack_tokens, cp.pack_cost, cp.pack_len))
    per_rank = [int(cp.at_positions(r, cp.pack_len).sum()) for r in range(world)]
    if underfull == "error" and counts.sum() and min(per_rank) == 0:
        raise PlanError(underfull_message(world, workers, len(offsets) - 1, int(counts.sum()), per_rank))
    kept = list(range(world)) if rank is None else [int(rank)]
    slots = [cp.slots_of(r) for r in kept]
    order = shard_read_order(len(offsets) - 1, seed, epoch)  # the exact planner's read order
    v = np.concatenate([x[1] for x in slots])
    ordinal = np.concatenate([x[2] for x in slots])
    shard, ids, reads = resolve_slots(cp, value_of_shape, shape_ids, offsets, order, exclude, v, ordinal)
    layout = _Streams({}, {}, {}, {})
    at = 0
    smallest = int(np.argmin(seq_len)) if len(seq_len) else 0
    for r, (position, _, _) in zip(kept, slots):
        n = len(position)
        sh, ii = shard[at : at + n], ids[at : at + n]
        shape = shape_ids[offsets[sh] + ii].astype(np.int64)
        _rank_streams(layout, r, workers, cp.steps, position, sh, ii, shape, seq_len, smallest)
        at += n
    oversize = int(live[big].sum())
    excluded = int(gone[~big].sum())
    report = packed_report(
        int(counts.sum()), oversize, excluded, tokens, cost, lens, rows, per_rank, reads, batcher, num_workers,
        epoch,
    )  # fmt: skip
    report["planned_on_counts"] = {"parts": len(cp.parts), "copies": [p.reps for p in cp.parts],
                                   "template_samples": [int(p.per_rep.sum()) for p in cp.parts]}  # fmt: skip
    return packed_plan(
        layout, world, num_workers, seed, epoch, bucket_dicts(shapes, seq_len, batcher), cp.steps,
        tokens.sum(axis=1)[rows].tolist(), report,
        np.stack([cp.at_positions(r, cp.pack_cost) for r in range(world)]) if keep_costs else None, rank, t0,
    )  # fmt: skip


@dataclass
class _Streams:
    """The kept streams of a plan on counts (the fields :func:`~.packed_report.packed_plan` reads)."""

    streams: dict[tuple[int, int], list[list[tuple[int, int]]]]
    batch_buckets: dict[tuple[int, int], list[int]]
    batch_steps: dict[tuple[int, int], list[int]]
    reads: dict[tuple[int, int], list[tuple[int, list[int]]]]


def _rank_streams(
    layout: _Streams,
    rank: int,
    workers: int,
    n_steps: int,
    position: np.ndarray,
    shard: np.ndarray,
    ids: np.ndarray,
    shape: np.ndarray,
    seq_len: np.ndarray,
    smallest: int,
) -> None:
    """Rank ``rank``'s streams, batch buckets, batch steps and reads from its samples (position = step)."""
    o = np.lexsort((ids, shard, position))
    pos, sh, ii, shp = position[o], shard[o], ids[o], shape[o]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(pos, minlength=n_steps)))).astype(np.int64)
    # A pack's bucket: its largest sample's (the first in ref order among equals); empty: the smallest shape.
    first = np.lexsort((np.arange(len(pos)), -seq_len[shp], pos))
    nonempty = bounds[1:] > bounds[:-1]
    bucket = np.full(n_steps, smallest, dtype=np.int64)
    bucket[nonempty] = shp[first[bounds[:-1][nonempty]]]
    refs = list(zip(sh.tolist(), ii.tolist()))
    packs = [refs[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    # Reads: per pack, one run per shard (refs sorted), in step order.
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(pos) != 0) | (np.diff(sh) != 0))))
    ends = np.append(starts[1:], len(pos)).tolist()
    ids_list = ii.tolist()
    run_stream = (pos[starts] % workers).tolist()
    reads: list[list[tuple[int, list[int]]]] = [[] for _ in range(workers)]
    for w, s, a, b in zip(run_stream, sh[starts].tolist(), starts.tolist(), ends):
        reads[w].append((s, ids_list[a:b]))
    buckets = bucket.tolist()
    for w in range(workers):
        st = (rank, w)
        layout.streams[st] = packs[w::workers]
        layout.batch_buckets[st] = buckets[w::workers]
        layout.batch_steps[st] = list(range(w, n_steps, workers))
        layout.reads[st] = reads[w]

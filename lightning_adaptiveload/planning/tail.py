"""Lockstep's packed tail: where the lockstep classes stop lining up across ranks, the rest of the epoch
runs as packed steps.

A lockstep epoch pairs the ranks' samples class by class (:mod:`.lockstep`). On mixes with many length
classes the last part of the epoch has steps whose batches differ in class across ranks (``Batch.equal``
False): their compute varies by tens of percent. :func:`packed_tail` takes the samples of every such
batch, from all ranks, and re-plans them with :func:`~.packed.pack_steps` (the same balanced packing as
the ``packed`` schedule, same cost model and ``max_tokens``) into *tail steps* of one pack per rank,
appended after the equal lockstep steps. Step counts are then equal by construction: every stream of a
worker index keeps the same number of lockstep batches, and every tail step adds one pack to the same
worker on every rank (the worker with the fewest batches so far), so that every rank's round robin over
its workers stays aligned: at each step either every rank takes its batch of one lockstep step or every
rank takes its pack of one tail step.

The packs keep the ``packed`` schedule's batch contract (``docs/data_path.md``, "Packed batches"); the plan
marks them (``EpochPlan.pack_batches``) so that the loader collates each batch the right way. Pure
Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

from typing import Any, get_args

import numpy as np

from lightning_adaptiveload.planning.packed import hash_seed, pack_steps
from lightning_adaptiveload.planning.plan import Batch, Read, Ref, Stream
from lightning_adaptiveload.planning.settings import LockstepTail

__all__ = ["LOCKSTEP_TAILS", "packed_tail", "tail_reads"]

#: What a lockstep epoch does where its classes stop lining up across ranks: ``"packed"`` (tail steps of
#: packs, needs a model that runs packs) or ``"bucketed"`` (unequal bucketed batches, then the equal-steps
#: pass splits, moves and pads them).
LOCKSTEP_TAILS: tuple[str, ...] = get_args(LockstepTail)  # the choices of PlanSettings.lockstep_tail


def packed_tail(
    sim: dict[Stream, list[Batch]],
    world: int,
    workers: int,
    bucket_of: list[list[int]],
    seq_len: list[int],
    batcher: Any,
    seed: int,
    epoch: int,
) -> dict[str, Any]:
    """Replace every stream's unequal lockstep batches by tail steps of packs (in place).

    Args:
        sim: ``sim[(rank, worker)]``: the stream's lockstep batches (from
            :func:`~.lockstep.lockstep_batches`); the equal ones stay, the others are taken out and their
            samples packed; the packs (``Batch.pack`` True) are appended.
        world, workers: ranks R and streams per rank.
        bucket_of: per shard, per sample, its bucket id.
        seq_len: tokens of each bucket's samples.
        batcher: gives ``max_tokens`` (token capacity of a pack) and the cost model (``c0`` per pack).
        seed, epoch: seed the order of the tail steps.

    Returns:
        ``{"steps": tail steps, "samples": samples packed, "empty": empty packs, "removed": per stream, the
        refs taken out of its lockstep batches}``.

    Raises:
        RuntimeError: the streams of one worker index hold different numbers of equal lockstep batches
            (a planner bug: the lockstep steps would not line up).
    """
    refs: list[Ref] = []
    removed: dict[Stream, list[Ref]] = {}
    for st in sorted(sim):
        batches = sim[st]
        n_eq = len(batches)  # the unequal batches end a lockstep stream (no class lines up after them)
        while n_eq and not batches[n_eq - 1].equal:
            n_eq -= 1
        removed[st] = [ref for bt in batches[n_eq:] for ref in bt.refs]
        refs.extend(removed[st])
        sim[st] = batches[:n_eq]
    for w in range(workers):
        n = {len(sim[(r, w)]) for r in range(world)}
        if len(n) > 1:
            raise RuntimeError(
                f"lockstep streams of worker {w} hold {sorted(n)} equal batches; this is a planner bug: report "
                "it with the seed, epoch and world size"
            )
    if not refs:
        return {"steps": 0, "samples": 0, "empty": 0, "removed": removed}
    refs.sort()
    buckets = np.array([bucket_of[s][i] for s, i in refs], dtype=np.int64)
    tokens = np.asarray(seq_len, dtype=np.int64)[buckets]
    cm = batcher.cost_model
    # Ties broken by (shard, sample id): a pack's samples then tend to come from few shards (fewer opens).
    order = np.arange(len(refs), dtype=np.int64)
    steps = pack_steps(tokens, cm.costs(tokens), cm.c0, int(batcher.max_tokens), world, order)
    # A seeded order of the tail steps (as the packed schedule), each step's packs rotated over the ranks
    # so that no rank always gets the lightest (or empty) pack.
    perm = np.random.default_rng(hash_seed(seed, epoch)).permutation(len(steps)).tolist()
    steps = [steps[k][k % world :] + steps[k][: k % world] for k in perm]
    length = [len(sim[(0, w)]) for w in range(workers)]
    empty = 0
    smallest = int(np.argmin(seq_len))
    for packs in steps:
        # The worker with the fewest batches: the same on every rank, so the round robins stay aligned.
        w = min(range(workers), key=lambda x: (length[x], x))
        length[w] += 1
        for r, pack in enumerate(packs):
            if pack:
                big = max(pack, key=lambda i: (int(tokens[i]), -i))
                sim[(r, w)].append(Batch(int(buckets[big]), sorted(refs[i] for i in pack), True, pack=True))
            else:  # fewer samples than packs: a zero-weight step for this rank
                sim[(r, w)].append(Batch(smallest, [], True, pack=True))
                empty += 1
    return {"steps": len(steps), "samples": len(refs), "empty": empty, "removed": removed}


def tail_reads(reads: list[Read], batches: list[Batch], removed: list[Ref]) -> list[Read]:
    """A stream's reads after :func:`packed_tail`: its lockstep reads, kept to the samples its lockstep
    batches still hold (all it read but ``removed``, the refs :func:`packed_tail` took out of its batches:
    a lockstep stream reads exactly its batches' samples), then per pack the runs of the pack's samples in
    each shard (one read per shard and pack, opened when the pack needs it: the stream holds at most one
    pack decoded ahead)."""
    gone: dict[int, set[int]] = {}
    for shard, i in removed:
        gone.setdefault(shard, set()).add(i)
    out: list[Read] = []
    for shard, ids in reads:
        drop = gone.get(shard)
        kept = [i for i in ids if i not in drop] if drop else list(ids)
        if kept:
            out.append((shard, kept))
    for bt in batches:
        if not bt.pack:
            continue
        runs: list[Read] = []
        for shard, i in bt.refs:  # sorted: one run per shard
            if runs and runs[-1][0] == shard:
                runs[-1][1].append(i)
            else:
                runs.append((shard, [i]))
        out.extend(runs)
    return out

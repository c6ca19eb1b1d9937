"""The ``packed`` schedule: at every step each rank takes one pack of samples of any shapes, and the packs
of one step cost the same on every rank.

A *pack* is a list of samples whose tokens sum to at most ``max_tokens``; the model runs it as one
sequence with attention confined to each sample (``docs/data_path.md``, "Packed batches"). The plan is
built from the index alone, so every rank computes the same one:

1. **Cores.** Samples are sorted by tokens, largest first (ties in the seeded shard order, so that a
   pack's samples tend to come from few shards). Samples above a *filler threshold* are *cores*; they are
   packed next-fit in that order, so consecutive core packs hold samples of near-equal size.
2. **Steps.** Core packs, in that order, are grouped R at a time into steps (plus empty packs, so that
   the epoch has enough packs for its tokens): the packs of one step have near-equal per-sample
   quadratic cost, which no filling could otherwise repair.
3. **Fill.** Each step's target cost is what its cheapest-to-fill pack reaches when filled with small
   samples; the *fillers* (samples at or below the threshold), largest first, go to the pack furthest
   below its target that has token room, while they bring it closer. The smallest fillers come last and
   fine-tune. The threshold is the smallest one whose fillers can cover every step's deficit.
4. **Leftovers.** Fillers no pack needs form extra steps of R packs, balanced longest-processing-time
   first (least-cost pack with room).
5. **Order.** Steps are shuffled (seeded by seed and epoch), so the epoch's order stays mixed; the pack
   of rank r at step k goes to worker ``k % W``. Each stream reads, pack by pack, the runs of a pack's
   samples in each shard, so it holds at most one pack of decoded samples (bounded buffering).

Resume works as for the other schedules: :func:`~.planner.consumed_refs` and ``exclude`` replan the rest
of an epoch for another world size; :func:`~.planner.continue_plan` continues with another worker count.
Pure Python and NumPy: no Lightning, no torch.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_adaptiveload.planning.packed_report import (
    bucket_dicts,
    packed_plan,
    packed_report,
    rank_correlation,
)
from lightning_adaptiveload.planning.packing_kernels import greedy_cores, pack_costs, pack_sums
from lightning_adaptiveload.planning.sizing import tokens_per_sample

if TYPE_CHECKING:  # the batcher module imports torch; packing needs only its sizing rule
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

__all__ = ["hash_seed", "pack_steps", "plan_packed", "rank_correlation"]

Ref = tuple[int, int]
# Packs per step are filled to this share of max_tokens when the epoch's pack count is chosen.
_TARGET_FILL = 0.985
# Filler reserves tried: the smallest samples holding this share of the epoch's tokens are fillers, and
# core packs leave this share of max_tokens free for them (or none: both are tried).
# A filler that fits none of this many neediest packs (token room) goes to the leftover steps.
_MAX_ASIDE = 64
_RESERVES = (0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45)


def pack_steps(
    tokens: np.ndarray, costs: np.ndarray, c0: float, max_tokens: int, world: int, order: np.ndarray
) -> list[list[list[int]]]:
    """Balanced multi-way packing of samples into steps of ``world`` packs each.

    Args:
        tokens: int array (N,): tokens of each sample (each <= ``max_tokens``).
        costs: float array (N,): per-sample cost (the cost model's ``cost(S)``, without ``c0``).
        c0: cost per pack (added once to every non-empty pack).
        max_tokens: token capacity of a pack.
        world: packs per step (ranks).
        order: int array (N,): tie-break rank of each sample (its position in the seeded read order).

    Returns:
        ``steps[k][r]``: the sample indices (into ``tokens``) of rank r's pack at step k, in the
        unshuffled step order. Every sample appears exactly once; every step has ``world`` packs (some
        possibly empty when there are fewer samples than packs).
    """
    n = len(tokens)
    if n == 0:
        return []
    tokens = np.asarray(tokens, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    desc = np.lexsort((order, -tokens))  # largest first, ties in read order
    asc = desc[::-1]
    share = np.cumsum(tokens[asc]) / float(tokens.sum())
    best: tuple[tuple[int, float], list[list[list[int]]]] | None = None
    # Cores either leave the fillers' share of every pack free, or fill packs to max_tokens (when sample
    # sizes divide max_tokens, e.g. two 32,760-token clips in 65,520, a uniform reserve would halve them).
    for reserve, room in [(r, r) for r in _RESERVES] + [(r, 0.0) for r in _RESERVES]:
        n_fill = int(np.searchsorted(share, reserve, side="right"))
        trial = _cores_and_targets(
            tokens, costs, c0, max_tokens, world, asc[n_fill:], asc[:n_fill][::-1], room
        )
        steps = _filled_steps(trial, tokens, costs, c0, max_tokens, world)
        score = (len(steps), _mean_cv(steps, costs, c0))  # fewest steps (fullest packs), then balance
        if best is None or score < best[0]:
            best = (score, steps)
    assert best is not None
    steps = best[1]
    _no_idle_rank(steps, costs)
    return steps


def _no_idle_rank(steps: list[list[list[int]]], costs: np.ndarray) -> None:
    """Give every empty pack a sample from the same step's pack with the most samples (its cheapest).

    An empty pack leaves its rank idle for the step; moving one sample can only lower that pack's cost.
    """
    for packs in steps:
        while True:
            empty = [r for r, p in enumerate(packs) if not p]
            donor = max(range(len(packs)), key=lambda r: (len(packs[r]), -r))
            if not empty or len(packs[donor]) < 2:
                break
            i = min(packs[donor], key=lambda j: (costs[j], j))
            packs[donor].remove(i)
            packs[empty[0]].append(i)


def _filled_steps(
    trial: dict[str, Any], tokens: np.ndarray, costs: np.ndarray, c0: float, max_tokens: int, world: int
) -> list[list[list[int]]]:
    """Fill one reserve trial's core packs and add the steps of what is left over."""
    packs, step_of, target = trial["packs"], trial["step_of"], trial["target"]
    pack_tokens, pack_cost = pack_sums(packs, tokens, costs)
    pack_cost = np.where(pack_tokens > 0, pack_cost + c0, 0.0)
    leftover = _fill(
        trial["fillers"], tokens, costs, c0, max_tokens, packs, pack_tokens, pack_cost, target[step_of]
    )
    steps = [[packs[i] for i in range(k * world, (k + 1) * world)] for k in range(len(packs) // world)]
    leftover = _layer_fill(leftover, tokens, costs, c0, max_tokens, steps)
    steps += _leftover_steps(leftover, tokens, costs, max_tokens, world)
    return steps


def _mean_cv(steps: list[list[list[int]]], costs: np.ndarray, c0: float) -> float:
    """Mean over steps of the coefficient of variation of the packs' costs (the plan's own estimate)."""
    flat = [p for st in steps for p in st]
    nonempty = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat)) > 0
    cost = np.where(nonempty, pack_sums(flat, costs)[0] + c0, 0.0).reshape(len(steps), -1)
    mean = cost.mean(axis=1)
    return float(np.mean(np.where(mean > 0, cost.std(axis=1) / np.where(mean > 0, mean, 1.0), 0.0)))


def _layer_fill(
    leftover: list[int],
    tokens: np.ndarray,
    costs: np.ndarray,
    c0: float,
    max_tokens: int,
    steps: list[list[list[int]]],
) -> list[int]:
    """Add the leftover fillers a layer at a time: ``world`` fillers of near-equal size to the ``world``
    packs of one step with room for all of them (the largest to the cheapest pack), so that the step
    stays balanced while its packs fill up. Returns the fillers that found no such step.
    """
    if not leftover or not steps:
        return leftover
    world = len(steps[0])
    items = sorted(leftover, key=lambda i: (-int(tokens[i]), i))
    flat = [p for st in steps for p in st]
    nonempty = np.fromiter(map(len, flat), dtype=np.int64, count=len(flat)) > 0
    used, cost = pack_sums(flat, tokens, costs)
    used = used.reshape(len(steps), world)
    cost = (cost + np.where(nonempty, c0, 0.0)).reshape(len(steps), world)
    heap = [(-int(max_tokens - used[k].max()), k) for k in range(len(steps))]
    heapq.heapify(heap)
    rest: list[int] = []
    for start in range(0, len(items) - world + 1, world):
        chunk = items[start : start + world]
        need = int(tokens[chunk[0]])  # the largest of the chunk
        if not heap or -heap[0][0] < need:
            rest.extend(chunk)
            continue
        _, k = heapq.heappop(heap)
        for i, r in zip(chunk, np.argsort(cost[k], kind="stable").tolist()):
            steps[k][r].append(i)
            used[k, r] += int(tokens[i])
            cost[k, r] += float(costs[i]) + (c0 if used[k, r] == int(tokens[i]) else 0.0)
        heapq.heappush(heap, (-int(max_tokens - used[k].max()), k))
    rest.extend(items[len(items) - len(items) % world :] if len(items) % world else [])
    return rest


def _better(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether reserve trial ``a`` fills packs better than ``b`` (estimated tokens / capacity).

    Running out of fillers does not unbalance a step: fillers go to the pack furthest below its target,
    so every pack ends the same distance below its step's target (water filling).
    """
    return a["est_fill"] > b["est_fill"] + 1e-9


def _cores_and_targets(
    tokens: np.ndarray,
    costs: np.ndarray,
    c0: float,
    max_tokens: int,
    world: int,
    cores_asc: np.ndarray,
    fillers: np.ndarray,
    reserve: float,
) -> dict[str, Any]:
    """Core packs (leaving ``reserve`` of ``max_tokens`` free), grouped into steps, with step targets.

    Packs are sorted by the cost they reach when filled, largest first, and grouped ``world`` at a time,
    so that the packs of a step, filled, cost the same and are full.
    """
    capacity = max(int(tokens.max()), int(max_tokens * (1.0 - reserve)))
    packs = greedy_cores(tokens, cores_asc, capacity)
    need = math.ceil(int(tokens.sum()) / (max_tokens * _TARGET_FILL))
    n_packs = max(len(packs), need, world)
    n_packs = world * math.ceil(n_packs / world)
    packs += [[] for _ in range(n_packs - len(packs))]
    ft = tokens[fillers]
    per_token = float(costs[fillers].sum() / ft.sum()) if len(fillers) else 0.0
    grain = int(np.median(ft)) if len(fillers) else 0
    core_tokens, core_cost = pack_sums(packs, tokens, costs)
    core_tokens = core_tokens.astype(np.float64)
    # What each pack reaches when its room is filled with typical fillers (less half a filler of slack).
    # Packs of near-equal reach share a step: filled, they cost the same AND are full.
    reach = core_cost + np.maximum(0.0, max_tokens - core_tokens - grain / 2) * per_token
    by_reach = np.lexsort((np.arange(n_packs), -reach))
    packs = [packs[k] for k in by_reach.tolist()]
    core_cost, reach = core_cost[by_reach], reach[by_reach]
    step_of = np.arange(n_packs) // world
    target = reach.reshape(-1, world).min(axis=1)
    gap = np.maximum(0.0, target[step_of] - core_cost)
    deficit = float(gap.sum())
    # Fillers beyond what the deficits take form extra steps of their own (filled to _TARGET_FILL).
    spare_tokens = max(0.0, float(ft.sum()) - deficit / per_token) if per_token > 0 else 0.0
    extra = world * math.ceil(spare_tokens / (world * max_tokens * _TARGET_FILL))
    est_fill = float(tokens.sum()) / ((n_packs + extra) * max_tokens)
    return {
        "packs": packs,
        "fillers": fillers,
        "step_of": step_of,
        "target": target + c0,
        "deficit": deficit,
        "est_fill": est_fill,
        "filler_cost": float(costs[fillers].sum()),
    }


def _fill(
    fillers: np.ndarray,
    tokens: np.ndarray,
    costs: np.ndarray,
    c0: float,
    max_tokens: int,
    packs: list[list[int]],
    pack_tokens: np.ndarray,
    pack_cost: np.ndarray,
    target: np.ndarray,
) -> list[int]:
    """Give each filler (largest first) to the pack furthest below its target with room; return the rest.

    A filler goes to a pack only while it brings the pack closer to its target (its cost is at most
    twice the deficit), so each pack ends within half a filler's cost of its target.
    """
    # Costs of empty packs count c0 from their first sample; account for it up front.
    cur = np.where(pack_tokens > 0, pack_cost, c0)
    heap = list(zip((-(target - cur)).tolist(), range(len(packs))))
    heapq.heapify(heap)
    leftover: list[int] = []
    used = pack_tokens.tolist()  # Python ints: the loop reads and writes one pack at a time
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i, t, c in zip(fillers.tolist(), tokens[fillers].tolist(), costs[fillers].tolist()):
        aside = []
        placed = False
        while heap and len(aside) < _MAX_ASIDE:
            neg_def, k = heap[0]
            if -neg_def < c / 2:
                break  # the neediest pack is closer to its target than this filler would leave it
            if used[k] + t <= max_tokens:
                packs[k].append(i)
                used[k] += t
                replace(heap, (neg_def + c, k))  # (keys are unique: only the set in the heap matters)
                placed = True
                break
            aside.append(pop(heap))
        for item in aside:
            push(heap, item)
        if not placed:
            leftover.append(i)
    pack_tokens[:] = used
    return leftover


def _leftover_steps(
    leftover: list[int], tokens: np.ndarray, costs: np.ndarray, max_tokens: int, world: int
) -> list[list[list[int]]]:
    """Extra steps of ``world`` packs from the samples no core pack needed, balanced LPT (largest first)."""
    if not leftover:
        return []
    left = np.asarray(leftover, dtype=np.int64)
    items = left[np.lexsort((left, -costs[left]))].tolist()  # costliest first, ties by index
    item_tokens, item_costs = tokens[items].tolist(), costs[items].tolist()
    total = sum(item_tokens)
    n_steps = max(1, math.ceil(total / (world * max_tokens * _TARGET_FILL)))
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    while True:
        packs: list[list[int]] = [[] for _ in range(n_steps * world)]
        load = [0.0] * len(packs)
        used = [0] * len(packs)
        heap = [(0.0, k) for k in range(len(packs))]
        ok = True
        for i, t, c in zip(items, item_tokens, item_costs):
            aside = []
            while heap and used[heap[0][1]] + t > max_tokens:
                aside.append(pop(heap))
            if not heap:
                ok = False
                break
            k = heap[0][1]
            packs[k].append(i)
            used[k] += t
            load[k] += c
            replace(heap, (load[k], k))  # (keys are unique: only the set in the heap matters)
            for item in aside:
                push(heap, item)
        if ok:
            break
        n_steps += 1
    # Group packs of near-equal cost into steps.
    by_cost = sorted(range(len(packs)), key=lambda k: (-load[k], k))
    return [[packs[k] for k in by_cost[s * world : (s + 1) * world]] for s in range(n_steps)]


def _collect(
    data: Any, batcher: DualConstraintBatcher, exclude: Mapping[int, Collection[int]]
) -> tuple[list[tuple[int, ...]], list[Ref], list[int], int, int]:
    """The samples to pack: ``(shapes, refs, shape id per ref, oversize count, excluded count)``.

    Raises:
        ValueError: a latent that is not (C, T, H, W), or an oversize one under ``oversize="raise"``.
    """
    max_tokens = int(batcher.max_tokens)
    tokens_of: dict[tuple[int, ...], int] = {}
    shape_ids: dict[tuple[int, ...], int] = {}
    shapes: list[tuple[int, ...]] = []
    refs: list[Ref] = []
    sample_shape: list[int] = []
    oversize = excluded = 0
    for sid, row in enumerate(data.shapes):
        gone = exclude.get(sid, ())
        for i, raw in enumerate(row):
            # A shape seen before is found without converting it (a tuple of NumPy ints hashes as of ints).
            b = shape_ids.get(raw) if type(raw) is tuple else None
            shape = raw if b is not None else tuple(int(x) for x in raw)
            if b is None:
                b = shape_ids.get(shape)
            if b is None:
                if len(shape) != 4:
                    raise ValueError(
                        f"{data.paths[sid]}, sample #{i}: latent shape {list(shape)} must be (C, T, H, W)"
                    )
                b = shape_ids[shape] = len(shapes)
                shapes.append(shape)
                tokens_of[shape] = tokens_per_sample(shape, batcher.patch_size)
            s_tok = tokens_of[shape]
            if s_tok > max_tokens:
                if i not in gone:
                    if batcher.oversize == "raise":
                        raise ValueError(
                            f"{data.paths[sid]}, sample #{i}: latent shape {list(shape)} has {s_tok} tokens, more "
                            f"than max_tokens={max_tokens}; raise max_tokens or set oversize='skip'"
                        )
                    oversize += 1
                continue
            if i in gone:
                excluded += 1
                continue
            refs.append((sid, i))
            sample_shape.append(b)
    return shapes, refs, sample_shape, oversize, excluded


def plan_packed(
    data: Any,
    world: int,
    num_workers: int,
    batcher: DualConstraintBatcher,
    seed: int,
    epoch: int,
    exclude: Mapping[int, Collection[int]],
    underfull: str,
    t0: float,
    rank: int | None = None,
    step_costs: bool = True,
) -> Any:
    """The packed schedule's :class:`~.plan.EpochPlan`, planned exactly, sample by sample.

    The :class:`~.schedules.Packed` schedule calls it for an epoch of at most
    :data:`~.packed_counts.TEMPLATE_SAMPLES` samples left to plan; a larger one it plans on counts
    (:func:`~.packed_counts.plan_on_counts`, rank-locally where ``rank`` is given). ``rank`` is accepted
    for the same signature: the exact plan holds every stream.

    Args:
        data: the planner's input (``.paths``, ``.keys``, ``.shapes`` per shard; ``.arrays`` for a compact
            index).
        world, num_workers, batcher, seed, epoch, underfull, rank: as :func:`~.planner.plan_epoch`.
        step_costs: keep ``plan.step_costs`` (a plan on counts builds the (world, steps) array only then).
        exclude: ``{shard_id: sample_ids}`` already consumed.
        t0: ``time.perf_counter()`` at the start of planning (for ``report["plan_seconds"]``).
    """
    from lightning_adaptiveload.planning.plan import PlanError, underfull_message

    workers = max(1, int(num_workers))
    samples = _Samples.of(data, batcher, exclude, seed, epoch)
    steps = _ordered_steps(samples, batcher, world, seed, epoch)
    if underfull == "error" and samples.refs:
        per_rank = [sum(len(st[r]) for st in steps) for r in range(world)]
        if min(per_rank) == 0:
            raise PlanError(underfull_message(world, workers, len(data.shapes), len(samples.refs), per_rank))
    layout = _layout(samples, steps, world, workers, batcher.cost_model)
    lens = np.array([[len(p) for p in st] for st in steps], dtype=np.int64).reshape(len(steps), world)
    report = packed_report(
        len(samples.refs), samples.oversize, samples.excluded, layout.step_tokens.T, layout.step_cost.T, lens,
        np.arange(len(steps)), lens.sum(axis=0).tolist(), sum(len(v) for v in layout.reads.values()), batcher,
        num_workers, epoch,
    )  # fmt: skip
    return packed_plan(
        layout, world, num_workers, seed, epoch, bucket_dicts(samples.shapes, samples.seq_len, batcher), len(steps),
        [int(x) for x in layout.step_tokens.sum(axis=0)], report, layout.step_cost, None, t0,
    )  # fmt: skip


@dataclass
class _Samples:
    """The epoch's samples as arrays: shapes, refs, tokens and cost per sample, and the shard order."""

    shapes: list[tuple[int, ...]]  # distinct latent shapes
    refs: list[Ref]
    shape_idx: np.ndarray  # (N,) index into shapes
    seq_len: np.ndarray  # (len(shapes),) tokens of each shape
    tokens: np.ndarray  # (N,)
    costs: np.ndarray  # (N,)
    key: np.ndarray  # (N,) shard position in the seeded order, then sample id: the reading order
    oversize: int
    excluded: int

    @classmethod
    def of(cls, data: Any, batcher: Any, exclude: Mapping[int, Collection[int]], seed: int, epoch: int):
        order = shard_read_order(len(data.shapes), seed, epoch)
        position = {shard: k for k, shard in enumerate(order)}
        shapes, refs, sample_shape, oversize, excluded = _collect(data, batcher, exclude)
        seq_len = np.array([tokens_per_sample(s, batcher.patch_size) for s in shapes], dtype=np.int64)
        shape_idx = np.array(sample_shape, dtype=np.int64)
        tokens = seq_len[shape_idx] if len(refs) else np.zeros(0, dtype=np.int64)
        if len(refs):
            batcher.cost_model.check_positive(sorted(set(tokens.tolist())))
        key = np.array([position[s] * (1 << 32) + i for s, i in refs], dtype=np.int64)
        costs = batcher.cost_model.costs(tokens)
        return cls(shapes, refs, shape_idx, seq_len, tokens, costs, key, oversize, excluded)


def _ordered_steps(
    samples: _Samples, batcher: Any, world: int, seed: int, epoch: int
) -> list[list[list[int]]]:
    """The packed steps in a seeded random order, each step's packs rotated over the ranks, so that no rank
    is the one that gets every step's lightest (or empty) pack."""
    cm = batcher.cost_model
    steps = pack_steps(samples.tokens, samples.costs, cm.c0, int(batcher.max_tokens), world, samples.key)
    perm = np.random.default_rng(abs(hash_seed(seed, epoch))).permutation(len(steps))
    return [steps[k][k % world :] + steps[k][: k % world] for k in perm]


@dataclass
class _Layout:
    """What every stream reads and yields, and the per-(rank, step) tokens and planned cost."""

    streams: dict[tuple[int, int], list[list[Ref]]]
    batch_buckets: dict[tuple[int, int], list[int]]
    batch_steps: dict[tuple[int, int], list[int]]
    reads: dict[tuple[int, int], list[tuple[int, list[int]]]]
    step_tokens: np.ndarray  # (world, steps)
    step_cost: np.ndarray  # (world, steps)


def _layout(samples: _Samples, steps: list[list[list[int]]], world: int, workers: int, cost_model) -> _Layout:
    streams: dict[tuple[int, int], list[list[Ref]]] = {
        (r, w): [] for r in range(world) for w in range(workers)
    }
    out = _Layout(
        streams=streams,
        batch_buckets={st: [] for st in streams},
        batch_steps={st: [] for st in streams},
        reads={st: [] for st in streams},
        step_tokens=np.zeros((world, len(steps)), dtype=np.int64),
        step_cost=np.zeros((world, len(steps)), dtype=np.float64),
    )
    tokens, refs = samples.tokens, samples.refs
    smallest = int(np.argmin(samples.seq_len)) if len(samples.shapes) else 0
    flat = [pack for packs in steps for pack in packs]  # world packs per step
    if flat:
        out.step_tokens[:] = pack_sums(flat, tokens)[0].reshape(len(steps), world).T
        out.step_cost[:] = pack_costs(flat, tokens, cost_model).reshape(len(steps), world).T
    tok, shape_of = tokens.tolist(), samples.shape_idx.tolist()
    for k, packs in enumerate(steps):
        for r, pack in enumerate(packs):
            st = (r, k % workers)
            pack_refs = sorted(map(refs.__getitem__, pack))
            streams[st].append(pack_refs)
            # The bucket of a pack: that of its largest sample (only types an empty pack's batch).
            big = max(pack, key=lambda i: (tok[i], -i)) if pack else -1
            out.batch_buckets[st].append(shape_of[big] if pack else smallest)
            out.batch_steps[st].append(k)
            out.reads[st].extend(_runs(pack_refs))
    return out


def shard_read_order(n_shards: int, seed: int, epoch: int) -> list[int]:
    """The shards in the seeded order whose samples, by id, break ties between samples of equal tokens."""
    order = list(range(n_shards))
    random.Random(f"lightning-adaptiveload:{seed}:{epoch}").shuffle(order)
    return order


def hash_seed(seed: int, epoch: int) -> int:
    """A stable 63-bit seed from (seed, epoch) for the step shuffle (independent of PYTHONHASHSEED)."""
    return random.Random(f"lightning-adaptiveload:packed:{seed}:{epoch}").getrandbits(63)


def _runs(pack_refs: list[Ref]) -> list[tuple[int, list[int]]]:
    """The pack's refs (sorted) as one read per shard: ``[(shard, ids ascending)]``."""
    out: list[tuple[int, list[int]]] = []
    for shard, i in pack_refs:
        if out and out[-1][0] == shard:
            out[-1][1].append(i)
        else:
            out.append((shard, [i]))
    return out

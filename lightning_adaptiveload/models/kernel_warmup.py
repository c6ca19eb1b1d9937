"""Build an epoch's attention kernels before its first step, not on the step that first meets a shape.

cuDNN's attention (PyTorch's fastest SDPA kernel on Hopper) builds an execution graph the first time it sees
a shape: 67-76 ms a graph on one H200 (run 77 of ``docs/lab_notebook.md``), for the forward and the backward of
the self- and the cross-attention. The step that first meets a batch shape is slower by its builds; under
DDP every other rank waits for it. A long run builds each shape once, but a packed epoch meets its run shapes
(``count`` samples of one length, :func:`~.pack_attention.equal_runs`) one rank at a time over its first
hundreds of steps, and a benchmark of a few dozen steps counts every one of them.

:class:`~lightning_adaptiveload.callbacks.kernel_warmup.KernelWarmup` (a Lightning callback, in
:mod:`lightning_adaptiveload.callbacks.kernel_warmup`) reads the rank's plan of the epoch before the epoch's
first step and runs the attention shapes the epoch will take once through the model's first block, forward and
backward (:func:`warm_kernels`); every block has the same attention shapes, and the kernels' caches are per
process.

- **Bounded** (:func:`plan_warmup`). A *shape* here is what one build serves: a distinct dense batch, a
  distinct run (token count, sample count) of a mixed pack, or a mixed pack's sample count. The plan's
  counts say how many steps meet each; only those met at least ``min_count`` times are warmed (a shape met
  once is built once either way: warming it only moves the build before step 1), most frequent first, at
  most ``max_shapes`` of them, and :func:`run_budgeted` stops before a pass that would end past
  ``max_seconds`` (at the mean rate so far). :meth:`WarmupPlan.skipped` counts what was left, and the steps
  that meet it. An index of 20,000 distinct shapes, each met once, warms nothing (it took 20,000 passes).
- **What runs.** Per distinct bucketed batch or equal-length pack: that batch. Per distinct run of a mixed
  pack: the run inside a made-up mixed pack (:func:`warm_packs`), so that it goes through the packed
  attention op as in training. Per sample count of a mixed pack: one made-up mixed pack of that many
  samples (torch 2.11's compiled blocks guard on it). Latents, times and text are random; the text has the
  first batch's length and dtype (a model with ``text_len`` pads every text to one length anyway).
- **Nothing trains.** Gradients go to the block's input only (:func:`torch.autograd.grad`): no parameter
  gets a gradient, no optimizer state changes, and DDP's gradient hooks do not fire.
- **Compiled blocks** meet the shapes as they would in training (the same inputs, the same
  ``requires_grad``), so the compiles the first steps would pay happen here instead, and count as theirs.
- **Refused** (an error at the start of training): a model other than :class:`~.video_dit.VideoDiT` (or
  one with a ``pack_prologue`` and ``blocks`` of its own), and a data module other than
  ``AdaptiveLoadDataModule`` (no plan to read).
- **Under FSDP2 it does nothing**, with a warning: calling one sharded block gathers it, a collective that
  ranks warming different shapes would not match. The run goes on without the warm-up.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_adaptiveload.models.pack_attention import equal_runs

__all__ = ["WarmupPlan", "plan_warmup", "planned_batches", "run_budgeted", "warm_kernels", "warm_packs"]

Shape = tuple[int, ...]  # a latent's (C, T, H, W)
# What one build serves: ("dense", batch), ("run", tokens, count) of a mixed pack, ("mixed", sample count).
Unit = tuple


def _tokens(shape: Shape, patch_size: Sequence[int]) -> int:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    return (t // pt) * (h // ph) * (w // pw)


def planned_batches(
    plan: Any, rank: int, latent_shape: Callable[[Any], Shape]
) -> Iterator[tuple[Shape, ...]]:
    """The latent shapes of each batch ``rank`` takes in ``plan`` (an ``EpochPlan``), in step order.

    A generator: a rank's epoch can hold millions of batches, and :func:`plan_warmup` keeps only their
    distinct shapes and counts.

    Args:
        plan: the epoch's plan (its ``step_order``, ``streams``, ``buckets``, ``batch_buckets`` and
            ``is_pack``).
        rank: the rank whose batches to list.
        latent_shape: a sample ref -> its latent shape (``ShardIndex.latent_shape``); asked for the samples of
            packs only (a bucketed batch's shape is its bucket's).
    """
    for w, j in plan.step_order[rank]:
        stream = (rank, w)
        refs = plan.streams[stream][j]
        if not refs:
            continue
        if plan.is_pack(stream, j):
            yield tuple(tuple(int(d) for d in latent_shape(ref)) for ref in refs)
        else:
            shape = tuple(int(d) for d in plan.buckets[plan.batch_buckets[stream][j]]["shape"])
            yield (shape,) * len(refs)


def _units(batch: Sequence[Shape], patch_size: Sequence[int]) -> list[Unit]:
    """The shapes (:data:`Unit`) a batch's step builds: its dense batch, or its runs and its sample count."""
    lens = [_tokens(s, patch_size) for s in batch]
    if not lens:
        return []
    if len(set(lens)) == 1:
        return [("dense", tuple(batch))]
    runs = dict.fromkeys(("run", length, count) for length, count in equal_runs(lens))
    return [*runs, ("mixed", len(batch))]


@dataclass
class WarmupPlan:
    """What :func:`plan_warmup` chose to warm in an epoch, and what it left (pure data; see the module).

    Attributes:
        packs: the batches to run, most frequent shapes first (:func:`run_budgeted` may stop early).
        steps: the batches of the plan read.
        shapes: the distinct shapes those steps meet that were not warmed or met before (``seen``).
        recurring: of them, the shapes met at least ``min_count`` times.
        chosen: of them, the shapes picked (at most ``max_shapes``); the packs cover them and maybe more.
        min_count, max_shapes: the rules it was made with (``max_shapes`` None: no cap).
    """

    packs: list[list[Shape]]
    steps: int
    shapes: int
    recurring: int
    chosen: int
    min_count: int
    max_shapes: int | None
    _units: list[Unit] = field(repr=False)  # the epoch's new shapes, by id
    _counts: list[int] = field(repr=False)  # steps meeting each
    _covers: list[frozenset[int]] = field(repr=False)  # per pack, the ids of the epoch's shapes it builds
    _extra: list[list[Unit]] = field(repr=False)  # per pack, the shapes it builds that the epoch never meets
    _steps_of: Counter = field(repr=False)  # a step's new shape ids (sorted tuple) -> steps like it
    _picked: frozenset[int] = field(repr=False)

    @property
    def met_once(self) -> int:
        """The new shapes that a single step meets."""
        return sum(1 for c in self._counts if c < 2)

    @property
    def mostly_once(self) -> bool:
        """Nearly every new shape (90% or more, of 10 or more) is met once: warming cannot pay for itself."""
        return self.shapes >= 10 and self.met_once >= 0.9 * self.shapes

    def skipped(self, run: int | None = None) -> dict[str, int]:
        """The shapes not warmed when the first ``run`` packs ran (all of them: None), by why, and the steps
        that meet at least one of them (each pays that shape's build on its first meeting).

        Returns:
            ``{"shapes", "steps", "once", "over_max_shapes", "over_max_seconds"}``: ``once`` met fewer
            than ``min_count`` times, ``over_max_shapes`` recurring but beyond the cap, ``over_max_seconds``
            picked but in a pack the time budget left out.
        """
        run = len(self.packs) if run is None else run
        covered: set[int] = set().union(*self._covers[:run])
        left = [i for i in range(len(self._units)) if i not in covered]
        out = {"shapes": len(left), "once": 0, "over_max_shapes": 0, "over_max_seconds": 0}
        for i in left:
            if i in self._picked:
                out["over_max_seconds"] += 1
            elif self._counts[i] < self.min_count:
                out["once"] += 1
            else:
                out["over_max_shapes"] += 1
        cold = set(left)
        out["steps"] = sum(n for ids, n in self._steps_of.items() if cold.intersection(ids))
        return out

    def seen_after(self, run: int | None = None) -> set[Unit]:
        """The shapes built once the first ``run`` packs ran and the epoch trained: every shape the epoch
        meets (training builds those left out) and the made-up shapes of the packs that ran."""
        run = len(self.packs) if run is None else run
        return {*self._units, *(u for extra in self._extra[:run] for u in extra)}


def plan_warmup(
    batches: Iterable[Sequence[Shape]],
    patch_size: Sequence[int],
    seen: set | None = None,
    *,
    max_shapes: int | None = None,
    min_count: int = 1,
) -> WarmupPlan:
    """Choose the shapes of ``batches`` (one epoch of one rank, :func:`planned_batches`) to warm, and the
    batches that build them (pure: ``seen`` is read, not changed; add :meth:`WarmupPlan.seen_after`).

    Each shape (a distinct dense batch, a run of a mixed pack, a mixed pack's sample count) not in ``seen``
    is counted over the steps. Those met at least ``min_count`` times are picked, most frequent first (ties:
    first met first), at most ``max_shapes`` (None: all). The picked dense batches run as they are; the
    picked runs are regrouped into made-up mixed packs of at most as many tokens as the largest batch, never
    two runs of one length in a pack (they would merge into one run); a run left alone gets the shortest run
    as a partner, so that its pack stays mixed. Last, for each picked sample count that no made-up pack has,
    one pack of that many samples of the two shortest lengths: torch 2.11's compiled blocks guard on a mixed
    pack's sample count (run 64), so each count is a graph of its own there. The packs come most frequent
    shape first, so that a time budget cuts the rarest. Every pack builds at least one picked shape: there
    are at most ``max_shapes`` packs.

    Memory: one entry per distinct shape and per distinct set of new shapes a step meets.
    """
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"plan_warmup: min_count must be an integer >= 1, got {min_count!r}")
    if max_shapes is not None and (
        isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 0
    ):
        raise ValueError(f"plan_warmup: max_shapes must be an integer >= 0 or None, got {max_shapes!r}")
    seen = set() if seen is None else seen
    ids: dict[Unit, int] = {}
    counts: list[int] = []
    steps_of: Counter = Counter()
    runs: dict[tuple[int, int], list[Shape]] = {}  # (tokens, count) -> the run's shapes, as first met
    lengths: dict[int, Shape] = {}  # every length of a mixed pack -> a shape of it (partners)
    cap = 0
    steps = 0
    for batch in batches:
        steps += 1
        units = _units(batch, patch_size)
        if not units:
            continue
        lens = [_tokens(s, patch_size) for s in batch]
        cap = max(cap, sum(lens))
        if units[0][0] != "dense":
            for length, shape in zip(lens, batch):
                lengths.setdefault(length, shape)
            i = 0
            for length, count in equal_runs(lens):
                runs.setdefault((length, count), list(batch[i : i + count]))
                i += count
        mine = []
        for u in units:
            if u in seen:
                continue
            j = ids.get(u)
            if j is None:
                j = ids[u] = len(counts)
                counts.append(0)
            counts[j] += 1
            mine.append(j)
        if mine:
            steps_of[tuple(sorted(mine))] += 1
    units_list = list(ids)
    recurring = sorted((j for j, c in enumerate(counts) if c >= min_count), key=lambda j: (-counts[j], j))
    picked = recurring if max_shapes is None else recurring[:max_shapes]
    packs: list[list[Shape]] = []
    for j in picked:
        if units_list[j][0] == "dense":
            packs.append(list(units_list[j][1]))
    picked_runs = [units_list[j][1:] for j in picked if units_list[j][0] == "run"]
    mixed: list[dict[str, Any]] = []  # {"lengths": set, "tokens": int, "shapes": list}
    for length, count in sorted(picked_runs, key=lambda k: (-k[0] * k[1], k)):
        tokens = length * count
        home = next((m for m in mixed if length not in m["lengths"] and m["tokens"] + tokens <= cap), None)
        if home is None:
            home = {"lengths": set(), "tokens": 0, "shapes": []}
            mixed.append(home)
        home["lengths"].add(length)
        home["tokens"] += tokens
        home["shapes"].extend(runs[(length, count)])
    for m in mixed:
        if len(m["lengths"]) == 1:  # alone: the shortest other length as its partner, so that it stays mixed
            (length,) = m["lengths"]
            m["shapes"].append(min((k, v) for k, v in lengths.items() if k != length)[1])
        packs.append(m["shapes"])
    made = {len(m["shapes"]) for m in mixed}
    for j in picked:
        unit = units_list[j]
        if unit[0] == "mixed" and unit[1] not in made:
            (_, first), (_, second) = sorted(lengths.items())[:2]
            packs.append([first] * (unit[1] - 1) + [second])
            made.add(unit[1])
    covers, extra = [], []
    for pack in packs:
        built = _units(pack, patch_size)
        covers.append(frozenset(ids[u] for u in built if u in ids))
        extra.append([u for u in built if u not in ids])
    # Most frequent shape first (stable: dense batches, made-up packs, sample counts, as built).
    order = sorted(range(len(packs)), key=lambda k: -max((counts[j] for j in covers[k]), default=0))
    return WarmupPlan(
        packs=[packs[k] for k in order],
        steps=steps,
        shapes=len(counts),
        recurring=len(recurring),
        chosen=len(picked),
        min_count=min_count,
        max_shapes=max_shapes,
        _units=units_list,
        _counts=counts,
        _covers=[covers[k] for k in order],
        _extra=[extra[k] for k in order],
        _steps_of=steps_of,
        _picked=frozenset(picked),
    )


def warm_packs(
    batches: Iterable[Sequence[Shape]], patch_size: Sequence[int], seen: set | None = None
) -> list[list[Shape]]:
    """The batches that take every attention shape of ``batches`` once (pure but for ``seen``), with no
    budget: :func:`plan_warmup` with ``min_count=1`` and no ``max_shapes``.

    ``seen``: the dense batches, runs and mixed sample counts taken before (left out), updated with those of
    this call.
    """
    plan = plan_warmup(batches, patch_size, seen)
    if seen is not None:
        seen.update(plan.seen_after())
    return plan.packs


def run_budgeted(
    packs: Sequence[Sequence[Shape]],
    warm_one: Callable[[Sequence[Shape]], None],
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Run ``warm_one`` on each pack in order until the time budget would be passed; returns how many ran.

    Before each pack but the first, a pack is not started when the time spent plus the mean time of a pack
    so far would pass ``max_seconds`` (None: no limit): the warm-up ends within its budget but for the
    first pass, or a pass far slower than the mean.

    Args:
        packs: as :attr:`WarmupPlan.packs`.
        warm_one: runs one pack.
        max_seconds: the budget, seconds of ``clock``.
        clock: seconds, monotonic (on a GPU, one that synchronises the device).
        progress: called with (done, total, seconds spent) after each pack.
    """
    if max_seconds is not None and not (isinstance(max_seconds, int | float) and max_seconds > 0):
        raise ValueError(f"run_budgeted: max_seconds must be a number > 0 or None, got {max_seconds!r}")
    start = clock()
    for i, shapes in enumerate(packs):
        if max_seconds is not None and i > 0:
            spent = clock() - start
            if spent + spent / i > max_seconds:
                return i
        warm_one(shapes)
        if progress is not None:
            progress(i + 1, len(packs), clock() - start)
    return len(packs)


def warm_kernels(
    model: Any,
    packs: Sequence[Sequence[Shape]],
    text: tuple[int, torch.dtype] | None,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
    *,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run each pack through ``model.blocks[0]``, forward and backward to the block's input (see the module).

    Args:
        model: a :class:`~.video_dit.VideoDiT` (anything with its ``pack_prologue`` and ``blocks``), in
            training mode, under the precision context of a training step.
        packs: latent shapes (C, T, H, W) per pack (:attr:`WarmupPlan.packs`, :func:`warm_packs`).
        text: (length, dtype) of the text states, or None for batches without text.
        device: where the model runs.
        progress: called with (done, total) after each pack.
        max_seconds: stop before a pack that would end past it (:func:`run_budgeted`); None: no limit.
        clock: the clock of ``max_seconds``.

    Returns the number of packs run (the first ones of ``packs``).
    """
    block = model.blocks[0]
    text_dim = model.config.text_dim
    g = torch.Generator(device).manual_seed(0)  # not the global streams: training draws the same either way

    def warm_one(shapes: Sequence[Shape]) -> None:
        n = len(shapes)
        latents = [torch.randn(s, device=device, generator=g) for s in shapes]
        timestep = torch.full((n,), 500.0, device=device)
        context = mask = None
        if text is not None:
            context = torch.randn((n, text[0], text_dim), device=device, generator=g).to(text[1])
            mask = torch.ones((n, text[0]), dtype=torch.bool, device=device)
        h, _, args, segments, _, _ = model.pack_prologue(latents, timestep, context, mask)
        out = block(h, *args) if segments is None else block(h, *args, segments=segments)
        torch.autograd.grad(out, h, torch.ones_like(out))
        del out, h, args, segments

    report = None if progress is None else (lambda done, total, _spent: progress(done, total))
    return run_budgeted(packs, warm_one, max_seconds, clock, report)

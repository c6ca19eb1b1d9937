"""Build an epoch's attention kernels before its first step, not on the step that first meets a shape.

cuDNN's attention (PyTorch's fastest SDPA kernel on Hopper) builds an execution graph the first time it sees
a shape: 67-76 ms a graph on one H200 (run 77 of ``docs/lab_notebook.md``), for the forward and the backward of
the self- and the cross-attention. The step that first meets a batch shape is slower by its builds; under
DDP every other rank waits for it. A long run builds each shape once, but a packed epoch meets its run shapes
(``count`` samples of one length, :func:`~.pack_attention.equal_runs`) one rank at a time over its first
hundreds of steps, and a benchmark of a few dozen steps counts every one of them.

:class:`~.warmup_callback.KernelWarmup` (a Lightning callback, in :mod:`.warmup_callback`) reads the rank's
plan of the epoch before the epoch's first step and runs each attention shape the epoch will take once through
the model's first block, forward and backward (:func:`warm_kernels`); every block has the same attention
shapes, and the kernels' caches are per process.

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

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_adaptiveload.models.pack_attention import equal_runs

__all__ = ["planned_batches", "warm_kernels", "warm_packs"]

Shape = tuple[int, ...]  # a latent's (C, T, H, W)


def _tokens(shape: Shape, patch_size: Sequence[int]) -> int:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    return (t // pt) * (h // ph) * (w // pw)


def planned_batches(plan: Any, rank: int, latent_shape: Callable[[Any], Shape]) -> Iterator[tuple[Shape, ...]]:
    """The latent shapes of each batch ``rank`` takes in ``plan`` (an ``EpochPlan``), in step order.

    A generator: a rank's epoch can hold millions of batches, and ``warm_packs`` keeps only their distinct
    shapes.

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


def warm_packs(
    batches: Iterable[Sequence[Shape]], patch_size: Sequence[int], seen: set | None = None
) -> list[list[Shape]]:
    """The batches that take every attention shape of ``batches`` once (pure but for ``seen``).

    A batch whose samples all have one token count runs as a dense batch: each distinct one is kept as it is.
    A mixed pack runs each run of consecutive equal-length samples as one dense kernel call; its distinct
    runs (token count, sample count) are regrouped into made-up mixed packs of at most as many tokens as the
    largest batch, never two runs of one length in a pack (they would merge into one run). A run left alone
    gets the shortest run as a partner, so that its pack stays mixed. Dense batches come first. Last, for each
    sample count of a mixed pack that no made-up pack has, one pack of that many samples of the two shortest
    lengths: torch 2.11's compiled blocks guard on a mixed pack's sample count (run 64), so each count is a
    graph of its own there.

    ``seen``: the dense batches, runs and mixed sample counts taken before (left out), updated with those of
    this call.
    """
    seen = set() if seen is None else seen
    dense: dict[tuple[Shape, ...], None] = {}
    runs: dict[tuple[int, int], list[Shape]] = {}
    lengths: dict[int, Shape] = {}  # every length of a mixed pack -> a shape of it (partners)
    counts: set[int] = set()  # the sample counts of mixed packs
    cap = 0
    for batch in batches:
        lens = [_tokens(s, patch_size) for s in batch]
        if not lens:
            continue
        cap = max(cap, sum(lens))
        if len(set(lens)) == 1:
            if ("dense", tuple(batch)) not in seen:
                dense.setdefault(tuple(batch), None)
            continue
        counts.add(len(batch))
        for length, shape in zip(lens, batch):
            lengths.setdefault(length, shape)
        i = 0
        for length, count in equal_runs(lens):
            if ("run", length, count) not in seen:
                runs.setdefault((length, count), list(batch[i : i + count]))
            i += count
    seen.update(("dense", b) for b in dense)
    seen.update(("run",) + k for k in runs)
    packs: list[list[Shape]] = [list(b) for b in dense]
    mixed: list[dict[str, Any]] = []  # {"lengths": set, "tokens": int, "shapes": list}
    for (length, count), shapes in sorted(runs.items(), key=lambda kv: (-kv[0][0] * kv[0][1], kv[0])):
        tokens = length * count
        home = next((m for m in mixed if length not in m["lengths"] and m["tokens"] + tokens <= cap), None)
        if home is None:
            home = {"lengths": set(), "tokens": 0, "shapes": []}
            mixed.append(home)
        home["lengths"].add(length)
        home["tokens"] += tokens
        home["shapes"].extend(shapes)
    for m in mixed:
        if len(m["lengths"]) == 1:  # alone: the shortest other length as its partner, so that it stays mixed
            (length,) = m["lengths"]
            m["shapes"].append(min((k, v) for k, v in lengths.items() if k != length)[1])
        packs.append(m["shapes"])
    seen.update(("mixed", len(m["shapes"])) for m in mixed)
    if counts - {n for kind, *rest in seen if kind == "mixed" for n in rest}:
        (_, first), (_, second) = sorted(lengths.items())[:2]
        for n in sorted(counts):
            if ("mixed", n) not in seen:
                packs.append([first] * (n - 1) + [second])
                seen.add(("mixed", n))
    return packs


def warm_kernels(
    model: Any,
    packs: Sequence[Sequence[Shape]],
    text: tuple[int, torch.dtype] | None,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Run each pack through ``model.blocks[0]``, forward and backward to the block's input (see the module).

    Args:
        model: a :class:`~.video_dit.VideoDiT` (anything with its ``pack_prologue`` and ``blocks``), in
            training mode, under the precision context of a training step.
        packs: latent shapes (C, T, H, W) per pack (:func:`warm_packs`).
        text: (length, dtype) of the text states, or None for batches without text.
        device: where the model runs.
        progress: called with (done, total) after each pack.

    Returns the number of packs run.
    """
    block = model.blocks[0]
    text_dim = model.config.text_dim
    g = torch.Generator(device).manual_seed(0)  # not the global streams: training draws the same either way
    for i, shapes in enumerate(packs):
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
        if progress is not None:
            progress(i + 1, len(packs))
    return len(packs)

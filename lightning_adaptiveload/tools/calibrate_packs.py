"""The designed pack measurements of ``calibrate``: which steps to time, timing them, fitting all terms.

The pack cost model ``cost(step) = c0 + sum_i (alpha*S_i + beta*S_i^2)``
(:meth:`~lightning_adaptiveload.planning.cost_model.CostModel.fit_packs`) has three terms, and steps of one
shape cannot tell them apart: ``c0`` shows only between steps of different sample counts, ``beta`` only
between steps of different lengths. A trace of bucketed batches (one shape per step, batch sizes set by
the budget) is a poor design for it; the fit of our H100 trace errs 8.9% on average and 30% at worst.
This module times a designed set instead, each step through the model's packed forward
(:meth:`VideoDiT.forward_packed`, the ``packed`` schedule's step) at the chosen ``max_tokens``:

- a single small image (the per-step constant dominates),
- several small images, and as many as ``max_tokens`` holds (alpha),
- one clip (the longest shape; beta), two clips, a clip filled up with images,
- one of each native shape of the data (a mixed pack),

beside the single samples that ``calibrate`` times through the bucketed forward. All points are fitted
together and every point's relative error is reported.

The measurement loop takes a *timer*: ``timer(shapes) -> seconds`` of one step. On a device it is
:meth:`~lightning_adaptiveload.tools.calibrate_bench.Bench.time_pack`; tests inject a synthetic one.
Plain Python and NumPy besides the timer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ERROR_TARGETS",
    "PackTiming",
    "design_packs",
    "fit_pack_terms",
    "time_packs",
]

# The targets for the fitted pack model: mean and worst relative error over the measured points.
ERROR_TARGETS = {"mean_rel_error": 0.05, "max_rel_error": 0.15}

Shape = tuple[int, int, int, int]


@dataclass
class PackTiming:
    """One timed step: ``name`` of the design point, its samples' latent shapes and token counts.

    ``seconds`` is the median of ``runs`` (None: out of memory); ``path`` is ``"packed"`` (the packed
    forward) or ``"bucketed"`` (a batch of one shape); ``predicted`` and ``rel_error`` are filled by
    :func:`fit_pack_terms`.
    """

    name: str
    shapes: list[Shape]
    seq_lens: list[int]
    path: str
    seconds: float | None
    runs: list[float] = field(default_factory=list)
    predicted: float | None = None
    rel_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for the results file."""
        return {
            "name": self.name,
            "path": self.path,
            "samples": len(self.seq_lens),
            "tokens": int(sum(self.seq_lens)),
            "seq_lens": [int(s) for s in self.seq_lens],
            "shapes": ["x".join(map(str, s)) for s in self.shapes],
            "seconds": self.seconds,
            "runs": list(self.runs),
            "predicted": self.predicted,
            "rel_error": self.rel_error,
        }


def design_packs(
    shapes: Sequence[Sequence[int]], seq_lens: Sequence[int], max_tokens: int
) -> list[tuple[str, list[Shape]]]:
    """The designed packs over the data's native shapes, each within ``max_tokens`` tokens.

    Args:
        shapes: the data's distinct latent shapes (C, T, H, W).
        seq_lens: their token counts, in the same order.
        max_tokens: the token budget of a step.

    Returns:
        ``(name, shapes of the pack)`` pairs, without duplicates (the same multiset of token counts is
        timed once). "image" is the shortest single-frame shape (the shortest shape when none has one
        frame), "clip" the longest shape.

    Raises:
        ValueError: no shape, or no shape within ``max_tokens``.
    """
    pairs = sorted(
        ((int(s), tuple(int(d) for d in x)) for x, s in zip(shapes, seq_lens) if int(s) <= max_tokens),
        key=lambda p: (p[0], p[1]),
    )
    if not pairs:
        raise ValueError(f"design_packs: no shape within max_tokens={max_tokens}; raise max_tokens")
    singles = [p for p in pairs if p[1][1] == 1] or pairs
    s_img, img = singles[0]
    s_clip, clip = pairs[-1]
    fill = max_tokens // s_img
    design: list[tuple[str, list[Shape]]] = [
        ("single small image", [img]),
        ("several images", [img] * min(4, fill)),
        ("images at max_tokens", [img] * fill),
        ("one clip", [clip]),
    ]
    if s_clip + s_img <= max_tokens:
        design.append(("clip + images", [clip] + [img] * ((max_tokens - s_clip) // s_img)))
    if 2 * s_clip <= max_tokens:
        design.append(("two clips", [clip, clip]))
    # One of each native shape, longest first while it fits: a pack of mixed lengths and aspect ratios.
    mixed: list[Shape] = []
    used = 0
    for s, x in sorted(pairs, key=lambda p: -p[0]):
        if used + s <= max_tokens:
            mixed.append(x)
            used += s
    if len({tuple(m) for m in mixed}) > 1:
        design.append(("mixed native shapes", mixed))
    out, seen = [], set()
    for name, pack in design:
        key = tuple(sorted(int(s) for s in _lens(pack, shapes, seq_lens)))
        if key not in seen:
            seen.add(key)
            out.append((name, [tuple(x) for x in pack]))
    return out


def _lens(pack: Sequence[Shape], shapes: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> list[int]:
    table = {tuple(int(d) for d in x): int(s) for x, s in zip(shapes, seq_lens)}
    return [table[tuple(x)] for x in pack]


def time_packs(
    design: Sequence[tuple[str, Sequence[Shape]]],
    seq_len_of: Callable[[Shape], int],
    timer: Callable[[list[Shape]], float | None],
    repeats: int = 3,
    warmup: int = 1,
    path: str = "packed",
    progress: Any = None,
) -> list[PackTiming]:
    """Time every designed step: ``warmup`` untimed calls, then the median of ``repeats`` timed ones.

    Args:
        design: ``(name, shapes)`` from :func:`design_packs`.
        seq_len_of: tokens of one latent shape.
        timer: seconds of one step of these shapes, or None when it ran out of memory.
        repeats, warmup: timed and untimed calls per step.
        path: recorded in each :class:`PackTiming`.
        progress: an optional tqdm-like bar (``update``, ``set_postfix_str``).
    """
    out = []
    for name, shapes in design:
        shapes = [tuple(int(d) for d in x) for x in shapes]
        lens = [seq_len_of(x) for x in shapes]
        runs: list[float] = []
        oom = False
        for k in range(warmup + repeats):
            seconds = timer(shapes)
            if seconds is None:
                oom = True
                break
            if k >= warmup:
                runs.append(float(seconds))
        median = None if oom or not runs else statistics.median(runs)
        out.append(PackTiming(name, shapes, lens, path, median, runs))
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"{name}: {'OOM' if median is None else f'{median:.4g} s'}")
    return out


def fit_pack_terms(points: Sequence[PackTiming], fit_gamma: bool = False):
    """Fit ``c0``, alpha, beta to every point that ran; fill each point's prediction and relative error.

    Returns:
        The fitted :class:`~lightning_adaptiveload.planning.cost_model.CostModel`; its ``fit_info`` holds
        n, rmse, mean and max relative error, r2, and whether the errors meet :data:`ERROR_TARGETS`
        (``meets_targets`` 1.0 or 0.0).

    Raises:
        ValueError: fewer than three points ran.
    """
    from lightning_adaptiveload.planning.cost_model import CostModel

    ok = [p for p in points if p.seconds is not None]
    if len(ok) < 3:
        raise ValueError(
            f"calibrate: only {len(ok)} timed steps ran (the rest ran out of memory); the pack fit needs 3 or "
            "more: lower --max-tokens"
        )
    try:
        model = CostModel.fit_packs([p.seq_lens for p in ok], [p.seconds for p in ok], fit_gamma=fit_gamma)
    except ValueError as err:
        table = "; ".join(
            f"{p.name} ({len(p.seq_lens)} samples, {sum(p.seq_lens)} tokens): {p.seconds:.4g} s" for p in ok
        )
        raise ValueError(f"calibrate: {err}. Measured steps: {table}") from None
    for p in ok:
        p.predicted = model.pack_cost(p.seq_lens)
        p.rel_error = (p.predicted - p.seconds) / p.seconds
    errors = np.abs([p.rel_error for p in ok])
    info = dict(model.fit_info or {})
    info["mean_rel_error"] = float(errors.mean())
    info["max_rel_error"] = float(errors.max())
    info["meets_targets"] = float(
        info["mean_rel_error"] <= ERROR_TARGETS["mean_rel_error"]
        and info["max_rel_error"] <= ERROR_TARGETS["max_rel_error"]
    )
    model.fit_info = info
    return model

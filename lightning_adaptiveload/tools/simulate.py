"""Planning simulator: how evenly each batching mode loads the ranks, before any GPU hour is spent.

For a data set (a length mix or the index of real shards), a model of what a batch costs (a fitted
:class:`~lightning_adaptiveload.planning.cost_model.CostModel`, or step times measured per bucket), a set of world
sizes and the budgets, the simulator plans one epoch with the real planner
(:func:`lightning_adaptiveload.planning.planner.plan_epoch` and
:class:`~lightning_adaptiveload.planning.batching.DualConstraintBatcher`, the very code the DataModule runs), replays
each rank's batches step by step, and reports per mode:

- ``cv_mean``, ``cv_p95``: the compute CV across ranks of each step (population std / mean of the ranks'
  step times), mean and 95th percentile over steps;
- ``straggler_wait``: the share of the job's time ranks spend waiting for the slowest rank at the gradient
  all-reduce: ``sum_steps (max - mean) / sum_steps max`` (the per-step ``1 - mean / max``, weighted by the
  step's duration; :func:`lightning_adaptiveload.monitor.stats.straggler_wait`), and ``step_wait_mean`` (the same
  per-step figure, unweighted). These and the CV and imbalance figures are
  :data:`lightning_adaptiveload.monitor.stats.BALANCE_FIGURES`, the names the ``LoadBalanceMonitor`` summary uses
  for measured runs. ``wait_share`` and ``wait_mean`` are their old names, kept in the rows;
- ``tokens_per_s`` and ``tokens_per_s_ratio``: total tokens / sum over steps of the slowest rank's time, and
  its ratio to ``equal_tokens`` at the same world size;
- ``peak_tokens`` (the memory high-water mark in tokens per rank and step), ``token_fill`` (mean tokens of a
  rank's batch / ``max_tokens``), ``compute_fill`` (mean planned cost / ``max_compute``) and
  ``vram_utilisation`` (mean / max of the per-step memory: the paper's "peak VRAM utilisation efficiency",
  measured peak GB from a trace when it has them, tokens otherwise);
- ``recommended_max_compute``: the candidate ``max_compute`` (cost-model units) with the highest tokens/s
  (within 0.5%: the largest such budget); every candidate respects ``max_tokens``, the memory cap.

Modes (:data:`MODES`): ``equal_tokens`` (each rank on its own, ``B = max_tokens // S``: the baseline every
trainer uses), ``dual`` (each rank on its own, the AdaptiveLoad paper's dual constraint), ``lockstep`` (all
ranks take a batch of the same length class at each step, with the dual constraint) and
``lockstep_equal_tokens``.

The time of a rank's step is the time of its batch (from the per-bucket table or the cost model) plus an
optional fixed per-step overhead. The simulator is deterministic for a seed.

Example:
    >>> from lightning_adaptiveload.tools.simulate import simulate
    >>> result = simulate("tiny", world_sizes=[4], max_tokens=512, min_steps_per_rank=8, progress=False)
    >>> sorted({row["mode"] for row in result.rows})
    ['dual', 'equal_tokens', 'lockstep']
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.data.mixes import Mix, load_mix
from lightning_adaptiveload.monitor import stats
from lightning_adaptiveload.planning.cost_model import CostModel

__all__ = [
    "MODES",
    "StepTimeTable",
    "SimulationResult",
    "balance_metrics",
    "plot_result",
    "simulate",
    "write_outputs",
    "main",
]

# mode name -> (schedule passed to plan_epoch, batcher mode)
MODES: dict[str, tuple[str, str]] = {
    "equal_tokens": ("independent", "equal_tokens"),
    "dual": ("independent", "dual"),
    "lockstep": ("lockstep", "dual"),
    "lockstep_equal_tokens": ("lockstep", "equal_tokens"),
    "packed": ("packed", "equal_tokens"),  # one pack per rank and step (planning/packed.py)
}
DEFAULT_MODES = ("equal_tokens", "dual", "lockstep")
DEFAULT_WORLD_SIZES = (2, 8, 16, 64)

_THW = tuple[int, int, int]
_DEFAULT_PATCH = (1, 2, 2)
# Issue 7's targets, checked and reported (never asserted).
_TARGET_LOCKSTEP = 0.02
_PAPER_IMBALANCE_DUAL = 0.189
# max_compute candidates within this relative tokens/s of the best count as equally good.
_SEARCH_TIE = 0.005


# ----------------------------------------------------------------------------------------------------
# What a batch costs: measured per bucket, or a cost model
# ----------------------------------------------------------------------------------------------------


@dataclass
class StepTimeTable:
    """Measured time of one training step per bucket and batch size, e.g. from a GPU trace.

    A step's time at a batch size that was not measured is interpolated linearly in B between the two
    nearest measured batch sizes (extrapolated from the two nearest outside them); with one measured B,
    it is scaled in proportion to B. A bucket missing from the table falls back to :attr:`fallback` (a
    quadratic cost model fitted to the table's per-sample times, times B). Both cases are counted in
    :attr:`lookups` so that the result can say how much of it rests on measurements. Peak memory, where
    the trace has it, follows :meth:`batch_peak_gb`.

    Attributes:
        seconds: (T, H, W) of the latent -> {batch size: seconds of forward + backward}.
        peak_gb: (T, H, W) -> {batch size: peak allocated GiB}, where the trace has it.
        source: where the numbers came from (file path or a description).
        patch_size: (pt, ph, pw) used to count tokens for the fallback fit.
        lookups: counts of ``"measured"``, ``"interpolated"``, ``"scaled"`` and ``"fallback"`` lookups.
    """

    seconds: dict[_THW, dict[int, float]]
    peak_gb: dict[_THW, dict[int, float]] = field(default_factory=dict)
    source: str = ""
    patch_size: tuple[int, int, int] = _DEFAULT_PATCH
    lookups: dict[str, int] = field(default_factory=dict)
    _fallback: CostModel | None = field(default=None, repr=False)
    _mem_line: tuple[float, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.seconds:
            raise ValueError(
                f"step time table {self.source or '<dict>'}: no entries; give at least one bucket"
            )
        for thw, by_b in self.seconds.items():
            for b, s in by_b.items():
                if int(b) < 1 or not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
                    raise ValueError(
                        f"step time table {self.source or '<dict>'}: bucket (T,H,W)={thw} batch {b}: seconds must be "
                        f"a positive finite number and B >= 1, got {s!r}"
                    )

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, patch_size: Sequence[int] = _DEFAULT_PATCH) -> StepTimeTable:
        """Read a trace: one JSON object per line with ``T, H, W, B`` and ``ms`` (``peak_gb`` optional).

        Lines that do not start with ``{`` (comments, fit summaries) are skipped. Repeated (T, H, W, B)
        entries are averaged.

        Raises:
            FileNotFoundError: no such file.
            ValueError: a JSON line that does not parse or lacks a key; the message names file, line and key.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"step time trace {path!r}: no such file; pass the JSONL a GPU trace wrote"
            )
        sums: dict[tuple[_THW, int], list[float]] = {}
        mems: dict[tuple[_THW, int], list[float]] = {}
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"step time trace {path}: line {lineno} is not valid JSON ({err})"
                    ) from None
                for key in ("T", "H", "W", "B", "ms"):
                    if key not in rec:
                        raise ValueError(
                            f"step time trace {path}: line {lineno} lacks key {key!r}; each line needs "
                            "T, H, W, B and ms"
                        )
                thw = (int(rec["T"]), int(rec["H"]), int(rec["W"]))
                b = int(rec["B"])
                ms = float(rec["ms"])
                if b < 1 or not (math.isfinite(ms) and ms > 0):
                    raise ValueError(
                        f"step time trace {path}: line {lineno}: B={rec['B']!r}, ms={rec['ms']!r}; "
                        "B must be >= 1 and ms positive"
                    )
                sums.setdefault((thw, b), []).append(ms / 1e3)
                if rec.get("peak_gb") is not None:
                    mems.setdefault((thw, b), []).append(float(rec["peak_gb"]))
        if not sums:
            raise ValueError(f"step time trace {path}: no JSON lines with T, H, W, B, ms found")
        seconds: dict[_THW, dict[int, float]] = {}
        for (thw, b), vals in sums.items():
            seconds.setdefault(thw, {})[b] = float(np.mean(vals))
        peak: dict[_THW, dict[int, float]] = {}
        for (thw, b), vals in mems.items():
            peak.setdefault(thw, {})[b] = float(np.mean(vals))
        return cls(seconds=seconds, peak_gb=peak, source=path, patch_size=tuple(int(v) for v in patch_size))

    @classmethod
    def from_monitor_csv(
        cls,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        latent_shapes: Iterable[Sequence[int]],
        patch_size: Sequence[int] = _DEFAULT_PATCH,
        warmup_steps: int = 5,
    ) -> StepTimeTable:
        """Per-bucket step times measured in a real run, from LoadBalanceMonitor's ``load_balance_ranks.csv``.

        Each row is one rank's step: its own compute time (``compute_time_s``, waiting excluded), tokens per
        sample (``seq_len``) and batch size. The median over rows of each (seq_len, B) becomes the entry
        of every latent shape in ``latent_shapes`` with that many tokens (the CSV does not record T, H, W;
        shapes with equal token counts cost the same). Steps during which FLOPs were counted, the first
        ``warmup_steps`` steps of each file and rows without a time are left out.

        Args:
            paths: one or more CSV files (e.g. the runs of several modes, for more (S, B) pairs).
            latent_shapes: the data set's latent shapes (C, T, H, W), e.g. a mix's buckets.
            patch_size: (pt, ph, pw) of the model.
            warmup_steps: leading steps of each file to leave out (compilation, allocator warm-up).

        Raises:
            FileNotFoundError: a path does not exist.
            ValueError: a file lacks a column, or no usable row is left.
        """
        import csv

        patch = tuple(int(v) for v in patch_size)
        files = [os.fspath(paths)] if isinstance(paths, str | os.PathLike) else [os.fspath(p) for p in paths]
        by_key: dict[tuple[int, int], list[float]] = {}
        mem: dict[tuple[int, int], list[float]] = {}
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"monitor CSV {path!r}: no such file (LoadBalanceMonitor writes it)")
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                need = {"batch_idx", "seq_len", "batch_size", "compute_time_s"}
                missing = need - set(reader.fieldnames or ())
                if missing:
                    raise ValueError(
                        f"monitor CSV {path}: missing column(s) {sorted(missing)}; "
                        "expected LoadBalanceMonitor's load_balance_ranks.csv"
                    )
                rows = list(reader)
            first = min((int(float(r["batch_idx"])) for r in rows if r["batch_idx"]), default=0)
            for r in rows:
                try:
                    step = int(float(r["batch_idx"]))
                    s_len, b, sec = (
                        int(float(r["seq_len"])),
                        int(float(r["batch_size"])),
                        float(r["compute_time_s"]),
                    )
                except (TypeError, ValueError):
                    continue
                if step < first + warmup_steps or r.get("flops_counted") in ("1", "1.0") or not sec > 0:
                    continue
                by_key.setdefault((s_len, b), []).append(sec)
                peak = r.get("peak_allocated_bytes")
                if peak not in (None, ""):
                    mem.setdefault((s_len, b), []).append(float(peak) / 2**30)
        if not by_key:
            raise ValueError(
                f"monitor CSV(s) {files}: no usable row after leaving out {warmup_steps} warm-up steps"
            )
        seconds: dict[_THW, dict[int, float]] = {}
        peak_gb: dict[_THW, dict[int, float]] = {}
        for shape in {tuple(int(v) for v in sh) for sh in latent_shapes}:
            thw = shape[-3:]
            tokens = (thw[0] // patch[0]) * (thw[1] // patch[1]) * (thw[2] // patch[2])
            for (s_len, b), vals in by_key.items():
                if s_len == tokens:
                    seconds.setdefault(thw, {})[b] = float(np.median(vals))
                    if mem.get((s_len, b)):
                        peak_gb.setdefault(thw, {})[b] = float(np.max(mem[(s_len, b)]))
        if not seconds:
            raise ValueError(
                f"monitor CSV(s) {files}: no measured sequence length {sorted({k[0] for k in by_key})} matches the "
                f"given latent shapes under patch {list(patch)}"
            )
        return cls(seconds=seconds, peak_gb=peak_gb, source=";".join(files), patch_size=patch)

    def _tokens(self, thw: _THW) -> int:
        pt, ph, pw = self.patch_size
        return (thw[0] // pt) * (thw[1] // ph) * (thw[2] // pw)

    @property
    def fallback(self) -> CostModel:
        """Quadratic cost model (seconds per sample) fitted to every measured point, for missing buckets."""
        if self._fallback is None:
            s, y, b = self.points()
            distinct = len(set(s))
            self._fallback = CostModel.fit(s, y, kind="quadratic", batch_sizes=b, fit_gamma=distinct >= 3)
        return self._fallback

    def points(self) -> tuple[list[int], list[float], list[int]]:
        """Every measurement as (tokens per sample S, seconds, batch size B) lists, for fitting."""
        s, y, b = [], [], []
        for thw, by_b in sorted(self.seconds.items()):
            for bs, sec in sorted(by_b.items()):
                s.append(self._tokens(thw))
                y.append(sec)
                b.append(bs)
        return s, y, b

    def fit_cost_model(self, kind: str = "power") -> CostModel:
        """Fit a :class:`CostModel` of ``kind`` to every measured point (batch times, with their B)."""
        s, y, b = self.points()
        return CostModel.fit(s, y, kind=kind, batch_sizes=b)

    def _count(self, what: str) -> None:
        self.lookups[what] = self.lookups.get(what, 0) + 1

    @staticmethod
    def _interp(by_b: Mapping[int, float], batch_size: int) -> tuple[float, str]:
        if batch_size in by_b:
            return by_b[batch_size], "measured"
        bs = sorted(by_b)
        if len(bs) == 1:
            return by_b[bs[0]] * batch_size / bs[0], "scaled"
        # Two nearest measured batch sizes bracketing B (or the two at the nearer end outside them).
        hi = next((i for i, v in enumerate(bs) if v > batch_size), len(bs) - 1)
        hi = max(hi, 1)
        b0, b1 = bs[hi - 1], bs[hi]
        t0, t1 = by_b[b0], by_b[b1]
        value = t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        # A line through two points can dip below zero far outside them; never go below B x the smallest
        # per-sample time measured for this bucket.
        floor = batch_size * min(by_b[v] / v for v in bs) * 0.5
        return max(value, floor), "interpolated"

    def batch_seconds(self, thw: Sequence[int], batch_size: int) -> float:
        """Seconds of forward + backward of a batch of ``batch_size`` latents of (T, H, W) = ``thw``."""
        key = (int(thw[0]), int(thw[1]), int(thw[2]))
        by_b = self.seconds.get(key)
        if by_b is None:
            self._count("fallback")
            return self.fallback.batch_cost(batch_size, self._tokens(key))
        value, how = self._interp(by_b, int(batch_size))
        self._count(how)
        return value

    def _memory_line(self) -> tuple[float, float] | None:
        """(GiB at 0 tokens, GiB per token) fitted to every measured peak, or None with < 2 token counts."""
        if self._mem_line is None:
            pts = [
                (b * self._tokens(thw), gb) for thw, by_b in self.peak_gb.items() for b, gb in by_b.items()
            ]
            if len({t for t, _ in pts}) < 2:
                self._mem_line = ()
            else:
                slope, icpt = np.polyfit([t for t, _ in pts], [g for _, g in pts], 1)
                self._mem_line = (float(icpt), float(slope))
        return self._mem_line or None

    def batch_peak_gb(self, thw: Sequence[int], batch_size: int) -> float | None:
        """Peak allocated GiB of such a batch, or None where the table has no memory figures.

        Measured, else interpolated in B for the bucket, else a line in the batch's tokens fitted to every
        measured peak (model states are a constant, activations grow with tokens; scaling one measured
        peak in proportion to B would count the model states B times).
        """
        key = (int(thw[0]), int(thw[1]), int(thw[2]))
        by_b = self.peak_gb.get(key, {})
        b = int(batch_size)
        if b in by_b:
            return by_b[b]
        if len(by_b) >= 2:
            return self._interp(by_b, b)[0]
        line = self._memory_line()
        if line is None:
            return None
        return line[0] + line[1] * b * self._tokens(key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary: source, the measured points and the lookup counts."""
        return {
            "source": self.source,
            "patch_size": list(self.patch_size),
            "points": [
                {
                    "T": t[0],
                    "H": t[1],
                    "W": t[2],
                    "B": b,
                    "seconds": s,
                    "peak_gb": self.peak_gb.get(t, {}).get(b),
                }
                for t, by_b in sorted(self.seconds.items())
                for b, s in sorted(by_b.items())
            ],
            "lookups": dict(self.lookups),
        }


def _load_times(times: StepTimeTable | CostModel | Mapping | str | os.PathLike | None, patch) -> Any:
    """Resolve the ``times`` argument of :func:`simulate` into a StepTimeTable or a CostModel."""
    if times is None:
        return CostModel.default()
    if isinstance(times, StepTimeTable | CostModel):
        return times
    if isinstance(times, Mapping):
        return CostModel.from_dict(times)
    path = os.fspath(times)
    if path.endswith(".jsonl") or path.endswith(".txt"):
        return StepTimeTable.from_jsonl(path, patch)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"times {path!r}: no such file; pass a trace (.jsonl/.txt, one JSON per line with T, H, W, B, ms) "
            "or a cost model (.json with kind and its coefficients)"
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # A file of JSON lines under another extension.
        return StepTimeTable.from_jsonl(path, patch)
    if isinstance(data, Mapping) and "cost_model" in data:
        data = data["cost_model"]
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"times {path}: not a cost model ({err}); see CostModel.to_dict for the format"
        ) from None


class _Coster:
    """Seconds (and memory) of a batch of B latents of one shape, cached per (shape, B)."""

    def __init__(
        self, times: StepTimeTable | CostModel, patch: tuple[int, int, int], overhead_s: float
    ) -> None:
        self.times = times
        self.patch = patch
        self.overhead_s = float(overhead_s)
        self._cache: dict[tuple[_THW, int], tuple[float, float | None]] = {}

    def tokens(self, thw: _THW) -> int:
        pt, ph, pw = self.patch
        return (thw[0] // pt) * (thw[1] // ph) * (thw[2] // pw)

    def __call__(self, thw: _THW, b: int) -> tuple[float, float | None]:
        key = (thw, b)
        hit = self._cache.get(key)
        if hit is None:
            if isinstance(self.times, StepTimeTable):
                sec = self.times.batch_seconds(thw, b)
                mem = self.times.batch_peak_gb(thw, b)
            else:
                sec = self.times.batch_cost(b, self.tokens(thw))
                mem = None
            hit = (sec + self.overhead_s, mem)
            self._cache[key] = hit
        return hit


# ----------------------------------------------------------------------------------------------------
# Metrics of a replayed plan
# ----------------------------------------------------------------------------------------------------


def balance_metrics(
    rank_seconds: np.ndarray,
    rank_tokens: np.ndarray,
    *,
    rank_memory: np.ndarray | None = None,
    rank_cost: np.ndarray | None = None,
    max_tokens: int | None = None,
    max_compute: float | None = None,
) -> dict[str, float]:
    """Balance, throughput and memory statistics of per-rank step times.

    The balance figures are :func:`lightning_adaptiveload.monitor.stats.balance_summary` of ``rank_seconds``
    (:data:`~lightning_adaptiveload.monitor.stats.BALANCE_FIGURES`: the names the monitor's summary uses).

    Args:
        rank_seconds: float array (steps, world): each rank's compute time of each step, seconds.
        rank_tokens: int array (steps, world): tokens in each rank's batch.
        rank_memory: optional float array (steps, world): each rank's peak memory per step (any unit);
            tokens are used when None.
        rank_cost: optional float array (steps, world): the planner's cost-model estimate of each batch.
        max_tokens: the token budget, for ``token_fill``.
        max_compute: the compute budget in cost-model units, for ``compute_fill``.

    Returns:
        ``steps, world, cv_mean, cv_p50, cv_p95, imbalance_mean, imbalance_p95, straggler_wait
        (time-weighted), step_wait_mean (unweighted), wait_share and wait_mean (their old names),
        step_seconds_mean, step_time_cv (of the step durations across steps), total_seconds, total_tokens,
        tokens_per_s, peak_tokens, token_fill, compute_fill, vram_utilisation`` (fractions, not percent).

    Raises:
        ValueError: arrays of different or non-2-D shapes, no steps, or negative times.
    """
    t = np.asarray(rank_seconds, dtype=np.float64)
    tok = np.asarray(rank_tokens, dtype=np.float64)
    if t.ndim != 2 or t.shape != tok.shape or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(
            f"rank_seconds {t.shape} and rank_tokens {tok.shape} must both be (steps, world) with steps, world >= 1"
        )
    if np.any(t < 0) or not np.all(np.isfinite(t)):
        raise ValueError("rank_seconds must be finite and >= 0")
    top = t.max(axis=1)
    figures = stats.balance_summary(t)
    total_seconds = float(top.sum())
    total_tokens = float(tok.sum())
    mem = tok if rank_memory is None else np.asarray(rank_memory, dtype=np.float64)
    out = {
        "steps": int(t.shape[0]),
        "world": int(t.shape[1]),
        **figures,
        "wait_share": figures["straggler_wait"],  # old names, kept for scripts
        "wait_mean": figures["step_wait_mean"],
        "step_seconds_mean": float(top.mean()),
        "step_time_cv": stats.cv(top),  # of the step durations across steps
        "total_seconds": total_seconds,
        "total_tokens": total_tokens,
        "tokens_per_s": total_tokens / total_seconds if total_seconds > 0 else math.nan,
        "peak_tokens": int(tok.max()),
        "token_fill": float(tok.mean() / max_tokens) if max_tokens else math.nan,
        "compute_fill": math.nan,
        "vram_utilisation": stats.peak_vram_utilisation_efficiency(mem.ravel().tolist()),
    }
    if rank_cost is not None and max_compute and math.isfinite(max_compute):
        out["compute_fill"] = float(np.asarray(rank_cost, dtype=np.float64).mean() / max_compute)
    return out


# ----------------------------------------------------------------------------------------------------
# Populations: what the planner plans over
# ----------------------------------------------------------------------------------------------------


def _largest_remainder(p: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to n, proportional to p (Hamilton's method): no bucket is under-drawn by chance."""
    raw = p * n
    counts = np.floor(raw).astype(np.int64)
    rest = n - int(counts.sum())
    if rest > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:rest]] += 1
    return counts


def _mix_population(mix: Mix, num_samples: int, num_shards: int, seed: int) -> Any:
    """An in-memory ShardIndex of ``num_samples`` latent shapes in the mix's exact proportions, shuffled."""
    from lightning_adaptiveload.data.shards import ShardIndex, ShardInfo

    counts = _largest_remainder(mix.probabilities, num_samples)
    bucket_ids = np.repeat(np.arange(len(mix.buckets)), counts)
    np.random.default_rng(seed).shuffle(bucket_ids)
    shapes = [mix.buckets[i].latent_shape for i in bucket_ids.tolist()]
    shards = []
    for k, part in enumerate(np.array_split(np.arange(num_samples), num_shards)):
        idx = part.tolist()
        shards.append(
            ShardInfo(
                path=f"sim://{mix.name}/shard-{k:06d}.tar",
                keys=[f"s{i:09d}" for i in idx],
                latent_shapes=[tuple(shapes[i]) for i in idx],
                text_lengths=[0] * len(idx),
                num_bytes=-1,
            )
        )
    return ShardIndex(shards=shards, metadata={"simulated_from_mix": mix.name, "num_samples": num_samples})


def _bucket_shares(source: Any) -> dict[tuple[int, int, int, int], float]:
    if isinstance(source, Mix):
        return {b.latent_shape: float(b.p) for b in source.buckets}
    counts: dict[tuple[int, int, int, int], int] = {}
    for s in source.shards:
        for shape in s.latent_shapes:
            counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    n = sum(counts.values())
    return {k: v / n for k, v in sorted(counts.items())}


# ----------------------------------------------------------------------------------------------------
# The result
# ----------------------------------------------------------------------------------------------------


@dataclass
class SimulationResult:
    """What :func:`simulate` found.

    Attributes:
        rows: one dict per (mode, world size): the :func:`balance_metrics` keys plus ``mode``,
            ``world_size``, ``schedule``, ``batching``, ``max_compute``, ``tokens_per_s_ratio``,
            ``samples``, ``recommended_max_compute`` and ``candidates`` (the search's table).
        per_step_cv: (mode, world size) -> per-step compute CV array, for plots.
        buckets: per bucket: latent shape, share, tokens, and per mode its batch size and batch seconds.
        meta: settings, machine, date, sources, planner and cost model used.
        notes: caveats found while simulating (extrapolated step times, small populations, ...).
    """

    rows: list[dict[str, Any]]
    per_step_cv: dict[tuple[str, int], np.ndarray]
    buckets: list[dict[str, Any]]
    meta: dict[str, Any]
    notes: list[str]

    def row(self, mode: str, world_size: int) -> dict[str, Any]:
        """The row of ``mode`` at ``world_size``; KeyError if it was not simulated."""
        for r in self.rows:
            if r["mode"] == mode and r["world_size"] == world_size:
                return r
        raise KeyError(f"no result for mode {mode!r} at world size {world_size}")

    def targets(self) -> dict[str, Any]:
        """Issue 7's targets: lockstep CV and wait <= 2% at every size; dual imbalance <= 18.9% at 16 ranks."""
        out: dict[str, Any] = {}
        lock = [r for r in self.rows if r["mode"] == "lockstep"]
        if lock:
            out["lockstep_cv_le_2pct_all_sizes"] = all(r["cv_mean"] <= _TARGET_LOCKSTEP for r in lock)
            out["lockstep_wait_le_2pct_all_sizes"] = all(r["wait_share"] <= _TARGET_LOCKSTEP for r in lock)
            out["lockstep_worst_cv_p95"] = max(r["cv_p95"] for r in lock)
        dual16 = [r for r in self.rows if r["mode"] == "dual" and r["world_size"] == 16]
        if dual16:
            out["dual_imbalance_16"] = dual16[0]["imbalance_mean"]
            out["dual_imbalance_16_le_paper_18.9pct"] = dual16[0]["imbalance_mean"] <= _PAPER_IMBALANCE_DUAL
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (NaN written as null)."""
        return _jsonable(
            {
                "meta": self.meta,
                "buckets": self.buckets,
                "results": self.rows,
                "targets": self.targets(),
                "notes": self.notes,
            }
        )

    def table(self) -> str:
        """A plain-text table: mode x world size -> CV mean/p95, imbalance, wait, tokens/s ratio, fill."""
        head = (
            f"{'mode':<22}{'ranks':>6}{'steps':>7}{'CV mean':>9}{'CV p95':>9}{'imbal':>8}{'wait':>8}"
            f"{'tok/s x':>9}{'peak tok':>10}{'tok fill':>9}{'VRAM ut':>9}{'rec. max_compute':>18}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            rec = r.get("recommended_max_compute")
            lines.append(
                f"{r['mode']:<22}{r['world_size']:>6}{r['steps']:>7}{100 * r['cv_mean']:>8.1f}%"
                f"{100 * r['cv_p95']:>8.1f}%{100 * r['imbalance_mean']:>7.1f}%{100 * r['wait_share']:>7.1f}%"
                f"{r['tokens_per_s_ratio']:>9.3f}{r['peak_tokens']:>10}{100 * r['token_fill']:>8.1f}%"
                f"{100 * r['vram_utilisation']:>8.1f}%{('-' if rec is None else f'{rec:.4g}'):>18}"
            )
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ----------------------------------------------------------------------------------------------------
# The simulation
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Replay:
    seconds: np.ndarray  # (steps, world)
    tokens: np.ndarray
    memory: np.ndarray | None
    cost: np.ndarray
    samples: int
    batch_sizes: dict[tuple[int, int, int, int], set[int]]


def _replay(plan: Any, coster: _Coster, plan_cost: CostModel) -> _Replay:
    """Turn an EpochPlan into per-(step, rank) seconds, tokens, memory and planned cost.

    Uses the plan's own step order (``plan.step_order``: the DataLoader's round robin over a rank's
    workers) and bucket table, so that what is replayed is exactly what the DataModule would yield.
    """
    world, n = plan.world_size, plan.steps
    counts = {len(order) for order in plan.step_order}
    if counts != {n}:
        raise RuntimeError(
            f"the plan gives ranks different step counts {sorted(counts)} (plan.steps={n}) at world size {world}; "
            "DDP would hang. This is a planner bug: report it with the seed and world size"
        )
    seconds = np.zeros((n, world))
    tokens = np.zeros((n, world), dtype=np.int64)
    cost = np.zeros((n, world))
    memory: np.ndarray | None = np.zeros((n, world))
    samples = 0
    sizes: dict[tuple[int, int, int, int], set[int]] = {}
    shapes = [tuple(int(v) for v in bk["shape"]) for bk in plan.buckets]
    for r in range(world):
        for k, (w, j) in enumerate(plan.step_order[r]):
            b = len(plan.streams[(r, w)][j])
            if b == 0:
                continue
            shape = shapes[plan.batch_buckets[(r, w)][j]]
            thw = (shape[1], shape[2], shape[3])
            sec, mem = coster(thw, b)
            seconds[k, r] = sec
            tok = coster.tokens(thw)
            tokens[k, r] = b * tok
            cost[k, r] = plan_cost.batch_cost(b, tok)
            if mem is None:
                memory = None
            elif memory is not None:
                memory[k, r] = mem
            samples += b
            sizes.setdefault(shape, set()).add(b)
    return _Replay(seconds, tokens, memory, cost, samples, sizes)


def _replay_packs(plan: Any, index: Any, coster: _Coster, plan_cost: CostModel) -> _Replay:
    """:func:`_replay` for a packed plan: a pack's seconds are ``c0 + sum cost(S_i)`` of the pack cost model
    (a measured table's packs are not measured: its fitted model stands in), plus the step overhead."""
    times = coster.times if isinstance(coster.times, CostModel) else coster.times.fallback
    n, world = plan.steps, plan.world_size
    seconds, cost = np.zeros((n, world)), np.zeros((n, world))
    tokens = np.zeros((n, world), dtype=np.int64)
    samples = 0
    for r in range(world):
        for k, (w, j) in enumerate(plan.step_order[r]):
            shapes = [index.shards[s].latent_shapes[i] for s, i in plan.streams[(r, w)][j]]
            toks = [coster.tokens((int(x[1]), int(x[2]), int(x[3]))) for x in shapes]
            if not toks:
                continue
            seconds[k, r] = times.pack_cost(toks) + coster.overhead_s
            tokens[k, r] = sum(toks)
            cost[k, r] = plan_cost.pack_cost(toks)
            samples += len(toks)
    return _Replay(seconds, tokens, None, cost, samples, {})


def _make_batcher(batching: str, max_tokens: int, max_compute: Any, plan_cost: CostModel, patch) -> Any:
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    if batching == "equal_tokens":
        return DualConstraintBatcher(max_tokens=max_tokens, mode="equal_tokens", patch_size=patch)
    return DualConstraintBatcher(
        max_tokens=max_tokens, max_compute=max_compute, cost_model=plan_cost, mode="dual", patch_size=patch
    )


def _run_mode(
    index: Any,
    world: int,
    mode: str,
    *,
    max_tokens: int,
    max_compute: Any,
    plan_cost: CostModel,
    coster: _Coster,
    patch,
    num_workers: int,
    seed: int,
    epoch: int,
    plan_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], np.ndarray, _Replay, Any]:
    from lightning_adaptiveload.planning.planner import plan_epoch

    schedule, batching = MODES[mode]
    batcher = _make_batcher(batching, max_tokens, max_compute, plan_cost, patch)
    plan = plan_epoch(
        index, world, num_workers, batcher, seed, epoch, mode=schedule, **dict(plan_options or {})
    )
    if plan.mode == "packed":
        rep = _replay_packs(plan, index, coster, plan_cost)
    else:
        rep = _replay(plan, coster, plan_cost)
    if rep.seconds.shape[0] == 0:
        raise ValueError(
            f"mode {mode!r} at world size {world}: the plan has no steps ({index.num_samples} samples); "
            "use more samples (min_steps_per_rank) or fewer ranks"
        )
    resolved = _resolved_max_compute(batcher, index) if batching == "dual" else None
    m = balance_metrics(
        rep.seconds,
        rep.tokens,
        rank_memory=rep.memory,
        rank_cost=rep.cost,
        max_tokens=max_tokens,
        max_compute=resolved,
    )
    m["samples"] = rep.samples
    m["max_compute"] = resolved
    # The end of an epoch (leftover partial buckets, steps split to equalise step counts, lockstep tails)
    # weighs more in a short simulated epoch than in a real one: report the first 90% of steps apart.
    body = max(1, int(0.9 * rep.seconds.shape[0]))
    head = balance_metrics(rep.seconds[:body], rep.tokens[:body])
    m["cv_mean_first90"] = head["cv_mean"]
    m["straggler_wait_first90"] = m["wait_share_first90"] = head["straggler_wait"]
    m["plan_report"] = {
        k: plan.report.get(k)
        for k in (
            "partial_batches",
            "bound_partial_batches",
            "split_batches",
            "reduced_steps",
            "unequal_steps",
            "max_buffered_samples",
            "plan_seconds",
            "fill_mean",
            "reads",
            "shard_opens_per_rank",
            "order_rank_correlation",
        )
    }
    cv, _, _ = stats.balance_rows(rep.seconds)
    return m, cv, rep, batcher


def _resolved_max_compute(batcher: Any, index: Any) -> float | None:
    value = getattr(batcher, "max_compute", None)
    if isinstance(value, int | float):
        return float(value)
    shapes = [shape for s in index.shards for shape in s.latent_shapes]
    try:
        return float(batcher.resolve_max_compute(shapes))
    except (AttributeError, TypeError):
        return None


def _candidates(
    shares: Mapping[tuple[int, int, int, int], float],
    max_tokens: int,
    plan_cost: CostModel,
    patch,
    limit: int,
    extra: Iterable[float] = (),
) -> list[float]:
    """max_compute values at which some bucket's batch size changes, thinned to ``limit``.

    Any max_compute between two consecutive break points gives the same batch sizes, so the break points
    (``b * cost(S)`` for every bucket S and every b up to ``max_tokens // S``) are the only values worth
    trying. The largest is the unconstrained (equal-token) plan.
    """
    points: set[float] = set()
    pt, ph, pw = patch
    for shape in shares:
        s = (shape[1] // pt) * (shape[2] // ph) * (shape[3] // pw)
        b_max = max_tokens // s
        c = plan_cost.cost(s)
        for b in range(1, b_max + 1):
            points.add(round(b * c, 12))
    # Below the cheapest single sample every bucket has B = 1, the same plan as at that point.
    floor = min(plan_cost.cost((sh[1] // pt) * (sh[2] // ph) * (sh[3] // pw)) for sh in shares)
    pts = sorted(v for v in points if v >= floor * (1 - 1e-12))
    if len(pts) > limit:
        # Geometric thinning keeps resolution where batches are small, where each step of B matters most.
        picks = np.unique(np.round(np.geomspace(1, len(pts), limit)).astype(int) - 1)
        pts = [pts[i] for i in picks]
    pts = sorted(set(pts) | {float(v) for v in extra if v is not None and math.isfinite(v)})
    return pts


def _default_plan_cost(times: StepTimeTable | CostModel, shares, patch, p: float | None) -> CostModel:
    """The cost model the dual batcher plans with: ``S^p`` with p given, else p fitted to the times."""
    if p is not None:
        return CostModel(kind="power", p=float(p))
    pt, ph, pw = patch
    seqs = sorted({(sh[1] // pt) * (sh[2] // ph) * (sh[3] // pw) for sh in shares})
    if isinstance(times, StepTimeTable):
        if len(set(times.points()[0])) >= 2:
            return times.fit_cost_model("power")
        # One measured length cannot fix an exponent: plan with the times' own fallback model instead.
        times = times.fallback
    if len(seqs) < 2:
        return times
    return CostModel.fit(seqs, [times.cost(s) for s in seqs], kind="power")


def simulate(
    source: str | os.PathLike | Mix | Any = "wan21_480p",
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    modes: Sequence[str] = DEFAULT_MODES,
    max_tokens: int = 32760,
    max_compute: float | str = "auto",
    times: StepTimeTable | CostModel | Mapping | str | os.PathLike | None = None,
    plan_cost_model: CostModel | Mapping | None = None,
    p: float | None = None,
    recommend: bool = True,
    max_candidates: int = 10,
    search_steps_per_rank: int = 64,
    num_workers: int = 1,
    seed: int = 0,
    epoch: int = 0,
    min_steps_per_rank: int = 200,
    shards_per_stream: int = 4,
    plan_options: Mapping[str, Any] | None = None,
    step_overhead_s: float = 0.0,
    patch_size: Sequence[int] = _DEFAULT_PATCH,
    out_dir: str | os.PathLike | None = None,
    plots: bool = True,
    progress: bool = True,
) -> SimulationResult:
    """Plan an epoch with the real planner for each mode and world size, and measure the balance.

    Args:
        source: a packaged mix name, a mix JSON path or a :class:`~lightning_adaptiveload.data.mixes.Mix`
            (a synthetic population is drawn from it at each world size), or a
            :class:`~lightning_adaptiveload.data.shards.ShardIndex` or the path of an ``index.json`` (real shards,
            planned as they are).
        world_sizes: data-parallel ranks to simulate, each in 2..1024.
        modes: names from :data:`MODES`. ``equal_tokens`` is always simulated (the reference for
            ``tokens_per_s_ratio``), even when not listed.
        max_tokens: the token budget per rank and step (the memory cap), identical in every mode.
        max_compute: the dual modes' compute budget in ``plan_cost_model`` units, ``"auto"`` (the batcher's
            documented rule) or ``"search"`` (use the recommended value, found as below).
        times: what a batch costs in seconds: a :class:`StepTimeTable` or a trace path (``.jsonl``), a
            :class:`CostModel` (or its dict / JSON file). Default: :meth:`CostModel.default` (Wan 2.1 1.3B,
            H100).
        plan_cost_model: the cost model the dual batcher plans with; default ``S^p`` with ``p`` given, or p
            fitted to ``times`` by least squares on log-log ("p fitted").
        p: exponent of the planning model ``S^p`` (ignored when ``plan_cost_model`` is given).
        recommend: search ``max_compute`` candidates (break points of the batch sizes, at most
            ``max_candidates``) for each dual mode and world size, keeping the highest tokens/s.
        search_steps_per_rank: epoch length per rank of the (mix) population the search plans, at most
            ``min_steps_per_rank``; shorter than the reported runs so that the search stays cheap.
        num_workers: DataLoader workers per rank (streams per rank in the plan).
        seed, epoch: the planner's seed and epoch.
        min_steps_per_rank: a mix population is sized so that every rank gets about this many steps in the
            ``equal_tokens`` mode (more in the others).
        shards_per_stream: virtual shards per (rank, worker) stream when drawing from a mix.
        plan_options: extra keyword arguments of :func:`~lightning_adaptiveload.planning.planner.plan_epoch`, e.g.
            ``{"max_buffered_samples": 256, "lockstep_tolerance": 0.01}``.
        step_overhead_s: fixed seconds added to every rank's step (optimizer, all-reduce), which dilutes the
            imbalance.
        patch_size: (pt, ph, pw) of the model's patch embedding.
        out_dir: when given, ``simulate.json`` and (with ``plots``) PNG plots are written there.
        plots: write PNG plots to ``out_dir``.
        progress: show a tqdm bar over (world size, mode) runs.

    Returns:
        A :class:`SimulationResult`.

    Raises:
        ValueError: bad world size, mode, budget or source; the message names the argument and value.
    """
    from lightning_adaptiveload.data.shards import ShardIndex
    from lightning_adaptiveload.planning.planner import PlanError

    patch = tuple(int(v) for v in patch_size)
    if len(patch) != 3 or min(patch) < 1:
        raise ValueError(f"patch_size must be 3 positive integers (pt, ph, pw), got {patch_size!r}")
    sizes = [int(w) for w in world_sizes]
    if not sizes or any(w < 2 or w > 1024 for w in sizes):
        raise ValueError(f"world_sizes must be integers in 2..1024, got {list(world_sizes)!r}")
    sizes = sorted(set(sizes))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    mode_list = ["equal_tokens"] + [m for m in dict.fromkeys(modes) if m != "equal_tokens"]
    if not (isinstance(max_tokens, int | np.integer) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(max_compute, str):
        if max_compute not in ("auto", "search"):
            raise ValueError(
                f"max_compute must be a positive number, 'auto' or 'search', got {max_compute!r}"
            )
    elif not (isinstance(max_compute, int | float) and max_compute > 0):
        raise ValueError(f"max_compute must be a positive number, 'auto' or 'search', got {max_compute!r}")
    if min_steps_per_rank < 1 or num_workers < 0 or shards_per_stream < 1:
        raise ValueError(
            f"min_steps_per_rank ({min_steps_per_rank}) and shards_per_stream ({shards_per_stream}) must be >= 1, "
            f"num_workers ({num_workers}) >= 0"
        )
    if step_overhead_s < 0:
        raise ValueError(f"step_overhead_s must be >= 0, got {step_overhead_s!r}")

    # -- the data --------------------------------------------------------------------------------------
    mix: Mix | None = None
    fixed_index = None
    if isinstance(source, Mix):
        mix = source
    elif isinstance(source, ShardIndex):
        fixed_index = source
    else:
        path = os.fspath(source)
        if path.endswith("index.json") or (
            os.path.isdir(path) and os.path.isfile(os.path.join(path, "index.json"))
        ):
            fixed_index = ShardIndex.load(os.path.join(path, "index.json") if os.path.isdir(path) else path)
        else:
            mix = load_mix(path)
    shares = _bucket_shares(mix if mix is not None else fixed_index)
    too_big = {sh: q for sh, q in shares.items() if _tok(sh, patch) > max_tokens}
    if too_big:
        raise ValueError(
            f"max_tokens={max_tokens}: buckets {sorted(too_big)} hold more tokens per sample "
            f"({sorted({_tok(sh, patch) for sh in too_big})}) than the budget; raise max_tokens or drop them"
        )

    time_source = _load_times(times, patch)
    if plan_cost_model is not None:
        plan_cost = CostModel.from_dict(plan_cost_model)
    else:
        plan_cost = _default_plan_cost(time_source, shares, patch, p)
    coster = _Coster(time_source, patch, step_overhead_s)
    notes: list[str] = []

    # Samples per batch under equal_tokens, the mode with the biggest batches: sizes the population.
    samples_per_batch = 1.0 / sum(q / max(1, max_tokens // _tok(sh, patch)) for sh, q in shares.items())

    streams = max(1, num_workers)
    runs = [(w, m) for w in sizes for m in mode_list]
    bar = _progress(len(runs), progress)
    rows: list[dict[str, Any]] = []
    per_step_cv: dict[tuple[str, int], np.ndarray] = {}
    bucket_b: dict[str, dict[tuple[int, int, int, int], set[int]]] = {m: {} for m in mode_list}
    started = time.perf_counter()
    for w in sizes:
        if mix is not None:
            n = int(math.ceil(w * min_steps_per_rank * samples_per_batch * 1.05))
            index = _mix_population(mix, n, w * streams * shards_per_stream, seed)
            # The search compares budgets with each other, so a shorter epoch does: it keeps the search
            # cheap at large world sizes (the reported rows use the full epoch).
            n_search = int(
                math.ceil(w * min(min_steps_per_rank, search_steps_per_rank) * samples_per_batch * 1.05)
            )
            search_index = (
                index
                if n_search >= n
                else _mix_population(mix, n_search, w * streams * shards_per_stream, seed)
            )
        else:
            index = search_index = fixed_index
            if index.num_shards < w * streams:
                notes.append(
                    f"world size {w}: the index has {index.num_shards} shards for {w * streams} streams; "
                    "some streams get no shard of their own"
                )
        base_tps = None
        for mode in mode_list:
            schedule, batching = MODES[mode]
            kwargs = dict(
                max_tokens=int(max_tokens),
                plan_cost=plan_cost,
                coster=coster,
                patch=patch,
                num_workers=num_workers,
                seed=seed,
                epoch=epoch,
                plan_options=plan_options,
            )
            search: list[dict[str, Any]] = []
            best = None
            if batching == "dual" and (recommend or max_compute == "search"):
                auto_value = None
                if max_compute == "auto" or max_compute == "search":
                    probe = _make_batcher("dual", int(max_tokens), "auto", plan_cost, patch)
                    auto_value = _resolved_max_compute(probe, search_index)
                extra = [auto_value] + ([float(max_compute)] if not isinstance(max_compute, str) else [])
                for cand in _candidates(shares, int(max_tokens), plan_cost, patch, max_candidates, extra):
                    try:
                        m, _, _, _ = _run_mode(search_index, w, mode, max_compute=cand, **kwargs)
                    except PlanError as err:
                        # Tiny budgets leave one sample per batch: ranks with fewer samples cannot match
                        # the step count. Such a budget is unusable, not an error of the simulation.
                        search.append({"max_compute": cand, "infeasible": str(err)})
                        continue
                    search.append(
                        {
                            "max_compute": cand,
                            "tokens_per_s": m["tokens_per_s"],
                            "wait_share": m["wait_share"],
                            "cv_mean": m["cv_mean"],
                            "token_fill": m["token_fill"],
                            "peak_tokens": m["peak_tokens"],
                        }
                    )
                # Highest tokens/s. Budgets within _SEARCH_TIE of the best are a tie (the simulation is not
                # that precise), won by the largest: it changes the fewest batch sizes, so it leans least on
                # step times interpolated for batch sizes the trace did not measure.
                feasible = [c for c in search if "infeasible" not in c]
                if feasible:
                    top = max(c["tokens_per_s"] for c in feasible)
                    near = [c for c in feasible if c["tokens_per_s"] >= top * (1 - _SEARCH_TIE)]
                    best = max(near, key=lambda c: c["max_compute"])
                elif max_compute == "search":
                    raise ValueError(
                        f"mode {mode!r} at {w} ranks: no max_compute candidate gives a feasible plan "
                        f"({search[0]['infeasible'] if search else 'no candidates'})"
                    )
            budget = max_compute
            if batching == "dual" and max_compute == "search":
                budget = best["max_compute"]
            m, cv, rep, _ = _run_mode(index, w, mode, max_compute=budget, **kwargs)
            if mode == "equal_tokens":
                base_tps = m["tokens_per_s"]
            m.update(
                mode=mode,
                world_size=w,
                schedule=schedule,
                batching=batching,
                tokens_per_s_ratio=m["tokens_per_s"] / base_tps if base_tps else math.nan,
                population_samples=index.num_samples,
                recommended_max_compute=None if best is None else best["max_compute"],
                recommended_tokens_per_s_ratio=None if best is None else best["tokens_per_s"] / base_tps,
                candidates=search,
            )
            if m["steps"] < min_steps_per_rank and mix is None:
                notes.append(f"{mode} at {w} ranks: only {m['steps']} steps per rank in this index")
            rows.append(m)
            per_step_cv[(mode, w)] = cv
            for shape, bs in rep.batch_sizes.items():
                bucket_b[mode].setdefault(shape, set()).update(bs)
            bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - started

    if isinstance(time_source, StepTimeTable):
        lk = time_source.lookups
        if lk.get("fallback"):
            notes.append(
                f"{lk['fallback']} (shape, batch size) pairs were for buckets missing from the trace; they used the quadratic "
                f"fit {time_source.fallback.describe()} s per sample"
            )
        if lk.get("interpolated") or lk.get("scaled"):
            notes.append(
                f"batch sizes not measured in the trace were interpolated linearly in B "
                f"({lk.get('interpolated', 0)} shape/B pairs) or scaled in proportion to B ({lk.get('scaled', 0)}); "
                "measure them (benchmarks/gpu_trace_wan13b.py takes B=1 and the equal-token B) to rely on them"
            )

    buckets = []
    for shape, share in sorted(shares.items(), key=lambda kv: (_tok(kv[0], patch), kv[0])):
        thw = (shape[1], shape[2], shape[3])
        entry: dict[str, Any] = {"latent_shape": list(shape), "share": share, "tokens": _tok(shape, patch)}
        for mode in mode_list:
            bs = sorted(bucket_b[mode].get(shape, ()))
            entry[f"batch_sizes_{mode}"] = bs
            if bs:
                entry[f"batch_seconds_{mode}"] = [coster(thw, b)[0] for b in bs]
        buckets.append(entry)

    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "source": (mix.source or mix.name) if mix is not None else (fixed_index.source or "<ShardIndex>"),
        "source_kind": "mix" if mix is not None else "index",
        "world_sizes": sizes,
        "modes": mode_list,
        "max_tokens": int(max_tokens),
        "max_compute": max_compute,
        "times": time_source.to_dict()
        if isinstance(time_source, StepTimeTable)
        else {"cost_model": time_source.to_dict()},
        "plan_cost_model": plan_cost.to_dict(),
        "num_workers": num_workers,
        "seed": seed,
        "epoch": epoch,
        "min_steps_per_rank": min_steps_per_rank,
        "shards_per_stream": shards_per_stream,
        "search_steps_per_rank": search_steps_per_rank,
        "max_candidates": max_candidates,
        "plan_options": dict(plan_options or {}),
        "step_overhead_s": step_overhead_s,
        "patch_size": list(patch),
        "elapsed_s": elapsed,
    }
    result = SimulationResult(rows=rows, per_step_cv=per_step_cv, buckets=buckets, meta=meta, notes=notes)
    if out_dir is not None:
        write_outputs(result, out_dir, plots=plots)
    return result


def _tok(shape: Sequence[int], patch: Sequence[int]) -> int:
    return (shape[1] // patch[0]) * (shape[2] // patch[1]) * (shape[3] // patch[2])


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="simulate", unit="run")


# ----------------------------------------------------------------------------------------------------
# Output: JSON and plots
# ----------------------------------------------------------------------------------------------------

_COLORS = {
    "equal_tokens": "#7f7f7f",
    "dual": "#1f77b4",
    "lockstep": "#d62728",
    "lockstep_equal_tokens": "#ff7f0e",
}
_EXTRA_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def _color(mode: str, modes: list[str]) -> str:
    if mode in _COLORS:
        return _COLORS[mode]
    extras = [m for m in modes if m not in _COLORS]
    return _EXTRA_COLORS[extras.index(mode) % len(_EXTRA_COLORS)]


def write_outputs(result: SimulationResult, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, str]:
    """Write ``simulate.json`` and the PNG plots into ``out_dir``; returns {what: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "simulate.json")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=1)
    if plots:
        paths.update(plot_result(result, out_dir))
    return paths


def plot_result(
    result: SimulationResult, out_dir: str | os.PathLike, prefix: str = "simulate_"
) -> dict[str, str]:
    """PNG plots: per-step CV distributions per mode, wait share and tokens/s ratio against world size."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in result.rows))
    sizes = sorted({r["world_size"] for r in result.rows})
    out: dict[str, str] = {}

    # 1. CV distributions: one box per mode, grouped by world size.
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(sizes) + 2), 4.8))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        data = [100 * result.per_step_cv.get((mode, w), np.zeros(1)) for w in sizes]
        pos = [k + (i - (len(modes) - 1) / 2) * width for k in range(len(sizes))]
        bp = ax.boxplot(
            data,
            positions=pos,
            widths=width * 0.85,
            patch_artist=True,
            showfliers=False,
            whis=(5, 95),
            showmeans=True,
            medianprops={"color": "black"},
            meanprops={
                "marker": "D",
                "markerfacecolor": "white",
                "markeredgecolor": "black",
                "markersize": 4,
            },
        )
        for box in bp["boxes"]:
            box.set_facecolor(_color(mode, modes))
            box.set_alpha(0.75)
        ax.plot([], [], color=_color(mode, modes), lw=8, alpha=0.75, label=_legend(mode))
    ax.axhline(100 * _TARGET_LOCKSTEP, color="k", ls=":", lw=1, label="2% target")
    ax.set_xticks(range(len(sizes)), [str(w) for w in sizes])
    ax.set_xlabel("ranks (data-parallel world size)")
    ax.set_ylabel("compute CV across ranks per step (%)")
    # Two lines: on one, the title is wider than the figure and is cut off.
    ax.set_title(
        "Per-step compute CV across ranks\n(box p25-p75, whiskers p5-p95, diamond: mean)", fontsize=10
    )
    # Below the axes: the boxes of the small world sizes reach the top.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(4, len(modes) + 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out["cv_png"] = os.path.join(out_dir, f"{prefix}cv.png")
    fig.savefig(out["cv_png"], dpi=110)
    plt.close(fig)

    # 2 and 3. Wait share and tokens/s ratio against world size.
    for key, ylabel, title, fname, scale in (
        (
            "wait_share",
            "straggler wait (% of step time)",
            "Time spent waiting for the slowest rank",
            "wait",
            100,
        ),
        (
            "tokens_per_s_ratio",
            "tokens/s relative to equal_tokens",
            "Throughput at the same max_tokens",
            "throughput",
            1,
        ),
    ):
        fig, ax = plt.subplots(figsize=(6.0, 4.0))
        for mode in modes:
            ys = [scale * result.row(mode, w)[key] for w in sizes]
            ax.plot(sizes, ys, marker="o", color=_color(mode, modes), label=_legend(mode))
        if key == "wait_share":
            ax.axhline(100 * _TARGET_LOCKSTEP, color="k", ls=":", lw=1, label="2% target")
        else:
            ax.axhline(1.0, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(w) for w in sizes])
        ax.set_xlabel("ranks (data-parallel world size)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out[f"{fname}_png"] = os.path.join(out_dir, f"{prefix}{fname}.png")
        fig.savefig(out[f"{fname}_png"], dpi=110)
        plt.close(fig)
    return out


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def _int_list_arg(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budget_arg(text: str) -> float | str:
    if text in ("auto", "search"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'search', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"max_compute must be positive, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-adaptiveload simulate",
        description=(
            "Plan one epoch with the real planner for each batching mode and world size, replay per-rank step "
            "times and report the compute CV, straggler wait, tokens/s, memory fill and a recommended max_compute."
        ),
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--mix", default=None, help="packaged mix name or mix JSON path (default: wan21_480p)")
    src.add_argument("--index", default=None, help="index.json of real shards (or its folder)")
    ap.add_argument(
        "--times",
        default=None,
        help="per-bucket step times (JSONL trace with T,H,W,B,ms) or a cost-model JSON; default: the built-in "
        "Wan 2.1 1.3B H100 fit",
    )
    ap.add_argument(
        "--world-sizes", type=_int_list_arg, default=list(DEFAULT_WORLD_SIZES), help="e.g. 2,8,16,64"
    )
    ap.add_argument(
        "--modes",
        default=None,
        help="batcher modes, comma-separated, from dual,equal_tokens (default with --schedules: both; with "
        f"neither flag: the configurations {','.join(DEFAULT_MODES)}). Deprecated: the configuration names "
        f"{','.join(n for n in MODES if n not in _BATCHER_MODES)} here still work",
    )
    ap.add_argument(
        "--schedules",
        default=None,
        help="schedules, comma-separated, from independent,lockstep,packed (default with --modes: "
        "independent); "
        "every schedule is simulated with every mode",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=32760, help="token budget per rank and step (memory cap)"
    )
    ap.add_argument("--max-compute", type=_budget_arg, default="auto", help="number, 'auto' or 'search'")
    ap.add_argument(
        "--p", type=float, default=None, help="planning exponent of S^p (default: fitted to --times)"
    )
    ap.add_argument("--no-recommend", action="store_true", help="skip the max_compute search")
    ap.add_argument("--candidates", type=int, default=10, help="max_compute candidates in the search")
    ap.add_argument(
        "--search-steps-per-rank", type=int, default=64, help="epoch length per rank in the search"
    )
    ap.add_argument(
        "--num-workers", type=int, default=1, help="DataLoader workers per rank the plan is made for"
    )
    ap.add_argument("--seed", type=int, default=0, help="shard-order seed of the planner")
    ap.add_argument("--epoch", type=int, default=0, help="epoch number to plan (with the seed)")
    ap.add_argument("--min-steps-per-rank", type=int, default=200, help="simulated epoch length per rank")
    ap.add_argument(
        "--max-buffered-samples",
        type=int,
        default=None,
        help="planner's per-stream buffer bound (default: its own)",
    )
    ap.add_argument(
        "--lockstep-tolerance",
        type=float,
        default=None,
        help="planner's lockstep cost tolerance (default: its own)",
    )
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed ms added to every step")
    ap.add_argument(
        "--patch-size",
        type=int,
        nargs=3,
        default=list(_DEFAULT_PATCH),
        metavar=("PT", "PH", "PW"),
        help="the model's patch size, for the token counts (default: 1 2 2)",
    )
    ap.add_argument("--out", default="simulate_out", help="folder for simulate.json and PNG plots")
    ap.add_argument("--no-plots", action="store_true", help="write simulate.json only")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


_BATCHER_MODES = ("dual", "equal_tokens")


def _legend(name: str) -> str:
    """A configuration's name with its schedule and mode, for plot legends."""
    return f"{name} ({MODES[name][0]}, {MODES[name][1]})" if name in MODES else name


def _configurations(modes: str | None, schedules: str | None) -> list[str]:
    """The configuration names (keys of :data:`MODES`) for the ``--modes`` and ``--schedules`` flags."""
    if modes is None and schedules is None:
        return list(DEFAULT_MODES)
    mode_list = [m for m in (modes or ",".join(_BATCHER_MODES)).split(",") if m]
    legacy = [m for m in mode_list if m not in _BATCHER_MODES]
    if legacy and schedules is None and all(m in MODES for m in legacy):
        print(
            f"note: --modes {','.join(legacy)} names schedule+mode configurations; this spelling is deprecated: "
            "use --schedules independent,lockstep --modes dual,equal_tokens",
            file=sys.stderr,
        )
        return mode_list
    schedule_list = [x for x in (schedules or "independent").split(",") if x]
    for value, valid, flag in (
        (mode_list, _BATCHER_MODES, "--modes"),
        (schedule_list, _SCHEDULE_NAMES, "--schedules"),
    ):
        bad = [v for v in value if v not in valid]
        if bad:
            raise ValueError(f"{flag} {','.join(bad)}: not one of {','.join(valid)}")
    by_pair = {pair: name for name, pair in MODES.items()}
    return [by_pair[(sch, m)] for sch in schedule_list for m in mode_list]


_SCHEDULE_NAMES = ("independent", "lockstep", "packed")


def _describe(names: Sequence[str], times: Any) -> list[str]:
    """What the output's configuration names mean, and where the step times come from."""
    lines = [
        "configurations: "
        + "; ".join(f"{n} = schedule {MODES[n][0]}, mode {MODES[n][1]}" for n in names if n in MODES)
    ]
    if times is None:
        lines.append(
            "step times: the built-in cost model (CostModel.default(), a fit of Wan 2.1 1.3B on one H100), not "
            "a measured trace; pass --times TRACE.jsonl for measured per-bucket times"
        )
    else:
        kind = "measured trace" if str(times).endswith((".jsonl", ".txt")) else "cost model"
        lines.append(f"step times: {kind} {times}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_adaptiveload simulate [options]``; ``argv`` excludes the word ``simulate``.

    Prints the table, writes ``simulate.json`` and PNGs to ``--out``; returns 0, or 2 on bad input.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    source = args.index if args.index is not None else (args.mix or "wan21_480p")
    try:
        names = _configurations(args.modes, args.schedules)
        for line in _describe(names, args.times):
            print(line)
        result = simulate(
            source,
            world_sizes=args.world_sizes,
            modes=names,
            max_tokens=args.max_tokens,
            max_compute=args.max_compute,
            times=args.times,
            p=args.p,
            recommend=not args.no_recommend,
            max_candidates=args.candidates,
            search_steps_per_rank=args.search_steps_per_rank,
            num_workers=args.num_workers,
            seed=args.seed,
            epoch=args.epoch,
            min_steps_per_rank=args.min_steps_per_rank,
            plan_options={
                k: v
                for k, v in (
                    ("max_buffered_samples", args.max_buffered_samples),
                    ("lockstep_tolerance", args.lockstep_tolerance),
                )
                if v is not None
            },
            step_overhead_s=args.step_overhead_ms / 1e3,
            patch_size=args.patch_size,
            out_dir=args.out,
            plots=not args.no_plots,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.table())
    for key, value in result.targets().items():
        print(f"  {key}: {value if not isinstance(value, float) else f'{100 * value:.2f}%'}")
    for note in result.notes:
        print(f"  note: {note}")
    print(f"wrote {os.path.join(args.out, 'simulate.json')}" + ("" if args.no_plots else " and PNG plots"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

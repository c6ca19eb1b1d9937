"""What a batch costs in the simulator: step times measured per bucket, or a cost model.

Owns :class:`StepTimeTable` (step times of a GPU trace or of a LoadBalanceMonitor run, interpolated in the
batch size), :func:`load_times` (the simulator's ``times`` argument resolved to a table or a cost model) and
:class:`BatchCoster` (the seconds and memory of a batch, cached). Plain Python and numpy.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import tokens_per_sample

__all__ = ["DEFAULT_PATCH", "StepTimeTable", "BatchCoster", "load_times"]

_THW = tuple[int, int, int]
DEFAULT_PATCH = (1, 2, 2)


#: The largest T, H, W or B a trace line may give (a latent of 2^31 frames is not a measurement).
_MAX_DIM = 1 << 31


def _whole(value: Any) -> int:
    """A trace's whole number: an int, or a float with no fraction (``4.0``); bool, strings and the rest are
    refused (``TypeError``/``ValueError``/``OverflowError`` for the caller to name the line)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{type(value).__name__} {value!r:.40} is not a number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    out = int(value)  # OverflowError for inf
    if abs(out) > _MAX_DIM:
        raise OverflowError(f"{value!r:.40} is larger than {_MAX_DIM}")
    return out


@dataclass
class StepTimeTable:
    """Measured time of one training step per bucket and batch size, e.g. from a GPU trace.

    A step's time at a batch size that was not measured is interpolated linearly in B between the two
    nearest measured batch sizes (extrapolated from the two nearest outside them); with one measured B,
    it is scaled in proportion to B. A bucket missing from the table falls back to :attr:`fallback` (a
    quadratic cost model fitted to the table's per-sample times, times B). Both cases are counted in
    :attr:`lookups` so that the result can say how much of it rests on measurements. Peak memory, where
    the trace has it, follows :meth:`batch_peak_gb`. A pack of mixed shapes is not a bucket: the simulator
    prices it with :attr:`pack_cost_model` (``c0 + sum cost(S_i)``).

    Attributes:
        seconds: (T, H, W) of the latent -> {batch size: seconds of forward + backward}.
        peak_gb: (T, H, W) -> {batch size: peak allocated GiB}, where the trace has it.
        source: where the numbers came from (file path or a description).
        patch_size: (pt, ph, pw) used to count tokens for the fallback fit.
        lookups: counts of ``"measured"``, ``"interpolated"``, ``"scaled"`` and ``"fallback"`` lookups.
        pack_model: the pack cost model (seconds) that prices packs, e.g. fitted to measured packs
            (:meth:`CostModel.fit_packs`) or from ``calibrate``; None: the per-sample :attr:`fallback`.
        skipped_packs: rows of a monitor CSV left out because they were packs of mixed lengths.
    """

    seconds: dict[_THW, dict[int, float]]
    peak_gb: dict[_THW, dict[int, float]] = field(default_factory=dict)
    source: str = ""
    patch_size: tuple[int, int, int] = DEFAULT_PATCH
    lookups: dict[str, int] = field(default_factory=dict)
    pack_model: CostModel | None = None
    skipped_packs: int = 0
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
    def from_jsonl(cls, path: str | os.PathLike, patch_size: Sequence[int] = DEFAULT_PATCH) -> StepTimeTable:
        """Read a trace: one JSON object per line with ``T, H, W, B`` and ``ms`` (``peak_gb`` optional).

        Lines that do not start with ``{`` (comments, fit summaries) are skipped. Repeated (T, H, W, B)
        entries are averaged.

        Raises:
            FileNotFoundError: no such file.
            ValueError: a JSON line that does not parse or lacks a key; the message names file, line and key.
        """
        from lightning_adaptiveload.shards.textfile import iter_lines

        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"step time trace {path!r}: no such file; pass the JSONL a GPU trace wrote"
            )
        sums: dict[tuple[_THW, int], list[float]] = {}
        mems: dict[tuple[_THW, int], list[float]] = {}
        # A regular file, bounded in bytes and line length, UTF-8 (errors name the file and the line).
        for lineno, line in iter_lines(path, what=f"step time trace {path}"):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as err:
                raise ValueError(f"step time trace {path}: line {lineno} is not valid JSON ({err})") from None
            if not isinstance(rec, dict):
                raise ValueError(
                    f"step time trace {path}: line {lineno} is a JSON {type(rec).__name__}, not an object "
                    "with T, H, W, B and ms"
                )
            for key in ("T", "H", "W", "B", "ms"):
                if key not in rec:
                    raise ValueError(
                        f"step time trace {path}: line {lineno} lacks key {key!r}; each line needs "
                        "T, H, W, B and ms"
                    )
            try:
                thw = (_whole(rec["T"]), _whole(rec["H"]), _whole(rec["W"]))
                b = _whole(rec["B"])
                ms = float(rec["ms"])
                peak = None if rec.get("peak_gb") is None else float(rec["peak_gb"])
            except (TypeError, ValueError, OverflowError) as err:
                raise ValueError(
                    f"step time trace {path}: line {lineno}: T, H, W, B must be whole numbers and ms, peak_gb "
                    f"numbers ({type(err).__name__}: {err}); got T={rec['T']!r}, H={rec['H']!r}, "
                    f"W={rec['W']!r}, B={rec['B']!r}, ms={rec['ms']!r}"[:600]
                ) from None
            if b < 1 or min(thw) < 1 or not (math.isfinite(ms) and ms > 0):
                raise ValueError(
                    f"step time trace {path}: line {lineno}: T, H, W = {list(thw)}, B={rec['B']!r}, "
                    f"ms={rec['ms']!r}; T, H, W and B must be >= 1 and ms positive"
                )
            if peak is not None and not (math.isfinite(peak) and peak >= 0):
                raise ValueError(
                    f"step time trace {path}: line {lineno}: peak_gb={rec['peak_gb']!r}; must be a finite "
                    "number >= 0 or absent"
                )
            sums.setdefault((thw, b), []).append(ms / 1e3)
            if peak is not None:
                mems.setdefault((thw, b), []).append(peak)
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
        patch_size: Sequence[int] = DEFAULT_PATCH,
        warmup_steps: int = 5,
        exclude: Mapping[str, Collection[int]] | None = None,
    ) -> StepTimeTable:
        """Per-bucket step times measured in a real run, from LoadBalanceMonitor's ``load_balance_ranks.csv``.

        Each row is one rank's step: its own compute time (``compute_time_s``, waiting excluded), tokens per
        sample (``seq_len``) and batch size. The median over rows of each (seq_len, B) becomes the entry
        of every latent shape in ``latent_shapes`` with that many tokens (the CSV does not record T, H, W;
        shapes with equal token counts cost the same). Steps during which FLOPs were counted, the first
        ``warmup_steps`` steps of each file and rows without a time are left out, and so are packs of mixed
        lengths (``num_tokens != seq_len * batch_size``, where the CSV has ``num_tokens``): their
        ``seq_len`` is the longest sample's and their ``batch_size`` the sample count, which are not a
        bucket's; price them with :attr:`pack_model` (counted in :attr:`skipped_packs`).

        Args:
            paths: one or more CSV files (e.g. the runs of several configurations, for more (S, B) pairs).
            latent_shapes: the data set's latent shapes (C, T, H, W), e.g. a mix's buckets.
            patch_size: (pt, ph, pw) of the model.
            warmup_steps: leading steps of each file to leave out (compilation, allocator warm-up).
            exclude: per file (its path as given in ``paths``), the ``batch_idx`` values to leave out as well
                (e.g. steps that stalled for reasons the monitor did not flag).

        Raises:
            FileNotFoundError: a path does not exist.
            ValueError: a file lacks a column, or no usable row is left.
        """
        import csv

        patch = tuple(int(v) for v in patch_size)
        files = [os.fspath(paths)] if isinstance(paths, str | os.PathLike) else [os.fspath(p) for p in paths]
        by_key: dict[tuple[int, int], list[float]] = {}
        mem: dict[tuple[int, int], list[float]] = {}
        skipped = 0
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
            skip = {int(v) for v in (exclude or {}).get(path, ())}
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
                if step < first + warmup_steps or step in skip or r.get("flops_counted") in ("1", "1.0"):
                    continue
                if not sec > 0:
                    continue
                if r.get("num_tokens") not in (None, "") and int(float(r["num_tokens"])) != s_len * b:
                    skipped += 1  # a pack of mixed lengths: not a bucket of (seq_len, batch_size)
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
            tokens = tokens_per_sample(thw, patch)
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
        return cls(
            seconds=seconds, peak_gb=peak_gb, source=";".join(files), patch_size=patch, skipped_packs=skipped
        )

    def _tokens(self, thw: _THW) -> int:
        return tokens_per_sample(thw, self.patch_size)

    @property
    def fallback(self) -> CostModel:
        """Quadratic cost model (seconds per sample) fitted to every measured point, for missing buckets.

        Its per-sample constant is fitted where it comes out >= 0; a negative one (a tangent to long
        samples only) would price a short missing bucket, say images when only clips were measured, below
        zero, so the fit is then made without it."""
        if self._fallback is None:
            s, y, b = self.points()
            fit = CostModel.fit(s, y, kind="quadratic", batch_sizes=b, fit_gamma=len(set(s)) >= 3)
            if fit.gamma < 0:
                fit = CostModel.fit(s, y, kind="quadratic", batch_sizes=b, fit_gamma=False)
            self._fallback = fit
        return self._fallback

    @property
    def pack_cost_model(self) -> CostModel:
        """The model that prices a pack: :attr:`pack_model` when given, else :attr:`fallback`."""
        return self.pack_model if self.pack_model is not None else self.fallback

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

    def lookup_notes(self) -> list[str]:
        """Notes on how many lookups were interpolated, scaled or fitted rather than measured."""
        notes = []
        lk = self.lookups
        if lk.get("fallback"):
            notes.append(
                f"{lk['fallback']} (shape, batch size) pairs were for buckets missing from the trace; they used the "
                f"quadratic fit {self.fallback.describe()} s per sample"
            )
        if lk.get("pack"):
            how = (
                f"the pack cost model {self.pack_model.describe()} s"
                if self.pack_model is not None
                else f"the per-sample fit {self.fallback.describe()} s (no pack model given)"
            )
            notes.append(f"{lk['pack']} packs were priced by {how}")
        if lk.get("interpolated") or lk.get("scaled"):
            notes.append(
                f"batch sizes not measured in the trace were interpolated linearly in B "
                f"({lk.get('interpolated', 0)} shape/B pairs) or scaled in proportion to B ({lk.get('scaled', 0)}); "
                "measure them (benchmarks/balance/gpu_trace_wan13b.py takes B=1 and the equal-token B) to rely on them"
            )
        return notes

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
            "pack_model": None if self.pack_model is None else self.pack_model.to_dict(),
            "skipped_packs": self.skipped_packs,
        }


def load_times(times: StepTimeTable | CostModel | Mapping | str | os.PathLike | None, patch) -> Any:
    """Resolve the ``times`` argument of :func:`~lightning_adaptiveload.tools.simulate.simulate`.

    Args:
        times: a StepTimeTable or CostModel (returned as is), a cost model's dict, a trace path
            (``.jsonl``/``.txt``), a cost-model JSON path, or None for :meth:`CostModel.default`.
        patch: (pt, ph, pw) of the model, for a trace's token counts.

    Returns:
        A :class:`StepTimeTable` or a :class:`CostModel`.
    """
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


class BatchCoster:
    """Seconds (and memory) of a batch of B latents of one shape, cached per (shape, B)."""

    def __init__(
        self, times: StepTimeTable | CostModel, patch: tuple[int, int, int], overhead_s: float
    ) -> None:
        self.times = times
        self.patch = patch
        self.overhead_s = float(overhead_s)
        self._cache: dict[tuple[_THW, int], tuple[float, float | None]] = {}

    def tokens(self, thw: _THW) -> int:
        return tokens_per_sample(thw, self.patch)

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

"""Is a multi-GPU run's rank-to-rank noise coming from power-capped clocks? Summarizes an ``nvidia-smi`` log
of every GPU's clocks, power and clock event reasons, taken while the run trained.

The log (plain or ``.gz``) is what this writes, every 250 ms (``gpu_ddp_modes_x4.sh`` with ``CLOCKS=1``)::

    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,\\
clocks_event_reasons.active --format=csv -lms 250 > gpu_clocks.csv

The reasons column may be missing (older drivers reject the field; ``clocks_throttle_reasons.active`` is
its old name), values may be ``[N/A]``, and blank or garbled lines (a logger killed mid-line) are counted
and reported, not fatal. Per GPU, over its *busy* samples (``utilization.gpu >= --busy``, default 90%):
the SM clock's mean, std (population; as a share of the mean in the verdict), min, p5, p50 and max; the
share of busy samples at the highest SM clock seen anywhere in the file; power mean and max; temperature
min and max; the share of busy samples with each clock event reason bit set (over the samples whose
reasons are known); and a one-line verdict. ``--limits`` reads the output of
``nvidia-smi --query-gpu=power.limit,clocks.max.sm,clocks.applications.graphics --format=csv`` (one row per
GPU, in index order) to give power as a share of the limit and clocks as a share of the maximum (without
it, "of max" is of the highest SM clock in the file). CPU only; nothing here times anything.

    python benchmarks/balance/gpu_clocks_summary.py gpu_clocks.csv.gz [--limits gpu_limits.txt] [--busy 90]
        [--json summary.json] [--plot clocks.png]

Exit codes: 0 done; 2 a missing, empty or unreadable input file (the message names it).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import write_json  # noqa: E402

from lightning_adaptiveload.monitor.report import jsonable  # noqa: E402

# NVML's clocks event reasons (nvmlClocksEventReason*), bit -> name.
REASONS: dict[int, str] = {
    0x1: "GPU idle",
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
    0x100: "display clock setting",
}
POWER_CAP = 0x4
# Reasons that slow a busy GPU down besides the SW power cap; each gets a clause in the verdict when seen.
SLOWDOWNS = (0x8, 0x20, 0x40, 0x80)

# Column names as nvidia-smi writes them (units in brackets removed), and their older spellings -> our key.
COLUMNS: dict[str, str] = {
    "timestamp": "timestamp",
    "index": "index",
    "clocks.sm": "sm",
    "clocks.current.sm": "sm",
    "clocks.mem": "mem",
    "clocks.current.memory": "mem",
    "clocks.memory": "mem",
    "power.draw": "power",
    "power.draw.instant": "power",
    "power.draw.average": "power",
    "temperature.gpu": "temp",
    "utilization.gpu": "util",
    "clocks_event_reasons.active": "reasons",
    "clocks_throttle_reasons.active": "reasons",
    "clocks.event_reasons.active": "reasons",
    "clocks.throttle_reasons.active": "reasons",
}
REQUIRED = ("index", "sm", "util")
NUMERIC = ("sm", "mem", "power", "temp", "util")
LIMIT_COLUMNS: dict[str, str] = {
    "index": "index",
    "power.limit": "power_limit_w",
    "enforced.power.limit": "power_limit_w",
    "clocks.max.sm": "max_sm_mhz",
    "clocks.max.graphics": "max_sm_mhz",
    "clocks.applications.graphics": "app_clock_mhz",
}
TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S")
NA = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "unknown error", ""}


class InputError(Exception):
    """An input file that cannot be summarized (missing, empty, no usable header); the message names it."""


@dataclass
class GpuLog:
    """One GPU's samples in file order: seconds since the file's first timestamp (NaN when not logged), the
    numeric columns (NaN for ``[N/A]`` or not logged) and the reasons bitmask (-1 when unknown)."""

    t: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in NUMERIC})
    reasons: list[int] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {k: np.asarray(v, dtype=float) for k, v in self.values.items()}
        out["t"] = np.asarray(self.t, dtype=float)
        out["reasons"] = np.asarray(self.reasons, dtype=np.int64)
        return out


@dataclass
class ClockLog:
    """A parsed log: per GPU index its samples, and what the parser met on the way."""

    path: str
    columns: list[str]
    has_reasons: bool
    gpus: dict[int, GpuLog]
    start: str | None = None
    lines: int = 0
    blank: int = 0
    garbled: int = 0
    garbled_examples: list[str] = field(default_factory=list)
    na: dict[str, int] = field(default_factory=dict)
    truncated: bool = False


def column_key(name: str) -> str:
    """``'clocks.current.sm [MHz]'`` -> ``'clocks.current.sm'``: a header cell without its unit, lower case."""
    return name.split("[", 1)[0].strip().lower()


def read_lines(path: str) -> tuple[list[str], bool]:
    """The file's lines (gzip recognised by its magic bytes, not its name), and whether a compressed file
    ended early (the lines read before the damage are kept)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    lines: list[str] = []
    raw = gzip.open(path, "rb") if gz else open(path, "rb")
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as f:
        try:
            for line in f:
                lines.append(line.rstrip("\r\n"))
        except (EOFError, OSError):
            return lines, True
    return lines, False


def parse_value(text: str) -> float:
    """``'345 MHz'`` -> 345.0, ``'82.08 W'`` -> 82.08, ``'0 %'`` -> 0.0, ``'[N/A]'`` -> NaN; ValueError else."""
    s = text.strip()
    if s.lower() in NA:
        return math.nan
    return float(s.split()[0])


def parse_reasons(text: str) -> int:
    """``'0x0000000000000004'`` -> 4; ``[N/A]`` -> -1; ValueError else."""
    s = text.strip()
    if s.lower() in NA:
        return -1
    return int(s, 16) if s.lower().startswith("0x") else int(s)


def parse_time(text: str) -> datetime:
    s = text.strip()
    for fmt in TIME_FORMATS:
        try:
            return datetime.strptime(s, fmt)
        except ValueError:
            pass
    raise ValueError(f"not a timestamp: {s!r}")


def parse_log(path: str) -> ClockLog:
    """Reads an ``nvidia-smi --format=csv`` log. Raises :class:`InputError` for a missing or empty file, or a
    header without the index, SM clock and utilization columns."""
    lines, truncated = read_lines(path)
    body = iter(enumerate(lines))
    header = None
    for _, line in body:
        if line.strip():
            header = next(csv.reader([line], skipinitialspace=True))
            break
    if header is None:
        raise InputError(f"{path}: empty file (no header line)")
    names = [column_key(c) for c in header]
    keys = [COLUMNS.get(n) for n in names]
    missing = [k for k in REQUIRED if k not in keys]
    if missing:
        raise InputError(
            f"{path}: the header names no {', '.join(missing)} column (header: {','.join(names)})"
        )
    log = ClockLog(path=path, columns=names, has_reasons="reasons" in keys, gpus={}, truncated=truncated)
    t0: datetime | None = None
    for _, line in body:
        log.lines += 1
        if not line.strip():
            log.blank += 1
            continue
        cells = next(csv.reader([line], skipinitialspace=True))
        try:
            row = _parse_row(cells, keys)
        except (ValueError, IndexError):
            log.garbled += 1
            if len(log.garbled_examples) < 3:
                log.garbled_examples.append(line[:120])
            continue
        stamp = row.pop("timestamp", None)
        if stamp is not None and t0 is None:
            t0 = stamp
            log.start = stamp.isoformat(sep=" ", timespec="milliseconds")
        gpu = log.gpus.setdefault(int(row.pop("index")), GpuLog())
        gpu.t.append((stamp - t0).total_seconds() if stamp is not None and t0 is not None else math.nan)
        for k in NUMERIC:
            v = row.get(k, math.nan)
            gpu.values[k].append(v)
            if k in row and math.isnan(v):
                log.na[k] = log.na.get(k, 0) + 1
        r = int(row.get("reasons", -1))
        if log.has_reasons and r < 0:
            log.na["reasons"] = log.na.get("reasons", 0) + 1
        gpu.reasons.append(r)
    if not log.gpus:
        raise InputError(f"{path}: no samples (a header and {log.lines} line(s), none readable)")
    return log


def _parse_row(cells: list[str], keys: list[str | None]) -> dict:
    """One data line's cells -> {key: value}; ValueError when it does not have the header's shape."""
    if len(cells) != len(keys):
        raise ValueError(f"{len(cells)} fields, the header has {len(keys)}")
    row: dict = {}
    for key, cell in zip(keys, cells):
        if key is None:
            continue
        if key == "timestamp":
            row[key] = parse_time(cell)
        elif key == "index":
            row[key] = int(cell.strip())
        elif key == "reasons":
            row[key] = parse_reasons(cell)
        else:
            row[key] = parse_value(cell)
    return row


def parse_limits(path: str) -> dict[int, dict[str, float]]:
    """GPU index -> ``power_limit_w``, ``max_sm_mhz``, ``app_clock_mhz`` (those present) from
    ``nvidia-smi --query-gpu=power.limit,clocks.max.sm,clocks.applications.graphics --format=csv``: rows in
    index order unless an index column says otherwise."""
    lines, _ = read_lines(path)
    rows = [next(csv.reader([ln], skipinitialspace=True)) for ln in lines if ln.strip()]
    if not rows:
        raise InputError(f"{path}: empty file (no header line)")
    keys = [LIMIT_COLUMNS.get(column_key(c)) for c in rows[0]]
    if not any(k not in (None, "index") for k in keys):
        raise InputError(f"{path}: the header names none of {', '.join(sorted(LIMIT_COLUMNS))}")
    out: dict[int, dict[str, float]] = {}
    for n, cells in enumerate(rows[1:]):
        if len(cells) != len(keys):
            continue
        entry: dict[str, float] = {}
        index = n
        for key, cell in zip(keys, cells):
            try:
                if key == "index":
                    index = int(cell.strip())
                elif key is not None:
                    entry[key] = parse_value(cell)
            except ValueError:
                entry[key] = math.nan
        out[index] = entry
    if not out:
        raise InputError(f"{path}: a header but no GPU rows")
    return out


def _share(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if mask.size else None


def reason_shares(reasons: np.ndarray) -> dict[str, float | None]:
    """Share of the samples (those with known reasons) with each named bit set, ``none`` (no bit: full
    clocks) and ``other bits`` (bits NVML does not name here)."""
    known = reasons[reasons >= 0]
    out: dict[str, float | None] = {name: _share((known & bit) != 0) for bit, name in REASONS.items()}
    out["none"] = _share(known == 0)
    unnamed = ~np.int64(sum(REASONS))
    out["other bits"] = _share((known & unnamed) != 0)
    return out


def _stat(x: np.ndarray, fn) -> float | None:
    return float(fn(x)) if x.size else None


def gpu_stats(
    arrays: dict[str, np.ndarray],
    busy: float,
    file_max_sm: float,
    limits: dict[str, float] | None = None,
    has_reasons: bool = True,
) -> dict:
    """One GPU's figures over its busy samples (utilization >= ``busy``); a sample whose value is N/A is left
    out of that value's figures only. ``file_max_sm``: the highest SM clock in the whole file."""
    util = arrays["util"]
    is_busy = np.nan_to_num(util, nan=-1.0) >= busy
    sm = arrays["sm"][is_busy]
    sm = sm[np.isfinite(sm)]
    power = arrays["power"][is_busy]
    power = power[np.isfinite(power)]
    temp = arrays["temp"][is_busy]
    temp = temp[np.isfinite(temp)]
    mean = _stat(sm, np.mean)
    std = _stat(sm, np.std)
    out: dict = {
        "samples": int(util.size),
        "busy_samples": int(is_busy.sum()),
        "busy_share": _share(is_busy),
        "sm_mhz": {
            "mean": mean,
            "std": std,
            "std_share": std / mean if mean else None,
            "min": _stat(sm, np.min),
            "p5": _stat(sm, lambda x: np.percentile(x, 5)),
            "p50": _stat(sm, np.median),
            "max": _stat(sm, np.max),
        },
        "at_file_max_sm": _share(sm == file_max_sm) if sm.size else None,
        "power_w": {"mean": _stat(power, np.mean), "max": _stat(power, np.max)},
        "temperature_c": {"min": _stat(temp, np.min), "max": _stat(temp, np.max)},
        "reasons": reason_shares(arrays["reasons"][is_busy]) if has_reasons else None,
        "reasons_known": int((arrays["reasons"][is_busy] >= 0).sum()) if has_reasons else 0,
    }
    limits = limits or {}
    max_sm = limits.get("max_sm_mhz")
    if max_sm is not None and math.isfinite(max_sm) and max_sm > 0:
        out["max_sm_mhz"], out["max_sm_source"] = max_sm, "limits"
    else:
        out["max_sm_mhz"], out["max_sm_source"] = file_max_sm, "file"
    out["sm_mean_share_of_max"] = mean / out["max_sm_mhz"] if mean is not None else None
    limit = limits.get("power_limit_w")
    if limit is not None and math.isfinite(limit) and limit > 0:
        out["power_limit_w"] = limit
        out["power_share_of_limit"] = {
            k: (v / limit if v is not None else None) for k, v in out["power_w"].items()
        }
    return out


def verdict(s: dict, busy: float) -> str:
    """One line: how often the busy GPU was power-capped, and what its SM clock did."""
    if not s["busy_samples"]:
        return f"no busy samples (utilization >= {busy:g}%)"
    parts = []
    shares = s["reasons"]
    if shares is None:
        parts.append("clock event reasons not logged")
    elif not s["reasons_known"]:
        parts.append("clock event reasons all [N/A]")
    else:
        cap = shares[REASONS[POWER_CAP]] or 0.0
        parts.append(
            f"power-capped in {_pct(cap)} of busy samples" if cap else "never power-capped when busy"
        )
    sm = s["sm_mhz"]
    if sm["mean"] is not None:
        of = "of max" if s["max_sm_source"] == "limits" else "of the file's max"
        parts.append(
            f"SM clock {sm['mean']:.0f} MHz mean ({_pct(s['sm_mean_share_of_max'])} {of}), std {sm['std_share']:.1%}"
        )
    if "power_limit_w" in s and s["power_w"]["mean"] is not None:
        parts.append(
            f"power {s['power_w']['mean']:.0f} W mean ({_pct(s['power_share_of_limit']['mean'])} of limit)"
        )
    for bit in SLOWDOWNS:
        v = (shares or {}).get(REASONS[bit])
        if v:
            parts.append(f"{REASONS[bit]} in {_pct(v)}")
    return "; ".join(parts)


def across_gpus(stats: dict[int, dict]) -> str | None:
    """One line comparing the GPUs' busy mean SM clocks (a steady gap between ranks is a straggler of its
    own, beside each GPU's own spread)."""
    means = {g: s["sm_mhz"]["mean"] for g, s in stats.items() if s["sm_mhz"]["mean"] is not None}
    if len(means) < 2:
        return None
    lo, hi = min(means, key=means.get), max(means, key=means.get)
    gap = means[hi] / means[lo] - 1
    stds = [s["sm_mhz"]["std_share"] for s in stats.values() if s["sm_mhz"]["std_share"] is not None]
    return (
        f"across GPUs: busy mean SM clock {means[lo]:.0f} MHz (GPU {lo}) to {means[hi]:.0f} MHz (GPU {hi}), "
        f"a {gap:.1%} gap; within each GPU, std {min(stds):.1%} to {max(stds):.1%}"
    )


def _pct(x: float | None) -> str:
    """A share as a whole percent, with one decimal where rounding would give 0% or 100% for a share that
    is neither (99.5% is not "100%")."""
    if x is None:
        return "-"
    text = f"{100 * x:.0f}"
    if text in ("0", "100") and 0 < x < 1:
        text = f"{100 * x:.1f}"
    return text + "%"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(stats: dict[int, dict]) -> str:
    """The per-GPU figures as a fixed-width table."""
    head = [
        "gpu",
        "busy/all",
        "sm mean",
        "std",
        "min",
        "p5",
        "p50",
        "max",
        "at max",
        "% of max",
        "W mean",
        "W max",
    ]
    head += ["% limit", "temp", "pwr cap"]
    rows = [head]
    for g, s in sorted(stats.items()):
        sm, pw, tc = s["sm_mhz"], s["power_w"], s["temperature_c"]
        lim = s.get("power_share_of_limit") or {}
        cap = (s["reasons"] or {}).get(REASONS[POWER_CAP]) if s["reasons_known"] else None
        rows.append(
            [
                str(g),
                f"{s['busy_samples']}/{s['samples']}",
                _num(sm["mean"]),
                _num(sm["std"]),
                _num(sm["min"]),
                _num(sm["p5"]),
                _num(sm["p50"]),
                _num(sm["max"]),
                _pct(s["at_file_max_sm"]),
                _pct(s["sm_mean_share_of_max"]),
                _num(pw["mean"]),
                _num(pw["max"]),
                _pct(lim.get("mean")),
                "-" if tc["min"] is None else f"{tc['min']:.0f}-{tc['max']:.0f}",
                _pct(cap),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def reason_lines(stats: dict[int, dict]) -> list[str]:
    """Per GPU, the reasons seen in its busy samples, most frequent first."""
    out = []
    for g, s in sorted(stats.items()):
        if not s["reasons_known"]:
            continue
        seen = sorted(((v, k) for k, v in s["reasons"].items() if v), reverse=True)
        text = ", ".join(f"{k} {100 * v:.1f}%" for v, k in seen) or "none"
        out.append(f"  GPU {g} ({s['reasons_known']} busy samples): {text}")
    return out


def summarize(log: ClockLog, busy: float, limits: dict[int, dict[str, float]] | None = None) -> dict:
    """Per GPU :func:`gpu_stats` and :func:`verdict`, and the file's own figures."""
    arrays = {g: gpu.arrays() for g, gpu in sorted(log.gpus.items())}
    all_sm = np.concatenate([a["sm"] for a in arrays.values()])
    all_sm = all_sm[np.isfinite(all_sm)]
    file_max = float(all_sm.max()) if all_sm.size else math.nan
    stats = {
        g: gpu_stats(a, busy, file_max, (limits or {}).get(g), log.has_reasons) for g, a in arrays.items()
    }
    ends = [a["t"][np.isfinite(a["t"])] for a in arrays.values()]
    duration = max((float(t.max()) for t in ends if t.size), default=None)
    return {
        "file": {
            "start": log.start,
            "duration_s": duration,
            "columns": log.columns,
            "has_reasons": log.has_reasons,
            "lines": log.lines,
            "blank_lines": log.blank,
            "garbled_lines": log.garbled,
            "garbled_examples": log.garbled_examples,
            "na_values": log.na,
            "truncated": log.truncated,
            "max_sm_mhz": file_max if math.isfinite(file_max) else None,
        },
        "gpus": stats,
        "verdicts": {g: verdict(s, busy) for g, s in stats.items()},
        "across_gpus": across_gpus(stats),
    }


def report(summary: dict, path: str, busy: float) -> str:
    """The printed summary: what was read, the table, the reasons, the verdicts."""
    f = summary["file"]
    dur = f"{f['duration_s']:.0f} s from {f['start']}" if f["duration_s"] is not None else "no timestamps"
    lines = [
        f"{os.path.basename(path)}: {len(summary['gpus'])} GPU(s), {dur}; busy = utilization >= {busy:g}%",
        f"  {f['lines']} data line(s): {f['blank_lines']} blank, {f['garbled_lines']} garbled"
        + (f", N/A values {f['na_values']}" if f["na_values"] else "")
        + ("" if f["has_reasons"] else "; no clock event reasons column")
        + ("; the compressed file ends early" if f["truncated"] else ""),
    ]
    lines += [f"  garbled: {ex!r}" for ex in f["garbled_examples"]]
    lines += [
        f"SM clock (MHz) and power over busy samples; 'at max' = at {_num(f['max_sm_mhz'])} MHz, the file's "
        "highest SM clock",
        table(summary["gpus"]),
    ]
    reasons = reason_lines(summary["gpus"])
    if reasons:
        lines += ["clock event reasons (share of busy samples with the bit set):", *reasons]
    lines += [f"GPU {g}: {v}" for g, v in summary["verdicts"].items()]
    if summary["across_gpus"]:
        lines.append(summary["across_gpus"])
    return "\n".join(lines)


def plot(log: ClockLog, summary: dict, busy: float, path: str) -> str | None:
    """Per GPU one row, titled with its verdict: SM clock and power over time (busy samples in colour, the
    others grey; the max clock, the busy mean and the power limit as lines), and the histogram of busy SM
    clocks. The clock axis spans the busy clocks (idle clocks below it are cut). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    gpus = sorted(log.gpus)
    fig = plt.figure(figsize=(14, 3.6 * len(gpus) + 0.6), layout="constrained")
    rows = fig.subfigures(len(gpus), 1, squeeze=False)[:, 0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (sub, g) in enumerate(zip(rows, gpus)):
        a = log.gpus[g].arrays()
        s = summary["gpus"][g]
        timed = bool(np.isfinite(a["t"]).any())
        t = a["t"] if timed else np.arange(a["t"].size, dtype=float)
        is_busy = np.nan_to_num(a["util"], nan=-1.0) >= busy
        c = colours[n % len(colours)]
        grid = sub.add_gridspec(1, 3, width_ratios=[3, 3, 1])
        ax_sm = sub.add_subplot(grid[0])
        ax_pw = sub.add_subplot(grid[1], sharex=ax_sm)
        ax_h = sub.add_subplot(grid[2], sharey=ax_sm)
        sub.suptitle(f"GPU {g}: {summary['verdicts'][g]}", fontsize=10, x=0.01, ha="left")
        for ax, key, label in ((ax_sm, "sm", "SM clock (MHz)"), (ax_pw, "power", "power (W)")):
            ax.plot(t, a[key], color="0.85", lw=0.7, zorder=1)
            ax.scatter(
                t[~is_busy], a[key][~is_busy], s=4, color="0.6", label=f"utilization < {busy:g}%", zorder=2
            )
            ax.scatter(t[is_busy], a[key][is_busy], s=6, color=c, label=f"busy (>= {busy:g}%)", zorder=3)
            ax.set_ylabel(label)
            ax.set_xlabel("seconds from the log's start" if timed else "sample")
            ax.grid(alpha=0.3)
        ax_sm.axhline(
            s["max_sm_mhz"], color="k", ls="--", lw=0.8, label=f"max SM clock {s['max_sm_mhz']:.0f}"
        )
        if s.get("power_limit_w"):
            ax_pw.axhline(
                s["power_limit_w"], color="k", ls="--", lw=0.8, label=f"limit {s['power_limit_w']:.0f} W"
            )
        sm = a["sm"][is_busy]
        sm = sm[np.isfinite(sm)]
        if sm.size:
            mean = s["sm_mhz"]["mean"]
            for ax in (ax_sm, ax_h):
                ax.axhline(mean, color="k", lw=0.8, label=f"busy mean {mean:.0f}")
            lo, hi = float(sm.min()), max(float(sm.max()), s["max_sm_mhz"])
            ax_sm.set_ylim(lo - 0.3 * (hi - lo) - 10, hi + 0.08 * (hi - lo) + 10)
            ax_h.hist(sm, bins=min(40, max(5, np.unique(sm).size)), color=c, orientation="horizontal")
        ax_h.set_xlabel("busy samples")
        ax_h.tick_params(labelleft=False)
        ax_h.grid(alpha=0.3)
        ax_sm.legend(fontsize=7, loc="lower left", markerscale=2, ncol=2)
        ax_pw.legend(fontsize=7, loc="center right", markerscale=2)  # the idle start fills the lower left
        ax_h.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{os.path.basename(log.path)}: SM clock and power per GPU", fontsize=11)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the nvidia-smi CSV log (plain or .gz)")
    ap.add_argument(
        "--busy", type=float, default=90.0, help="utilization.gpu percent from which a sample is busy"
    )
    ap.add_argument("--limits", help="nvidia-smi power.limit,clocks.max.sm,clocks.applications.graphics CSV")
    ap.add_argument("--json", help="write the summary as JSON here")
    ap.add_argument("--plot", help="write the plot (PNG) here; needs matplotlib")
    args = ap.parse_args(argv)
    try:
        log = parse_log(args.log)
        limits = parse_limits(args.limits) if args.limits else None
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(log, args.busy, limits)
    print(report(summary, args.log, args.busy))
    if args.json:
        payload = {
            "input": os.path.basename(args.log),
            "date": datetime.now().isoformat(timespec="seconds"),
            "settings": {
                "busy_util_pct": args.busy,
                "limits": os.path.basename(args.limits) if args.limits else None,
                "limits_per_gpu": limits,
            },
            "reason_bits": {f"0x{bit:x}": name for bit, name in REASONS.items()},
            **summary,
        }
        write_json(os.path.dirname(args.json) or ".", os.path.basename(args.json), jsonable(payload))
    if args.plot:
        if plot(log, summary, args.busy, args.plot) is None:
            print("--plot: matplotlib is not installed; no plot written")
        else:
            print("wrote", args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

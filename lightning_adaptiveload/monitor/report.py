"""Result files of the monitor and the simulator: JSON, CSV, the summary table and PNG plots.

Owns how a measurement is written down: :func:`jsonable` (the one NaN-to-null conversion of the package,
used by the monitor, the simulator and the benchmarks), :func:`write_json`, the CSV cells and files of the
:class:`~lightning_adaptiveload.monitor.LoadBalanceMonitor`, its printed summary, and the figures (matplotlib's
object API, no pyplot state). Plain Python, numpy and matplotlib: no torch, no Lightning.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_adaptiveload import stats
from lightning_adaptiveload.monitor.steps import FIELDS, FLAG_COUNTED, FLAG_HOOK, GIB, STEP_COLUMNS

__all__ = [
    "jsonable",
    "write_json",
    "machine_info",
    "new_figure",
    "save_figure",
    "format_value",
    "format_summary",
    "FileGuard",
    "write_ranks_header",
    "append_rank_rows",
    "step_rows",
    "write_steps_csv",
    "write_step_files",
    "write_monitor_plots",
]

# CSV columns written as integers (the rest as repr of the float).
_INT_COLUMNS = frozenset(
    (
        "batch_idx",
        "step",
        "epoch",
        "num_tokens",
        "batch_size",
        "seq_len",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "alloc_retries",
        "ooms",
        "counted",
        "hook_timed",
        "packed",
        "epoch_end",
        "tokens",
        "samples",
    )
)


def jsonable(value: Any) -> Any:
    """JSON-able copy: numpy scalars to Python, NaN and inf to null, tuples to lists, keys to str."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | os.PathLike, payload: Any) -> str:
    """Write :func:`jsonable` of ``payload`` to ``path`` (strict JSON: no NaN); returns the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(jsonable(payload), f, indent=1, allow_nan=False)
    return path


def append_json_line(path: str | os.PathLike, payload: Any) -> str:
    """Append ``payload`` (made JSON-able by :func:`jsonable`) as one line of the JSON-lines file ``path``."""
    with open(path, "a") as f:
        f.write(json.dumps(jsonable(payload)) + "\n")
    return os.fspath(path)


def machine_info() -> dict[str, Any]:
    """The machine a result was computed on: CPU model, core count, platform, Python (for result files)."""
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


def new_figure(figsize: tuple[float, float], layout: str = "constrained") -> Any:
    """A matplotlib ``Figure`` of the object API (Agg when saved): no pyplot state, no global backend."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout=layout)


def save_figure(fig: Any, path: str | os.PathLike) -> str:
    """Save ``fig`` as a PNG at the resolution of every plot of the package; returns the path."""
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    return path


def _csv_cell(value: float, name: str) -> str | int | float:
    if math.isnan(value):
        return ""
    if name in _INT_COLUMNS:
        return int(value)
    return repr(float(value))


def format_value(value: float) -> str:
    """A number for the summary table: ``-`` when not finite, scientific when very large or small."""
    if not math.isfinite(value):
        return "-"
    a = abs(value)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}"


def _percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, int | float) and math.isfinite(value) else "-"


def _rate(value: Any) -> str:
    if not (isinstance(value, int | float) and math.isfinite(value)):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _figure(table: dict[str, Any], key: str, stat: str = "mean") -> float:
    d = table.get(key) or {}
    return d.get(stat, math.nan) if d.get("n", 0) else math.nan


def _rows_note(rows: dict[str, Any]) -> str:
    """``"264 in the measured times; left out: 4 warm-up, 1 negative reading"``."""
    left = {k: n for k, n in (rows.get("left_out") or {}).items() if n}
    if not left:
        return "all in the measured times"
    words = {"warm_up": "warm-up (FLOPs counted or compiling)"}
    parts = ", ".join(f"{n} {words.get(k, k + ' time reading')}" for k, n in left.items())
    return f"{rows.get('used', 0)} in the measured times; left out: {parts}"


def _epoch_end_line(ends: dict[str, Any]) -> str | None:
    """The line that explains each epoch's last step, where it stands out."""
    if not ends or not ends.get("stands_out"):
        return None
    worst = ends["worst"]
    what = (
        "a pack of the samples left over after the epoch's equal steps (lockstep's packed tail)"
        if ends["packed"] == ends["steps"] and ends["others_packed"] < 0.5 * ends["other_steps"]
        else "the epoch's remainder, the samples its plan could not pair into equal steps"
    )
    tokens = ""
    if math.isfinite(worst["rank_tokens_max"]) and math.isfinite(worst["rank_tokens_min"]):
        tokens = (
            f"up to {worst['rank_tokens_max']:,.0f} tokens vs {worst['rank_tokens_min']:,.0f} on the ranks, "
        )
    return (
        f"  last step of each epoch ({ends['steps']} steps): {tokens}token CV {_percent(ends['token_cv'])} "
        f"(the other steps {_percent(ends['others_token_cv'])})\n    {what}; docs/monitor.md"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """The LoadBalanceMonitor's printed summary, read in ten seconds: a line of metadata, then a few rows (steps,
    tokens/s, MFU, the planned compute CV beside the measured step-time CV, the straggler wait, VRAM efficiency),
    a line on each epoch's last step where it stands out, and where the files are. Planned figures (the cost
    model's estimate of the batches run) and measured ones (the ranks' own compute times) are named apart. Every
    statistic's distribution is in ``load_balance.json`` (``summary.table``)."""
    meta, overall, table = summary["meta"], summary.get("overall") or {}, summary.get("table") or {}
    source = meta.get("flops_source")
    flops = f"FLOPs by {source}" if source not in (None, "none") else "FLOPs not counted (no TFLOP/s or MFU)"
    lines = [
        f"LoadBalanceMonitor: {meta['num_steps']} steps x {meta['world_size']} ranks on {meta['device']}; "
        f"compute time by {meta['timing_method']}, {flops}",
    ]

    def row(label: str, value: str, note: str = "") -> None:
        lines.append(f"  {label:<22}{value:>8}  {note}".rstrip())

    if not meta.get("num_steps"):
        lines.append("  no training step was measured")
    else:
        row("steps", f"{meta['num_steps']:,}", _rows_note(summary.get("rows") or {}))
        row("tokens/s", _rate(overall.get("tokens_per_s", math.nan)), "summed over the ranks, whole job")
        tflops = overall.get("tflops_per_device", math.nan)
        mfu_note = f"{format_value(tflops)} TFLOP/s per device" if math.isfinite(tflops) else ""
        if not math.isfinite(overall.get("mfu", math.nan)):
            mfu_note = "; ".join(x for x in (mfu_note, f"no peak FLOP/s known for {meta['device']}") if x)
        row("MFU", _percent(overall.get("mfu", math.nan)), mfu_note)
        no_cost = (summary.get("rows") or {}).get("cost_left_out", 0)
        row(
            "planned compute CV",
            _percent(_figure(table, "compute_cv")),
            f"p95 {_percent(_figure(table, 'compute_cv', 'p95'))}; the cost model's estimate of the batches run"
            + (
                f" ({no_cost} steps without a usable cost left out)"
                if 0 < no_cost < meta["num_steps"]
                else ""
            ),
        )
        row(
            "measured step-time CV",
            _percent(_figure(table, "step_time_cv")),
            f"p95 {_percent(_figure(table, 'step_time_cv', 'p95'))}; the ranks' measured compute times",
        )
        measured = overall.get("measured_straggler_wait", math.nan)
        row(
            "straggler wait",
            _percent(overall.get("straggler_wait", math.nan)),
            "of the compute time, ranks waiting for the slowest"
            + (f" (measured at the all-reduce: {_percent(measured)})" if math.isfinite(measured) else ""),
        )
        vram = _figure(table, "vram_efficiency_mean")
        util = overall.get("peak_vram_util_eff", math.nan)
        row(
            "VRAM efficiency",
            _percent(vram),
            "peak allocated / device memory, mean"
            + (f"; peak VRAM utilisation efficiency {_percent(util)}" if math.isfinite(util) else "")
            if math.isfinite(vram)
            else "CUDA only",
        )
    line = _epoch_end_line(summary.get("epoch_ends") or {})
    if line:
        lines.append(line)
    fetched = summary.get("fetched") or {}
    if fetched.get("per_epoch"):
        n, total = len(fetched["per_epoch"]), fetched["total"]
        lines.append(
            f"  {'fetched per epoch':<22}{total['bytes'] / n / 2**20:>7.1f}M  bytes of ranged reads in "
            f"{total['requests'] / n:,.0f} requests, all ranks ({total['retries']} retries, "
            f"{total['cache_hits']} cache hits over {n} epochs)"
        )
    files = summary.get("files")
    if files:
        lines.append(f"  files: {files}")
    path = meta.get("norm_modulate_path", "not called")
    if path != "not called":
        lines.append(f"  layer_norm_modulate (rank 0): {path}")
    return "\n".join(lines)


class FileGuard:
    """Writes that must not stop training: the first ``OSError`` of each file (EFBIG, ENOSPC, a folder made
    read-only after the start) is reported once through ``warn``, naming the file and the error, and that file
    is written no more (a CSV with a gap would read as whole); the other files go on.

    Args:
        owner: who writes (the messages start with it).
        warn: called with the message, once per file.

    Attributes:
        failed: path -> the error, for each file given up.
        written: the paths written at least once, in order.
    """

    def __init__(self, owner: str, warn: Callable[[str], None]) -> None:
        self.owner = owner
        self.warn = warn
        self.failed: dict[str, str] = {}
        self.written: list[str] = []

    def write(self, path: str, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)``, which writes ``path``; returns whether it ran without an ``OSError``."""
        if path in self.failed:
            return False
        try:
            fn(*args)
        except OSError as err:
            self.failed[path] = f"{type(err).__name__}: {err}"
            self.warn(
                f"{self.owner}: could not write {path} ({err}); this file is not written again in this fit, and "
                "training goes on (docs/monitor.md, 'Files written at the end of fit')"
            )
            return False
        if path not in self.written:
            self.written.append(path)
        return True


def write_ranks_header(path: str | os.PathLike) -> None:
    """Start ``load_balance_ranks.csv``: one row per rank and step follows (:func:`append_rank_rows`)."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerow(["rank", *FIELDS[:-1], "flops_counted", "backward_timed"])


def append_rank_rows(path: str | os.PathLike, steps: np.ndarray) -> None:
    """Append every rank's record of every step of ``steps`` (float64 (steps, ranks, fields)) to the CSV."""
    k, world, _ = steps.shape
    flags = steps[:, :, -1].astype(np.int64)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        for i in range(k):
            for r in range(world):
                row = steps[i, r]
                writer.writerow(
                    [
                        r,
                        *(_csv_cell(float(v), FIELDS[j]) for j, v in enumerate(row[:-1])),
                        int(bool(flags[i, r] & FLAG_COUNTED)),
                        int(bool(flags[i, r] & FLAG_HOOK)),
                    ]
                )


def step_rows(table: dict[str, np.ndarray]) -> list[dict[str, float]]:
    """The per-step table as one dict per step (the :data:`STEP_COLUMNS`), for the CSV and the JSON."""
    keys = list(STEP_COLUMNS)
    return [dict(zip(keys, vals)) for vals in zip(*(table[k].tolist() for k in keys))] if table else []


def write_steps_csv(path: str | os.PathLike, rows: list[dict[str, float]]) -> None:
    """Write ``load_balance_steps.csv``: one row per step (:func:`step_rows`)."""
    keys = list(STEP_COLUMNS)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        for row in rows:
            writer.writerow([_csv_cell(row[k], k) for k in keys])


def write_step_files(outdir: str, table: dict[str, np.ndarray], summary: dict[str, Any]) -> None:
    """Write ``load_balance_steps.csv`` (one row per step) and ``load_balance.json`` (summary and steps)."""
    rows = step_rows(table)
    write_steps_csv(os.path.join(outdir, "load_balance_steps.csv"), rows)
    write_json(os.path.join(outdir, "load_balance.json"), {"summary": summary, "steps": rows})


# ---------------------------------------------------------------------- monitor plots (rank 0, end of fit)


def _rolling_mean(values: np.ndarray, width: int) -> np.ndarray:
    out = np.full(len(values), np.nan)
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        if (~np.isnan(window)).any():
            out[i] = np.nanmean(window)
    return out


def _plot_cv(outdir: str, table: dict[str, np.ndarray], world: int | None) -> str:
    """Distribution of the per-step CVs across ranks; each epoch's last step (the plan's remainder) apart."""
    counted = table["counted"] > 0
    ends = np.asarray(table.get("epoch_end", np.zeros(len(counted)))) > 0
    if ends.all():  # one step an epoch: nothing to tell apart
        ends = np.zeros(len(counted), dtype=bool)
    fig = new_figure((12, 3.8))
    for ax, key, label in zip(
        fig.subplots(1, 3),
        ("compute_cv", "token_cv", "step_time_cv"),
        ("planned compute CV (cost-model estimate)", "token CV", "measured step-time CV (compute times)"),
    ):
        keep = ~counted if key == "step_time_cv" else np.ones(len(counted), dtype=bool)
        vals = 100 * table[key]
        keep &= ~np.isnan(vals)
        if keep.any():
            d = stats.describe(vals[keep].tolist())
            bins = np.histogram_bin_edges(vals[keep], bins=min(50, max(5, int(keep.sum()) // 3)))
            ax.hist(
                [vals[keep & ~ends], vals[keep & ends]],
                bins=bins,
                stacked=True,
                color=["tab:blue", "tab:orange"],
                alpha=0.8,
                label=["steps", "last step of each epoch" if (keep & ends).any() else "_nolegend_"],
            )
            ax.axvline(d["mean"], color="k", linestyle="--", label=f"mean {d['mean']:.1f}%")
            ax.axvline(d["p95"], color="tab:red", linestyle=":", label=f"p95 {d['p95']:.1f}%")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("CV across ranks per step (%)")
        ax.set_ylabel("steps")
    ranks = f"{world} ranks" if world is not None else "ranks"
    fig.suptitle(f"Balance across {ranks}, {len(table['step'])} steps")
    return save_figure(fig, os.path.join(outdir, "load_balance_cv.png"))


def _plot_throughput(outdir: str, table: dict[str, np.ndarray]) -> str:
    """Job throughput over steps, per step and as a rolling mean."""
    x = table["batch_idx"] + 1
    width = max(1, min(50, len(table["step"]) // 10))
    fig = new_figure((10, 5.5))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, key, label in zip(axes, ("tokens_per_s", "samples_per_s"), ("tokens/s", "samples/s")):
        ax.plot(x, table[key], color="tab:blue", alpha=0.35, linewidth=0.8, label="per step")
        ax.plot(
            x, _rolling_mean(table[key], width), color="tab:blue", linewidth=1.8, label=f"mean of {width}"
        )
        ax.set_ylabel(f"{label} (all ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("training batch")
    fig.suptitle("Job throughput, summed over ranks")
    return save_figure(fig, os.path.join(outdir, "load_balance_throughput.png"))


def _plot_ranks(ax: Any, x: np.ndarray, values: np.ndarray, banded: bool) -> None:
    """Every rank's line, or the min-to-max band and the mean over ranks."""
    if banded:
        ax.fill_between(
            x, values[:, 0], values[:, 2], color="tab:blue", alpha=0.3, label="min to max over ranks"
        )
        ax.plot(x, values[:, 1], color="tab:blue", linewidth=0.9, label="mean over ranks")
    else:
        for r in range(values.shape[1]):
            ax.plot(x, values[:, r], linewidth=0.9, label=f"rank {r}")


def _plot_compute_time(
    outdir: str, table: dict[str, np.ndarray], rank_compute: np.ndarray, banded: bool
) -> str:
    """Each rank's compute time over steps, with the step's wall time."""
    x = table["batch_idx"] + 1
    fig = new_figure((10, 4.5))
    ax = fig.subplots()
    _plot_ranks(ax, x, 1e3 * rank_compute, banded)
    ax.plot(
        x,
        1e3 * table["step_time_s"],
        color="k",
        linestyle="--",
        linewidth=0.9,
        label="step wall time (slowest)",
    )
    ax.set_xlabel("training batch")
    ax.set_ylabel("ms")
    ax.set_title("Each rank's own compute time (waiting for other ranks excluded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    return save_figure(fig, os.path.join(outdir, "load_balance_compute_time.png"))


def _plot_memory(
    outdir: str, table: dict[str, np.ndarray], rank_peak: np.ndarray, totals: np.ndarray, banded: bool
) -> str:
    """Peak allocated memory per step and rank, with the high-water mark and the device's memory."""
    x = table["batch_idx"] + 1
    fig = new_figure((10, 4.5))
    ax = fig.subplots()
    gib = rank_peak / GIB
    _plot_ranks(ax, x, gib, banded)
    ax.axhline(float(np.nanmax(gib)), color="k", linestyle=":", label="high-water mark")
    if not np.isnan(totals).all():
        ax.axhline(float(np.nanmin(totals)) / GIB, color="tab:red", linestyle="--", label="device memory")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("training batch")
    ax.set_ylabel("peak allocated (GiB)")
    ax.set_title("Peak allocated memory per step and rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="lower right")
    return save_figure(fig, os.path.join(outdir, "load_balance_memory.png"))


def write_monitor_plots(
    outdir: str,
    table: dict[str, np.ndarray],
    rank_compute: np.ndarray,
    rank_peak: np.ndarray,
    totals: np.ndarray,
    banded: bool = False,
) -> list[str]:
    """Write the LoadBalanceMonitor's PNG plots and return their paths.

    Args:
        outdir: directory to write into.
        table: the per-step table (``STEP_COLUMNS`` -> float array (steps,)).
        rank_compute: compute time in seconds, (steps, ranks), or (steps, 3) min/mean/max when ``banded``.
        rank_peak: peak allocated bytes, same layout; all nan without CUDA (no memory plot then).
        totals: (ranks,) device memory in bytes.
        banded: the per-rank arrays hold min/mean/max over ranks instead of every rank.
    """
    world = rank_compute.shape[1] if not banded else None
    written = [
        _plot_cv(outdir, table, world),
        _plot_throughput(outdir, table),
        _plot_compute_time(outdir, table, rank_compute, banded),
    ]
    if not np.isnan(rank_peak).all():  # CUDA only
        written.append(_plot_memory(outdir, table, rank_peak, totals, banded))
    return written

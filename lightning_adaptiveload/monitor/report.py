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
    "write_ranks_header",
    "append_rank_rows",
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


def format_summary(summary: dict[str, Any]) -> str:
    """The LoadBalanceMonitor's printed summary: a line of metadata, the statistics table, the whole job."""
    meta, overall, table = summary["meta"], summary["overall"], summary["table"]
    source = meta.get("flops_source")
    flops = f"FLOPs by {source}" if source not in (None, "none") else "FLOPs not counted (no TFLOP/s or MFU)"
    lines = [
        f"LoadBalanceMonitor: {meta['num_steps']} steps x {meta['world_size']} ranks on {meta['device']}; "
        f"compute time by {meta['timing_method']}, {flops}",
        f"{'statistic':<22}{'mean':>12}{'p50':>12}{'p95':>12}{'max':>12}",
    ]
    for key, d in table.items():
        if d["n"] == 0:
            continue
        lines.append(
            f"{key:<22}" + "".join(f"{format_value(d[c]):>12}" for c in ("mean", "p50", "p95", "max"))
        )
    lines.append(
        "whole job: " + ", ".join(f"{k}={format_value(v)}" for k, v in overall.items() if math.isfinite(v))
    )
    lines.append(f"layer_norm_modulate (rank 0): {meta.get('norm_modulate_path', 'not called')}")
    return "\n".join(lines)


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


def write_step_files(outdir: str, table: dict[str, np.ndarray], summary: dict[str, Any]) -> None:
    """Write ``load_balance_steps.csv`` (one row per step) and ``load_balance.json`` (summary and steps)."""
    keys = list(STEP_COLUMNS)
    rows = [dict(zip(keys, vals)) for vals in zip(*(table[k].tolist() for k in keys))] if table else []
    with open(os.path.join(outdir, "load_balance_steps.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        for row in rows:
            writer.writerow([_csv_cell(row[k], k) for k in keys])
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
    """Distribution of the per-step CVs across ranks."""
    counted = table["counted"] > 0
    fig = new_figure((12, 3.8))
    for ax, key, label in zip(
        fig.subplots(1, 3),
        ("compute_cv", "token_cv", "step_time_cv"),
        ("compute CV (cost-model estimate)", "token CV", "step-time CV (measured compute)"),
    ):
        vals = 100 * table[key][~counted] if key == "step_time_cv" else 100 * table[key]
        vals = vals[~np.isnan(vals)]
        if vals.size:
            d = stats.describe(vals.tolist())
            ax.hist(vals, bins=min(50, max(5, vals.size // 3)), color="tab:blue", alpha=0.8)
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

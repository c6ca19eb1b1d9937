"""PNG plots of a simulation: per-step CV per variant and world size, straggler wait and throughput.

Drawn with the figure helpers of :mod:`lightning_adaptiveload.monitor.report` (matplotlib's object API,
no pyplot state), the same as the LoadBalanceMonitor's plots. No Lightning.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from lightning_adaptiveload.monitor.report import new_figure, save_figure
from lightning_adaptiveload.tools.replay import TARGET_LOCKSTEP, VARIANTS

__all__ = ["plot_result"]


class SimulationResult(Protocol):
    """What the plots read of :class:`lightning_adaptiveload.tools.simulate.SimulationResult` (named here, not
    imported: the simulator imports this module to write its plots)."""

    rows: list[dict[str, Any]]
    per_step_cv: dict[tuple[str, int], np.ndarray]


_COLORS = {
    "equal_tokens": "#7f7f7f",
    "dual": "#1f77b4",
    "lockstep": "#d62728",
    "lockstep_equal_tokens": "#ff7f0e",
}
_EXTRA_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def _color(variant: str, variants: list[str]) -> str:
    if variant in _COLORS:
        return _COLORS[variant]
    extras = [m for m in variants if m not in _COLORS]
    return _EXTRA_COLORS[extras.index(variant) % len(_EXTRA_COLORS)]


def plot_result(
    result: SimulationResult, out_dir: str | os.PathLike, prefix: str = "simulate_"
) -> dict[str, str]:
    """PNG plots: per-step CV distributions per variant, wait share and tokens/s ratio against world size."""
    variants = list(dict.fromkeys(r["variant"] for r in result.rows))
    sizes = sorted({r["world_size"] for r in result.rows})
    out: dict[str, str] = {
        "cv_png": _plot_cv(result, variants, sizes, os.path.join(out_dir, f"{prefix}cv.png"))
    }
    out.update(_plot_against_world_size(result, variants, sizes, out_dir, prefix))
    return out


def _plot_cv(result: SimulationResult, variants: list[str], sizes: list[int], path: str) -> str:
    """CV distributions: one box per variant, grouped by world size."""
    fig = new_figure((max(7.0, 1.6 * len(sizes) + 3), 5.0), layout="tight")
    ax = fig.subplots()
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        data = [100 * result.per_step_cv.get((variant, w), np.zeros(1)) for w in sizes]
        pos = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(sizes))]
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
            box.set_facecolor(_color(variant, variants))
            box.set_alpha(0.75)
        ax.plot([], [], color=_color(variant, variants), lw=8, alpha=0.75, label=_legend(variant))
    ax.axhline(100 * TARGET_LOCKSTEP, color="k", ls=":", lw=1, label="2% target")
    ax.set_xticks(range(len(sizes)), [str(w) for w in sizes])
    ax.set_xlabel("ranks (data-parallel world size)")
    ax.set_ylabel("compute CV across ranks per step (%)")
    # Two lines: on one, the title is wider than the figure and is cut off.
    ax.set_title(
        "Per-step compute CV across ranks\n(box p25-p75, whiskers p5-p95, diamond: mean)", fontsize=10
    )
    # Inside the axes, above the boxes: the y range gets headroom for it (a legend below the axes was cut
    # off at both sides and squeezed the axes into the middle of the canvas).
    bottom, top = ax.get_ylim()
    rows = -(-(len(variants) + 1) // 2)
    ax.set_ylim(bottom, bottom + (top - bottom) * (1.15 + 0.12 * rows))
    ax.legend(fontsize=8, loc="upper center", ncol=2, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def _plot_against_world_size(
    result: SimulationResult, variants: list[str], sizes: list[int], out_dir: str | os.PathLike, prefix: str
) -> dict[str, str]:
    """Wait share and tokens/s ratio against world size."""
    out: dict[str, str] = {}
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
        fig = new_figure((6.0, 4.0), layout="tight")
        ax = fig.subplots()
        for variant in variants:
            ys = [scale * result.row(variant, w)[key] for w in sizes]
            ax.plot(
                sizes,
                ys,
                color=_color(variant, variants),
                label=_legend(variant),
                **_style(variant, variants),
            )
        if key == "wait_share":
            ax.axhline(100 * TARGET_LOCKSTEP, color="k", ls=":", lw=1, label="2% target")
        else:
            ax.axhline(1.0, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(w) for w in sizes])
        ax.set_xlabel("ranks (data-parallel world size)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out[f"{fname}_png"] = save_figure(fig, os.path.join(out_dir, f"{prefix}{fname}.png"))
    return out


_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_LINESTYLES = ("-", "--", "-.", ":")


def _style(variant: str, variants: list[str]) -> dict[str, object]:
    """Marker and line style of a configuration: one of its own, so that configurations with equal values
    (``lockstep_equal_tokens`` on ``lockstep``) stay visible, the later one hollow and dashed over the other."""
    i = variants.index(variant) if variant in variants else 0
    return {
        "marker": _MARKERS[i % len(_MARKERS)],
        "ls": _LINESTYLES[i % len(_LINESTYLES)],
        "markersize": 9 - 1.5 * (i % 3),
        "markerfacecolor": "white" if i % 2 else _color(variant, variants),
        "lw": 2.2 - 0.4 * (i % 3),
    }


def _legend(name: str) -> str:
    """A configuration's name with its schedule and sizing rule, for plot legends."""
    if name not in VARIANTS:
        return name
    schedule, sizing = VARIANTS[name]
    return f"{name} (packed: no batch sizing)" if schedule == "packed" else f"{name} ({schedule}, {sizing})"

"""Turn the LoadBalanceMonitor CSVs of ``benchmarks/ddp_modes.py`` into the comparison table and plots.

Reads ``<run_dir>/<mode>/**/load_balance_ranks.csv`` (one row per rank and step), the monitor's
``load_balance.json`` (device memory) and the logger's ``metrics.csv`` (loss) for each mode, leaves out the
first ``--warmup`` steps and the steps during which FLOPs were counted (their times are inflated), and
reports per mode:

- tokens/s: all ranks' tokens / the summed step wall time (slowest rank's ``iter_time_s``: data, compute,
  waiting, optimizer), and relative to ``equal_tokens``;
- compute CV across ranks per step (mean, p95) and the straggler wait ``sum (max - mean) / sum max`` of the
  ranks' own compute times; imbalance ``max / mean - 1``;
- memory: the peak allocated over (rank, step) as a share of the device, and the paper's "peak VRAM
  utilisation efficiency" ``mean / max`` of the per-step peaks (``lightning_adaptiveload.monitor.stats``);
- the target of issue 7: lockstep's tokens/s gain over ``equal_tokens`` against the baseline's wait share.

Writes ``benchmarks/results/ddp_modes_<date>.json``, a Markdown table on stdout, and plots into
``docs/img/`` (``ddp_cv.png``, ``ddp_step_time.png``, ``ddp_loss.png``, ``ddp_throughput.png``).

Usage::

    python benchmarks/ddp_modes_report.py RUN_DIR [--warmup 5]
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import glob
import json
import math
import os
import sys

import numpy as np

from lightning_adaptiveload.monitor.report import jsonable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("equal_tokens", "dual", "lockstep")
_COLORS = {"equal_tokens": "#7f7f7f", "dual": "#1f77b4", "lockstep": "#d62728"}


def _find(run_dir: str, mode: str, name: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(run_dir, mode, "**", name), recursive=True), key=os.path.getmtime)
    return hits[-1] if hits else None


def _float(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def load_ranks_csv(path: str) -> dict[str, np.ndarray]:
    """The per-rank CSV as (steps, world) arrays keyed by column, ordered by batch index and rank."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows; did the run reach a logged step?")
    ranks = sorted({int(r["rank"]) for r in rows})
    batches = sorted({int(_float(r["batch_idx"])) for r in rows})
    pos_r = {r: i for i, r in enumerate(ranks)}
    pos_b = {b: i for i, b in enumerate(batches)}
    cols = [c for c in rows[0] if c != "rank"]
    out = {c: np.full((len(batches), len(ranks)), np.nan) for c in cols}
    for r in rows:
        i, j = pos_b[int(_float(r["batch_idx"]))], pos_r[int(r["rank"])]
        for c in cols:
            out[c][i, j] = _float(r[c])
    return out


def load_loss(path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(steps, loss) from a Lightning CSVLogger metrics.csv: the first column whose name holds 'loss'."""
    if path is None:
        return np.zeros(0), np.zeros(0)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return np.zeros(0), np.zeros(0)
    keys = [k for k in rows[0] if "loss" in k.lower() and "val" not in k.lower()]
    key = next((k for k in keys if "step" in k.lower()), keys[0] if keys else None)
    if key is None:
        return np.zeros(0), np.zeros(0)
    pts = [(_float(r.get("step")), _float(r[key])) for r in rows if r.get(key) not in (None, "")]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def mode_summary(ranks: dict[str, np.ndarray], warmup: int, device_total: float | None) -> dict[str, float]:
    """Per-mode figures from the per-rank arrays (see the module docstring)."""
    from lightning_adaptiveload.monitor import stats

    keep = np.ones(ranks["compute_time_s"].shape[0], dtype=bool)
    keep[:warmup] = False
    if "flops_counted" in ranks:
        keep &= ~(np.nan_to_num(ranks["flops_counted"]).max(axis=1) > 0)
    comp = ranks["compute_time_s"][keep]
    ok = np.isfinite(comp).all(axis=1)
    comp = comp[ok]
    tokens = ranks["num_tokens"][keep][ok]
    wall_col = "iter_time_s" if np.isfinite(ranks["iter_time_s"][keep][ok]).all() else "step_time_s"
    wall = np.nanmax(ranks[wall_col][keep][ok], axis=1)
    cvs = [stats.cv(row) for row in comp]
    imb = [stats.imbalance(row) for row in comp]
    top = comp.max(axis=1)
    peaks = ranks["peak_allocated_bytes"][keep][ok]
    out = {
        "steps_used": int(len(comp)),
        "world_size": int(comp.shape[1]) if comp.size else 0,
        "tokens_per_s": float(tokens.sum() / wall.sum()) if wall.sum() > 0 else math.nan,
        "samples_per_s": float(ranks["batch_size"][keep][ok].sum() / wall.sum())
        if wall.sum() > 0
        else math.nan,
        "step_wall_s_mean": float(wall.mean()) if len(wall) else math.nan,
        "step_wall_cv_over_steps": float(wall.std() / wall.mean())
        if len(wall) and wall.mean() > 0
        else math.nan,
        "compute_cv_mean": float(np.mean(cvs)) if cvs else math.nan,
        "compute_cv_p95": stats.percentile(cvs, 95),
        "imbalance_mean": float(np.mean(imb)) if imb else math.nan,
        "straggler_wait": stats.straggler_wait(comp) if top.sum() > 0 else math.nan,  # time-weighted
        "token_cv_mean": float(np.mean([stats.cv(r) for r in tokens])) if len(tokens) else math.nan,
        "wall_column": wall_col,
    }
    if np.isfinite(peaks).all() and peaks.size:
        out["peak_allocated_gib_max"] = float(peaks.max() / 2**30)
        out["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(peaks.ravel().tolist())
        if device_total:
            out["vram_efficiency_max"] = float(peaks.max() / device_total)
            out["vram_efficiency_mean"] = float(peaks.mean() / device_total)
    return out


def _device_total(json_path: str | None) -> tuple[float | None, str | None]:
    if json_path is None:
        return None, None
    with open(json_path) as f:
        meta = json.load(f).get("summary", {}).get("meta", {})
    totals = meta.get("device_total_bytes") or []
    totals = [t for t in totals if t]
    return (float(min(totals)) if totals else None), meta.get("device")


def _plots(per_mode: dict[str, dict], img_dir: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from lightning_adaptiveload.monitor import stats

    os.makedirs(img_dir, exist_ok=True)
    out = {}
    modes = list(per_mode)
    fig, ax = plt.subplots(figsize=(6, 4))
    data = [[100 * stats.cv(r) for r in per_mode[m]["compute"] if np.isfinite(r).all()] for m in modes]
    bp = ax.boxplot(data, patch_artist=True, showfliers=False, whis=(5, 95), showmeans=True)
    for box, m in zip(bp["boxes"], modes):
        box.set_facecolor(_COLORS.get(m, "#2ca02c"))
        box.set_alpha(0.75)
    ax.set_xticks(range(1, len(modes) + 1), modes)
    ax.set_ylabel("compute CV across ranks per step (%)")
    ax.set_title("Measured per-step compute CV (whiskers p5-p95)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out["cv"] = os.path.join(img_dir, "ddp_cv.png")
    fig.savefig(out["cv"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in modes:
        comp = per_mode[m]["compute"]
        ax.plot(np.nanmax(comp, axis=1), color=_COLORS.get(m), lw=1, label=f"{m}: slowest rank")
        ax.plot(np.nanmin(comp, axis=1), color=_COLORS.get(m), lw=0.8, ls=":", label=f"{m}: fastest rank")
    ax.set_xlabel("step")
    ax.set_ylabel("compute time (s)")
    ax.set_title("Per-step compute time, slowest and fastest rank")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out["step_time"] = os.path.join(img_dir, "ddp_step_time.png")
    fig.savefig(out["step_time"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    any_loss = False
    for m in modes:
        s, v = per_mode[m]["loss"]
        if len(v):
            any_loss = True
            ax.plot(s, v, color=_COLORS.get(m), lw=1, label=m)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss (rectified flow), same data and seed")
    if any_loss:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out["loss"] = os.path.join(img_dir, "ddp_loss.png")
    fig.savefig(out["loss"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    tps = [per_mode[m]["summary"]["tokens_per_s"] for m in modes]
    ax.bar(modes, tps, color=[_COLORS.get(m) for m in modes])
    for i, v in enumerate(tps):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Measured throughput, same max_tokens")
    fig.tight_layout()
    out["throughput"] = os.path.join(img_dir, "ddp_throughput.png")
    fig.savefig(out["throughput"], dpi=110)
    plt.close(fig)
    return out


def simulate_calibrated(run_dir: str, sizes: list[int], mix_name: str, max_tokens: int, warmup: int) -> dict:
    """Simulate more ranks than were run, with the per-bucket compute times measured in these runs.

    Every (seq_len, batch size) the runs met becomes a measured point (median compute time of a rank's step,
    waiting excluded); buckets or batch sizes never met are interpolated or fitted, and the result says how
    many lookups that was.
    """
    from lightning_adaptiveload.data.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import StepTimeTable, simulate

    csvs = [p for m in MODES if (p := _find(run_dir, m, "load_balance_ranks.csv"))]
    mix = load_mix(mix_name)
    table = StepTimeTable.from_monitor_csv(csvs, [b.latent_shape for b in mix.buckets], warmup_steps=warmup)
    result = simulate(
        mix, world_sizes=sizes, max_tokens=max_tokens, times=table, min_steps_per_rank=400, progress=False
    )
    print(f"\nsimulation calibrated on the measured step times ({', '.join(csvs)}):")
    print(result.table())
    for note in result.notes:
        print(f"  note: {note}")
    keys = ("mode", "world_size", "cv_mean", "cv_p95", "imbalance_mean", "wait_share", "tokens_per_s_ratio")
    return {
        "measured_points": table.to_dict()["points"],
        "lookups": dict(table.lookups),
        "rows": [{k: r[k] for k in keys} for r in result.rows],
        "targets": result.targets(),
        "notes": result.notes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation, allocator)")
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument(
        "--simulate",
        default="8,16,64",
        help="world sizes to simulate with the step times measured in these runs ('' to skip)",
    )
    ap.add_argument("--mix", default="wan21_480p", help="the mix the runs trained on (for the simulation)")
    ap.add_argument("--max-tokens", type=int, default=32760)
    args = ap.parse_args(argv)

    per_mode: dict[str, dict] = {}
    device = None
    for mode in MODES:
        path = _find(args.run_dir, mode, "load_balance_ranks.csv")
        if path is None:
            print(
                f"warning: no load_balance_ranks.csv under {os.path.join(args.run_dir, mode)}; skipped",
                file=sys.stderr,
            )
            continue
        ranks = load_ranks_csv(path)
        total, dev = _device_total(_find(args.run_dir, mode, "load_balance.json"))
        device = device or dev
        summary = mode_summary(ranks, args.warmup, total)
        summary["csv"] = os.path.relpath(path, args.run_dir)
        per_mode[mode] = {
            "summary": summary,
            "compute": ranks["compute_time_s"][args.warmup :],
            "loss": load_loss(_find(args.run_dir, mode, "metrics.csv")),
        }
    if not per_mode:
        print(f"error: no mode results under {args.run_dir}", file=sys.stderr)
        return 2
    base = per_mode.get("equal_tokens", {}).get("summary")
    for m in per_mode.values():
        s = m["summary"]
        s["tokens_per_s_ratio"] = s["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
    target = None
    if base and "lockstep" in per_mode:
        gain = per_mode["lockstep"]["summary"]["tokens_per_s_ratio"] - 1
        target = {
            "baseline_straggler_wait": base["straggler_wait"],
            "lockstep_tokens_per_s_gain": gain,
            "gain_if_all_wait_removed": 1 / (1 - base["straggler_wait"]) - 1,
            "met": bool(gain >= base["straggler_wait"]),
        }
    cols = (
        ("tokens_per_s", "tokens/s", "{:,.0f}"),
        ("tokens_per_s_ratio", "x equal_tokens", "{:.3f}"),
        ("compute_cv_mean", "compute CV mean", "{:.1%}"),
        ("compute_cv_p95", "compute CV p95", "{:.1%}"),
        ("imbalance_mean", "imbalance", "{:.1%}"),
        ("straggler_wait", "straggler wait", "{:.1%}"),
        ("peak_allocated_gib_max", "peak GiB", "{:.1f}"),
        ("vram_efficiency_max", "peak / device", "{:.1%}"),
        ("peak_vram_util_eff", "peak VRAM util. eff.", "{:.1%}"),
        ("steps_used", "steps", "{}"),
    )
    lines = ["| mode | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode, m in per_mode.items():
        s = m["summary"]
        cells = []
        for key, _, fmt in cols:
            v = s.get(key)
            cells.append(
                "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)
            )
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if target:
        print(
            f"\nlockstep gain {target['lockstep_tokens_per_s_gain']:+.1%} vs baseline wait "
            f"{target['baseline_straggler_wait']:.1%} (all wait removed would give "
            f"{target['gain_if_all_wait_removed']:+.1%}): target {'met' if target['met'] else 'NOT met'}"
        )
    plots = _plots(per_mode, args.img)
    calibrated = None
    sizes = [int(v) for v in args.simulate.split(",") if v]
    if sizes:
        calibrated = simulate_calibrated(args.run_dir, sizes, args.mix, args.max_tokens, args.warmup)
    os.makedirs(args.results, exist_ok=True)
    date = _dt.date.today().isoformat()
    out = os.path.join(args.results, f"ddp_modes_{date}.json")
    payload = {
        "device": device,
        "date": date,
        "run_dir": os.path.abspath(args.run_dir),
        "warmup_steps_left_out": args.warmup,
        "modes": {m: v["summary"] for m, v in per_mode.items()},
        "target_lockstep_recovers_wait": target,
        "calibrated_simulation": calibrated,
        "plots": {k: os.path.relpath(v, ROOT) for k, v in plots.items()},
    }
    with open(out, "w") as f:
        json.dump(jsonable(payload), f, indent=1)
    print(f"wrote {out} and {len(plots)} plots in {args.img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

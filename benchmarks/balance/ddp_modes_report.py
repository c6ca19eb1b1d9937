"""Turn the LoadBalanceMonitor CSVs of ``benchmarks/balance/ddp_modes.py`` into the comparison table and plots.

Reads, per mode, ``<run_dir>/<mode>/**/load_balance_ranks.csv`` (one row per rank and step), the monitor's
``load_balance.json`` (device, memory), LightningCLI's ``config.yaml`` (the data module's planning settings
and cost model) and the logger's ``metrics.csv`` (loss); and ``<run_dir>/runs_*.json`` (what
``ddp_modes.py`` ran; modes split over several calls are read together) and ``<run_dir>/data_index.json``
(the shards the runs trained on). It leaves out the first ``--warmup`` steps and the steps during which
FLOPs were counted or ``torch.compile`` compiled (their times are inflated). *Stalls*, kept steps in which
some rank took far longer than its tokens explain (:func:`stall_steps`: a compile the monitor did not flag,
or another one-off), are counted, and tokens/s is given without them too, beside the figure over all kept
steps.

**Measured**, per mode:

- tokens/s: all ranks' tokens / the summed step wall time (slowest rank's ``iter_time_s``: data, compute,
  waiting, optimizer), and relative to ``equal_tokens``;
- model TFLOP/s per GPU (the monitor's model FLOPs over the same wall time) and its ratio to
  ``equal_tokens``: the steps measured hold other lengths in each mode, and a long clip's token costs more
  than a short one's, so over a window tokens/s moves with the lengths drawn and the FLOP rate much less
  (:func:`model_flop_rate`); the simulator's ratio over the whole first epoch is printed beside it;
- compute CV across ranks per step (mean, p95), imbalance ``max / mean - 1``;
- the straggler wait two ways: ``straggler_wait`` ``sum (max - mean) / sum max`` of the ranks' own compute
  times (to the end of each rank's backward), and ``measured_straggler_wait`` from each rank's measured
  ``sync_wait_s`` (:func:`lightning_adaptiveload.stats.measured_wait_rows`); the two must agree;
- the noise floor: the straggler wait over the steps in which every rank ran identical work (the same tokens,
  samples and longest sample; :func:`identical_work_steps`), which no schedule can remove; blank under 10
  such steps;
- memory: the peak allocated over (rank, step) as a share of the device, and the paper's "peak VRAM
  utilisation efficiency" ``mean / max`` of the per-step peaks.

**Simulated, for the same settings** (labelled so): the simulator's planner and replay
(:func:`lightning_adaptiveload.tools.replay.run_mode`) plan the very epochs the runs trained on (the same
shards, world size, ``max_tokens``, seed, workers and planning options, from ``config.yaml``), and price
each step with times measured in these runs: a bucketed batch by the per-(length, batch size) medians of
the bucketed modes' steps (:meth:`StepTimeTable.from_monitor_csv`, packs of mixed lengths left out), a pack by the
pack cost model ``c0 + sum (alpha*S_i + beta*S_i^2)`` fitted to the measured packs
(:meth:`CostModel.fit_pack_sums`; ``--pack-cost-model`` gives a calibrated one instead). A step's simulated
wall time is its slowest rank's time plus the measured per-step overhead (optimizer, all-reduce tail, data:
the median of wall minus slowest compute). Figures are taken over the same steps as the measured ones; the
share of (step, rank) batches whose token count matches the run's says whether the replay is the run's plan.

**The planner's estimate**: the straggler wait of the planner's own cost model (``batch["cost"]``, in the
CSV) on the batches run, beside the measured wait, with the cost model's error per rank step (issue 43); and
lockstep's measured tokens/s gain beside ``1 / (1 - w) - 1`` for ``equal_tokens``' measured wait ``w``.

A pack's ``sum S_i^2`` is not in the CSV (it records ``batch_size`` N, ``num_tokens`` sum S_i and the longest
S_i); it is recovered from the planner's cost of the step, ``c0 + alpha*sum S + beta*sum S^2 + gamma*N``,
when that model is quadratic (the recipes' and ``calibrate``'s are), else estimated with the other samples
of equal length (counted and said).

Writes ``<results>/ddp_modes_<tag>_<date>.json``, the tables on stdout (and ``.md`` beside the JSON), plots
``ddp_<tag>_{cv,step_time,loss,throughput}.png`` into ``--img``, and, with ``--simulate``, a simulation of
more ranks calibrated on the same times.

Usage::

    python benchmarks/balance/ddp_modes_report.py RUN_DIR [--warmup 5] [--tag fast_w4]
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
from typing import Any

import numpy as np

from lightning_adaptiveload.monitor.report import jsonable
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
MODES = ("equal_tokens", "dual", "lockstep", "packed")
_COLORS = {"equal_tokens": "#7f7f7f", "dual": "#1f77b4", "lockstep": "#d62728", "packed": "#2ca02c"}
# Issue 36's judgement of the 4-GPU table (fastest settings) and of the simulator; reported, never asserted.
TARGETS = {
    "packed_x_equal_tokens": 1.15,
    "packed_x_lockstep": 1.0,
    "balance_max": 0.01,
    "sim_ratio_err": 0.05,
}


# ------------------------------------------------------------------------------------------------ reading


def _find(run_dir: str, mode: str, name: str) -> str | None:
    """``<run_dir>/<mode>/**/<name>`` (a run folder; the newest), else ``<run_dir>/<mode>_<name>`` (the flat
    copy committed under ``benchmarks/results/``, so that a report can be made again from it)."""
    hits = sorted(glob.glob(os.path.join(run_dir, mode, "**", name), recursive=True), key=os.path.getmtime)
    if hits:
        return hits[-1]
    flat = os.path.join(run_dir, f"{mode}_{name}")
    return flat if os.path.isfile(flat) else None


def _float(text: Any) -> float:
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
    """(steps, loss) from a Lightning CSVLogger metrics.csv: the first column whose name holds 'loss'.

    Finite values only (the plot); :func:`first_nonfinite_loss` says where a NaN or inf began."""
    pts = _loss_points(path)
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def first_nonfinite_loss(path: str | None) -> float | None:
    """The first step whose logged training loss is NaN or inf, or None (all finite, or no log)."""
    return next((s for s, v in _loss_points(path) if not math.isfinite(v)), None)


def _loss_points(path: str | None) -> list[tuple[float, float]]:
    if path is None:
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    keys = [k for k in rows[0] if "loss" in k.lower() and "val" not in k.lower()]
    key = next((k for k in keys if "step" in k.lower()), keys[0] if keys else None)
    if key is None:
        return []
    return [(_float(r.get("step")), _float(r[key])) for r in rows if r.get(key) not in (None, "")]


def load_config(path: str | None) -> dict[str, Any]:
    """LightningCLI's saved ``config.yaml``: ``{"data": data init_args, "model": model init_args}``."""
    if path is None:
        return {}
    import yaml

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    return {
        "data": _flat_data_args(((cfg.get("data") or {}).get("init_args")) or {}),
        "model": ((cfg.get("model") or {}).get("init_args")) or {},
    }


def _flat_data_args(args: dict[str, Any]) -> dict[str, Any]:
    """The data module's arguments as one flat dict, from a config of either form: the nested groups of
    this release (``batching``, ``plan``, ``loader``, ``source``) or the flat keys runs before it saved."""
    flat = {k: v for k, v in args.items() if k not in ("batching", "plan", "loader", "source")}
    old_names = {"sizing": "mode", "chunk_samples": "plan_chunk_samples"}
    for group in ("batching", "plan", "loader", "source"):
        for key, value in (args.get(group) or {}).items():
            flat[old_names.get(key, key)] = value
    return flat


def load_run_meta(run_dir: str) -> dict[str, Any]:
    """What ``ddp_modes.py`` ran, from every ``runs_*.json`` in ``run_dir`` (one per call)."""
    calls = []
    for path in sorted(glob.glob(os.path.join(run_dir, "runs_*.json"))):
        with open(path) as f:
            calls.append(json.load(f))
    if not calls:
        return {}
    meta = {k: calls[-1].get(k) for k in ("devices", "max_tokens", "mix", "samples", "seed", "data")}
    meta["settings"] = sorted({c.get("settings", "eager") for c in calls})
    meta["steps"] = sorted({c.get("steps") for c in calls if c.get("steps") is not None})
    meta["epochs"] = sorted({c.get("epochs") for c in calls if c.get("epochs")})
    meta["calls"] = [
        {
            "date": c.get("date"),
            "settings": c.get("settings", "eager"),
            "modes": [r["mode"] for r in c.get("runs", [])],
            "rc": [r.get("rc") for r in c.get("runs", [])],
            "seconds": [r.get("seconds") for r in c.get("runs", [])],
        }
        for c in calls
    ]
    for key in ("devices", "max_tokens", "mix", "samples", "seed"):
        values = {json.dumps(c.get(key)) for c in calls}
        if len(values) > 1:
            meta.setdefault("mismatches", []).append(f"{key} differs between calls: {sorted(values)}")
    if len(meta["settings"]) > 1:
        meta.setdefault("mismatches", []).append(f"settings differ between calls: {meta['settings']}")
    return meta


def _device_info(json_path: str | None) -> dict[str, Any]:
    if json_path is None:
        return {}
    with open(json_path) as f:
        summary = json.load(f).get("summary", {})
    meta, overall = summary.get("meta", {}), summary.get("overall", {})
    totals = [t for t in (meta.get("device_total_bytes") or []) if t]
    compiles = meta.get("compiles_rank0")  # [[step, seconds], ...]; absent in monitors before 2026-11-28
    return {
        "device": meta.get("device"),
        "device_total": float(min(totals)) if totals else None,
        "compile_steps": None if compiles is None else len(compiles),
        "compile_s": None if compiles is None else float(sum(sec for _, sec in compiles)),
        "monitor_overall": {
            k: overall.get(k) for k in ("straggler_wait", "measured_straggler_wait", "tokens_per_s", "mfu")
        },
    }


# -------------------------------------------------------------------------------------- per-step pieces


def plan_cost_model(config: dict[str, Any]):
    """The planner's cost model of a run (``data.init_args.cost_model``; None: the default)."""
    from lightning_adaptiveload.planning.cost_model import CostModel

    spec = (config.get("data") or {}).get("cost_model")
    return CostModel.default() if spec is None else CostModel.from_dict(spec)


def kept_steps(ranks: dict[str, np.ndarray], warmup: int) -> np.ndarray:
    """bool (steps,): past the warm-up, not a FLOP-counting or compiling step, every rank's time known."""
    keep = np.ones(ranks["compute_time_s"].shape[0], dtype=bool)
    keep[:warmup] = False
    if "flops_counted" in ranks:
        keep &= ~(np.nan_to_num(ranks["flops_counted"]).max(axis=1) > 0)
    keep &= np.isfinite(ranks["compute_time_s"]).all(axis=1)
    return keep


def pack_rows(ranks: dict[str, np.ndarray], mode: str) -> np.ndarray:
    """bool (steps, world): the rank's step was a pack. Every step of ``packed``; elsewhere (lockstep's packed
    tail) the packs of mixed lengths (``num_tokens != seq_len * batch_size``): a tail pack of equal lengths
    runs the bucketed path and is a bucket's batch in all but name."""
    n, m, t = ranks["batch_size"], ranks["seq_len"], ranks["num_tokens"]
    if mode == "packed":
        return np.isfinite(t) & (n > 0)
    return np.isfinite(t) & (n > 0) & (np.abs(t - m * n) > 0.5)


def square_sums(ranks: dict[str, np.ndarray], plan_cost) -> tuple[np.ndarray, np.ndarray]:
    """Each step's ``sum S_i^2`` (float (steps, world)) and whether it is exact (bool, same shape).

    Exact for a batch of one length (``N * S^2``) and, when the planner's cost model is quadratic, for a
    pack: ``(cost - c0 - alpha*sum S - gamma*N) / beta``, kept when it lies within what the recorded longest
    sample allows. Otherwise estimated as the longest sample plus ``N - 1`` equal others (the least
    ``sum S_i^2`` that the record allows).
    """
    n, m, t, c = ranks["batch_size"], ranks["seq_len"], ranks["num_tokens"], ranks["cost"]
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(n > 1, (t - m) ** 2 / np.maximum(n - 1, 1), 0.0)
        low = m * m + rest
        high = m * t
        out = low.copy()
        exact = np.abs(t - m * n) <= 0.5
        out[exact] = (n * m * m)[exact]
        if plan_cost.kind == "quadratic" and plan_cost.beta > 0:
            q = (c - plan_cost.c0 - plan_cost.alpha * t - plan_cost.gamma * n) / plan_cost.beta
            ok = ~exact & np.isfinite(q) & (q >= low * (1 - 1e-6)) & (q <= high * (1 + 1e-6))
            out[ok] = np.clip(q[ok], low[ok], high[ok])
            exact = exact | ok
    return out, exact & np.isfinite(out)


def measured_wait(sync_wait: np.ndarray, compute: np.ndarray) -> float:
    """``measured_straggler_wait`` over these steps: each rank's measured wait less the step's least,
    over the slowest compute, time-weighted as the monitor does; nan without a measured step."""
    from lightning_adaptiveload import stats

    if sync_wait.size == 0:
        return math.nan
    share, _ = stats.measured_wait_rows(sync_wait, compute)
    top = compute.max(axis=1)
    ok = np.isfinite(share) & np.isfinite(top)
    if not ok.any() or top[ok].sum() <= 0:
        return math.nan
    return float(np.average(share[ok], weights=top[ok]))


def cost_model_error(cost: np.ndarray, seconds: np.ndarray) -> float:
    """Mean relative error per rank step of ``k * cost`` against the measured compute time, ``k`` the best
    scale (the planner's model may be in any unit, and only its ratios plan the batches)."""
    r = (cost / seconds)[np.isfinite(cost) & np.isfinite(seconds) & (seconds > 0) & (cost > 0)]
    if r.size == 0:
        return math.nan
    k = r.sum() / (r * r).sum()
    return float(np.mean(np.abs(k * r - 1.0)))


#: Fewer identical-work steps than this give no noise floor (nan).
MIN_IDENTICAL_STEPS = 10


def model_flop_rate(ranks: dict[str, np.ndarray], keep: np.ndarray, wall: np.ndarray) -> float:
    """Model TFLOP/s per GPU over the kept steps: every rank's model FLOPs (the monitor's ``flops`` column,
    ``flops_per_batch``) over the summed step wall times and the ranks; NaN without FLOPs.

    Over a window of steps this is a truer epoch-speed ratio between schedules than tokens/s: each schedule
    draws other samples into its first steps, and a token of a long clip costs more than one of a short clip
    (attention), so tokens/s moves with the lengths drawn; a FLOP's time moves much less with them."""
    if "flops" not in ranks or not keep.any() or wall.sum() <= 0:
        return math.nan
    flops = ranks["flops"][keep]
    if not np.isfinite(flops).all() or (flops <= 0).any():
        return math.nan
    return float(flops.sum() / wall.sum() / flops.shape[1] / 1e12)


def identical_work_steps(ranks: dict[str, np.ndarray], keep: np.ndarray) -> np.ndarray:
    """bool (steps,): the kept steps (:func:`kept_steps`: every rank's time known) in which every rank ran
    the same work: the same tokens, samples and longest sample. No schedule can balance these better, so
    their straggler wait is the noise floor of the machine and the path (kernels, clocks, the all-reduce's
    overlap) that any plan sits on."""
    same = keep.copy()
    for c in ("num_tokens", "batch_size", "seq_len"):
        if c in ranks:
            col = ranks[c]
            same &= np.isfinite(col).all(axis=1) & (np.nanmax(col, axis=1) - np.nanmin(col, axis=1) <= 0.5)
    return same


def identical_work_noise(comp: np.ndarray) -> float:
    """The relative spread of the ranks' compute times ``comp`` (identical-work steps, world) on identical
    work: the mean of each step's ``std / mean`` (``ddof=1``); nan under :data:`MIN_IDENTICAL_STEPS` steps.
    The simulator adds this noise to its replayed times to predict the wait a real machine adds."""
    if comp.shape[0] < MIN_IDENTICAL_STEPS or comp.shape[1] < 2:
        return math.nan
    return float(np.mean(comp.std(axis=1, ddof=1) / comp.mean(axis=1)))


#: A step is a *stall* when some rank's compute time exceeds both this factor times, and
#: :data:`STALL_EXCESS_S` seconds more than, what its tokens take at the run's median seconds per token.
STALL_FACTOR = 3.0
STALL_EXCESS_S = 3.0


def stall_steps(ranks: dict[str, np.ndarray], keep: np.ndarray) -> np.ndarray:
    """bool (steps,): the kept steps in which some rank took far longer than its tokens explain (a compile
    or another one-off the monitor did not flag: a rank's batch of images at a small batch size costs more
    per token than a clip, which the factor and the excess in seconds leave alone). Reported beside the
    figures over all kept steps, never instead of them."""
    comp, tok = ranks["compute_time_s"], ranks["num_tokens"]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = comp[keep] / tok[keep]
    ok = np.isfinite(per_token) & (per_token > 0)
    if not ok.any():
        return np.zeros(comp.shape[0], dtype=bool)
    expected = float(np.median(per_token[ok])) * tok
    over = (comp > STALL_FACTOR * expected) & (comp - expected > STALL_EXCESS_S)
    return keep & np.nan_to_num(over, nan=False).any(axis=1)


def calibration_steps(ranks: dict[str, np.ndarray], warmup: int) -> np.ndarray:
    """bool (steps,): the steps the simulator is calibrated on: kept, and not stalls (a stall's time says
    nothing of what its batch costs)."""
    keep = kept_steps(ranks, warmup)
    return keep & ~stall_steps(ranks, keep)


def mode_summary(
    ranks: dict[str, np.ndarray], warmup: int, device_total: float | None, mode: str = ""
) -> dict[str, Any]:
    """Measured figures of one mode (see the module docstring), over :func:`kept_steps`."""
    from lightning_adaptiveload import stats

    keep = kept_steps(ranks, warmup)
    comp = ranks["compute_time_s"][keep]
    tokens = ranks["num_tokens"][keep]
    wall_col = "iter_time_s" if np.isfinite(ranks["iter_time_s"][keep]).all() else "step_time_s"
    wall = np.nanmax(ranks[wall_col][keep], axis=1) if keep.any() else np.zeros(0)
    cvs = [stats.cv(row) for row in comp]
    imb = [stats.imbalance(row) for row in comp]
    top = comp.max(axis=1) if comp.size else np.zeros(0)
    peaks = ranks["peak_allocated_bytes"][keep]
    sync = ranks["sync_wait_s"][keep] if "sync_wait_s" in ranks else np.full_like(comp, np.nan)
    out: dict[str, Any] = {
        "steps_logged": int(comp.shape[0] + (~keep).sum()),
        "steps_used": int(len(comp)),
        "world_size": int(ranks["compute_time_s"].shape[1]),
        "tokens_per_s": float(tokens.sum() / wall.sum()) if wall.sum() > 0 else math.nan,
        "samples_per_s": float(ranks["batch_size"][keep].sum() / wall.sum()) if wall.sum() > 0 else math.nan,
        "step_wall_s_mean": float(wall.mean()) if len(wall) else math.nan,
        "step_overhead_s_median": float(np.median(wall - top)) if len(wall) else math.nan,
        "compute_cv_mean": float(np.mean(cvs)) if cvs else math.nan,
        "compute_cv_p95": stats.percentile(cvs, 95) if cvs else math.nan,
        "imbalance_mean": float(np.mean(imb)) if imb else math.nan,
        "straggler_wait": stats.straggler_wait(comp) if top.sum() > 0 else math.nan,  # time-weighted
        "measured_straggler_wait": measured_wait(sync, comp),
        "token_cv_mean": float(np.mean([stats.cv(r) for r in tokens])) if len(tokens) else math.nan,
        "pack_steps": int(pack_rows(ranks, mode)[keep].any(axis=1).sum()),
        "wall_column": wall_col,
        "model_tflops_per_gpu": model_flop_rate(ranks, keep, wall),
    }
    same = ranks["compute_time_s"][identical_work_steps(ranks, keep)]
    out["identical_work_steps"] = int(same.shape[0])
    out["identical_work_wait"] = stats.straggler_wait(same) if len(same) >= MIN_IDENTICAL_STEPS else math.nan
    out["identical_work_noise"] = identical_work_noise(same)
    stalls = stall_steps(ranks, keep)
    steady = keep & ~stalls
    steady_wall = np.nanmax(ranks[wall_col][steady], axis=1) if steady.any() else np.zeros(0)
    out["stall_steps"] = int(stalls.sum())
    out["stall_wall_s"] = float(np.nanmax(ranks[wall_col][stalls], axis=1).sum()) if stalls.any() else 0.0
    out["tokens_per_s_no_stalls"] = (
        float(ranks["num_tokens"][steady].sum() / steady_wall.sum()) if steady_wall.sum() > 0 else math.nan
    )
    cost = ranks["cost"][keep] if "cost" in ranks else None
    if cost is not None and np.isfinite(cost).all() and cost.size and (cost > 0).all():
        out["planner_straggler_wait"] = stats.straggler_wait(cost)
        out["planner_cv_mean"] = float(np.mean([stats.cv(r) for r in cost]))
        out["cost_model_rel_error"] = cost_model_error(cost, comp)
    if np.isfinite(peaks).all() and peaks.size:
        out["peak_allocated_gib_max"] = float(peaks.max() / 2**30)
        out["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(peaks.ravel().tolist())
        if device_total:
            out["vram_efficiency_max"] = float(peaks.max() / device_total)
            out["vram_efficiency_mean"] = float(peaks.mean() / device_total)
    return out


# ----------------------------------------------------------------------------------- the pack cost model


def pack_statistics(per_mode: dict[str, dict], warmup: int) -> dict[str, np.ndarray]:
    """Every measured pack of every mode: N, sum S, sum S^2 (and whether exact), compute seconds."""
    cols: dict[str, list] = {"n": [], "s1": [], "s2": [], "exact": [], "seconds": [], "mode": []}
    for mode, m in per_mode.items():
        ranks, plan_cost = m["ranks"], m["plan_cost"]
        keep = calibration_steps(ranks, warmup)[:, None] & pack_rows(ranks, mode)
        keep &= np.isfinite(ranks["compute_time_s"]) & (ranks["compute_time_s"] > 0)
        s2, exact = square_sums(ranks, plan_cost)
        cols["n"].append(ranks["batch_size"][keep])
        cols["s1"].append(ranks["num_tokens"][keep])
        cols["s2"].append(s2[keep])
        cols["exact"].append(exact[keep])
        cols["seconds"].append(ranks["compute_time_s"][keep])
        cols["mode"].append(np.full(int(keep.sum()), mode, dtype=object))
    if not cols["n"]:
        return {k: np.zeros(0) for k in cols}
    return {k: np.concatenate(v) for k, v in cols.items()}


def fit_pack_model(packs: dict[str, np.ndarray], given: Any = None) -> tuple[Any, dict[str, Any]]:
    """The pack cost model that prices packs in the simulation, and how it was obtained.

    ``given`` (a :class:`CostModel`) wins; else ``c0 + sum(alpha*S + beta*S^2)`` fitted to the measured packs
    (:meth:`CostModel.fit_pack_sums`), with its error on every pack; None when fewer than 3 packs with two
    distinct sample counts or token sums were measured (the simulation then prices packs by the bucketed
    steps' per-sample fit, and says so).
    """
    from lightning_adaptiveload.planning.cost_model import CostModel

    info: dict[str, Any] = {
        "packs_measured": int(len(packs["n"])),
        "sum_sq_estimated": int((~packs["exact"].astype(bool)).sum()),
    }
    model = None
    if given is not None:
        model = given
        info["source"] = "given (--pack-cost-model)"
    elif len(packs["n"]) >= 3 and (len(np.unique(packs["n"])) > 1 or len(np.unique(packs["s1"])) > 1):
        try:
            model = CostModel.fit_pack_sums(packs["n"], packs["s1"], packs["s2"], packs["seconds"])
            info["source"] = "fitted to this run's packs"
        except ValueError as err:
            info["source"] = f"not fitted ({err})"
    else:
        info["source"] = "none: fewer than 3 distinct packs measured"
    if model is not None:
        info["model"] = model.to_dict()
        info["formula"] = model.describe()
        if len(packs["n"]):
            pred = model.c0 + model.alpha * packs["s1"] + model.beta * packs["s2"] + model.gamma * packs["n"]
            err = np.abs(pred - packs["seconds"]) / packs["seconds"]
            info["mean_rel_error"] = float(err.mean())
            info["max_rel_error"] = float(err.max())
    return model, info


def bucketed_step_model(per_mode: dict[str, dict], warmup: int):
    """``c0 + B*(alpha*S + beta*S^2)`` fitted to the bucketed steps of these modes (each rank's batch of B
    samples of S tokens, its compute seconds): a step's fixed cost apart from its samples', so that it can
    price a pack of any shapes (:meth:`CostModel.fit_pack_sums` with B, B*S and B*S^2)."""
    from lightning_adaptiveload.planning.cost_model import CostModel

    cols: dict[str, list] = {"n": [], "s1": [], "s2": [], "seconds": []}
    for mode, m in per_mode.items():
        ranks = m["ranks"]
        keep = calibration_steps(ranks, warmup)[:, None] & ~pack_rows(ranks, mode)
        keep &= np.isfinite(ranks["compute_time_s"]) & (ranks["compute_time_s"] > 0)
        b, seq = ranks["batch_size"][keep], ranks["seq_len"][keep]
        cols["n"].append(b)
        cols["s1"].append(b * seq)
        cols["s2"].append(b * seq * seq)
        cols["seconds"].append(ranks["compute_time_s"][keep])
    n, s1, s2, y = (np.concatenate(cols[k]) if cols[k] else np.zeros(0) for k in ("n", "s1", "s2", "seconds"))
    return CostModel.fit_pack_sums(n, s1, s2, y)


# ---------------------------------------------------------------------------------------- the simulator


def calibrated_table(
    csvs: list[str], mix_name: str, warmup: int, pack_model: Any, exclude: dict[str, list[int]] | None = None
):
    """The simulator's step times measured in these runs: bucketed medians (without the ``exclude``d
    ``batch_idx`` values of each CSV: the stalls), and packs by ``pack_model``."""
    from lightning_adaptiveload.data.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import StepTimeTable

    mix = load_mix(mix_name)
    shapes = [b.latent_shape for b in mix.buckets]
    table = StepTimeTable.from_monitor_csv(csvs, shapes, warmup_steps=warmup, exclude=exclude)
    table.pack_model = pack_model
    return table


def _plan_settings(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The data module's planning settings of a run (its saved config; the recipe's defaults without one)."""
    data = config.get("data") or {}
    return {
        "max_tokens": int(data.get("max_tokens") or meta.get("max_tokens") or 32760),
        "max_compute": data.get("max_compute", "auto") if data.get("max_compute") is not None else "auto",
        "num_workers": int(data.get("num_workers", 4)),
        "seed": int(data.get("seed", 0)),
        "patch": tuple(int(v) for v in data.get("patch_size", (1, 2, 2))),
        "plan_options": {
            "lockstep_tail": data.get("lockstep_tail", "packed"),
            "lockstep_tolerance": float(data.get("lockstep_tolerance", 0.05)),
            "max_buffered_samples": data.get("max_buffered_samples"),
        },
    }


def with_noise(times: np.ndarray, noise: float, draws: int) -> np.ndarray:
    """(draws, *times.shape): ``times`` scaled by ``1 + noise * N(0, 1)`` (at least 0), seeded."""
    rng = np.random.default_rng(0)
    return times * np.maximum(1.0 + noise * rng.standard_normal((draws, *times.shape)), 0.0)


def noise_floor(noise: float, ranks: int, draws: int = 4096) -> float:
    """The straggler wait of identical work on ``ranks`` ranks whose times are ``1 + noise * N(0, 1)``
    (:func:`with_noise`) over seeded draws: the floor under any schedule at that size."""
    from lightning_adaptiveload import stats

    return stats.straggler_wait(with_noise(np.ones((draws, ranks)), noise, 1)[0])


def _pooled_noise(per_mode: dict[str, dict]) -> float:
    """Every mode's :func:`identical_work_noise`, weighted by its identical-work steps; nan without one."""
    pairs = [
        (m["summary"].get("identical_work_noise", math.nan), m["summary"].get("identical_work_steps", 0))
        for m in per_mode.values()
    ]
    pairs = [(v, n) for v, n in pairs if math.isfinite(v) and n > 0]
    return float(np.average([v for v, _ in pairs], weights=[n for _, n in pairs])) if pairs else math.nan


def predict_mode(
    mode: str,
    m: dict[str, Any],
    index: Any,
    table: Any,
    overhead_s: float,
    meta: dict[str, Any],
    warmup: int,
    noise: float = math.nan,
) -> dict[str, Any]:
    """The simulator's figures for one measured mode, over the same steps (see the module docstring). With a
    finite ``noise`` (:func:`identical_work_noise`), also its tokens/s and wait with every replayed rank time
    scaled by ``1 + noise * N(0, 1)``: the mean over 64 seeded draws."""
    from lightning_adaptiveload import stats
    from lightning_adaptiveload.tools.replay import run_mode
    from lightning_adaptiveload.tools.step_times import BatchCoster

    ranks = m["ranks"]
    world = int(ranks["compute_time_s"].shape[1])
    s = _plan_settings(m["config"], meta)
    coster = BatchCoster(table, s["patch"], 0.0)
    batch_idx = np.nan_to_num(ranks["batch_idx"][:, 0], nan=-1).astype(np.int64)
    keep = kept_steps(ranks, warmup)
    need = int(batch_idx.max()) + 1
    seconds, tokens, cost = [], [], []
    epoch = 0
    while sum(len(x) for x in seconds) < need and epoch < 50:
        _, _, rep, _ = run_mode(
            index,
            world,
            mode,
            max_tokens=s["max_tokens"],
            max_compute=s["max_compute"],
            plan_cost=m["plan_cost"],
            coster=coster,
            patch=s["patch"],
            num_workers=s["num_workers"],
            seed=s["seed"],
            epoch=epoch,
            plan_options=s["plan_options"],
        )
        seconds.append(rep.seconds)
        tokens.append(rep.tokens)
        cost.append(rep.cost)
        epoch += 1
    sec, tok, cst = (np.concatenate(x) for x in (seconds, tokens, cost))
    rows = batch_idx[keep]
    rows = rows[(rows >= 0) & (rows < len(sec))]
    if rows.size == 0:
        return {"error": "no measured step to compare with"}
    sec, tok, cst = sec[rows], tok[rows], cst[rows]
    measured_tokens = ranks["num_tokens"][np.isin(batch_idx, rows)]
    wall = sec.max(axis=1) + overhead_s
    noisy: dict[str, float] = {}
    if math.isfinite(noise) and noise > 0:
        draws = with_noise(sec, noise, 64)
        noisy = {
            "noise": float(noise),
            "tokens_per_s_with_noise": float(
                np.mean([tok.sum() / (d.max(axis=1) + overhead_s).sum() for d in draws])
            ),
            "straggler_wait_with_noise": float(np.mean([stats.straggler_wait(d) for d in draws])),
        }
    # The whole first epoch, beside the measured steps: how far the steps a run measured stand from an epoch.
    first = seconds[0].max(axis=1) + overhead_s
    return {
        **noisy,
        "tokens_per_s_epoch0": float(tokens[0].sum() / first.sum()),
        "epoch0_steps": int(len(first)),
        "steps": int(len(rows)),
        "epochs_planned": epoch,
        "plan_match": float(np.mean(np.abs(measured_tokens - tok) < 0.5)),
        "tokens_per_s": float(tok.sum() / wall.sum()),
        "compute_cv_mean": float(np.mean(stats.balance_rows(sec)[0])),
        "straggler_wait": stats.straggler_wait(sec),
        # The planner's cost model on the replayed batches: the same steps, and the whole first epoch.
        "planner_straggler_wait": stats.straggler_wait(cst),
        "planner_straggler_wait_epoch0": stats.straggler_wait(cost[0]),
    }


def simulate_more_ranks(
    table: Any, sizes: list[int], modes: list[str], mix_name: str, max_tokens: int, steps_per_rank: int
) -> dict[str, Any]:
    """Simulate more ranks than were run (mix population), with the step times measured in these runs."""
    from lightning_adaptiveload.data.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import simulate

    result = simulate(
        load_mix(mix_name),
        settings=SimulateSettings(
            world_sizes=sizes, modes=modes, max_tokens=max_tokens, min_steps_per_rank=steps_per_rank
        ),
        times=table,
        progress=False,
    )
    print(f"\nSIMULATED: more ranks, step times calibrated on this run ({mix_name} population):")
    print(result.table())
    for note in result.notes:
        print(f"  note: {note}")
    keys = ("mode", "world_size", "cv_mean", "cv_p95", "imbalance_mean", "wait_share", "tokens_per_s_ratio")
    return {
        "rows": [{k: r[k] for k in keys} for r in result.rows],
        "targets": result.targets(),
        "notes": result.notes,
    }


# ------------------------------------------------------------------------------------------------- output


def _fmt(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


def _table(rows: list[tuple[str, dict]], cols: tuple) -> str:
    lines = ["| mode | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode, s in rows:
        lines.append(f"| {mode} | " + " | ".join(_fmt(s.get(k), f) for k, _, f in cols) + " |")
    return "\n".join(lines)


def _plots(per_mode: dict[str, dict], img_dir: str, tag: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from lightning_adaptiveload import stats

    os.makedirs(img_dir, exist_ok=True)
    stem = f"ddp_{tag}_" if tag else "ddp_"
    out = {}
    modes = list(per_mode)
    fig, ax = plt.subplots(figsize=(6, 4))
    data = [
        [100 * stats.cv(r) for r in per_mode[m]["compute"] if np.isfinite(r).all()] or [0.0] for m in modes
    ]
    bp = ax.boxplot(data, patch_artist=True, showfliers=False, whis=(5, 95), showmeans=True)
    for box, m in zip(bp["boxes"], modes):
        box.set_facecolor(_COLORS.get(m, "#9467bd"))
        box.set_alpha(0.75)
    ax.set_xticks(range(1, len(modes) + 1), modes)
    ax.set_ylabel("compute CV across ranks per step (%)")
    ax.set_title("Measured per-step compute CV (whiskers p5-p95)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out["cv"] = os.path.join(img_dir, stem + "cv.png")
    fig.savefig(out["cv"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in modes:
        comp = per_mode[m]["compute"]
        if not comp.size:
            continue
        ax.plot(np.nanmax(comp, axis=1), color=_COLORS.get(m), lw=1, label=f"{m}: slowest rank")
        ax.plot(np.nanmin(comp, axis=1), color=_COLORS.get(m), lw=0.8, ls=":", label=f"{m}: fastest rank")
    ax.set_xlabel("step (kept)")
    ax.set_ylabel("compute time (s)")
    ax.set_title("Measured per-step compute time, slowest and fastest rank")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out["step_time"] = os.path.join(img_dir, stem + "step_time.png")
    fig.savefig(out["step_time"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    any_loss = False
    for m in modes:
        s, v = per_mode[m]["loss"]
        bad = per_mode[m]["summary"].get("loss_nonfinite_from_step")
        if len(v):
            any_loss = True
            label = m if bad is None else f"{m} (not finite from step {int(bad)})"
            ax.plot(s, v, color=_COLORS.get(m), lw=1, label=label)
            if bad is not None:  # where the curve ends: NaN or inf from here on
                ax.plot([s[-1]], [v[-1]], "x", color=_COLORS.get(m), ms=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss (rectified flow), same data and seed")
    if any_loss:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out["loss"] = os.path.join(img_dir, stem + "loss.png")
    fig.savefig(out["loss"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    tps = [per_mode[m]["summary"]["tokens_per_s"] for m in modes]
    ax.bar(modes, tps, color=[_COLORS.get(m) for m in modes], label="measured")
    for i, v in enumerate(tps):
        ax.text(i, v, _fmt(v, "{:,.0f}"), ha="center", va="bottom", fontsize=8)
    sim = [(per_mode[m].get("simulated") or {}).get("tokens_per_s", math.nan) for m in modes]
    if any(math.isfinite(v) for v in sim):
        ax.plot(range(len(modes)), sim, "kD", mfc="none", label="simulated (calibrated on this run)")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput, same max_tokens")
    fig.tight_layout()
    out["throughput"] = os.path.join(img_dir, stem + "throughput.png")
    fig.savefig(out["throughput"], dpi=110)
    plt.close(fig)
    return out


MEASURED_COLS = (
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tokens_per_s_ratio", "x equal_tokens", "{:.3f}"),
    ("model_tflops_per_gpu", "model TFLOP/s per GPU", "{:.1f}"),
    ("flop_rate_ratio", "x equal_tokens, FLOP rate", "{:.3f}"),
    ("compute_cv_mean", "compute CV mean", "{:.1%}"),
    ("compute_cv_p95", "compute CV p95", "{:.1%}"),
    ("imbalance_mean", "imbalance", "{:.1%}"),
    ("straggler_wait", "straggler wait", "{:.1%}"),
    ("measured_straggler_wait", "measured wait (sync_wait)", "{:.1%}"),
    ("identical_work_wait", "wait, identical work (floor)", "{:.1%}"),
    ("identical_work_steps", "identical-work steps", "{}"),
    ("peak_allocated_gib_max", "peak GiB", "{:.1f}"),
    ("vram_efficiency_max", "peak / device", "{:.1%}"),
    ("peak_vram_util_eff", "peak VRAM util. eff.", "{:.1%}"),
    ("pack_steps", "pack steps", "{}"),
    ("steps_used", "steps", "{}"),
    ("compile_steps", "compiling steps", "{}"),
    ("compile_s", "compile s (rank 0)", "{:.0f}"),
    ("stall_steps", "stalls", "{}"),
    ("tokens_per_s_no_stalls", "tokens/s w/o stalls", "{:,.0f}"),
    ("no_stalls_ratio", "x equal_tokens w/o stalls", "{:.3f}"),
)
BESIDE_COLS = (
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("sim_tokens_per_s", "SIM. tokens/s", "{:,.0f}"),
    ("tokens_per_s_ratio", "x equal_tokens", "{:.3f}"),
    ("sim_ratio", "SIM. x equal_tokens", "{:.3f}"),
    ("sim_ratio_epoch", "SIM. x equal_tokens, whole epoch", "{:.3f}"),
    ("compute_cv_mean", "compute CV", "{:.1%}"),
    ("sim_cv", "SIM. compute CV", "{:.1%}"),
    ("straggler_wait", "straggler wait", "{:.1%}"),
    ("measured_straggler_wait", "measured wait", "{:.1%}"),
    ("sim_wait", "SIM. wait", "{:.1%}"),
    ("sim_wait_noise", "SIM. wait + noise", "{:.1%}"),
    ("sim_ratio_noise", "SIM. x equal_tokens + noise", "{:.3f}"),
    ("planner_straggler_wait", "planner's wait", "{:.1%}"),
    ("sim_plan_match", "SIM. plan match", "{:.0%}"),
    ("sim_epoch0_steps", "SIM. steps in epoch 0", "{}"),
)


def _gain_lines(
    per_mode: dict[str, dict], world: int = 4, settings: str = "fast"
) -> tuple[list[str], dict[str, Any]]:
    """Issue 43's and issue 36's checks, in words (never asserted); issue 36's thresholds are its targets only
    at 4 GPUs with the fast settings and finite losses, and the line says so otherwise."""
    lines: list[str] = []
    checks: dict[str, Any] = {}
    base = per_mode.get("equal_tokens", {}).get("summary")
    if base is None:
        return ["(no equal_tokens run: no ratios, no gain check)"], checks
    w_meas, w_der = base.get("measured_straggler_wait", math.nan), base.get("straggler_wait", math.nan)
    for name in ("lockstep", "packed"):
        if name not in per_mode:
            continue
        gain = per_mode[name]["summary"]["tokens_per_s_ratio"] - 1
        explained = {
            "measured_tokens_per_s_gain": gain,
            "equal_tokens_measured_wait": w_meas,
            "gain_if_all_measured_wait_removed": 1 / (1 - w_meas) - 1 if math.isfinite(w_meas) else math.nan,
            "equal_tokens_straggler_wait": w_der,
            "gain_if_all_derived_wait_removed": 1 / (1 - w_der) - 1 if math.isfinite(w_der) else math.nan,
        }
        checks[f"{name}_gain"] = explained
        lines.append(
            f"{name}: measured tokens/s gain {_fmt(gain, '{:+.1%}')} over equal_tokens; removing all of "
            f"equal_tokens' measured wait ({_fmt(w_meas, '{:.1%}')}) would give "
            f"{_fmt(explained['gain_if_all_measured_wait_removed'], '{:+.1%}')} (1 / (1 - w) - 1; from the "
            f"compute times' wait {_fmt(w_der, '{:.1%}')}: {_fmt(explained['gain_if_all_derived_wait_removed'], '{:+.1%}')})"
        )
    plan_w, err = base.get("planner_straggler_wait"), base.get("cost_model_rel_error")
    if plan_w is not None and math.isfinite(w_meas):
        diff = abs(plan_w - w_meas)
        agree = bool(err is not None and math.isfinite(err) and diff <= err)
        checks["equal_tokens_planner_vs_monitor"] = {
            "planner_straggler_wait": plan_w,
            "measured_straggler_wait": w_meas,
            "difference": diff,
            "cost_model_mean_rel_error": err,
            "agree_within_cost_model_error": agree,
        }
        lines.append(
            f"equal_tokens: the planner's estimated wait {plan_w:.1%} (its cost model on the batches run) vs the "
            f"monitor's measured wait {w_meas:.1%}: {diff * 100:.1f} points apart; the cost model errs "
            f"{_fmt(err, '{:.1%}')} per rank step (after a best scale): "
            f"{'agree' if agree else 'do NOT agree'} within it (a first-order bound: the wait moves by about "
            "the per-rank relative error)"
        )
    pk, lk = per_mode.get("packed", {}).get("summary"), per_mode.get("lockstep", {}).get("summary")
    if pk is not None:
        t = TARGETS
        met = {
            "packed_ge_1.15x_equal_tokens": pk["tokens_per_s_ratio"] >= t["packed_x_equal_tokens"],
            "packed_ge_1.0x_lockstep": (
                lk is not None and pk["tokens_per_s"] >= t["packed_x_lockstep"] * lk["tokens_per_s"]
            ),
        }
        for name, s in (("packed", pk), ("lockstep", lk)):
            if s is None:
                continue
            met[f"{name}_cv_le_1pct"] = s["compute_cv_mean"] <= t["balance_max"]
            met[f"{name}_measured_wait_le_1pct"] = s["measured_straggler_wait"] <= t["balance_max"]
        checks["issue36_targets"] = met
        caveats = [f"{world} GPUs"] if world != 4 else []
        caveats += [f"settings {settings}"] if settings != "fast" else []
        caveats += [
            f"{k}'s loss not finite"
            for k, v in per_mode.items()
            if v["summary"].get("loss_nonfinite_from_step") is not None
        ]
        checks["issue36_targets_apply"] = not caveats
        head = (
            "issue 36's 4-GPU targets (fastest settings): "
            if not caveats
            else f"issue 36's thresholds on this run (NOT its acceptance run: {', '.join(caveats)}): "
        )
        lines.append(head + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    return lines, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out (compilation, allocator)")
    ap.add_argument("--results", default=os.path.join(BENCH, "results"))
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--tag", default=None, help="in file names (default: <settings>_w<ranks>)")
    ap.add_argument(
        "--simulate",
        default="8,16,64",
        help="more world sizes to simulate with the step times measured in these runs ('' to skip)",
    )
    ap.add_argument("--simulate-steps", type=int, default=400, help="steps per rank of those simulations")
    ap.add_argument("--mix", default=None, help="the mix the runs trained on (default: the runs' own)")
    ap.add_argument(
        "--pack-cost-model",
        default=None,
        help="price packs with this cost model (JSON, or a calibration fragment's data.init_args.cost_model) "
        "instead of the fit to this run's packs",
    )
    ap.add_argument("--no-predict", action="store_true", help="skip the simulation of the runs' own settings")
    ap.add_argument(
        "--calibrate-on",
        default=None,
        help="comma-separated modes whose steps alone calibrate the simulation (an out-of-sample prediction of "
        "the others); packs are then priced by the per-step model c0 + sum(alpha*S + beta*S^2) fitted to those "
        "modes' bucketed steps unless packed is among them. Default: every mode",
    )
    args = ap.parse_args(argv)

    meta = load_run_meta(args.run_dir)
    mix = args.mix or meta.get("mix") or "wan21_480p"
    per_mode: dict[str, dict] = {}
    device = None
    for mode in MODES:
        path = _find(args.run_dir, mode, "load_balance_ranks.csv")
        if path is None:
            print(
                f"note: no load_balance_ranks.csv under {os.path.join(args.run_dir, mode)}", file=sys.stderr
            )
            continue
        ranks = load_ranks_csv(path)
        info = _device_info(_find(args.run_dir, mode, "load_balance.json"))
        device = device or info.get("device")
        config = load_config(_find(args.run_dir, mode, "config.yaml"))
        summary = mode_summary(ranks, args.warmup, info.get("device_total"), mode)
        summary["csv"] = os.path.relpath(path, args.run_dir)
        summary["monitor_whole_job"] = info.get("monitor_overall")
        # Rank 0's compiling steps and their compile seconds (left out of every figure above; None: a
        # monitor too old to list them).
        summary["compile_steps"] = info.get("compile_steps")
        summary["compile_s"] = info.get("compile_s")
        summary["loss_nonfinite_from_step"] = first_nonfinite_loss(_find(args.run_dir, mode, "metrics.csv"))
        keep = kept_steps(ranks, args.warmup)
        per_mode[mode] = {
            "summary": summary,
            "ranks": ranks,
            "config": config,
            "plan_cost": plan_cost_model(config),
            "compute": ranks["compute_time_s"][keep],
            "loss": load_loss(_find(args.run_dir, mode, "metrics.csv")),
        }
    if not per_mode:
        print(f"error: no mode results under {args.run_dir}", file=sys.stderr)
        return 2
    world = next(iter(per_mode.values()))["summary"]["world_size"]
    settings = "+".join(meta.get("settings") or ["unknown"])
    tag = args.tag if args.tag is not None else f"{settings}_w{world}"
    base = per_mode.get("equal_tokens", {}).get("summary")
    for m in per_mode.values():
        s = m["summary"]
        s["tokens_per_s_ratio"] = s["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        s["no_stalls_ratio"] = (
            s["tokens_per_s_no_stalls"] / base["tokens_per_s_no_stalls"] if base else math.nan
        )
        s["flop_rate_ratio"] = s["model_tflops_per_gpu"] / base["model_tflops_per_gpu"] if base else math.nan

    # -- the simulator's prediction for these settings
    notes: list[str] = list(meta.get("mismatches", []))
    notes += [
        f"{k}: no config.yaml; its planning settings and cost model are taken as the recipes' defaults"
        for k, v in per_mode.items()
        if not v["config"]
    ]
    notes += [
        f"{k}: the training loss is not finite from step {int(v['summary']['loss_nonfinite_from_step'])}: its "
        "tokens/s time the steps, but it is not a valid training run"
        for k, v in per_mode.items()
        if v["summary"].get("loss_nonfinite_from_step") is not None
    ]
    few = [
        f"{k} {v['summary']['steps_used']}" for k, v in per_mode.items() if v["summary"]["steps_used"] < 30
    ]
    if few:
        notes.append(f"fewer than 30 steps used ({', '.join(few)}): a smoke run, not a table")
    given = None
    if args.pack_cost_model:
        given = _load_cost_model(args.pack_cost_model)
    calib = list(per_mode)
    if args.calibrate_on:
        calib = [m.strip() for m in args.calibrate_on.split(",") if m.strip()]
        unknown = [m for m in calib if m not in per_mode]
        if unknown or not calib:
            print(
                f"error: --calibrate-on {args.calibrate_on!r}: {unknown or 'no mode'} not among the runs' modes "
                f"{sorted(per_mode)}",
                file=sys.stderr,
            )
            return 2
        notes.append(
            f"SIM. calibrated on {', '.join(calib)} only: for the other modes it is an out-of-sample prediction"
        )
        if given is None and "packed" not in calib:
            given = bucketed_step_model({k: per_mode[k] for k in calib}, args.warmup)
    pack_model, pack_info = fit_pack_model(
        pack_statistics({k: per_mode[k] for k in calib}, args.warmup), given
    )
    if args.calibrate_on and given is not None and not args.pack_cost_model:
        pack_info["source"] = f"the per-step model fitted to the bucketed steps of {', '.join(calib)}"
        pack_info["packs_measured"] = 0
    if pack_info["sum_sq_estimated"]:
        notes.append(
            f"{pack_info['sum_sq_estimated']} packs' sum S^2 estimated (planner cost model not quadratic, or out "
            "of bounds): longest sample plus equal others"
        )
    table = None
    # The bucket table from the bucketed modes' steps (the packed run's steps are all packs, priced by the
    # pack model; lockstep's mixed tail packs are left out by the table itself).
    sources = [k for k in calib if k != "packed"] or ["packed"]
    csvs = [os.path.join(args.run_dir, per_mode[k]["summary"]["csv"]) for k in sources]
    stalls = {}
    for k, path in zip(sources, csvs, strict=True):
        ranks = per_mode[k]["ranks"]
        stalled = stall_steps(ranks, kept_steps(ranks, args.warmup))
        stalls[path] = [int(b) for b in np.nanmax(ranks["batch_idx"], axis=1)[stalled]]
    try:
        table = calibrated_table(csvs, mix, args.warmup, pack_model, exclude=stalls)
    except ValueError as err:
        notes.append(f"no calibrated simulation: {err}")
    overhead = float(np.nanmedian([m["summary"]["step_overhead_s_median"] for m in per_mode.values()]))
    index_path = os.path.join(args.run_dir, "data_index.json")
    noise = _pooled_noise(per_mode)
    if table is not None and not args.no_predict and world >= 2:
        index = _index(index_path, mix, meta, world, notes)
        for mode, m in per_mode.items():
            try:
                m["simulated"] = predict_mode(mode, m, index, table, overhead, meta, args.warmup, noise)
            except Exception as err:  # a report keeps going: the failure is printed beside the mode
                m["simulated"] = {"error": f"{type(err).__name__}: {err}"}
        sim_base = (per_mode.get("equal_tokens", {}).get("simulated") or {}).get("tokens_per_s")
        base_noise = (per_mode.get("equal_tokens", {}).get("simulated") or {}).get("tokens_per_s_with_noise")
        base_epoch = (per_mode.get("equal_tokens", {}).get("simulated") or {}).get("tokens_per_s_epoch0")
        for mode, m in per_mode.items():
            sim, s = m.get("simulated") or {}, m["summary"]
            s["sim_tokens_per_s"] = sim.get("tokens_per_s")
            s["sim_ratio"] = sim["tokens_per_s"] / sim_base if sim_base and "tokens_per_s" in sim else None
            s["sim_cv"], s["sim_wait"] = sim.get("compute_cv_mean"), sim.get("straggler_wait")
            s["sim_plan_match"] = sim.get("plan_match")
            s["sim_epoch0_steps"] = sim.get("epoch0_steps")
            s["sim_wait_noise"] = sim.get("straggler_wait_with_noise")
            if base_epoch and sim.get("tokens_per_s_epoch0"):
                s["sim_ratio_epoch"] = sim["tokens_per_s_epoch0"] / base_epoch
            if base_noise and sim.get("tokens_per_s_with_noise"):
                s["sim_ratio_noise"] = sim["tokens_per_s_with_noise"] / base_noise
            if s["sim_ratio"] is not None and math.isfinite(s["tokens_per_s_ratio"]):
                s["sim_ratio_rel_error"] = s["sim_ratio"] / s["tokens_per_s_ratio"] - 1
            if s["sim_ratio"] is not None and math.isfinite(s.get("no_stalls_ratio", math.nan)):
                s["sim_ratio_rel_error_no_stalls"] = s["sim_ratio"] / s["no_stalls_ratio"] - 1
            if sim.get("error"):
                notes.append(f"{mode}: simulation failed: {sim['error']}")
            elif sim.get("plan_match", 1.0) < 0.95:
                notes.append(
                    f"{mode}: only {sim['plan_match']:.0%} of the simulated batches have the run's token counts: "
                    "the replayed plan is not the run's (other data or planning settings)"
                )

    # -- print
    steps = ", ".join(
        [str(v) for v in meta.get("steps", [])] + [f"{v} whole epoch(s)" for v in meta.get("epochs", [])]
    )
    steps = steps or "?"
    head = (
        f"ddp_modes: {world} ranks on {device or 'unknown device'}, settings {settings}, max_tokens "
        f"{meta.get('max_tokens', '?')}, mix {mix}, steps asked {steps}; first {args.warmup} steps and "
        "FLOP-counting or compiling steps left out"
    )
    measured = _table([(k, v["summary"]) for k, v in per_mode.items()], MEASURED_COLS)
    beside = _table([(k, v["summary"]) for k, v in per_mode.items()], BESIDE_COLS)
    gain_lines, checks = _gain_lines(per_mode, world, settings)
    sim_errors = {
        k: v["summary"].get("sim_ratio_rel_error")
        for k, v in per_mode.items()
        if "sim_ratio_rel_error" in v["summary"]
    }
    if sim_errors:
        ok = {k: abs(e) <= TARGETS["sim_ratio_err"] for k, e in sim_errors.items()}
        checks["sim_ratio_within_5pct"] = ok
        gain_lines.append(
            "SIMULATED vs measured tokens/s ratio: "
            + ", ".join(
                f"{k} {e:+.1%} ({'within' if ok[k] else 'OUTSIDE'} 5%)" for k, e in sim_errors.items()
            )
        )
        steady = {
            k: v["summary"]["sim_ratio_rel_error_no_stalls"]
            for k, v in per_mode.items()
            if "sim_ratio_rel_error_no_stalls" in v["summary"]
        }
        if any(v["summary"].get("stall_steps") for v in per_mode.values()) and steady:
            ok = {k: abs(e) <= TARGETS["sim_ratio_err"] for k, e in steady.items()}
            checks["sim_ratio_within_5pct_no_stalls"] = ok
            gain_lines.append(
                "SIMULATED vs measured tokens/s ratio without stalls (the simulator prices steps as they run "
                "between stalls): "
                + ", ".join(
                    f"{k} {e:+.1%} ({'within' if ok[k] else 'OUTSIDE'} 5%)" for k, e in steady.items()
                )
            )
    mixes = [
        (k, v["summary"])
        for k, v in per_mode.items()
        if math.isfinite(v["summary"].get("flop_rate_ratio", math.nan))
    ]
    if len(mixes) > 1:
        gain_lines.append(
            "x equal_tokens by tokens/s, by model FLOP rate, and SIMULATED over the whole first epoch (each mode's "
            "measured steps drew other lengths; the FLOP rate moves less with them): "
            + ", ".join(
                f"{k} {s['tokens_per_s_ratio']:.3f} / {s['flop_rate_ratio']:.3f} / "
                + _fmt(s.get("sim_ratio_epoch"), "{:.3f}")
                for k, s in mixes
                if k != "equal_tokens"
            )
        )
    sim_how = (
        f"SIMULATED (the simulator's planner and replay on the runs' data and settings, calibrated on the "
        f"step times of {', '.join(calib)}: bucketed steps by measured medians, packs by "
        f"{pack_info['formula'] + ' s' if 'formula' in pack_info else 'the bucketed steps per-sample fit'} "
        f"[{pack_info['source']}; {pack_info['packs_measured']} packs measured"
        + (
            f", mean error {pack_info['mean_rel_error']:.1%}, max {pack_info['max_rel_error']:.1%}"
            if "mean_rel_error" in pack_info
            else ""
        )
        + f"], plus {overhead:.3f} s measured per-step overhead). planner's wait: its cost model on the batches run."
    )
    if any("noise" in (m.get("simulated") or {}) for m in per_mode.values()):
        sim_how += (
            f" + noise: every replayed rank time scaled by 1 + {noise:.2%} x N(0, 1), the spread measured on "
            "identical work (mean of 64 draws)."
        )
    text = "\n".join(
        [head, "", "MEASURED", measured, "", "MEASURED beside SIMULATED", beside, "", sim_how, ""]
        + gain_lines
        + [f"note: {n}" for n in notes]
    )
    print(text)
    plots = _plots(per_mode, args.img, tag)
    more = None
    sizes = [int(v) for v in args.simulate.split(",") if v]
    if sizes and table is not None:
        modes = [m for m in per_mode if m in ("equal_tokens", "dual", "lockstep", "packed")]
        try:
            more = simulate_more_ranks(
                table, sizes, modes, mix, int(meta.get("max_tokens") or 32760), args.simulate_steps
            )
        except ValueError as err:  # e.g. no cost model fits timings dominated by compile stalls
            more = {"error": f"{type(err).__name__}: {err}"}
            print(f"note: no simulation at {args.simulate} ranks: {more['error']}")
        if more is not None and "error" not in more and math.isfinite(noise):
            more["noise_floor"] = {str(n): noise_floor(noise, n) for n in sorted({world, *sizes})}
            print(
                "  note: these projections replay exact times; with the noise measured on identical work here "
                f"(relative spread {noise:.2%}), identical work alone would wait "
                + ", ".join(f"{v:.1%} at {n} ranks" for n, v in more["noise_floor"].items())
                + f" (measured at {world}: the floor column above)"
            )
    os.makedirs(args.results, exist_ok=True)
    date = _dt.date.today().isoformat()
    out = os.path.join(args.results, f"ddp_modes_{tag}_{date}.json")
    payload = {
        "device": device,
        "date": date,
        "world_size": world,
        "settings": settings,
        "run_dir": os.path.abspath(args.run_dir),
        "runs": meta,
        "warmup_steps_left_out": args.warmup,
        "modes": {m: v["summary"] for m, v in per_mode.items()},
        "simulated_same_settings": {m: v.get("simulated") for m, v in per_mode.items()},
        "simulation_times": {
            "pack_model": pack_info,
            "step_overhead_s": overhead,
            "table": None if table is None else table.to_dict(),
        },
        "checks": checks,
        "notes": notes,
        "simulated_more_ranks": more,
        "plots": {k: os.path.relpath(v, ROOT) for k, v in plots.items()},
    }
    with open(out, "w") as f:
        json.dump(jsonable(payload), f, indent=1)
    with open(out[: -len(".json")] + ".md", "w") as f:
        f.write(text + "\n")
    print(f"wrote {out} (and .md) and {len(plots)} plots in {args.img}")
    return 0


def _load_cost_model(path: str):
    """A cost model from a JSON file (CostModel.to_dict) or a calibration fragment (data.init_args.cost_model)."""
    import yaml

    from lightning_adaptiveload.planning.cost_model import CostModel

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    args = _flat_data_args((((data or {}).get("data") or {}).get("init_args")) or {})
    spec = args.get("cost_model", data)
    if isinstance(spec, dict) and "cost_model" in spec:
        spec = spec["cost_model"]
    return CostModel.from_dict(spec)


def _index(path: str, mix: str, meta: dict[str, Any], world: int, notes: list[str]):
    """The shards the runs trained on (``data_index.json``), else a population of the mix (said in a note)."""
    from lightning_adaptiveload.data.index import ShardIndex
    from lightning_adaptiveload.data.mixes import load_mix
    from lightning_adaptiveload.tools.replay import mix_population

    if os.path.isfile(path):
        return ShardIndex.load(path)
    n = int(meta.get("samples") or 768)
    notes.append(
        f"no {os.path.basename(path)} in the run folder: the simulation plans a {n}-sample population of {mix}, "
        "not the runs' shards (its batches are not the run's)"
    )
    return mix_population(load_mix(mix), n, max(world * 4, n // 16), int(meta.get("seed") or 0))


if __name__ == "__main__":
    sys.exit(main())

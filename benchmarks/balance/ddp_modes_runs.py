"""The measured half of ``ddp_modes_report.py``: reading a run folder of ``benchmarks/balance/ddp_modes.py``
(the monitor's per-rank CSV, its JSON, LightningCLI's ``config.yaml``, the logger's ``metrics.csv``, the calls'
``runs_*.json``) and each mode's measured figures over the kept steps (:func:`mode_summary`). No simulation
here: :mod:`ddp_modes_sim` prices the same steps with the simulator."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------------------------ reading


def find_file(run_dir: str, mode: str, name: str) -> str | None:
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
        "data": flat_data_args(((cfg.get("data") or {}).get("init_args")) or {}),
        "model": ((cfg.get("model") or {}).get("init_args")) or {},
    }


def flat_data_args(args: dict[str, Any]) -> dict[str, Any]:
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


def device_info(json_path: str | None) -> dict[str, Any]:
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

"""Issue 41 on GPUs: does the cost refit lower the wait of the epochs after the first? Each epoch's figures.

Reads the run folders of ``benchmarks/balance/gpu_closed_loop.sh`` (or any runs with a
:class:`~lightning_adaptiveload.LoadBalanceMonitor`): per run, per epoch, the straggler wait from the ranks'
compute times and the measured wait (``sync_wait_s``), and, where the monitor refitted, each refit's status,
terms and error (``cost_refit.jsonl``: the fitted model's and the starting model's mean and worst relative
error per step on that epoch's rows), and each mid-epoch replan's line (``replans``). Writes one JSON (device-free: the runs' own files name the device) and
prints a table. Nothing here times anything.

    python benchmarks/balance/closed_loop_report.py refit_on=/tmp/cl/on refit_off=/tmp/cl/off --out cl.json
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys
from datetime import datetime, timezone
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning_adaptiveload import stats  # noqa: E402


def find_one(run_dir: str, name: str) -> str | None:
    """The newest ``name`` under ``run_dir`` (the monitor writes into the logger's version folder)."""
    hits = sorted(glob.glob(os.path.join(run_dir, "**", name), recursive=True), key=os.path.getmtime)
    return hits[-1] if hits else None


def epoch_tables(path: str) -> list[dict[str, np.ndarray]]:
    """Per epoch, ``compute`` and ``sync_wait`` as (steps, ranks) arrays from ``load_balance_ranks.csv``.

    The CSV has one row per rank and step, with the step's ``epoch`` (global ``step`` orders the rows).
    Steps missing a rank are left out.
    """
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    need = {"rank", "step", "epoch", "compute_time_s", "sync_wait_s"}
    missing = sorted(need - set(rows[0]))
    if missing:
        raise ValueError(
            f"{path}: missing column(s) {missing}; expected LoadBalanceMonitor's load_balance_ranks.csv"
        )
    world = 1 + max(int(r["rank"]) for r in rows)
    by_step: dict[int, dict[int, dict[str, str]]] = {}
    for r in rows:
        by_step.setdefault(int(float(r["step"])), {})[int(r["rank"])] = r
    per_epoch: dict[int, list[dict[int, dict[str, str]]]] = {}
    for step in sorted(by_step):
        ranks = by_step[step]
        if len(ranks) == world:
            per_epoch.setdefault(int(float(ranks[0]["epoch"])), []).append(ranks)
    epochs = [per_epoch[e] for e in sorted(per_epoch)]

    def col(steps: list[dict[int, dict[str, str]]], key: str) -> np.ndarray:
        return np.array([[_num(s[r].get(key)) for r in range(world)] for s in steps], dtype=np.float64)

    return [{"compute": col(e, "compute_time_s"), "sync_wait": col(e, "sync_wait_s")} for e in epochs]


def _num(v: Any) -> float:
    try:
        return float(v) if v not in (None, "") else math.nan
    except ValueError:
        return math.nan


def run_summary(run_dir: str, warmup: int) -> dict[str, Any]:
    """Per epoch: steps, straggler wait (derived and measured); and the refits found beside the CSV."""
    path = find_one(run_dir, "load_balance_ranks.csv")
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no load_balance_ranks.csv (was the LoadBalanceMonitor on?)")
    out: dict[str, Any] = {"csv": path, "epochs": []}
    for e, t in enumerate(epoch_tables(path)):
        skip = warmup if e == 0 else 0  # the first steps of the run: compiling, allocator warm-up
        comp, wait = t["compute"][skip:], t["sync_wait"][skip:]
        ok = np.all(np.isfinite(comp), axis=1)
        comp, wait = comp[ok], wait[ok]
        step_time = comp + np.nan_to_num(wait)
        out["epochs"].append(
            {
                "epoch": e,
                "steps": int(len(comp)),
                "straggler_wait": stats.straggler_wait(comp) if len(comp) else math.nan,
                "measured_wait": float(np.nansum(wait) / np.nansum(step_time)) if len(comp) else math.nan,
            }
        )
    refits = find_one(run_dir, "cost_refit.jsonl")
    out["refits"] = []
    out["replans"] = []
    if refits:
        with open(refits, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if r.get("event") == "replan":  # a mid-epoch replan (RefitConfig.replan_wait)
                    out["replans"].append(r)
                    continue
                out["refits"].append(
                    {
                        k: r.get(k)
                        for k in (
                            "epoch",
                            "step",
                            "status",
                            "reason",
                            "clamped",
                            "change",
                            "applied",
                            "terms",
                        )
                    }
                    | {
                        "error": (r.get("error") or {}).get("all"),
                        "prior_error": (r.get("prior_error") or {}).get("all"),
                    }
                )
    return out


def print_table(result: dict[str, Any]) -> None:
    print("run        epoch  steps  straggler wait  measured wait")
    for label, run in result["runs"].items():
        for e in run["epochs"]:
            print(
                f"{label:<10} {e['epoch']:>5} {e['steps']:>6} {e['straggler_wait']:>14.2%} {e['measured_wait']:>14.2%}"
            )
        for r in run["refits"]:
            err, prior = r.get("error") or {}, r.get("prior_error") or {}
            print(
                f"{label:<10} refit after epoch {r['epoch']}: {r['status']}, applied {r['applied']}, model error mean "
                f"{err.get('mean', math.nan):.1%} / worst {err.get('max', math.nan):.1%} (starting model, best-scaled: "
                f"{prior.get('mean', math.nan):.1%} / {prior.get('max', math.nan):.1%}); terms {r['terms']}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR, e.g. refit_on=/tmp/cl/on/packed")
    ap.add_argument("--warmup", type=int, default=3, help="steps of the first epoch left out")
    ap.add_argument("--out", default=None, help="JSON to write")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "benchmark": "closed_loop",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "warmup_steps": args.warmup,
        "runs": {},
    }
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            ap.error(f"{item!r}: give LABEL=RUN_DIR")
        try:
            result["runs"][label] = run_summary(path, args.warmup)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {label}: {err}", file=sys.stderr)
            return 2
        info = find_one(path, "load_balance.json")
        if info:
            with open(info, encoding="utf-8") as f:
                result["runs"][label]["device"] = ((json.load(f).get("summary") or {}).get("meta") or {}).get(
                    "device"
                )
    print_table(result)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=float)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where slow steps of identical work lose their time: a summary of ``step_probe.py``'s files.

For each run folder under the given path (every ``step_probe_rank*.csv`` found), it takes the steps of the
most common shape (tokens, samples) after the first ``--skip`` steps and after that shape's first step, and
prints per phase (forward,
backward, optimizer, whole step) the GPU time's median and relative spread, the host time beside it, and
the slowest third against the fastest third. A phase whose GPU time moves with its host time points at the
host (launches, Python, GC); a GPU phase that moves alone points at the GPU's work. Where the probe
profiled steps, it compares the slowest and the fastest profiled step of that shape kernel by kernel, with
the GPU's idle time inside each step.

    python benchmarks/balance/step_probe_summary.py RUN_FOLDER [--json OUT.json]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import sys
from collections import Counter
from typing import Any

PHASES = ("forward", "backward", "optimizer", "step")


def _float(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def summarize_rows(rows: list[dict[str, str]], skip: int = 5) -> dict[str, Any]:
    """The summary of one rank file's rows: the common shape's steps, per phase, slow third against fast."""
    # A shape's first step builds its kernels (compile, cuDNN's execution graphs): left out, as the first steps.
    seen: set[tuple[str, str]] = set()
    later = []
    for r in sorted(rows, key=lambda r: int(r["step"])):
        shape = (r["num_tokens"], r["batch_size"])
        if shape in seen:
            later.append(r)
        seen.add(shape)
    rows = [r for r in later if int(r["step"]) > skip and _float(r.get("gpu_step_s")) is not None]
    if not rows:
        return {"steps": 0}
    shape = Counter((r["num_tokens"], r["batch_size"]) for r in rows).most_common(1)[0][0]
    same = [r for r in rows if (r["num_tokens"], r["batch_size"]) == shape and r.get("profiled") in ("0", "", None)]
    out: dict[str, Any] = {"shape": {"tokens": int(shape[0]), "samples": int(shape[1])}, "steps": len(same)}
    if len(same) < 3:
        return out
    same.sort(key=lambda r: float(r["gpu_step_s"]))
    third = max(1, len(same) // 3)
    fast, slow = same[:third], same[-third:]
    phases = {}
    for phase in PHASES:
        gpu = [float(r[f"gpu_{phase}_s"]) for r in same]
        host = [float(r[f"host_{phase}_s"]) for r in same]
        med = statistics.median(gpu)
        phases[phase] = {
            "gpu_median_s": med,
            "gpu_rel_std": statistics.pstdev(gpu) / statistics.fmean(gpu),
            "host_median_s": statistics.median(host),
            "gpu_slow_minus_fast_s": statistics.fmean(float(r[f"gpu_{phase}_s"]) for r in slow)
            - statistics.fmean(float(r[f"gpu_{phase}_s"]) for r in fast),
            "host_slow_minus_fast_s": statistics.fmean(float(r[f"host_{phase}_s"]) for r in slow)
            - statistics.fmean(float(r[f"host_{phase}_s"]) for r in fast),
        }
    out["phases"] = phases
    out["gc"] = {
        "slow_mean_s": statistics.fmean(float(r["gc_s"]) for r in slow),
        "fast_mean_s": statistics.fmean(float(r["gc_s"]) for r in fast),
        "gen2_slow": sum(int(r["gc_gen2"]) for r in slow),
        "gen2_fast": sum(int(r["gc_gen2"]) for r in fast),
    }
    out["slow_steps"] = [int(r["step"]) for r in slow]
    out["fast_steps"] = [int(r["step"]) for r in fast]
    return out


def compare_profiles(profile: dict[str, Any], rows: list[dict[str, str]], top: int = 12) -> dict[str, Any] | None:
    """The slowest against the fastest profiled step of the most common profiled shape, kernel by kernel."""
    shape_of = {int(r["step"]): (r["num_tokens"], r["batch_size"]) for r in rows}
    steps = {int(k): v for k, v in profile.get("steps", {}).items() if v.get("gpu_step_s") is not None}
    if len(steps) < 2:
        return None
    shape = Counter(shape_of.get(s) for s in steps).most_common(1)[0][0]
    same = sorted((s for s in steps if shape_of.get(s) == shape), key=lambda s: steps[s]["gpu_step_s"])
    if len(same) < 2:
        return None
    fast, slow = steps[same[0]], steps[same[-1]]
    names = set(fast["kernels"]) | set(slow["kernels"])
    diff = sorted(
        ((n, slow["kernels"].get(n, 0.0) - fast["kernels"].get(n, 0.0)) for n in names), key=lambda kv: -abs(kv[1])
    )
    return {
        "shape": {"tokens": int(shape[0]), "samples": int(shape[1])},
        "fast": {k: fast[k] for k in ("gpu_step_s", "span_s", "busy_s", "idle_s", "gaps_s")} | {"step": same[0]},
        "slow": {k: slow[k] for k in ("gpu_step_s", "span_s", "busy_s", "idle_s", "gaps_s")} | {"step": same[-1]},
        "kernel_diff_s": dict(diff[:top]),
        "profiled_steps": {s: steps[s]["gpu_step_s"] for s in same},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run folder (searched recursively for step_probe_rank*.csv)")
    ap.add_argument("--skip", type=int, default=5, help="leave out the first steps (compiles, warm-up)")
    ap.add_argument("--json", default=None, help="write the summary here too")
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.run, "**", "*step_probe_rank*.csv"), recursive=True))
    if not files:
        print(f"error: no step_probe_rank*.csv under {args.run}", file=sys.stderr)
        return 2
    result = {}
    for path in files:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        s = summarize_rows(rows, args.skip)
        prof_path = path.replace("step_probe_rank", "step_probe_profile_rank").replace(".csv", ".json")
        if os.path.exists(prof_path):
            with open(prof_path) as f:
                s["profile"] = compare_profiles(json.load(f), rows)
        result[os.path.relpath(path, args.run)] = s
        print(f"{os.path.relpath(path, args.run)}: shape {s.get('shape')}, {s['steps']} unprofiled steps")
        for phase, p in s.get("phases", {}).items():
            print(
                f"  {phase:<9} GPU median {p['gpu_median_s'] * 1e3:8.1f} ms  rel. std {p['gpu_rel_std']:6.2%}  "
                f"host median {p['host_median_s'] * 1e3:8.1f} ms  slow-fast third: GPU "
                f"{p['gpu_slow_minus_fast_s'] * 1e3:+7.1f} ms, host {p['host_slow_minus_fast_s'] * 1e3:+7.1f} ms"
            )
        if "gc" in s:
            g = s["gc"]
            print(
                f"  GC per step: slow third {g['slow_mean_s'] * 1e3:.1f} ms ({g['gen2_slow']} gen-2), "
                f"fast third {g['fast_mean_s'] * 1e3:.1f} ms ({g['gen2_fast']} gen-2)"
            )
        prof = s.get("profile")
        if prof:
            for which in ("fast", "slow"):
                p = prof[which]
                print(
                    f"  profiled {which} step {p['step']}: GPU {p['gpu_step_s'] * 1e3:.1f} ms, kernels busy "
                    f"{p['busy_s'] * 1e3:.1f} ms, idle inside {p['idle_s'] * 1e3:.1f} ms "
                    f"(largest gaps {[round(g * 1e3, 1) for g in p['gaps_s'][:3]]} ms)"
                )
            print("  kernel time, slow minus fast:")
            for name, d in prof["kernel_diff_s"].items():
                print(f"    {d * 1e3:+8.2f} ms  {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Epoch planning time and peak memory, per schedule and scale (CPU only).

Each case runs in a fresh subprocess (its peak RSS is the planner's plus the index's). Run it against
two checkouts to compare (the package is imported from PYTHONPATH)::

    PYTHONPATH=/path/to/old python benchmarks/planning/bench_plan_speed.py --label before --out old.json
    PYTHONPATH=$PWD python benchmarks/planning/bench_plan_speed.py --label after --out new.json

A case: ``N`` samples drawn from the ``wan21_480p`` mix in shards of 1,000, ``R`` ranks, 2 workers,
``max_tokens`` 65,520 (``max_compute="auto"`` for the bucketed schedules). Peak memory above ~4 GiB
at 1,024 ranks and 1M samples: keep the default cases unless the box has room.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

CASES = [
    ("independent", 200_000, 64),
    ("lockstep", 200_000, 64),
    ("packed", 200_000, 64),
    ("independent", 1_000_000, 64),
    ("lockstep", 1_000_000, 64),
    ("packed", 1_000_000, 64),
    ("packed", 200_000, 1024),
    ("packed", 1_000_000, 1024),
]


def _device() -> str:
    """The CPU's model name (the planner runs on the CPU), and the core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def _one(mode: str, n: int, world: int, workers: int, profile: int) -> dict:
    import numpy as np

    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings
    from lightning_adaptiveload.shards.mixes import load_mix

    mix = load_mix("wan21_480p")
    b = mix.sample_buckets(np.random.default_rng(0), n)
    shapes = [tuple(bk.latent_shape) for bk in mix.buckets]
    index = [[shapes[i] for i in b[s : s + 1000]] for s in range(0, n, 1000)]
    batcher = DualConstraintBatcher(
        max_tokens=65520, max_compute=None if mode == "packed" else "auto", partial="emit"
    )
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    plan = plan_epoch(index, world, workers, batcher, 0, 0, PlanSettings(schedule=mode))
    seconds = time.perf_counter() - t
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    return {
        "mode": mode,
        "samples": n,
        "world": world,
        "workers": workers,
        "plan_seconds": round(seconds, 3),
        "steps": plan.steps,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_before_plan_mib": round(rss0 / 1024, 1),
        "device": _device(),
    }


def _table(before_path: str, after_path: str) -> str:
    with open(before_path) as f:
        before = {(r["mode"], r["samples"], r["world"]): r for r in json.load(f)}
    with open(after_path) as f:
        after = json.load(f)
    lines = [
        "| schedule | samples | ranks | before s | after s | speed-up | peak RSS before / after MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in after:
        b = before.get((a["mode"], a["samples"], a["world"]))
        if b is None:
            continue
        lines.append(
            f"| {a['mode']} | {a['samples']:,} | {a['world']:,} | {b['plan_seconds']:.2f} | {a['plan_seconds']:.2f} "
            f"| {b['plan_seconds'] / a['plan_seconds']:.1f}x | {b['peak_rss_mib']:.0f} / {a['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--one", nargs=3, metavar=("MODE", "N", "R"), help="run one case in this process")
    ap.add_argument("--profile", type=int, default=0, help="with --one: print the top N profile entries")
    ap.add_argument("--cases", default="", help="comma-separated case numbers (default all)")
    ap.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"), help="markdown table of two runs")
    args = ap.parse_args()
    if args.table:
        print(_table(*args.table))
        return
    if args.one:
        mode, n, r = args.one
        print(json.dumps(_one(mode, int(n), int(r), args.workers, args.profile)))
        return
    picked = [CASES[int(k)] for k in args.cases.split(",")] if args.cases else CASES
    rows = []
    for mode, n, r in picked:
        cmd = [sys.executable, __file__, "--one", mode, str(n), str(r), "--workers", str(args.workers)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]) | {"label": args.label})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

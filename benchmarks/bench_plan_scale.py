"""Index load + epoch planning at scale on CPU (issue 16): what one rank spends before its first step.

For each size a synthetic binary index (``index.npidx``: wan21_480p shapes, 1,000 samples a shard; the
generator of ``bench_index_scale.py``) is written once; then, per schedule, a fresh process loads it
(``CompactIndex.load``) and plans one epoch for 64 ranks x 2 workers (``plan_epoch``, ``max_tokens``
65,520, ``max_compute="auto"`` for the bucketed schedules). Each process reports its load and plan wall
times and its peak resident memory (VmHWM, imports included; the imports alone are reported apart; with
``--processes`` > 1 also the largest planning process's peak, which VmHWM does not count). With
``--repeats`` N, N fresh processes run per point; the fastest is fitted and all are kept.
With ``--resume-at F`` (issue 40) a further fresh process per point restarts the epoch after a fraction F
of its steps on every rank, as a failed job resumes: it loads the index and resumes rank ``--rank``'s
position (``data.resume.resume_plan``: that rank's plan, continued at its position), timed and measured
the same way (rows with ``"case": "resume"``). ``--world`` takes a list: every world size is run.
A straight line and a power law are fitted per schedule to extrapolate to 100M samples; both are written,
with the points, to ``benchmarks/results/plan_scale_<cpu>_<date>.json``. Never asserts a time. Run::

    python benchmarks/bench_plan_scale.py                         # 1M, 2M, 5M, 10M (packed: 1M, 2M)
    python benchmarks/bench_plan_scale.py --sizes "" --packed-sizes 1e6,1e7,2e7,5e7,1e8 --rank 0 --repeats 3
    python benchmarks/bench_plan_scale.py --sizes 1e8 --packed-sizes 1e8 --world 1024 --rank 0 --repeats 3 \
        --chunk 10000000 --resume-at 0.5                         # issue 40: 100M samples on 1,024 ranks
    python benchmarks/bench_plan_scale.py --sizes 1e5 --packed-sizes 1e5   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# This checkout's package, as in the measured processes (``-c`` runs import it from the working directory,
# the repository root): an installed copy elsewhere would write the index with other code.
sys.path.insert(1, os.path.dirname(HERE))
from _common import cpu_name  # noqa: E402
from bench_index_scale import synthetic_columns  # noqa: E402

from lightning_adaptiveload.shards.columnar import write_columns  # noqa: E402

_ONE = r"""
import json, resource, sys, time
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                yield line.split(":")[0], int(line.split()[1]) / 1024
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
before = dict(hwm())
path, mode, world, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
chunk, rank = int(sys.argv[5]) or None, (None if int(sys.argv[6]) < 0 else int(sys.argv[6]))
procs = int(sys.argv[7])
t = time.perf_counter()
index = CompactIndex.load(path)
load_s = time.perf_counter() - t
batcher = DualConstraintBatcher(65520, max_compute=None if mode == "packed" else "auto", partial="emit")
t = time.perf_counter()
plan = plan_epoch(index, world, workers, batcher, 0, 0,
                  PlanSettings(schedule=mode, chunk_samples=chunk, plan_processes=procs), rank=rank)
plan_s = time.perf_counter() - t
after = dict(hwm())
rep = plan.report
print(json.dumps({"load_s": load_s, "plan_s": plan_s, "steps": plan.steps, "segments": rep.get("segments", 1),
                  "unequal_steps": rep["unequal_steps"], "packed_tail_steps": rep.get("packed_tail_steps", 0),
                  "empty_batches": rep["empty_batches"], "est_compute_cv": rep["est_compute_cv"],
                  "est_straggler_wait": rep["est_straggler_wait"], "fill_mean": rep.get("fill_mean"),
                  "planned_on_counts": rep.get("planned_on_counts"),
                  "imports_mib": before["VmRSS"], "peak_mib": after["VmHWM"], "rss_after_mib": after["VmRSS"],
                  "largest_child_peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

# A restart at a fraction of the epoch: the index loaded, this rank's position resumed (positional resume).
_RESUME = r"""
import json, resource, sys, time
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                yield line.split(":")[0], int(line.split()[1]) / 1024
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.loading.loader import PlannedShardDataset
from lightning_adaptiveload.loading.resume import STATE_VERSION, resume_plan
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import PlanSettings
before = dict(hwm())
path, mode, world, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
chunk, rank, done = int(sys.argv[5]) or None, max(0, int(sys.argv[6])), int(sys.argv[7])
t = time.perf_counter()
index = CompactIndex.load(path)
load_s = time.perf_counter() - t
t = time.perf_counter()
batcher = DualConstraintBatcher(65520, max_compute=None if mode == "packed" else "auto", partial="emit")
ds = PlannedShardDataset(index, batcher, PlanSettings(schedule=mode, chunk_samples=chunk), seed=0, num_workers=workers,
                         placement=(rank, world))
state = {"version": STATE_VERSION, "fingerprint": ds.fingerprint, "epoch": 0,
         "segments": [{"kind": "fresh", **ds.plan_settings(), "consumed": [done] * world}]}
resumed = resume_plan(ds, state)
plan_s = time.perf_counter() - t
after = dict(hwm())
print(json.dumps({"load_s": load_s, "plan_s": plan_s, "steps": resumed.plan.steps, "resumed_at_step": done,
                  "resume_kind": resumed.kind, "imports_mib": before["VmRSS"], "peak_mib": after["VmHWM"],
                  "rss_after_mib": after["VmRSS"]}))
"""


def _fastest(cmd: list[str], repeats: int) -> tuple[dict, list[dict]]:
    """The fastest of ``repeats`` fresh processes (a shared machine only ever adds time), and all."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(runs, key=lambda r: r["load_s"] + r["plan_s"]), runs


def _fits(xs: np.ndarray, ys: np.ndarray, at: float = 1e8) -> dict:
    if len(xs) < 2:
        return {}
    slope, intercept = np.polyfit(xs, ys, 1)
    k, log_c = np.polyfit(np.log(xs), np.log(ys), 1)
    return {
        "linear": {"per_million": slope * 1e6, "intercept": intercept, "at_100M": slope * at + intercept},
        "power": {"exponent": k, "at_100M": float(np.exp(log_c) * at**k)},
        "points": len(xs),
    }


def _point(path: str, n: int, mode: str, world: int, args: argparse.Namespace) -> list[dict]:
    """The plan (and with ``--resume-at``, the restart) of one size, schedule and world size."""
    common = [path, mode, str(world), str(args.workers), str(args.chunk), str(args.rank)]
    best, runs = _fastest([sys.executable, "-c", _ONE, *common, str(args.processes)], args.repeats)
    rows = [{"samples": n, "mode": mode, "world_size": world, "case": "plan", **best}]
    if args.resume_at:
        done = int(best["steps"] * args.resume_at)
        again, more = _fastest([sys.executable, "-c", _RESUME, *common, str(done)], args.repeats)
        rows.append({"samples": n, "mode": mode, "world_size": world, "case": "resume", **again})
        runs += more
    for row, group in zip(rows, (runs[: args.repeats], runs[args.repeats :])):
        if args.repeats > 1:
            row["all_load_plus_plan_s"] = [r["load_s"] + r["plan_s"] for r in group]
        print(
            f"{mode:12s} {n:>11,d} x {world:5d} ranks {row['case']:6s}  load {row['load_s']:6.2f} s  "
            f"plan {row['plan_s']:7.2f} s  peak {row['peak_mib']:7.0f} MiB (imports {row['imports_mib']:.0f})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,2e6,5e6,1e7", help="samples, for independent and lockstep")
    ap.add_argument("--packed-sizes", default="1e6,2e6", help="samples, for packed")
    ap.add_argument("--world", default="64", help="world sizes, comma-separated (1024: issue 40)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument("--chunk", type=int, default=0, help="plan_epoch(chunk_samples=...); 0: at once")
    ap.add_argument("--processes", type=int, default=1, help="plan_epoch(plan_processes=...)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per point; the fastest is fitted")
    ap.add_argument(
        "--resume-at",
        type=float,
        default=0.0,
        help="also time a restart after this share of the epoch; 0: no",
    )
    ap.add_argument(
        "--rank", type=int, default=-1, help="plan_epoch(rank=...): a rank-local plan; -1: every stream"
    )
    ap.add_argument(
        "--schedules",
        default="independent,lockstep,packed",
        help="comma-separated: which schedules to run (each at its sizes)",
    )
    args = ap.parse_args()
    schedules = [m for m in ("independent", "lockstep", "packed") if m in args.schedules.split(",")]
    if not schedules or set(args.schedules.split(",")) - set(schedules):
        ap.error(f"--schedules {args.schedules!r}: choose from independent, lockstep, packed")
    worlds = [int(w) for w in str(args.world).split(",") if w]
    sizes = sorted({int(float(x)) for x in args.sizes.split(",") + args.packed_sizes.split(",") if x})
    packed_sizes = {int(float(x)) for x in args.packed_sizes.split(",") if x}
    bucketed_sizes = {int(float(x)) for x in args.sizes.split(",") if x}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = os.path.join(tmp, f"index_{n}.npidx")
            write_columns(path, synthetic_columns(n, seed=1))
            for world in worlds:
                for mode in schedules:
                    if n not in (packed_sizes if mode == "packed" else bucketed_sizes):
                        continue
                    rows += _point(path, n, mode, world, args)
            os.unlink(path)
    fits = {}
    for mode in schedules:
        sel = [r for r in rows if r["mode"] == mode and r["case"] == "plan" and r["world_size"] == worlds[-1]]
        xs = np.array([r["samples"] for r in sel], dtype=np.float64)
        fits[mode] = {
            "load_plus_plan_s": _fits(xs, np.array([r["load_s"] + r["plan_s"] for r in sel])),
            "peak_mib": _fits(xs, np.array([r["peak_mib"] for r in sel])),
        }
    result = {
        "benchmark": "plan_scale",
        "cpu": cpu_name(),
        "date": datetime.date.today().isoformat(),
        "settings": {
            "mix": "wan21_480p",
            "samples_per_shard": 1000,
            "world_size": worlds,
            "resume_at": args.resume_at or None,
            "num_workers": args.workers,
            "max_tokens": 65520,
            "index": "binary (index.npidx), CompactIndex.load in a fresh process",
            "chunk_samples": args.chunk or None,
            "rank": None if args.rank < 0 else args.rank,
            "plan_processes": args.processes,
            "repeats": args.repeats,
        },
        "targets_at_100M": {"load_plus_plan_s": 30, "peak_gb": 2},
        "rows": rows,
        "fits": fits,
    }
    out = args.out or os.path.join(
        HERE, "results", f"plan_scale_{cpu_name().split()[0].lower()}_{result['date']}.json"
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"fits: world size {worlds[-1]}")
    for mode, fit in fits.items():
        t, m = fit["load_plus_plan_s"], fit["peak_mib"]
        if t:
            print(
                f"{mode:12s} at 100M: {t['linear']['at_100M']:7.0f} s linear, {t['power']['at_100M']:7.0f} s "
                f"power (exponent {t['power']['exponent']:.2f}); peak {m['linear']['at_100M'] / 1024:6.1f} GiB"
            )
    print("wrote", out)


if __name__ == "__main__":
    main()

"""Simulated balance of the lockstep schedule with and without its packed tail (CPU, no GPU).

Lockstep pairs the ranks' batches class by class; where the classes stop lining up (the end of an epoch
on a mix of many length classes) it used to take unequal bucketed batches. With ``lockstep_tail="packed"``
those samples are re-planned as balanced packs (``planning/tail.py``). Each configuration plans an epoch
of about ``--steps`` steps per rank with the real planner (``tools/simulate.py``) and replays it with the
pack cost model fitted to our H100 trace (as ``bench_packed_balance.py``). Writes
``benchmarks/results/lockstep_tail_<date>.json`` (one row per mix, max_tokens, world size and tail).
Usage::

    python benchmarks/balance/bench_lockstep_tail.py [--worlds 8,16,64,1024] [--steps 128]
    python benchmarks/balance/bench_lockstep_tail.py --table benchmarks/results/lockstep_tail_<date>.json
    python benchmarks/balance/bench_lockstep_tail.py --trace TRACE.jsonl --worlds 1024 --configs wan21_480p:32760

With ``--trace`` the bucketed batches are timed by a measured per-bucket trace and planned with the
simulator's default model (as ``bench_balance_trace.py``), the packs by the trace's fitted model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_packed_balance import TRACE, trace_pack_model  # noqa: E402

from lightning_adaptiveload.shards.mixes import Bucket, Mix  # noqa: E402
from lightning_adaptiveload.tools.simulate import simulate  # noqa: E402
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings  # noqa: E402

CONFIGS = [  # (mix, max_tokens)
    ("wan21_480p", 32760),
    ("wan21_480p", 65520),
    ("wan21_720p", 131040),
    ("native_480p", 32760),
    ("native_480p", 65520),
    ("many_lengths_480p", 65520),
]


def many_lengths_mix() -> Mix:
    """Wan 2.1 480p geometry with every frame count 4n+1 up to 81 (21 latent lengths) in three aspects:
    63 buckets, dozens of lockstep classes. 20% images, 30% full-length clips, the other 50% spread evenly
    over the 19 lengths between (a modelling choice for a set cut at scene boundaries, not measured data)."""
    aspects = [((60, 104), 0.7, (480, 832)), ((104, 60), 0.2, (832, 480)), ((80, 80), 0.1, (640, 640))]
    buckets = []
    for t in range(1, 22):
        p_len = 0.2 if t == 1 else 0.3 if t == 21 else 0.5 / 19
        for (h, w), p_asp, (ph, pw) in aspects:
            buckets.append(
                Bucket((16, t, h, w), p_len * p_asp, t * (h // 2) * (w // 2), 4 * (t - 1) + 1, ph, pw)
            )
    return Mix("many_lengths_480p", tuple(buckets), note=many_lengths_mix.__doc__ or "")


def table(path: str) -> None:
    """Print the JSON results as the markdown table of docs/load_balance_report.md (bucketed -> packed)."""
    rows = json.load(open(path))["rows"]
    by = {(r["mix"], r["max_tokens"], r["world_size"], r["lockstep_tail"]): r for r in rows}
    print(
        "| mix | max_tokens | ranks | steps | CV mean | CV p95 | wait | fill | unequal steps | packed tail steps "
        "(share) | tail fill |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def pair(a: dict, b: dict, key: str) -> str:
        return f"{100 * a[key]:.2f}% -> {100 * b[key]:.2f}%"

    for (mix, mt, world, tail), b in by.items():
        a = by.get((mix, mt, world, "bucketed"))
        if tail != "packed" or a is None:
            continue
        print(
            f"| {mix} | {mt:,} | {world} | {a['steps']} -> {b['steps']} | {pair(a, b, 'cv_mean')} | "
            f"{pair(a, b, 'cv_p95')} | {pair(a, b, 'straggler_wait')} | {pair(a, b, 'fill')} | "
            f"{a['unequal_bucketed_steps']} -> {b['unequal_bucketed_steps']} | {b['packed_tail_steps']} "
            f"({100 * b['packed_tail_share']:.1f}%) | {100 * b['tail_fill_mean']:.1f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,16,64,1024")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--tails", default="bucketed,packed")
    parser.add_argument("--configs", default=None, help="mix:max_tokens,... (default: CONFIGS)")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--trace", default=None, help="time with this per-bucket trace (JSONL or anchor .txt)"
    )
    parser.add_argument("--table", default=None, help="print a results JSON as a markdown table and exit")
    args = parser.parse_args()
    if args.table:
        table(args.table)
        return
    model = trace_pack_model()
    times, plan_cost = (args.trace, None) if args.trace else (model, model)
    worlds = [int(x) for x in args.worlds.split(",")]
    out = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "results",
        f"lockstep_tail_{datetime.date.today().isoformat()}.json",
    )
    configs = CONFIGS
    if args.configs:
        configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    rows = []
    for name, max_tokens in configs:
        source = many_lengths_mix() if name == "many_lengths_480p" else name
        for world in worlds:
            for tail in args.tails.split(","):
                t0 = time.perf_counter()
                res = simulate(
                    source,
                    settings=SimulateSettings(
                        world_sizes=[world],
                        variants=["lockstep"],
                        max_tokens=max_tokens,
                        recommend=False,
                        min_steps_per_rank=args.steps,
                        plan_options={"lockstep_tail": tail},
                    ),
                    times=times,
                    plan_cost_model=plan_cost,
                    plots=False,
                    progress=False,
                )
                for row in res.rows:
                    if row["variant"] != "lockstep":
                        continue
                    rep = row.get("plan_report") or {}
                    steps = row.get("steps") or 0
                    rows.append(
                        {
                            "mix": name,
                            "max_tokens": max_tokens,
                            "world_size": world,
                            "schedule": "lockstep",
                            "lockstep_tail": tail,
                            "steps": steps,
                            "cv_mean": row["cv_mean"],
                            "cv_p95": row["cv_p95"],
                            "straggler_wait": row["straggler_wait"],
                            "fill": row.get("token_fill"),
                            "tokens_per_s_ratio": row.get("tokens_per_s_ratio"),
                            "unequal_bucketed_steps": rep.get("lockstep_tail_steps"),
                            "packed_tail_steps": rep.get("packed_tail_steps"),
                            "packed_tail_share": (rep.get("packed_tail_steps") or 0) / steps
                            if steps
                            else 0.0,
                            "packed_tail_samples": rep.get("packed_tail_samples"),
                            "tail_fill_mean": rep.get("tail_fill_mean"),
                            "shard_opens_per_rank": (rep.get("reads") or 0) / world,
                            "plan_seconds": rep.get("plan_seconds"),
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
                print(f"# {name} {max_tokens} {world} {tail}: {time.perf_counter() - t0:.0f} s", flush=True)
                meta = {
                    "date": datetime.date.today().isoformat(),
                    "machine": platform.processor() or platform.machine(),
                    "device": "none (CPU simulation)",
                    "cost_model": model.to_dict()
                    if not args.trace
                    else "simulator default (p fitted to the trace)",
                    "trace": os.path.basename(args.trace or TRACE),
                    "steps_per_rank": args.steps,
                    "num_workers": 1,
                }
                with open(out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

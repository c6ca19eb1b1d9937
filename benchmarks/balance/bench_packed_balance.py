"""Simulated balance and fill of the packed schedule beside lockstep and equal_tokens (CPU, no GPU).

Each configuration plans a 128-step epoch with the real planner (``tools/simulate.py``) and replays it
with the pack cost model fitted to our H100 trace (``c0 + sum alpha*S + beta*S^2``, see
``CostModel.fit_packs``). Writes ``benchmarks/results/packed_balance_<date>.json`` (one row per mix,
max_tokens, world size and schedule). Usage::

    python benchmarks/balance/bench_packed_balance.py [--worlds 8,64,1024] [--steps 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.tools.simulate import simulate
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

TRACE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "results",
    "trace_wan13b_h100_2026-11-23.jsonl",
)
CONFIGS = [  # (mix, max_tokens)
    ("wan21_480p", 32760),
    ("wan21_480p", 65520),
    ("native_480p", 32760),
    ("native_480p", 65520),
    ("wan21_720p", 131040),
]


def trace_pack_model() -> CostModel:
    """The pack cost model fitted to the H100 trace's packs and single samples (seconds per step)."""
    rows = [json.loads(line) for line in open(TRACE) if line.startswith("{")]
    return CostModel.fit_packs([[r["S"]] * r["B"] for r in rows], [r["ms"] / 1e3 for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64,1024")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--schedules", default="packed,lockstep,equal_tokens")
    parser.add_argument("--configs", default=None, help="mix:max_tokens,... (default: CONFIGS)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = trace_pack_model()
    worlds = [int(x) for x in args.worlds.split(",")]
    modes = args.schedules.split(",")
    out = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "results",
        f"packed_balance_{datetime.date.today().isoformat()}.json",
    )
    rows = []
    configs = CONFIGS
    if args.configs:
        configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    for mix, max_tokens in configs:
        for world in worlds:
            t0 = time.perf_counter()
            res = simulate(
                mix,
                settings=SimulateSettings(
                    world_sizes=[world],
                    variants=modes,
                    max_tokens=max_tokens,
                    recommend=False,
                    min_steps_per_rank=args.steps,
                ),
                times=model,
                plan_cost_model=model,
                plots=False,
                progress=False,
            )
            for row in res.rows:
                rep = row.get("plan_report") or {}
                rows.append(
                    {
                        "mix": mix,
                        "max_tokens": max_tokens,
                        "world_size": world,
                        "schedule": row["variant"],
                        "steps": row.get("steps"),
                        "cv_mean": row["cv_mean"],
                        "cv_p95": row["cv_p95"],
                        "straggler_wait": row["straggler_wait"],
                        "fill": row.get("token_fill"),
                        # Shard reads a rank opens in the epoch (each a seek into one shard).
                        "shard_opens_per_rank": (rep.get("reads") or 0) / world,
                        "order_rank_correlation": rep.get("order_rank_correlation"),
                        "plan_seconds": rep.get("plan_seconds"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            print(f"# {mix} {max_tokens} {world}: {time.perf_counter() - t0:.0f} s", flush=True)
            meta = {
                "date": datetime.date.today().isoformat(),
                "machine": platform.processor() or platform.machine(),
                "device": "none (CPU simulation)",
                "cost_model": model.to_dict(),
                "trace": os.path.basename(TRACE),
                "steps_per_rank": args.steps,
            }
            with open(out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

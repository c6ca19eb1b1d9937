"""Every schedule at two (or more) ``max_tokens``: one table of balance, wait, tokens/s and fill (CPU only).

Plans one epoch per (schedule, max_tokens) with the real planner (``tools/simulate.py``) on the
wan21_480p mix at 16 ranks and replays it with the pack cost model fitted to our H100 trace
(``c0 + sum alpha*S + beta*S^2``, :meth:`CostModel.fit_packs`; the same model prices every schedule,
so that a pack and a bucketed batch of the same samples cost the same). ``dual`` and ``lockstep`` plan
with that model and ``max_compute="auto"``. Writes ``benchmarks/results/schedule_table_<date>.json`` and
prints the markdown table of ``docs/load_balance_report.md`` ("Every schedule at two budgets")::

    python benchmarks/balance/schedule_table.py [--max-tokens 32760,65520,131040] [--world 16] [--steps 128]
        [--cost-model calib.yaml]  # plan and replay with a calibrated fragment's cost model instead

``lockstep`` and ``packed`` are whatever ``planning/lockstep.py`` and ``planning/packed.py`` do in the
checkout it runs in: re-run it after a change to either (one command, a few minutes on one core).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from lightning_adaptiveload.monitor.report import jsonable
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.tools.simulate import simulate
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
TRACE = os.path.join(HERE, "results", "trace_wan13b_h100_2026-11-23.jsonl")
SCHEDULES = ("equal_tokens", "dual", "lockstep", "packed")
LABELS = {  # schedule name in the table: (schedule, batching)
    "equal_tokens": "independent + equal_tokens",
    "dual": "independent + dual",
    "lockstep": "lockstep (+ dual)",
    "packed": "packed",
}


def trace_pack_model() -> CostModel:
    """The pack cost model fitted to the H100 trace's batches (seconds per step)."""
    rows = [json.loads(line) for line in open(TRACE) if line.startswith("{")]
    return CostModel.fit_packs([[r["S"]] * r["B"] for r in rows], [r["ms"] / 1e3 for r in rows])


def calibrated_model(path: str) -> CostModel:
    """The cost model of a ``calibrate`` fragment (``data.init_args.batching.cost_model``; before the settings
    groups, ``data.init_args.cost_model``)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    try:
        args = data["data"]["init_args"]
        return CostModel.from_dict((args.get("batching") or args)["cost_model"])
    except (KeyError, TypeError, AttributeError):
        raise SystemExit(
            f"{path}: no data.init_args.batching.cost_model; pass a fragment written by calibrate"
        ) from None


def markdown(rows: list[dict]) -> str:
    """The table: one line per (max_tokens, schedule)."""
    out = [
        "| max_tokens | schedule | steps / rank | imbalance (max/mean - 1) | CV mean | straggler wait | "
        "tokens/s vs equal_tokens | memory fill (tokens / max_tokens) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['max_tokens']:,} | {LABELS.get(r['variant'], r['variant'])} | {r['steps']} | "
            f"{100 * r['imbalance_mean']:.1f}% | {100 * r['cv_mean']:.1f}% | {100 * r['straggler_wait']:.1f}% | "
            f"{100 * (r['tokens_per_s_ratio'] - 1):+.1f}% | {100 * r['token_fill']:.1f}% |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", default="wan21_480p")
    parser.add_argument("--max-tokens", default="32760,65520,131040")
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128, help="steps per rank of equal_tokens")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument(
        "--cost-model", help="a calibrate fragment (YAML) whose cost model replaces the trace fit"
    )
    parser.add_argument(
        "--times",
        choices=("pack", "trace"),
        default="pack",
        help="replay with the pack cost model (c0 per step, default) or the trace's per-bucket table "
        "(batch times scaled in proportion to B, no per-step constant; packs priced by its quadratic fit)",
    )
    parser.add_argument(
        "--plan",
        choices=("pack", "p"),
        default="pack",
        help="dual and lockstep plan with the pack cost model (default) or with S^p, p fitted to the times",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = calibrated_model(args.cost_model) if args.cost_model else trace_pack_model()
    out = args.out or os.path.join(
        HERE, "results", f"schedule_table_{datetime.date.today().isoformat()}.json"
    )
    rows = []
    for max_tokens in [int(x) for x in args.max_tokens.split(",")]:
        t0 = time.perf_counter()
        res = simulate(
            args.mix,
            settings=SimulateSettings(
                world_sizes=[args.world],
                variants=args.schedules.split(","),
                max_tokens=max_tokens,
                recommend=False,
                min_steps_per_rank=args.steps,
            ),
            times=model if args.times == "pack" else TRACE,
            plan_cost_model=model if args.plan == "pack" else None,
            plots=False,
            progress=False,
        )
        for row in res.rows:
            keep = (
                "variant",
                "schedule",
                "batching",
                "world_size",
                "steps",
                "max_compute",
                "imbalance_mean",
                "cv_mean",
                "cv_p95",
                "straggler_wait",
                "tokens_per_s",
                "tokens_per_s_ratio",
                "token_fill",
                "compute_fill",
                "vram_utilisation",
                "peak_tokens",
            )
            rows.append({"mix": args.mix, "max_tokens": max_tokens, **{k: row.get(k) for k in keep}})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        print(f"# {max_tokens}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "device": "none (CPU simulation)",
        "mix": args.mix,
        "world_size": args.world,
        "steps_per_rank": args.steps,
        "cost_model": model.to_dict(),
        "cost_model_source": args.cost_model or os.path.basename(TRACE),
        "max_compute": "auto (the batcher's rule) for dual and lockstep",
        "times": args.times,
        "plan": args.plan,
        "command": "python benchmarks/balance/schedule_table.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(jsonable({"meta": meta, "rows": rows}), f, indent=1)  # NaN written as null
    print(markdown(rows))


if __name__ == "__main__":
    main()

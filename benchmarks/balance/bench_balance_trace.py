"""Trace-driven balance simulation: measured per-bucket step times -> CV, straggler wait, tokens/s per mode.

Takes one or more step-time traces (JSONL, one line per (T, H, W, B): the anchor trace of diffusers' Wan 2.1
1.3B on an H100, and/or ours from ``benchmarks/balance/gpu_trace_wan13b.py``), and simulates with the real planner
(:func:`lightning_adaptiveload.tools.simulate.simulate`) the wan21_480p mix at 2, 8, 16 and 64 ranks in the modes
``equal_tokens``, ``dual`` (p fitted to the trace, ``max_compute="auto"``), ``lockstep`` (dual constraint) and
``lockstep_equal_tokens``. Then it checks the anchor README's numbers for the equal-token baseline (9.7% wait
at 2 ranks, 13% at 8 to 64) in two ways: by the planner-driven simulation, and by the anchor's own replay (each
rank draws its batches independently, with the batches' frequencies), which has no end-of-epoch effects.

Writes ``benchmarks/results/balance_trace_<trace>_<date>.json`` and PNG plots (default: ``docs/img/``).

Run (CPU, 1 to 5 minutes on 2 cores, depending on load)::

    python benchmarks/balance/bench_balance_trace.py
    python benchmarks/balance/bench_balance_trace.py --trace benchmarks/results/trace_wan-13b_nvidia_h100_....jsonl
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import sys
import time

import numpy as np

from lightning_adaptiveload.monitor.report import jsonable
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
_ANCHOR = os.path.join(ROOT, "..", "shared", "anchors", "trace_wan13b_h100_2026-11-22.txt")
# The anchor README's figures for the equal-token baseline on this trace and mix.
_ANCHOR_WAIT = {2: 0.097, 8: 0.13, 16: 0.13, 64: 0.13}
_ANCHOR_CV = {2: 0.12, 8: 0.215, 16: 0.215, 64: 0.215}


def iid_replay(table, mix, max_tokens: int, world: int, steps: int, seed: int) -> dict[str, float]:
    """The anchor's own replay: every rank draws each batch independently with the batches' frequencies.

    A bucket with share p and equal-token batch size B makes p / B of the batches. This is the steady state
    of the ``equal_tokens`` mode with no end of epoch: the reference the planner-driven numbers are
    compared with. It is not the simulator (which runs the real planner); it only checks the trace's numbers.
    """
    from lightning_adaptiveload.tools.replay import balance_metrics

    shapes = [b.latent_shape for b in mix.buckets]
    sizes = np.array([max(1, max_tokens // b.tokens) for b in mix.buckets])
    freq = mix.probabilities / sizes
    freq /= freq.sum()
    secs = np.array([table.batch_seconds(s[1:], int(b)) for s, b in zip(shapes, sizes)])
    toks = np.array([b.tokens for b in mix.buckets]) * sizes
    draw = np.random.default_rng(seed).choice(len(shapes), size=(steps, world), p=freq)
    return balance_metrics(secs[draw], toks[draw], max_tokens=max_tokens)


def _trace_name(path: str) -> str:
    base = os.path.splitext(os.path.basename(path))[0]
    return base.replace("trace_", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trace", action="append", default=None, help="JSONL trace(s); default: the anchor trace"
    )
    ap.add_argument("--mix", default="wan21_480p")
    ap.add_argument("--world-sizes", default="2,8,16,64")
    ap.add_argument("--modes", default="equal_tokens,dual,lockstep,lockstep_equal_tokens")
    ap.add_argument("--max-tokens", type=int, default=32760)
    ap.add_argument("--min-steps-per-rank", type=int, default=1000, help="epoch length simulated per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--large", type=int, default=1024, help="also time one run at this world size (0: skip)")
    ap.add_argument(
        "--lockstep-buffer",
        type=int,
        default=256,
        help="also simulate lockstep with this buffer bound (0: skip)",
    )
    ap.add_argument("--large-steps", type=int, default=128, help="epoch length per rank of the large run")
    ap.add_argument("--results", default=os.path.join(BENCH, "results"))
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)

    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import StepTimeTable, simulate
    from lightning_adaptiveload.tools.simulate_plots import plot_result

    traces = args.trace
    if not traces:
        traces = [p for p in [_ANCHOR] if os.path.isfile(p)]
        traces += sorted(glob.glob(os.path.join(BENCH, "results", "trace_*.jsonl")))
    if not traces:
        print(
            "error: no trace found; pass --trace PATH (a JSONL with T, H, W, B, ms per line)", file=sys.stderr
        )
        return 2
    sizes = [int(v) for v in args.world_sizes.split(",") if v]
    modes = [m for m in args.modes.split(",") if m]
    mix = load_mix(args.mix)
    os.makedirs(args.results, exist_ok=True)
    os.makedirs(args.img, exist_ok=True)
    date = _dt.date.today().isoformat()
    for trace in traces:
        name = _trace_name(trace)
        print(f"== {trace}")
        started = time.perf_counter()
        result = simulate(
            mix,
            settings=SimulateSettings(
                world_sizes=sizes,
                variants=modes,
                max_tokens=args.max_tokens,
                min_steps_per_rank=args.min_steps_per_rank,
                max_candidates=args.candidates,
                seed=args.seed,
            ),
            times=trace,
        )
        if args.lockstep_buffer:
            # The planner's per-stream buffer bound decides whether lockstep stays aligned at many ranks:
            # simulate lockstep once more with a larger bound, as a row of its own.
            extra = simulate(
                mix,
                settings=SimulateSettings(
                    world_sizes=sizes,
                    variants=["lockstep"],
                    max_tokens=args.max_tokens,
                    min_steps_per_rank=args.min_steps_per_rank,
                    recommend=False,
                    seed=args.seed,
                    plan_options={"max_buffered_samples": args.lockstep_buffer},
                ),
                times=trace,
            )
            label = f"lockstep_buffer{args.lockstep_buffer}"
            for row in extra.rows:
                if row["variant"] == "lockstep":
                    row["variant"] = label
                    result.rows.append(row)
                    result.per_step_cv[(label, row["world_size"])] = extra.per_step_cv[
                        ("lockstep", row["world_size"])
                    ]
            result.meta["extra_rows"] = {
                label: {"plan_options": {"max_buffered_samples": args.lockstep_buffer}}
            }
        elapsed = time.perf_counter() - started
        print(result.table())
        table = StepTimeTable.from_jsonl(trace)
        check = []
        for w in sizes:
            iid = iid_replay(table, mix, args.max_tokens, w, steps=20000, seed=args.seed)
            sim = result.row("equal_tokens", w)
            check.append(
                {
                    "world_size": w,
                    "anchor_readme_wait": _ANCHOR_WAIT.get(w),
                    "anchor_readme_cv": _ANCHOR_CV.get(w),
                    "iid_replay_wait": iid["wait_share"],
                    "iid_replay_cv": iid["cv_mean"],
                    "iid_replay_tokens_per_s_gain_if_no_wait": 1 / (1 - iid["wait_share"]) - 1,
                    "simulated_wait": sim["wait_share"],
                    "simulated_cv": sim["cv_mean"],
                    "simulated_wait_first90": sim["wait_share_first90"],
                    "simulated_cv_first90": sim["cv_mean_first90"],
                }
            )
        print("equal_tokens sanity check (wait / CV): anchor README vs iid replay vs planner simulation")
        for c in check:
            print(
                f"  {c['world_size']:>4} ranks: README {100 * (c['anchor_readme_wait'] or np.nan):5.1f}% / "
                f"{100 * (c['anchor_readme_cv'] or np.nan):4.1f}%   iid {100 * c['iid_replay_wait']:5.1f}% / "
                f"{100 * c['iid_replay_cv']:4.1f}%   planner {100 * c['simulated_wait']:5.1f}% / "
                f"{100 * c['simulated_cv']:4.1f}% (first 90% of steps: {100 * c['simulated_wait_first90']:5.1f}% / "
                f"{100 * c['simulated_cv_first90']:4.1f}%)"
            )
        large = None
        if args.large:
            t0 = time.perf_counter()
            big = simulate(
                mix,
                settings=SimulateSettings(
                    world_sizes=[args.large],
                    variants=modes,
                    max_tokens=args.max_tokens,
                    min_steps_per_rank=args.large_steps,
                    recommend=False,
                    seed=args.seed,
                ),
                times=trace,
                progress=False,
            )
            large = {
                "world_size": args.large,
                "min_steps_per_rank": args.large_steps,
                "elapsed_s": time.perf_counter() - t0,
                "rows": [
                    {
                        k: r[k]
                        for k in ("variant", "steps", "cv_mean", "cv_p95", "wait_share", "tokens_per_s_ratio")
                    }
                    for r in big.rows
                ],
            }
            print(
                f"{args.large} ranks, {len(modes)} modes, {args.large_steps} steps per rank: {large['elapsed_s']:.1f} s"
            )
            print(big.table())
        payload = result.to_dict()
        payload["benchmark"] = {
            "script": "benchmarks/balance/bench_balance_trace.py",
            "trace": os.path.relpath(trace, ROOT) if trace.startswith(ROOT) else trace,
            "date": date,
            "elapsed_s": elapsed,
            "anchor_check": check,
            "large": large,
        }
        out = os.path.join(args.results, f"balance_trace_{name}_{date}.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(jsonable(payload), f, indent=1)
        plots = plot_result(result, args.img, prefix=f"balance_{name}_")
        print(f"wrote {out}; plots: {', '.join(sorted(plots.values()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How often does ``plan_epoch`` refuse an epoch that can be planned? (issue 13, item 1)

Plans random small epochs (1-16 ranks, 0-4 workers, both schedules, at least 4 samples per stream, so that
every rank can get at least one sample) and counts the ``PlanError``s; then the wan21_480p mix sampled to
1,024 samples on 64 ranks. Every plan that succeeds is checked for exactly-once and equal step counts.
Writes ``results/plan_feasibility.json``. Run: ``python benchmarks/planning/plan_feasibility.py [--plans 3000]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.plan import PlanError
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings

SHAPES = [(4, t, h, w) for t in (1, 3, 5, 9) for h, w in ((4, 6), (6, 4), (4, 4))]
WEIGHTS = [8, 8, 4, 2, 2, 1, 2, 2, 1, 6, 6, 3]


def _check(plan, n_samples: int) -> None:
    refs = [ref for batches in plan.streams.values() for b in batches for ref in b]
    assert len(refs) == len(set(refs)) == n_samples, "exactly once"
    assert all(len(o) == plan.steps for o in plan.step_order), "equal steps"
    for st, batches in plan.streams.items():
        read = sorted((s, i) for s, ids in plan.reads[st] for i in ids)
        assert read == sorted(ref for b in batches for ref in b), "a stream reads exactly its samples"


def random_case(k: int) -> dict:
    rng = random.Random(k)
    world, workers = rng.randint(1, 16), rng.randint(0, 4)
    streams = world * max(1, workers)
    n = rng.randint(4 * streams, 12 * streams)
    n_shards = rng.randint(1, 16)
    cuts = sorted(rng.sample(range(1, n), min(n_shards - 1, n - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    index = [rng.choices(SHAPES, WEIGHTS, k=s) for s in sizes]
    return {
        "index": index,
        "world": world,
        "workers": workers,
        "mode": rng.choice(["independent", "lockstep"]),
        "max_tokens": rng.choice([96, 200, 400]),
        "batch_mode": rng.choice(["dual", "equal_tokens"]),
        "p": rng.choice([1.0, 1.5, 2.0]),
        "seed": k,
    }


def run_case(case: dict) -> str | int:
    """The PlanError's message, or the plan's count of empty (zero-weight) batches."""
    batcher = DualConstraintBatcher(
        case["max_tokens"], sizing=case["batch_mode"], cost_model=CostModel(kind="power", p=case["p"])
    )
    try:
        plan = plan_epoch(
            case["index"],
            case["world"],
            case["workers"],
            batcher,
            seed=case["seed"],
            epoch=0,
            settings=PlanSettings(schedule=case["mode"]),
        )
    except PlanError as err:
        return str(err)
    _check(plan, sum(map(len, case["index"])))
    return int(plan.report["empty_batches"])


def wan_case() -> str | None:
    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.replay import mix_population as _mix_population

    index = _mix_population(load_mix("wan21_480p"), 1024, 64, seed=0)  # the case
    out = []
    for mode in ("independent", "lockstep"):
        batcher = DualConstraintBatcher(32760, sizing="equal_tokens")
        try:
            plan = plan_epoch(index, 64, 0, batcher, seed=0, epoch=0, settings=PlanSettings(schedule=mode))
            _check(plan, 1024)
        except PlanError as err:
            out.append(f"{mode}: {err}")
    return "; ".join(out) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=3000)
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "results" / "plan_feasibility.json")
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    failures = []
    empty = []
    for k in range(args.plans):
        case = random_case(k)
        got = run_case(case)
        if isinstance(got, str):
            failures.append({k: v for k, v in case.items() if k != "index"} | {"error": got})
        elif got:
            empty.append(got)
    wan = wan_case()
    result = {
        "plans": args.plans,
        "plan_errors": len(failures),
        "plans_with_empty_batches": len(empty),
        "empty_batches": sum(empty),
        "first_failures": failures[:10],
        "wan21_480p_1024_samples_64_ranks": wan or "planned",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "first_failures"}, indent=1))
    return 1 if failures or wan else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fit the pack cost model to the H100 trace and compare it with the per-sample fits (CPU only).

Every trace row is one step: B samples of S tokens (B = 1: a single sample). Fits: ``quadratic``
(per sample, gamma free), ``power`` (``scale * S^p``, per sample), and ``fit_packs`` (``c0 + sum alpha*S +
beta*S^2``). Writes ``benchmarks/results/pack_cost_fit_h100_2026-11-23.json`` with each fit's mean and max
relative error over every measured step, and per point. Usage: ``python benchmarks/balance/fit_pack_cost.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from lightning_adaptiveload.planning.cost_model import CostModel

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
TRACE = os.path.join(HERE, "results", "trace_wan13b_h100_2026-11-23.jsonl")
OUT = os.path.join(HERE, "results", "pack_cost_fit_h100_2026-11-23.json")
ANCHOR = "/work/shared/anchors/trace_wan13b_h100_2026-11-22.txt"


def main() -> None:
    meta = json.loads(open(TRACE).readline()[len("# meta ") :])
    rows = [json.loads(line) for line in open(TRACE) if line.startswith("{")]
    s = [r["S"] for r in rows]
    b = [r["B"] for r in rows]
    y = np.array([r["ms"] / 1e3 for r in rows])
    packs = [[r["S"]] * r["B"] for r in rows]
    fits = {
        "quadratic_per_sample": CostModel.fit(s, y, kind="quadratic", batch_sizes=b),
        "power_per_sample": CostModel.fit(s, y, kind="power", batch_sizes=b),
        "default": CostModel.default(),
        "pack": CostModel.fit_packs(packs, y),
    }
    out = {
        "meta": {"trace": os.path.basename(TRACE), "device": meta.get("device"), "n": len(rows)},
        "fits": {},
    }
    for name, model in fits.items():
        pred = np.array([model.pack_cost(p) for p in packs])
        rel = np.abs(pred - y) / y
        out["fits"][name] = {
            "model": model.to_dict() | {"describe": model.describe()},
            "mean_rel_error": float(rel.mean()),
            "max_rel_error": float(rel.max()),
            "points": [
                {"S": si, "B": bi, "seconds": float(yi), "predicted": float(pi)}
                for si, bi, yi, pi in zip(s, b, y, pred)
            ],
        }
        print(f"{name:22s} {model.describe():60s} mean {rel.mean():.1%} max {rel.max():.1%}")
    # Repeat measurements of one configuration bound what any fit can reach.
    groups: dict[tuple[int, int], list[float]] = {}
    for si, bi, yi in zip(s, b, y):
        groups.setdefault((si, bi), []).append(float(yi))
    spread = [max(v) / min(v) - 1 for v in groups.values() if len(v) > 1]
    out["repeat_spread_max"] = max(spread) if spread else 0.0
    print(f"largest spread between repeats of one (S, B): {out['repeat_spread_max']:.1%}")
    # The 2026-11-22 anchor trace (shared/anchors; equal-token packs only, so c0 is barely identifiable).
    if os.path.exists(ANCHOR):
        arows = [json.loads(line) for line in open(ANCHOR) if line.startswith("{")]
        ay = np.array([r["ms"] / 1e3 for r in arows])
        apacks = [[r["S"]] * r["B"] for r in arows]
        out["anchor"] = {}
        for name, model in {
            "quadratic_per_sample": CostModel.fit(
                [r["S"] for r in arows], ay, batch_sizes=[r["B"] for r in arows]
            ),
            "power_per_sample": CostModel.fit(
                [r["S"] for r in arows], ay, kind="power", batch_sizes=[r["B"] for r in arows]
            ),
            "pack": CostModel.fit_packs(apacks, ay),
        }.items():
            rel = np.abs(np.array([model.pack_cost(p) for p in apacks]) - ay) / ay
            out["anchor"][name] = {
                "model": model.describe(),
                "mean_rel_error": float(rel.mean()),
                "max_rel_error": float(rel.max()),
            }
            print(f"anchor {name:15s} {model.describe():60s} mean {rel.mean():.1%} max {rel.max():.1%}")
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Render the packed-balance JSON results as the markdown table of docs/load_balance_report.md.

python benchmarks/balance/packed_balance_table.py benchmarks/results/packed_balance_2026-11-23.json [...]
"""

from __future__ import annotations

import json
import sys

TARGETS = {"cv_mean": 0.005, "cv_p95": 0.015, "straggler_wait": 0.005, "fill": 0.97}


def _pct(x: float | None, key: str | None = None, schedule: str = "") -> str:
    if x is None:
        return "-"
    text = f"{100 * x:.2f}%"
    if schedule == "packed" and key in TARGETS:
        miss = x < TARGETS[key] if key == "fill" else x > TARGETS[key]
        if miss:
            text += " **miss**"
    return text


def main() -> None:
    print(
        "| mix | max_tokens | ranks | schedule | steps | CV mean | CV p95 | wait | fill | shard opens / rank | order corr. |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        for r in json.load(open(path))["rows"]:
            s = r["schedule"]
            corr = r.get("order_rank_correlation")
            print(
                f"| {r['mix']} | {r['max_tokens']:,} | {r['world_size']} | {s} | {r['steps']} | "
                f"{_pct(r['cv_mean'], 'cv_mean', s)} | {_pct(r['cv_p95'], 'cv_p95', s)} | "
                f"{_pct(r['straggler_wait'], 'straggler_wait', s)} | {_pct(r['fill'], 'fill', s)} | "
                f"{r['shard_opens_per_rank']:.0f} | {'-' if corr is None else f'{corr:+.3f}'} |"
            )


if __name__ == "__main__":
    main()

"""Two runs of the same plan, step by step: where does a variant gain or lose time on identical work?

Both runs must have trained the same epoch plan (the same data, seed, schedule and world size), so that step k
holds the same batch in both; each gives the per-step rows of ``step_probe.py`` (``step_probe_rank0.csv``).
It checks that the batches agree (tokens and samples), then prints, and writes as JSON:

- each step whose GPU time differs by more than ``--min-diff-s`` between the runs, marked where the batch's
  shape (tokens, samples) is met for the first time in the run;
- the summed GPU step time of both runs over the steps from ``--from-step`` to the last step both ran;
- per run, the steps that first meet a shape (not the first step), and how much slower they were than the
  median later step of the same shape where there is one (a cuDNN graph build or a compile shows there).

With ``--plot``, the two runs' GPU step times per step, first meetings marked.

    python benchmarks/balance/step_pairs.py BASE.csv VARIANT.csv --names base,warm --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from datetime import date


def _rows(path: str) -> dict[int, dict]:
    with open(path, newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    if not rows:
        raise SystemExit(f"{path}: no step rows")
    return rows


def _shape(r: dict) -> tuple[int, int]:
    return int(r["num_tokens"]), int(r["batch_size"])


def first_meetings(rows: dict[int, dict]) -> list[dict]:
    """Steps (after the first) that meet a shape for the first time, with the median later step of that shape."""
    later: dict[tuple[int, int], list[float]] = {}
    first: dict[tuple[int, int], int] = {}
    for step in sorted(rows):
        key = _shape(rows[step])
        if key in first:
            later.setdefault(key, []).append(float(rows[step]["gpu_step_s"]))
        else:
            first[key] = step
    out = []
    for key, step in sorted(first.items(), key=lambda kv: kv[1]):
        if step == min(rows):
            continue
        t = float(rows[step]["gpu_step_s"])
        med = statistics.median(later[key]) if key in later else None
        out.append(
            {
                "step": step,
                "tokens": key[0],
                "samples": key[1],
                "gpu_step_s": t,
                "median_later_s": med,
                "excess_s": None if med is None else t - med,
            }
        )
    return out


def compare(base: dict[int, dict], var: dict[int, dict], from_step: int, min_diff_s: float) -> dict:
    common = sorted(set(base) & set(var))
    for step in common:
        if _shape(base[step]) != _shape(var[step]):
            raise SystemExit(
                f"step {step}: the runs trained different batches ({_shape(base[step])} against "
                f"{_shape(var[step])}): not the same plan"
            )
    firsts = {s["step"] for s in first_meetings(base)} | {s["step"] for s in first_meetings(var)}
    differing = [
        {
            "step": s,
            "tokens": _shape(base[s])[0],
            "samples": _shape(base[s])[1],
            "base_s": float(base[s]["gpu_step_s"]),
            "variant_s": float(var[s]["gpu_step_s"]),
            "first_meeting": s in firsts,
        }
        for s in common
        if abs(float(base[s]["gpu_step_s"]) - float(var[s]["gpu_step_s"])) > min_diff_s
    ]
    counted = [s for s in common if s >= from_step]
    return {
        "common_steps": len(common),
        "summed_from_step": from_step,
        "summed_steps": len(counted),
        "base_summed_s": sum(float(base[s]["gpu_step_s"]) for s in counted),
        "variant_summed_s": sum(float(var[s]["gpu_step_s"]) for s in counted),
        "differing_steps": differing,
        "base_first_meetings": first_meetings(base),
        "variant_first_meetings": first_meetings(var),
    }


def _plot(base: dict[int, dict], var: dict[int, dict], names: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for rows, name, marker in ((base, names[0], "o"), (var, names[1], "s")):
        steps = sorted(s for s in rows if s > 1)
        ax.plot(steps, [float(rows[s]["gpu_step_s"]) for s in steps], marker=marker, ms=3, lw=1, label=name)
        meets = [m["step"] for m in first_meetings(rows)]
        ax.scatter(
            meets, [float(rows[s]["gpu_step_s"]) for s in meets], s=60, facecolors="none", edgecolors="k"
        )
    ax.set_yscale("log")
    ax.set_xlabel("step (the same batch in both runs; step 1 left out)")
    ax.set_ylabel("GPU step time (s, log)")
    ax.set_title("Identical batches, two variants (circled: a shape met for the first time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="step_probe_rank0.csv of the baseline run")
    p.add_argument("variant", help="step_probe_rank0.csv of the variant, the same plan")
    p.add_argument("--names", default="base,variant", help="two labels, comma-separated")
    p.add_argument("--from-step", type=int, default=3, help="first step of the sums (default 3)")
    p.add_argument(
        "--min-diff-s", type=float, default=0.03, help="list steps differing by more (default 0.03)"
    )
    p.add_argument("--device", default="", help="the device, for the JSON")
    p.add_argument("--json", help="write the comparison here")
    p.add_argument("--plot", help="write the step-time plot here")
    args = p.parse_args(argv)
    names = args.names.split(",")
    if len(names) != 2:
        raise SystemExit(f"--names takes two labels, got {args.names!r}")
    base, var = _rows(args.base), _rows(args.variant)
    res = compare(base, var, args.from_step, args.min_diff_s)
    print(f"{res['common_steps']} steps in both runs; steps differing by more than {args.min_diff_s} s:")
    for d in res["differing_steps"]:
        print(
            f"  step {d['step']:4d} ({d['tokens']} tokens, {d['samples']} samples): {names[0]} {d['base_s']:.3f} s, "
            f"{names[1]} {d['variant_s']:.3f} s{'  (a first meeting)' if d['first_meeting'] else ''}"
        )
    print(
        f"steps {args.from_step}-{max(set(base) & set(var))}: {names[0]} {res['base_summed_s']:.2f} s, "
        f"{names[1]} {res['variant_summed_s']:.2f} s of GPU step time"
    )
    for key, name in (("base_first_meetings", names[0]), ("variant_first_meetings", names[1])):
        for m in res[key]:
            extra = "" if m["excess_s"] is None else f", {m['excess_s'] * 1000:+.0f} ms against later"
            print(
                f"  {name}: step {m['step']} first meets ({m['tokens']}, {m['samples']}): {m['gpu_step_s']:.3f} s{extra}"
            )
    res.update(
        names=names,
        device=args.device,
        date=date.today().isoformat(),
        inputs=[args.base, args.variant],
        what="GPU step time (step_probe.py, CUDA events) of identical batches in two runs of one plan",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        _plot(base, var, names, args.plot)


if __name__ == "__main__":
    main()

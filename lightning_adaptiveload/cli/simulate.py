"""``lightning-adaptiveload simulate``: the planning simulator's command line.

Parses the flags, maps ``--schedules`` and ``--modes`` (the sizing rules) to the simulator's
configurations (:data:`~lightning_adaptiveload.tools.replay.VARIANTS`), runs
:func:`lightning_adaptiveload.tools.simulate.simulate` and prints its table; the library itself never
parses arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload.cli.recipe_file import check_regular
from lightning_adaptiveload.planning.plan import batching_label
from lightning_adaptiveload.tools.simulate import DEFAULT_VARIANTS, DEFAULT_WORLD_SIZES, VARIANTS, simulate
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings
from lightning_adaptiveload.tools.step_times import DEFAULT_PATCH

__all__ = ["main"]


def _int_list_arg(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budget_arg(text: str) -> float | str:
    if text in ("auto", "search"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'search', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"max_compute must be positive, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-adaptiveload simulate",
        description=(
            "Plan one epoch with the real planner for each schedule, sizing rule and world size, replay per-rank step "
            "times and report the compute CV, straggler wait, tokens/s, memory fill and a recommended max_compute."
        ),
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--mix", default=None, help="packaged mix name or mix JSON path (default: wan21_480p)")
    src.add_argument("--index", default=None, help="index.json of real shards (or its folder)")
    ap.add_argument(
        "--times",
        default=None,
        help="per-bucket step times (JSONL trace with T,H,W,B,ms) or a cost-model JSON; default: the built-in "
        "Wan 2.1 1.3B H100 fit",
    )
    ap.add_argument(
        "--world-sizes", type=_int_list_arg, default=list(DEFAULT_WORLD_SIZES), help="e.g. 2,8,16,64"
    )
    ap.add_argument(
        "--modes",
        dest="sizings",
        default=None,
        help="batch sizing rules, comma-separated, from dual,equal_tokens (default with --schedules: both; with "
        f"neither flag: the configurations {','.join(DEFAULT_VARIANTS)})",
    )
    ap.add_argument(
        "--schedules",
        default=None,
        help="schedules, comma-separated, from independent,lockstep,packed (default with --modes: independent); "
        "every schedule is simulated with every sizing rule, except packed, which sizes no batches (its packs "
        "fill --max-tokens and are balanced by the cost model) and is simulated once",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=32760, help="token budget per rank and step (memory cap)"
    )
    ap.add_argument("--max-compute", type=_budget_arg, default="auto", help="number, 'auto' or 'search'")
    ap.add_argument(
        "--p", type=float, default=None, help="planning exponent of S^p (default: fitted to --times)"
    )
    ap.add_argument("--no-recommend", action="store_true", help="skip the max_compute search")
    ap.add_argument("--candidates", type=int, default=10, help="max_compute candidates in the search")
    ap.add_argument(
        "--search-steps-per-rank", type=int, default=64, help="epoch length per rank in the search"
    )
    ap.add_argument(
        "--num-workers", type=int, default=1, help="DataLoader workers per rank the plan is made for"
    )
    ap.add_argument("--seed", type=int, default=0, help="shard-order seed of the planner")
    ap.add_argument("--epoch", type=int, default=0, help="epoch number to plan (with the seed)")
    ap.add_argument("--min-steps-per-rank", type=int, default=200, help="simulated epoch length per rank")
    ap.add_argument(
        "--max-buffered-samples",
        type=int,
        default=None,
        help="planner's per-stream buffer bound (default: its own)",
    )
    ap.add_argument(
        "--lockstep-tolerance",
        type=float,
        default=None,
        help="planner's lockstep cost tolerance (default: its own)",
    )
    ap.add_argument(
        "--lockstep-tail",
        choices=("packed", "bucketed"),
        default=None,
        help="lockstep's end of epoch where the classes stop lining up: balanced packs (default) or bucketed",
    )
    ap.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed ms added to every step")
    ap.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="relative std of each rank's step time on identical work, e.g. 0.019 (a run's identical_work_noise): "
        "every row also gives its wait and tokens/s ratio with it (seeded draws)",
    )
    ap.add_argument(
        "--patch-size",
        type=int,
        nargs=3,
        default=list(DEFAULT_PATCH),
        metavar=("PT", "PH", "PW"),
        help="the model's patch size, for the token counts (default: 1 2 2)",
    )
    ap.add_argument(
        "--replay",
        default=None,
        metavar="CSV",
        help="replay a run's own load_balance_ranks.csv (LoadBalanceMonitor): report the starting cost model's "
        "error on its steps (--times: a cost-model JSON; default: the built-in one) and the refit "
        "(docs/closed_loop.md); writes replay.json to --out and plans nothing",
    )
    ap.add_argument(
        "--sequence-parallel",
        "--sequence_parallel",
        dest="sequence_parallel",
        type=_int_list_arg,
        default=None,
        metavar="G,...",
        help="sequence-parallel degrees to compare, e.g. 1,2,4: --world-sizes are then GPU counts, each split in "
        "groups of G GPUs (--max-tokens per GPU, a group takes G times it); prints which degree and schedule is "
        "expected fastest at each GPU count (simulated) and writes simulate_sequence.json",
    )
    ap.add_argument(
        "--preset",
        choices=("wan-1.3b", "wan-14b"),
        default=None,
        help="with --sequence-parallel: the model whose width and depth price the all-to-all and whose cost is "
        "estimated from the 1.3B fit by FLOPs (default: wan-1.3b; --times, a cost-model JSON, overrides the cost)",
    )
    ap.add_argument(
        "--link-gb-per-s", type=float, default=300.0, help="with --sequence-parallel: all-to-all GB/s per GPU"
    )
    ap.add_argument("--out", default="simulate_out", help="folder for simulate.json and PNG plots")
    ap.add_argument("--no-plots", action="store_true", help="write simulate.json only")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


_SIZINGS = ("dual", "equal_tokens")


def _configurations(sizings: str | None, schedules: str | None) -> list[str]:
    """The configuration names (keys of :data:`~lightning_adaptiveload.tools.replay.VARIANTS`) for the
    ``--modes`` (sizing rules) and ``--schedules`` flags.

    Every schedule is taken with every sizing rule, but the packed schedule sizes no batches (its packs are
    filled up to ``--max-tokens`` and balanced by the cost model, whatever the rule): it is simulated once,
    as ``packed``, and a note says so when ``--modes`` was given.

    Raises:
        ValueError: a sizing rule or schedule that is not one of the choices (the message lists them).
    """
    if sizings is None and schedules is None:
        return list(DEFAULT_VARIANTS)
    sizing_list = [m for m in (sizings or ",".join(_SIZINGS)).split(",") if m]
    schedule_list = [x for x in (schedules or "independent").split(",") if x]
    for value, valid, flag in (
        (sizing_list, _SIZINGS, "--modes"),
        (schedule_list, _SCHEDULE_NAMES, "--schedules"),
    ):
        bad = [v for v in value if v not in valid]
        if bad:
            raise ValueError(f"{flag} {','.join(bad)}: not one of {','.join(valid)}")
    if "packed" in schedule_list and sizings is not None:
        print(
            f"note: --modes {sizings} does not apply to the packed schedule (it sizes no batches: each pack is "
            "filled up to --max-tokens and the packs of a step are balanced by the cost model); packed is "
            "simulated once",
            file=sys.stderr,
        )
    by_pair = {pair: name for name, pair in VARIANTS.items()}
    names = ["packed" if sch == "packed" else by_pair[(sch, m)] for sch in schedule_list for m in sizing_list]
    return list(dict.fromkeys(names))


_SCHEDULE_NAMES = ("independent", "lockstep", "packed")


def _describe(names: Sequence[str], times: Any) -> list[str]:
    """What the output's configuration names mean, and where the step times come from."""
    lines = [
        "configurations: "
        + "; ".join(f"{n} = {batching_label(*VARIANTS[n])}" for n in names if n in VARIANTS)
    ]
    if times is None:
        lines.append(
            "step times: the built-in cost model (CostModel.default(), a fit of Wan 2.1 1.3B on one H100), not "
            "a measured trace; pass --times TRACE.jsonl for measured per-bucket times"
        )
    else:
        kind = "measured trace" if str(times).endswith((".jsonl", ".txt")) else "cost model"
        lines.append(f"step times: {kind} {times}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_adaptiveload simulate [options]``; ``argv`` excludes the word ``simulate``.

    Prints the table, writes ``simulate.json`` and PNGs to ``--out``; returns 0, or 2 on bad input.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.replay is not None:
        return _replay(args.replay, args.times, args.out)
    source = args.index if args.index is not None else (args.mix or "wan21_480p")
    if args.sequence_parallel is not None:
        return _degrees(args, source)
    try:
        for flag, value in (("--mix", args.mix), ("--times", args.times)):
            if value is not None:
                check_regular(value, what=f"{flag} {value}")
        names = _configurations(args.sizings, args.schedules)
        for line in _describe(names, args.times):
            print(line)
        settings = SimulateSettings(
            world_sizes=args.world_sizes,
            variants=names,
            max_tokens=args.max_tokens,
            max_compute=args.max_compute,
            p=args.p,
            recommend=not args.no_recommend,
            max_candidates=args.candidates,
            search_steps_per_rank=args.search_steps_per_rank,
            num_workers=args.num_workers,
            seed=args.seed,
            epoch=args.epoch,
            min_steps_per_rank=args.min_steps_per_rank,
            plan_options={
                k: v
                for k, v in (
                    ("max_buffered_samples", args.max_buffered_samples),
                    ("lockstep_tolerance", args.lockstep_tolerance),
                    ("lockstep_tail", args.lockstep_tail),
                )
                if v is not None
            },
            step_overhead_s=args.step_overhead_ms / 1e3,
            noise=args.noise,
            patch_size=args.patch_size,
        )
        result = simulate(
            source,
            settings,
            times=args.times,
            out_dir=args.out,
            plots=not args.no_plots,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.table())
    fragment = result.recipe_fragment()
    if fragment is not None:
        print(fragment)
    for note in result.notes:
        print(f"  note: {note}")
    print(f"wrote {os.path.join(args.out, 'simulate.json')}" + ("" if args.no_plots else " and PNG plots"))
    return 0


def _degrees(args: argparse.Namespace, source: str) -> int:
    """``--sequence-parallel``: every degree at every GPU count (:func:`~lightning_adaptiveload.tools.simulate_sequence.simulate_degrees`)."""
    from lightning_adaptiveload.cli.recipe_file import read_json
    from lightning_adaptiveload.monitor.report import write_json
    from lightning_adaptiveload.tools.simulate_sequence import model_comm, model_cost, simulate_degrees

    preset = args.preset or "wan-1.3b"
    try:
        if args.times is not None and not args.times.endswith(".json"):
            raise ValueError(
                f"--times {args.times!r}: with --sequence-parallel, give a cost-model JSON (seconds)"
            )
        times = read_json(args.times, what=f"--times {args.times}") if args.times else model_cost(preset)
        if isinstance(times, dict) and "cost_model" in times:
            times = times["cost_model"]
        names = (
            _configurations(args.sizings, args.schedules)
            if (args.sizings or args.schedules)
            else ["equal_tokens", "lockstep", "packed"]
        )
        result = simulate_degrees(
            source,
            gpu_counts=args.world_sizes,
            degrees=args.sequence_parallel,
            max_tokens=args.max_tokens,
            times=times,
            comm=model_comm(preset, link_gb_per_s=args.link_gb_per_s),
            variants=names,
            min_steps_per_rank=args.min_steps_per_rank,
            num_workers=args.num_workers,
            seed=args.seed,
            patch_size=args.patch_size,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.table())
    os.makedirs(args.out, exist_ok=True)
    print(f"wrote {write_json(os.path.join(args.out, 'simulate_sequence.json'), result.to_dict())}")
    return 0


def _replay(csv_path: str, times: str | None, out: str) -> int:
    """The refit of a run's own steps: the starting model's error on them, the refit's terms and error."""
    from lightning_adaptiveload.cli.recipe_file import read_json
    from lightning_adaptiveload.monitor.cost_refit import format_refit, measurements_from_ranks_csv
    from lightning_adaptiveload.monitor.report import write_json
    from lightning_adaptiveload.planning.cost_model import CostModel
    from lightning_adaptiveload.planning.refit import RefitConfig, refit_cost_model

    try:
        if times is not None and not times.endswith(".json"):
            raise ValueError(f"--times {times!r}: with --replay, give the starting cost model as a JSON file")
        if times is not None:
            prior = CostModel.from_dict(read_json(times, what=f"--times {times}"))
        else:
            prior = CostModel.default()
        # The file through the bounded reader first (regular file, bytes, line length, CSV fields, UTF-8:
        # errors name the file and the line), its bad cells counted by column; then the refit's own reader.
        rows = _replay_rows(csv_path)
        result = refit_cost_model(prior, measurements_from_ranks_csv(csv_path), RefitConfig())
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows.update(
        used=result.points_used,
        outliers=result.points_rejected,
        warmup=result.points_warmup,
        dropped=dict(result.points_dropped),
    )
    # The refit accounts for every row it was given; a difference would be rows its reader lost.
    rows["unaccounted"] = (
        rows["read"] - rows["used"] - rows["outliers"] - rows["warmup"] - sum(rows["dropped"].values())
    )
    print(format_refit(result))
    print(_rows_line(rows))
    os.makedirs(out, exist_ok=True)
    doc = {"replay": csv_path, "rows": rows, **result.to_dict()}
    print(f"wrote {write_json(os.path.join(out, 'replay.json'), doc)}")
    return 0


#: The columns of a ranks CSV whose cells the replay reads as numbers.
_REPLAY_NUMBERS = (
    "rank",
    "batch_idx",
    "batch_size",
    "num_tokens",
    "seq_len",
    "compute_time_s",
    "token_sq_sum",
)


def _replay_rows(csv_path: str) -> dict:
    """The rows of ``csv_path`` (read through :func:`~lightning_adaptiveload.shards.textfile.read_csv`), and
    its cells that are not numbers, by column (each such row is dropped or priced without that cell by the
    refit; the first few line numbers kept)."""
    import math

    from lightning_adaptiveload.shards.textfile import read_csv

    need = ("rank", "batch_idx", "batch_size", "num_tokens", "seq_len", "compute_time_s")
    header, rows = read_csv(csv_path, what=f"--replay {csv_path}", required=need)
    bad: dict[str, int] = {}
    lines: dict[str, list[int]] = {}
    for lineno, row in rows:
        for col in _REPLAY_NUMBERS:
            if col not in header:
                continue
            cell = row.get(col)
            if cell in (None, "") and col == "token_sq_sum":
                continue  # optional: absent in files written before the column
            try:
                ok = math.isfinite(float(cell))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                ok = False
            if not ok:
                bad[col] = bad.get(col, 0) + 1
                if len(lines.setdefault(col, [])) < 5:
                    lines[col].append(lineno)
    return {"read": len(rows), "bad_cells": bad, "bad_cell_lines": lines}


def _rows_line(rows: dict) -> str:
    """One line: how many rows were read, used, and left out, and why (the counts add up to ``read``)."""
    dropped = rows["dropped"]
    parts = [
        f"{rows['read']} read",
        f"{rows['used']} used",
        f"{rows['outliers']} outliers",
        f"{rows['warmup']} warm-up",
        f"{sum(dropped.values())} dropped"
        + (f" ({', '.join(f'{k} {v}' for k, v in dropped.items())})" if dropped else ""),
    ]
    if rows.get("unaccounted"):
        parts.append(f"{rows['unaccounted']} unaccounted")
    line = "  rows: " + ", ".join(parts)
    if rows["bad_cells"]:
        cells = ", ".join(
            f"{col} {n} (lines {', '.join(map(str, rows['bad_cell_lines'][col]))}{', ...' if n > 5 else ''})"
            for col, n in rows["bad_cells"].items()
        )
        line += f"; cells that are not finite numbers: {cells}"
    return line


if __name__ == "__main__":
    sys.exit(main())

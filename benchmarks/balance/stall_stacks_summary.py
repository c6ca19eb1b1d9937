"""Summarize the monitor's ``stall_stacks_rank*.txt`` files (``LoadBalanceMonitor(stall_stacks_s=...)``): for
each slow step, how many dumps it got (about its length over the threshold) and the innermost frames of each
thread that is not only waiting (``--all-threads``: all), in the first and the last dump, so that one can
tell a compile from a kernel wait or a collective.

    python benchmarks/balance/stall_stacks_summary.py RUN_DIR [--frames 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import glob
import os
import re

_HEADER = re.compile(r"^== step (\d+): running for ([0-9.]+) s")
_THREAD = re.compile(r"^Thread .*, most recent call first:$")
# A thread whose innermost frame is one of these is waiting for work (queues, timers, progress bars).
_IDLE = (
    "threading.py",
    "selectors.py",
    "multiprocessing/",
    "tqdm/_monitor.py",
    "rich_progress.py",
    "subprocess_script.py",
    "compile_worker/",
    "connection.py",
)


def idle(thread: list[str]) -> bool:
    """Whether a dumped thread (its line, then its frames innermost first) is only waiting."""
    return len(thread) < 2 or any(part in thread[1] for part in _IDLE)


def parse(path: str) -> dict[int, list[tuple[float, list[list[str]]]]]:
    """step -> dumps (seconds into the step, threads -> [thread line, frame lines innermost first]), from one
    stall_stacks file."""
    steps: dict[int, list[tuple[float, list[list[str]]]]] = {}
    threads: list[list[str]] | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            m = _HEADER.match(line)
            if m:
                threads = []
                steps.setdefault(int(m.group(1)), []).append((float(m.group(2)), threads))
            elif threads is not None and _THREAD.match(line):
                threads.append([line])
            elif threads and line.strip():
                threads[-1].append(line.strip())
    return steps


def summarize(path: str, frames: int, max_steps: int, all_threads: bool = False) -> str:
    steps = parse(path)
    out = [f"{os.path.basename(path)}: {len(steps)} slow step(s)"]
    for step in sorted(steps)[:max_steps]:
        dumps = steps[step]
        out.append(f"  step {step}: {len(dumps)} dump(s), the last {dumps[-1][0]:.1f} s into the step")
        for seconds, threads in [dumps[0], dumps[-1]] if len(dumps) > 1 else dumps:
            for thread in threads:
                if idle(thread) and not all_threads:
                    continue
                out.append(f"    [{seconds:.1f} s] {thread[0]}")
                out.extend(f"      {frame}" for frame in thread[1 : 1 + frames])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run folder (searched recursively for stall_stacks_rank*.txt)")
    ap.add_argument("--frames", type=int, default=8, help="innermost frames shown per thread")
    ap.add_argument("--steps", type=int, default=8, help="slow steps shown per file")
    ap.add_argument("--all-threads", action="store_true", help="also the threads that only wait")
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.run, "**", "stall_stacks_rank*.txt"), recursive=True))
    if not files:
        print(f"no stall_stacks_rank*.txt under {args.run}")
        return 1
    for path in files:
        print(os.path.relpath(path, args.run))
        print(summarize(path, args.frames, args.steps, args.all_threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

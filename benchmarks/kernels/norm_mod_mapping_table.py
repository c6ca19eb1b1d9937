"""Side-by-side table of norm_mod_mapping runs (benchmarks/kernels/gpu_norm_mod_s34.sh output).

Reads files named ``<binary>_run<k>.txt`` from a folder and prints, per shape, op and variant, each binary's
time in ms as ``run1/run2/...``; binaries in the order given (default: as found). A regular expression
keeps only the matching rows.

    python benchmarks/kernels/norm_mod_mapping_table.py LOGS [--bins nm_cs0,nm_cs1] [--match "auto|copy"]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

_ROW = re.compile(r"(\S+ \S+)\s+(copy|ln fwd|rms fwd|ln bwd|rms bwd)\s+(.+?)\s+([\d.]+)\s+([\d.]+)%")


def read_runs(folder: Path) -> tuple[dict, list[str]]:
    """{(shape, op, variant): {binary: {run: ms}}} and the binaries in the order found."""
    table: dict = defaultdict(lambda: defaultdict(dict))
    bins: list[str] = []
    for f in sorted(folder.glob("*_run*.txt")):
        name, run = f.stem.rsplit("_run", 1)
        if name not in bins:
            bins.append(name)
        for line in f.read_text().splitlines():
            m = _ROW.match(line)
            if m:
                shape, op, variant, ms, _ = m.groups()
                table[(shape, op, variant.strip())][name][run] = float(ms)
    return table, bins


def render(table: dict, bins: list[str], match: str = "") -> str:
    runs = sorted({r for v in table.values() for b in v.values() for r in b})
    width = 7 * len(runs)
    out = [f"{'shape':22s} {'op':7s} {'variant':28s} " + " ".join(f"{b:>{width}s}" for b in bins)]
    for key, per_bin in table.items():
        if match and not re.search(match, " ".join(key)):
            continue
        cells = [
            "/".join(f"{per_bin[b][r]:.4f}" if r in per_bin.get(b, {}) else "-" for r in runs) for b in bins
        ]
        out.append(f"{key[0]:22s} {key[1]:7s} {key[2][:28]:28s} " + " ".join(f"{c:>{width}s}" for c in cells))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--bins", default="", help="comma-separated binaries, in column order")
    ap.add_argument("--match", default="", help="regular expression over 'shape op variant'")
    args = ap.parse_args()
    table, found = read_runs(args.folder)
    bins = args.bins.split(",") if args.bins else found
    print(render(table, bins, args.match))


if __name__ == "__main__":
    main()

"""``lightning-adaptiveload build-ops``: compile the fused CUDA op ahead of time.

The command line of :func:`lightning_adaptiveload.ops._build.build_ahead_of_time`, e.g. once per node
before a multi-GPU job.
"""

from __future__ import annotations

import argparse
import re
import sys

from lightning_adaptiveload.ops._build import FusedOpUnavailable, build_ahead_of_time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_adaptiveload build-ops``: compile the fused op's CUDA kernels ahead of use.

    Returns:
        0 when the library is in the cache (a fresh build is checked to load in its child process), 1
        otherwise (the reason on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="lightning_adaptiveload build-ops",
        description="Compile the fused layer_norm_modulate CUDA kernels into the cache.",
    )
    parser.add_argument(
        "--arch",
        action="append",
        default=None,
        help="GPU architecture to build for, e.g. 9.0 (repeatable; default: the visible GPUs)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    archs = [a for spec in args.arch for a in re.split(r"[;,\s]+", spec) if a] if args.arch else None
    try:
        summary = build_ahead_of_time(archs, force=args.force, verbose=args.verbose)
    except FusedOpUnavailable as exc:
        print(f"build-ops: {exc}", file=sys.stderr)
        return 1
    print(f"build-ops: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

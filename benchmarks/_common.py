"""Helpers shared by the benchmark scripts (run as scripts: ``python benchmarks/<name>.py``, so this
folder is on ``sys.path``)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (for result files), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

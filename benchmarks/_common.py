"""Helpers shared by the benchmark scripts (run as scripts: ``python benchmarks/<name>.py``, so this
folder is on ``sys.path``)."""

from __future__ import annotations

import math
import platform
from typing import Any

import numpy as np


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


def jsonable(value: Any) -> Any:
    """JSON-able copy: numpy scalars to Python, NaN and inf to null, tuples to lists, keys to str."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

"""How long a test may wait for a subprocess or a worker: generous limits scaled to the machine's load.

A limit is a guard against a hang, never a measurement (no test asserts a time). On a shared 2-core
machine with other test runs beside this one, a subprocess that takes 40 s when idle can take several
minutes, so every limit is ``base * TIME_FACTOR``: ``LIGHTNING_ADAPTIVELOAD_TEST_TIME_FACTOR`` when set,
else the load average per core at collection, at least 2 (two runs of the suite started together both
see an idle machine when they collect) and at most 4.
"""

from __future__ import annotations

import math
import os


def _factor() -> float:
    given = os.environ.get("LIGHTNING_ADAPTIVELOAD_TEST_TIME_FACTOR")
    if given:
        value = float(given)
        if not value > 0:
            raise ValueError(f"LIGHTNING_ADAPTIVELOAD_TEST_TIME_FACTOR={given!r}: give a positive number")
        return value
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 2.0
    return min(4.0, max(2.0, per_core))


TIME_FACTOR = _factor()


def scaled(seconds: float) -> int:
    """``seconds * TIME_FACTOR``, rounded up: a subprocess timeout or a ``pytest.mark.timeout``."""
    return int(math.ceil(seconds * TIME_FACTOR))

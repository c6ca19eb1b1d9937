"""Moved to :mod:`lightning_adaptiveload.stats` (a leaf the planner imports too); this path re-exports it
for one release."""

from lightning_adaptiveload.stats import *  # noqa: F403
from lightning_adaptiveload.stats import __all__  # noqa: F401

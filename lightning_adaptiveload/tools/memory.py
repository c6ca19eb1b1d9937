"""Moved to :mod:`lightning_adaptiveload.models.memory` (the memory model lives beside the models); this
path re-exports it for one release."""

from lightning_adaptiveload.models.memory import *  # noqa: F403
from lightning_adaptiveload.models.memory import __all__  # noqa: F401

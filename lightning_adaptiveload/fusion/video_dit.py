"""The fusion adapter for our reference model (:mod:`lightning_adaptiveload.models.video_dit`).

Its ``NormModulate`` module already has both paths and a ``fused`` switch, so the adapter only sets the
switch (and unfusing restores the previous value). Recognised lazily, by module path and class name, so
that importing the fusion pass does not import the model.
"""

from __future__ import annotations

from typing import Any

from lightning_adaptiveload.fusion.adapter import FlagAdapter, FusionAdapter

__all__ = ["builtin_entries"]

_VIDEO_DIT_MODULE = "lightning_adaptiveload.models.layers"


def builtin_entries() -> list[tuple[Any, FusionAdapter]]:
    """The ``(target, adapter)`` pairs of this family, in the order the registry tries them."""
    return [((_VIDEO_DIT_MODULE, "NormModulate"), FlagAdapter("fused", "video-dit-norm-modulate"))]

"""The packed path's other routes, for before/after comparisons (the package itself always takes "auto").

``pack_routes(segment_sum=..., segment_attention=..., force_segments=...)`` patches the three private route
choices of :mod:`lightning_adaptiveload.models.packing` for the ``with`` block and restores them after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from lightning_adaptiveload.models import packing


@contextlib.contextmanager
def pack_routes(
    segment_sum: str = "auto", segment_attention: str = "auto", force_segments: bool = False
) -> Iterator[None]:
    if segment_sum not in packing.SEGMENT_SUMS:
        raise ValueError(f"segment_sum must be one of {list(packing.SEGMENT_SUMS)}, got {segment_sum!r}")
    if segment_attention not in packing.SEGMENT_ATTENTIONS:
        raise ValueError(
            f"segment_attention must be one of {list(packing.SEGMENT_ATTENTIONS)}, got {segment_attention!r}"
        )
    with (
        mock.patch.object(packing, "_segment_sum_route", lambda: segment_sum),
        mock.patch.object(packing, "_segment_attention_route", lambda: segment_attention),
        mock.patch.object(packing, "_force_segments", lambda: force_segments),
    ):
        yield

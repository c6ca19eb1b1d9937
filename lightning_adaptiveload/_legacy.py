"""The flat keywords of the tool functions, kept for one release beside their settings objects.

``simulate``, ``calibrate``, ``write_synthetic_shards``, ``compare_compiled`` and ``ingest`` took their knobs as
flat keywords (up to 27 of them); they now take one frozen settings object. The old keywords still work for one
release: :func:`settings_from_legacy` builds the settings object from them and warns once per call with a
:class:`DeprecationWarning` that names the class to use.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["settings_from_legacy"]

T = TypeVar("T")


def settings_from_legacy(
    cls: type[T],
    settings: T | None,
    legacy: Mapping[str, Any],
    *,
    caller: str,
    required: Mapping[str, Any] | None = None,
    nested: Mapping[str, type] | None = None,
    stacklevel: int = 3,
    instead: str | None = None,
) -> T:
    """The settings object of a call: ``settings`` itself, or one built from the deprecated flat keywords.

    Args:
        cls: the frozen settings dataclass (e.g. ``SimulateSettings``).
        settings: what the caller passed as ``settings`` (None: not given).
        legacy: the ``**legacy`` keywords of the call; each must be a field of ``cls``.
        caller: the function's name, for the messages.
        required: fields given as ordinary arguments of the function (not deprecated), merged in.
        nested: field name -> settings class of a nested group; a flat keyword that is a field of that class
            goes into it (``calibrate(warmup=1, device="cpu")`` -> ``CalibrateSettings(warmup=1,
            training=CalibratedTraining(device="cpu"))``).
        stacklevel: the warning's stack level (3: the caller of the function that calls this).
        instead: what the warning tells the caller to pass instead (default: ``settings=Cls(...)``), for a
            callable that takes its groups as separate arguments (``optimizer=OptimizerSettings(lr=...)``).

    Raises:
        TypeError: a keyword that is no field of ``cls`` (the closest field is suggested), or both
            ``settings`` and flat keywords.
    """
    groups = {name: [f.name for f in dataclasses.fields(sub)] for name, sub in (nested or {}).items()}
    fields = [f.name for f in dataclasses.fields(cls)] + [k for sub in groups.values() for k in sub]  # type: ignore[arg-type]
    unknown = [k for k in legacy if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, fields, n=1)
        hint = (
            f"; did you mean {close[0]!r}?" if close else f"; the settings are the fields of {cls.__name__}"
        )
        raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}{hint}")
    if not legacy:
        if settings is not None:
            return settings
        return cls(**dict(required or {}))
    if settings is not None:
        raise TypeError(
            f"{caller}(): pass settings={cls.__name__}(...) or the old keywords {sorted(legacy)}, not both"
        )
    instead = instead or f"settings={cls.__name__}({', '.join(f'{k}=...' for k in legacy)})"
    warnings.warn(
        f"{caller}({', '.join(f'{k}=...' for k in legacy)}): the flat keywords are deprecated and will be "
        f"removed in the next release; pass {instead} instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    top = {k: v for k, v in legacy.items() if not any(k in sub for sub in groups.values())}
    for name, sub_fields in groups.items():
        inner = {k: v for k, v in legacy.items() if k in sub_fields}
        if inner:
            top[name] = nested[name](**inner)  # type: ignore[index]
    return cls(**{**dict(required or {}), **top})

"""The flat keywords of the tool functions, kept for one release beside their settings objects.

``simulate``, ``calibrate``, ``write_synthetic_shards``, ``compare_compiled`` and ``ingest`` took their knobs as
flat keywords (up to 27 of them); they now take one frozen settings object. ``AdaptiveLoadDataModule`` took
27 keywords; it now takes a few settings groups (``batching=Batching(...)``, ``plan=PlanSettings(...)``, ...). The old keywords still work for one
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
    renamed: Mapping[str, str] | None = None,
    spread: bool = False,
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
            training=CalibratedTraining(device="cpu"))``). A group built from flat keywords starts from
            the default of its field in ``cls``.
        renamed: old flat name -> its field's name now (``{"mode": "sizing"}``); the warning says so.
        spread: the fields of ``cls`` are the caller's own parameters (its settings groups), not one
            ``settings`` argument: the warning names each group (``batching=Batching(...)``), and
            ``required`` holds the groups given.
        stacklevel: the warning's stack level (3: the caller of the function that calls this).
        instead: what the warning tells the caller to pass instead (default: ``settings=Cls(...)``), for a
            callable that takes its groups as separate arguments (``optimizer=OptimizerSettings(lr=...)``).

    Raises:
        TypeError: a keyword that is no field of ``cls`` (the closest field is suggested), or both
            ``settings`` (or, with ``spread``, a group) and flat keywords of it.
    """
    old_names = dict(renamed or {})
    legacy = {old_names.get(k, k): v for k, v in legacy.items()}
    was = {new: old for old, new in old_names.items()}
    groups = {name: [f.name for f in dataclasses.fields(sub)] for name, sub in (nested or {}).items()}
    fields = [f.name for f in dataclasses.fields(cls)] + [k for sub in groups.values() for k in sub]  # type: ignore[arg-type]
    unknown = [k for k in legacy if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, fields + list(old_names), n=1)
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
    top = {k: v for k, v in legacy.items() if not any(k in sub for sub in groups.values())}
    inners = {name: {k: v for k, v in legacy.items() if k in sub} for name, sub in groups.items()}
    inners = {name: inner for name, inner in inners.items() if inner}
    clash = sorted(set(required or {}) & (set(top) | set(inners)))
    if clash:
        raise TypeError(f"{caller}(): pass {clash[0]}=... or the old keywords of it, not both")
    # Warned before the values are checked: a bad value given the old way is both deprecated and refused.
    renames = "".join(f" ({was[k]!r} is now {k!r})" for k in legacy if k in was)
    if instead:
        advice = f"pass {instead} instead{renames}"
    elif spread:
        new_form = [f"{k}=..." for k in top] + [
            f"{name}={nested[name].__name__}({', '.join(f'{k}=...' for k in inner)})"  # type: ignore[index]
            for name, inner in inners.items()
        ]
        advice = f"pass {', '.join(new_form)} instead{renames}"
    else:
        advice = f"pass settings={cls.__name__}({', '.join(f'{k}=...' for k in legacy)}) instead{renames}"
    old = ", ".join(f"{was.get(k, k)}=..." for k in legacy)
    warnings.warn(
        f"{caller}({old}): the flat keywords are deprecated and will be removed in the next release; {advice}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    defaults = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name, inner in inners.items():
        field = defaults.get(name)
        base = None if field is None else field.default
        if field is not None and base is dataclasses.MISSING:
            base = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        top[name] = (
            dataclasses.replace(base, **inner) if dataclasses.is_dataclass(base) else nested[name](**inner)  # type: ignore[index, arg-type]
        )
    return cls(**{**dict(required or {}), **top})

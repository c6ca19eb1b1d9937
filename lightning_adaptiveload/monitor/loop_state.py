"""The closed loop's checkpoint state, by version: the one place that reads a state written by an older release.

The :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop` keeps the learned cost model in the
checkpoint (``checkpoint["callbacks"]["ClosedLoop"]``). Its versions:

- **1** (0.1.0): the closed loop was part of the ``LoadBalanceMonitor``, so its state sits under the monitor's
  state key: ``{"cost_refit": CostRefitter state, "replan": ReplanTrigger state}``, with no version of its own;
- **2** (0.2.0): under the ClosedLoop's own key: ``{"version": 2, "cost_refit": ..., "replan": ...}``.

:func:`find_loop_state` finds the state wherever it sits and :func:`current_loop_state` brings it to this
version; nothing else in the package knows the older layouts. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STATE_VERSION", "current_loop_state", "find_loop_state", "holds_loop_state"]

STATE_VERSION = 2


def holds_loop_state(state: Any) -> bool:
    """Whether ``state`` (one callback's checkpoint state) holds a closed loop's state, of any version."""
    return isinstance(state, Mapping) and "cost_refit" in state


def current_loop_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` in this version's layout (version 1 gets its version; the refit's own state is unchanged).

    Raises:
        ValueError: a version this code does not read (names it and what to do).
    """
    version = state.get("version", 1 if "cost_refit" in state else None)
    if version == 1:
        return {**dict(state), "version": STATE_VERSION}
    if version == STATE_VERSION:
        return dict(state)
    raise ValueError(
        f"ClosedLoop checkpoint state has version {version!r} (keys {sorted(map(str, state))}); this code reads "
        f"versions 1 and {STATE_VERSION}. Resume with the release that wrote the checkpoint, or remove "
        "checkpoint['callbacks']['ClosedLoop'] to start the closed loop afresh"
    )


def find_loop_state(
    callback_states: Mapping[Any, Any], own_key: str, monitor_key: str | None = None
) -> dict[str, Any] | None:
    """The closed loop's state in a checkpoint's ``callbacks`` entry, in this version's layout.

    Args:
        callback_states: ``checkpoint["callbacks"]`` (state key -> state).
        own_key: the ClosedLoop's state key (where this version saves it).
        monitor_key: the LoadBalanceMonitor's state key (where 0.1.0 saved it); None: not looked at.

    Returns:
        The state under ``own_key`` if there is one, else the one a 0.1.0 monitor saved, else None.
    """
    own = callback_states.get(own_key)
    if own:
        return current_loop_state(own)
    found = callback_states.get(monitor_key) if monitor_key is not None else None
    return current_loop_state(found) if holds_loop_state(found) else None

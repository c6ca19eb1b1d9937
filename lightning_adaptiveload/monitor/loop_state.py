"""The closed loop's checkpoint state, by version and by schema: the one place that reads a state written by an
older release, and the one place that checks a state before it is used.

The :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop` keeps the learned cost model in the
checkpoint (``checkpoint["callbacks"]["ClosedLoop"]``). Its versions:

- **1** (0.1.0): the closed loop was part of the ``LoadBalanceMonitor``, so its state sits under the monitor's
  state key: ``{"cost_refit": CostRefitter state, "replan": ReplanTrigger state}``, with no version of its own;
- **2** (0.2.0): under the ClosedLoop's own key: ``{"version": 2, "cost_refit": ..., "replan": ...}``.

:func:`find_loop_state` finds the state wherever it sits and :func:`current_loop_state` brings it to this
version; nothing else in the package knows the older layouts. :func:`read_loop_state` checks it field by field
(:func:`check_cost_refit_state`, :func:`check_replan_state`): a missing key, a value of the wrong type (``"abc"``
for a number, ``True`` for a coefficient), a coefficient that is not finite or negative, is a
:class:`LoopStateError` naming the checkpoint key, the field and the rule, never a bare ``KeyError``. The
``LoadBalanceMonitor``'s own state (it keeps none) is checked by :func:`check_monitor_state`. No Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.refit import StepMeasurements

__all__ = [
    "STATE_VERSION",
    "COST_REFIT_VERSION",
    "LoopStateError",
    "check_cost_refit_state",
    "check_monitor_state",
    "check_replan_state",
    "current_loop_state",
    "find_loop_state",
    "holds_loop_state",
    "read_loop_state",
    "state_where",
]

STATE_VERSION = 2
COST_REFIT_VERSION = 1  # the layout of the "cost_refit" part (CostRefitter.state_dict)
#: The most rows of measurements one part of a state may hold (RefitConfig.max_saved_steps keeps 100,000).
MAX_SAVED_ROWS = 1 << 24
_MAX_HISTORY = 1 << 20  # refits recorded in one state
_MEASUREMENT_COLUMNS = tuple(StepMeasurements.__dataclass_fields__)
_INTEGER_COLUMNS = ("rank", "batch_idx")  # whole numbers >= 0
_FLAG_COLUMNS = ("packed", "warmup")  # 0 or 1
_TOP_KEYS = ("version", "cost_refit", "replan")
# The cost refit's keys: required, then optional.
_REFIT_KEYS = ("version", "model", "applied", "measurements")
_REFIT_OPTIONAL = ("window", "seen", "history")
_REPLAN_KEYS = ("epoch", "replans")


class LoopStateError(ValueError):
    """A closed loop's (or the monitor's) checkpoint state that cannot be used; the message names the checkpoint
    key, the field, its value and the rule, and says what to do."""


def state_where(state_key: str) -> str:
    """How a callback's state is named in the messages: ``checkpoint['callbacks']['ClosedLoop']``."""
    return f"checkpoint['callbacks'][{state_key!r}]"


def _what_to_do(where: str) -> str:
    if not where.startswith("checkpoint["):
        return "What to do: restore a state that CostRefitter.state_dict or ReplanTrigger.state_dict wrote"
    return (
        f"What to do: resume from another checkpoint, or delete {where} from the checkpoint to start the closed "
        "loop afresh (the data module then plans with its own cost model until the first refit)"
    )


def _prefix(where: str) -> str:
    """``"ClosedLoop checkpoint state checkpoint['callbacks']['ClosedLoop']: "``, or the state's own name."""
    return f"ClosedLoop checkpoint state {where}: " if where.startswith("checkpoint[") else f"{where}: "


def _bad(where: str, field: str, problem: str) -> LoopStateError:
    return LoopStateError(f"{_prefix(where)}{field} {problem}. {_what_to_do(where)}")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _mapping(value: Any, where: str, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(where, field, f"is {_describe(value)}, not a dict")
    return value


def _keys(value: Mapping[str, Any], where: str, field: str, required: tuple, optional: tuple = ()) -> None:
    missing = [k for k in required if k not in value]
    if missing:
        raise _bad(where, field, f"lacks the key(s) {missing} (it has {sorted(map(str, value))})")
    unknown = sorted(str(k) for k in value if k not in required and k not in optional)
    if unknown:
        raise _bad(
            where, field, f"has unknown key(s) {unknown}; this release reads {sorted(required + optional)}"
        )


def _count(value: Any, where: str, field: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int or value < 0:
        rule = "an integer >= 0" + (" or null" if allow_none else "")
        raise _bad(where, field, f"is {_describe(value)}; expected {rule}")


def holds_loop_state(state: Any) -> bool:
    """Whether ``state`` (one callback's checkpoint state) holds a closed loop's state, of any version."""
    return isinstance(state, Mapping) and "cost_refit" in state


def current_loop_state(state: Mapping[str, Any], where: str = state_where("ClosedLoop")) -> dict[str, Any]:
    """``state`` in this version's layout (version 1 gets its version; the refit's own state is unchanged).

    Raises:
        LoopStateError: (a ``ValueError``) not a dict, or a version this code does not read (names it and what
            to do).
    """
    state = _mapping(state, where, "the state")
    version = state.get("version", 1 if "cost_refit" in state else None)
    if version == 1 and type(version) is int:
        return {**dict(state), "version": STATE_VERSION}
    if version == STATE_VERSION and type(version) is int:
        return dict(state)
    raise LoopStateError(
        f"ClosedLoop checkpoint state {where} has version {version!r} (keys {sorted(map(str, state))}); this "
        f"code reads versions 1 and {STATE_VERSION}. Resume with the release that wrote the checkpoint, or "
        f"remove {where} to start the closed loop afresh"
    )


def read_loop_state(state: Any, where: str = state_where("ClosedLoop")) -> dict[str, Any]:
    """``state`` in this version's layout (:func:`current_loop_state`), every field checked.

    Args:
        state: the closed loop's state as saved (either version).
        where: the checkpoint key it came from, for the messages.

    Raises:
        LoopStateError: naming ``where``, the field (``cost_refit.model.gamma``), its value and the rule.
    """
    state = current_loop_state(state, where)
    _keys(state, where, "the state", ("version", "cost_refit"), ("replan",))
    check_cost_refit_state(state["cost_refit"], where, "cost_refit")
    if "replan" in state:
        check_replan_state(state["replan"], where, "replan")
    return state


def check_cost_refit_state(
    state: Any, where: str = "the cost refit state", field: str = "cost_refit"
) -> CostModel | None:
    """Check a :class:`~lightning_adaptiveload.monitor.cost_refit.CostRefitter` state; returns its model.

    The rules: ``version`` is 1; ``model`` is null or a cost model (``CostModel.from_dict``: every coefficient a
    finite number, none of alpha, beta, c0, p, scale negative); ``applied`` a bool; ``measurements`` and
    ``window`` the columns of :class:`~lightning_adaptiveload.planning.refit.StepMeasurements`, lists of
    numbers of one length (``rank`` and ``batch_idx`` whole numbers >= 0, ``packed`` and ``warmup`` 0 or 1; a
    measured value may be nan: the refit leaves such rows out); ``seen`` ``[rank, shape class, count]``
    triples; ``history`` a list of dicts.

    Raises:
        LoopStateError: the first field that breaks a rule, named ``field.key``.
    """
    state = _mapping(state, where, field)
    _keys(state, where, field, _REFIT_KEYS, _REFIT_OPTIONAL)
    version = state["version"]
    if type(version) is not int or version != COST_REFIT_VERSION:
        raise LoopStateError(
            f"{_prefix(where)}cost refit state has version {version!r} ({field}.version is "
            f"{_describe(version)}); this release reads version {COST_REFIT_VERSION}: resume with the code that "
            f"wrote the checkpoint. {_what_to_do(where)}"
        )
    model = _cost_model(state["model"], where, f"{field}.model")
    if type(state["applied"]) is not bool:
        raise _bad(where, f"{field}.applied", f"is {_describe(state['applied'])}; expected true or false")
    _measurements(state["measurements"], where, f"{field}.measurements")
    if "window" in state:
        _measurements(state["window"], where, f"{field}.window")
    if "seen" in state:
        _seen(state["seen"], where, f"{field}.seen")
    if "history" in state:
        history = state["history"]
        if not isinstance(history, list) or len(history) > _MAX_HISTORY:
            raise _bad(
                where, f"{field}.history", f"is {_describe(history)}; expected a list of refit records"
            )
        for i, line in enumerate(history):
            if not isinstance(line, Mapping):
                raise _bad(where, f"{field}.history[{i}]", f"is {_describe(line)}, not a dict")
    return model


def check_replan_state(state: Any, where: str = "the replan state", field: str = "replan") -> None:
    """Check a :class:`~lightning_adaptiveload.monitor.replan.ReplanTrigger` state: ``{"epoch": int >= 0 or
    null, "replans": int >= 0}``.

    Raises:
        LoopStateError: naming the field and the rule.
    """
    state = _mapping(state, where, field)
    _keys(state, where, field, (), _REPLAN_KEYS)
    _count(state.get("epoch"), where, f"{field}.epoch", allow_none=True)
    _count(state.get("replans", 0), where, f"{field}.replans")


def check_monitor_state(state: Any, where: str = state_where("LoadBalanceMonitor")) -> None:
    """Check a ``LoadBalanceMonitor``'s checkpoint state: this release keeps none; a 0.1.0 monitor kept its
    closed loop's there (``cost_refit``, ``replan``), checked as :func:`read_loop_state` does.

    Raises:
        LoopStateError: not a dict, another key, or a 0.1.0 closed-loop state that breaks a rule.
    """
    if not isinstance(state, Mapping):
        raise LoopStateError(
            f"LoadBalanceMonitor checkpoint state {where} is {_describe(state)}, not a dict. The monitor keeps no "
            f"state; delete {where} from the checkpoint"
        )
    if not state:
        return
    unknown = sorted(str(k) for k in state if k not in ("cost_refit", "replan", "version"))
    if unknown:
        raise LoopStateError(
            f"LoadBalanceMonitor checkpoint state {where} has key(s) {unknown}: the monitor keeps no state, and the "
            f"one of 0.1.0 held only the closed loop's ('cost_refit', 'replan'). Delete {where} from the checkpoint"
        )
    read_loop_state(state, where)


def find_loop_state(
    callback_states: Mapping[Any, Any], own_key: str, monitor_key: str | None = None
) -> dict[str, Any] | None:
    """The closed loop's state in a checkpoint's ``callbacks`` entry, in this version's layout, checked.

    Args:
        callback_states: ``checkpoint["callbacks"]`` (state key -> state).
        own_key: the ClosedLoop's state key (where this version saves it).
        monitor_key: the LoadBalanceMonitor's state key (where 0.1.0 saved it); None: not looked at.

    Returns:
        The state under ``own_key`` if there is one, else the one a 0.1.0 monitor saved, else None.

    Raises:
        LoopStateError: the state found breaks a rule of :func:`read_loop_state` (naming its key).
    """
    own = callback_states.get(own_key)
    if own:
        return read_loop_state(own, state_where(own_key))
    found = callback_states.get(monitor_key) if monitor_key is not None else None
    return read_loop_state(found, state_where(str(monitor_key))) if holds_loop_state(found) else None


# ---------------------------------------------------------------------- the parts


def _cost_model(value: Any, where: str, field: str) -> CostModel | None:
    if value is None:
        return None
    _mapping(value, where, field)
    for name, raw in value.items():  # named before CostModel's own check, with the rule
        if name in ("kind", "fit_info"):
            continue
        if isinstance(raw, bool) or not isinstance(raw, Real):
            raise _bad(where, f"{field}.{name}", f"is {_describe(raw)}; expected a finite number")
        if not math.isfinite(float(raw)):
            raise _bad(where, f"{field}.{name}", f"is {raw!r}; a cost-model coefficient must be finite")
        if name in ("alpha", "beta", "c0", "p", "scale") and float(raw) < 0:
            raise _bad(where, f"{field}.{name}", f"is {raw!r}; a cost-model coefficient {name} must be >= 0")
    try:
        return CostModel.from_dict(value)
    except (TypeError, ValueError) as err:
        raise _bad(where, field, f"is not a cost model ({err})") from None


def _measurements(value: Any, where: str, field: str) -> None:
    value = _mapping(value, where, field)
    _keys(value, where, field, _MEASUREMENT_COLUMNS)
    length = None
    for name in _MEASUREMENT_COLUMNS:
        column = value[name]
        if not isinstance(column, list | tuple) or len(column) > MAX_SAVED_ROWS:
            raise _bad(
                where,
                f"{field}.{name}",
                f"is {_describe(column)}; expected a list of at most {MAX_SAVED_ROWS} numbers",
            )
        if length is not None and len(column) != length:
            raise _bad(
                where,
                f"{field}.{name}",
                f"has {len(column)} rows, the columns before it {length}; all must be equal",
            )
        length = len(column)
        if set(map(type, column)) <= {float, int}:  # the common case, checked at once
            a = np.asarray(column, dtype=np.float64)
            if name in _INTEGER_COLUMNS:
                ok = np.isfinite(a) & (a >= 0) & (a == np.floor(a))
            elif name in _FLAG_COLUMNS:
                ok = (a == 0) | (a == 1)
            else:
                continue
            if ok.all():
                continue
        for i, x in enumerate(column):
            if isinstance(x, bool) or not isinstance(x, Real):
                raise _bad(where, f"{field}.{name}[{i}]", f"is {_describe(x)}; expected a number")
            if name in _INTEGER_COLUMNS and not (math.isfinite(x) and x >= 0 and float(x).is_integer()):
                raise _bad(where, f"{field}.{name}[{i}]", f"is {x!r}; expected a whole number >= 0")
            if name in _FLAG_COLUMNS and x not in (0, 1):
                raise _bad(where, f"{field}.{name}[{i}]", f"is {x!r}; expected 0 or 1")


def _seen(value: Any, where: str, field: str) -> None:
    if not isinstance(value, list) or len(value) > MAX_SAVED_ROWS:
        raise _bad(where, field, f"is {_describe(value)}; expected a list of [rank, shape class, count]")
    for i, item in enumerate(value):
        ok = (
            isinstance(item, list | tuple)
            and len(item) == 3
            and type(item[0]) is int
            and item[0] >= 0
            and isinstance(item[1], str)
            and type(item[2]) is int
            and item[2] >= 0
        )
        if not ok:
            raise _bad(
                where,
                f"{field}[{i}]",
                f"is {_describe(item)}; expected [rank (integer >= 0), shape class (text), count (integer >= 0)]",
            )

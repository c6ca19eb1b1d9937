"""settings_from_legacy: the deprecated flat keywords -> one settings object, nested groups included."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from lightning_adaptiveload._legacy import settings_from_legacy


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inner:
    depth: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outer:
    width: int = 2
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def _call(settings=None, **legacy):
    return settings_from_legacy(_Outer, settings, legacy, caller="f", nested={"inner": _Inner}, stacklevel=3)


def test_no_keywords_give_the_settings_or_the_defaults_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _call() == _Outer()
        given = _Outer(width=5)
        assert _call(given) is given


def test_flat_keywords_are_routed_into_their_group_and_warn_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _call(width=3, depth=4)
    assert got == _Outer(width=3, inner=_Inner(depth=4))
    assert len(caught) == 1 and caught[0].category is DeprecationWarning
    assert "settings=_Outer(" in str(caught[0].message) and "width=..." in str(caught[0].message)
    assert caught[0].filename == __file__


def test_a_misspelt_keyword_and_both_forms_are_type_errors():
    with pytest.raises(
        TypeError, match="f\\(\\) got an unexpected keyword argument 'dept'; did you mean 'depth'"
    ):
        _call(dept=4)
    with pytest.raises(TypeError, match="not both"):
        _call(_Outer(), width=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Groups:
    inner: _Inner = dataclasses.field(default_factory=lambda: _Inner(depth=7))
    other: _Outer = dataclasses.field(default_factory=_Outer)


def _spread(given=None, **legacy):
    return settings_from_legacy(
        _Groups,
        None,
        legacy,
        caller="g",
        required=given or {},
        nested={"inner": _Inner, "other": _Outer},
        renamed={"old_width": "width"},
        spread=True,
        stacklevel=3,
    )


def test_spread_groups_start_from_their_defaults_rename_and_name_each_group():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _spread(old_width=4)
    # The group built from a flat keyword starts from the field's default, not the class's.
    assert got == _Groups(inner=_Inner(depth=7), other=_Outer(width=4))
    assert len(caught) == 1 and caught[0].filename == __file__
    message = str(caught[0].message)
    assert message.startswith("g(old_width=...)") and "pass other=_Outer(width=...) instead" in message
    assert "('old_width' is now 'width')" in message and "settings=" not in message
    assert _spread(depth=1).inner == _Inner(depth=1)  # replaces the default's field


def test_spread_refuses_a_group_given_both_ways_and_suggests_old_names():
    with pytest.raises(TypeError, match="pass inner=... or the old keywords of it, not both"):
        _spread({"inner": _Inner(depth=2)}, depth=3)
    with pytest.raises(TypeError, match="did you mean 'old_width'"):
        _spread(old_widht=3)
    assert _spread({"inner": _Inner(depth=2)}, width=5) == _Groups(inner=_Inner(depth=2), other=_Outer(width=5))

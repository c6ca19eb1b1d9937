"""CalibrateSettings, CalibratedTraining, MemorySearch: each bad value rejected once, in one place; the deprecated
flat keywords of calibrate() still work, warn once and give the same result."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from lightning_adaptiveload.tools.calibrate import calibrate
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
)

_OK = dict(mix="tiny")


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (CalibrateSettings, dict(mix=None, shapes=None), "shapes"),
        (CalibrateSettings, dict(_OK, warmup=-1), "warmup"),
        (CalibrateSettings, dict(_OK, repeats=0), "repeats"),
        (CalibrateSettings, dict(_OK, kind="cubic"), "kind"),
        (CalibrateSettings, dict(_OK, max_compute="search"), "max_compute"),
        (CalibrateSettings, dict(_OK, batch_sizes=[0]), "batch_sizes"),
        (CalibrateSettings, dict(_OK, training={"device": "cpu"}), "training"),
        (CalibratedTraining, dict(precision="fp8"), "precision"),
        (CalibratedTraining, dict(device="gpu"), "device"),
        (CalibratedTraining, dict(checkpoint_blocks="all"), "checkpoint_blocks"),
        (CalibratedTraining, dict(checkpoint_blocks="auto"), "activation_checkpointing"),
        (MemorySearch, dict(vram_fraction=1.5), "vram_fraction"),
        (MemorySearch, dict(memory_budget_gb=0.0), "memory_budget_gb"),
        (MemorySearch, dict(max_tokens=0), "max_tokens"),
        (MemorySearch, dict(max_batch=0), "max_batch"),
    ],
)
def test_each_bad_value_is_rejected_once_by_its_settings_class(cls, kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        cls(**kwargs)
    # The one error site: the class's __post_init__ (calibrate() itself checks none of these).
    assert err.traceback[-1].name == "__post_init__" or err.traceback[-2].name == "__post_init__"
    bad = {k: v for k, v in kwargs.items() if k not in _OK}
    if field not in ("shapes", "activation_checkpointing", "training"):
        assert repr(next(iter(bad.values()))) in str(err.value)  # the message names the value


def test_settings_are_frozen_and_keyword_only():
    settings = CalibrateSettings(mix="tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.warmup = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        MemorySearch(0.5)  # type: ignore[misc]
    assert settings.training == CalibratedTraining() and settings.memory == MemorySearch()


def _timer(shapes):
    return 1e-6 * sum(t * h * w for _, t, h, w in shapes)


@pytest.mark.timeout(240)
def test_the_flat_keywords_still_work_warn_once_and_give_the_same_result():
    settings = CalibrateSettings(
        mix="tiny",
        num_shapes=3,
        warmup=0,
        repeats=1,
        packs=False,
        training=CalibratedTraining(device="cpu"),
        memory=MemorySearch(max_tokens=900),
    )
    new = calibrate("tiny", settings=settings, progress=False, timer=_timer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = calibrate(
            preset="tiny", mix="tiny", num_shapes=3, warmup=0, repeats=1, packs=False, device="cpu",
            max_tokens=900, progress=False, timer=_timer,
        )  # fmt: skip
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "CalibrateSettings(" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__
    assert (old.max_tokens, old.max_compute, old.cost_model) == (
        new.max_tokens,
        new.max_compute,
        new.cost_model,
    )
    assert old.timings == new.timings
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="vram_fraction"):
        calibrate(preset="tiny", mix="tiny", vram_fraction=2.0)  # the flat keyword reaches the same one check
    with pytest.raises(TypeError, match="did you mean 'repeats'"):
        calibrate(preset="tiny", mix="tiny", repeat=1)

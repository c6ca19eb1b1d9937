"""CalibrateSettings, CalibratedTraining, MemorySearch, ModuleBatches: each bad value rejected once, in one place;
calibrate() takes its knobs in them only."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_adaptiveload.tools.calibrate import calibrate
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
    ModuleBatches,
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
        (CalibrateSettings, dict(_OK, packs="auto"), "packs"),
        (CalibratedTraining, dict(precision="fp8"), "precision"),
        (CalibratedTraining, dict(device="gpu"), "device"),
        (CalibratedTraining, dict(checkpoint_blocks="all"), "checkpoint_blocks"),
        (CalibratedTraining, dict(checkpoint_blocks="auto"), "activation_checkpointing"),
        (MemorySearch, dict(vram_fraction=1.5), "vram_fraction"),
        (MemorySearch, dict(memory_budget_gb=0.0), "memory_budget_gb"),
        (MemorySearch, dict(max_tokens=0), "max_tokens"),
        (MemorySearch, dict(max_batch=0), "max_batch"),
        (ModuleBatches, dict(patch_size=(1, 2)), "patch_size"),
        (ModuleBatches, dict(text_dim=0), "text_dim"),
        (ModuleBatches, dict(text_pad_to=-3), "text_pad_to"),
        (ModuleBatches, dict(dtype="bfloat16"), "dtype"),
        (ModuleBatches, dict(schedule=3), "schedule"),
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


def test_calibrate_takes_no_flat_keywords():
    # The flat keywords of earlier releases are gone: the settings objects are the one way in.
    with pytest.raises(TypeError, match="unexpected keyword argument 'mix'"):
        calibrate(preset="tiny", mix="tiny", device="cpu")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="give the shapes to measure"):
        calibrate("tiny")  # no settings: nothing says what to measure
    with pytest.raises(TypeError, match="CalibrateSettings"):
        calibrate("tiny", settings={"mix": "tiny"})  # type: ignore[arg-type]


def test_module_batches_defaults_are_the_synthetic_datas():
    batches = ModuleBatches(patch_size=[1, 2, 2])
    assert batches.patch_size == (1, 2, 2) and batches.text_dim == 32 and batches.dtype == "float16"
    assert ModuleBatches(text_dim=None).text_dim is None  # batches without text
    assert CalibrateSettings(mix="tiny").packs is None  # packs where the model takes them

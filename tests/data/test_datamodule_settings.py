"""The DataModule's settings groups (issue 39, item 1): Batching, PlanSettings, Loader, Source.

Each setting is checked in one place: a bad value raises one ValueError, from the same function whichever
layer it came through (the DataModule's nested form, its deprecated flat keywords, the batcher, the
settings class itself), naming the key and the value. The flat keywords of the last release still work,
with one DeprecationWarning per call naming the new form.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings

import pytest
from _paths import ROOT

from lightning_adaptiveload import AdaptiveLoadDataModule
from lightning_adaptiveload.cli.recipe_forms import nest_data_args, nest_flags, nest_recipe
from lightning_adaptiveload.loading.settings import DATAMODULE_GROUPS, Loader, Source, group_of_keyword
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.planning.sizing import BatchSizer

QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")

# (flat keyword, its group, the field there, a bad value, where it is checked: (file, function)).
BAD = [
    ("max_tokens", "batching", "max_tokens", 0, ("planning/sizing.py", "__post_init__")),
    ("max_tokens", "batching", "max_tokens", "many", ("planning/sizing.py", "__post_init__")),
    ("mode", "batching", "sizing", "dual2", ("planning/sizing.py", "__post_init__")),
    ("patch_size", "batching", "patch_size", (1, 2), ("planning/sizing.py", "_patch")),
    ("max_compute", "batching", "max_compute", "lots", ("planning/settings.py", "__post_init__")),
    ("oversize", "batching", "oversize", "drop", ("planning/settings.py", "__post_init__")),
    ("schedule", "plan", "schedule", "sync", ("planning/settings.py", "__post_init__")),
    ("lockstep_tail", "plan", "lockstep_tail", "none", ("planning/settings.py", "__post_init__")),
    ("lockstep_tolerance", "plan", "lockstep_tolerance", 1.5, ("planning/settings.py", "__post_init__")),
    ("plan_chunk_samples", "plan", "chunk_samples", 0, ("planning/settings.py", "__post_init__")),
    ("plan_processes", "plan", "plan_processes", 0, ("planning/settings.py", "__post_init__")),
    ("num_workers", "loader", "num_workers", -1, ("loading/settings.py", "__post_init__")),
    ("num_workers", "loader", "num_workers", 1.5, ("loading/settings.py", "_integer")),
    ("text_pad_to", "loader", "text_pad_to", 0, ("loading/settings.py", "__post_init__")),
    ("on_error", "source", "on_error", "ignore", ("shards/format.py", "check_on_error")),
    ("max_member_bytes", "source", "max_member_bytes", -5, ("loading/settings.py", "__post_init__")),
]


def _raise_site(call) -> tuple[ValueError, tuple[str, str]]:
    """The one ValueError ``call`` raises and the (file, function) that raised it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError) as info:
            call()
    err = info.value
    last = traceback.extract_tb(err.__traceback__)[-1]
    path = last.filename.replace(os.sep, "/")
    return err, ("/".join(path.split("/")[-2:]), last.name)


@pytest.mark.parametrize("flat, group, field, value, site", BAD, ids=[f"{b[0]}={b[3]!r}" for b in BAD])
def test_each_bad_value_is_refused_once_from_one_place(flat, group, field, value, site):
    cls = DATAMODULE_GROUPS[group]
    calls = {
        "nested": lambda: AdaptiveLoadDataModule("data", **{group: cls(**{field: value})}),
        "flat": lambda: AdaptiveLoadDataModule("data", **{flat: value}),
        "settings class": lambda: cls(**{field: value}),
    }
    if group == "batching":
        calls["batcher"] = lambda: DualConstraintBatcher(**{"max_tokens": 64, field: value})
    sites = set()
    for how, call in calls.items():
        err, where = _raise_site(call)
        sites.add(where)
        # One error: not one caught and raised again in another shape.
        assert err.__cause__ is None and err.__context__ is None, (how, err)
        message = str(err)
        assert field in message or flat in message, (how, message)
        assert repr(value) in message or str(value) in message, (how, message)
    assert sites == {site}, (flat, sites)


def test_the_batch_sizer_checks_sizing_and_max_tokens_where_batching_does():
    _, direct = _raise_site(lambda: BatchSizer(64, sizing="sometimes"))
    _, nested = _raise_site(lambda: Batching(sizing="sometimes"))  # type: ignore[arg-type]
    assert direct == nested == ("planning/sizing.py", "__post_init__")


def test_nested_and_flat_forms_build_the_same_settings_and_the_flat_one_warns_once():
    nested = AdaptiveLoadDataModule(
        "data",
        batching=Batching(max_tokens=512, sizing="equal_tokens", oversize="skip"),
        plan=PlanSettings(schedule="lockstep", lockstep_tail="bucketed", chunk_samples=1000),
        loader=Loader(num_workers=0, seed=3, text_pad_to=8),
        source=Source(on_error="skip", index_allow_outside=True),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = AdaptiveLoadDataModule(
            "data",
            max_tokens=512,
            mode="equal_tokens",
            oversize="skip",
            schedule="lockstep",
            lockstep_tail="bucketed",
            plan_chunk_samples=1000,
            num_workers=0,
            seed=3,
            text_pad_to=8,
            on_error="skip",
            index_allow_outside=True,
        )
    deprecations = [w for w in caught if w.category is DeprecationWarning]
    assert len(deprecations) == 1 and deprecations[0].filename == __file__
    message = str(deprecations[0].message)
    for new in ("batching=Batching(", "plan=PlanSettings(", "loader=Loader(", "source=Source(", "sizing=..."):
        assert new in message, message
    assert "'mode' is now 'sizing'" in message and "'plan_chunk_samples' is now 'chunk_samples'" in message
    for name in ("batching", "plan_settings", "loader", "source"):
        assert getattr(flat, name) == getattr(nested, name), name
    assert flat.batcher.config() == nested.batcher.config() and flat.batcher.sizing == "equal_tokens"
    assert (flat.num_workers, flat.seed, flat.text_pad_to, flat.on_error) == (0, 3, 8, "skip")


def test_defaults_need_no_keyword_and_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm = AdaptiveLoadDataModule("data")
    assert dm.batching == Batching() and dm.loader == Loader() and dm.source == Source()
    # The DataModule plans big epochs in segments by default (plan_epoch's own default plans at once).
    assert dm.plan_settings == PlanSettings(chunk_samples=500_000)


def test_a_misspelt_keyword_and_a_group_given_twice_are_type_errors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_token'; did you mean 'max_tokens'"):
        AdaptiveLoadDataModule("data", max_token=512)
    with pytest.raises(TypeError, match="pass plan=... or the old keywords of it, not both"):
        AdaptiveLoadDataModule("data", plan=PlanSettings(schedule="lockstep"), schedule="packed")
    with warnings.catch_warnings():  # flat keywords of another group beside a group: allowed (and warned)
        warnings.simplefilter("ignore", DeprecationWarning)
        dm = AdaptiveLoadDataModule("data", plan=PlanSettings(schedule="lockstep"), num_workers=0)
    assert dm.schedule == "lockstep" and dm.num_workers == 0


def test_the_batcher_takes_sizing_and_mode_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="pass sizing='equal_tokens' instead"):
        old = DualConstraintBatcher(512, mode="equal_tokens")
    assert old.config() == DualConstraintBatcher(512, sizing="equal_tokens").config()
    with pytest.warns(DeprecationWarning, match="use .sizing"):
        assert old.mode == "equal_tokens"
    with pytest.warns(DeprecationWarning, match="BatchSizer.sizing"):
        assert old.sizer.mode == "equal_tokens"
    # The config names the rule "sizing"; one saved before (a checkpoint's resume state) said "mode".
    config = old.config()
    assert config["sizing"] == "equal_tokens" and "mode" not in config
    saved = {**{k: v for k, v in config.items() if k != "sizing"}, "mode": "equal_tokens"}
    assert DualConstraintBatcher.from_config(saved).config() == config
    settings = Batching(max_tokens=512, sizing="equal_tokens")
    assert DualConstraintBatcher.from_settings(settings).config() == config


def test_every_old_flat_keyword_has_one_place_in_a_group():
    old = [
        "max_tokens", "max_compute", "cost_model", "mode", "schedule", "patch_size", "num_workers", "seed",
        "on_error", "oversize", "max_buffered_samples", "lockstep_tolerance", "pin_memory", "max_member_bytes",
        "index_allow_schemes", "index_allow_outside", "text_pad_to", "lockstep_tail", "plan_chunk_samples",
        "plan_processes",
    ]  # fmt: skip
    places = {key: group_of_keyword(key) for key in old}
    assert all(places.values()), places
    assert len(set(places.values())) == len(old)  # no two old keywords land on one field
    # The DataModule's own parameters stay where they were.
    for kept in ("train_shards", "val_shards", "synthetic", "val_underfull", "sample_transform"):
        assert group_of_keyword(kept) is None
    fields = {f.name for cls in DATAMODULE_GROUPS.values() for f in dataclasses.fields(cls)}
    assert {field for _, field in places.values()} <= fields


def test_settings_groups_are_frozen_and_keyword_only():
    for cls in DATAMODULE_GROUPS.values():
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
        value = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.__setattr__(dataclasses.fields(cls)[0].name, None)


def test_an_old_form_recipe_is_nested_with_one_warning():
    recipe = {
        "trainer": {"max_steps": 2},
        "data": {
            "class_path": "lightning_adaptiveload.AdaptiveLoadDataModule",
            "init_args": {"train_shards": "d", "max_tokens": 900, "mode": "dual", "schedule": "lockstep",
                          "plan": {"lockstep_tail": "bucketed"}, "num_workers": 0},
        },
    }  # fmt: skip
    with pytest.warns(DeprecationWarning, match="nest them as data.init_args.batching.max_tokens") as caught:
        nested = nest_recipe(recipe)
    assert len(caught) == 1
    assert nested["data"]["init_args"] == {
        "train_shards": "d",
        "batching": {"max_tokens": 900, "sizing": "dual"},
        "plan": {"lockstep_tail": "bucketed", "schedule": "lockstep"},
        "loader": {"num_workers": 0},
    }
    assert nested["trainer"] == recipe["trainer"] and recipe["data"]["init_args"]["mode"] == "dual"  # a copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nest_recipe(nested) == nested  # the new form: unchanged, no warning
        assert nest_recipe([1, 2]) == [1, 2] and nest_recipe({"data": 3}) == {"data": 3}
    with pytest.raises(ValueError, match="data.init_args.batching.max_tokens is given twice"):
        nest_data_args({"max_tokens": 1, "batching": {"max_tokens": 2}})


def test_old_form_flags_are_renamed_with_one_warning():
    argv = ["fit", "--data.init_args.mode=equal_tokens", "--data.max_tokens", "900",
            "--data.init_args.synthetic.num_samples=64", "--data.init_args.plan.schedule=lockstep"]  # fmt: skip
    with pytest.warns(DeprecationWarning, match="the command line uses the flat DataModule keys") as caught:
        out = nest_flags(argv)
    assert len(caught) == 1
    assert out == ["fit", "--data.init_args.batching.sizing=equal_tokens", "--data.init_args.batching.max_tokens=900",
                   "--data.init_args.synthetic.num_samples=64", "--data.init_args.plan.schedule=lockstep"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nest_flags(out) == out


def test_a_null_flag_for_a_group_field_sets_that_field_alone():
    # jsonargparse reads `--data.init_args.batching.max_compute=null` as the string "None"; the CLI passes
    # the field inside its group instead, in either form, and the parsed value is None.
    flags = ["--data.init_args.batching.max_compute=null", "--data.init_args.plan.max_buffered_samples", "~"]
    assert nest_flags(flags) == [
        '--data.init_args.batching={"max_compute": null}',
        '--data.init_args.plan={"max_buffered_samples": null}',
    ]


def test_the_null_flag_reaches_the_datamodule_as_none(capsys, monkeypatch):
    import sys

    import yaml

    from lightning_adaptiveload.cli.fit import build_cli

    monkeypatch.setattr(sys, "argv", ["lightning-adaptiveload"])
    with pytest.raises(SystemExit):
        build_cli(
            ["fit", "--config", QUICKSTART, "--data.init_args.batching.max_compute=null", "--print_config"]
        )
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    # Set alone: the recipe's other batching keys stay.
    assert data["batching"]["max_compute"] is None and data["batching"]["max_tokens"] == 1024


def test_the_hyperparameters_are_plain_data_and_rebuild_the_datamodule(tmp_path):
    # A DDP resume failed: the checkpoint held the settings objects, and Lightning reads it with
    # weights_only=True, which refuses any class it does not know. The groups are saved as their dicts.
    import torch

    from lightning_adaptiveload.planning.cost_model import CostModel

    dm = AdaptiveLoadDataModule(
        "data",
        batching=Batching(max_tokens=512, max_compute=3.0, cost_model=CostModel(kind="power", p=1.5)),
        plan=PlanSettings(schedule="lockstep"),
        source=Source(index_allow_schemes=["https"]),
    )
    torch.save({"datamodule_hyper_parameters": dict(dm.hparams)}, tmp_path / "h.pt")
    saved = torch.load(tmp_path / "h.pt", weights_only=True)["datamodule_hyper_parameters"]
    assert saved["batching"]["cost_model"] == {"kind": "power", "p": 1.5, "scale": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = AdaptiveLoadDataModule(**saved)  # what LightningDataModule.load_from_checkpoint does
    for name in ("batching", "plan_settings", "loader", "source"):
        assert getattr(again, name) == getattr(dm, name), name
    assert again.batcher.config() == dm.batcher.config()

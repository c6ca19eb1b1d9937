"""The DataModule's settings groups (issue 39, item 1): Batching, PlanSettings, Loader, Source.

Each setting is checked in one place: a bad value raises one ValueError, from the same function whichever
layer it came through (the DataModule with the group as an object or as its dict, the batcher, the
settings class itself), naming the key and the value. The DataModule takes its settings as these groups
only (0.2.0 removed the flat keywords of 0.1.0).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings

import pytest
from _paths import ROOT

from lightning_adaptiveload import AdaptiveLoadDataModule
from lightning_adaptiveload.cli.fit import group_flags
from lightning_adaptiveload.loading.settings import DATAMODULE_GROUPS, Loader, Source
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.planning.sizing import BatchSizer

QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")

# (group, field, a bad value, where it is checked: (file, function)).
BAD = [
    ("batching", "max_tokens", 0, ("planning/sizing.py", "__post_init__")),
    ("batching", "max_tokens", "many", ("planning/sizing.py", "__post_init__")),
    ("batching", "sizing", "dual2", ("planning/sizing.py", "__post_init__")),
    ("batching", "patch_size", (1, 2), ("planning/sizing.py", "_patch")),
    ("batching", "max_compute", "lots", ("planning/settings.py", "__post_init__")),
    ("batching", "oversize", "drop", ("planning/settings.py", "__post_init__")),
    ("plan", "schedule", "sync", ("planning/settings.py", "__post_init__")),
    ("plan", "lockstep_tail", "none", ("planning/settings.py", "__post_init__")),
    ("plan", "lockstep_tolerance", 1.5, ("planning/settings.py", "__post_init__")),
    ("plan", "chunk_samples", 0, ("planning/settings.py", "__post_init__")),
    ("plan", "plan_processes", 0, ("planning/settings.py", "__post_init__")),
    ("loader", "num_workers", -1, ("loading/settings.py", "__post_init__")),
    ("loader", "num_workers", 1.5, ("loading/settings.py", "_integer")),
    ("loader", "text_pad_to", 0, ("loading/settings.py", "__post_init__")),
    ("source", "on_error", "ignore", ("shards/format.py", "check_on_error")),
    ("source", "max_member_bytes", -5, ("loading/settings.py", "__post_init__")),
]


def _raise_site(call) -> tuple[ValueError, tuple[str, str]]:
    """The one ValueError ``call`` raises and the (file, function) that raised it."""
    with pytest.raises(ValueError) as info:
        call()
    err = info.value
    last = traceback.extract_tb(err.__traceback__)[-1]
    path = last.filename.replace(os.sep, "/")
    return err, ("/".join(path.split("/")[-2:]), last.name)


@pytest.mark.parametrize("group, field, value, site", BAD, ids=[f"{b[1]}={b[2]!r}" for b in BAD])
def test_each_bad_value_is_refused_once_from_one_place(group, field, value, site):
    cls = DATAMODULE_GROUPS[group]
    calls = {
        "nested": lambda: AdaptiveLoadDataModule("data", **{group: cls(**{field: value})}),
        # A group's dict: what a checkpoint's hyper-parameters hold.
        "dict": lambda: AdaptiveLoadDataModule("data", **{group: {field: value}}),
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
        assert field in message, (how, message)
        assert repr(value) in message or str(value) in message, (how, message)
    assert sites == {site}, (field, sites)


def test_the_batch_sizer_checks_sizing_and_max_tokens_where_batching_does():
    _, direct = _raise_site(lambda: BatchSizer(64, sizing="sometimes"))
    _, nested = _raise_site(lambda: Batching(sizing="sometimes"))  # type: ignore[arg-type]
    assert direct == nested == ("planning/sizing.py", "__post_init__")


def test_a_group_given_as_its_dict_builds_the_same_settings():
    nested = AdaptiveLoadDataModule(
        "data",
        batching=Batching(max_tokens=512, sizing="equal_tokens", oversize="skip"),
        plan=PlanSettings(schedule="lockstep", lockstep_tail="bucketed", chunk_samples=1000),
        loader=Loader(num_workers=0, seed=3, text_pad_to=8),
        source=Source(on_error="skip", index_allow_outside=True),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = AdaptiveLoadDataModule(
            "data",
            batching={"max_tokens": 512, "sizing": "equal_tokens", "oversize": "skip"},
            plan={"schedule": "lockstep", "lockstep_tail": "bucketed", "chunk_samples": 1000},
            loader={"num_workers": 0, "seed": 3, "text_pad_to": 8},
            source={"on_error": "skip", "index_allow_outside": True},
        )
    for name in ("batching", "plan_settings", "loader", "source"):
        assert getattr(plain, name) == getattr(nested, name), name
    assert plain.batcher.config() == nested.batcher.config() and plain.batcher.sizing == "equal_tokens"
    assert (plain.num_workers, plain.seed, plain.text_pad_to, plain.on_error) == (0, 3, 8, "skip")


def test_defaults_need_no_keyword_and_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm = AdaptiveLoadDataModule("data")
    assert dm.batching == Batching() and dm.loader == Loader() and dm.source == Source()
    # The DataModule plans big epochs in segments by default (plan_epoch's own default plans at once).
    assert dm.plan_settings == PlanSettings(chunk_samples=500_000)


def test_a_flat_keyword_or_a_bad_group_is_a_type_error():
    # The flat keywords of 0.1.0 are gone: each is a keyword the DataModule does not take.
    for flat in ("max_tokens", "schedule", "num_workers", "mode", "plan_chunk_samples"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{flat}'"):
            AdaptiveLoadDataModule("data", **{flat: 1})
    with pytest.raises(TypeError, match=r"plan: unknown key\(s\) \['mode'\]; PlanSettings has"):
        AdaptiveLoadDataModule("data", plan={"mode": "lockstep"})
    with pytest.raises(TypeError, match="batching: expected a Batching"):
        AdaptiveLoadDataModule("data", batching=PlanSettings(schedule="lockstep"))
    dm = AdaptiveLoadDataModule("data", plan=PlanSettings(schedule="lockstep"), loader=Loader(num_workers=0))
    assert dm.schedule == "lockstep" and dm.num_workers == 0


def test_the_batcher_takes_sizing_only():
    with pytest.raises(TypeError, match="unexpected keyword argument 'mode'"):
        DualConstraintBatcher(512, mode="equal_tokens")  # type: ignore[call-arg]
    batcher = DualConstraintBatcher(512, sizing="equal_tokens")
    assert not hasattr(batcher, "mode") and not hasattr(batcher.sizer, "mode")
    assert batcher.sizing == batcher.sizer.sizing == "equal_tokens"
    config = batcher.config()
    assert config["sizing"] == "equal_tokens" and "mode" not in config
    assert DualConstraintBatcher.from_config(config).config() == config
    settings = Batching(max_tokens=512, sizing="equal_tokens")
    assert DualConstraintBatcher.from_settings(settings).config() == config


def test_settings_groups_are_frozen_and_keyword_only():
    for cls in DATAMODULE_GROUPS.values():
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
        value = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.__setattr__(dataclasses.fields(cls)[0].name, None)


def test_group_flags_take_the_init_args_form():
    argv = ["fit", "--data.batching.max_tokens", "900", "--data.init_args.synthetic.num_samples=64",
            "--data.init_args.plan.schedule=lockstep", "--data.init_args.max_tokens=5"]  # fmt: skip
    assert group_flags(argv) == [
        "fit",
        "--data.init_args.batching.max_tokens=900",
        "--data.init_args.synthetic.num_samples=64",  # not a settings group: as it was
        "--data.init_args.plan.schedule=lockstep",
        "--data.init_args.max_tokens=5",  # a flat key: left for the parser to refuse, naming it
    ]
    assert group_flags(group_flags(argv)) == group_flags(argv)


def test_a_null_flag_for_a_group_field_sets_that_field_alone():
    # jsonargparse reads `--data.init_args.batching.max_compute=null` as the string "None"; the CLI passes
    # the field inside its group instead, in either form, and the parsed value is None.
    flags = ["--data.init_args.batching.max_compute=null", "--data.init_args.plan.max_buffered_samples", "~"]
    assert group_flags(flags) == [
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

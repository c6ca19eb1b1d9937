"""VideoDiTModule's settings groups (issue 39, item 1): each setting validated in one place, the flat keywords
of earlier releases merged into their groups with one DeprecationWarning, checkpoints with plain hyper-parameters,
and recipes in both forms through the real LightningCLI path."""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from _paths import ROOT

from lightning_adaptiveload.models.compile_check import CompileSettings
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.models.module_settings import (
    DEPRECATED_KEYWORDS,
    MemorySettings,
    ModuleSettings,
    OptimizerSettings,
    SamplingSettings,
    settings_from_keywords,
)

QUICKSTART = ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml"
_MEMORY = {"num_blocks": 2, "base_bytes": 1.0, "token_all": 1.0, "text_all": 1.0, "token_block": 1.0,
           "text_block": 1.0}  # fmt: skip

# (group, field, a bad value): every check of every group.
BAD = [
    (OptimizerSettings, "lr", 0.0),
    (OptimizerSettings, "lr", float("nan")),
    (OptimizerSettings, "betas", (0.9,)),
    (OptimizerSettings, "betas", (0.9, 1.0)),
    (OptimizerSettings, "weight_decay", -0.1),
    (OptimizerSettings, "eps", 0),
    (OptimizerSettings, "warmup_steps", -1),
    (OptimizerSettings, "warmup_steps", 2.5),
    (OptimizerSettings, "weight_dtype", "fp16"),
    (SamplingSettings, "timestep_sampling", "lognormal"),
    (SamplingSettings, "shift", 0),
    (SamplingSettings, "sigmoid_scale", -1.0),
    (SamplingSettings, "num_train_timesteps", 0),
    (SamplingSettings, "val_timesteps", (0.5, 1.5)),
    (SamplingSettings, "val_timesteps", ()),
    (MemorySettings, "activation_checkpointing", "yes"),
    (MemorySettings, "checkpoint_policy", "save_everything"),
    (MemorySettings, "checkpoint_blocks", -1),
    (MemorySettings, "checkpoint_blocks", "all"),
    (MemorySettings, "checkpoint_blocks", "auto"),  # without activation_memory
    (MemorySettings, "activation_memory", {"num_blocks": 2}),  # keys missing
    (MemorySettings, "memory_budget_gib", 0.0),
    (MemorySettings, "expandable_segments", "yes"),
]


def _site(err: BaseException) -> tuple[str, str]:
    """Where an error was raised: the innermost frame's file name and function."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return Path(frame.filename).name, frame.name


@pytest.mark.parametrize("cls, key, value", BAD, ids=[f"{c.__name__}.{k}={v!r}" for c, k, v in BAD])
def test_each_bad_value_has_exactly_one_error_site(cls, key, value):
    group = {OptimizerSettings: "optimizer", SamplingSettings: "sampling", MemorySettings: "memory"}[cls]
    sites, messages = set(), []
    # The same bad value through every way in: the group itself, the module with the group, the flat keyword.
    ways = [lambda: cls(**{key: value}), lambda: VideoDiTModule(**{group: {key: value}})]
    if key in DEPRECATED_KEYWORDS:
        ways.append(lambda: VideoDiTModule(**{key: value}))
    for build in ways:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with pytest.raises(ValueError) as err:
                build()
        sites.add(_site(err.value))
        messages.append(str(err.value))
    assert sites == {("module_settings.py", "__post_init__")}
    # The message names the recipe key and the value.
    assert all(f"model.init_args.{group}.{key}" in m and repr(value)[:4] in m for m in messages), messages


def test_good_values_are_normalised_once():
    opt = OptimizerSettings(betas=[0.8, 0.9])  # YAML gives lists
    assert opt.betas == (0.8, 0.9)
    assert SamplingSettings(val_timesteps=[0, 1]).val_timesteps == (0.0, 1.0)
    mem = MemorySettings(checkpoint_blocks="auto", activation_memory=_MEMORY)
    assert mem.activation_memory == _MEMORY and mem.activation_memory is not _MEMORY
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        OptimizerSettings(1e-3)  # type: ignore[misc]  # keyword-only


def test_the_deprecated_keywords_are_the_fields_of_the_groups():
    fields = {
        f.name
        for cls in (OptimizerSettings, SamplingSettings, MemorySettings)
        for f in dataclasses.fields(cls)
    } - {"expandable_segments"}  # new settings are given in their group only
    assert DEPRECATED_KEYWORDS == fields and VideoDiTModule.deprecated_keywords == fields
    assert len(fields) == 16  # 21 parameters before: these, plus the 5 that stay


# ------------------------------------------------------------------------------------- flat keywords


def test_flat_keywords_build_the_same_module_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = VideoDiTModule(
            lr=2e-3, warmup_steps=10, shift=1.0, activation_checkpointing=True, weight_dtype="bf16"
        )
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(ours) == 1 and ours[0].filename == __file__  # points at the caller
    text = str(ours[0].message)
    for part in ("optimizer=OptimizerSettings(lr=..., warmup_steps=..., weight_dtype=...)",
                 "sampling=SamplingSettings(shift=...)", "memory=MemorySettings(activation_checkpointing=...)"):  # fmt: skip
        assert part in text, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = VideoDiTModule(
            optimizer=OptimizerSettings(lr=2e-3, warmup_steps=10, weight_dtype="bf16"),
            sampling=SamplingSettings(shift=1.0),
            memory=MemorySettings(activation_checkpointing=True),
        )
    for name in ("optimizer_settings", "sampling_settings", "memory_settings", "compile_settings"):
        assert getattr(old, name) == getattr(new, name), name
    assert dict(old.hparams) == dict(new.hparams)


def test_flat_keywords_merge_into_a_given_group_and_refuse_a_second_value():
    with pytest.warns(DeprecationWarning):
        got = settings_from_keywords({"optimizer": OptimizerSettings(weight_dtype="bf16")}, {"lr": 3e-3})
    assert got == ModuleSettings(optimizer=OptimizerSettings(lr=3e-3, weight_dtype="bf16"))
    with pytest.warns(DeprecationWarning):  # the same value both ways is not a conflict
        VideoDiTModule(optimizer=OptimizerSettings(lr=3e-3), lr=3e-3)
    with pytest.raises(TypeError, match=r"lr=0.003 as a flat keyword and optimizer.lr=0.001"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            VideoDiTModule(optimizer=OptimizerSettings(lr=1e-3), lr=3e-3)


def test_unknown_keywords_name_the_nearest():
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'; did you mean 'lr'"):
        VideoDiTModule(lrr=1e-3)
    with pytest.raises(TypeError, match=r"model.init_args.memory: unknown key\(s\) \['checkpoint_blokcs'\]"):
        VideoDiTModule(memory={"checkpoint_blokcs": 2})
    with pytest.raises(TypeError, match="expected a SamplingSettings"):
        VideoDiTModule(sampling=5.0)


# ----------------------------------------------------------------------------------- compile, checkpoint


def test_compile_takes_a_bool_or_compile_settings():
    assert VideoDiTModule().compile_settings is None
    assert VideoDiTModule(compile=True).compile_settings == CompileSettings()
    chosen = CompileSettings(backend="aot_eager", dynamic=False)
    module = VideoDiTModule(compile=chosen)
    assert module.compile_settings is chosen and module.hparams["compile"]["backend"] == "aot_eager"
    module.configure_model()
    assert all(block._compiled_call_impl is not None for block in module.model.blocks)
    with pytest.raises(TypeError, match="model.init_args.compile"):
        VideoDiTModule(compile="yes")


def test_a_checkpoint_keeps_plain_hyper_parameters_and_restores_the_settings(tmp_path):
    import lightning

    module = VideoDiTModule(
        optimizer=OptimizerSettings(lr=3e-3, betas=(0.8, 0.9)),
        sampling=SamplingSettings(val_timesteps=(0.5,)),
        memory=MemorySettings(activation_checkpointing=True, checkpoint_blocks=1),
        compile=CompileSettings(backend="aot_eager"),
    )
    module.configure_model()
    path = tmp_path / "m.ckpt"
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
         "pytorch-lightning_version": lightning.__version__},
        path,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        torch.load(path, weights_only=True)  # plain values only
        again = VideoDiTModule.load_from_checkpoint(path, weights_only=True)
    for name in ("optimizer_settings", "sampling_settings", "memory_settings", "compile_settings"):
        assert getattr(again, name) == getattr(module, name), name
    # A checkpoint of an earlier release keeps the flat keywords: it loads, with the warning.
    old = tmp_path / "old.ckpt"
    flat = {"preset": "tiny", "lr": 3e-3, "shift": 1.0, "activation_checkpointing": True, "compile": False}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": flat,
                "pytorch-lightning_version": lightning.__version__}, old)  # fmt: skip
    with pytest.warns(DeprecationWarning, match="flat keywords are deprecated"):
        restored = VideoDiTModule.load_from_checkpoint(old, weights_only=True)
    assert restored.optimizer_settings.lr == 3e-3 and restored.sampling_settings.shift == 1.0


# ------------------------------------------------------------------------------------------------- CLI


def _old_form(recipe: dict) -> dict:
    """The recipe with its model section in the flat form of earlier releases."""
    args = recipe["model"]["init_args"]
    for group in ("optimizer", "sampling", "memory"):
        args.update(args.pop(group, None) or {})
    return recipe


def test_route_legacy_keywords_moves_only_the_deprecated_keys(tmp_path):
    from lightning_adaptiveload.cli.fit import route_legacy_keywords

    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(_old_form(yaml.safe_load(QUICKSTART.read_text()))))
    argv = [
        "fit",
        "--config",
        str(old),
        "--model.init_args.shift=2",
        "--model.init_args.lrr=1",
        "--trainer.devices=1",
    ]
    routed = route_legacy_keywords(argv)
    assert routed[:2] == ["fit", "--config"]
    assert routed[3:] == ["--model.dict_kwargs.shift=2", "--model.init_args.lrr=1", "--trainer.devices=1"]
    model = yaml.safe_load(routed[2])["model"]
    assert model["dict_kwargs"] == {"lr": 2e-3, "warmup_steps": 10, "shift": 1.0}
    assert model["init_args"] == {"preset": "tiny"}
    assert route_legacy_keywords(["fit", "--config", str(QUICKSTART)]) is None  # the new form: untouched
    # A model class without deprecated keywords: its keys are the parser's to check.
    other = _old_form(yaml.safe_load(QUICKSTART.read_text()))
    other["model"]["class_path"] = "lightning.pytorch.demos.boring_classes.BoringModel"
    old.write_text(yaml.safe_dump(other))
    assert route_legacy_keywords(argv) is None


@pytest.mark.timeout(240)
def test_recipes_in_both_forms_build_the_same_module_through_the_cli(tmp_path, monkeypatch):
    import sys

    from lightning_adaptiveload.cli.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-adaptiveload"])
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(_old_form(yaml.safe_load(QUICKSTART.read_text()))))
    common = [
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.logger=false",
        "--trainer.callbacks=[]",
    ]
    built = {}
    for form, recipe in (("new", QUICKSTART), ("old", old)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = build_cli(["--config", str(recipe), *common], run=False)
        deprecations = [w for w in caught if "flat keywords are deprecated" in str(w.message)]
        assert len(deprecations) == (form == "old"), form
        assert isinstance(cli.model.optimizer_settings, OptimizerSettings)  # jsonargparse built the dataclass
        built[form] = cli.model
    for name in ("optimizer_settings", "sampling_settings", "memory_settings", "compile_settings"):
        assert getattr(built["old"], name) == getattr(built["new"], name), name
    assert built["new"].optimizer_settings.lr == 2e-3 and built["new"].sampling_settings.shift == 1.0
    # compile: a bool, or CompileSettings' fields; a second value changes one field of a group.
    cli = build_cli(
        ["--config", str(QUICKSTART), *common, "--model.init_args.compile={backend: aot_eager, mode: null}",
         "--model.init_args.optimizer.weight_dtype=bf16"],
        run=False,
    )  # fmt: skip
    assert cli.model.compile_settings == CompileSettings(backend="aot_eager")
    assert cli.model.optimizer_settings == OptimizerSettings(lr=2e-3, warmup_steps=10, weight_dtype="bf16")


# ------------------------------------------------------------------------------ expandable segments


def test_expandable_segments_are_set_before_the_network_is_built(monkeypatch):
    from lightning_adaptiveload.models import acceleration, module

    calls = []
    monkeypatch.setattr(acceleration, "use_expandable_segments", lambda: calls.append("alloc") or "on")
    real_init = module.VideoDiT.__init__

    def built(self, *args, **kwargs):
        calls.append("build")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(module.VideoDiT, "__init__", built)
    VideoDiTModule(memory={"expandable_segments": True}).configure_model()
    VideoDiTModule().configure_model()  # off by default
    assert calls == ["alloc", "build", "build"]


def test_use_expandable_segments_respects_the_environment(monkeypatch):
    from lightning_adaptiveload.models import acceleration

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert acceleration.use_expandable_segments() == "on" and seen == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert "the environment decides" in acceleration.use_expandable_segments() and len(seen) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert acceleration.use_expandable_segments() == "not applied: no CUDA"

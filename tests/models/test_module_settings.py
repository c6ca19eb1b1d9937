"""VideoDiTModule's settings groups (issue 39, item 1): each setting validated in one place, the groups as the
only form (0.2.0 removed the flat keywords), checkpoints with plain hyper-parameters (0.1.0's included), and a
recipe through the real LightningCLI path."""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from _paths import ROOT

from lightning_adaptiveload.models.compile_check import CompileSettings
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.models.module_settings import (
    MemorySettings,
    ModuleSettings,
    OptimizerSettings,
    SamplingSettings,
    module_settings,
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
    # The same bad value through every way in: the group itself, the module with the group (object or dict).
    ways = [
        lambda: cls(**{key: value}),
        lambda: VideoDiTModule(**{group: {key: value}}),
        lambda: module_settings({group: {key: value}}),
    ]
    for build in ways:
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


def test_the_groups_are_the_only_form():
    # 0.1.0's flat keywords (lr=, shift=, activation_checkpointing=, ...) are keywords the module does not take.
    for flat in ("lr", "warmup_steps", "shift", "activation_checkpointing", "weight_dtype"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{flat}'"):
            VideoDiTModule(**{flat: 1})
    assert not hasattr(VideoDiTModule, "deprecated_keywords")
    got = module_settings({"optimizer": {"lr": 3e-3, "weight_dtype": "bf16"}, "sampling": None})
    assert got == ModuleSettings(optimizer=OptimizerSettings(lr=3e-3, weight_dtype="bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = VideoDiTModule(
            optimizer=OptimizerSettings(lr=2e-3, warmup_steps=10, weight_dtype="bf16"),
            sampling=SamplingSettings(shift=1.0),
            memory=MemorySettings(activation_checkpointing=True),
        )
    assert module.optimizer_settings.lr == 2e-3 and module.memory_settings.activation_checkpointing


def test_unknown_keywords_are_refused_naming_them():
    with pytest.raises(TypeError, match="unexpected keyword argument 'lrr'"):
        VideoDiTModule(lrr=1e-3)  # type: ignore[call-arg]
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


def test_the_hyper_parameters_of_a_0_1_0_checkpoint_rebuild_the_module():
    # 0.1.0 saved the groups as their dicts already: they are read as they are.
    from _paths import ASSETS

    saved = torch.load(ASSETS / "quickstart_v0.1.0_step30.ckpt", map_location="cpu", weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = VideoDiTModule(**saved["hyper_parameters"])
    assert module.optimizer_settings == OptimizerSettings(lr=2e-3, warmup_steps=10)
    assert module.sampling_settings.shift == 1.0 and dict(module.hparams) == saved["hyper_parameters"]


# ------------------------------------------------------------------------------------------------- CLI


@pytest.mark.timeout(240)
def test_a_recipe_builds_the_module_through_the_cli(tmp_path, monkeypatch):
    import sys

    from lightning_adaptiveload.cli.fit import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-adaptiveload"])
    common = [
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.logger=false",
        "--trainer.callbacks=[]",
    ]
    cli = build_cli(["--config", str(QUICKSTART), *common], run=False)
    assert isinstance(cli.model.optimizer_settings, OptimizerSettings)  # jsonargparse built the dataclass
    assert cli.model.optimizer_settings.lr == 2e-3 and cli.model.sampling_settings.shift == 1.0
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

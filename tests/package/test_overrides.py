"""Every Lightning hook the package overrides carries ``@override`` (``typing_extensions.override`` sets
``__override__`` on it), so that a hook Lightning renames or drops is found by a type checker, not by a run
whose hook silently never fires."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning.pytorch as pl
import pytest
from typing_extensions import override

import lightning_adaptiveload
from lightning_adaptiveload.fusion.mixin import FusedNormModulateMixin

LIGHTNING_BASES = (pl.Callback, pl.LightningModule, pl.LightningDataModule)


def _function(value):
    """The function behind a class attribute: a plain function, or the one a descriptor wraps."""
    for attr in ("__func__", "fget", "fn"):  # staticmethod/classmethod, property, the DataModule's _only_with
        inner = getattr(value, attr, None)
        if inner is not None:
            return inner
    return value


def _is_lightning(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning")


def unmarked_overrides(cls: type) -> list[str]:
    """``Class.method`` for each method defined in ``cls`` or its package bases that overrides a method of a
    Lightning class in its MRO without ``__override__``."""
    mro = inspect.getmro(cls)
    found = []
    for i, owner in enumerate(mro):
        if _is_lightning(owner) or not owner.__module__.startswith(lightning_adaptiveload.__name__):
            continue
        for name, value in vars(owner).items():
            if name.startswith("__") or not callable(_function(value)):
                continue
            if not any(_is_lightning(base) and name in vars(base) for base in mro[i + 1 :]):
                continue
            if not getattr(_function(value), "__override__", False) and not getattr(
                value, "__override__", False
            ):
                found.append(f"{owner.__qualname__}.{name}")
    return found


def _package_classes() -> list[type]:
    for info in pkgutil.walk_packages(lightning_adaptiveload.__path__, lightning_adaptiveload.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    seen: dict[str, type] = {}
    stack = list(LIGHTNING_BASES)
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith(lightning_adaptiveload.__name__ + "."):
                seen[f"{sub.__module__}.{sub.__qualname__}"] = sub

    class MixedIn(FusedNormModulateMixin, pl.LightningModule):  # the mixin's hooks, in a LightningModule
        pass

    seen["fusion.mixin (in a LightningModule)"] = MixedIn
    return list(seen.values())


def test_every_overridden_lightning_hook_carries_override():
    classes = _package_classes()
    names = {c.__name__ for c in classes}
    expected = {"LoadBalanceMonitor", "ClosedLoop", "AlignedGC", "KernelWarmup", "AdaptiveLoadDataModule"}
    expected |= {"VideoDiTModule", "IngestModule", "ShardPredictionWriter", "MixedIn"}
    assert expected <= names, expected - names  # the walk found the package's Lightning classes
    missing = sorted({m for cls in classes for m in unmarked_overrides(cls)})
    assert missing == [], f"add @override (from typing_extensions import override) to: {missing}"


def test_the_check_catches_a_hook_without_override():
    class Plain(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pass

        def helper(self):  # not a Lightning method: no decorator needed
            pass

    class Marked(pl.Callback):
        @override
        def on_train_start(self, trainer, pl_module):
            pass

    Plain.__module__ = Marked.__module__ = lightning_adaptiveload.__name__ + ".probe"
    assert unmarked_overrides(Plain) == [
        "test_the_check_catches_a_hook_without_override.<locals>.Plain.on_train_start"
    ]
    assert unmarked_overrides(Marked) == []


@pytest.mark.parametrize("base", LIGHTNING_BASES)
def test_lightning_bases_are_not_checked_themselves(base):
    assert unmarked_overrides(base) == []

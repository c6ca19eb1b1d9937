"""Lazy re-exports for package ``__init__`` modules.

A package re-exports its public names without importing the modules that define them, so importing a
pure submodule (``lightning_adaptiveload.stats``) never pulls in Lightning through its package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """Module ``__getattr__``, ``__dir__`` and ``__all__`` for a package.

    Args:
        package: the package's ``__name__``.
        exports: public name -> submodule (relative to ``package``) that defines it.
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_ = importlib.import_module(package).__dict__
        globals_[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__, names

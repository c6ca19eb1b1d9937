"""Command line: `python -m lightning_adaptiveload` (LightningCLI `fit`, and the tool commands)."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {},
)

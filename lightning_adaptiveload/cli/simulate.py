"""`lightning-adaptiveload simulate`: the planning simulator."""

from lightning_adaptiveload.tools.simulate import main

__all__ = ["main"]

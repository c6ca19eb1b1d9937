"""`lightning-adaptiveload calibrate`: time the model, fit the cost model, find the token budget."""

from lightning_adaptiveload.tools.calibrate import main

__all__ = ["main"]

"""`lightning-adaptiveload build-ops`: compile the fused CUDA op ahead of time."""

from lightning_adaptiveload.ops._build import main

__all__ = ["main"]

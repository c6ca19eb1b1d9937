"""Tools that use the library: calibration of a model on a GPU, the planning simulator."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "SimulationResult": "simulate",
        "StepTimeTable": "simulate",
        "estimate_memory": "memory",
        "MemoryEstimate": "memory",
    },
)

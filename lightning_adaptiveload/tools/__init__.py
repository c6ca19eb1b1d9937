"""Tools that use the library: calibration of a model on a GPU, the planning simulator (``simulate``: the
orchestrator; ``replay``: one configuration planned and replayed; ``step_times``: what a batch costs;
``simulate_plots``: its figures)."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "SimulationResult": "simulate",
        "StepTimeTable": "step_times",
        "BatchCoster": "step_times",
        "Replay": "replay",
        "balance_metrics": "replay",
        "plot_result": "simulate_plots",
    },
)

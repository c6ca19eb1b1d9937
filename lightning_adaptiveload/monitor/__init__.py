"""Load-balance measurement: statistics (``stats``, pure), the per-step table (``steps``, pure), result files
(``report``, pure, shared with the simulator), clocks (``timing``), FLOPs (``flops``), the
LoadBalanceMonitor callback (``callback``) with its cost-model refit (``cost_refit``), and the AlignedGC
callback (``aligned_gc``); the two callbacks are the only modules here that import Lightning."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "LoadBalanceMonitor": "callback",
        "AlignedGC": "aligned_gc",
        "BatchFlops": "flops",
        "HostClock": "timing",
        "ManualClock": "timing",
        "CostRefitter": "cost_refit",
        "CudaClock": "timing",
        "BackwardTimer": "timing",
        "split_blocks": "steps",
        "step_table": "steps",
        "jsonable": "report",
        "write_json": "report",
        "FsdpStepTimer": "fsdp_timing",
    },
)

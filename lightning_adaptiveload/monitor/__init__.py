"""Load-balance measurement, without Lightning: the per-step table (``steps``), result files (``report``,
shared with the simulator), clocks (``timing``, ``fsdp_timing``), FLOPs (``flops``); and the pure parts of the
closed loop that plans with those measurements: the cost-model refit (``cost_refit``), the mid-epoch replan
decision (``replan``) and its checkpoint state's versions and schema (``loop_state``). The callbacks that use them are in
:mod:`lightning_adaptiveload.callbacks` (``LoadBalanceMonitor``, ``ClosedLoop``); the balance statistics are in
:mod:`lightning_adaptiveload.stats`."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
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

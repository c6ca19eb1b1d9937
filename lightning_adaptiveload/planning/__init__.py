"""Who computes what (pure, no Lightning): the cost model, the batch sizing rule and batching stage, the epoch planner."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "CostModel": "cost_model",
        "DualConstraintBatcher": "batching",
        "EpochPlan": "planner",
        "collate": "batching",
        "collate_packed": "packed_collate",
        "plan_epoch": "planner",
        "tokens_per_sample": "batching",
    },
)

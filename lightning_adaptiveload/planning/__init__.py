"""Who computes what (pure, no Lightning): the cost model, the batch sizing rule and batching stage, the
epoch planner (buckets, assignment, the independent, lockstep and packed schedules as objects looked up by
name in ``schedules.py``, equal steps, resume).
Which schedule to use: ``docs/schedules.md``."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "BatchSizer": "sizing",
        "Batching": "settings",
        "BucketSize": "sizing",
        "CostModel": "cost_model",
        "DualConstraintBatcher": "batching",
        "EpochPlan": "plan",
        "EpochSchedule": "job",
        "LOCKSTEP_TAILS": "tail",
        "PlanError": "plan",
        "PlanJob": "job",
        "PlanSettings": "settings",
        "SCHEDULES": "plan",
        "SCHEDULE_TYPES": "schedules",
        "consumed_refs": "resume",
        "continue_plan": "resume",
        "index_fingerprint": "inputs",
        "plan_epoch": "planner",
        "schedule_for": "schedules",
        "tokens_per_sample": "sizing",
    },
)

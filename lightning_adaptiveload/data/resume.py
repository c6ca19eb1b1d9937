"""Mid-epoch resume: the saved data position's version, and the replay that plans the rest of the epoch.

The DataModule saves, per epoch, its *segments*: the plan settings of each run of the epoch and how many
batches every rank consumed in it. :func:`resume_plan` replays them (re-planning each segment with the
samples consumed before it left out) and continues the last plan where it stopped, or re-plans the
remaining samples when the world size changed or the ranks stopped at different batches. Pure (no
Lightning).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_adaptiveload.planning.plan import EpochPlan
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan

__all__ = ["STATE_VERSION", "Resumed", "check_state_version", "resume_plan"]

#: Version of ``AdaptiveLoadDataModule.state_dict()``'s layout.
STATE_VERSION = 1


def check_state_version(state: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state`` has the layout this version reads."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"AdaptiveLoadDataModule state version {state.get('version')!r} is not supported "
            f"(expected {STATE_VERSION}); resume without the datamodule state or from a newer checkpoint"
        )


@dataclass
class Resumed:
    """The rest of a resumed epoch.

    Attributes:
        plan: the plan of the batches still to run on every rank.
        segments: the saved segments plus the new one (its ``consumed`` still None).
        segment_base: batches consumed before the new segment (the fit loop's restored count).
        kind: ``"continue"`` (the last plan, continued) or ``"replan"`` (the rest planned afresh).
        consumed_samples: samples consumed before the new segment.
    """

    plan: EpochPlan
    segments: list[dict[str, Any]]
    segment_base: int
    kind: str
    consumed_samples: int


def resume_plan(ds: Any, state: Mapping[str, Any]) -> Resumed:
    """Replay the saved segments of ``state["epoch"]`` and plan what is left of it.

    Args:
        ds: the :class:`~lightning_adaptiveload.data.loader.PlannedShardDataset` to resume (its
            ``world_size`` and ``num_workers`` are the new run's).
        state: ``AdaptiveLoadDataModule.state_dict()``'s dict.

    Raises:
        ValueError: the state belongs to other shards (another index fingerprint).
    """
    if state["fingerprint"] != ds.fingerprint:
        raise ValueError(
            "the checkpoint's data position belongs to other shards (index fingerprint "
            f"{state['fingerprint']} vs {ds.fingerprint} now): resume with the same shards, or drop the "
            "datamodule state from the checkpoint to start the epoch afresh"
        )
    epoch = int(state["epoch"])
    segments = [dict(s) for s in state["segments"]]
    # Replay the epoch's segments to find what was consumed and the last plan.
    plan: EpochPlan | None = None
    gone: set[tuple[int, int]] = set()
    previous = 0
    for seg in segments:
        if seg["kind"] == "continue" and plan is not None:
            plan = continue_plan(plan, previous, int(seg["num_workers"]))
        else:
            plan = ds.make_plan(epoch, seg, exclude=gone)
        consumed = [int(x) for x in seg["consumed"]]
        gone |= consumed_refs(plan, consumed)
        previous = consumed[0]
    assert plan is not None
    last = segments[-1]
    same_ranks = plan.world_size == ds.world_size and len(set(last["consumed"])) == 1
    if same_ranks:
        new_plan = continue_plan(plan, int(last["consumed"][0]), ds.num_workers)
        kind = "continue"
    else:
        new_plan = ds.make_plan(epoch, exclude=gone)
        kind = "replan"
    return Resumed(
        plan=new_plan,
        segments=segments + [{"kind": kind, **ds.plan_settings(), "consumed": None}],
        # Lightning restores its processed-batch count to the total consumed so far (equal on all ranks).
        segment_base=sum(max(int(x) for x in s["consumed"]) for s in segments),
        kind=kind,
        consumed_samples=len(gone),
    )

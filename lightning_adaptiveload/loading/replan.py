"""Mid-epoch replanning: the rest of a running epoch planned again, with the batcher's current cost model.

The closed loop (``docs/closed_loop.md``) refits the cost model from the run's own steps. With
``RefitConfig(replan_wait=...)`` a window whose straggler wait is over the threshold has the rest of the running
epoch replanned with the refit model, here. A mid-epoch replan is a resume without a restart: it uses the
resume-by-position machinery (``loading/resume.py``).

1. **Close the running segment** at the step every rank has reached (:func:`~.resume.position_state`: each
   rank's consumed count and digest part, gathered; ranks at different steps are refused).
2. **The consumed samples** of the epoch so far: every saved rank's plan of every segment replayed into a
   :class:`~lightning_adaptiveload.planning.resume.ConsumedMask` (:func:`~.resume.consumed_mask`; the time of
   one rank-local plan per rank and segment).
3. **Plan the rest** without them, with the current settings (the batcher's refit cost model): every rank
   makes the same plan (deterministic from the same inputs), so every sample of the epoch is read once and
   every rank has the same number of steps. It is saved as a segment of kind ``"refit"`` with its settings,
   so a resume replays it exactly (:func:`~.resume.resume_plan` continues it at its position).
4. **Continue the loader** with the new plan (:meth:`~.loader.PlannedDataLoader.restart`): the next batch is
   the new plan's first; with workers, they are restarted with it.

Pure PyTorch (no Lightning): the Lightning side is the ``ClosedLoop`` callback's (``callbacks/closed_loop.py``),
which tells the trainer the epoch's new batch count (``_lightning_compat.set_epoch_length``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from lightning_adaptiveload.loading.resume import consumed_mask, position_state
from lightning_adaptiveload.planning.chunked import local_plan

__all__ = ["ReplanError", "Replanned", "replan_rest"]


class ReplanError(RuntimeError):
    """The running epoch cannot be replanned now; the message says why and what to do."""


@dataclass(frozen=True)
class Replanned:
    """What a mid-epoch replan did (the same on every rank).

    Attributes:
        epoch: the training epoch.
        consumed_steps: steps of the epoch every rank had run when it was replanned.
        steps_left_before: steps the old plan had left.
        steps_left_after: steps the new plan has (the rest of the epoch).
        consumed_samples: samples the epoch had consumed on all ranks.
        plan_seconds: wall time of the replan (the replay of the consumed samples and the new plan).
    """

    epoch: int
    consumed_steps: int
    steps_left_before: int
    steps_left_after: int
    consumed_samples: int
    plan_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def replan_rest(dm: Any) -> Replanned:
    """Plan the rest of ``dm``'s running training epoch again with its current settings; every rank must call
    it at the same step (it gathers).

    Args:
        dm: the :class:`~lightning_adaptiveload.datamodule.AdaptiveLoadDataModule` whose training epoch
            is running (its loader's iterator started and not ended).

    Raises:
        ReplanError: no training epoch is running, the ranks are at different steps, or its loader has no
            running iterator.
    """
    start = time.perf_counter()
    ds = dm.train_dataset
    loader = getattr(dm, "_train_loader", None)
    if ds is None or ds.plan is None or not dm._segments or not getattr(dm, "_iterating", False):
        raise ReplanError("no training epoch is running: a mid-epoch replan needs a running epoch")
    if loader is None or loader._live() is None:
        raise ReplanError("the training loader has no running iterator: nothing to replan")
    consumed = dm._consumed_now()  # this rank's batches of the epoch, all segments
    mine = consumed - dm._segment_base
    left_before = ds.plan.steps - mine
    state = position_state(ds, dm._segments, mine)  # gathers every rank's count and digest part
    segments = state["segments"]
    if len(set(segments[-1]["consumed"])) != 1:
        raise ReplanError(
            f"the ranks are at different steps ({segments[-1]['consumed']}): a mid-epoch replan needs every "
            "rank at the same step (it runs in on_train_batch_end, which DDP ranks reach together)"
        )
    epoch = int(ds.epoch)
    gone = consumed_mask(ds, epoch, segments)
    plan = ds.make_plan(epoch, exclude=gone or None, local=True)
    plan = local_plan(plan, ds.rank) if plan.rank is None else plan
    dm._segments = segments + [{"kind": "refit", **ds.plan_settings(), "consumed": None}]
    dm._segment_base = consumed
    ds.begin_epoch(epoch, plan)
    loader.restart()
    return Replanned(
        epoch=epoch,
        consumed_steps=consumed,
        steps_left_before=left_before,
        steps_left_after=plan.steps,
        consumed_samples=gone.total(),
        plan_seconds=time.perf_counter() - start,
    )

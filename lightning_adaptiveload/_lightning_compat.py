"""The one place this package reads or writes the Trainer's loop state (Lightning internals).

Lightning's public API does not say how far the running epoch has gone, whether a batch ends an optimizer
step, or lets a callback change the epoch's batch count. The few places that need one of these call the small
named functions here, so that a Lightning upgrade that moves an internal is fixed in one file
(``tests/package/test_layout.py::test_only_the_compat_module_edits_the_trainer`` keeps it so):

- :func:`end_exhausted_restart` (the DataModule): a checkpoint saved after the last batch of an epoch makes
  Lightning restart that epoch on resume. With nothing left in it, Lightning's epoch loop (2.x, loaders of a
  planned length) runs no iteration, keeps its ``restarting`` flag, and then does not ask for the next epoch's
  iterator in the normal way: the next epoch loses batches (``tests/data/test_resume.py``, run "c", reads
  every sample once only with this);
- :func:`total_batch_idx` and :func:`is_logging_step` (the ``LoadBalanceMonitor``): the batch's index over the
  fit, and Lightning's own logging cadence at optimizer steps;
- :func:`batches_left_in_epoch`, :func:`epoch_length_fixed_because` and :func:`set_epoch_length` (the
  ``ClosedLoop``'s mid-epoch replan): the batches left in the running epoch, and telling the fit loop its new
  batch count.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "batches_left_in_epoch",
    "end_exhausted_restart",
    "epoch_length_fixed_because",
    "is_logging_step",
    "set_epoch_length",
    "total_batch_idx",
]


def end_exhausted_restart(trainer: Any) -> bool:
    """Let Lightning end a restarted epoch that has nothing left as a fresh one (its counters untouched).

    Returns:
        Whether the flag was cleared (False: no trainer, no such loop, or not restarting).
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not getattr(loop, "restarting", False):
        return False
    loop.restarting = False
    return True


def total_batch_idx(trainer: Any) -> int:
    """The index of the running training batch over the whole fit (all epochs); the same on every rank."""
    return int(trainer.fit_loop.total_batch_idx)


def is_logging_step(trainer: Any) -> bool:
    """Whether Lightning logs at the batch that just ran: its own logging cadence, at optimizer steps only
    (with gradient accumulation every micro-batch of a logging step would match otherwise); the rule of
    Lightning's ``ThroughputMonitor``. A Lightning without these internals: ``log_every_n_steps`` and the
    public step counter."""
    try:
        if trainer.fit_loop._should_accumulate():
            return False
        return bool(trainer._logger_connector.should_update_logs)
    except AttributeError:
        n = trainer.log_every_n_steps
        return n > 0 and trainer.global_step % n == 0


def batches_left_in_epoch(trainer: Any) -> float:
    """Training batches of the running epoch not yet run (``inf`` for a loader without a length)."""
    return trainer.num_training_batches - trainer.fit_loop.epoch_loop.batch_progress.current.processed


def epoch_length_fixed_because(trainer: Any) -> str:
    """Why the running epoch's batch count cannot be changed (``""``: :func:`set_epoch_length` can change it).

    Lightning read the count from the loader when the epoch started; changing it needs a sized training
    loader, ``limit_train_batches`` at its default and a training step that takes batches (not
    ``dataloader_iter``).
    """
    loop = getattr(trainer, "fit_loop", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    if loop is None or fetcher is None or not hasattr(fetcher, "length"):
        return "this Lightning version's fit loop has no data fetcher with a length"
    if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
        return "training_step takes dataloader_iter, so Lightning fetches the batches in the step"
    if trainer.limit_train_batches != 1.0:
        return f"limit_train_batches={trainer.limit_train_batches!r} cuts the epoch at a count the replan changes"
    if not math.isfinite(float(loop.max_batches)):
        return "the training loader has no length"
    return ""


def set_epoch_length(trainer: Any, batches: int) -> None:
    """Tell the fit loop that the running epoch has ``batches`` batches in all (a replanned epoch's count):
    the loop's batch count, its data fetcher's length and end flag, and the validation interval derived from
    them (a fraction of the epoch). Check :func:`epoch_length_fixed_because` first."""
    loop = trainer.fit_loop
    loop.max_batches = int(batches)
    fetcher = loop._data_fetcher
    fetcher.length = int(batches)
    fetcher.done = fetcher.fetched >= int(batches)
    interval = trainer.val_check_interval
    if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
        trainer.val_check_batch = max(1, int(int(batches) * interval))

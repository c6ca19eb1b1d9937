"""The one place this package works around a Lightning behaviour by touching the Trainer's loop state.

A checkpoint saved after the last batch of an epoch makes Lightning restart that epoch on resume. With
nothing left in it, Lightning's epoch loop (2.x, loaders of a planned length) runs no iteration, keeps its
``restarting`` flag, and then does not ask for the next epoch's iterator in the normal way: the next epoch
loses batches (``tests/data/test_resume.py``, run "c", reads every sample once only with this). The
DataModule calls :func:`end_exhausted_restart` when a resumed epoch's plan has no step left; nothing else
in the package assigns to the Trainer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["end_exhausted_restart"]


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

"""Planning for sequence-parallel groups: which GPUs form a group, what a group's batch may hold and cost.

Under Ulysses sequence parallelism of degree G the world's GPUs form ``world_size / G`` data-parallel
*groups* of G GPUs on a 2-D mesh ``("data", "sequence")``, data outer and sequence inner: global rank ``r``
is GPU ``r % G`` of group ``r // G`` (ranks 0..G-1 form group 0). The planner needs nothing new: an epoch
is planned for the groups as if each were one rank (:func:`data_placement`), with the batching of a group
(:func:`group_batching`): G times one GPU's ``max_tokens``, and the cost on one GPU of the group,
``cost(S) / G`` plus the all-to-all (:meth:`~.cost_model.CostModel.sequence_parallel`). So a plan of 4 GPUs
at degree 2 *is* a plan of 2 ranks (the same digests), the budgets aside; exactly-once, equal steps,
lockstep and packed balance hold across the groups because they hold across ranks.

Every GPU of a group reads the group's stream: the same samples, batches and order (the model takes its
own sequence shard). Why not one reader per group that scatters: that puts a collective, and a broadcast
of whole latents, on every step's critical path, and makes the data position of a group live on one GPU.
Reading alike costs G times the read bytes of a group (the shards are read G times, from the page cache or
object storage), needs no process group on the data path, and leaves exactly-once and resume as they are:
the state saved by any GPU of a group is its group's position. Pure Python (no Lightning, no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_adaptiveload.planning.cost_model import CostModel, SequenceComm
from lightning_adaptiveload.planning.settings import Batching

__all__ = ["data_placement", "group_batching", "sequence_rank"]


def _degree(degree: Any) -> int:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"sequence_parallel must be an integer >= 1 (GPUs per group), got {degree!r}")
    return degree


def data_placement(rank: int, world_size: int, degree: int) -> tuple[int, int]:
    """``(data rank, data world size)`` of global ``rank`` of ``world_size`` GPUs in groups of ``degree``.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``degree`` (the message names both and what to do),
            or ``rank`` is not in ``[0, world_size)``.

    Example:
        >>> data_placement(3, 4, 2)
        (1, 2)
    """
    g = _degree(degree)
    if world_size % g:
        raise ValueError(
            f"plan.sequence_parallel={g} needs a world size that is a multiple of it (groups of {g} GPUs), got "
            f"{world_size} processes; run on a multiple of {g} GPUs, or set data.init_args.plan.sequence_parallel "
            f"to a divisor of {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    return rank // g, world_size // g


def sequence_rank(rank: int, degree: int) -> int:
    """The GPU of global ``rank`` within its group (the model's sequence shard): ``rank % degree``."""
    return int(rank) % _degree(degree)


def group_batching(
    batching: Batching, degree: int, comm: SequenceComm | dict[str, Any] | None = None
) -> Batching:
    """The batching a group of ``degree`` GPUs plans with: ``max_tokens`` times G, and the cost of the batch
    on one GPU of the group (:meth:`~.cost_model.CostModel.sequence_parallel`: a ``max_compute`` given as a
    number stays what one GPU may spend per step). ``degree`` 1: ``batching`` itself (the same plans).

    Raises:
        ValueError: a cost model that cannot price the all-to-all (a power model), a bad ``comm``.
    """
    g = _degree(degree)
    if g == 1:
        return batching
    cost = (
        CostModel.from_dict(batching.cost_model) if batching.cost_model is not None else CostModel.default()
    )
    return dataclasses.replace(
        batching,
        max_tokens=batching.max_tokens * g,
        cost_model=cost.sequence_parallel(g, comm).to_dict(),
    )

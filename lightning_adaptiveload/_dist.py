"""The one place that talks to ``torch.distributed``.

Rank and world size come from the trainer or from an initialised process group, never from
environment variables: Lightning does not set ``RANK`` for the processes it spawns.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_EXIT_HOOK_REGISTERED = False
# Local waits of the gloo teardown; neither sends anything to a peer. At exit: how long a rank waits for gloo's
# worker threads to stop before it exits anyway (they stop at once unless a collective is still in flight,
# which only a failed run leaves behind). After a collective: how long to wait for gloo to let go of its tensors.
EXIT_JOIN_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 1.0


def destroy_gloo_group_at_exit() -> None:
    """Stop gloo's worker threads when this process exits, before the interpreter finalizes (CPU DDP).

    Why: a gloo worker thread finishes a collective, wakes the caller, and only then drops the work, and with
    it the last reference to tensors whose Python objects the caller has already released, so it takes the GIL
    to free them. If the main thread has meanwhile started interpreter finalization, CPython (3.11 here) ends
    that thread with ``pthread_exit``; the unwind meets a ``noexcept`` C++ destructor and the process
    aborts: SIGABRT, "terminate called without an active exception" (docs/ci_flake.md has the stacks). A rank
    that exits a few milliseconds after its last collective (rank 1 after ``LoadBalanceMonitor``'s final
    gather) can lose that race when the CPU is busy.

    The fix: an ``atexit`` handler, which runs while the interpreter is still whole, destroys the default
    group; with no other reference left, ``~ProcessGroupGloo`` joins the worker threads with the GIL released,
    so a pending free completes first. It sends nothing to the peers and waits at most
    ``EXIT_JOIN_TIMEOUT_S`` (see :func:`_destroy_gloo_group_at_exit`). The library keeps no reference of its
    own to the default group (the monitor registers no DDP communication hook, whose state held one before).
    Registered once per process; NCCL groups are left alone.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED or not is_gloo():
        return
    atexit.register(_destroy_gloo_group_at_exit)
    _EXIT_HOOK_REGISTERED = True


def is_gloo() -> bool:
    """A gloo default process group is up (CPU DDP)."""
    return is_distributed() and dist.get_backend() == "gloo"


def _destroy_gloo_group_at_exit() -> None:
    """Destroy the gloo default group on a helper thread; wait for it at most ``EXIT_JOIN_TIMEOUT_S``.

    The same on a clean end and on a failure, and never a message to a peer. After a clean end nothing is in
    flight, so the worker threads stop as soon as they have dropped their last work. A failed rank may have
    left a collective in flight that only a peer can finish (or end, by exiting); this rank then waits at most
    the bound and exits without it, instead of waiting for that peer.
    """
    if not is_gloo():
        return  # destroyed already (destroy_gloo_group_now, or the program itself)
    try:
        helper = threading.Thread(target=_destroy_gloo_group, name="gloo-group-teardown", daemon=True)
        helper.start()
    except RuntimeError:  # no new thread at this point of the shutdown: destroying here could block
        return
    helper.join(EXIT_JOIN_TIMEOUT_S)


def _destroy_gloo_group() -> None:
    try:
        if is_gloo():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit, a failed clean-up must not mask the exit status
        pass


def destroy_gloo_group_now() -> None:
    """At the end of a run: wait for every rank, then destroy a gloo default group (no-op otherwise).

    The ranks tear the group down together while the interpreter is whole, instead of one rank exiting
    (and closing its connections) while another still plans or reports; the exit handler of
    :func:`destroy_gloo_group_at_exit` then finds nothing left. The package's CLI calls this after every
    subcommand (a clean end only: a failed subcommand never gets here), whatever the LightningModule.
    """
    if not is_gloo():
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a peer already gone: still destroy ours
        pass
    _destroy_gloo_group()


def rank_and_world(trainer: Any | None = None) -> tuple[int, int]:
    """Global rank and world size: from ``trainer`` if given, else the process group, else (0, 1)."""
    if trainer is not None:
        return int(trainer.global_rank), int(trainer.world_size)
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sequence_degree(trainer: Any | None) -> int | None:
    """The sequence-parallel degree of the trainer's strategy, or None where it says none.

    Read from the strategy's ``sequence_mesh`` or ``device_mesh`` (a dimension named ``"sequence"``), else its
    ``sequence_parallel`` or ``sequence_parallel_size`` attribute (``SequenceParallelStrategy``); by name, so
    that no strategy module is imported.
    """
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if strategy is None:
        return None
    for attr in ("sequence_mesh", "device_mesh"):
        try:
            mesh = getattr(strategy, attr, None)
        except Exception:  # noqa: BLE001 - a strategy whose mesh is not built yet (before setup)
            mesh = None
        if "sequence" in tuple(getattr(mesh, "mesh_dim_names", None) or ()):
            return int(mesh["sequence"].size())
    for name in ("sequence_parallel", "sequence_parallel_size"):
        value = getattr(strategy, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def all_gather_floats_by_group(values: list[float], groups: int) -> list[list[float]]:
    """:func:`all_gather_floats` from every rank, one row per data-parallel group of ``world / groups`` ranks
    (data outer, sequence inner: ranks ``g*G .. g*G + G - 1`` form group g): the first rank's row.

    The ranks of a group read the same stream, so they must hold the same values; a group whose ranks
    disagree would break exactly-once on resume and is refused. ``groups`` equal to the world size (no
    sequence parallelism): :func:`all_gather_floats` itself.

    Raises:
        RuntimeError: the world size is not a multiple of ``groups``, or the ranks of a group disagree.
    """
    rows = all_gather_floats(values)
    if groups == len(rows):
        return rows
    if groups < 1 or len(rows) % groups:
        raise RuntimeError(f"{len(rows)} ranks cannot form {groups} data-parallel groups of equal size")
    size = len(rows) // groups
    out = []
    for g in range(groups):
        mine = rows[g * size : (g + 1) * size]
        if any(row != mine[0] for row in mine):
            raise RuntimeError(
                f"the ranks {g * size}..{(g + 1) * size - 1} of sequence-parallel group {g} hold different data "
                f"positions {mine}: every rank of a group must take the same batches"
            )
        out.append(mine[0])
    return out


def _collective_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo (CPU DDP) only CPU tensors.
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Gather one short list of floats from every rank in a single collective.

    Returns a list indexed by rank. Every rank must pass the same number of values. Identity
    (``[values]``) when not distributed.
    """
    if not is_distributed():
        return [list(values)]
    world = dist.get_world_size()
    local = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    out = torch.empty((world, local.numel()), dtype=torch.float64, device=local.device)
    if local.is_cuda:
        dist.all_gather_into_tensor(out, local)
    else:
        rows = list(out.unbind(0))
        held = [local, *rows]
        # Tensor._use_count is private: where a torch lacks it, nothing is waited for (the exit handler's
        # join still covers a clean end).
        counts = [t._use_count() for t in held] if hasattr(local, "_use_count") else None
        dist.all_gather(rows, local)
        if counts is not None:
            _wait_until_released(held, counts)
    return out.cpu().tolist()


def _wait_until_released(tensors: list[torch.Tensor], counts: list[int]) -> None:
    """Hold ``tensors`` until gloo's worker thread has dropped the finished collective's references to them.

    Each tensor's use count is back to ``counts`` (taken before the collective) once the work is gone. Until
    then the worker holds them, and if Python released them first, the worker would have to take the GIL to
    free their Python objects, possibly as the interpreter finalizes (see
    :func:`destroy_gloo_group_at_exit`). Local only: at most ``RELEASE_TIMEOUT_S``, the GIL released.
    """
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(t._use_count() > c for t, c in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(1e-4)


def all_gather_object(obj: Any) -> list[Any]:
    """Gather a picklable object from every rank (rare, small payloads such as checkpoint state)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank (rare, small payloads)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# -- strategies: which ones synchronise gradients (by class name, so no strategy module is imported) -----


class UnsupportedStrategyError(RuntimeError):
    """A strategy under which training would not synchronise gradients (or that the module cannot use)."""


def _names(strategy: Any) -> set[str]:
    # By class name along the MRO, so that subclasses count and no strategy module needs importing.
    return {cls.__name__ for cls in type(strategy).__mro__}


def check_sharded(strategy: Any, model: torch.nn.Module) -> None:
    """Refuse a ``ModelParallelStrategy`` run whose model was not parallelised in ``configure_model``.

    Lightning's ``ModelParallelStrategy`` leaves all parallelisation to the module: a module that applies
    neither ``fully_shard`` nor tensor parallelism trains a separate model on every rank, silently. Called
    by the monitor at the start of training, for any LightningModule.

    Raises:
        UnsupportedStrategyError: several processes, ``ModelParallelStrategy``, and no parameter is a
            DTensor (nothing is sharded or replicated by FSDP2 / tensor parallelism).
    """
    if "ModelParallelStrategy" not in _names(strategy) or int(getattr(strategy, "world_size", 1)) <= 1:
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return
    raise UnsupportedStrategyError(
        f"{type(model).__name__} runs under {type(strategy).__name__} on {strategy.world_size} processes but its "
        "configure_model() applies no parallelism (no parameter is a DTensor), so no gradient would be "
        "synchronised and every rank would train its own model. Shard it there, e.g. "
        "lightning_adaptiveload.models.sharding.shard_model(self.model, self.device_mesh), or use strategy: ddp"
    )

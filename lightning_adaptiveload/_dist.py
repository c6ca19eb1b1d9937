"""The one place that talks to ``torch.distributed``.

Rank and world size come from the trainer or from an initialised process group, never from
environment variables: Lightning does not set ``RANK`` for the processes it spawns.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_EXIT_HOOK_REGISTERED = False


def destroy_gloo_group_at_exit() -> None:
    """Destroy the default process group when this process exits, if it is a gloo group (CPU DDP).

    A process that exits with a live gloo group can abort (SIGABRT, "terminate called without an active
    exception") during interpreter finalization: gloo's worker threads still hold work objects whose
    tensors need the GIL, which is being torn down (PyTorch's own fix, pytorch/pytorch#179291, was
    abandoned). Lightning's ``ddp_spawn`` workers exit without destroying the group; an ``atexit`` handler
    runs while the interpreter is still whole. Registered once per process; NCCL groups are left alone.
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED or not is_distributed() or dist.get_backend() != "gloo":
        return
    atexit.register(_destroy_gloo_group)
    _EXIT_HOOK_REGISTERED = True


def _destroy_gloo_group() -> None:
    try:
        if is_distributed() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit, a failed clean-up must not mask the exit status
        pass


def destroy_gloo_group_now() -> None:
    """At the end of a run: wait for every rank, then destroy a gloo default group (no-op otherwise).

    The ranks tear the group down together while the interpreter is whole, instead of one rank exiting
    (and closing its connections) while another still plans or reports; the exit handler of
    :func:`destroy_gloo_group_at_exit` then finds nothing left. The package's CLI calls this after every
    subcommand, whatever the LightningModule.
    """
    if not is_distributed() or dist.get_backend() != "gloo":
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
    dist.all_gather_into_tensor(out, local) if local.is_cuda else dist.all_gather(list(out.unbind(0)), local)
    return out.cpu().tolist()


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

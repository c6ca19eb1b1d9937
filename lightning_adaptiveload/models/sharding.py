"""Sharding a model with FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per block, then the root.

Pure PyTorch (no Lightning), so that a plain training loop or a user's own LightningModule can call
:func:`shard_model` too; :class:`~lightning_adaptiveload.models.module.VideoDiTModule` calls it from
``configure_model`` under Lightning's ``ModelParallelStrategy``. Order matters and is the caller's job:
fuse the norm + modulate sites and set activation checkpointing first (both change the modules that FSDP
wraps), shard, then materialise (meta-device init) and load weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "ShardingError",
    "default_mp_policy",
    "is_fsdp2_sharded",
    "load_full_state_dict",
    "shard_model",
]


class ShardingError(RuntimeError):
    """A model or a device mesh that :func:`shard_model` cannot shard; the message says what to change."""


def _fully_shard_api():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def default_mp_policy(device_type: str) -> Any:
    """The mixed-precision policy for ``device_type``: bf16 compute, fp32 master weights and gradient reduction.

    On CUDA the all-gathered parameters are bf16 (half the all-gather traffic and the unsharded memory) while
    the sharded parameters, hence the optimizer's master copy, stay fp32, and gradients are reduce-scattered
    in fp32 (a bf16 sum over many ranks loses the small gradients). On CPU (gloo tests) everything stays
    fp32, so that FSDP2's losses can be compared with DDP's to float tolerance.

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ...

    Returns:
        a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    _, MixedPrecisionPolicy, _ = _fully_shard_api()
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def is_fsdp2_sharded(module: nn.Module) -> bool:
    """True if ``fully_shard`` was applied to ``module`` (FSDP2 swaps the class for an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return False
    return isinstance(module, FSDPModule)


def _check_mesh(mesh: Any) -> None:
    if mesh is None:
        raise ShardingError(
            "shard_model: mesh is None; pass a DeviceMesh (Lightning: self.device_mesh under "
            "ModelParallelStrategy; plain PyTorch: torch.distributed.init_device_mesh('cuda', (world,)))"
        )
    if mesh.ndim not in (1, 2):
        raise ShardingError(
            f"shard_model: a {mesh.ndim}-D device mesh {tuple(mesh.shape)} (dims {mesh.mesh_dim_names}); give a "
            "1-D mesh (FSDP over every rank) or a 2-D (replicate, shard) mesh (HSDP)"
        )


def shard_model(
    model: nn.Module,
    mesh: Any,
    mp_policy: Any | None = None,
    reshard_after_forward: bool = True,
    blocks: Iterable[nn.Module] | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply FSDP2 to ``model``: each block its own unit, then the root (embeddings, head) as the last unit.

    One unit per block keeps one block's full parameters alive at a time (plus the prefetched next one);
    the root unit holds the small rest. Works on a model on the meta device (materialise it afterwards with
    ``to_empty`` + ``reset_parameters``, or load weights with :func:`load_full_state_dict`) and on a real one
    (each rank then keeps only its shard). A 2-D mesh gives HSDP: replicated over dim 0 (e.g. nodes), sharded
    over dim 1 (e.g. the GPUs of a node), so that the all-gathers stay on the node's fast links.

    Args:
        model: the network; in place. Set activation checkpointing and fuse sites before calling this.
        mesh: a ``DeviceMesh`` (1-D or 2-D) over the ranks that train this model.
        mp_policy: a ``MixedPrecisionPolicy``; None: :func:`default_mp_policy` for the mesh's device type.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3: least
            memory, one more all-gather per block in the backward); False keeps them until the backward
            (ZeRO-2-like: faster, more memory). The root unit never reshards after forward: its backward
            comes first.
        blocks: the modules to shard as units; None: ``model.blocks``.
        cpu_offload: keep the sharded parameters, gradients and optimizer states in host memory
            (``CPUOffloadPolicy``; the optimizer step then runs on the CPU).

    Returns:
        ``model`` (now an ``FSDPModule``).

    Raises:
        ShardingError: no mesh or a mesh of more than 2 dimensions, no blocks, or a model already sharded.
    """
    _check_mesh(mesh)
    if is_fsdp2_sharded(model):
        raise ShardingError(
            f"shard_model: {type(model).__name__} is already sharded (fully_shard applied twice?)"
        )
    if blocks is None:
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ShardingError(
                f"shard_model: {type(model).__name__} has no `blocks` attribute; pass blocks=[...] (the repeated "
                "layers, e.g. model.layers)"
            )
    blocks = list(blocks)
    if not blocks:
        raise ShardingError(f"shard_model: {type(model).__name__} has no blocks to shard (blocks is empty)")
    fully_shard, _, CPUOffloadPolicy = _fully_shard_api()
    if mp_policy is None:
        mp_policy = default_mp_policy(mesh.device_type)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def load_full_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Give a sharded model (on the meta device or not) the weights of a full state dict.

    Only rank 0 needs the tensors (``state``; None on the other ranks): they are broadcast and each rank
    keeps its shard, so no rank but 0 ever holds the whole model in host memory.

    Args:
        model: a model sharded by :func:`shard_model`.
        state: the full state dict (rank 0), None elsewhere.
        device: where the shards live (the rank's GPU, or ``cpu``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    has_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if has_meta:
        model.to_empty(device=device)
    set_model_state_dict(
        model,
        dict(state) if state is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )

"""Which Lightning strategies :class:`~lightning_adaptiveload.models.module.VideoDiTModule` trains under, and
its sharding under ``ModelParallelStrategy`` (FSDP2).

The rule: a run of several processes must synchronise gradients. DDP (and its spawn/notebook variants,
DeepSpeed), FSDP (v1, ``FSDPStrategy``) and ``ModelParallelStrategy`` with the model sharded by FSDP2 do;
any other strategy of more than one process is refused before the first step, naming the strategy and
what to use instead. ``ModelParallelStrategy`` itself synchronises nothing: the module must shard itself
in ``configure_model``, which :func:`shard_module_model` does for ours (and :func:`~lightning_adaptiveload._dist.check_sharded`
checks for anyone's, after the strategy's setup).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_adaptiveload import _dist
from lightning_adaptiveload._dist import UnsupportedStrategyError, _names, check_sharded

__all__ = ["UnsupportedStrategyError", "check_sharded", "check_strategy", "shard_module_model"]


def check_strategy(strategy: Any | None, module: Any) -> str | None:
    """Say how ``module`` trains under ``strategy``, or refuse it.

    Args:
        strategy: the trainer's strategy (None outside a Trainer).
        module: the ``VideoDiTModule`` (its ``optimizer_settings`` are checked).

    Returns:
        ``"fsdp2"`` (shard with FSDP2 in ``configure_model``), ``"fsdp"`` (FSDP v1 wraps it), ``"ddp"``
        (replicated, DDP or DeepSpeed), or None (one process, or no trainer).

    Raises:
        UnsupportedStrategyError: a strategy of several processes that synchronises no gradient, or
            ``ModelParallelStrategy`` with an option that FSDP2 sharding does not support.
    """
    if strategy is None:
        return None
    names = _names(strategy)
    name = type(strategy).__name__
    if "ModelParallelStrategy" in names:
        weight_dtype = getattr(getattr(module, "optimizer_settings", None), "weight_dtype", "fp32")
        if weight_dtype != "fp32":
            raise UnsupportedStrategyError(
                f"VideoDiTModule: weight_dtype={weight_dtype!r} under {name}: FSDP2 keeps fp32 master "
                "shards and computes in bf16 by its mixed-precision policy already; set "
                "model.init_args.optimizer.weight_dtype: fp32"
            )
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:  # pragma: no cover - torch < 2.6
            raise UnsupportedStrategyError(
                f"VideoDiTModule: {name} needs torch.distributed.fsdp.fully_shard (torch >= 2.6), got torch "
                f"{torch.__version__}; upgrade torch or use strategy: ddp / fsdp"
            ) from exc
        return "fsdp2"
    if "FSDPStrategy" in names:
        return "fsdp"
    if "DDPStrategy" in names:  # also DeepSpeedStrategy, ddp_spawn, ddp_notebook
        return "ddp"
    if int(getattr(strategy, "world_size", 1)) <= 1:
        return None
    raise UnsupportedStrategyError(
        f"VideoDiTModule: strategy {name} runs {strategy.world_size} processes but does not synchronise the "
        "model's gradients (each rank would train its own model); use strategy: ddp (replicated), "
        "lightning.pytorch.strategies.ModelParallelStrategy (sharded with FSDP2; the module shards itself) or "
        "fsdp"
    )


def shard_module_model(module: Any, strategy: Any) -> None:
    """Shard ``module.model`` (a ``VideoDiT``) with FSDP2 on the strategy's device mesh, in place.

    Steps, in the order that works: fuse the norm + modulate sites (where the module uses
    ``FusedNormModulateMixin``: fusion swaps submodules, which must happen before FSDP groups their
    parameters), shard (each block, then the root), and with ``init_from`` load the checkpoint: rank 0 reads
    and checks it, every rank keeps its shard. Without ``init_from`` the model stays on the meta device
    and the strategy materialises it with each module's ``reset_parameters`` (Wan's init).

    A 2-D mesh (Lightning's ``data_parallel`` x ``tensor_parallel``) gives HSDP: replicated over the first
    dimension (nodes, by default), sharded over the second (the GPUs of a node).
    """
    from lightning_adaptiveload.models.sharding import default_mp_policy, load_full_state_dict, shard_model

    fuse = getattr(module, "_fuse_after_configure_model", None)
    if callable(fuse):
        fuse()
    device = strategy.root_device
    shard_model(module.model, module.device_mesh, default_mp_policy(device.type), reshard_after_forward=True)
    path = module.hparams.get("init_from")
    if path is None:
        return
    from lightning_adaptiveload.models.pretrained import pretrained_state_dict

    rank = _dist.rank_and_world(module.trainer)[0]
    state, problem = None, None
    if rank == 0:
        try:
            state = pretrained_state_dict(module.model, path)
        except Exception as exc:  # every rank must raise, not wait in the broadcast below
            problem = f"{type(exc).__name__}: {exc}"
    problem = _dist.broadcast_object(problem)
    if problem is not None:
        raise UnsupportedStrategyError(
            f"VideoDiTModule: init_from={path!r} could not be loaded on rank 0: {problem}"
        )
    load_full_state_dict(module.model, state, device)

"""lightning-adaptiveload: load-balanced training of video DiTs on mixed-length data."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# name -> module that defines it; imported on first use so that `import lightning_adaptiveload`
# stays cheap and the pure core never pulls in Lightning.
_EXPORTS = {
    # the DataModule and its settings
    "AdaptiveLoadDataModule": "datamodule",
    "Batching": "planning.settings",
    "PlanSettings": "planning.settings",
    "Loader": "loading.settings",
    "Source": "loading.settings",
    # planning, without Lightning
    "CostModel": "planning.cost_model",
    "DualConstraintBatcher": "planning.batching",
    "EpochPlan": "planning.plan",
    "plan_epoch": "planning.planner",
    # shards
    "ShardIndex": "shards.index",
    "ShardWriter": "shards.writer",
    "ShardError": "shards.format",
    "load_mix": "shards.mixes",
    "write_synthetic_shards": "shards.synthetic",
    # callbacks
    "LoadBalanceMonitor": "callbacks.load_balance",
    "ClosedLoop": "callbacks.closed_loop",
    "AlignedGC": "callbacks.aligned_gc",
    "KernelWarmup": "callbacks.kernel_warmup",
    # the fused op and the fusion pass
    "layer_norm_modulate": "ops",
    "fuse_norm_modulate": "fusion.registry",
    "unfuse_norm_modulate": "fusion.registry",
    "register_fusion_adapter": "fusion.registry",
    "FusedNormModulateMixin": "fusion.mixin",
    "FusionError": "fusion.adapter",
    # the reference model
    "VideoDiT": "models",
    "VideoDiTConfig": "models",
    "VideoDiTModule": "models.module",
    "token_weighted_loss": "models.loss",
}
# `simulate()` lives in `lightning_adaptiveload.tools.simulate`; it is not re-exported here because the
# submodule of the same name would shadow it once imported.

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_adaptiveload' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_adaptiveload.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""lightning-adaptiveload: load-balanced training of video DiTs on mixed-length data."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so that `import lightning_adaptiveload`
# stays cheap and the pure core never pulls in Lightning.
_EXPORTS = {
    "CostModel": "planning.cost_model",
    "DualConstraintBatcher": "planning.batching",
    "tokens_per_sample": "planning.batching",
    "collate": "planning.batching",
    "plan_epoch": "planning.planner",
    "EpochPlan": "planning.planner",
    "ShardIndex": "data.shards",
    "ShardWriter": "data.shards",
    "ShardError": "data.shards",
    "iter_shard": "data.shards",
    "write_synthetic_shards": "data.shards",
    "load_mix": "data.mixes",
    "AdaptiveLoadDataModule": "data.datamodule",
    "LoadBalanceMonitor": "monitor.callback",
    "layer_norm_modulate": "ops",
    "fuse_norm_modulate": "fusion.core",
    "unfuse_norm_modulate": "fusion.core",
    "FusedNormModulateMixin": "fusion.core",
    "register_fusion_adapter": "fusion.core",
    "VideoDiT": "models",
    "VideoDiTConfig": "models",
    "VideoDiTModule": "models.module",
    "SimulationResult": "tools.simulate",
    "StepTimeTable": "tools.simulate",
    "ShardInfo": "data.shards",
    "expand_paths": "data.shards",
    "Mix": "data.mixes",
    "available_mixes": "data.mixes",
    "FusionReport": "fusion.core",
    "FusionError": "fusion.core",
    "unregister_fusion_adapter": "fusion.core",
    "fused_op_status": "ops",
    "NormModulate": "models",
    "token_weighted_loss": "models.loss",
    "global_token_count": "models.loss",
    "rank_noise_generator": "models.loss",
    "wan_flops_per_batch": "monitor.flops",
    "apply_sample_transform": "data.datamodule",
    "shard_model": "models.sharding",
    "estimate_memory": "tools.memory",
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

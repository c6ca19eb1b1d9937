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
    "tokens_per_sample": "planning.sizing",
    "collate": "data.collate",
    "plan_epoch": "planning.planner",
    "EpochPlan": "planning.plan",
    "ShardIndex": "data.index",
    "ShardWriter": "data.writer",
    "ShardError": "data.format",
    "iter_shard": "data.reader",
    "write_synthetic_shards": "data.synthetic",
    "SyntheticShards": "data.synthetic",
    "load_mix": "data.mixes",
    "AdaptiveLoadDataModule": "data.datamodule",
    "Batching": "planning.settings",
    "PlanSettings": "planning.settings",
    "Loader": "data.settings",
    "Source": "data.settings",
    "LoadBalanceMonitor": "monitor.callback",
    "AlignedGC": "monitor.aligned_gc",
    "KernelWarmup": "models.warmup_callback",
    "layer_norm_modulate": "ops",
    "fuse_norm_modulate": "fusion.registry",
    "unfuse_norm_modulate": "fusion.registry",
    "FusedNormModulateMixin": "fusion.mixin",
    "register_fusion_adapter": "fusion.registry",
    "VideoDiT": "models",
    "VideoDiTConfig": "models",
    "VideoDiTModule": "models.module",
    "SimulationResult": "tools.simulate",
    "SimulateSettings": "tools.simulate_settings",
    "StepTimeTable": "tools.step_times",
    "ShardInfo": "data.format",
    "expand_paths": "data.paths",
    "Mix": "data.mixes",
    "available_mixes": "data.mixes",
    "FusionReport": "fusion.registry",
    "FusionError": "fusion.adapter",
    "unregister_fusion_adapter": "fusion.registry",
    "fused_op_status": "ops",
    "NormModulate": "models",
    "token_weighted_loss": "models.loss",
    "global_token_count": "models.loss",
    "rank_noise_generator": "models.loss",
    "wan_flops_per_batch": "models.wan_flops",
    "apply_sample_transform": "data.stream",
    "shard_model": "models.sharding",
    "estimate_memory": "models.memory",
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

"""lightning-adaptiveload: load-balanced training of video DiTs on mixed-length data."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so that `import lightning_adaptiveload`
# stays cheap and the pure core never pulls in Lightning.
_EXPORTS = {
    "CostModel": "cost_model",
    "DualConstraintBatcher": "batching",
    "tokens_per_sample": "batching",
    "collate": "batching",
    "plan_epoch": "planning",
    "EpochPlan": "planning",
    "ShardIndex": "shards",
    "ShardWriter": "shards",
    "ShardError": "shards",
    "iter_shard": "shards",
    "write_synthetic_shards": "shards",
    "load_mix": "mixes",
    "AdaptiveLoadDataModule": "datamodule",
    "LoadBalanceMonitor": "monitor",
    "layer_norm_modulate": "ops",
    "fuse_norm_modulate": "fusion",
    "unfuse_norm_modulate": "fusion",
    "FusedNormModulateMixin": "fusion",
    "register_fusion_adapter": "fusion",
    "VideoDiT": "models",
    "VideoDiTConfig": "models",
    "VideoDiTModule": "module",
    "SimulationResult": "simulate",
    "StepTimeTable": "simulate",
    "ShardInfo": "shards",
    "expand_paths": "shards",
    "Mix": "mixes",
    "available_mixes": "mixes",
    "FusionReport": "fusion",
    "FusionError": "fusion",
    "unregister_fusion_adapter": "fusion",
    "fused_op_status": "ops",
    "NormModulate": "models",
    "token_weighted_loss": "loss",
    "global_token_count": "loss",
    "rank_noise_generator": "loss",
    "wan_flops_per_batch": "flops",
    "apply_sample_transform": "datamodule",
}
# `simulate()` lives in `lightning_adaptiveload.simulate`; it is not re-exported here because the
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

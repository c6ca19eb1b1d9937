"""The norm+modulate fusion pass, its adapter registry and the adapters for the model families it knows."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "FusedNormModulateMixin": "core",
        "FusionError": "core",
        "FusionReport": "core",
        "fuse_norm_modulate": "core",
        "register_fusion_adapter": "core",
        "unfuse_norm_modulate": "core",
        "unregister_fusion_adapter": "core",
    },
)

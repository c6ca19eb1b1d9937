"""The norm+modulate fusion pass, its adapter registry and the adapters for the model families it knows.

``registry.py`` holds the pass and the registry, ``adapter.py`` the adapter interface, ``probe.py`` the
numerical check; ``video_dit.py``, ``wan.py`` and ``dit.py`` the built-in adapters of each model family;
``mixin.py`` the LightningModule mixin.
"""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "FusedNormModulateMixin": "mixin",
        "FusionAdapter": "adapter",
        "FusionError": "adapter",
        "FusionReport": "registry",
        "ReplaceForward": "adapter",
        "SkippedModule": "registry",
        "fuse_norm_modulate": "registry",
        "register_fusion_adapter": "registry",
        "unfuse_norm_modulate": "registry",
        "unregister_fusion_adapter": "registry",
    },
)

"""The norm+modulate fusion pass, its adapter registry and the adapters for the model families it knows.

``registry.py`` holds the pass and the registry, ``adapter.py`` the adapter interface, ``probe.py`` the
numerical check (on a perturbed copy), ``sites.py`` one fused site (``norm_modulate``: LayerNorm or RMSNorm);
``video_dit.py``, ``wan.py``, ``dit.py``, ``diffusers_norms.py`` (diffusers' modulated norm classes) and
``diffusers_mmdit.py`` and ``diffusers_blocks.py`` (the diffusers MMDiT and single-stream blocks that
modulate inline) the built-in adapters; ``mixin.py`` the
LightningModule mixin.
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
        "ProbeResult": "probe",
        "ReplaceForward": "adapter",
        "SkippedModule": "registry",
        "fuse_norm_modulate": "registry",
        "norm_modulate": "sites",
        "norm_site_reason": "sites",
        "register_fusion_adapter": "registry",
        "unfuse_norm_modulate": "registry",
        "unregister_fusion_adapter": "registry",
    },
)

"""Ingest: your videos and images to latent shards with Wan's VAE (and umT5 captions).

``job`` runs it as a ``Trainer.predict`` job (the one Lightning module here); ``media`` (inputs, frame
sampling, decoding), ``encode`` (pixels to latents), ``output`` (an output folder read back for a resume),
``settings`` and ``demo`` (random-weight stand-ins for a CPU demo) are pure.
"""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "IngestSettings": "settings",
        "ingest": "job",
    },
)

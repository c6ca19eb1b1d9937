"""Load-balance measurement: statistics (pure), report files, and the LoadBalanceMonitor callback."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "LoadBalanceMonitor": "callback",
        "FsdpStepTimer": "fsdp_timing",
    },
)

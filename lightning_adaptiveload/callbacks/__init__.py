"""Lightning callbacks: the ``LoadBalanceMonitor`` (measures), the ``ClosedLoop`` (refits the cost model from
those measurements and plans the next epoch with it), ``AlignedGC`` and ``KernelWarmup``."""

from __future__ import annotations

from lightning_adaptiveload._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "AlignedGC": "aligned_gc",
        "ClosedLoop": "closed_loop",
        "KernelWarmup": "kernel_warmup",
        "LoadBalanceMonitor": "load_balance",
    },
)

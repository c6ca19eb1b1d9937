"""Builds the benchmark-only variants of the fused LayerNorm-Modulate kernels.

The shipped operator (``csrc/ln_modulate_binding.cpp``) always lets the launchers choose their plan. The
benchmarks also time launch overrides (warps per row, rows per CTA, the forward kernel path, backward
vectors per thread and row slots) and a kernel variant the shipped build leaves out (the persistent forward
under an 80-register cap). This module compiles the kernel sources of ``csrc/`` with
``ADAPTIVELOAD_BENCH_VARIANTS`` defined, together with ``modulate_variants.cpp`` (a pybind module with
``forward``, ``backward`` and ``backward_plan`` taking the overrides), into its own cache directory. It
registers no operator, so it loads beside the shipped library.

    from modulate_variants import load_variants
    ext = load_variants()
    y, mean, rstd = ext.forward(x, shift, scale, None, None, group_size, 1e-6, warps_per_row, rows_per_cta, path)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

from lightning_adaptiveload.ops import _build

_HERE = Path(__file__).resolve().parent
_BINDING = _HERE / "modulate_variants.cpp"
_DEFINE = "-DADAPTIVELOAD_BENCH_VARIANTS"
_module: ModuleType | None = None


def load_variants(verbose: bool = False) -> ModuleType:
    """Builds (when not cached) and imports the benchmark build; same toolchain needs as the shipped one."""
    global _module
    if _module is not None:
        return _module
    from torch.utils import cpp_extension

    _build._check_toolchain()
    csrc = _build.find_csrc()
    archs = _build._arch_list(None)
    binding_hash = hashlib.sha256(_BINDING.read_bytes()).hexdigest()[:8]
    key = f"variants-{binding_hash}-{_build.build_key(csrc, archs)}"
    build_dir = _build._cache_root() / "torch_extensions" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    try:
        _module = cpp_extension.load(
            name="adaptiveload_ln_modulate_variants_" + hashlib.sha256(key.encode()).hexdigest()[:12],
            sources=[str(csrc / s) for s in _build.KERNEL_SOURCES] + [str(_BINDING)],
            extra_include_paths=[str(csrc)],
            extra_cflags=_build._CXX_FLAGS + [_DEFINE],
            extra_cuda_cflags=_build._NVCC_FLAGS + [_DEFINE],
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=True,
        )
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    return _module

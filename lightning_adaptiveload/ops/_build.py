"""Build and load the CUDA extension of the fused LayerNorm-Modulate op.

The kernels (``csrc/`` at the repository root) are compiled on first use with ninja through
``torch.utils.cpp_extension.load`` and cached under ``~/.cache/lightning_adaptiveload/torch_extensions``
in a directory named by the hash of the sources, the torch and CUDA versions and the GPU architectures,
so that a changed source, a new torch or another GPU gets its own build and an unchanged one loads in
well under a second. ``python -m lightning_adaptiveload build-ops`` (``main`` below) builds ahead of time,
for example once per node before a multi-GPU job.

Environment:
    LIGHTNING_ADAPTIVELOAD_CSRC: directory holding the CUDA sources (default: ``csrc/`` of the checkout).
    LIGHTNING_ADAPTIVELOAD_CACHE: cache root (default: ``$XDG_CACHE_HOME/lightning_adaptiveload`` or
        ``~/.cache/lightning_adaptiveload``).
    TORCH_CUDA_ARCH_LIST: architectures to build for, e.g. ``"9.0"`` (default: those of the visible GPUs).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["FusedOpUnavailable", "find_csrc", "build_key", "load_extension", "get_extension", "main"]

_log = logging.getLogger("lightning_adaptiveload.ops")

#: Files of the extension, relative to the csrc directory. Sources are compiled; headers only hashed.
SOURCES = (
    "ln_modulate.cu",
    "ln_modulate_bf16.cu",
    "ln_modulate_fp16.cu",
    "ln_modulate_fp32.cu",
    "ln_modulate_binding.cpp",
)
HEADERS = ("ln_modulate.h", "ln_modulate_kernels.cuh")

_NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
_CXX_FLAGS = ["-O3", "-std=c++17"]

_lock = threading.Lock()
_extension: ModuleType | None = None
_failure: str | None = None


class FusedOpUnavailable(RuntimeError):
    """The CUDA extension cannot be built or loaded here; the message says why and what to do."""


def find_csrc() -> Path:
    """Locates the directory with the CUDA sources.

    Looks at ``$LIGHTNING_ADAPTIVELOAD_CSRC``, then ``csrc/`` of the repository checkout this package was
    imported from (the editable install), then ``_csrc/`` inside the installed package.

    Raises:
        FusedOpUnavailable: when none holds all the sources; the message lists where it looked.
    """
    here = Path(__file__).resolve()
    candidates = []
    env = os.environ.get("LIGHTNING_ADAPTIVELOAD_CSRC")
    if env:
        candidates.append(Path(env).expanduser())
    candidates += [here.parents[2] / "csrc", here.parents[1] / "_csrc"]
    for c in candidates:
        if all((c / f).is_file() for f in SOURCES + HEADERS):
            return c
    looked = ", ".join(str(c) for c in candidates)
    raise FusedOpUnavailable(
        f"the CUDA sources of the fused op ({', '.join(SOURCES)}) were not found; looked in: {looked}. "
        "Install lightning-adaptiveload from a source checkout (pip install -e .) or point "
        "LIGHTNING_ADAPTIVELOAD_CSRC at its csrc/ directory."
    )


def _source_hash(csrc: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        h.update(name.encode())
        h.update(b"\0")
        h.update((csrc / name).read_bytes())
    return h.hexdigest()[:16]


def _arch_list(archs: list[str] | None = None) -> list[str]:
    if archs:
        return sorted(set(archs))
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return sorted({a for a in re.split(r"[;\s,]+", env.strip()) if a})
    if not torch.cuda.is_available():
        raise FusedOpUnavailable(
            "no CUDA GPU is visible to pick the architecture to build for; pass --arch (e.g. --arch 9.0) "
            "or set TORCH_CUDA_ARCH_LIST"
        )
    return sorted(
        {"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())}
    )


def build_key(csrc: Path, archs: list[str]) -> str:
    """Cache key: source hash, torch version, CUDA version and GPU architectures."""
    raw = f"{_source_hash(csrc)}-torch{torch.__version__}-cuda{torch.version.cuda}-sm{'_'.join(archs)}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


def _cache_root() -> Path:
    env = os.environ.get("LIGHTNING_ADAPTIVELOAD_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lightning_adaptiveload"


def _check_toolchain() -> None:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise FusedOpUnavailable(
            f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch to use the "
            "fused kernels"
        )
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = Path(cuda_home) / "bin" / "nvcc" if cuda_home else None
    if nvcc is None or not nvcc.exists():
        raise FusedOpUnavailable(
            f"nvcc was not found (CUDA_HOME={cuda_home!r}, nvcc on PATH: {shutil.which('nvcc')!r}); install the "
            f"CUDA toolkit {torch.version.cuda} (the version torch was built with) and set CUDA_HOME to it, or "
            "prebuild on a machine that has it with `python -m lightning_adaptiveload build-ops` and share "
            "LIGHTNING_ADAPTIVELOAD_CACHE"
        )
    if not cpp_extension.is_ninja_available():
        raise FusedOpUnavailable(
            "ninja is not installed; `pip install ninja` (torch builds extensions with it)"
        )


def load_extension(
    archs: list[str] | None = None, verbose: bool = False, force: bool = False
) -> tuple[ModuleType, Path]:
    """Builds (when not cached) and imports the extension.

    Args:
        archs: GPU architectures such as ``["9.0"]``; default: ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs.
        verbose: show the compiler's output.
        force: delete the cached build first.

    Returns:
        The extension module (functions ``forward``, ``backward``, ``backward_plan``) and its build directory.

    Raises:
        FusedOpUnavailable: no CUDA torch, no nvcc or ninja, no sources, or the build failed (the message
            holds the compiler's error).
    """
    from torch.utils import cpp_extension

    _check_toolchain()
    csrc = find_csrc()
    archs = _arch_list(archs)
    key = build_key(csrc, archs)
    build_dir = _cache_root() / "torch_extensions" / key
    if force and build_dir.exists():
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    name = "adaptiveload_ln_modulate_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    fresh = not any(build_dir.glob(f"{name}*.so"))
    if fresh:
        _log.warning(
            "lightning_adaptiveload: compiling the fused layer_norm_modulate CUDA kernels for sm %s "
            "(first use, about a minute); cached in %s",
            ",".join(archs),
            build_dir,
        )
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(csrc / s) for s in SOURCES],
            extra_include_paths=[str(csrc)],
            extra_cflags=_CXX_FLAGS,
            extra_cuda_cflags=_NVCC_FLAGS,
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=True,
        )
    except Exception as exc:  # the compiler's message is in exc; keep it
        raise FusedOpUnavailable(
            f"building the CUDA extension in {build_dir} failed: {exc}. Rerun "
            "`python -m lightning_adaptiveload build-ops --verbose --force` to see the full compiler output."
        ) from exc
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    if fresh:
        _log.warning("lightning_adaptiveload: fused kernels built in %.0f s", time.perf_counter() - start)
    return module, build_dir


def get_extension() -> tuple[ModuleType | None, str | None]:
    """The loaded extension, building it on first call; ``(None, reason)`` when it is unavailable.

    The outcome is remembered for the process: a failed build is not retried on every call.
    """
    global _extension, _failure
    if _extension is not None or _failure is not None:
        return _extension, _failure
    with _lock:
        if _extension is None and _failure is None:
            try:
                _extension, _ = load_extension()
            except FusedOpUnavailable as exc:
                _failure = str(exc)
    return _extension, _failure


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_adaptiveload build-ops``: compile the fused op's CUDA kernels ahead of use.

    Returns:
        0 when the extension is built (or already cached) and loads, 1 otherwise (the reason on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="lightning_adaptiveload build-ops",
        description="Compile the fused layer_norm_modulate CUDA kernels into the cache.",
    )
    parser.add_argument(
        "--arch",
        action="append",
        default=None,
        help="GPU architecture to build for, e.g. 9.0 (repeatable; default: the visible GPUs)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    archs = [a for spec in args.arch for a in re.split(r"[;,\s]+", spec) if a] if args.arch else None
    start = time.perf_counter()
    try:
        module, build_dir = load_extension(archs=archs, verbose=args.verbose, force=args.force)
    except FusedOpUnavailable as exc:
        print(f"build-ops: {exc}", file=sys.stderr)
        return 1
    print(f"build-ops: {module.__name__} ready in {build_dir} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

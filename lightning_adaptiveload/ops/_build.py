"""Build and load the CUDA extension of the fused norm-modulate ops (LayerNorm and RMSNorm).

The kernels (``csrc/`` at the repository root) are compiled on first use with ninja through
``torch.utils.cpp_extension.load`` and cached under ``~/.cache/lightning_adaptiveload/torch_extensions``
in a directory named by the hash of the sources, the torch and CUDA versions and the GPU architectures,
so that a changed source, a new torch or another GPU gets its own build and an unchanged one loads in
well under a second. The extension is a plain shared library that registers the operator with the
dispatcher (``TORCH_LIBRARY``); loading it is ``torch.ops.load_library``. The cache is consulted first, so
a node without nvcc loads a build made elsewhere (shared ``LIGHTNING_ADAPTIVELOAD_CACHE``); only a missing
build needs the toolchain, and it is compiled in a child process so that this one loads the library only
once. ``python -m lightning_adaptiveload build-ops`` (:func:`build_ahead_of_time`) builds ahead of time, for example once
per node before a multi-GPU job.

Environment:
    LIGHTNING_ADAPTIVELOAD_CSRC: directory holding the CUDA sources (default: ``csrc/`` of the checkout).
    LIGHTNING_ADAPTIVELOAD_CACHE: cache root (default: ``$XDG_CACHE_HOME/lightning_adaptiveload`` or
        ``~/.cache/lightning_adaptiveload``).
    TORCH_CUDA_ARCH_LIST: architectures to build for, e.g. ``"9.0"`` (default: those of the visible GPUs).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

__all__ = [
    "FusedOpUnavailable",
    "find_csrc",
    "build_key",
    "load_extension",
    "get_extension",
    "build_ahead_of_time",
]

_log = logging.getLogger("lightning_adaptiveload.ops")

#: Files of the extension, relative to the csrc directory. Sources are compiled; headers only hashed. The
#: kernel sources are shared with the benchmarks' build of tuning variants (benchmarks/kernels/modulate_variants.py).
KERNEL_SOURCES = (
    "ln_modulate.cu",
    "ln_modulate_bf16.cu",
    "ln_modulate_fp16.cu",
    "ln_modulate_fp32.cu",
    # The bulk-copy kernels of both norms (norm_mod_tma.cuh), one file per x dtype and norm.
    "norm_mod_tma_bf16_ln.cu",
    "norm_mod_tma_bf16_rms.cu",
    "norm_mod_tma_fp16_ln.cu",
    "norm_mod_tma_fp16_rms.cu",
    "norm_mod_tma_fp32_ln.cu",
    "norm_mod_tma_fp32_rms.cu",
)
# ln_modulate_binding.cpp: the operators' registration; norm_mod_python.cpp: the eager fast path, a Python
# module in the same library (python_entry).
SOURCES = KERNEL_SOURCES + ("ln_modulate_binding.cpp", "norm_mod_python.cpp")
HEADERS = (
    "ln_modulate.h",
    "ln_modulate_kernels.cuh",
    "norm_mod_tma.cuh",
    "norm_mod_eager.h",
    "norm_mod_direct.h",
)

_NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
_CXX_FLAGS = ["-O3", "-std=c++17"]

_lock = threading.Lock()
_extension: str | None = None
_failure: str | None = None
_built_seconds: float | None = None  # how long a build in this process took (None: none ran)


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


def _library_name(key: str) -> str:
    return "adaptiveload_ln_modulate_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _build_in_child(name: str, csrc: Path, build_dir: Path, archs: list[str], verbose: bool) -> None:
    """Compiles the library with ``cpp_extension.load`` in a child Python process.

    The child loads what it built (a check that it loads) and exits; this process then loads the cached
    file once. Building here instead would load the library into this process as a side effect, and a
    second registration of the operator (say after ``--force``) aborts the process.
    """
    spec = {
        "name": name,
        "sources": [str(csrc / s) for s in SOURCES],
        "extra_include_paths": [str(csrc)],
        "extra_cflags": _CXX_FLAGS,
        "extra_cuda_cflags": _NVCC_FLAGS,
        "build_directory": str(build_dir),
        "verbose": verbose,
        "with_cuda": True,
        "is_python_module": False,
    }
    code = "import json, sys; from torch.utils import cpp_extension; cpp_extension.load(**json.loads(sys.argv[1]))"
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=";".join(archs))
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)],
        env=env,
        stdout=None if verbose else subprocess.PIPE,
        stderr=None if verbose else subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        output = ((proc.stdout or "") + (proc.stderr or "")).strip()
        tail = output[-4000:] if output else "(output shown above)"
        raise FusedOpUnavailable(
            f"building the CUDA extension in {build_dir} failed (exit status {proc.returncode}): {tail}. Rerun "
            "`python -m lightning_adaptiveload build-ops --verbose --force` to see the full compiler output."
        )


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def python_entry(path: str | Path):
    """The Python module of a loaded library (``csrc/norm_mod_python.cpp``: the ops' eager fast path).

    The library is one file: ``torch.ops.load_library`` registered its operators, and importing the same
    file as an extension module runs only its module init (the loader finds the file already loaded).

    Returns:
        The module, or None when the file has none (the ops then take their checked Python path).
    """
    path = Path(path)
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        _log.warning(
            "lightning_adaptiveload: the fast path of %s did not import (%s); using the Python path",
            path,
            exc,
        )
        return None
    return module


def load_extension(
    archs: list[str] | None = None, verbose: bool = False, force: bool = False, load: bool = True
) -> tuple[Path, Path]:
    """Loads the cached extension, building it first when the cache has none.

    Args:
        archs: GPU architectures such as ``["9.0"]``; default: ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs.
        verbose: show the compiler's output.
        force: delete the cached build first.
        load: load the library into this process (registering the operator's CUDA kernels); False only
            builds it (``build-ops``).

    Returns:
        The shared library's path and its build directory.

    Raises:
        FusedOpUnavailable: no sources; or no cached build and no CUDA torch, nvcc or ninja; or the build
            failed (the message holds the compiler's error).
    """
    global _built_seconds
    csrc = find_csrc()
    archs = _arch_list(archs)
    key = build_key(csrc, archs)
    build_dir = _cache_root() / "torch_extensions" / key
    name = _library_name(key)
    library = build_dir / f"{name}.so"
    if force and build_dir.exists():
        shutil.rmtree(build_dir)
    # A lock file means another process is building into this directory: build (wait) through torch's lock.
    cached = library.is_file() and not (build_dir / "lock").exists()
    if not cached:
        # Only a build needs the toolchain: a node without nvcc loads a build shared through the cache.
        _check_toolchain()
        build_dir.mkdir(parents=True, exist_ok=True)
        _log.warning(
            "lightning_adaptiveload: compiling the fused norm-modulate CUDA kernels for sm %s "
            "(first use, about a minute); cached in %s",
            ",".join(archs),
            build_dir,
        )
        start = time.perf_counter()
        _build_in_child(name, csrc, build_dir, archs, verbose)
        if not library.is_file():
            raise FusedOpUnavailable(
                f"the build in {build_dir} reported success but {library.name} is not there; rerun "
                "`python -m lightning_adaptiveload build-ops --verbose --force`"
            )
        _built_seconds = time.perf_counter() - start
        _log.warning("lightning_adaptiveload: fused kernels built in %.0f s", _built_seconds)
    if load:
        try:
            _load_library(library)
        except OSError as exc:  # a truncated or foreign file in the cache
            raise FusedOpUnavailable(
                f"loading the cached CUDA extension {library} failed: {exc}. Delete {build_dir} or rerun "
                "`python -m lightning_adaptiveload build-ops --force`"
            ) from exc
    return library, build_dir


def get_extension() -> tuple[str | None, str | None]:
    """Loads the extension once per process, building it on first call.

    Returns:
        ``(path of the loaded library, None)`` or ``(None, reason)`` when it is unavailable. The outcome is
        remembered for the process: a failed build is not retried on every call.
    """
    global _extension, _failure
    if _extension is not None or _failure is not None:
        return _extension, _failure
    with _lock:
        if _extension is None and _failure is None:
            try:
                _extension = str(load_extension()[0])
            except FusedOpUnavailable as exc:
                _failure = str(exc)
    return _extension, _failure


def build_ahead_of_time(archs: list[str] | None = None, *, force: bool = False, verbose: bool = False) -> str:
    """Compile the fused op's CUDA kernels into the cache (``lightning-adaptiveload build-ops``).

    Built, and checked to load, in a child process; this one need not load the library. On a GPU node the
    import of the op may have built it already (then this finds it cached).

    Args:
        archs: GPU architectures, e.g. ``["9.0"]`` (default: ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs).
        force: rebuild even when a cached build exists.
        verbose: show the compiler's output.

    Returns:
        One line saying where the library is and whether it was built or found in the cache.

    Raises:
        FusedOpUnavailable: it cannot be built (the message says why).
    """
    library, build_dir = load_extension(archs=archs, verbose=verbose, force=force, load=False)
    how = f"built in {_built_seconds:.0f} s" if _built_seconds is not None else "found in the cache"
    return f"{library.name} ready in {build_dir} ({how})"

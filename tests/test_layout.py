"""The layout's promises: the pure core imports without Lightning, and the public API did not move."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import lightning_adaptiveload

# The Lightning adapters: the only modules allowed to import Lightning (docs/architecture.md).
ADAPTERS = (
    "lightning_adaptiveload.cli",
    "lightning_adaptiveload.data.datamodule",
    "lightning_adaptiveload.data.ingest",
    "lightning_adaptiveload.models.module",
    "lightning_adaptiveload.monitor.callback",
    "lightning_adaptiveload.fusion.mixin",
    "lightning_adaptiveload.__main__",
)


def _all_modules() -> list[str]:
    names = ["lightning_adaptiveload"]
    for info in pkgutil.walk_packages(lightning_adaptiveload.__path__, "lightning_adaptiveload."):
        names.append(info.name)
    return sorted(names)


def _is_adapter(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ADAPTERS)


_BLOCKED_IMPORT = """
import importlib, json, sys
for blocked in ("lightning", "pytorch_lightning", "lightning_fabric"):
    sys.modules[blocked] = None  # any import of it raises ImportError
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - report every failure by module
        failed[name] = f"{type(err).__name__}: {err}"
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning") and sys.modules[m])
print(json.dumps({"failed": failed, "leaked": leaked}))
"""


def test_pure_modules_import_without_lightning():
    pure = [m for m in _all_modules() if not _is_adapter(m)]
    assert len(pure) > 20, pure  # the walk found the package
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, json.dumps(pure)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, "these modules must not import Lightning:\n" + "\n".join(
        f"  {k}: {v}" for k, v in result["failed"].items()
    )
    assert result["leaked"] == []


def test_the_blocker_catches_a_lightning_import():
    # The check above would pass vacuously if blocking did nothing: an adapter must fail under it.
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, json.dumps(["lightning_adaptiveload.models.module"])],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "lightning_adaptiveload.models.module" in json.loads(out.stdout.strip().splitlines()[-1])["failed"]


def test_public_api_resolves():
    for name in lightning_adaptiveload.__all__:
        if name != "__version__":
            assert getattr(lightning_adaptiveload, name) is not None, name


def test_folder_exports_resolve():
    import importlib

    for folder in ("data", "planning", "monitor", "fusion", "models", "tools", "ops"):
        package = importlib.import_module(f"lightning_adaptiveload.{folder}")
        for name in getattr(package, "__all__", []):
            assert getattr(package, name) is not None, f"{folder}.{name}"

"""No public function or constructor takes more than 12 parameters (issue 39, item 1): knobs travel in small
frozen, keyword-only settings objects, and the callables that take them have no ``**`` catch-all for flat
keywords (0.2.0 removed those of 0.1.0). ``self`` and ``cls`` do not count."""

from __future__ import annotations

import ast
import pathlib

import pytest

import lightning_adaptiveload

PACKAGE = pathlib.Path(lightning_adaptiveload.__file__).parent
MAX_PARAMETERS = 12

# Every public callable is split now (issue 39); a new long signature fails this test (add it here only with
# a reason, and a stale entry fails too).
KNOWN_EXCEPTIONS: set[str] = set()

SPLIT = {
    "datamodule.py::__init__",  # AdaptiveLoadDataModule: Batching, PlanSettings, Loader, Source
    "planning/batching.py::__init__",  # DualConstraintBatcher: Batching
    "loading/loader.py::__init__",  # PlannedShardDataset: PlanSettings
    "planning/planner.py::plan_epoch",
    "planning/chunked.py::plan_segments",
    "tools/calibrate.py::calibrate",
    "tools/simulate.py::simulate",
    "ingest/job.py::ingest",
    "shards/synthetic.py::write_synthetic_shards",
    "models/compile_check.py::compare_compiled",
    "models/module.py::__init__",  # VideoDiTModule: OptimizerSettings, SamplingSettings, MemorySettings
}


def _count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional and keyword parameters, ``self``/``cls`` left out (``*args`` and ``**kwargs`` do not count)."""
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return n - 1 if a.args and a.args[0].arg in ("self", "cls") else n


def _parameter_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            name = f"{path.relative_to(PACKAGE).as_posix()}::{node.name}"
            counts[name] = max(_count(node), counts.get(name, 0))
    return counts


def test_no_new_public_signature_has_more_than_12_parameters():
    counts = _parameter_counts()
    offenders = {name for name, n in counts.items() if n > MAX_PARAMETERS}
    new = offenders - KNOWN_EXCEPTIONS
    assert not KNOWN_EXCEPTIONS - offenders, (
        f"split now, remove from KNOWN_EXCEPTIONS: {KNOWN_EXCEPTIONS - offenders}"
    )
    assert not new, (
        f"more than {MAX_PARAMETERS} parameters: {sorted((k, counts[k]) for k in new)}; "
        "group them in a frozen settings dataclass"
    )


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_the_split_tool_functions_take_at_most_12_parameters(name):
    counts = _parameter_counts()
    assert name in counts, f"{name} moved: update this test"
    assert counts[name] <= MAX_PARAMETERS, (name, counts[name])


def _catch_alls() -> dict[str, str]:
    """Every function of the package that takes ``**kwargs``: its name -> the catch-all's name."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.args.kwarg is not None:
                found[f"{path.relative_to(PACKAGE).as_posix()}::{node.name}"] = node.args.kwarg.arg
    return found


def test_no_callable_takes_flat_keywords_beside_its_settings():
    found = _catch_alls()
    assert not {name for name, arg in found.items() if arg == "legacy"}, "a **legacy catch-all is back"
    # The callables whose settings were split into settings objects take those objects only.
    assert not SPLIT & set(found), sorted(SPLIT & set(found))


def test_the_checker_counts_what_it_should():
    # self and **kwargs do not count; a 13-parameter function is seen (the proof that the tests above can fail).
    f, g = ast.parse(
        "def f(self, a, b, *args, c, **kwargs): pass\ndef g("
        + ", ".join(f"p{i}" for i in range(13))
        + "): pass"
    ).body
    assert _count(f) == 3 and _count(g) == 13 > MAX_PARAMETERS

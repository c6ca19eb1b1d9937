"""The layout's promises: the pure core imports without Lightning, and the public API did not move."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import lightning_adaptiveload

# The Lightning adapters: the only modules allowed to import Lightning (docs/architecture.md).
ADAPTERS = (
    "lightning_adaptiveload.callbacks",
    "lightning_adaptiveload.cli",
    "lightning_adaptiveload.datamodule",
    "lightning_adaptiveload.ingest.job",
    "lightning_adaptiveload.models.module",
    # the LightningModule mixin (``FusedNormModulateMixin``): a piece of a LightningModule
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

    for folder in ("shards", "loading", "ingest", "callbacks", "planning", "monitor", "fusion", "models", "tools", "ops"):
        package = importlib.import_module(f"lightning_adaptiveload.{folder}")
        for name in getattr(package, "__all__", []):
            assert getattr(package, name) is not None, f"{folder}.{name}"


# ---------------------------------------------------------------------------------------------------------
# Imports point one way (docs/architecture.md, "Layers"). Read from the source with `ast`, so a wrong-way
# import inside a function counts as much as one at the top of a module.

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PACKAGE = "lightning_adaptiveload"

# Lower layers first. A module may import its own folder and any lower layer, not a folder of its own
# layer: the monitor knows no model (it gets FLOPs from the module or a callable). `tools` may import any
# folder but `cli`; `cli` is imported by nothing but `__main__`. The top-level leaves: `stats` (the balance
# statistics), `_dist`, `_lazy`.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "_lazy", "_dist", "_lightning_compat", "stats"),
    ("planning",),
    ("shards",),
    ("loading",),
    ("ops",),
    ("models", "fusion", "monitor"),
    ("callbacks", "datamodule", "ingest"),
    ("tools",),
    ("cli",),
    ("__main__",),
)

# (importer, imported) -> why. Each must still exist (test_allowed_back_edges_are_used).
ALLOWED_BACK_EDGES = {
    (
        "lightning_adaptiveload.planning.batching",
        "lightning_adaptiveload.loading.collate",
    ): "DualConstraintBatcher.__call__, the WebDataset stage, emits collated torch batches (imported when called)",
}


# Import circles left, each with the reason; test_no_import_cycles wants exactly these (none now).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: ``a.planning.x`` -> ``planning``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    unit = _unit(module)
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{module}: its folder {unit!r} has no layer in tests/package/test_layout.py LAYERS; add it")


def _module_names(root: Path, package: str) -> dict[str, Path]:
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, dict[str, set[str]]]:
    """Per module of ``package`` under ``root``: the package's modules it imports, by kind.

    Kinds: ``"top"`` (run when the module is imported), ``"lazy"`` (inside a function), ``"typing"``
    (under ``if TYPE_CHECKING:``, never run). ``from pkg.a import b`` names the submodule ``pkg.a.b`` when
    there is one, else ``pkg.a``.
    """
    modules = _module_names(root, package)

    def targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]

    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        kinds: dict[str, set[str]] = {"top": set(), "lazy": set(), "typing": set()}

        def visit(node: ast.AST, kind: str, name: str = name, path: Path = path, kinds=kinds) -> None:
            for child in ast.iter_child_nodes(node):
                sub = kind
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "top":
                    sub = "lazy"
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    sub = "typing"
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in targets(name, path.name == "__init__.py", child):
                        if target == package or target.startswith(package + "."):
                            kinds[sub].add(target)
                        else:
                            kinds[sub].add("<external>:" + target)
                visit(child, sub)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "top")
        graph[name] = kinds
    return graph


def import_cycles(graph: dict[str, dict[str, set[str]]], kinds=("top", "lazy")) -> list[list[str]]:
    """Strongly connected groups of more than one module over the imports of ``kinds`` (Tarjan)."""
    edges = {m: sorted(t for k in kinds for t in g[k] if t in graph and t != m) for m, g in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(cycles)


def wrong_way_imports(graph: dict[str, dict[str, set[str]]], allowed=()) -> list[str]:
    """``importer -> imported (layers i < j)`` for every import, of any kind, of a higher layer's module."""
    bad = []
    for module, kinds in sorted(graph.items()):
        for kind, found in kinds.items():
            for target in sorted(found):
                if target.startswith("<external>") or target not in graph:
                    continue
                if _unit(target) == _unit(module) or (module, target) in allowed:
                    continue
                if _layer(target) >= _layer(module):
                    bad.append(f"{module} -> {target} ({kind}; layers {_layer(module)} -> {_layer(target)})")
    return bad


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, set[str]]]:
    return import_graph(Path(lightning_adaptiveload.__file__).parent.parent)


def test_no_import_cycles(graph):
    # Type-only imports count too: a circle of names is a circle of files, whatever runs first.
    assert len(graph) > 100  # the walk found the package
    assert {tuple(c) for c in import_cycles(graph, kinds=("top", "lazy", "typing"))} == set(KNOWN_CYCLES)


def test_imports_point_one_way(graph):
    assert wrong_way_imports(graph, ALLOWED_BACK_EDGES) == []


def test_the_monitor_knows_no_model(graph):
    # Issue 39: the monitor takes FLOPs from the module's flops_per_batch or a user's flops_fn (as Lightning's
    # ThroughputMonitor does), never from the models folder; the layer rule above also forbids it, this names it.
    monitor = [m for m in graph if _unit(m) == "monitor"]
    assert len(monitor) > 3
    for module in monitor:
        found = {t for kind in graph[module].values() for t in kind}
        assert not {t for t in found if _unit(t) in ("models", "fusion")}, module


def test_allowed_back_edges_are_used(graph):
    for importer, imported in ALLOWED_BACK_EDGES:
        assert any(imported in found for found in graph[importer].values()), (importer, imported)


def test_planning_and_stats_import_neither_torch_nor_lightning(graph):
    forbidden = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
    for module, kinds in graph.items():
        if _unit(module) not in ("planning", "stats"):
            continue
        externals = {t.split(":", 1)[1].split(".")[0] for k in ("top", "lazy") for t in kinds[k] if ":" in t}
        assert not externals & set(forbidden), (module, sorted(externals & set(forbidden)))
    # stats is a leaf: it imports nothing of the package
    assert not any(t.startswith(PACKAGE) for k in graph["lightning_adaptiveload.stats"].values() for t in k)


def test_planning_imports_without_torch():
    # At run time too: with torch blocked, every planning module (and stats) imports.
    names = [m for m in _all_modules() if _unit(m) in ("planning", "stats")]
    code = _BLOCKED_IMPORT.replace('("lightning", "pytorch_lightning", "lightning_fabric")', '("torch",)')
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["failed"] == {}
    assert len(names) > 15, names


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checks_catch_a_cycle_and_a_wrong_way_import(tmp_path):
    # The checks above would pass vacuously if the graph missed imports: they must see these.
    root = _fake_package(
        tmp_path,
        {
            "__init__.py": "",
            "planning/__init__.py": "",
            "planning/a.py": "def f():\n    from lightning_adaptiveload.monitor import b\n",
            "planning/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
            "monitor/__init__.py": "",
            "monitor/b.py": "from lightning_adaptiveload.planning.a import f\nimport torch\n",
        },
    )
    g = import_graph(root)
    assert g["lightning_adaptiveload.planning.a"]["lazy"] == {"lightning_adaptiveload.monitor.b"}
    assert g["lightning_adaptiveload.planning.c"]["typing"] == {"lightning_adaptiveload.planning.a"}
    assert import_cycles(g) == [["lightning_adaptiveload.monitor.b", "lightning_adaptiveload.planning.a"]]
    assert wrong_way_imports(g) == [
        "lightning_adaptiveload.planning.a -> lightning_adaptiveload.monitor.b (lazy; layers 1 -> 5)"
    ]
    allowed = {("lightning_adaptiveload.planning.a", "lightning_adaptiveload.monitor.b"): "test"}
    assert wrong_way_imports(g, allowed) == []


# ---------------------------------------------------------------------------------------------------------
# Schedules are objects looked up once by name (planning/schedules.py), and the data folder never edits the
# Trainer (issue 39, items 2 and 3). Both read the source, so a new offence anywhere fails here.

import re  # noqa: E402

PACKAGE_DIR = Path(lightning_adaptiveload.__file__).parent

# The schedule names a setting may give: only the registry (schedules.py) and the settings that validate
# them (settings.py, plan.py) may compare against them in planning/.
SCHEDULE_NAMES = ("independent", "lockstep", "packed", "auto")
# Modules that turn a schedule name into behaviour must not: the planner looks the schedule up once, the
# bucketed plan and the segments get the schedule object.
NO_SCHEDULE_STRINGS = (
    "planning/planner.py",
    "planning/bucketed.py",
    "planning/chunked.py",
    # the DataModule asks the schedule object (``always_packs``, ``has_lockstep_tail``)
    "datamodule.py",
)


def schedule_name_tests(source: str) -> list[str]:
    """Every comparison (``==``, ``!=``, ``in``, ``not in``) of something with a schedule name, as code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set()
        for op in operands:
            for sub in ast.walk(op):
                if isinstance(sub, ast.Constant) and sub.value in SCHEDULE_NAMES:
                    names.add(sub.value)
        if names:
            found.append(ast.unparse(node))
    return found


def test_the_planner_looks_schedules_up_instead_of_testing_their_names():
    for rel in NO_SCHEDULE_STRINGS:
        found = schedule_name_tests((PACKAGE_DIR / rel).read_text(encoding="utf-8"))
        assert found == [], (
            f"{rel} tests schedule names {found}: add a schedule object (planning/schedules.py)"
        )
    from typing import get_args

    from lightning_adaptiveload.planning.schedules import SCHEDULE_TYPES
    from lightning_adaptiveload.planning.settings import Schedule

    assert set(SCHEDULE_TYPES) == set(SCHEDULE_NAMES) == set(get_args(Schedule))


def test_the_schedule_name_check_catches_a_chain():
    assert schedule_name_tests('if mode == "packed":\n    pass\nx = s in ("lockstep", "auto")\n') == [
        "mode == 'packed'",
        "s in ('lockstep', 'auto')",
    ]
    assert schedule_name_tests('x = "packed"\nif mode == other:\n    pass\n') == []


# `trainer.<attr> = ...` (or `+=`, ...) and any use of Lightning's fit loop.
TRAINER_EDIT = re.compile(r"(?<![\w-])trainer\.\w*\s*[-+*/|&]?=(?!=)|fit_loop")


def trainer_edits(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if TRAINER_EDIT.search(line.split("#", 1)[0])]


def test_only_the_compat_module_edits_the_trainer():
    found = {
        str(path.relative_to(PACKAGE_DIR)): trainer_edits(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path.name != "_lightning_compat.py"
    }
    assert len(found) > 100  # the walk found the package
    assert {k: v for k, v in found.items() if v} == {}, (
        "only lightning_adaptiveload/_lightning_compat.py may change the Trainer or read its fit loop: add a "
        "function there, or let the CLI set what Lightning needs"
    )


def test_the_trainer_edit_check_catches_an_edit():
    assert trainer_edits("    trainer.reload_dataloaders_every_n_epochs = 1\n") != []
    assert trainer_edits("x = trainer.fit_loop.epoch_loop.restarting\n") != []
    assert trainer_edits("self.trainer.limit_val_batches += 1\n") != []
    assert trainer_edits("if trainer.max_epochs != 1 and trainer.max_steps == 3:\n") == []
    assert trainer_edits('args = "--trainer.max_steps=20"  # trainer.fit_loop in a comment\n') == []


def test_the_top_level_api_stays_small():
    # 0.2.0: at most 30 public names at the top (Lightning's callbacks/__init__ exports about 25); the rest
    # lives in the subpackages named by job.
    names = [n for n in lightning_adaptiveload.__all__ if n != "__version__"]
    assert len(names) <= 30, names
    assert {"AdaptiveLoadDataModule", "LoadBalanceMonitor", "ClosedLoop", "fuse_norm_modulate"} <= set(names)

"""The user pages say what a user can do and what it measured, the way the lab notebook does not: no run or
issue numbers, one set of measured multi-GPU figures on every page that quotes them, the data path's flow
first, the architecture page's layers those the layout test enforces, and a CHANGELOG whose 0.2.0 section
names every module that moved and every top-level name that left."""

from __future__ import annotations

import ast
import importlib
import re

import pytest
from _paths import ROOT

import lightning_adaptiveload

# The pages that keep the runs (the notebook and the detailed results), and the two pages other work owns.
NOT_USER_PAGES = {"lab_notebook.md", "results.md", "fusion.md", "fused_op.md"}
USER_PAGES = (
    "README.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_USER_PAGES),
)

_RUN_OR_ISSUE = re.compile(r"\b(?:[Rr]uns?|[Ii]ssues?|[Ss]essions?) \d")


def run_or_issue_numbers(text: str) -> list[str]:
    """The lines of ``text`` that cite a run, issue or session by number ("run 83", "issue 36", "runs 58-61");
    a file name that holds one (``..._run66-69/``) is a path, not a citation."""
    return [
        f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if _RUN_OR_ISSUE.search(line)
    ]


def test_user_pages_cite_no_run_or_issue_numbers():
    bad = [f"{page}:{hit}" for page in USER_PAGES for hit in run_or_issue_numbers((ROOT / page).read_text())]
    assert not bad, "move the run's story to docs/lab_notebook.md or docs/results.md:\n" + "\n".join(bad)


def test_the_citation_check_can_fail():
    assert run_or_issue_numbers("measured (run 83, one H200)\nsee issue 36\nruns 58-61 on 2 GPUs")
    assert len(run_or_issue_numbers("a\nRuns 1 to 9\nb")) == 1
    assert not run_or_issue_numbers("`benchmarks/results/ddp_modes_fast_h200x4_2026-11-28_run66-69/`")
    assert not run_or_issue_numbers("when a step has lasted 4 s; 36 to 161 counted steps")


# ----------------------------------------------------------------------------- the measured DDP figures

_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})*(?:\.\d+)?[x%]?")


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of every table row (indented or not) whose first cell matches ``first_cell``."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if re.search(first_cell, cells[0]):
                rows.append(cells)
    return rows


def ddp_table(text: str) -> dict[tuple[str, str], list[str]]:
    """(settings, GPUs) -> the figures of a "settings, GPUs" table row: `equal_tokens`' tokens/s and wait,
    then `dual`, lockstep (ratio, wait) and packed (ratio, wait), in that order."""
    table = {}
    for cells in _table_rows(text, r"^(fast|eager)\b.*\d x H200$"):
        settings, gpus = cells[0].split()[0].rstrip(","), re.search(r"\d x H200", cells[0]).group(0)
        table[(settings, gpus)] = [n for cell in cells[1:5] for n in _NUMBER.findall(cell.replace("**", ""))]
    return table


def test_the_pages_agree_on_the_schedules_multi_gpu_figures():
    schedules = ddp_table((ROOT / "docs" / "schedules.md").read_text())
    report = ddp_table((ROOT / "docs" / "load_balance_report.md").read_text())
    keys = {(s, g) for s in ("fast", "eager") for g in ("2 x H200", "4 x H200")}
    assert set(schedules) == keys and set(report) == keys, (sorted(schedules), sorted(report))
    assert schedules == report  # the same tokens/s, ratios and waits in the one page and the report

    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "docs" / "results.md").read_text()
    for (settings, gpus), figures in schedules.items():
        tokens, _, dual, lockstep, _, packed, _ = figures
        label = "recipes as shipped" if settings == "fast" else "eager"
        (row,) = _table_rows(results, rf"^the schedules under DDP, {label}, {gpus[0]} GPUs$")
        flat = " ".join(row).replace("**", "")
        for figure in (f"({tokens})", dual, lockstep, packed):
            assert figure in flat, (settings, gpus, figure, row)
        (row,) = _table_rows(readme, rf"^the schedules under DDP, {label}$")
        flat = " ".join(row).replace("**", "")
        assert lockstep in flat and packed in flat, (settings, gpus, row)


def test_every_figure_of_the_readmes_results_table_is_in_the_results_page():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Measured results") : readme.index("## Tests")]
    figures = set(re.findall(r"\d[\d,]*(?:\.\d+)?(?:x|%| ms| s| GiB)", table))
    assert len(figures) > 10, figures  # the table was found
    results = (ROOT / "docs" / "results.md").read_text()
    missing = sorted(f for f in figures if f not in results)
    assert not missing, f"README figures with no source in docs/results.md: {missing}"


def test_the_figure_check_reads_a_table():
    text = "| fast, 2 x H200 | 31,223 (4.8%) | 0.963x | **1.031x** (1.0%) | 1.080x (0.7%) | 95-161 |\n"
    assert ddp_table(text) == {
        ("fast", "2 x H200"): ["31,223", "4.8%", "0.963x", "1.031x", "1.0%", "1.080x", "0.7%"]
    }
    assert ddp_table(text) != ddp_table(text.replace("1.080x", "1.087x"))


def test_no_page_says_the_schedules_are_unmeasured_on_several_gpus():
    stale = (
        "no multi-GPU run",
        "not yet re-measured end to end",
        "No GPU has trained with it",
        "no GPU has run it",
    )
    bad = [(page, s) for page in USER_PAGES for s in stale if s in (ROOT / page).read_text()]
    assert not bad, bad


# ----------------------------------------------------------------------------- the data path's first page


def test_the_data_path_opens_with_the_flow():
    text = (ROOT / "docs" / "data_path.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    first = sections[1]
    assert first.startswith("The flow in one page"), first[:80]
    assert len(first.splitlines()) <= 50, len(first.splitlines())  # a short mental model before the details
    diagram = re.search(r"```\n(.*?)\n", first, re.S).group(1)
    words = ["shards", "index", "plan", "loader", "batches", "model"]
    positions = [diagram.find(w) for w in words]
    assert -1 not in positions and positions == sorted(positions), diagram


# ----------------------------------------------------------------------------- the architecture page


def _layout_layers() -> list[set[str]]:
    tree = ast.parse((ROOT / "tests" / "package" / "test_layout.py").read_text())
    node = next(
        n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "LAYERS"
    )
    package = ROOT / "lightning_adaptiveload"

    def exists(unit: str) -> bool:  # a unit the layout test still names after its module was deleted
        return unit == "" or (package / unit).is_dir() or (package / f"{unit}.py").exists()

    return [{u for u in layer if exists(u)} for layer in ast.literal_eval(node.value)]


def architecture_layers(text: str) -> list[set[str]]:
    """The units of each row of the "Layers" table of ``docs/architecture.md``, lowest first."""
    section = text[text.index("### Layers") :]
    layers = []
    for cells in _table_rows(section, r"^\d+$"):
        units = {re.sub(r"(/|\.py)$", "", name) for name in re.findall(r"`([^`]+)`", cells[1])}
        layers.append({"" if u == "__init__" else u for u in units})
    return layers


def test_the_architecture_page_shows_the_layers_the_layout_test_enforces():
    assert architecture_layers((ROOT / "docs" / "architecture.md").read_text()) == _layout_layers()


def test_the_layer_check_reads_the_table():
    text = "### Layers\n\n| layer | folders | imports |\n|---|---|---|\n| 0 | the package's `__init__.py`, `stats.py` | - |\n| 1 | `planning/` | 0 |\n"
    assert architecture_layers(text) == [{"", "stats"}, {"planning"}]


# ----------------------------------------------------------------------------- the CHANGELOG

#: The top-level names of 0.1.0 (``git show 23c2a34:lightning_adaptiveload/__init__.py``).
NAMES_0_1_0 = """AdaptiveLoadDataModule AlignedGC Batching CostModel DualConstraintBatcher EpochPlan FusedNormModulateMixin
FusionError FusionReport KernelWarmup LoadBalanceMonitor Loader Mix NormModulate PlanSettings ShardError ShardIndex
ShardInfo ShardWriter SimulateSettings SimulationResult Source StepTimeTable SyntheticShards VideoDiT VideoDiTConfig
VideoDiTModule apply_sample_transform available_mixes collate estimate_memory expand_paths fuse_norm_modulate
fused_op_status global_token_count iter_shard layer_norm_modulate load_mix plan_epoch rank_noise_generator
register_fusion_adapter shard_model token_weighted_loss tokens_per_sample unfuse_norm_modulate
unregister_fusion_adapter wan_flops_per_batch write_synthetic_shards""".split()

#: The modules of 0.1.0's ``data/`` folder and the callbacks that moved in 0.2.0.
MOVED_0_1_0 = """data.format data.untrusted data.npy data.paths data.scan data.reader data.writer data.index data.indexing
data.index_file data.index_columns data.key_columns data.columnar data.compact data.compact_build data.synthetic
data.mixes data.index_agreement data.collate data.packed_collate data.stream data.loader data.resume data.replan
data.settings data.datamodule_inputs data.datamodule data.ingest data.ingest_output data.ingest_settings data.media
data.media_encode data.demo monitor.callback monitor.aligned_gc models.warmup_callback monitor.stats
tools.memory""".split()


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def _changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


def test_the_changelog_keeps_a_changelog_order():
    versions = re.findall(r"^## \[([^\]]+)\](.*)$", _changelog(), re.M)
    assert [v for v, _ in versions][:3] == ["Unreleased", "0.2.0", "0.1.0"], versions
    assert versions[1][1] == " - 2026-12-02" and lightning_adaptiveload.__version__ == "0.2.0"
    assert not run_or_issue_numbers(_section(_changelog(), "## [0.1.0]"))  # a summary for users, not the log


def _unbracket(cell: str) -> str:
    """``cell`` without its parenthesised remarks (``(LoadBalanceMonitor)``, ``(and `ingest.ingest`)``)."""
    return re.sub(r"\([^)]*\)", "", cell)


def _expand(cell: str) -> list[str]:
    """``data.format``, ``.untrusted`` -> ``data.format``, ``data.untrusted``."""
    names, base = [], ""
    for name in re.findall(r"`([\w.]+)`", cell):
        if name.startswith("."):
            name = base + name[1:]
        else:
            base = name.rsplit(".", 1)[0] + "." if "." in name else ""
        names.append(name)
    return names


def test_the_changelog_moves_every_module_to_one_that_exists():
    section = _section(_changelog(), "## [0.2.0]")
    moved = {}
    for cells in _table_rows(section, r"^`(data|monitor|models|tools)\."):
        old, new = _expand(_unbracket(cells[0])), _unbracket(cells[1])
        same = re.search(r"`(\w+)\.<the same name>`", new)
        targets = (
            [f"{same.group(1)}.{o.split('.', 1)[1]}" for o in old] if same else re.findall(r"`([\w.]+)`", new)
        )
        for i, o in enumerate(old):
            moved[o] = targets[i] if same else targets[min(i, len(targets) - 1)]
    missing = sorted(set(MOVED_0_1_0) - set(moved))
    assert not missing, f"modules moved in 0.2.0 without a row in the CHANGELOG's table: {missing}"
    for old, new in moved.items():
        assert importlib.util.find_spec(f"lightning_adaptiveload.{new}") is not None, (old, new)


def test_the_changelog_says_where_every_removed_top_level_name_lives():
    section = _section(_changelog(), "## [0.2.0]")
    table = section[section.index("**Names no longer at the top level.**") :]
    table = table[: table.index("Still at the top level")]
    where = {}
    for cells in _table_rows(table, r"^`\w+`"):
        (module,) = re.findall(r"`(lightning_adaptiveload[\w.]*)`", cells[1])
        for name in re.findall(r"`(\w+)`", cells[0]):
            where[name] = module
    removed = set(NAMES_0_1_0) - set(lightning_adaptiveload.__all__)
    assert set(where) == removed, (sorted(removed - set(where)), sorted(set(where) - removed))
    for name, module in where.items():
        assert getattr(importlib.import_module(module), name, None) is not None, (name, module)
    kept = [n for n in lightning_adaptiveload.__all__ if n != "__version__"]
    still = section[section.index("Still at the top level") :]
    assert all(f"`{n}`" in still for n in kept), [n for n in kept if f"`{n}`" not in still]


@pytest.mark.parametrize("page", ["README.md", "docs/closed_loop.md", "docs/monitor.md"])
def test_the_pages_put_the_closed_loop_after_the_monitor(page: str):
    text = (ROOT / page).read_text()
    assert "ClosedLoop" in text, page
    assert "LoadBalanceMonitor(refit" not in text and "refit=True` (the default)" not in text, page
    lines = [
        i
        for i, line in enumerate(text.splitlines())
        if "class_path: lightning_adaptiveload.ClosedLoop" in line
    ]
    for i in lines:  # in a recipe snippet the monitor comes first
        assert "class_path: lightning_adaptiveload.LoadBalanceMonitor" in text.splitlines()[i - 1], (page, i)


def test_the_pages_do_not_import_removed_top_level_names():
    removed = set(NAMES_0_1_0) - set(lightning_adaptiveload.__all__)
    bad = []
    for page in (*USER_PAGES, "docs/fusion.md", "docs/fused_op.md"):
        for m in re.finditer(
            r"from lightning_adaptiveload import \(?([\w, \n]+)\)?", (ROOT / page).read_text()
        ):
            bad += [(page, n) for n in re.findall(r"\w+", m.group(1)) if n in removed]
    assert not bad, bad


def test_the_user_pages_are_found():
    assert len(USER_PAGES) > 10 and all(
        (ROOT / p).exists() for p in USER_PAGES
    )  # the checks above read pages

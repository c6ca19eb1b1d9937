"""Every relative link of the README, ``benchmarks/README.md``, ``tests/README.md`` and ``docs/*.md`` leads to a
file (and a heading, where it names one), and every ``benchmarks/`` path and every test file they name exists
(issue 39: scripts moved into topic folders, ``docs/performance.md`` split into a user page and a lab notebook,
and the test files into folders shaped like the package)."""

from __future__ import annotations

import re
from pathlib import Path

from _paths import ROOT

PAGES = (
    "README.md",
    "benchmarks/README.md",
    "tests/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_references(root: Path, page: str) -> list[str]:
    """The links, ``benchmarks/`` paths and test files (``tests/.../test_x.py``) of ``root/page`` that lead
    nowhere, one line each. A path written as a pattern (followed by ``*``, ``{`` or ``<``, as in
    ``loader_*.json``) is not checked."""
    text = (root / page).read_text()
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (root / page).parent / path if path else root / page
        if not file.exists():
            bad.append(
                f"{page}: link {target}: no file {file.relative_to(root) if file.is_relative_to(root) else file}"
            )
        elif anchor and file.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
            if anchor not in headings:
                bad.append(f"{page}: link {target}: no heading '{anchor}' in {path or page}")
    for m in re.finditer(r"(?<![\w/])benchmarks/[\w./-]+", text):
        if text[m.end() : m.end() + 1] in ("*", "{", "<"):
            continue
        path = m.group(0).rstrip(".")
        if not (root / path).exists():
            bad.append(f"{page}: path {path} does not exist")
    for m in re.finditer(r"\btests/[\w/-]+\.(?:py|json|yaml|md)\b", text):
        if not (root / m.group(0)).exists():
            bad.append(f"{page}: test file {m.group(0)} does not exist")
    return bad


def test_every_link_and_benchmarks_path_of_the_docs_resolves():
    bad = [line for page in PAGES for line in broken_references(ROOT, page)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_missing_file_heading_and_script(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "model").mkdir(parents=True)
    (tmp_path / "benchmarks" / "model" / "bench_step.py").write_text("")
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Settings to use\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#settings-to-use) `benchmarks/model/bench_step.py` "
        "`benchmarks/results/loader_*.json`\n"
        "[gone](docs/b.md) [moved](docs/a.md#run-3) `benchmarks/bench_step.py`.\n"
        "`tests/planning/test_x.py::test_y` `tests/test_x.py` `tests/_runner.launch` `tests/benchmarks/test_b.py`\n"
    )
    for folder in ("planning", "benchmarks"):  # tests/benchmarks/test_b.py is no benchmarks/ path
        (tmp_path / "tests" / folder).mkdir(parents=True)
    (tmp_path / "tests" / "planning" / "test_x.py").write_text("")
    (tmp_path / "tests" / "benchmarks" / "test_b.py").write_text("")
    bad = broken_references(tmp_path, "README.md")
    assert len(bad) == 4, bad
    assert (
        "docs/b.md" in bad[0] and "no heading 'run-3'" in bad[1] and "benchmarks/bench_step.py does" in bad[2]
    )
    assert "test file tests/test_x.py does not exist" in bad[3]

"""One page says which schedule to use, the first pages link to it, and code that lists the schedules lists
all three."""

from __future__ import annotations

import re

import yaml
from _paths import ROOT

from lightning_adaptiveload.planning.plan import SCHEDULES

PAGE = ROOT / "docs" / "schedules.md"


def test_the_schedules_page_covers_every_schedule_and_mode_and_the_gpu_caveat():
    text = PAGE.read_text()
    for name in (*SCHEDULES, "equal_tokens", "dual"):
        assert f"`{name}`" in text, name
    assert "runs_packed_batches = True" in text and "lockstep_tail" in text  # what the model must declare
    assert "GPU recipes keep `lockstep`" in text  # the recommendation, plainly
    assert "Measured end to end on 4 x H200 and 2 x H200" in text  # the multi-GPU figures, with their devices
    # packed's measured caveat: what was slow, the measured fix, and what is still unmeasured
    assert "half the tokens/s" in text and "bench_packed_step.py" in text
    assert "multi-GPU tables have not been re-run since" in " ".join(text.split())  # what is still unmeasured
    assert "no multi-GPU run" not in text  # it said so while the README quoted two multi-GPU tables
    assert len(text.splitlines()) < 120  # one short page


def test_the_first_pages_link_to_it():
    for page, link in (
        ("README.md", "docs/schedules.md"),
        ("docs/recipes.md", "schedules.md"),
        ("docs/your_own_model.md", "schedules.md"),
    ):
        text = (ROOT / page).read_text()
        assert f"]({link})" in text, page
        assert (ROOT / page).parent.joinpath(link).resolve() == PAGE.resolve()


def test_code_that_lists_the_schedules_lists_packed_too():
    # A docstring or comment naming "independent" and "lockstep" as choices must name "packed" within the
    # same few lines: the third schedule was missing from the DataModule's, the loader's and the planner's.
    missing = []
    for path in sorted((ROOT / "lightning_adaptiveload").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.search(r'"independent"``?,? or ``"lockstep"|"independent" \| "lockstep"', line):
                window = " ".join(lines[i : i + 3])
                if "packed" not in window:
                    missing.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not missing, "\n".join(missing)


def test_training_recipes_follow_the_page():
    recipes = ROOT / "lightning_adaptiveload" / "recipes"
    for name in ("quickstart", "wan13b_480p_finetune", "wan14b_720p"):
        data = yaml.safe_load((recipes / f"{name}.yaml").read_text())["data"]["init_args"]
        assert data["plan"]["schedule"] == "lockstep", name  # the recommendation of docs/schedules.md

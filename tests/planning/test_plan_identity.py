"""The vectorised planner plans exactly what the per-sample planner did: every EpochPlan field of a matrix
of cases (schedules x world sizes x workers x mixes x seeds/epochs x resume x lockstep tails) matches
the digests in ``tests/assets/plan_digests.json``, computed with the planner before it was vectorised.

If a planning change is *meant* to change plans, regenerate the digests (``python tests/_plan_cases.py
digest tests/assets/plan_digests.json --quick``) and say so in the CHANGELOG."""

from __future__ import annotations

import json

import pytest
from _paths import ASSETS
from _plan_cases import FIELDS, case_key, cases, digest_plan, plan_case

_DIGESTS = ASSETS / "plan_digests.json"
# Report counters that show which branches of the planner a plan went through.
_BRANCHES = (
    "reduced_steps",
    "moved_samples",
    "split_batches",
    "moved_batches",
    "packed_tail_steps",
    "lockstep_tail_steps",
    "bound_partial_batches",
)


def _expected() -> dict[str, dict[str, str]]:
    with open(_DIGESTS) as f:
        return json.load(f)


def test_fixture_covers_the_quick_matrix():
    assert sorted(_expected()) == sorted(case_key(c) for c in cases(quick=True))


@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
def test_plans_are_unchanged(schedule):
    expected = _expected()
    picked = [c for c in cases(quick=True) if c["schedule"] == schedule]
    assert picked
    diffs, seen = [], set()
    for c in picked:
        plan = plan_case(c)
        got = digest_plan(plan)
        want = expected[case_key(c)]
        bad = [f for f in FIELDS if got[f] != want[f]]
        if bad:
            diffs.append(f"{case_key(c)}: {bad}")
        seen.update(k for k in _BRANCHES if plan.report.get(k))
    assert not diffs, "plans changed:\n" + "\n".join(diffs)
    # The matrix must reach the planner's branches, or the comparison proves little.
    must = {
        "independent": {"split_batches", "moved_batches", "bound_partial_batches"},
        "lockstep": {"reduced_steps", "moved_samples", "packed_tail_steps", "lockstep_tail_steps"},
        "packed": set(),
    }[schedule]
    assert must <= seen, f"the quick matrix reaches none of {sorted(must - seen)}"

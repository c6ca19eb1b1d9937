"""step_pairs.py: two runs of one plan compared step by step; a run of another plan is refused."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from _paths import ROOT


@pytest.fixture
def step_pairs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    import step_pairs

    return step_pairs


def _write(path: Path, rows: list[tuple[int, int, float]]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "step", "num_tokens", "batch_size", "gpu_step_s"])
        for step, (tokens, samples, t) in enumerate(rows, start=1):
            w.writerow([0, step, tokens, samples, t])
    return str(path)


def test_first_meetings_and_the_sums(step_pairs, tmp_path, capsys):
    base = [(10, 1, 9.0), (10, 1, 1.0), (20, 2, 1.5), (10, 1, 1.0), (20, 2, 1.2), (30, 1, 2.0)]
    warm = [(10, 1, 20.0), (10, 1, 1.0), (20, 2, 1.2), (10, 1, 1.0), (20, 2, 1.2), (30, 1, 2.0)]
    out = tmp_path / "pairs.json"
    step_pairs.main([_write(tmp_path / "a.csv", base), _write(tmp_path / "b.csv", warm), "--json", str(out)])
    res = json.loads(out.read_text())
    assert [m["step"] for m in res["base_first_meetings"]] == [3, 6]  # step 1 left out
    first = res["base_first_meetings"][0]
    assert first["median_later_s"] == 1.2 and first["excess_s"] == pytest.approx(0.3)
    assert res["base_first_meetings"][1]["excess_s"] is None  # met once: nothing to compare with
    assert res["base_summed_s"] == pytest.approx(1.5 + 1.0 + 1.2 + 2.0)
    assert res["variant_summed_s"] == pytest.approx(1.2 + 1.0 + 1.2 + 2.0)
    assert [d["step"] for d in res["differing_steps"]] == [1, 3] and res["differing_steps"][1][
        "first_meeting"
    ]
    assert "step    3 (20 tokens, 2 samples)" in capsys.readouterr().out


def test_runs_of_different_plans_are_refused(step_pairs, tmp_path):
    a = _write(tmp_path / "a.csv", [(10, 1, 1.0), (20, 2, 1.0)])
    b = _write(tmp_path / "b.csv", [(10, 1, 1.0), (20, 3, 1.0)])
    with pytest.raises(SystemExit, match="step 2: the runs trained different batches"):
        step_pairs.main([a, b])

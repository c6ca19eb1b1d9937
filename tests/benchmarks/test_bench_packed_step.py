"""``benchmarks/model/bench_packed_step.py --quick`` runs on the CPU and writes its JSON (no timing is checked)."""

import json

import pytest
from _paths import ROOT

BENCH = str(ROOT / "benchmarks" / "model")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import bench_packed_step

    return bench_packed_step


def test_quick_mode_runs_every_case_and_writes_json(bench, tmp_path, monkeypatch):
    from lightning_adaptiveload.models import packing

    assert bench.main(["--quick", "--out", str(tmp_path), "--filename", "quick.json"]) == 0
    data = json.loads((tmp_path / "quick.json").read_text())
    assert data["device"] and data["date"] and data["torch"] and not data["errors"]
    assert data["settings"]["preset"] == "tiny" and data["settings"]["quick"] is True
    # Patch 1 x 2 x 2: the clip 16 x 3 x 8 x 8 has 48 tokens; the mix 16 x 2 x 8 x 8 and four 16 x 1 x 8 x 8.
    assert data["shapes"]["tokens"]["clip/pack"] == 48 and data["shapes"]["tokens"]["mix/pack"] == 32 + 4 * 16
    seen = {(r["case"], r["variant"]) for r in data["results"]}
    assert {("clip", "bucketed"), ("clip", "pack"), ("clip", "pack-old"), ("mix", "pack")} <= seen
    assert {("segment_rows", how) for how in ("splits", "matmul", "index_add", "index")} <= seen
    assert all(r["median_ms"] > 0 and r["tokens"] > 0 for r in data["results"])
    assert {(r["case"], r["variant"]) for r in data["summary"]} >= {("clip", "pack"), ("mix", "pack")}
    # The variants' settings were restored.
    assert packing._segment_sum_route() == "auto" and packing._force_segments() is False


def test_unknown_case_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cases", "clips"])
    assert "unknown mode or case ['clips']" in capsys.readouterr().err

"""``benchmarks/fusion/bench_families.py --quick`` runs its diffusers families (the nine the table started
from, then Mochi and Lumina2) on the CPU and writes a JSON whose structure the GPU table relies on (no timing
is checked)."""

import json
import signal

import pytest
from _paths import ROOT

pytest.importorskip("diffusers")

BENCH = str(ROOT / "benchmarks" / "fusion")
FAMILIES = ["wan", "sd3", "flux", "cogvideox", "ltx", "hunyuan", "pixart", "dit", "sana", "mochi", "lumina2"]
FOUR = ["eager", "eager_fused", "compiled", "compiled_fused"]


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(BENCH)
        import bench_families

        yield bench_families


def _main(bench, argv: list[str]) -> int:
    """``bench.main(argv)`` in this process, with the SIGTERM handler it installs taken out again afterwards.

    The script's handler turns SIGTERM into its ``_Stopped`` exception. Left installed in the pytest process,
    a later SIGTERM (a CI time limit, a runner stopping the suite) surfaced as ``bench_families._Stopped``
    in whatever test was running then (seen in tests/cli/test_cli.py under load)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return bench.main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    """``--quick`` over every family once (eager phase): the JSON's path."""
    out = tmp_path_factory.mktemp("quick")
    assert _main(bench, ["--quick", "--out", str(out), "--filename", "quick.json"]) == 0
    return out / "quick.json"


def _is_measured(v: dict) -> bool:
    return v["ms"]["median"] > 0 and v["ms"]["n"] >= 1 and v["loss"] > 0


def test_quick_mode_covers_every_family_with_four_variants_each(quick):
    data = json.loads(quick.read_text())
    env = data["environment"]
    assert env["device"] and env["torch"] and env["diffusers"] and data["date"]
    assert data["settings"]["quick"] is True and data["settings"]["layers"] == 2
    assert data["settings"]["weights"] == "fp32" and data["settings"]["autocast"] == "bf16"
    assert list(data["families"]) == FAMILIES
    classes = {f["class"] for f in data["families"].values()}
    assert (
        len(classes) == len(FAMILIES)
        and "WanTransformer3DModel" in classes
        and "SanaTransformer2DModel" in classes
    )
    for key, fam in data["families"].items():
        assert sorted(fam["variants"]) == sorted(FOUR), key
        assert fam["tokens"] > 0 and fam["dim"] > 0 and fam["heads"] > 0, key
        assert sum(fam["layers"].values()) == 2 * len(fam["layers"]), key
        eager = fam["variants"]["eager"]
        assert _is_measured(eager), (key, eager)
        fused = fam["variants"]["eager_fused"]
        assert "fused_sites" in fam["fusion"], key
        if "ms" in fused:  # fused: its sites are counted, and it computes what eager mode computes
            assert (
                fam["fusion"]["fused_sites"] > 0 and fused["fused_sites"] == fam["fusion"]["fused_sites"]
            ), key
            assert fam["loss_rel_diff_vs_eager"]["eager_fused"] < 0.05, (key, fam["loss_rel_diff_vs_eager"])
            assert fam["ratios"]["eager_fused/eager"] > 0, key
        elif "skipped" in fused:  # not fused: the reason is FusionError's message
            assert fused["skipped"].startswith("fusion refused") and fam["fusion"]["error"], (key, fused)
        else:  # fused, but its step failed: the error is recorded
            assert fused["error"], (key, fused)
        for name in ("compiled", "compiled_fused"):
            assert "--compile-quick" in fam["variants"][name]["skipped"], (key, name)
    # Wan fuses (its adapter is built in), so the ratio exists; the table has one row per family.
    assert data["families"]["wan"]["fusion"]["fused_sites"] > 0
    rows = [line for line in data["table"].splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == FAMILIES
    assert data["unfinished"] == {}


def test_quick_compiled_phase_and_merge(bench, quick, tmp_path):
    args = ["--quick", "--compile-quick", "--phases", "compiled", "--families", "wan", "--out", str(tmp_path)]
    assert _main(bench, [*args, "--filename", "compiled.json"]) == 0
    compiled = json.loads((tmp_path / "compiled.json").read_text())["families"]["wan"]
    for name in ("compiled", "compiled_fused"):
        v = compiled["variants"][name]
        assert _is_measured(v) and v["first_step_s"] > 0 and v["graphs_compiled"] >= 1, (name, v)
        assert v["compile"]["how"] == "acceleration.compile_blocks" and v["compile"]["backend"] == "aot_eager"
        assert v["compile"]["blocks"] == 2 and v["compile"]["dynamic"] is True
    assert compiled["variants"]["compiled_fused"]["fused_sites"] > 0
    assert "--phases compiled" in compiled["variants"]["eager"]["skipped"]
    # Same seed, weights and inputs: the compiled variants compute the eager phase's loss.
    ref = json.loads(quick.read_text())["families"]["wan"]["variants"]["eager"]["loss"]
    for name in ("compiled", "compiled_fused"):
        assert abs(compiled["variants"][name]["loss"] - ref) <= 0.05 * ref

    merge = ["--merge", str(quick), str(tmp_path / "compiled.json"), "--out", str(tmp_path)]
    assert _main(bench, [*merge, "--filename", "merged.json"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    wan = merged["families"]["wan"]
    assert all(_is_measured(wan["variants"][n]) for n in FOUR)
    assert set(wan["ratios"]) == {
        "eager_fused/eager",
        "compiled_fused/compiled",
        "compiled/eager",
        "compiled_fused/eager",
    }
    assert list(merged["families"]) == FAMILIES  # the others keep the first file's entries
    assert [m["file"] for m in merged["merged_from"]] == ["quick.json", "compiled.json"]


def test_time_budget_skips_with_a_reason_and_names_the_follow_up(bench, tmp_path, capsys):
    assert (
        _main(bench, ["--quick", "--time-budget-s", "1e-9", "--out", str(tmp_path), "--filename", "b.json"])
        == 0
    )
    data = json.loads((tmp_path / "b.json").read_text())
    assert list(data["families"]) == FAMILIES
    for fam in data["families"].values():
        assert "another call" in fam["variants"]["eager"]["skipped"]
        assert fam["tokens"] > 0  # the stub knows the shapes without building the model
    assert data["unfinished"] == {"eager": FAMILIES}
    assert f'FAMILIES="{" ".join(FAMILIES)}" PHASES=eager' in capsys.readouterr().out


def test_unknown_family_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        _main(bench, ["--quick", "--families", "wan", "sdxl"])
    assert "unknown family, variant or phase ['sdxl']" in capsys.readouterr().err


def test_running_the_script_in_process_leaves_the_sigterm_handler_as_it_was(bench, tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert (
        _main(bench, ["--quick", "--families", "wan", "--time-budget-s", "1e-9", "--out", str(tmp_path)]) == 0
    )
    assert signal.getsignal(signal.SIGTERM) is before
    bench.main(["--quick", "--families", "wan", "--time-budget-s", "1e-9", "--out", str(tmp_path)])
    try:  # the check can fail: called bare, the script leaves its handler installed
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        signal.signal(signal.SIGTERM, before)

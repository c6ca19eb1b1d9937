"""Tests of the planning simulator: metrics, step-time tables, replay of plans, simulate() and its CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import get_args

import numpy as np
import pytest

from lightning_adaptiveload import stats
from lightning_adaptiveload.cli.simulate import main
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.plan import EpochPlan
from lightning_adaptiveload.shards.format import ShardInfo
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.tools.replay import VARIANTS, balance_metrics
from lightning_adaptiveload.tools.replay import replay_plan as _replay
from lightning_adaptiveload.tools.simulate import simulate
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings, SimulateVariant
from lightning_adaptiveload.tools.step_times import BatchCoster as _Coster
from lightning_adaptiveload.tools.step_times import StepTimeTable

# ----------------------------------------------------------------------------------------------- metrics


def test_balance_metrics_matches_stats_definitions():
    rng = np.random.default_rng(3)
    t = rng.uniform(0.5, 2.0, size=(40, 5))
    tok = rng.integers(100, 1000, size=(40, 5))
    m = balance_metrics(t, tok, max_tokens=1000)
    cvs = [stats.cv(row) for row in t]
    imb = [stats.imbalance(row) for row in t]
    assert m["cv_mean"] == pytest.approx(np.mean(cvs), rel=1e-12)
    assert m["cv_p95"] == pytest.approx(stats.percentile(cvs, 95), rel=1e-12)
    assert m["imbalance_mean"] == pytest.approx(np.mean(imb), rel=1e-12)
    assert m["wait_mean"] == pytest.approx(np.mean([stats.straggler_wait(row) for row in t]), rel=1e-12)
    # Time-weighted wait: per-step waits weighted by the step's duration (its slowest rank).
    tops = t.max(axis=1)
    weighted = sum(stats.straggler_wait(row) * top for row, top in zip(t, tops)) / tops.sum()
    assert m["wait_share"] == pytest.approx(weighted, rel=1e-12)
    assert m["tokens_per_s"] == pytest.approx(tok.sum() / tops.sum(), rel=1e-12)
    assert m["peak_tokens"] == tok.max()
    assert m["token_fill"] == pytest.approx(tok.mean() / 1000)
    assert m["vram_utilisation"] == pytest.approx(tok.mean() / tok.max())
    assert (m["steps"], m["world"]) == (40, 5)


def test_balance_metrics_reports_the_shared_balance_figures():
    """Issue 13: the simulator reports the monitor's names, from the one definition in stats."""
    rng = np.random.default_rng(4)
    t = rng.uniform(0.5, 2.0, size=(30, 4))
    m = balance_metrics(t, np.ones_like(t, dtype=int))
    figures = stats.balance_summary(t)
    assert {k: m[k] for k in stats.BALANCE_FIGURES} == figures
    assert m["straggler_wait"] == m["wait_share"] and m["step_wait_mean"] == m["wait_mean"]
    assert m["straggler_wait"] != m["step_wait_mean"]  # two quantities, two names


def test_balance_metrics_equal_ranks_have_no_wait():
    t = np.tile(np.array([[1.0], [3.0], [2.0]]), (1, 8))
    m = balance_metrics(t, np.ones_like(t, dtype=int))
    assert m["cv_mean"] == 0 and m["wait_share"] == 0 and m["imbalance_mean"] == 0
    assert m["step_time_cv"] == pytest.approx(np.std([1, 3, 2]) / 2)


def test_balance_metrics_compute_fill_and_memory():
    t = np.array([[1.0, 2.0]])
    m = balance_metrics(
        t,
        np.array([[10, 20]]),
        rank_memory=np.array([[4.0, 8.0]]),
        rank_cost=np.array([[3.0, 5.0]]),
        max_compute=8.0,
    )
    assert m["compute_fill"] == pytest.approx(0.5)
    assert m["vram_utilisation"] == pytest.approx(0.75)
    assert m["wait_share"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "t, tok",
    [(np.ones(3), np.ones(3)), (np.ones((2, 2)), np.ones((2, 3))), (np.zeros((0, 2)), np.zeros((0, 2)))],
)
def test_balance_metrics_rejects_bad_shapes(t, tok):
    with pytest.raises(ValueError, match="steps, world"):
        balance_metrics(t, tok)


def test_balance_metrics_rejects_negative_times():
    with pytest.raises(ValueError, match=">= 0"):
        balance_metrics(np.array([[1.0, -1.0]]), np.array([[1, 1]]))


# ----------------------------------------------------------------------------------------- step times


def _write_trace(path, lines):
    with open(path, "w") as f:
        f.write("# meta {}\n")
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
        f.write("fit ms/sample = ...\n")


def test_a_missing_short_bucket_is_never_priced_below_zero(tmp_path):
    # Only long samples measured, on a curve whose least-squares tangent has a negative per-sample constant
    # (cost = 1e-3 S + 5e-7 S^2 - 0.5): images, missing from the table, would cost less than nothing.
    path = tmp_path / "clips.jsonl"
    cost = lambda s: 1e-3 * s + 5e-7 * s * s - 0.5  # noqa: E731
    _write_trace(path, [{"T": t, "H": 40, "W": 100, "B": 1, "ms": 1e3 * cost(1000 * t)} for t in (1, 2, 3)])
    table = StepTimeTable.from_jsonl(path)
    assert table.fallback.gamma >= 0
    assert table.batch_seconds((1, 20, 20), 21) > 0  # 21 images of 100 tokens
    assert table.batch_seconds((3, 40, 100), 1) == pytest.approx(cost(3000))  # measured stays measured


def test_step_time_table_reads_trace_and_interpolates(tmp_path):
    path = tmp_path / "trace.jsonl"
    _write_trace(
        path,
        [
            {"T": 1, "H": 4, "W": 4, "B": 1, "ms": 10.0, "peak_gb": 1.0},
            {"T": 1, "H": 4, "W": 4, "B": 5, "ms": 30.0, "peak_gb": 3.0},
            {"T": 3, "H": 4, "W": 4, "B": 2, "ms": 80.0},
            {"T": 3, "H": 4, "W": 4, "B": 2, "ms": 100.0},  # repeated: averaged
        ],
    )
    table = StepTimeTable.from_jsonl(path)
    assert table.batch_seconds((1, 4, 4), 1) == pytest.approx(0.010)
    assert table.batch_seconds((1, 4, 4), 3) == pytest.approx(0.020)  # linear between B=1 and B=5
    assert table.batch_seconds((1, 4, 4), 7) == pytest.approx(0.040)  # extrapolated on the same line
    assert table.batch_peak_gb((1, 4, 4), 3) == pytest.approx(2.0)
    assert table.batch_seconds((3, 4, 4), 2) == pytest.approx(0.090)
    assert table.batch_seconds((3, 4, 4), 1) == pytest.approx(0.045)  # one measured B: proportional
    # No memory figure for this bucket: the line through every measured peak, in batch tokens
    # (1 GiB at 4 tokens, 3 GiB at 20 tokens -> 0.5 GiB + 0.125 GiB per token).
    assert table.batch_peak_gb((3, 4, 4), 1) == pytest.approx(0.5 + 0.125 * 12)
    before = table.lookups.get("fallback", 0)
    missing = table.batch_seconds((2, 4, 4), 1)  # not in the trace: quadratic fit of the points
    assert missing > 0 and table.lookups["fallback"] == before + 1
    assert {"measured", "interpolated", "scaled"} <= set(table.lookups)


def test_step_time_table_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"T": 1, "H": 4, "W": 4, "B": 1, "ms": 1}\n{"T": 1, "H": 4, "B": 1, "ms": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 lacks key 'W'"):
        StepTimeTable.from_jsonl(path)
    path.write_text('{"T": 1, "H": 4, "W": 4, "B": 0, "ms": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        StepTimeTable.from_jsonl(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        StepTimeTable.from_jsonl(tmp_path / "nope.jsonl")


def test_step_time_table_from_monitor_csv(tmp_path):
    path = tmp_path / "load_balance_ranks.csv"
    head = "rank,batch_idx,step,seq_len,batch_size,compute_time_s,peak_allocated_bytes,flops_counted\n"
    rows = []
    for k in range(10):
        rows.append(f"0,{k},{k + 1},24,4,{0.4 + 0.01 * (k % 3)},{2**30},0")
        rows.append(f"1,{k},{k + 1},72,1,{9.0 if k < 2 else 0.3},{2 * 2**30},{1 if k == 5 else 0}")
    path.write_text(head + "\n".join(rows) + "\n")
    shapes = [(16, 1, 8, 12), (16, 1, 12, 8), (16, 3, 8, 12), (16, 9, 8, 12)]
    table = StepTimeTable.from_monitor_csv(path, shapes, warmup_steps=2)
    # Both 24-token shapes get the median of the kept rows; the 216-token shape was never measured.
    assert table.seconds[(1, 8, 12)] == table.seconds[(1, 12, 8)] == {4: pytest.approx(0.41)}
    assert table.seconds[(3, 8, 12)] == {1: pytest.approx(0.3)}  # warm-up (9 s) and counted step left out
    assert (9, 8, 12) not in table.seconds
    assert table.batch_peak_gb((1, 8, 12), 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no measured sequence length"):
        StepTimeTable.from_monitor_csv(path, [(16, 9, 8, 12)])
    bad = tmp_path / "bad.csv"
    bad.write_text("rank,step\n0,1\n")
    with pytest.raises(ValueError, match=r"bad.csv: missing column"):
        StepTimeTable.from_monitor_csv(bad, shapes)


# ------------------------------------------------------------------------------------- hand-made plans


def _hand_plan() -> EpochPlan:
    # Two ranks, two workers each; rank 0 alternates workers (round robin), rank 1 likewise.
    shapes = [(16, 1, 4, 4), (16, 3, 4, 4)]  # 4 and 12 tokens under patch (1, 2, 2)
    buckets = [{"shape": s, "seq_len": 0, "batch_size": 0, "cost": 0.0} for s in shapes]
    streams = {
        (0, 0): [[(0, 0), (0, 1), (0, 2)], [(0, 3)]],
        (0, 1): [[(1, 0)], [(1, 1)]],
        (1, 0): [[(2, 0)], [(2, 1), (2, 2)]],
        (1, 1): [[(3, 0), (3, 1)], [(3, 2)]],
    }
    batch_buckets = {(0, 0): [0, 1], (0, 1): [1, 1], (1, 0): [1, 0], (1, 1): [0, 1]}
    order = [[(0, 0), (1, 0), (0, 1), (1, 1)], [(0, 0), (1, 0), (0, 1), (1, 1)]]
    given = dict(
        world_size=2,
        num_workers=2,
        seed=0,
        epoch=0,
        schedule="independent",
        buckets=buckets,
        streams=streams,
        batch_buckets=batch_buckets,
        step_order=order,
        steps=4,
        global_tokens=[0] * 4,
    )
    # The replay reads only the fields above; bookkeeping fields the planner adds get empty values.
    for f in dataclasses.fields(EpochPlan):
        if (
            f.name not in given
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            given[f.name] = {k: [] for k in streams}
    return EpochPlan(**given)


def test_replay_of_hand_made_plan():
    plan = _hand_plan()
    cm = CostModel(kind="quadratic", alpha=1.0, beta=0.0)  # 1 second per token
    rep = _replay(plan, _Coster(cm, (1, 2, 2), overhead_s=0.5), cm)
    # rank 0: w0 b0 (3 x 4 tok), w1 b0 (1 x 12), w0 b1 (1 x 12), w1 b1 (1 x 12)
    # rank 1: w0 b0 (1 x 12), w1 b0 (2 x 4), w0 b1 (2 x 4), w1 b1 (1 x 12)
    assert rep.tokens.tolist() == [[12, 12], [12, 8], [12, 8], [12, 12]]
    assert rep.seconds.tolist() == [[12.5, 12.5], [12.5, 8.5], [12.5, 8.5], [12.5, 12.5]]
    assert rep.cost.tolist() == [[12, 12], [12, 8], [12, 8], [12, 12]]
    assert rep.samples == 12
    m = balance_metrics(rep.seconds, rep.tokens)
    assert m["wait_share"] == pytest.approx(2 * 2.0 / 50.0)
    assert m["cv_mean"] == pytest.approx(0.5 * (2.0 / 10.5))


def test_replay_rejects_unequal_step_counts():
    plan = _hand_plan()
    plan.step_order[1] = plan.step_order[1][:3]
    cm = CostModel(kind="quadratic", alpha=1.0)
    with pytest.raises(RuntimeError, match="different step counts"):
        _replay(plan, _Coster(cm, (1, 2, 2), 0.0), cm)


# ---------------------------------------------------------------------------------------- simulate()


def test_simulate_tiny_mix_end_to_end(tmp_path):
    result = simulate(
        "tiny",
        SimulateSettings(world_sizes=[4], max_tokens=450, min_steps_per_rank=24, max_candidates=4),
        progress=False,
        out_dir=tmp_path,
    )
    variants = [r["variant"] for r in result.rows]
    assert variants == ["equal_tokens", "dual", "lockstep"]
    base = result.row("equal_tokens", 4)
    assert base["tokens_per_s_ratio"] == pytest.approx(1.0)
    for r in result.rows:
        # Every sample of the population is trained on exactly once in every variant.
        assert r["samples"] == r["population_samples"]
        assert r["peak_tokens"] <= 450
        assert 0.0 <= r["wait_share"] < 1.0 and r["cv_p95"] >= r["cv_p50"] >= 0
        assert r["steps"] >= 24 * 0.9
        assert r["tokens_per_s"] == pytest.approx(r["total_tokens"] / r["total_seconds"])
        assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        assert len(result.per_step_cv[(r["variant"], 4)]) == r["steps"]
    for variant in ("dual", "lockstep"):
        r = result.row(variant, 4)
        feasible = [c for c in r["candidates"] if "infeasible" not in c]
        assert feasible, r["candidates"]
        best = max(c["tokens_per_s"] for c in feasible)
        rec = [c for c in feasible if c["max_compute"] == r["recommended_max_compute"]]
        assert rec and rec[0]["tokens_per_s"] >= best * (1 - 0.005)
        # Ties go to the largest budget.
        assert all(
            c["max_compute"] <= rec[0]["max_compute"] for c in feasible if c["tokens_per_s"] >= best * 0.995
        )
        assert r["max_compute"] > 0 and not math.isnan(r["compute_fill"])
    assert result.row("equal_tokens", 4)["recommended_max_compute"] is None
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert {"meta", "buckets", "results", "internal_checks", "notes"} <= set(data)
    assert data["meta"]["machine"]["cpu_count"] >= 1 and data["meta"]["max_tokens"] == 450
    assert sum(b["share"] for b in data["buckets"]) == pytest.approx(1.0)
    for name in ("simulate_cv.png", "simulate_wait.png", "simulate_throughput.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "lockstep" in result.table()


def test_simulate_is_deterministic():
    settings = SimulateSettings(world_sizes=[2], max_tokens=450, min_steps_per_rank=8, recommend=False)
    a = simulate("tiny", settings, progress=False)
    b = simulate("tiny", settings, progress=False)
    assert [r["wait_share"] for r in a.rows] == [r["wait_share"] for r in b.rows]


def test_simulate_real_index_is_planned_as_is():
    rng = np.random.default_rng(0)
    choices = [(16, 1, 8, 12), (16, 5, 8, 12), (16, 9, 8, 12)]
    shards = []
    for k in range(8):
        shapes = [choices[i] for i in rng.integers(0, 3, size=30)]
        keys = [f"k{k}_{i}" for i in range(30)]
        shards.append(
            ShardInfo(path=f"s{k}.tar", keys=keys, latent_shapes=shapes, text_lengths=[0] * 30, num_bytes=-1)
        )
    index = ShardIndex(shards=shards)
    cm = CostModel(kind="quadratic", alpha=1e-3, beta=1e-6)
    settings = SimulateSettings(world_sizes=[2], max_tokens=240, recommend=False)
    result = simulate(index, settings, times=cm, progress=False)
    for r in result.rows:
        assert r["samples"] == index.num_samples == r["population_samples"]


def test_simulate_with_trace_and_given_p(tmp_path):
    path = tmp_path / "trace.jsonl"
    recs = []
    for t in (1, 3, 5, 9):
        for h, w in ((8, 12), (12, 8), (10, 10)):
            s = t * h * w // 4
            recs.append(
                {"T": t, "H": h, "W": w, "B": max(1, 450 // s), "ms": 5 + 0.05 * 450 + 1e-4 * s * 450}
            )
    _write_trace(path, recs)
    result = simulate(
        "tiny",
        SimulateSettings(world_sizes=[2], max_tokens=450, p=2.0, min_steps_per_rank=8, recommend=False),
        times=str(path),
        progress=False,
    )
    assert result.meta["plan_cost_model"] == {"kind": "power", "p": 2.0, "scale": 1.0}
    assert result.meta["times"]["source"] == str(path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_sizes=[1]), "world_sizes"),
        (dict(world_sizes=[2048]), "world_sizes"),
        (dict(variants=["nope"]), "variants: unknown variant"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_compute="fast"), "max_compute"),
        (dict(max_compute=-1.0), "max_compute"),
        (dict(step_overhead_s=-1.0), "step_overhead_s"),
        (dict(patch_size=(1, 2)), "patch_size"),
        (dict(min_steps_per_rank=0), "min_steps_per_rank"),
        (dict(shards_per_stream=0), "shards_per_stream"),
        (dict(max_candidates=0), "max_candidates"),
        (dict(num_workers=-1), "num_workers"),
        (dict(p=0.0), "p must be"),
        (dict(noise=-0.01), "noise must be"),
        (dict(noise=0.9), "noise must be"),
        (dict(noise=True), "noise must be"),
        (dict(noise_draws=0), "noise_draws"),
    ],
)
def test_simulate_settings_reject_each_bad_value_once(kwargs, match):
    # The one place a bad setting is rejected: SimulateSettings.__post_init__ (simulate() has no check of its own).
    with pytest.raises(ValueError, match=match) as err:
        SimulateSettings(**kwargs)
    assert err.traceback[-1].name == "__post_init__"
    assert repr(next(iter(kwargs.values()))) in str(err.value) or "unknown variant" in str(err.value)
    # simulate() takes them in its settings only, not as flat keywords.
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        simulate("tiny", progress=False, **kwargs)


def test_simulate_rejects_a_bucket_longer_than_max_tokens():
    with pytest.raises(ValueError, match="max_tokens=100"):  # the longest tiny bucket has 225 tokens
        simulate("tiny", SimulateSettings(max_tokens=100), progress=False)


def test_simulate_settings_are_frozen_keyword_only_and_normalised():
    settings = SimulateSettings(world_sizes=[8, 2, 8], variants=["lockstep", "dual"], patch_size=[1, 2, 2])
    assert settings.world_sizes == (2, 8) and settings.patch_size == (1, 2, 2)
    assert settings.variants_to_run == ["equal_tokens", "lockstep", "dual"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_tokens = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SimulateSettings([2])  # type: ignore[misc]  # keyword-only
    assert set(get_args(SimulateVariant)) == set(
        VARIANTS
    )  # the Literal lists exactly the simulator's variants
    # Each variant is a (schedule, sizing rule) pair.
    assert VARIANTS["lockstep"] == ("lockstep", "dual")
    assert VARIANTS["equal_tokens"] == ("independent", "equal_tokens")


# --------------------------------------------------------------------------------------------- the CLI


def test_cli_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(
        [
            "--mix", "tiny", "--world-sizes", "2,4", "--max-tokens", "450", "--min-steps-per-rank", "8",
            "--candidates", "3", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "equal_tokens" in printed and "lockstep" in printed
    data = json.loads((out / "simulate.json").read_text())
    assert data["meta"]["variants"] == ["equal_tokens", "dual", "lockstep"]
    assert {(r["variant"], r["world_size"]) for r in data["results"]} == {
        (m, w) for m in ("equal_tokens", "dual", "lockstep") for w in (2, 4)
    }
    assert all(os.path.getsize(out / f"simulate_{k}.png") > 1000 for k in ("cv", "wait", "throughput"))
    # The project's internal checks stay in the JSON, not in what a user reads (issue 60, item 4).
    assert "_le_" not in printed and "pct:" not in printed and "internal_checks" in data
    # The recommended budget comes with its cost model, as YAML that a recipe's data.init_args takes.
    import yaml

    from lightning_adaptiveload.planning.settings import Batching

    fragment = printed[printed.index("# recommended for ") :].split("\nwrote ")[0]
    pasted = yaml.safe_load(fragment)
    batching = Batching(**pasted["batching"])
    assert (
        batching.max_tokens == 450 and batching.cost_model["kind"] == data["meta"]["plan_cost_model"]["kind"]
    )
    recommended = [r["recommended_max_compute"] for r in data["results"] if r["recommended_max_compute"]]
    assert any(batching.max_compute == pytest.approx(r, rel=1e-5) for r in recommended)
    assert pasted["plan"]["schedule"] in ("independent", "lockstep", "packed")


def test_cli_bad_input_returns_2(tmp_path, capsys):
    assert main(["--mix", str(tmp_path / "missing.json"), "--out", str(tmp_path), "--no-progress"]) == 2
    assert "missing.json" in capsys.readouterr().err


_CONFIG_OF = {
    ("independent", "dual"): "dual",
    ("independent", "equal_tokens"): "equal_tokens",
    ("lockstep", "dual"): "lockstep",
    ("lockstep", "equal_tokens"): "lockstep_equal_tokens",
}


@pytest.mark.parametrize("sizings", [None, "dual", "equal_tokens", "dual,equal_tokens"])
@pytest.mark.parametrize("schedules", ["independent", "lockstep", "packed", "independent,lockstep,packed"])
def test_cli_runs_every_schedule_with_every_sizing_rule(tmp_path, capsys, schedules, sizings):
    # `--schedules packed` (alone or with others) raised KeyError: ('packed', 'dual') before.
    argv = [
        "--mix", "tiny", "--world-sizes", "2", "--max-tokens", "450", "--min-steps-per-rank", "8",
        "--candidates", "2", "--out", str(tmp_path), "--no-plots", "--no-progress", "--schedules", schedules,
    ]  # fmt: skip
    argv += [] if sizings is None else ["--modes", sizings]
    assert main(argv) == 0
    printed = capsys.readouterr()
    wanted = {"equal_tokens"}  # the reference of tokens_per_s_ratio, always simulated
    for schedule in schedules.split(","):
        for sizing in (sizings or "dual,equal_tokens").split(","):
            wanted.add("packed" if schedule == "packed" else _CONFIG_OF[(schedule, sizing)])
    rows = json.loads((tmp_path / "simulate.json").read_text())["results"]
    assert sorted(r["variant"] for r in rows) == sorted(wanted)  # packed once, whatever the sizing rules
    assert all(r["steps"] > 0 for r in rows)
    if "packed" in schedules:
        assert "packed = schedule packed (no batch sizing" in printed.out
        # An explicit --modes is said not to apply to the packed schedule; no note without one.
        assert ("does not apply to the packed schedule" in printed.err) == (sizings is not None)


def test_table_splits_schedule_and_sizing_and_gives_the_budget_unit():
    settings = SimulateSettings(
        world_sizes=[2], variants=["dual", "packed"], max_tokens=450, min_steps_per_rank=8, max_candidates=2
    )
    result = simulate("tiny", settings, progress=False)
    lines = result.table().splitlines()
    head = lines[0].split()
    assert head[:5] == ["config", "schedule", "sizing", "ranks", "steps"]
    assert "[s]" in lines[0]  # the budget's unit: p fitted to the step times, so seconds per batch
    rows = {line.split()[0]: line.split() for line in lines[2:] if line.split()[0] in ("dual", "packed")}
    assert rows["dual"][1:3] == ["independent", "dual"]
    assert rows["packed"][1:3] == ["packed", "-"]  # the packed schedule sizes no batches
    assert "seconds per batch" in lines[-1] and "cost_model" in lines[-1]
    assert result.meta["max_compute_unit"].startswith("seconds per batch")
    given_p = simulate(
        "tiny",
        SimulateSettings(
            world_sizes=[2], variants=["dual"], max_tokens=450, p=1.5, min_steps_per_rank=8, max_candidates=2
        ),
        progress=False,
    )
    assert "[token^p]" in given_p.table().splitlines()[0]


def test_cv_max_shows_the_few_steps_that_lift_the_mean_above_the_p95():
    # 100 steps, 4 unbalanced: the p95 is 0 and below the mean; the mean is right, the max shows why.
    t = np.ones((100, 2))
    t[[3, 40, 70, 99], 0] = 3.0
    m = balance_metrics(t, np.ones_like(t))
    assert m["cv_p95"] == 0.0 < m["cv_mean"] == pytest.approx(4 * 0.5 / 100)
    assert m["cv_max"] == pytest.approx(0.5)
    assert m["cv_max"] >= m["cv_p95"]


def test_packed_schedule_is_balanced_with_the_planning_cost_model():
    from lightning_adaptiveload.tools.replay import make_batcher

    cm = CostModel(kind="power", p=2.0)
    # The batcher built for packed (and lockstep_equal_tokens) carried the default cost model before.
    assert make_batcher("equal_tokens", 450, "auto", cm, (1, 2, 2)).cost_model == cm
    assert make_batcher("dual", 450, "auto", cm, (1, 2, 2)).cost_model == cm


def test_noise_draws_are_seeded_and_scale_each_rank_time():
    from lightning_adaptiveload.tools.replay import with_noise

    t = np.array([[1.0, 2.0], [3.0, 4.0]])
    a, b = with_noise(t, 0.02, 5), with_noise(t, 0.02, 5)
    assert a.shape == (5, 2, 2) and np.array_equal(a, b)  # seeded
    assert not np.array_equal(a, with_noise(t, 0.02, 5, seed=1))
    assert np.array_equal(with_noise(t, 0.0, 3), np.broadcast_to(t, (3, 2, 2)))
    rel = (with_noise(np.ones((4000, 8)), 0.02, 1)[0] - 1.0).ravel()
    assert abs(rel.std() - 0.02) < 0.001 and abs(rel.mean()) < 0.001
    assert (with_noise(np.ones((100, 4)), 0.5, 20) >= 0).all()  # never a negative time


def test_the_noise_floor_matches_the_two_rank_formula_and_grows_with_the_ranks():
    from lightning_adaptiveload.tools.replay import noise_floor

    # Two ranks: E|x1 - x2| / 2 over E max = sigma / sqrt(pi) (to first order in sigma).
    assert noise_floor(0.02, 2, draws=200_000) == pytest.approx(0.02 / math.sqrt(math.pi), rel=0.02)
    floors = [noise_floor(0.02, n) for n in (2, 4, 8, 16)]
    assert floors == sorted(floors) and noise_floor(0.0, 8) == 0.0


def test_noisy_balance_of_identical_work_is_the_noise_floor():
    from lightning_adaptiveload.tools.replay import noise_floor, noisy_balance

    t, tok = np.full((500, 4), 2.0), np.full((500, 4), 1000.0)
    exact = balance_metrics(t, tok)
    noisy = noisy_balance(t, tok, 0.03, draws=8)
    assert exact["straggler_wait"] == 0.0
    assert noisy["straggler_wait"] == pytest.approx(noise_floor(0.03, 4), rel=0.05)
    # A slower slowest rank: fewer tokens per second than the exact replay.
    assert noisy["tokens_per_s"] < exact["tokens_per_s"]
    assert noisy_balance(t, tok, 0.0, draws=2)["tokens_per_s"] == pytest.approx(exact["tokens_per_s"])
    # A step's time outside the ranks' compute (optimizer, all-reduce tail) counts in the wall time, unscaled.
    with_overhead = noisy_balance(t, tok, 0.0, draws=2, overhead_s=0.5)["tokens_per_s"]
    assert with_overhead == pytest.approx(tok.sum() / (500 * (2.0 + 0.5)))


def test_simulate_with_noise_adds_the_noisy_figures_and_leaves_the_exact_ones():
    base = dict(world_sizes=[2, 4], max_tokens=450, min_steps_per_rank=8, recommend=False)
    variants = ("equal_tokens", "lockstep", "packed")
    exact = simulate("tiny", SimulateSettings(**base, variants=variants), progress=False)
    noisy = simulate(
        "tiny", SimulateSettings(**base, variants=variants, noise=0.05, noise_draws=16), progress=False
    )
    assert all("wait_share_noise" not in r for r in exact.rows) and "wait+noise" not in exact.table()
    for e, n in zip(exact.rows, noisy.rows, strict=True):
        assert (e["variant"], e["world_size"]) == (n["variant"], n["world_size"])
        assert e["wait_share"] == n["wait_share"] and e["tokens_per_s"] == n["tokens_per_s"]
        assert n["noise"] == 0.05 and n["wait_share_noise"] > 0
    rows = {(r["variant"], r["world_size"]): r for r in noisy.rows}
    assert rows[("equal_tokens", 4)]["tokens_per_s_ratio_noise"] == 1.0
    # Balanced steps wait about the floor with noise, however little they wait without it.
    from lightning_adaptiveload.tools.replay import noise_floor

    assert rows[("packed", 4)]["wait_share_noise"] >= 0.5 * noise_floor(0.05, 4)
    assert "wait+noise" in noisy.table() and noisy.meta["noise"] == 0.05 and noisy.meta["noise_draws"] == 16
    again = simulate(
        "tiny", SimulateSettings(**base, variants=variants, noise=0.05, noise_draws=16), progress=False
    )
    assert [r["wait_share_noise"] for r in again.rows] == [r["wait_share_noise"] for r in noisy.rows]


def test_cli_noise_flag_reaches_the_rows(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(
        [
            "--mix", "tiny", "--world-sizes", "2", "--max-tokens", "450", "--min-steps-per-rank", "8",
            "--no-recommend", "--noise", "0.02", "--out", str(out), "--no-progress", "--no-plots",
        ]
    )  # fmt: skip
    assert rc == 0 and "wait+noise" in capsys.readouterr().out
    data = json.loads((out / "simulate.json").read_text())
    assert all(r["noise"] == 0.02 and "wait_share_noise" in r for r in data["results"])
    assert main(["--mix", "tiny", "--noise", "2", "--out", str(out), "--no-progress"]) == 2
    assert "noise must be" in capsys.readouterr().err

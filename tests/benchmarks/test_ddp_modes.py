"""``benchmarks/balance/ddp_modes.py`` (commands of every mode and setting) and ``benchmarks/balance/ddp_modes_report.py``
(its tables from monitor CSVs, packs priced by the pack cost model), on CPU with fabricated runs."""

import json
import math
import os
import shlex
import sys

import numpy as np
import pytest
from _paths import ROOT

from lightning_adaptiveload import stats
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.settings import PlanSettings

BENCH = str(ROOT / "benchmarks" / "balance")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(BENCH)))
MODES = ("equal_tokens", "dual", "lockstep", "packed")

# The fabricated runs: bucketed steps take TRUTH's time, packs 10% more (the packed path's own cost), every
# step has OVERHEAD seconds of optimizer and data, and each rank measures half its true wait (plus a tail),
# so that a report reading sync_wait_s gives half the wait derived from the compute times.
TRUTH = CostModel(kind="quadratic", alpha=1e-3, beta=2e-6, c0=0.05)
PACK_SLOWDOWN = 1.1
OVERHEAD = 0.02
TAIL = 0.004
PLAN_COST = CostModel(kind="quadratic", alpha=2e-3, beta=3e-6)  # the planner's model, other units
MAX_TOKENS, WORLD, WORKERS = 512, 2, 2


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import ddp_modes
    import ddp_modes_report

    return ddp_modes, ddp_modes_report


@pytest.fixture
def parts(bench):
    """The report's two halves: the measured figures and the simulation."""
    import ddp_modes_runs
    import ddp_modes_sim

    return ddp_modes_runs, ddp_modes_sim


# ----------------------------------------------------------------------------------------- ddp_modes.py


def _dry_run(ddp_modes, capsys, settings, tmp_path):
    assert (
        ddp_modes.main(["--dry-run", "--settings", settings, "--devices", "4", "--out", str(tmp_path)]) == 0
    )
    lines = [ln[2:] for ln in capsys.readouterr().out.splitlines() if ln.startswith("$ ")]
    assert len(lines) == 4
    out = {}
    for mode, line in zip(MODES, lines):
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        args = dict(zip(words[4::2], words[5::2]))  # after: python -m lightning_adaptiveload fit
        assert words[1:4] == ["-m", "lightning_adaptiveload", "fit"] and len(words[4:]) % 2 == 0
        out[mode] = (env, words, args)
    return out


def test_dry_run_prints_one_command_per_mode_with_the_same_budget(bench, capsys, tmp_path):
    ddp_modes, _ = bench
    for settings in ("eager", "fast"):
        runs = _dry_run(ddp_modes, capsys, settings, tmp_path)
        for mode, (env, _, args) in runs.items():
            assert (
                args["--data.init_args.batching.max_tokens"] == "32760" and args["--trainer.devices"] == "4"
            )
            assert os.path.isfile(args["--config"])
            assert (args["--data.init_args.batching.sizing"], args["--data.init_args.plan.schedule"]) == {
                "equal_tokens": ("equal_tokens", "independent"),
                "dual": ("dual", "independent"),
                "lockstep": ("dual", "lockstep"),
                "packed": ("equal_tokens", "packed"),
            }[mode]
            # The data folder is named by what the data depends on, never by the steps or the mode.
            assert (
                os.path.basename(args["--data.init_args.train_shards"])
                == "wan21_480p_n768_seed0_text64-512x4096"
            )
            assert env == {}  # the recipes set the allocator themselves
            if settings == "fast":  # the recipe as shipped
                assert not any(k.startswith("--model.") for k in args)
            else:
                assert args["--model.init_args.compile"] == "false"
                assert args["--model.init_args.optimizer.weight_dtype"] == "fp32"
                memory = json.loads(args["--model.init_args.memory"])
                assert memory["checkpoint_policy"] == "full" and memory["expandable_segments"] is False


def test_whole_epochs_replace_the_step_count(bench, capsys, tmp_path):
    """--epochs 1: every mode runs one whole epoch (the same samples), not --steps steps; 0 is refused."""
    ddp_modes, _ = bench
    argv = ["--dry-run", "--devices", "2", "--out", str(tmp_path), "--modes", "packed"]
    assert ddp_modes.main([*argv, "--epochs", "1", "--steps", "70"]) == 0
    (line,) = [ln[2:] for ln in capsys.readouterr().out.splitlines() if ln.startswith("$ ")]
    args = dict(zip(shlex.split(line)[4::2], shlex.split(line)[5::2]))
    assert (args["--trainer.max_steps"], args["--trainer.max_epochs"]) == ("-1", "1")
    assert ddp_modes.main([*argv, "--steps", "70"]) == 0
    (line,) = [ln[2:] for ln in capsys.readouterr().out.splitlines() if ln.startswith("$ ")]
    args = dict(zip(shlex.split(line)[4::2], shlex.split(line)[5::2]))
    assert (args["--trainer.max_steps"], args["--trainer.max_epochs"]) == ("70", "-1")
    assert ddp_modes.main([*argv, "--epochs", "0"]) == 2
    assert "--epochs 0" in capsys.readouterr().err


@pytest.mark.parametrize("settings", ("eager", "fast"))
def test_every_command_parses_in_the_cli(bench, capsys, tmp_path, monkeypatch, settings):
    """Every mode's command of both settings parses: LightningCLI's --print_config checks keys and types."""
    import yaml

    from lightning_adaptiveload.cli.fit import build_cli

    ddp_modes, _ = bench
    monkeypatch.setattr(sys, "argv", ["lightning-adaptiveload"])  # the command line is `args`, not pytest's
    for mode, (_, words, _) in _dry_run(ddp_modes, capsys, settings, tmp_path).items():
        with pytest.raises(SystemExit) as done:
            build_cli(args=[*words[3:], "--trainer.max_time", "00:00:05:00", "--print_config"])
        assert done.value.code in (0, None)
        cfg = yaml.safe_load(capsys.readouterr().out)
        model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
        optimizer, memory = model["optimizer"], model["memory"]
        assert (
            data["batching"]["max_tokens"] == 32760
            and data["synthetic"] is None
            and data["val_shards"] is None
        )
        assert data["plan"]["schedule"] == {"packed": "packed", "lockstep": "lockstep"}.get(
            mode, "independent"
        )
        assert data["batching"]["sizing"] == ("dual" if mode in ("dual", "lockstep") else "equal_tokens")
        assert cfg["trainer"]["max_time"] == "00:00:05:00" and str(cfg["trainer"]["devices"]) == "4"
        if settings == "eager":  # the eager variant, as overrides of the recipe
            assert model["compile"] is False and optimizer["weight_dtype"] == "fp32"
            assert memory["checkpoint_blocks"] is None and memory["activation_checkpointing"] is True
            assert memory["checkpoint_policy"] == "full" and memory["expandable_segments"] is False
            assert model["attention_backend"] == "default"
        else:  # the recipe's own model settings: fast by default
            assert model["compile"] is True and optimizer["weight_dtype"] == "bf16"
            assert memory["checkpoint_blocks"] == "auto" and memory["checkpoint_policy"] == "save_matmuls"
            assert model["attention_backend"] == "auto" and memory["expandable_segments"] is True
            assert memory["activation_memory"]["num_blocks"] == 30
    # The check has teeth: a misspelt key of the same command is refused (not a prefix: argparse takes
    # an abbreviation of an option, `weight_dtyp`, as the option).
    with pytest.raises(Exception, match="weight_dtpye") as bad:
        build_cli(args=[*words[3:], "--model.init_args.optimizer.weight_dtpye", "bf16", "--print_config"])
    assert not isinstance(bad.value, SystemExit)


def test_activation_memory_from_a_calibration_fragment(bench, tmp_path):
    ddp_modes, _ = bench
    frag = tmp_path / "calib.yaml"
    frag.write_text(
        "model:\n  init_args:\n    activation_memory:\n      num_blocks: 30\n      base_bytes: 1.0\n"
    )
    assert ddp_modes.load_activation_memory(str(frag)) == {"num_blocks": 30, "base_bytes": 1.0}
    assert ddp_modes.load_activation_memory('{"num_blocks": 2}') == {"num_blocks": 2}
    old = tmp_path / "old.yaml"  # a fragment of an earlier release: flat model.init_args
    old.write_text("model:\n  init_args:\n    activation_memory:\n      num_blocks: 3\n")
    assert ddp_modes.load_activation_memory(str(old)) == {"num_blocks": 3}
    with pytest.raises(ValueError, match="no model.init_args.memory.activation_memory"):
        (tmp_path / "empty.yaml").write_text("data: {}\n")
        ddp_modes.load_activation_memory(str(tmp_path / "empty.yaml"))


def test_shards_are_reused_and_deterministic(bench, tmp_path):
    ddp_modes, _ = bench
    first, reused = ddp_modes.make_shards(str(tmp_path / "a"), 12, "tiny", 8, seed=3)
    assert not reused
    again, reused = ddp_modes.make_shards(str(tmp_path / "a"), 12, "tiny", 8, seed=3)
    assert reused and again == first
    other, _ = ddp_modes.make_shards(str(tmp_path / "b"), 12, "tiny", 8, seed=3)
    shards = [json.load(open(p))["shards"] for p in (first, other)]
    assert [s["latent_shapes"] for s in shards[0]] == [s["latent_shapes"] for s in shards[1]]
    for a, b in zip(*shards):  # the same bytes: the same latents and text states
        pa, pb = (os.path.join(os.path.dirname(p), s["path"]) for p, s in ((first, a), (other, b)))
        assert open(pa, "rb").read() == open(pb, "rb").read()


def test_unknown_mode_is_refused(bench, capsys):
    ddp_modes, _ = bench
    assert ddp_modes.main(["--dry-run", "--modes", "packd"]) == 2
    assert "unknown mode(s) ['packd']" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- ddp_modes_report.py


def _tokens(shape):
    return int(shape[1] * (shape[2] // 2) * (shape[3] // 2))


def _fabricate(run, index, mode, steps_wanted=None):
    """A monitor CSV, config.yaml and metrics.csv of ``mode`` over the planned epoch 0 (see the constants)."""
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.tools.replay import VARIANTS as SIM_MODES
    from lightning_adaptiveload.tools.replay import make_batcher

    schedule, batching = SIM_MODES[mode]
    batcher = make_batcher(batching, MAX_TOKENS, "auto", PLAN_COST, (1, 2, 2))
    plan = plan_epoch(
        index, WORLD, WORKERS, batcher, 0, 0, settings=PlanSettings(schedule=schedule, lockstep_tail="packed")
    )
    steps = plan.steps if steps_wanted is None else min(steps_wanted, plan.steps)
    folder = run / mode / "lightning_logs" / "version_0"
    folder.mkdir(parents=True)
    head = (
        "rank,batch_idx,step,cost,num_tokens,batch_size,seq_len,flops,compute_time_s,sync_wait_s,step_time_s,"
        "iter_time_s,data_time_s,peak_allocated_bytes,peak_reserved_bytes,alloc_retries,ooms,flops_counted,"
        "backward_timed"
    )
    lines, truth = [head], {"compute": [], "cost": [], "tokens": [], "sync": [], "pack": [], "flops": []}
    for k in range(steps):
        comp, cost, toks, pack, flops = [], [], [], [], []
        for r in range(WORLD):
            w, j = plan.step_order[r][k]
            lens = [_tokens(index.shards[s].latent_shapes[i]) for s, i in plan.streams[(r, w)][j]]
            mixed = len(set(lens)) > 1
            is_pack = mode == "packed" or mixed
            comp.append(TRUTH.pack_cost(lens) * (PACK_SLOWDOWN if is_pack else 1.0))
            cost.append(PLAN_COST.pack_cost(lens))
            toks.append((len(lens), sum(lens), max(lens)))
            pack.append(is_pack)
            flops.append(1e9 * sum(lens) + 4e6 * sum(n * n for n in lens))  # a model's: linear + attention
        top = max(comp)
        sync = [0.5 * (top - c) + TAIL for c in comp]
        for r in range(WORLD):
            n, total, longest = toks[r]
            wall = top + OVERHEAD
            lines.append(
                f"{r},{k},{k + 1},{cost[r]!r},{total},{n},{longest},{flops[r]!r},{comp[r]!r},{sync[r]!r},{wall!r},{wall!r},"
                f"0.001,{2**30},{2**30},0,0,0,1"
            )
        for key, v in (
            ("compute", comp),
            ("cost", cost),
            ("tokens", [t[1] for t in toks]),
            ("sync", sync),
            ("flops", flops),
        ):
            truth[key].append(v)
        truth["pack"].append(pack)
    (folder / "load_balance_ranks.csv").write_text("\n".join(lines) + "\n")
    plan_cost = {"kind": "quadratic", "alpha": PLAN_COST.alpha, "beta": PLAN_COST.beta, "gamma": 0.0}
    config = {
        "model": {"init_args": {"compile": False}},
        "data": {
            "init_args": {
                "max_tokens": MAX_TOKENS,
                "max_compute": "auto",
                "cost_model": plan_cost,
                "mode": batching,
                "schedule": schedule,
                "num_workers": WORKERS,
                "seed": 0,
                "patch_size": [1, 2, 2],
                "lockstep_tail": "packed",
                "lockstep_tolerance": 0.05,
                "max_buffered_samples": None,
            }
        },
    }
    import yaml

    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    loss = "\n".join(f"{k},{2.0 - 0.01 * k}" for k in range(steps))
    (folder / "metrics.csv").write_text("step,train/loss_step\n" + loss + "\n")
    return {k: np.asarray(v, dtype=float) for k, v in truth.items()}


@pytest.fixture
def fabricated(tmp_path, bench):
    ddp_modes, _ = bench
    index_path, _ = ddp_modes.make_shards(str(tmp_path / "data"), 160, "tiny", 8, seed=0)
    from lightning_adaptiveload.shards.index import ShardIndex

    index = ShardIndex.load(index_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "data_index.json").write_text(open(index_path).read())
    truth = {mode: _fabricate(run, index, mode) for mode in MODES}
    meta = {"settings": "eager", "devices": WORLD, "max_tokens": MAX_TOKENS, "mix": "tiny", "samples": 160}
    meta["runs"] = [{"mode": m, "rc": 0} for m in MODES]
    meta["steps"] = 60
    (run / "runs_eager_all.json").write_text(json.dumps(meta))
    return run, truth


def test_report_rows_measured_packs_priced_by_the_pack_model(bench, fabricated, tmp_path, capsys):
    _, report = bench
    run, truth = fabricated
    warmup = 2
    rc = report.main(
        [
            str(run),
            "--warmup",
            str(warmup),
            "--results",
            str(tmp_path / "res"),
            "--img",
            str(tmp_path / "img"),
            "--simulate",
            "",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "MEASURED beside SIMULATED" in text and "SIM. x equal_tokens" in text
    (out,) = (tmp_path / "res").glob("ddp_modes_eager_w2_*.json")
    data = json.loads(out.read_text())
    assert set(data["modes"]) == set(MODES)
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        f"ddp_eager_w2_{k}.png" for k in ("cv", "loss", "step_time", "throughput")
    ]
    for mode in MODES:
        s, t = data["modes"][mode], truth[mode]
        comp, sync = t["compute"][warmup:], t["sync"][warmup:]
        assert s["steps_used"] == len(comp)
        wall = comp.max(axis=1) + OVERHEAD
        assert s["tokens_per_s"] == pytest.approx(t["tokens"][warmup:].sum() / wall.sum(), rel=1e-9)
        flop_rate = t["flops"][warmup:].sum() / wall.sum() / WORLD / 1e12
        assert s["model_tflops_per_gpu"] == pytest.approx(flop_rate, rel=1e-9)
        assert s["straggler_wait"] == pytest.approx(stats.straggler_wait(comp), rel=1e-9)
        # Read from sync_wait_s (half the true wait by construction), not derived from the compute times.
        top = comp.max(axis=1)
        expected = np.average((sync - sync.min(axis=1, keepdims=True)).mean(axis=1) / top, weights=top)
        assert s["measured_straggler_wait"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert s["measured_straggler_wait"] == pytest.approx(0.5 * s["straggler_wait"], rel=1e-6, abs=1e-12)
        assert s["planner_straggler_wait"] == pytest.approx(
            stats.straggler_wait(t["cost"][warmup:]), rel=1e-9
        )
        assert s["pack_steps"] == int(t["pack"][warmup:].any(axis=1).sum())
        sim = data["simulated_same_settings"][mode]
        assert sim["plan_match"] == 1.0 and sim["steps"] == len(comp)
    base = data["modes"]["equal_tokens"]["model_tflops_per_gpu"]
    for mode in MODES:
        s = data["modes"][mode]
        assert s["flop_rate_ratio"] == pytest.approx(s["model_tflops_per_gpu"] / base, rel=1e-12)
        epoch = data["simulated_same_settings"][mode]["tokens_per_s_epoch0"]
        base_epoch = data["simulated_same_settings"]["equal_tokens"]["tokens_per_s_epoch0"]
        assert s["sim_ratio_epoch"] == pytest.approx(epoch / base_epoch, rel=1e-12)
    assert "x equal_tokens by tokens/s, by model FLOP rate" in text
    assert data["modes"]["packed"]["pack_steps"] == data["modes"]["packed"]["steps_used"]
    assert data["modes"]["equal_tokens"]["pack_steps"] == 0
    # The pack model is fitted to the measured packs: it recovers the packed path's own cost (10% over the
    # bucketed one), not the bucketed steps' fit.
    pack = data["simulation_times"]["pack_model"]
    assert pack["source"] == "fitted to this run's packs" and pack["sum_sq_estimated"] == 0
    assert pack["model"]["c0"] == pytest.approx(PACK_SLOWDOWN * TRUTH.c0, rel=1e-6)
    assert pack["model"]["alpha"] == pytest.approx(PACK_SLOWDOWN * TRUTH.alpha, rel=1e-6)
    assert pack["model"]["beta"] == pytest.approx(PACK_SLOWDOWN * TRUTH.beta, rel=1e-6)
    # So the simulation of the same settings gives the measured figures of the bucketed and packed runs.
    for mode in ("equal_tokens", "dual", "packed"):
        s = data["modes"][mode]
        assert s["sim_tokens_per_s"] == pytest.approx(s["tokens_per_s"], rel=1e-6), mode
        assert s["sim_wait"] == pytest.approx(s["straggler_wait"], rel=1e-6, abs=1e-12), mode
    # The mixed packs of lockstep's tail were left out of the bucket table.
    assert data["simulation_times"]["table"]["skipped_packs"] >= 0
    gain = data["checks"]["lockstep_gain"]
    w = data["modes"]["equal_tokens"]["measured_straggler_wait"]
    assert gain["gain_if_all_measured_wait_removed"] == pytest.approx(1 / (1 - w) - 1)
    assert "equal_tokens_planner_vs_monitor" in data["checks"]
    assert "issue36_targets" in data["checks"] and "sim_ratio_within_5pct" in data["checks"]


def test_a_nan_loss_is_said_and_voids_the_targets(bench, fabricated, tmp_path, capsys):
    # The 2 x H200 packed run of 2026-11-27 went NaN at step 3; the report had dropped the NaNs from its loss
    # plot without a word and printed issue 36's targets as met.
    _, report = bench
    run, _ = fabricated
    (metrics,) = (run / "packed").rglob("metrics.csv")
    lines = metrics.read_text().splitlines()
    lines[4:] = [f"{line.split(',')[0]},nan" for line in lines[4:]]
    metrics.write_text("\n".join(lines) + "\n")
    rc = report.main(
        [str(run), "--results", str(tmp_path / "res"), "--img", str(tmp_path / "img"), "--simulate", ""]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "packed: the training loss is not finite from step 3" in text
    (out,) = (tmp_path / "res").glob("ddp_modes_eager_w2_*.json")
    data = json.loads(out.read_text())
    assert data["modes"]["packed"]["loss_nonfinite_from_step"] == 3
    assert data["modes"]["equal_tokens"]["loss_nonfinite_from_step"] is None
    assert data["checks"]["issue36_targets_apply"] is False
    assert "NOT its acceptance run: 2 GPUs, settings eager, packed's loss not finite" in text


def test_calibrate_on_some_modes_predicts_the_others(bench, fabricated, tmp_path, capsys):
    _, report = bench
    run, _ = fabricated
    common = [str(run), "--results", str(tmp_path / "res"), "--img", str(tmp_path / "img"), "--simulate", ""]
    assert report.main([*common, "--calibrate-on", "equal_tokens,lockstep"]) == 0
    text = capsys.readouterr().out
    assert (
        "SIM. calibrated on equal_tokens, lockstep only: for the other modes it is an out-of-sample" in text
    )
    (out,) = (tmp_path / "res").glob("ddp_modes_eager_w2_*.json")
    data = json.loads(out.read_text())
    pack = data["simulation_times"]["pack_model"]
    assert pack["source"] == "the per-step model fitted to the bucketed steps of equal_tokens, lockstep"
    # The fabricated packs cost 10% more than the bucketed steps' model: an out-of-sample prediction sees
    # packed faster than measured, where the run's own pack fit matches it.
    assert data["modes"]["packed"]["sim_tokens_per_s"] > 1.03 * data["modes"]["packed"]["tokens_per_s"]
    assert report.main([*common, "--calibrate-on", "equal_tokens,nope"]) == 2
    assert "not among the runs' modes" in capsys.readouterr().err


def test_square_sums_recover_a_pack_from_the_planner_cost(bench, parts):
    runs, _ = parts
    packs = [[216, 24, 24], [120, 120], [72, 24, 24, 24, 24], [216]]
    ranks = {
        "batch_size": np.array([[len(p) for p in packs]], dtype=float),
        "num_tokens": np.array([[sum(p) for p in packs]], dtype=float),
        "seq_len": np.array([[max(p) for p in packs]], dtype=float),
        "cost": np.array([[PLAN_COST.pack_cost(p) for p in packs]]),
    }
    got, exact = runs.square_sums(ranks, PLAN_COST)
    assert exact.all()
    assert got[0] == pytest.approx([sum(s * s for s in p) for p in packs], rel=1e-9)
    # A power-law planner model cannot be inverted: the longest sample plus equal others stands in.
    got, exact = runs.square_sums(ranks, CostModel(kind="power", p=1.5))
    assert exact.tolist() == [[False, True, False, True]]
    assert got[0][0] == 216**2 + 2 * 24**2 and math.isclose(got[0][2], 72**2 + 4 * 24**2)


def test_monitor_csv_table_leaves_mixed_packs_out(tmp_path):
    from lightning_adaptiveload.tools.step_times import StepTimeTable

    path = tmp_path / "load_balance_ranks.csv"
    rows = ["rank,batch_idx,seq_len,batch_size,num_tokens,compute_time_s"]
    rows += [f"0,{k},24,4,96,0.5" for k in range(4)]  # a bucket: 4 x 24 tokens
    rows += [f"1,{k},216,3,264,9.0" for k in range(4)]  # a pack: 216 + 24 + 24 tokens
    path.write_text("\n".join(rows) + "\n")
    table = StepTimeTable.from_monitor_csv(path, [(16, 1, 8, 12), (16, 9, 8, 12)], warmup_steps=0)
    assert table.seconds == {(1, 8, 12): {4: 0.5}} and table.skipped_packs == 4
    model = CostModel(kind="quadratic", alpha=1.0, beta=0.0, c0=2.0)
    table.pack_model = model
    assert table.pack_cost_model is model and table.to_dict()["pack_model"]["c0"] == 2.0


def test_monitor_csv_table_leaves_excluded_steps_out(tmp_path):
    from lightning_adaptiveload.tools.step_times import StepTimeTable

    path = tmp_path / "load_balance_ranks.csv"
    rows = ["rank,batch_idx,seq_len,batch_size,num_tokens,compute_time_s"]
    # a rare bucket: two steps, one of them a 20 s stall; the median of both would be 10.25 s
    rows += ["0,0,24,4,96,0.5", "0,1,24,4,96,20.0"]
    path.write_text("\n".join(rows) + "\n")
    shapes = [(16, 1, 8, 12)]
    kept = StepTimeTable.from_monitor_csv(path, shapes, warmup_steps=0)
    assert kept.seconds == {(1, 8, 12): {4: 10.25}}
    cleaned = StepTimeTable.from_monitor_csv(path, shapes, warmup_steps=0, exclude={str(path): [1]})
    assert cleaned.seconds == {(1, 8, 12): {4: 0.5}}


def test_the_simulator_is_calibrated_without_stalls(bench, parts):
    runs, _ = parts
    comp = np.array([[2.0, 2.0]] * 8)
    comp[6] = [19.0, 19.5]  # both ranks stalled
    tok = np.full_like(comp, 32760.0)
    ranks = {"compute_time_s": comp, "num_tokens": tok}
    assert runs.calibration_steps(ranks, warmup=2).tolist() == [False] * 2 + [True] * 4 + [False, True]


def test_fit_pack_sums_equals_fit_packs():
    packs = [[1560], [1560] * 21, [32760], [32760, 1560, 1560], [14040, 7800, 7800, 1560]]
    seconds = [
        CostModel(alpha=3e-5, beta=1.5e-9, c0=0.3).pack_cost(p) * (1 + 0.01 * k) for k, p in enumerate(packs)
    ]
    a = CostModel.fit_packs(packs, seconds)
    b = CostModel.fit_pack_sums(
        [len(p) for p in packs], [sum(p) for p in packs], [sum(s * s for s in p) for p in packs], seconds
    )
    assert a == b and a.fit_info == pytest.approx(b.fit_info)
    with pytest.raises(ValueError, match="square_sums must be positive"):
        CostModel.fit_pack_sums([1, 1, 1], [1, 2, 3], [1, 0, 9], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("mode", MODES)
def test_the_report_replays_the_batches_the_data_module_yields(bench, tmp_path, mode):
    """The simulator's plan (what the report prices) is each rank's plan in the DataModule's loader."""
    from lightning_adaptiveload.loading.loader import PlannedShardDataset
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.shards.index import ShardIndex
    from lightning_adaptiveload.tools.replay import VARIANTS as SIM_MODES
    from lightning_adaptiveload.tools.replay import make_batcher

    ddp_modes, _ = bench
    index = ShardIndex.load(ddp_modes.make_shards(str(tmp_path), 120, "tiny", 8, seed=0)[0])
    schedule, batching = SIM_MODES[mode]
    for epoch in (0, 1):
        ref = plan_epoch(
            index,
            WORLD,
            WORKERS,
            make_batcher(batching, MAX_TOKENS, "auto", PLAN_COST, (1, 2, 2)),
            0,
            epoch,
            settings=PlanSettings(schedule=schedule),
        )
        for rank in range(WORLD):
            ds = PlannedShardDataset(
                index,
                make_batcher(batching, MAX_TOKENS, "auto", PLAN_COST, (1, 2, 2)),
                num_workers=WORKERS,
                # chunk_samples: the DataModule's default plan_chunk_samples
                settings=PlanSettings(schedule=schedule, chunk_samples=500_000),
                placement=(rank, WORLD),
            )
            plan = ds.make_plan(epoch, local=True)
            assert [plan.streams[(rank, w)][j] for w, j in plan.step_order[rank]] == [
                ref.streams[(rank, w)][j] for w, j in ref.step_order[rank]
            ]


def test_a_simulation_that_cannot_fit_is_said_not_raised(bench, fabricated, tmp_path, capsys, monkeypatch):
    # Run 46 (4 x H100, fast settings): steps dominated by compile stalls fit no cost model, and the report
    # crashed in its more-ranks simulation after printing the tables, losing its JSON.
    _, report = bench
    run, _ = fabricated

    def no_fit(*args, **kwargs):
        raise ValueError("the power fit gives exponent p = -2.055 <= 0 (time falls with length)")

    monkeypatch.setattr(report, "simulate_more_ranks", no_fit)
    rc = report.main(
        [str(run), "--results", str(tmp_path / "res"), "--img", str(tmp_path / "img"), "--simulate", "8"]
    )
    assert rc == 0
    assert "no simulation at 8 ranks: ValueError: the power fit" in capsys.readouterr().out
    (out,) = (tmp_path / "res").glob("ddp_modes_eager_w2_*.json")
    assert json.loads(out.read_text())["simulated_more_ranks"]["error"].startswith("ValueError")


def test_stalls_are_counted_and_left_out_only_of_the_no_stall_figure(bench, parts):
    runs, _ = parts
    # 2 ranks, 8 steps: a clip takes 2 s, a small image batch 0.4 s (more per token, not a stall), and
    # step 5 has one rank stuck for 20 s (a compile the monitor did not see).
    comp = np.array([[2.0, 2.0]] * 8)
    tok = np.array([[32760.0, 32760.0]] * 8)
    comp[3], tok[3] = [2.0, 0.4], [32760.0, 1560.0]
    comp[5, 1] = 20.0
    ranks = {
        "compute_time_s": comp,
        "num_tokens": tok,
        "batch_size": np.ones_like(comp),
        "seq_len": tok.copy(),
        "iter_time_s": comp.max(axis=1, keepdims=True).repeat(2, axis=1) + 0.05,
        "step_time_s": comp.max(axis=1, keepdims=True).repeat(2, axis=1) + 0.05,
        "peak_allocated_bytes": np.full_like(comp, 1e9),
    }
    keep = runs.kept_steps(ranks, warmup=1)
    stalls = runs.stall_steps(ranks, keep)
    assert stalls.tolist() == [False, False, False, False, False, True, False, False]
    s = runs.mode_summary(ranks, warmup=1, device_total=None)
    assert s["stall_steps"] == 1 and s["stall_wall_s"] == pytest.approx(20.05)
    assert s["steps_used"] == 7  # the stall stays in the figures over all kept steps
    all_tok = tok[1:].sum() / (comp[1:].max(axis=1) + 0.05).sum()
    steady = [1, 2, 3, 4, 6, 7]
    assert s["tokens_per_s"] == pytest.approx(all_tok)
    steady_tokens_per_s = tok[steady].sum() / (comp[steady].max(axis=1) + 0.05).sum()
    assert s["tokens_per_s_no_stalls"] == pytest.approx(steady_tokens_per_s)


def test_the_noise_floor_is_the_wait_of_identical_work_only(bench, parts):
    runs, sim = parts
    # 4 ranks, 30 steps. Even steps: every rank runs one 32,760-token clip, one rank 5% slower (noise).
    # Odd steps: rank 0 runs a shorter clip, so its time differs by work, and those steps are no floor.
    rng = np.random.default_rng(0)
    steps, world = 30, 4
    tok = np.full((steps, world), 32760.0)
    tok[1::2, 0] = 20280.0
    comp = 2.0 * tok / 32760.0
    comp[0::2, 3] *= 1.05
    comp[1::2] *= 1.0 + 0.001 * rng.random((steps // 2, world))
    ranks = {
        "compute_time_s": comp,
        "num_tokens": tok,
        "batch_size": np.ones_like(comp),
        "seq_len": tok.copy(),
        "iter_time_s": comp.max(axis=1, keepdims=True).repeat(world, axis=1) + 0.05,
        "step_time_s": comp.max(axis=1, keepdims=True).repeat(world, axis=1) + 0.05,
        "peak_allocated_bytes": np.full_like(comp, 1e9),
    }
    keep = runs.kept_steps(ranks, warmup=2)
    same = runs.identical_work_steps(ranks, keep)
    assert same.tolist() == [i >= 2 and i % 2 == 0 for i in range(steps)]
    s = runs.mode_summary(ranks, warmup=2, device_total=None)
    assert s["identical_work_steps"] == 14
    assert s["identical_work_wait"] == pytest.approx(stats.straggler_wait(comp[2::2]))
    assert s["identical_work_wait"] == pytest.approx((2.1 - 2.025) / 2.1)
    assert s["straggler_wait"] > s["identical_work_wait"]  # the odd steps' wait is work, not noise
    even = comp[2::2]
    assert s["identical_work_noise"] == pytest.approx(np.mean(even.std(axis=1, ddof=1) / even.mean(axis=1)))
    other = {"summary": {"identical_work_noise": 0.04, "identical_work_steps": 42}}
    pooled = sim.pooled_noise({"a": {"summary": s}, "b": other, "c": {"summary": {}}})
    assert pooled == pytest.approx((14 * s["identical_work_noise"] + 42 * 0.04) / 56)
    # Under 10 such steps there is no floor to give.
    s = runs.mode_summary(ranks, warmup=12, device_total=None)
    assert s["identical_work_steps"] == 9 and math.isnan(s["identical_work_wait"])
    assert math.isnan(s["identical_work_noise"]) and math.isnan(sim.pooled_noise({"a": {"summary": s}}))


def test_the_whole_epoch_ratio_is_the_window_ratio_when_the_window_is_the_epoch(bench, fabricated, tmp_path):
    """The runs measured every step of epoch 0 (no warm-up left out): the simulator's whole-epoch ratio and its
    ratio over the measured steps are one figure; with a warm-up left out they are not."""
    _, report = bench
    run, truth = fabricated
    ratios = {}
    for warmup in (0, 6):
        res = tmp_path / f"res{warmup}"
        args = [str(run), "--warmup", str(warmup), "--results", str(res), "--img", str(tmp_path / "img")]
        assert report.main([*args, "--simulate", ""]) == 0
        (out,) = res.glob("ddp_modes_*.json")
        data = json.loads(out.read_text())
        ratios[warmup] = {m: (v["sim_ratio"], v["sim_ratio_epoch"]) for m, v in data["modes"].items()}
    for mode, (window, epoch) in ratios[0].items():
        assert window == pytest.approx(epoch, rel=1e-12), mode
    steps = {m: v["sim_epoch0_steps"] for m, v in data["modes"].items()}
    assert steps == {m: int(truth[m]["compute"].shape[0]) for m in MODES}  # the fabricated runs ran epoch 0
    assert any(abs(w / e - 1) > 1e-6 for w, e in ratios[6].values())
    # The whole epoch does not depend on the steps left out.
    for mode in ratios[0]:
        assert ratios[6][mode][1] == pytest.approx(ratios[0][mode][1], rel=1e-12)

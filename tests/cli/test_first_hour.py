"""The first hour of a new user: errors that name their cause and are shown last, runs that say where their
output went, and recipes that ship in the wheel (issue 20)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from _paths import ROOT, TESTS
from _timing import scaled

from lightning_adaptiveload.cli import main as cli
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")
# A short 2-process CPU DDP run of the quickstart recipe, without validation data.
SHORT = [
    "--trainer.max_steps=2",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.val_shards=null",
    "--data.init_args.synthetic.num_samples=64",
]


def _run_cli(args, cwd, timeout=240, pythonpath=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        cwd=cwd,
        env=env,
    )


def _last_error_block(proc) -> str:
    """The final block the CLI prints for a failed run (stderr's last lines), asserting it is last."""
    tail = proc.stderr.rstrip().splitlines()
    assert len(tail) >= 2, proc.stderr[-3000:]
    assert tail[-2].startswith("lightning-adaptiveload: the run failed"), proc.stderr[-3000:]
    return tail[-1]


# ------------------------------------------------------------------------------------------ errors, 2 ranks


@pytest.mark.timeout(scaled(240))
def test_missing_shard_under_2_process_ddp_is_the_last_error(tmp_path):
    missing = str(tmp_path / "nowhere" / "shard-000000.tar")
    proc = _run_cli(
        ["fit", "--config", QUICKSTART, *SHORT, "--data.init_args.synthetic=null",
         f"--data.init_args.train_shards=[{missing}]"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    last = _last_error_block(proc)
    assert "missing_shard" in last and missing in last, last
    assert "Connection closed" not in proc.stderr and "gloo" not in proc.stderr.lower()


@pytest.mark.timeout(scaled(240))
def test_oversize_sample_without_validation_set_is_the_last_error(tmp_path):
    proc = _run_cli(
        ["fit", "--config", QUICKSTART, *SHORT, "--data.init_args.batching.max_tokens=100",
         "--data.init_args.batching.max_compute=null"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    last = _last_error_block(proc)
    assert "more than max_tokens=100" in last and "oversize='skip'" in last, last
    assert "iter(combined_loader)" not in proc.stderr


@pytest.mark.timeout(scaled(300))
def test_error_of_one_rank_is_shown_last_not_its_peers_connection_error(tmp_path):
    # Rank 1 fails in its first step; rank 0 then fails with a closed connection. The root cause (rank 1's
    # error) must be the final block.
    proc = _run_cli(
        ["fit", "--config", QUICKSTART, *SHORT, "--model.class_path=_failing_rank.FailsOnRankOne"],
        tmp_path,
        pythonpath=[str(ROOT), str(TESTS)],
    )
    assert proc.returncode != 0
    last = _last_error_block(proc)
    assert "rank one broke on purpose" in last, proc.stderr[-3000:]
    assert "on rank 1" in proc.stderr.rstrip().splitlines()[-2]


@pytest.mark.timeout(scaled(300))
def test_channel_mismatch_under_2_process_ddp_is_the_last_error(tmp_path):
    # The quickstart's 16-channel latents given to a model built for 8 channels: both ranks fail in their
    # first step; the final block names the channels, not the patch size.
    proc = _run_cli(
        ["fit", "--config", QUICKSTART, *SHORT, '--model.init_args.model_overrides={"in_channels": 8}'],
        tmp_path,
    )
    assert proc.returncode != 0
    last = _last_error_block(proc)
    assert "16 channels" in last and "(B, 8, T, H, W)" in last, last


@pytest.mark.timeout(scaled(240))
def test_key_with_a_dot_under_2_process_ddp_is_the_last_error(tmp_path):
    path = _dotted_shard(tmp_path)
    proc = _run_cli(
        ["fit", "--config", QUICKSTART, *SHORT, "--data.init_args.synthetic=null",
         f"--data.init_args.train_shards=[{path}]"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "keys cannot contain dots" in _last_error_block(proc)


def _dotted_shard(tmp_path) -> str:
    """A shard whose one sample is written as ``clip_v1.5.latent.npy`` (a dot inside the key)."""
    buf = io.BytesIO()
    np.save(buf, np.zeros((16, 1, 2, 2), np.float16))
    path = tmp_path / "dotted.tar"
    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo("clip_v1.5.latent.npy")
        info.size = len(buf.getvalue())
        tf.addfile(info, io.BytesIO(buf.getvalue()))
    return str(path)


# ------------------------------------------------------------------------------------ errors, one process


def test_synthetic_typo_is_caught_when_the_config_is_read(tmp_path):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    with pytest.raises(ValueError, match="did you mean 'num_samples'") as err:
        AdaptiveLoadDataModule(str(tmp_path / "train"), synthetic={"mix": "tiny", "num_sample": 8})
    assert "valid keys are" in str(err.value) and "val_num_samples" in str(err.value)
    # From the command line: one short final block, before any process starts.
    proc = _run_cli(["fit", "--config", QUICKSTART, "--data.init_args.synthetic.num_sample=8"], tmp_path)
    assert proc.returncode != 0
    assert "did you mean 'num_samples'" in _last_error_block(proc)
    assert not (tmp_path / "data").exists()


def test_unknown_top_level_key_suggests_the_nearest(tmp_path, capsys):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(Path(QUICKSTART).read_text().replace("\ntrainer:", "\ntrainr:"))
    assert cli.main(["fit", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'trainer'?" in err
    assert len(err.splitlines()) <= 5, err  # not the usage dump


@pytest.mark.parametrize(
    ("old", "new", "hint"),
    [
        ("max_epochs: 4", "max_epoch: 4", "'max_epochs'"),
        ("max_tokens: 1024", "max_token: 1024", "'max_tokens'"),
    ],
)
def test_unknown_nested_key_suggests_the_nearest(tmp_path, capsys, old, new, hint):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(Path(QUICKSTART).read_text().replace(old, new))
    assert cli.main(["fit", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"did you mean {hint}?" in err and len(err.splitlines()) <= 5, err


def test_mistyped_command_lists_the_tool_commands(capsys, monkeypatch):
    monkeypatch.setitem(
        cli.COMMANDS, "ingest", ("lightning_adaptiveload.cli.data", "index_main", "a new tool")
    )
    assert cli.main(["simulte"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'simulate'?" in err
    for name in (*cli.COMMANDS, "fit"):
        assert f"  {name} " in err, name


def test_channel_mismatch_is_named():
    from lightning_adaptiveload.models.module import VideoDiTModule

    module = VideoDiTModule(preset="tiny")
    batch = {"latents": torch.zeros(8, 4, 1, 8, 8), "text": None, "text_mask": None, "num_tokens": 128}
    with pytest.raises(ValueError, match="4 channels") as err:
        module.compute_loss(batch)
    assert "(B, 16, T, H, W)" in str(err.value) and "in_channels" in str(err.value)
    assert "patch_size" not in str(err.value)


def test_key_with_a_dot_says_keys_cannot_contain_dots(tmp_path):
    from lightning_adaptiveload.shards.format import ShardError
    from lightning_adaptiveload.shards.index import ShardIndex

    path = _dotted_shard(tmp_path)
    with pytest.raises(ShardError, match="keys cannot contain dots") as err:
        ShardIndex.build([path], progress=False)
    assert "clip_v1.5.latent.npy" in str(err.value)


def test_oversize_in_a_library_fit_is_the_error_raised(synthetic_shards, tmp_path):
    # Without the CLI: the oversize error is raised by setup, not masked by Lightning's teardown.
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.models.module import VideoDiTModule

    train = synthetic_shards([8, 8], seed=0, name="train")
    data = AdaptiveLoadDataModule(
        train,
        batching=Batching(max_tokens=100, sizing="equal_tokens"),
        loader=Loader(num_workers=0),
    )
    trainer = quiet_cpu_trainer(tmp_path, max_steps=1, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(ValueError, match="more than max_tokens=100"):
        trainer.fit(VideoDiTModule(preset="tiny"), datamodule=data)


def test_no_validation_data_means_no_validation_loader(synthetic_shards, tmp_path):
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.models.module import VideoDiTModule

    train = synthetic_shards([8, 8], seed=0, name="train")
    data = AdaptiveLoadDataModule(train, batching=Batching(max_tokens=1024), loader=Loader(num_workers=0))
    assert not is_overridden("val_dataloader", data)
    assert "val_dataloader" not in vars(data)  # decided by the class's hook, nothing rebound on the instance
    with_val = AdaptiveLoadDataModule(train, val_shards=train, loader=Loader(num_workers=0))
    assert is_overridden("val_dataloader", with_val)
    trainer = quiet_cpu_trainer(tmp_path, max_steps=1, reload_dataloaders_every_n_epochs=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(VideoDiTModule(preset="tiny"), datamodule=data)
    assert not [w for w in seen if "Total length" in str(w.message)]


# ------------------------------------------------------------------------------------------------ recipes


def test_packaged_recipe_resolves_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.resolve_recipe("quickstart") == QUICKSTART
    assert cli.resolve_recipe("quickstart.yaml") == QUICKSTART
    (tmp_path / "quickstart.yaml").write_text("seed_everything: 1\n")
    assert cli.resolve_recipe("quickstart.yaml") == "quickstart.yaml"  # a file here wins
    assert cli.resolve_recipe("recipes/quickstart.yaml") == QUICKSTART  # the checkout's spelling, elsewhere
    assert cli.resolve_recipe("other/quickstart.yaml") == "other/quickstart.yaml"
    assert cli.resolve_recipe("no_such_recipe") == "no_such_recipe"
    assert set(cli.packaged_recipes()) >= {"quickstart", "wan13b_480p_lockstep", "wan14b_720p"}


@pytest.mark.timeout(scaled(600))
def test_wheel_ships_the_recipes_and_runs_the_quickstart_by_name(tmp_path):
    # Build the wheel, install it into a fresh venv that sees this environment's packages (offline, no
    # dependency download), and run the packaged quickstart by name from a folder outside the checkout.
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("lightning_adaptiveload-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_adaptiveload/recipes/quickstart.yaml" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=scaled(180))
    # The fresh venv sees this environment's packages (torch, lightning, ...) through a .pth line, after its
    # own site-packages: the wheel installed there wins, and no download is needed.
    import sysconfig

    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "_test_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    run = subprocess.run(
        [str(venv / "bin" / "lightning-adaptiveload"), "fit", "--config", "quickstart", *SHORT],
        capture_output=True, text=True, timeout=scaled(300), cwd=outside, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # The run says where its output went and compares its balance with the baseline in one line.
    assert "where this run's output is" in run.stdout, run.stdout[-3000:]
    assert f"synthetic data:  {outside / 'data' / 'quickstart' / 'train'}" in run.stdout
    assert "baseline (schedule independent, sizing equal_tokens)" in run.stdout
    assert (outside / "data" / "quickstart" / "train" / "index.json").exists()
    # The installed package, not the checkout, ran it.
    where = subprocess.run(
        [python, "-c", "import lightning_adaptiveload as m; print(m.__file__)"],
        capture_output=True, text=True, cwd=outside, env=env, timeout=scaled(60),
    )  # fmt: skip
    assert str(ROOT) not in where.stdout and str(venv) in where.stdout


def test_every_tool_flag_has_a_help_line(monkeypatch):
    import argparse

    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit):
            cli._load(name)(["--help"])
    assert len(parsers) == len(cli.COMMANDS)
    missing = [
        f"{p.prog} {'/'.join(a.option_strings) or a.dest}"
        for p in parsers
        for a in p._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert not missing, missing


def test_simulate_flags_separate_schedules_from_sizing_rules(capsys):
    from lightning_adaptiveload.cli import simulate

    assert simulate._configurations(None, None) == list(simulate.DEFAULT_VARIANTS)
    assert simulate._configurations("dual", "independent,lockstep") == ["dual", "lockstep"]
    assert simulate._configurations("equal_tokens", None) == ["equal_tokens"]
    with pytest.raises(ValueError, match="--schedules"):
        simulate._configurations("dual", "lockstp")
    # --modes takes sizing rules only (0.1.0 also took a configuration name there); the error lists them.
    with pytest.raises(ValueError, match="--modes lockstep: not one of dual,equal_tokens"):
        simulate._configurations("lockstep,dual", None)
    lines = simulate._describe(["lockstep"], None)
    assert "schedule lockstep, sizing dual" in lines[0] and "built-in cost model" in lines[1]
    assert "measured trace" in simulate._describe(["dual"], "trace.jsonl")[1]


def test_end_of_fit_balance_line_reuses_the_runs_plan_and_skips_the_baseline_at_scale():
    # The run's figures come from the plan its loader made; a data set over BASELINE_MAX_SAMPLES gets no
    # second (baseline) plan at the end of fit. The stub index cannot be planned: any planning would raise.
    from types import SimpleNamespace

    from lightning_adaptiveload.cli import fit
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    plan = SimpleNamespace(epoch=3, report={"est_compute_cv": 0.0123, "steps": 77})
    datamodule = SimpleNamespace(
        train_index=SimpleNamespace(num_samples=fit.BASELINE_MAX_SAMPLES + 1),
        batcher=DualConstraintBatcher(max_tokens=1024),
        train_dataset=SimpleNamespace(plan=plan),
        schedule="lockstep",
        num_workers=0,
        seed=0,
    )
    line = fit._baseline_line(SimpleNamespace(world_size=8), datamodule)
    assert "epoch 3, 8 ranks): compute CV 0.012 over 77 steps with schedule lockstep" in line
    assert "baseline not planned" in line and "simulate" in line


def test_packed_schedule_is_named_alike_in_the_run_the_end_of_fit_and_simulate(synthetic_shards, caplog):
    # The epoch line said "schedule packed, mode dual" while simulate called packed "equal_tokens": the
    # packed schedule uses no sizing rule, and every place now says so in the same words.
    import logging
    from types import SimpleNamespace

    from lightning_adaptiveload import AdaptiveLoadDataModule
    from lightning_adaptiveload.cli import fit, simulate
    from lightning_adaptiveload.planning.plan import batching_label

    label = batching_label("packed", "dual")
    assert label == batching_label("packed", "equal_tokens") and "sizing dual" not in label
    assert f"packed = {label}" in simulate._describe(["packed"], None)[0]

    dm = AdaptiveLoadDataModule(
        train_shards=synthetic_shards([12, 12], seed=0),
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule="packed"),
        loader=Loader(num_workers=0),
    )
    dm.setup("fit")
    with caplog.at_level(logging.INFO):
        len(dm.train_dataloader())  # plans epoch 0 and prints its line
    epoch_line = next(r.getMessage() for r in caplog.records if "[adaptiveload] epoch 0" in r.getMessage())
    assert label in epoch_line and "sizing dual" not in epoch_line

    end_line = fit._baseline_line(SimpleNamespace(world_size=1), dm)
    assert f"with {label}" in end_line and "sizing dual" not in end_line.split(";")[0]


def test_docs_quote_the_quickstarts_end_of_fit_balance_line(tmp_path):
    # docs/recipes.md said 0.092 (epoch 0's baseline) where the run's line says 0.083: the line plans the
    # last epoch. Plan what the quickstart's line plans, from the recipe itself, and find it in the docs.
    import yaml

    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.shards.index import ShardIndex
    from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

    recipe = yaml.safe_load(open(QUICKSTART))
    data, trainer = recipe["data"]["init_args"], recipe["trainer"]
    batching, plan, loader = data["batching"], data["plan"], data["loader"]
    synthetic = {k: v for k, v in data["synthetic"].items() if k != "val_num_samples"}
    write_synthetic_shards(tmp_path, SyntheticShards(**synthetic), progress=False)
    index = ShardIndex.load(str(tmp_path / "index.json"))
    world, epoch = int(trainer["devices"]), int(trainer["max_epochs"]) - 1
    caps = {
        "max_tokens": batching["max_tokens"], "max_compute": batching.get("max_compute"), "sizing": batching["sizing"]
    }  # fmt: skip

    def cv(schedule: str, **batcher) -> str:
        planned = plan_epoch(index, world, loader["num_workers"], DualConstraintBatcher(**batcher), loader["seed"],
                             epoch, PlanSettings(schedule=schedule))  # fmt: skip
        return f"{planned.report['est_compute_cv']:.3f}"

    run = cv(plan["schedule"], **caps)
    base = cv("independent", max_tokens=batching["max_tokens"], sizing="equal_tokens")
    for doc in ("docs/recipes.md", "README.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert f"compute CV {run}" in text and f"against {base}" in text, (doc, run, base)


def test_the_oversize_error_gives_the_floor_max_tokens_must_reach(synthetic_shards):
    # "raise max_tokens to at least 216" named the first sample over the cap; following it failed again at a
    # 225-token sample. The error now names the largest sample's count and how many are over the cap.
    from lightning_adaptiveload.loading.datamodule_inputs import check_oversize
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.shards.index import ShardIndex

    index = ShardIndex.load(os.path.join(synthetic_shards([16] * 4, seed=0), "index.json"))
    shapes = [tuple(s) for shard in index.shards for s in shard.latent_shapes]
    tokens = [s[1] * (s[2] // 2) * (s[3] // 2) for s in shapes]
    cap = sorted(tokens)[len(tokens) // 2]
    over = [s for s, t in zip(shapes, tokens) if t > cap]
    with pytest.raises(ValueError) as err:
        check_oversize(index, DualConstraintBatcher(max_tokens=cap, sizing="equal_tokens"))
    message = str(err.value)
    assert f"raise max_tokens to at least {max(tokens)}," in message, message
    assert f"{len(over)} sample(s) of {len(set(over))} shape(s) are over it" in message, message
    # A compact (binary) index gives the same floor.
    from lightning_adaptiveload.shards.compact import CompactIndex

    with pytest.raises(ValueError, match=f"at least {max(tokens)},"):
        check_oversize(
            CompactIndex.from_shard_index(index), DualConstraintBatcher(max_tokens=cap, sizing="equal_tokens")
        )


def test_synthetic_data_written_into_a_new_folder_is_announced_first(tmp_path, caplog):
    # A mistyped train_shards path filled up with generated data and trained (rc 0); only the last line said.
    import logging

    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    folder = tmp_path / "data" / "nonexistent"
    dm = AdaptiveLoadDataModule(
        train_shards=str(folder),
        synthetic={"mix": "tiny", "num_samples": 16, "samples_per_shard": 8},
        batching=Batching(max_tokens=900),
        loader=Loader(num_workers=0),
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        dm.prepare_data()
    said = [r.getMessage() for r in caplog.records if "holds no shards" in r.getMessage()]
    assert len(said) == 1 and str(folder) in said[0] and "16 synthetic samples" in said[0], said
    assert "data.synthetic to null" in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        dm.prepare_data()  # the shards are there now: reused, nothing announced
    assert not [r for r in caplog.records if "holds no shards" in r.getMessage()]


def test_fast_dev_run_keeps_save_last_from_writing_last_ckpt():
    from types import SimpleNamespace

    from lightning_adaptiveload.cli import fit

    ckpt = SimpleNamespace(save_last=True)
    fit._no_last_checkpoint_under_fast_dev_run(SimpleNamespace(fast_dev_run=False, checkpoint_callbacks=[ckpt]))
    assert ckpt.save_last is True  # an ordinary fit keeps its last.ckpt
    fit._no_last_checkpoint_under_fast_dev_run(SimpleNamespace(fast_dev_run=1, checkpoint_callbacks=[ckpt]))
    assert ckpt.save_last is False


@pytest.mark.timeout(scaled(300))
def test_fast_dev_run_of_the_quickstart_writes_no_checkpoint(tmp_path, monkeypatch):
    # Issue 60, third pass: Lightning 2.6's ModelCheckpoint.on_train_end wrote runs/quickstart/checkpoints/
    # last.ckpt even under fast_dev_run, replacing the last real run's checkpoint.
    monkeypatch.chdir(tmp_path)
    args = [
        "fit", "--config", QUICKSTART, "--trainer.devices=1", "--trainer.strategy=auto",
        "--trainer.fast_dev_run=true", "--trainer.enable_progress_bar=false",
        "--data.init_args.synthetic.num_samples=32", "--data.init_args.synthetic.val_num_samples=8",
    ]  # fmt: skip
    cli.main(args)
    written = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*") if p.is_file())
    assert written == [], written

"""The command line: dispatch, LightningCLI recipes, the quickstart, and the calibration command."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _paths import ROOT
from _timing import scaled

from lightning_adaptiveload.cli import main as cli
from lightning_adaptiveload.cli.calibrate import main as calibrate_main
from lightning_adaptiveload.tools.calibrate import calibrate
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
)

RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "*.yaml")))
HAVE_DATAMODULE = importlib.util.find_spec("lightning_adaptiveload.datamodule") is not None
needs_datamodule = pytest.mark.skipif(not HAVE_DATAMODULE, reason="datamodule.py not in this tree yet")


@pytest.fixture
def one_thread():
    # Tiny matmuls gain nothing from a second thread; on a busy machine the spinning threads cost a lot.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ------------------------------------------------------------------------------------------------ dispatch


def test_usage_lists_every_command(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for name in (*cli.COMMANDS, "fit", "validate"):
        assert name in out
    assert cli.main(["--help"]) == 0


def test_tool_commands_dispatch_with_their_arguments(monkeypatch):
    seen = {}
    fake = type(sys)("fake_tool")
    fake.run = lambda argv: seen.setdefault("argv", argv) and 7
    monkeypatch.setitem(sys.modules, "fake_tool", fake)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_tool", "run", "a fake tool"))
    assert cli.main(["fake", "--a", "1"]) == 7
    assert seen["argv"] == ["--a", "1"]


def test_missing_tool_module_gives_a_clear_message(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("lightning_adaptiveload.no_such_module", "main", "gone"))
    with pytest.raises(SystemExit, match="no lightning_adaptiveload.no_such_module module"):
        cli.main(["ghost"])
    monkeypatch.setitem(
        cli.COMMANDS, "ghost", ("lightning_adaptiveload.cli.main", "no_such_function", "gone")
    )
    with pytest.raises(SystemExit, match="has no no_such_function"):
        cli.main(["ghost"])


def test_every_tool_command_resolves():
    # Every module the dispatcher names exists (once its owner has landed it) and has the function.
    for name, (module, _func, _) in cli.COMMANDS.items():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not in this tree yet")
        assert callable(cli._load(name)), name


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", "calibrate", "--help"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--vram-fraction" in proc.stdout


# ------------------------------------------------------------------------------------------------ recipes


def test_recipes_exist():
    names = {Path(p).name for p in RECIPES}
    for name in (
        "quickstart.yaml",
        "wan13b_480p_equal_tokens.yaml",
        "wan13b_480p_dual.yaml",
        "wan13b_480p_lockstep.yaml",
        "wan14b_720p.yaml",
    ):
        assert name in names


@needs_datamodule
@pytest.mark.parametrize("recipe", RECIPES, ids=[Path(p).name for p in RECIPES])
def test_recipe_parses(recipe, capsys):
    # --print_config parses and type-checks the whole recipe (class paths imported, init_args checked
    # against the signatures) without building a GPU trainer.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", recipe, "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"].endswith("VideoDiTModule")
    assert config["data"]["class_path"].endswith("AdaptiveLoadDataModule")
    assert config["seed_everything"] is not None


@needs_datamodule
def test_gpu_recipes_share_one_memory_ceiling():
    ceilings = {}
    for recipe in RECIPES:
        with open(recipe, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        # The three batching comparisons (the fine-tuning recipe is not one of them).
        if Path(recipe).name.startswith("wan13b_480p") and "finetune" not in Path(recipe).name:
            ceilings[Path(recipe).name] = config["data"]["init_args"]["batching"]["max_tokens"]
            assert config["trainer"]["precision"] == "bf16-mixed"
            assert config["model"]["init_args"]["memory"]["activation_checkpointing"] is True
    assert len(ceilings) == 3 and len(set(ceilings.values())) == 1, ceilings


@needs_datamodule
def test_fsdp_recipe_uses_model_parallel_strategy():
    # Issue 19: the 14B recipe shards with FSDP2 (the module applies fully_shard per block under
    # ModelParallelStrategy) and saves distributed checkpoints; FSDP v1's auto-wrap is gone.
    from lightning.pytorch.cli import LightningArgumentParser
    from lightning.pytorch.strategies import Strategy

    with open(ROOT / "recipes" / "wan14b_720p.yaml", encoding="utf-8") as f:
        strategy = yaml.safe_load(f)["trainer"]["strategy"]
    parser = LightningArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse < 4.49
    built = instantiate(parser.parse_object({"strategy": strategy})).strategy
    assert type(built).__name__ == "ModelParallelStrategy"
    assert built._save_distributed_checkpoint is True


def _run_cli(args, cwd, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@needs_datamodule
@pytest.mark.timeout(scaled(300))
def test_quickstart_runs_a_shortened_fit(tmp_path):
    # The README's command, shortened to 3 steps, in a fresh directory: it generates the synthetic shards,
    # trains on 2 CPU ranks (DDP re-launches the command) and prints the load-balance summary.
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    proc = _run_cli(["fit", "--config", recipe, "--trainer.max_steps=3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "LoadBalanceMonitor" in out and "straggler wait" in out
    assert (tmp_path / "data" / "quickstart" / "train" / "index.json").exists()
    saved = list((tmp_path / "runs" / "quickstart").rglob("config.yaml"))
    assert saved and yaml.safe_load(saved[0].read_text())["trainer"]["max_steps"] == 3


def _flat_form(tmp_path, section: str, group: str) -> str:
    """The quickstart with one settings group of ``section`` written flat, as 0.1.0's recipes did."""
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    args = recipe[section]["init_args"]
    args.update(args.pop(group))
    path = tmp_path / f"flat_{section}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@needs_datamodule
@pytest.mark.parametrize("section, group", [("data", "batching"), ("model", "optimizer"), ("model", "sampling")])
def test_a_recipe_in_the_flat_form_of_0_1_0_is_refused_naming_the_group(tmp_path, capsys, section, group):
    # 0.2.0 reads the settings groups only; a flat key gets a few lines saying where it goes now.
    recipe = _flat_form(tmp_path, section, group)
    assert cli.main(["fit", "--config", recipe, "--print_config"]) == 2
    err = capsys.readouterr().err
    assert "is not accepted" in err and f"is a setting of its group {group!r}: write it as {group}." in err, err
    assert len(err.splitlines()) <= 5


@needs_datamodule
def test_a_flat_flag_is_refused_naming_the_group(capsys):
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    assert cli.main(["fit", "--config", recipe, "--data.init_args.max_tokens=512", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert "has no argument 'max_tokens'" in err and "write it as batching.max_tokens" in err, err


@needs_datamodule
@pytest.mark.timeout(scaled(180))
def test_repeated_run_overwrites_the_saved_config(tmp_path, monkeypatch, one_thread):
    # Without a logger the config is saved to default_root_dir, the same path both times: the second run
    # must overwrite it rather than refuse to start.
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        str(ROOT / "recipes" / "quickstart.yaml"),
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.logger=false",
        "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.synthetic.num_samples=64",
        "--data.init_args.val_shards=null",
    ]
    cli.main([*args, "--trainer.max_steps=2"])
    saved = tmp_path / "runs" / "quickstart" / "config.yaml"
    assert yaml.safe_load(saved.read_text())["trainer"]["max_steps"] == 2
    cli.main([*args, "--trainer.max_steps=1"])
    assert yaml.safe_load(saved.read_text())["trainer"]["max_steps"] == 1


# ------------------------------------------------------------------------------------------------ calibrate


def _tiny_calibration(tmp_path, memory_budget_gb=0.02, max_tokens=None, **kwargs):
    options = dict(mix="tiny", num_shapes=3, warmup=1, repeats=2)
    options.update(kwargs)
    settings = CalibrateSettings(
        **options,
        training=CalibratedTraining(device="cpu"),
        memory=MemorySearch(memory_budget_gb=memory_budget_gb, max_tokens=max_tokens),
    )
    return calibrate("tiny", settings=settings, progress=False)


@pytest.mark.timeout(scaled(240))
def test_calibrate_on_cpu_writes_a_usable_fragment(tmp_path, one_thread):
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.cost_model import CostModel

    out = tmp_path / "cal.yaml"
    rc = calibrate_main(
        [
            "--preset", "tiny", "--mix", "tiny", "--num-shapes", "3", "--device", "cpu",
            "--memory-budget-gb", "0.02", "--warmup", "1", "--repeats", "2", "--no-progress",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    text = out.read_text()
    assert "# device: CPU" in text and "# precision: 32-true" in text and "16x9x10x10" in text
    data = yaml.safe_load(text)["data"]["init_args"]
    assert set(data) == {"batching"}
    data = data["batching"]
    assert set(data) == {"max_tokens", "max_compute", "cost_model"}
    # The budget is a whole number of the longest (225-token) samples, and the memory probes say why.
    assert data["max_tokens"] % 225 == 0 and data["max_tokens"] >= 225
    model = CostModel.from_dict(data["cost_model"])
    assert model.cost(225) > model.cost(24) > 0
    # max_compute is the batcher's "auto" rule on the mix's shapes.
    from lightning_adaptiveload.shards.mixes import load_mix

    batcher = DualConstraintBatcher(
        data["max_tokens"], "auto", cost_model=model, sizing="dual", oversize="skip"
    )
    expected = batcher.resolve_max_compute([b.latent_shape for b in load_mix("tiny").buckets])
    assert data["max_compute"] == pytest.approx(expected)


@pytest.mark.timeout(scaled(240))
def test_calibrate_budget_grows_with_memory(tmp_path, one_thread):
    small = _tiny_calibration(tmp_path, memory_budget_gb=0.012, batch_sizes=[1])
    large = _tiny_calibration(tmp_path, memory_budget_gb=0.03, batch_sizes=[1])
    assert small.max_tokens < large.max_tokens
    # Every probe it accepted fits the budget, every rejected one does not.
    for result, budget in ((small, 0.012), (large, 0.03)):
        for probe in result.probes:
            assert probe.fits == (probe.peak is not None and probe.peak <= budget * 1024**3)


def test_calibrate_reports_impossible_budgets(tmp_path, one_thread, capsys):
    rc = calibrate_main(
        [
            "--preset",
            "tiny",
            "--seq-lens",
            "64,256",
            "--device",
            "cpu",
            "--memory-budget-gb",
            "0.0001",
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "needs more than the budget" in capsys.readouterr().err


def test_calibrate_with_given_budget_and_seq_lens(tmp_path, one_thread):
    result = _tiny_calibration(tmp_path, mix=None, shapes=[(16, 1, 8, 16), (16, 1, 16, 16)], max_tokens=256,
                               max_compute="auto")  # fmt: skip
    assert result.max_tokens == 256 and result.max_compute == "auto" and result.probes == []
    assert {t.seq_len for t in result.timings} == {32, 64}
    with pytest.raises(ValueError, match="channels"):
        _tiny_calibration(tmp_path, mix=None, shapes=[(4, 1, 8, 8)])


@needs_datamodule
def test_calibration_fragment_is_included_by_a_recipe(tmp_path, one_thread, capsys):
    result = _tiny_calibration(tmp_path, max_tokens=900)
    fragment = tmp_path / "cal.yaml"
    fragment.write_text(result.to_yaml())
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(
            [
                "fit",
                "--config",
                str(ROOT / "recipes" / "quickstart.yaml"),
                "--config",
                str(fragment),
                "--print_config",
            ]
        )
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert data["batching"]["max_tokens"] == 900
    assert data["batching"]["max_compute"] == pytest.approx(result.max_compute)
    assert data["batching"]["cost_model"]["beta"] == pytest.approx(result.cost_model.beta)
    assert data["synthetic"]["mix"] == "tiny"  # the rest of the recipe is kept


def test_calibrate_reads_the_model_from_a_recipe(tmp_path, one_thread):
    out = tmp_path / "cal.yaml"
    rc = calibrate_main(
        ["--recipe", str(ROOT / "recipes" / "quickstart.yaml"), "--max-tokens", "900", "--num-shapes", "2",
         "--device", "cpu", "--warmup", "0", "--repeats", "1", "--no-progress", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    text = out.read_text()
    # The quickstart's tiny model, fp32, its synthetic mix and its longest text.
    assert "# model: tiny" in text and "# precision: 32-true" in text
    assert "from mix tiny" in text and "# text_len: 16" in text
    assert calibrate_main(["--recipe", str(tmp_path / "missing.yaml"), "--device", "cpu"]) == 2


def test_calibrate_takes_weight_dtype_from_the_recipe_or_the_flag(tmp_path, one_thread):
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    recipe["model"]["init_args"]["optimizer"]["weight_dtype"] = "bf16"
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(recipe))
    common = ["--max-tokens", "900", "--num-shapes", "2", "--device", "cpu", "--warmup", "0", "--repeats", "1",
              "--no-progress"]  # fmt: skip
    for extra, expected in (([], "bf16"), (["--weight-dtype", "fp32"], None)):
        out = tmp_path / f"cal_{expected}.yaml"
        assert calibrate_main(["--recipe", str(path), *common, *extra, "--out", str(out)]) == 0
        fragment = yaml.safe_load(out.read_text())
        optimizer = (fragment.get("model") or {}).get("init_args", {}).get("optimizer", {})
        assert optimizer.get("weight_dtype") == expected
        assert f"# weight_dtype: {expected or 'fp32'}" in out.read_text()


@pytest.mark.cuda
@pytest.mark.timeout(scaled(300))
def test_calibrate_on_cuda_measures_allocator_peaks(tmp_path):
    settings = CalibrateSettings(
        mix="tiny", num_shapes=3, warmup=1, repeats=3, training=CalibratedTraining(device="cuda"),
        memory=MemorySearch(memory_budget_gb=0.25, max_batch=64),
    )  # fmt: skip
    result = calibrate("tiny", settings=settings, progress=False)
    assert result.info["precision"] == "bf16-mixed" and "CUDA allocator" in result.info["memory"]
    assert all(p.peak is None or p.peak > 0 for p in result.probes)
    # The budget is a whole batch of the longest shape (225 tokens), or, when the shortest shape (24 tokens)
    # needs more memory per token, a whole batch of that one.
    assert result.max_tokens >= 225
    assert result.max_tokens % 225 == 0 or result.max_tokens % 24 == 0, result.max_tokens
    fitting = [p for p in result.probes if p.fits]
    assert fitting and all(p.peak is not None and p.peak <= 0.25 * 2**30 for p in fitting)
    assert result.cost_model.cost(225) > 0


def test_calibrate_takes_a_packaged_recipe_by_name(monkeypatch):
    # `fit --config quickstart` worked, `calibrate --recipe quickstart` said it could not read 'quickstart'.
    from lightning_adaptiveload.cli import calibrate as cal

    seen = {}

    class Stop(Exception):
        pass

    def fake_calibrate(preset, model_overrides, settings, **kwargs):
        seen.update(preset=preset, settings=settings, **kwargs)
        raise Stop

    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    with pytest.raises(Stop):
        cal.main(["--recipe", "quickstart", "--device", "cpu", "--no-progress"])
    assert seen["settings"].mix == "tiny"  # the quickstart's synthetic mix, read from the packaged recipe
    assert seen["settings"].training.device == "cpu" and seen["preset"] == "tiny"


def test_a_recipe_name_typo_gets_a_suggestion(capsys):
    from lightning_adaptiveload.cli import main as cli

    assert cli.main(["fit", "--config", "quickstrat"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--config quickstrat: no such file and no packaged recipe of that name" in err
    assert "did you mean 'quickstart'?" in err and len(err.splitlines()) == 1

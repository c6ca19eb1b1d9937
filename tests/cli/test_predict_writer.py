"""`predict --config quickstart` writes its per-sample results and names the place (issue 60, item 2);
`--ckpt_path last` finds the quickstart's last checkpoint or says why not (item 1)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from _paths import ROOT

from lightning_adaptiveload.callbacks.predictions import PredictionWriter

QUICKSTART = ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml"


def test_the_quickstart_recipe_has_a_prediction_writer():
    callbacks = yaml.safe_load(QUICKSTART.read_text())["trainer"]["callbacks"]
    writers = [c for c in callbacks if c["class_path"].endswith("PredictionWriter")]
    assert writers and writers[0]["init_args"]["output_dir"].startswith("runs/quickstart/")


def test_writer_writes_one_line_per_sample_and_a_new_run_starts_empty(tmp_path, capsys):
    trainer = SimpleNamespace(global_rank=0, is_global_zero=True)
    writer = PredictionWriter(str(tmp_path / "pred"))
    for _ in range(2):  # the second run replaces the first run's lines
        writer.on_predict_start(trainer, None)
        prediction = {"keys": ["a", "b"], "loss": torch.tensor([0.5, 1.5])}
        writer.write_on_batch_end(trainer, None, prediction, None, None, 0)
        writer.write_on_batch_end(trainer, None, {"keys": ["c"], "loss": torch.tensor([2.0])}, None, None, 1)
        writer.teardown(trainer, None, "predict")
    lines = (tmp_path / "pred" / "predictions_rank0.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"key": "a", "loss": 0.5},
        {"key": "b", "loss": 1.5},
        {"key": "c", "loss": 2.0},
    ]
    out = capsys.readouterr().out
    assert str(tmp_path / "pred") in out and "predictions_rank0.jsonl" in out


def test_writer_names_a_prediction_it_cannot_write(tmp_path):
    trainer = SimpleNamespace(global_rank=0, is_global_zero=True)
    writer = PredictionWriter(str(tmp_path))
    writer.on_predict_start(trainer, None)
    with pytest.raises(TypeError, match="predict_step of Tensor returned Tensor|returned Tensor"):
        writer.write_on_batch_end(trainer, torch.zeros(1), torch.zeros(2), None, None, 0)


# -- resuming from the command line (issue 60, item 1) -------------------------------------------------------


def test_the_quickstart_keeps_a_last_checkpoint_in_a_fixed_folder():
    recipe = yaml.safe_load(QUICKSTART.read_text())
    assert recipe["trainer"]["enable_checkpointing"] is True
    ckpt = [c for c in recipe["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert ckpt and ckpt[0]["init_args"]["save_last"] is True
    assert ckpt[0]["init_args"]["dirpath"] == "runs/quickstart/checkpoints"


def test_ckpt_path_last_with_nothing_to_resume_says_why(tmp_path, capsys):
    from lightning_adaptiveload.cli.fit import _check_resume

    cb = SimpleNamespace(dirpath=str(tmp_path / "ckpts"))
    trainer = SimpleNamespace(is_global_zero=True, checkpoint_callbacks=[cb])
    _check_resume(trainer, "last")
    assert "no last.ckpt in" in capsys.readouterr().out
    _check_resume(SimpleNamespace(is_global_zero=True, checkpoint_callbacks=[]), "last")
    assert "checkpointing is off" in capsys.readouterr().out
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "last.ckpt").write_bytes(b"")
    _check_resume(trainer, "last")
    _check_resume(trainer, None)
    assert capsys.readouterr().out == ""


def test_the_cli_hides_lightnings_resumability_warning_only():
    import warnings

    from lightning_adaptiveload.cli.fit import _quiet_resumability_warning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_resumability_warning()
        warnings.warn(
            "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not "
            "resumable. This can cause unreliable results if further training is done.",
            UserWarning,
            stacklevel=2,
        )
        warnings.warn("another warning", UserWarning, stacklevel=2)
    assert [str(w.message) for w in seen] == ["another warning"]

"""The CLI refuses argparse's abbreviations, names a bad key first with a suggestion, calls itself by its
name, and says when a DataModule subclass's ``**kw`` hides the groups (issue 60, item 5)."""

from __future__ import annotations

import sys
import textwrap

import pytest
from _paths import ROOT

from lightning_adaptiveload.cli import main as cli

QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _program(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-adaptiveload"])  # not pytest's arguments


def _fails(capsys, *flags):
    code = cli.main(["fit", "--config", QUICKSTART, *flags, "--print_config"])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize(
    "flags, bad, near",
    [
        (["--trainer.max_epoch", "1"], "'max_epoch'", "did you mean 'max_epochs'?"),
        (["--data.init_args.batching.max_token", "512"], "batching.max_token", "did you mean 'max_tokens'?"),
        (["--data.init_args.batching.max_tokns", "512"], "batching.max_tokns", "did you mean 'max_tokens'?"),
        (["--data.batching.max_tokns=512"], "batching.max_tokns", "did you mean 'max_tokens'?"),
        (["--model.init_args.presetx", "tiny"], "'presetx'", "did you mean 'preset'?"),
    ],
)
def test_abbreviations_and_typos_are_refused_with_the_key_first(capsys, flags, bad, near):
    err = _fails(capsys, *flags)
    lines = err.strip().splitlines()
    assert "not accepted" in lines[0]
    assert bad in lines[1] and near in err
    assert "Union subtypes" not in err and len(lines) <= 5


def _prints_config(capsys, *flags):
    with pytest.raises(SystemExit) as done:  # --print_config exits 0 after printing
        cli.main(["fit", "--config", QUICKSTART, *flags, "--print_config"])
    assert done.value.code in (0, None)
    return capsys.readouterr().out


def test_full_keys_still_parse(capsys):
    assert "max_epochs: 1" in _prints_config(capsys, "--trainer.max_epochs", "1")


def test_help_names_the_program(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/lightning_adaptiveload/__main__.py"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("usage: python -m lightning_adaptiveload") and " fit " in first
    assert "__main__.py" not in first
    monkeypatch.setattr(sys, "argv", ["/usr/bin/lightning-adaptiveload"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    assert capsys.readouterr().out.startswith("usage: lightning-adaptiveload")


def test_a_subclass_whose_kw_hides_the_groups_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "kwdata.py").write_text(
        textwrap.dedent(
            """
            from lightning_adaptiveload import AdaptiveLoadDataModule

            class Repacked(AdaptiveLoadDataModule):
                def __init__(self, root: str = "x", **kw):
                    opts = dict(train_shards=root, **kw)
                    super().__init__(**opts)

            class PassedOn(AdaptiveLoadDataModule):
                def __init__(self, root: str = "x", **kwargs):
                    super().__init__(train_shards=root, **kwargs)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _fails(capsys, "--data.class_path", "kwdata.Repacked", "--data.init_args.plan.schedule", "packed")
    assert "has no argument 'plan.schedule'" in err
    assert "takes **kw" in err and "docs/recipes.md" in err
    assert "'kw'" not in err  # not offered as a key
    out = _prints_config(
        capsys, "--data.class_path", "kwdata.PassedOn", "--data.init_args.plan.schedule", "packed"
    )
    assert "schedule: packed" in out

"""The one reader of a user's recipe and text files (``cli/recipe_file.py``): every command refuses a FIFO,
a device or a directory naming the path (without waiting on it), caps the size, refuses an alias bomb and
deep nesting from the YAML's events, and names the file and the line in every error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _paths import ROOT
from _timing import scaled

from lightning_adaptiveload.cli import main as cli
from lightning_adaptiveload.cli.recipe_file import (
    MAX_FILE_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    RecipeFileError,
    check_config_files,
    load_yaml,
    read_json,
    read_text,
    read_yaml,
)

# A "billion laughs": 9 levels of 9 aliases, 9^9 values once expanded, 300 bytes on disk.
BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(f"{x}: &{x} [{','.join([f'*{p}'] * 9)}]" for p, x in zip("abcdefgh", "bcdefghi")),
        "trainer: *i",
    ]
)
QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "recipe.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.timeout(scaled(60))  # no writer ever comes: a blocking open would never return
def test_a_fifo_is_refused_naming_it_without_waiting(fifo):
    with pytest.raises(RecipeFileError, match=rf"{fifo}: is a FIFO \(named pipe\), not a regular file"):
        read_yaml(fifo)


@pytest.mark.parametrize("path, kind", [("/dev/null", "a device"), (".", "a directory")])
def test_devices_and_directories_are_refused(path, kind):
    with pytest.raises(RecipeFileError, match=f"{path}: is {kind}, not a regular file"):
        read_text(path, what=f"--config {path}")


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing to read, only its size
    with pytest.raises(
        RecipeFileError, match=rf"big.yaml: {MAX_FILE_BYTES + 1} bytes, more than the {MAX_FILE_BYTES}"
    ):
        read_yaml(big)
    small = tmp_path / "small.yaml"
    small.write_text("a: 1\n" * 10)
    with pytest.raises(RecipeFileError, match="more than the 20 a recipe may have"):
        read_yaml(small, max_bytes=20)
    assert read_yaml(small, max_bytes=50) == {"a": 1}


@pytest.mark.timeout(scaled(60))  # expanded, the bomb's 9**9 values would take hours and all memory
def test_an_alias_bomb_fails_fast_naming_the_file_and_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(RecipeFileError) as err:
        read_yaml(path)
    message = str(err.value)
    assert message.startswith(f"{path}, line ") and f"expand to more than {MAX_YAML_VALUES} values" in message
    # A few aliases of a small anchor are fine; an alias inside its own anchor is not.
    assert load_yaml("a: &x [1, 2]\nb: *x\nc: *x\n") == {"a": [1, 2], "b": [1, 2], "c": [1, 2]}
    with pytest.raises(RecipeFileError, match=r"line 1: the alias \*a is used inside its own anchor &a"):
        load_yaml("a: &a [*a]\n", "r.yaml")


def test_deep_nesting_is_refused_before_it_recurses():
    with pytest.raises(RecipeFileError, match="r.yaml, line 1: nested too deeply"):
        load_yaml("model: " + "[" * 5000 + "]" * 5000, "r.yaml")
    block = (
        "".join(f"{'  ' * i}k{i}:\n" for i in range(MAX_YAML_DEPTH + 5))
        + "  " * (MAX_YAML_DEPTH + 5)
        + "v: 1\n"
    )
    with pytest.raises(
        RecipeFileError,
        match=f"r.yaml, line {MAX_YAML_DEPTH + 1}: nested too deeply \\(more than {MAX_YAML_DEPTH}",
    ):
        load_yaml(block, "r.yaml")
    assert load_yaml("a: " + "[" * 10 + "]" * 10) == {"a": [[[[[[[[[[]]]]]]]]]]}


def test_a_bad_yaml_line_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  max_steps: 3\nmodel: {a: 1\n")
    with pytest.raises(RecipeFileError, match=rf"{path}, line 4, column 1: not valid YAML: "):
        read_yaml(path)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"a: 1\nb: caf\xe9\n")
    with pytest.raises(RecipeFileError, match=rf"{latin}, line 2: not UTF-8 text"):
        read_yaml(latin)
    js = tmp_path / "cost.json"
    js.write_text('{"kind": "power",\n "p": }')
    with pytest.raises(RecipeFileError, match=rf"--times {js}, line 2, column 7: not valid JSON"):
        read_json(js, what=f"--times {js}")
    with pytest.raises(RecipeFileError, match="nothing.yaml: no such file"):
        read_yaml(tmp_path / "nothing.yaml")


def test_every_file_the_parser_would_read_is_checked_first(tmp_path, fifo):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    check_config_files(["fit", "--config", QUICKSTART, "--model", "lightning_adaptiveload.VideoDiTModule"])
    for argv, words in (
        (["fit", "--config", str(fifo)], f"--config {fifo}: is a FIFO"),
        (["fit", f"--config={fifo}"], f"--config {fifo}: is a FIFO"),
        (["fit", "--config", QUICKSTART, "--trainer", str(bomb)], f"--trainer {bomb}, line 5: its aliases"),
    ):
        with pytest.raises(RecipeFileError, match=words):
            check_config_files(argv)
    check_config_files(["fit", "--config", "trainer: {max_steps: 1}"])  # inline YAML: the parser's to read


def test_fit_with_a_fifo_as_config_exits_at_once_naming_it(fifo):
    # Before: the FIFO passed the "is it a file" test, and jsonargparse blocked reading it for ever.
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", "fit", "--config", str(fifo)],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--config {fifo}: is a FIFO (named pipe), not a regular file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(scaled(240))
def test_fit_refuses_an_alias_bomb_in_a_file_and_inline(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert cli.main(["fit", "--config", str(path)]) == 2
    assert f"--config {path}, line 5: its aliases (*name) expand to more than" in capsys.readouterr().err
    # Inline YAML is read by the parser, through the same limits (the test's timeout bounds the time).
    assert cli.main(["fit", "--config", BOMB]) == 2
    assert "expand to more than" in capsys.readouterr().err


def test_calibrate_and_simulate_read_their_files_through_it(tmp_path, fifo, capsys):
    from lightning_adaptiveload.cli.calibrate import _recipe_defaults
    from lightning_adaptiveload.cli.simulate import main as simulate_main

    with pytest.raises(ValueError, match=rf"--recipe {fifo}: is a FIFO"):
        _recipe_defaults(str(fifo))
    times = tmp_path / "cost.json"
    os.mkfifo(times)
    assert simulate_main(["--replay", str(tmp_path / "ranks.csv"), "--times", str(times)]) == 2
    assert f"--times {times}: is a FIFO (named pipe)" in capsys.readouterr().err
    trace = tmp_path / "trace.jsonl"
    os.mkfifo(trace)
    assert (
        simulate_main(["--mix", "tiny", "--times", str(trace), "--out", str(tmp_path), "--no-progress"]) == 2
    )
    assert f"--times {trace}: is a FIFO (named pipe)" in capsys.readouterr().err


def test_synth_refuses_a_fifo_as_its_mix(tmp_path, capsys):
    from lightning_adaptiveload.cli.data import synth_main

    mix = tmp_path / "mix.json"
    os.mkfifo(mix)
    assert synth_main(["--out", str(tmp_path / "out"), "--mix", str(mix), "--no-progress"]) == 2
    assert f"--mix {mix}: is a FIFO (named pipe)" in capsys.readouterr().err

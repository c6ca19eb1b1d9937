"""A failed command prints its error alone and last, with what to do; the traceback only on request
(issue 38, items 5 and 10).

A typo inside `synthetic:` printed 77 lines and a missing path 62 lines of traceback before the clear line,
and a GPU recipe on a CPU machine ended in `No supported gpu backend found!` with no hint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import ROOT
from _timing import scaled

from lightning_adaptiveload.cli import main as cli

QUICKSTART = str(ROOT / "lightning_adaptiveload" / "recipes" / "quickstart.yaml")
LOCKSTEP = str(ROOT / "lightning_adaptiveload" / "recipes" / "wan13b_480p_lockstep.yaml")


def _run_cli(args, cwd, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _final_block(stderr: str) -> list[str]:
    """The lines from the last 'the run failed' line to the end (asserting there is one)."""
    lines = stderr.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("lightning-adaptiveload: the run failed")]
    assert starts, stderr[-3000:]
    return lines[starts[-1] :]


def _traceback_file(stderr: str) -> str:
    found = re.findall(r"lightning-adaptiveload: traceback in (\S+) \(or rerun with --traceback\)", stderr)
    assert len(found) == 1, stderr[-3000:]
    return Path(found[0]).read_text()


@pytest.mark.timeout(scaled(240))
def test_synthetic_typo_prints_the_clear_line_alone_and_keeps_the_traceback(tmp_path):
    proc = _run_cli(["fit", "--config", QUICKSTART, "--data.init_args.synthetic.num_sample=8"], tmp_path)
    assert proc.returncode == 1
    block = _final_block(proc.stderr)
    assert len(block) == 2 and "did you mean 'num_samples'" in block[1], block
    assert "Traceback" not in proc.stderr and "jsonargparse" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 6, proc.stderr  # was 77 lines
    saved = _traceback_file(proc.stderr)
    assert "Traceback (most recent call last)" in saved and "check_synthetic" in saved
    # With --traceback (anywhere on the line) the frames are printed, and the clear line is still last.
    shown = _run_cli(
        ["fit", "--traceback", "--config", QUICKSTART, "--data.init_args.synthetic.num_sample=8"], tmp_path
    )
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    assert "did you mean 'num_samples'" in _final_block(shown.stderr)[1]
    assert "traceback in" not in shown.stderr


@pytest.mark.timeout(scaled(240))
def test_missing_path_prints_the_clear_line_alone(tmp_path):
    missing = str(tmp_path / "nowhere" / "shard-000000.tar")
    proc = _run_cli(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--data.init_args.synthetic=null",
            f"--data.init_args.train_shards=[{missing}]",
        ],
        tmp_path,
    )
    assert proc.returncode == 1
    block = _final_block(proc.stderr)
    assert "missing_shard" in block[1] and missing in block[1] and "What to do" in block[1], block
    assert "Traceback" not in proc.stderr, proc.stderr  # was 62 lines of it
    assert "missing_shard" in _traceback_file(proc.stderr)


@pytest.mark.timeout(scaled(240))
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_recipe_on_a_cpu_machine_says_which_recipe_is_for_the_cpu(tmp_path):
    proc = _run_cli(["fit", "--config", LOCKSTEP], tmp_path)
    assert proc.returncode == 1
    block = "\n".join(_final_block(proc.stderr))
    assert "No supported gpu backend found!" in block
    assert "what to do: wan13b_480p_lockstep.yaml asks for GPUs" in block
    assert "lightning-adaptiveload fit --config quickstart" in block
    # ... and what the natural retry would do: write ~7.5 GiB first, then train wan-1.3b on the CPU.
    size = float(re.search(r"write about ([\d.]+) GiB of synthetic data", block).group(1))
    assert 6.5 < size < 8.5 and "wan-1.3b" in block
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


def test_no_gpu_hint_reads_the_recipe_and_is_silent_for_other_errors():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    hint = cli._hints(
        MisconfigurationException("No supported gpu backend found!"), ["fit", "--config", LOCKSTEP]
    )
    assert hint[0].startswith("what to do: wan13b_480p_lockstep.yaml asks for GPUs")
    assert any("--config quickstart" in line for line in hint)
    quick = cli._hints(
        MisconfigurationException("No supported gpu backend found!"), ["fit", "--config", QUICKSTART]
    )
    assert not any("--trainer.accelerator cpu would" in line for line in quick)  # tiny model, 11 MB of data
    assert cli._hints(ValueError("something else"), ["fit", "--config", LOCKSTEP]) == []


@pytest.mark.timeout(scaled(240))
def test_a_tool_command_error_is_printed_alone_too(tmp_path):
    (tmp_path / "videos").mkdir()
    proc = _run_cli(["ingest", "videos", "--out", "out", "--vae", "no/such/vae", "--devices", "1"], tmp_path)
    assert proc.returncode == 1
    block = _final_block(proc.stderr)
    assert "vae 'no/such/vae' is not a folder" in block[1] and "tiny-random" in block[1], block
    assert "Traceback" not in proc.stderr


def test_traceback_flag_is_taken_off_the_command_line(monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    assert cli._take_traceback_flag(["fit", "--traceback", "--config", "x"]) == ["fit", "--config", "x"]
    assert os.environ[cli.TRACEBACK_ENV] == "1"  # the ranks DDP starts inherit it
    assert "--traceback" in cli._usage()

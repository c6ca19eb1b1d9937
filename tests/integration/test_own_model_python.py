"""examples/your_own_model/train_python.py, a module of one's own trained from Python, and the answers of
docs/your_own_model.md that it shows (issue 60): the text mask as nn.MultiheadAttention's key_padding_mask,
and the line that prints the shards' text width."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from _paths import ROOT

from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

EXAMPLE = ROOT / "examples" / "your_own_model"
# Subprocess limits are generous and scale with the machine's load (tests/README.md).
TIME_FACTOR = float(os.environ.get("LIGHTNING_ADAPTIVELOAD_TEST_TIME_FACTOR", "1"))


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import train_python

        yield train_python
    finally:
        sys.path.remove(str(EXAMPLE))


def test_a_row_without_text_is_nan_with_the_inverted_mask_and_finite_with_the_helper(example):
    torch.manual_seed(0)
    attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x, ctx = torch.randn(3, 5, 8), torch.randn(3, 4, 8)
    text_mask = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])  # sample 1: no text
    naive = attn(x, ctx, ctx, key_padding_mask=~text_mask)[0]  # need_weights=True, the default
    assert torch.isnan(naive[1]).all() and torch.isfinite(naive[[0, 2]]).all()  # what the docs warn of

    pad, has_text = example.text_key_padding_mask(text_mask)
    assert has_text.tolist() == [True, False, True] and not pad.all(dim=1).any()
    assert torch.equal(pad[[0, 2]], ~text_mask[[0, 2]])  # rows with text: exactly the inverted mask
    for need_weights in (True, False):
        out = attn(x, ctx, ctx, key_padding_mask=pad, need_weights=need_weights)[0] * has_text[:, None, None]
        assert torch.isfinite(out).all() and out[1].abs().sum() == 0
        assert torch.allclose(out[[0, 2]], naive[[0, 2]], atol=1e-6)


def test_the_module_trains_on_batches_with_and_without_text_and_on_empty_batches(example):
    model = example.TinyVideoFlow(text_dim=8, dim=16, heads=2, layers=1)
    lat = torch.randn(2, 16, 3, 4, 4)
    text = torch.zeros(2, 3, 8)
    text[0, :2] = torch.randn(2, 8)
    mask = torch.tensor([[True, True, False], [False, False, False]])  # sample 1 has no text
    for batch in (
        {"latents": lat, "text": text, "text_mask": mask},
        {"latents": lat, "text": None, "text_mask": None},
        {"latents": lat[:0], "text": None, "text_mask": None},  # every sample skipped: no error, a zero sum
    ):
        model.zero_grad()
        err = model._errors(batch)
        assert err.shape == (batch["latents"].shape[0],) and torch.isfinite(err).all()
        (err.sum() + 0.0 * sum(p.sum() for p in model.parameters())).backward()
    # Every parameter is in the graph even without text (DDP's all-reduce needs every gradient).
    model.zero_grad()
    model._errors({"latents": lat, "text": None, "text_mask": None}).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _doc_block_with(text: str) -> str:
    doc = (ROOT / "docs" / "your_own_model.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    return next(b for b in blocks if text in b)


def test_the_text_width_line_of_the_docs_prints_the_width_and_the_longest_text(tmp_path):
    shards = tmp_path / "data" / "wan_flow" / "train"
    write_synthetic_shards(
        str(shards), SyntheticShards(num_samples=12, samples_per_shard=6, text_len_range=(1, 12), text_dim=16)
    )
    from lightning_adaptiveload.shards.index import ShardIndex

    ShardIndex.for_paths(str(shards), save=str(shards / "index.json"), progress=False)
    block = _doc_block_with("text width")
    code = block.split('python -c "', 1)[1].rsplit('"', 1)[0]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120 * TIME_FACTOR
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    longest = max(t for s in ShardIndex.load(str(shards / "index.json")).shards for t in s.text_lengths)
    assert proc.stdout.strip() == f"text width 16 | longest text {longest}"


@pytest.mark.timeout(int(600 * TIME_FACTOR))
def test_train_python_fits_its_own_module_under_two_process_ddp(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "train_python.py"),
            "--devices",
            "2",
            "--max-steps",
            "4",
            "--num-samples",
            "48",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "runs"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=480 * TIME_FACTOR,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "LoadBalanceMonitor: 4 steps x 2 ranks" in out
    assert "runs_packed_batches" not in out  # it takes lockstep's packs: no bucketed-tail warning
    logs = tmp_path / "runs" / "logs" / "version_0"
    assert f"files: {logs}" in out  # a Python fit says where the monitor's files went
    assert (logs / "load_balance_steps.csv").is_file()
    rows = list(csv.DictReader(open(logs / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses and all(math.isfinite(v) for v in losses)

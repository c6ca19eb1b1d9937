"""FSDP2 (Lightning's ModelParallelStrategy + fully_shard) on CPU with gloo, 2 processes.

The tiny VideoDiT trains through the real data path (lockstep schedule) under DDP and under FSDP2 from the
same weights (``init_from``, which also exercises loading into a sharded meta-device model); the losses
must agree step by step. Also: a distributed checkpoint saved mid-epoch resumes to the same losses, the
monitor times compute by its FSDP2 method, and strategies that would not synchronise gradients are refused.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _ddp_data_runner import launch  # noqa: E402

from lightning_adaptiveload.data.shards import write_synthetic_shards  # noqa: E402
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig  # noqa: E402

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")

RUNNER = os.path.join(os.path.dirname(__file__), "_fsdp_runner.py")
SIZES = [9, 4, 7, 5, 8, 3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    data = str(root / "shards")
    write_synthetic_shards(data, mix="tiny", num_samples=sum(SIZES), samples_per_shard=SIZES, seed=5, progress=False)
    weights = root / "weights"
    weights.mkdir()
    torch.manual_seed(11)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    with torch.no_grad():  # a non-zero head, so that the first losses depend on every block
        model.head.head.weight.normal_(std=0.02)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(weights / "diffusion_pytorch_model.safetensors"),
    )
    return {"data": data, "init_from": str(weights)}


def _run(setup: dict, out: str, runs: list[dict], timeout: float = 150) -> None:
    os.makedirs(out, exist_ok=True)
    launch({**setup, "out": out, "world": 2, "runs": runs}, out, timeout=timeout, script=RUNNER)


def _losses(out: str, name: str) -> list[list[tuple[int, float]]]:
    rows = []
    for r in range(2):
        path = os.path.join(out, f"{name}.rank{r}.jsonl")
        rows.append([(d["global_step"], d["loss"]) for d in map(json.loads, open(path))] if os.path.exists(path) else [])
    return rows


def _errors(out: str, name: str) -> list[str]:
    return [open(p).read() for r in range(2) if os.path.exists(p := os.path.join(out, f"{name}.rank{r}.error"))]


@pytest.mark.timeout(240)
def test_fsdp2_matches_ddp_resumes_and_is_timed(setup, tmp_path):
    out = str(tmp_path)
    steps = 6
    _run(
        setup,
        out,
        [
            {"name": "ddp", "strategy": "ddp", "max_steps": steps, "clip": 1.0},
            {"name": "fsdp", "strategy": "fsdp2", "max_steps": steps, "clip": 1.0, "ckpt_every": 3},
            {"name": "fused", "strategy": "fsdp2", "max_steps": 3, "fused": True, "checkpointing": True, "clip": 1.0},
        ],
        timeout=220,
    )
    ddp, fsdp, fused = _losses(out, "ddp"), _losses(out, "fsdp"), _losses(out, "fused")
    assert [len(r) for r in ddp] == [steps, steps], _errors(out, "ddp")
    assert [len(r) for r in fsdp] == [steps, steps], _errors(out, "fsdp")
    for rank in range(2):
        # Same data, same weights, same noise: only the reduction order differs (reduce-scatter vs all-reduce).
        torch.testing.assert_close(
            torch.tensor([x for _, x in fsdp[rank]]), torch.tensor([x for _, x in ddp[rank]]), rtol=1e-4, atol=1e-6
        )
        # Fusion and activation checkpointing under fully_shard change nothing (the CPU path of the op).
        torch.testing.assert_close(
            torch.tensor([x for _, x in fused[rank]]), torch.tensor([x for _, x in ddp[rank][:3]]), rtol=1e-4, atol=1e-6
        )
    # Training moved the weights: the losses are not all the same number.
    assert len({round(x, 6) for _, x in ddp[0]}) > 1

    meta = json.load(open(os.path.join(out, "fsdp.monitor.json")))["meta"]
    assert meta["timing_method"] == "fsdp2_post_backward"
    assert json.load(open(os.path.join(out, "ddp.monitor.json")))["meta"]["timing_method"] == "ddp_comm_hook"

    ckpt = os.path.join(out, "fsdp-ckpt", "at-3.ckpt")
    assert os.path.isdir(ckpt), os.listdir(os.path.join(out, "fsdp-ckpt"))  # a distributed checkpoint: a folder
    # Kill at step 4 of a fresh run (after its own checkpoint at 3 was written), then resume from that one.
    _run(
        setup,
        out,
        [
            {"name": "killed", "strategy": "fsdp2", "max_steps": steps, "clip": 1.0, "ckpt_every": 3, "kill_at": 4},
            {
                "name": "resumed",
                "strategy": "fsdp2",
                "max_steps": steps,
                "clip": 1.0,
                "resume": os.path.join(out, "killed-ckpt", "at-3.ckpt"),
            },
        ],
        timeout=200,
    )
    assert os.path.exists(os.path.join(out, "killed.crashed"))
    resumed = _losses(out, "resumed")
    for rank in range(2):
        assert [s for s, _ in resumed[rank]] == list(range(3, steps)), _errors(out, "resumed")
        torch.testing.assert_close(
            torch.tensor([x for _, x in resumed[rank]]),
            torch.tensor([x for _, x in fsdp[rank][3:]]),
            rtol=1e-4,
            atol=1e-6,
        )


@pytest.mark.timeout(120)
def test_fsdp2_compute_time_leaves_out_the_wait(setup, tmp_path):
    # Rank 1 sleeps 0.3 s at the start of every backward: its compute includes the sleep, rank 0 waits
    # for it in the all-gathers of the backward, and that wait must not count as rank 0's compute.
    out = str(tmp_path)
    skew = 0.3
    _run(setup, out, [{"name": "skew", "strategy": "fsdp2", "max_steps": 4, "skew": skew}], timeout=100)
    summary = json.load(open(os.path.join(out, "skew.monitor.json")))
    assert summary["meta"]["timing_method"] == "fsdp2_post_backward"
    compute = [row for block in summary["rank_compute_s"] for row in block]
    assert len(compute) == 4
    for fast, slow in compute[1:]:  # the first step also initialises FSDP
        assert slow - fast > 0.5 * skew, compute


@pytest.mark.timeout(120)
def test_model_parallel_strategy_without_sharding_is_refused(setup, tmp_path):
    out = str(tmp_path)
    _run(setup, out, [{"name": "bare", "strategy": "fsdp2_unsharded", "max_steps": 2}], timeout=100)
    errors = _errors(out, "bare")
    assert len(errors) == 2
    assert all("UnsupportedStrategyError" in e and "ModelParallelStrategy" in e and "shard_model" in e for e in errors)
    assert _losses(out, "bare") == [[], []]  # not one step ran

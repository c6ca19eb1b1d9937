"""Sequence parallelism through the data path (CPU, gloo): a whole epoch of AdaptiveLoadDataModule on 4
processes as 2 data-parallel groups x 2 sequence ranks gives, step by step, the losses of 2-process DDP on the
same data and weights, under DDP and under FSDP2; and a kill and resume mid-epoch under the mesh reads every
sample exactly once.

The plain run plans with the group's budget and cost model (``max_tokens`` of one group, the cost of one
GPU of a group: ``planning/groups.py``), so that both runs take the same batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _ddp_data_runner import launch
from _paths import TESTS

from lightning_adaptiveload.planning.cost_model import CostModel, SequenceComm

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("lightning_adaptiveload.models.sequence_parallel")

RUNNER = str(TESTS / "_sp_data_runner.py")
SIZES = [9, 4, 7, 5, 8, 3]
COMM = SequenceComm(hidden=64, layers=2, link_gb_per_s=10.0)
CLOSE = {"rtol": 1e-4, "atol": 1e-6}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, synthetic_shards) -> dict:
    from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

    root = tmp_path_factory.mktemp("sp-epoch")
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
    per_gpu = CostModel.default()
    return {
        "data": synthetic_shards(SIZES, seed=5),
        "init_from": str(weights),
        "per_gpu_cost_model": per_gpu.to_dict(),
        "cost_model": per_gpu.sequence_parallel(2, COMM).to_dict(),
        "sequence_comm": COMM.to_dict(),
    }


def _run(setup: dict, out: str, world: int, runs: list[dict], timeout: float) -> None:
    os.makedirs(out, exist_ok=True)
    runs = [{"max_epochs": 1, **run} for run in runs]
    launch({**setup, "out": out, "world": world, "runs": runs}, out, timeout=timeout, script=RUNNER)


def _rows(out: str, name: str, world: int) -> list[list[dict]]:
    rows = []
    for r in range(world):
        path = os.path.join(out, f"{name}.rank{r}.jsonl")
        rows.append([json.loads(line) for line in open(path)] if os.path.exists(path) else [])
    return rows


def _losses(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([d["loss"] for d in rows], dtype=torch.float64)


def _all_keys(data: str) -> list[str]:
    from _fixtures import index_keys

    return index_keys(data)


@pytest.mark.timeout(600)
def test_an_epoch_in_groups_of_two_matches_ddp_and_resumes_exactly_once(setup, tmp_path):
    out = str(tmp_path)
    # equal_tokens: batches of up to 21 samples, so that the token weighting across the groups counts.
    epoch = {"max_tokens": 512, "sizing": "equal_tokens", "schedule": "lockstep", "lockstep_tail": "bucketed"}
    _run(setup, out, 2, [{"name": "ddp", "strategy": "ddp", **epoch}], timeout=240)
    ckpt = os.path.join(out, "killed-ckpt", "at-2.ckpt")
    sp = {"sequence_parallel": 2, **epoch}
    _run(
        setup,
        out,
        4,
        [
            {"name": "sp_ddp", "strategy": "ddp", **sp},
            {"name": "sp_fsdp2", "strategy": "fsdp2", **sp},
            {"name": "killed", "strategy": "ddp", "ckpt_every": 2, "kill_at": 3, **sp},
            {"name": "resumed", "strategy": "ddp", "resume": ckpt, **sp},
        ],
        timeout=540,
    )
    ddp = _rows(out, "ddp", 2)
    steps = len(ddp[0])
    assert steps >= 4 and len(ddp[1]) == steps
    assert max(len(d["keys"]) for d in ddp[0]) > 1
    assert len({round(d["loss"], 6) for d in ddp[0]}) > 1  # training moved the weights
    keys = _all_keys(setup["data"])
    for name in ("sp_ddp", "sp_fsdp2"):
        runs = _rows(out, name, 4)
        for r in range(4):
            plain = ddp[r // 2]  # ranks 2d and 2d + 1 form data group d
            assert [d["keys"] for d in runs[r]] == [d["keys"] for d in plain], (name, r)
            assert [d["global_tokens"] for d in runs[r]] == [d["global_tokens"] for d in plain]
            torch.testing.assert_close(_losses(runs[r]), _losses(plain), **CLOSE, msg=f"{name} rank {r}")
    # Killed after 3 steps, resumed from the checkpoint of step 2 on the same mesh: every sample once, and the
    # losses of the uninterrupted run.
    assert os.path.exists(os.path.join(out, "killed.crashed"))
    killed, resumed = _rows(out, "killed", 4), _rows(out, "resumed", 4)
    for r in range(4):
        assert [d["global_step"] for d in killed[r]] == [0, 1, 2]
        assert [d["global_step"] for d in resumed[r]] == list(range(2, steps))
        torch.testing.assert_close(_losses(resumed[r]), _losses(ddp[r // 2][2:]), **CLOSE)
    read = [k for r in (0, 2) for d in killed[r][:2] + resumed[r] for k in d["keys"]]
    assert sorted(read) == sorted(keys)

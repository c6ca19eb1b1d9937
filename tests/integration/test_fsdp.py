"""FSDP2 (Lightning's ModelParallelStrategy + fully_shard) on CPU with gloo, 2 processes.

The tiny VideoDiT trains through the real data path (lockstep schedule) under DDP and under FSDP2 from the
same weights (``init_from``, which also exercises loading into a sharded meta-device model); the losses
must agree step by step. Also: a distributed checkpoint saved mid-epoch resumes to the same losses, the
monitor times compute by its FSDP2 method, and strategies that would not synchronise gradients are refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _ddp_data_runner import launch
from _paths import TESTS

from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")

RUNNER = str(TESTS / "_fsdp_runner.py")
SIZES = [9, 4, 7, 5, 8, 3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, synthetic_shards) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    data = synthetic_shards(SIZES, seed=5)
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


def _run(setup: dict, out: str, runs: list[dict], timeout: float = 150, num_nodes: int = 1) -> None:
    os.makedirs(out, exist_ok=True)
    launch(
        {**setup, "out": out, "world": 2, "runs": runs, "num_nodes": num_nodes},
        out,
        timeout=timeout,
        script=RUNNER,
    )


def _keys(out: str, name: str) -> list[list[str]]:
    return [
        [k for d in map(json.loads, open(os.path.join(out, f"{name}.rank{r}.jsonl"))) for k in d["keys"]]
        for r in range(2)
    ]


def _losses(out: str, name: str) -> list[list[tuple[int, float]]]:
    rows = []
    for r in range(2):
        path = os.path.join(out, f"{name}.rank{r}.jsonl")
        rows.append(
            [(d["global_step"], d["loss"]) for d in map(json.loads, open(path))]
            if os.path.exists(path)
            else []
        )
    return rows


def _errors(out: str, name: str) -> list[str]:
    return [
        open(p).read() for r in range(2) if os.path.exists(p := os.path.join(out, f"{name}.rank{r}.error"))
    ]


def _column(rows: list[tuple[int, float]]) -> torch.Tensor:
    return torch.tensor([x for _, x in rows])


@pytest.mark.timeout(240)
def test_fsdp2_matches_ddp_resumes_and_is_timed(setup, tmp_path):
    out = str(tmp_path)
    steps = 6
    ckpt = os.path.join(out, "killed-ckpt", "at-3.ckpt")
    _run(
        setup,
        out,
        [
            {"name": "ddp", "strategy": "ddp", "max_steps": steps, "clip": 1.0},
            {
                "name": "fused",
                "strategy": "fsdp2",
                "max_steps": 3,
                "fused": True,
                "checkpointing": True,
                "clip": 1.0,
            },
            # Checkpoint at step 3, crash at step 4, resume from the checkpoint in a new Trainer.
            {
                "name": "killed",
                "strategy": "fsdp2",
                "max_steps": steps,
                "clip": 1.0,
                "ckpt_every": 3,
                "kill_at": 4,
            },
            {"name": "resumed", "strategy": "fsdp2", "max_steps": steps, "clip": 1.0, "resume": ckpt},
        ],
        timeout=220,
    )
    ddp, fused, killed, resumed = (_losses(out, n) for n in ("ddp", "fused", "killed", "resumed"))
    assert [len(r) for r in ddp] == [steps, steps], _errors(out, "ddp")
    assert os.path.exists(os.path.join(out, "killed.crashed")), _errors(out, "killed")
    assert os.path.isdir(ckpt)  # a distributed checkpoint (one file per rank): a folder
    for rank in range(2):
        # Same data, weights and noise: only the gradient reduction differs (reduce-scatter vs all-reduce).
        close = {"rtol": 1e-4, "atol": 1e-6}
        assert [s for s, _ in killed[rank]] == [0, 1, 2, 3], _errors(out, "killed")
        torch.testing.assert_close(_column(killed[rank]), _column(ddp[rank][:4]), **close)
        # Fusion and activation checkpointing under fully_shard change nothing (the op's CPU path here).
        torch.testing.assert_close(_column(fused[rank]), _column(ddp[rank][:3]), **close)
        # The resumed run continues the uninterrupted one: weights, optimizer, data position and noise.
        assert [s for s, _ in resumed[rank]] == list(range(3, steps)), _errors(out, "resumed")
        torch.testing.assert_close(_column(resumed[rank]), _column(ddp[rank][3:]), **close)
    # Training moved the weights: the losses are not all the same number.
    assert len({round(x, 6) for _, x in ddp[0]}) > 1
    assert (
        json.load(open(os.path.join(out, "resumed.monitor.json")))["meta"]["timing_method"]
        == "fsdp2_post_backward"
    )
    assert json.load(open(os.path.join(out, "ddp.monitor.json")))["meta"]["timing_method"] == "backward_end"


@pytest.mark.timeout(150)
def test_two_nodes_take_ranks_from_the_trainer_and_hsdp_matches_ddp(setup, tmp_path):
    # Two "nodes" of one process each: LOCAL_RANK is 0 on both, so anything that read the rank from the
    # environment would give both the same data. Lightning's mesh is then (2 nodes x 1 GPU): HSDP.
    out = str(tmp_path)
    runs = [{"name": n, "strategy": n, "max_steps": 3} for n in ("ddp", "fsdp2")]
    _run(setup, out, runs, timeout=140, num_nodes=2)
    ddp, hsdp = _losses(out, "ddp"), _losses(out, "fsdp2")
    assert [len(r) for r in hsdp] == [3, 3], _errors(out, "fsdp2")
    keys = _keys(out, "fsdp2")
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])  # each rank its own samples
    assert keys == _keys(out, "ddp")
    for rank in range(2):
        torch.testing.assert_close(_column(hsdp[rank]), _column(ddp[rank]), rtol=1e-4, atol=1e-6)
    meta = json.load(open(os.path.join(out, "fsdp2.monitor.json")))["meta"]
    assert meta["world_size"] == 2 and meta["timing_method"] == "fsdp2_post_backward"


SKEW_S = 0.3


@pytest.fixture(scope="module")
def small_runs(setup, tmp_path_factory) -> str:
    """One launch for the short runs: a module that does not shard, and a run with a slow rank 1."""
    out = str(tmp_path_factory.mktemp("fsdp-small"))
    _run(
        setup,
        out,
        [
            {"name": "bare", "strategy": "fsdp2_unsharded", "max_steps": 2},
            {"name": "skew", "strategy": "fsdp2", "max_steps": 4, "skew": SKEW_S},
            {"name": "full", "strategy": "fsdp2_full", "max_steps": 4, "ckpt_every": 2},
            {
                "name": "fullres",
                "strategy": "fsdp2_full",
                "max_steps": 4,
                "resume": os.path.join(out, "full-ckpt", "at-2.ckpt"),
            },
        ],
        timeout=110,
    )
    return out


@pytest.mark.timeout(120)
def test_fsdp2_compute_time_leaves_out_the_wait(small_runs):
    # Rank 1 sleeps at the start of every backward: its compute includes the sleep, rank 0 waits for it in
    # the backward's all-gathers, and that wait must not count as rank 0's compute.
    summary = json.load(open(os.path.join(small_runs, "skew.monitor.json")))
    assert summary["meta"]["timing_method"] == "fsdp2_post_backward"
    compute = [row for block in summary["rank_compute_s"] for row in block]
    assert len(compute) == 4
    for fast, slow in compute[1:]:  # the first step also initialises FSDP
        assert slow - fast > 0.5 * SKEW_S, compute


@pytest.mark.timeout(120)
def test_fsdp2_full_checkpoint_resumes(small_runs):
    # save_distributed_checkpoint=False: one file gathered on rank 0, loaded back into the shards.
    assert os.path.isfile(os.path.join(small_runs, "full-ckpt", "at-2.ckpt"))
    full, resumed = _losses(small_runs, "full"), _losses(small_runs, "fullres")
    for rank in range(2):
        assert [s for s, _ in resumed[rank]] == [2, 3], _errors(small_runs, "fullres")
        torch.testing.assert_close(_column(resumed[rank]), _column(full[rank][2:]), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(120)
def test_model_parallel_strategy_without_sharding_is_refused(small_runs):
    errors = _errors(small_runs, "bare")
    assert len(errors) == 2
    assert all(
        "UnsupportedStrategyError" in e and "ModelParallelStrategy" in e and "shard_model" in e
        for e in errors
    )
    assert _losses(small_runs, "bare") == [[], []]  # not one step ran


class _Module:
    def __init__(self, weight_dtype: str):
        from lightning_adaptiveload.models.module_settings import OptimizerSettings

        self.optimizer_settings = OptimizerSettings(weight_dtype=weight_dtype)


def _strategy(name: str, world: int, base: type = object):
    return type(name, (base,), {"world_size": world})()


def test_check_strategy_refuses_what_does_not_synchronise():
    from lightning_adaptiveload.models.strategies import UnsupportedStrategyError, check_strategy

    module = _Module(weight_dtype="fp32")
    assert check_strategy(None, module) is None
    assert check_strategy(_strategy("SingleDeviceStrategy", 1), module) is None
    ddp = type("DDPStrategy", (), {"world_size": 2})
    assert check_strategy(_strategy("DeepSpeedStrategy", 2, ddp), module) == "ddp"  # by the MRO
    assert check_strategy(_strategy("FSDPStrategy", 2), module) == "fsdp"
    assert check_strategy(_strategy("ModelParallelStrategy", 2), module) == "fsdp2"
    with pytest.raises(UnsupportedStrategyError, match="MyStrategy runs 2 processes.*ModelParallelStrategy"):
        check_strategy(_strategy("MyStrategy", 2), module)
    with pytest.raises(UnsupportedStrategyError, match="weight_dtype='bf16' under ModelParallelStrategy"):
        check_strategy(_strategy("ModelParallelStrategy", 2), _Module(weight_dtype="bf16"))


def test_shard_model_names_what_is_missing():
    from lightning_adaptiveload.models.sharding import ShardingError, shard_model

    with pytest.raises(ShardingError, match="mesh is None.*device_mesh"):
        shard_model(torch.nn.Linear(2, 2), None)

    class Mesh:
        ndim, shape, mesh_dim_names, device_type = 1, (2,), ("dp",), "cpu"

    with pytest.raises(ShardingError, match="Linear has no `blocks` attribute; pass blocks="):
        shard_model(torch.nn.Linear(2, 2), Mesh())
    with pytest.raises(ShardingError, match="3-D device mesh"):
        shard_model(torch.nn.Linear(2, 2), type("M3", (Mesh,), {"ndim": 3, "shape": (1, 1, 2)})())


def test_fsdp_step_marks_subtract_the_waits():
    from lightning_adaptiveload.monitor.fsdp_timing import FsdpStepMarks

    class Clock:  # marks are plain seconds
        @staticmethod
        def seconds(a, b):
            return b - a

    marks = FsdpStepMarks(end=10.0, waits=[(1.0, 3.0), (6.0, 6.5)])
    assert marks.compute_seconds(Clock, 0.0) == pytest.approx(7.5)

"""Ulysses sequence parallelism (``models/sequence_parallel.py``): a tiny VideoDiT split over 2 and 4 gloo
processes gives one process's forward and gradients; the refusals; a user's own attention layer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from _ddp_data_runner import launch  # noqa: E402
from _sp_runner import CASES, tiny_model  # noqa: E402

from lightning_adaptiveload.models import sequence_parallel as sp  # noqa: E402

RUNNER = str(TESTS / "_sp_runner.py")


def _reference(name: str, checkpointing: bool = False) -> dict:
    model = tiny_model(checkpointing)
    inputs, weight = CASES[name]()
    out = model(*inputs)
    (out * weight).sum().backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return {"out": out.detach(), "grads": grads}


def _check(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        # A gradient is a sum over tokens, added in another order on G ranks: the absolute tolerance scales
        # with the tensor's largest entry (fp32 rounding of a sum with cancellation), rtol as asked.
        atol = 1e-5 * float(g.abs().max()) + 1e-7
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
    # the check can fail: the batch reaches the parameters at all
    assert any(g.abs().sum() > 0 for n, g in want["grads"].items() if n.startswith("blocks.0.self_attn"))


@pytest.mark.parametrize(
    ("world", "degree", "checkpointing", "fsdp2"),
    [(2, 2, False, False), (4, 4, False, False), (4, 2, True, False), (4, 2, False, True)],
    ids=["g2", "g4", "2x2-ckpt", "2x2-fsdp2"],
)
def test_sharded_model_matches_one_process(tmp_path, world, degree, checkpointing, fsdp2):
    """Degree 2 and 4 (and 2 data x 2 sequence groups with activation checkpointing, or sharded by FSDP2
    over all four ranks): every rank's output and its group-averaged gradients (FSDP2: its world-averaged
    ones) equal one process's, fp32, for a clip, images (9 tokens: padded), a batch without text, and one
    with per-token timesteps. Degree 2 runs with the fused norm-modulate sites switched on."""
    cases = list(CASES)
    cfg = {"out": str(tmp_path), "world": world, "degree": degree, "cases": cases, "checkpointing": checkpointing}
    cfg["fsdp2"] = fsdp2
    cfg["fused"] = world == degree == 2  # degree 2 with the fused op's sites switched on (reference: eager)
    launch(cfg, str(tmp_path), timeout=300, script=RUNNER)
    for name in cases:
        want = _reference(name, checkpointing)
        for rank in range(world):
            _check(torch.load(tmp_path / f"{name}.rank{rank}.pt"), want)


def test_heads_not_divisible_is_refused():
    model = tiny_model()  # 4 heads
    group = _single_process_group()
    try:
        with pytest.raises(ValueError, match="4 heads are not divisible by the sequence-parallel degree 3"):
            sp._check_heads(model.config.num_heads, 3)
        model.set_sequence_group(group)  # degree 1 divides anything
        with pytest.raises(ValueError, match="pack .* not supported"):
            model([torch.zeros(16, 1, 2, 2)], torch.zeros(1))
    finally:
        dist.destroy_process_group()


def _single_process_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def test_degree_one_is_the_plain_model():
    """A group of one rank: the sharded path (shard, all-to-all, gather) is the identity."""
    group = _single_process_group()
    try:
        want = _reference("images")
        model = tiny_model()
        model.set_sequence_group(group)
        inputs, weight = CASES["images"]()
        out = model(*inputs)
        (out * weight).sum().backward()
        _check({"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}, want)
        import copy

        assert copy.deepcopy(model).sequence_group is group  # an EMA / meta copy shares the group
    finally:
        dist.destroy_process_group()


def test_compiled_blocks_trace_the_all_to_all():
    """Blocks compiled by dynamo (aot_eager: tracing and autograd, no C++ build) on the sharded path: one
    graph, no graph break at the all-to-all, the eager model's gradients. (Degree 1: the exchange is traced
    all the same; the multi-process equality is the tests above.)"""
    import torch._dynamo.utils as dynamo_utils

    group = _single_process_group()
    try:
        want = _reference("images")
        model = tiny_model()
        model.set_sequence_group(group)
        for block in model.blocks:
            block.compile(backend="aot_eager")
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        inputs, weight = CASES["images"]()
        out = model(*inputs)
        (out * weight).sum().backward()
        assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
        assert dynamo_utils.counters["stats"]["unique_graphs"] >= 1
        _check({"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}, want)
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_auto_checkpointing_sizes_the_shard_not_the_sequence(monkeypatch):
    """checkpoint_blocks "auto" under degree G chooses from the memory of S/G tokens per GPU (padded): 9
    tokens at G = 4 are sized as 3. (The degree is faked: the prologue runs no collective.)"""
    model = tiny_model()
    model.set_activation_checkpointing(True, num_blocks="auto", memory=_memory(model), budget_bytes=1e12)
    seen = []
    monkeypatch.setattr(model, "_choose_checkpointing", lambda b, s, t: seen.append((b, s, t)))
    (x, t, ctx, mask), _ = CASES["images"]()  # (3, 16, 1, 6, 6): 9 tokens per sample
    grid = model._check_input(x)
    model._dense_prologue(x, grid, t, ctx, mask)
    monkeypatch.setattr(sp, "_degree_and_rank", lambda group: (4, 1))
    model._sequence.group = object()  # any group: its size comes from the fake above
    model._dense_prologue(x, grid, t, ctx, mask)
    assert seen == [(3, 9, 5), (3, 3, 5)]


def _memory(model):
    from lightning_adaptiveload.models.memory import ActivationMemory

    n = len(model.blocks)
    return ActivationMemory(
        num_blocks=n, base_bytes=1e6, token_all=1e3, text_all=1e3, token_block=1e3, text_block=1e3
    )


def test_shard_and_padding_helpers():
    assert sp.padded_length(9, 4) == 12 and sp.padded_length(8, 4) == 8


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = tmp_path_factory.mktemp("sp_weights")
    model = tiny_model()
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "diffusion_pytorch_model.safetensors"),
    )
    return str(folder)


def _losses(out: Path, name: str, rank: int) -> list[float]:
    lines = (out / f"{name}.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if "loss" in x]


@pytest.mark.parametrize(("reference", "strategy"), [("ddp", "sp_ddp"), ("fsdp2", "sp_fsdp2")])
def test_fit_2_data_x_2_sequence_equals_2_process_data_parallel(tmp_path, weights, reference, strategy):
    """Three Lightning steps on 4 processes as 2 data x 2 sequence (SequenceParallelStrategy /
    SequenceParallelFSDPStrategy) give 2-process DDP's (FSDP2's) losses, rank by data rank: the sampler
    splits by data group, the noise is the data rank's, the loss weights and gradients are exact."""
    for name, world in ((reference, 2), (strategy, 4)):
        cfg = {"out": str(tmp_path), "world": world, "fit": {"strategy": name, "degree": 2, "init_from": weights, "max_steps": 3}}
        launch(cfg, str(tmp_path), timeout=400, script=RUNNER)
    for rank in range(4):
        want, got = _losses(tmp_path, reference, rank // 2), _losses(tmp_path, strategy, rank)
        assert len(want) == len(got) == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


def test_own_model_example(tmp_path):
    """examples/sequence_parallel/own_model_ulysses.py: a user's model calling the three functions matches
    one process (the example checks it and exits non-zero otherwise)."""
    import subprocess

    script = TESTS.parent / "examples" / "sequence_parallel" / "own_model_ulysses.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--world", "2", "--out", str(tmp_path / "r.pt")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equals one process's" in proc.stdout


def test_sp_recipe_builds_the_strategy_and_plans_the_same_degree():
    """recipes/wan14b_720p_sp.yaml names SequenceParallelFSDPStrategy (FSDP2: ModelParallelStrategy in its
    MRO, so the module shards itself) with the plan's degree, which divides wan-14b's 40 heads."""
    import yaml
    from lightning.pytorch.cli import LightningArgumentParser
    from lightning.pytorch.strategies import Strategy

    from lightning_adaptiveload.models.module import SequenceParallelFSDPStrategy
    from lightning_adaptiveload.models.strategies import check_strategy

    for root in (TESTS.parent / "recipes", TESTS.parent / "lightning_adaptiveload" / "recipes"):
        config = yaml.safe_load((root / "wan14b_720p_sp.yaml").read_text())
        parser = LightningArgumentParser()
        parser.add_argument("--strategy", type=Strategy)
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        built = instantiate(parser.parse_object({"strategy": config["trainer"]["strategy"]})).strategy
        assert isinstance(built, SequenceParallelFSDPStrategy)
        assert built.sequence_parallel_size == config["data"]["init_args"]["plan"]["sequence_parallel"] == 4
        assert check_strategy(built, None) == "fsdp2"
        assert 40 % built.sequence_parallel_size == 0


def test_strategy_refuses_a_bad_degree():
    from lightning_adaptiveload.models.module import SequenceParallelStrategy

    with pytest.raises(ValueError, match="sequence_parallel_size must be an integer >= 1, got 0"):
        SequenceParallelStrategy(0)

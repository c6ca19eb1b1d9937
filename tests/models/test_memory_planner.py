"""The memory planner's arithmetic (lightning_adaptiveload.models.memory): pure, milliseconds."""

from __future__ import annotations

import pytest

from lightning_adaptiveload.models.memory import GB, activation_bytes_per_token, estimate_memory


def test_ddp_state_is_twenty_bytes_per_parameter_on_every_gpu():
    one = estimate_memory(1e9, 80, 1, 0, 1.0, "ddp")
    eight = estimate_memory(1e9, 80, 8, 0, 1.0, "ddp")
    assert one.state_gb == pytest.approx(20.0) and eight.state_gb == pytest.approx(20.0)


def test_fsdp2_state_shrinks_with_gpus_down_to_the_gathered_units():
    params, block = 14e9, 0.35e9
    states = [
        estimate_memory(params, 141, g, 0, 1.0, "fsdp2", block_params=block).state_gb for g in (1, 2, 8, 64)
    ]
    assert states == sorted(states, reverse=True)
    assert states[1] == pytest.approx(params * 16 / 2 / GB + block * 8 / GB)
    offloaded = estimate_memory(params, 141, 1, 0, 1.0, "fsdp2", block_params=block, cpu_offload=True)
    assert offloaded.state_gb == pytest.approx(block * 8 / GB) and offloaded.host_gb == pytest.approx(
        params * 16 / GB
    )


@pytest.mark.parametrize("strategy,gpus", [("ddp", 1), ("fsdp2", 2), ("fsdp2", 8)])
def test_max_tokens_that_fit_is_the_boundary_of_fits(strategy, gpus):
    bpt = activation_bytes_per_token(1536, 8960, 30)
    e = estimate_memory(1.4e9, 80, gpus, 1000, bpt, strategy)
    n = e.max_tokens_that_fit
    assert estimate_memory(1.4e9, 80, gpus, n, bpt, strategy).fits
    assert not estimate_memory(1.4e9, 80, gpus, n + 1, bpt, strategy).fits


def test_checkpointing_keeps_fewer_activations():
    assert activation_bytes_per_token(5120, 13824, 40, True) < activation_bytes_per_token(
        5120, 13824, 40, False
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="strategy must be"):
        estimate_memory(1e9, 80, 1, 0, 1.0, "zero3")
    with pytest.raises(ValueError, match="cpu_offload=True needs strategy='fsdp2'"):
        estimate_memory(1e9, 80, 1, 0, 1.0, "ddp", cpu_offload=True)
    with pytest.raises(ValueError, match="gpus >= 1"):
        estimate_memory(1e9, 80, 0, 0, 1.0)

"""Gradients of a ``VideoDiT`` sharded with FSDP2, without Lightning, against DDP's (2 CPU processes, gloo).

Run by ``tests/_fsdp_runner.py`` (a run with ``"strategy": "model_checks"``) in its process group. For each
case (rank 0 with text, rank 1 without; no rank with text; a pack with text on each rank) every rank runs
forward and backward of ``shard_model(VideoDiT(tiny))`` on its own inputs and compares the full gradients
(gathered from the shards) with those of an unsharded copy averaged over both ranks' inputs, as DDP
would. Each rank writes ``<out>/model_checks.rank<r>.json``: per case ``{"ok": bool, "error": str | None,
"max_rel_diff": float, "zero_text_grads": bool}``; a case that raises is reported, and the later ones run.
"""

from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist

from lightning_adaptiveload.models.sharding import shard_model
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig


def _inputs(case: str, rank: int) -> tuple[str, tuple]:
    """The forward's arguments of ``case`` on ``rank``: ("dense" | "packed", args), drawn from a seed per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    text_dim = VideoDiTConfig.preset("tiny").text_dim
    if case == "packed":  # two shapes in one pack, each sample with its own text
        latents = [torch.randn(16, 2, 4, 6, generator=g), torch.randn(16, 1, 6, 4, generator=g)]
        t = torch.rand(2, generator=g) * 1000
        text = torch.randn(2, 3, text_dim, generator=g)
        mask = torch.tensor([[True, True, False], [True, True, True]])
        return "packed", (latents, t, text, mask)
    x = torch.randn(2, 16, 2, 4, 4, generator=g)
    t = torch.rand(2, generator=g) * 1000
    with_text = case == "mixed_text" and rank == 0
    text = torch.randn(2, 3, text_dim, generator=g) if with_text else None
    return "dense", (x, t, text, None)


def _loss(model: torch.nn.Module, kind: str, args: tuple) -> torch.Tensor:
    if kind == "packed":
        return sum(out.square().sum() for out in model.forward_packed(*args))
    return model(*args).square().sum()


def _model() -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    with torch.no_grad():  # a non-zero head, so that every parameter's gradient carries signal
        model.head.head.weight.normal_(std=0.02)
    return model.train()


def run_case(case: str, rank: int, world: int, mesh) -> dict:
    reference = _model()
    for r in range(world):  # the average of the ranks' gradients: what DDP and FSDP reduce to
        kind, args = _inputs(case, r)
        (_loss(reference, kind, args) / world).backward()
    sharded = shard_model(_model(), mesh)
    kind, args = _inputs(case, rank)
    _loss(sharded, kind, args).backward()
    worst, text_grads = 0.0, []
    text_names = {n for n, p in reference.named_parameters() if "cross_attn" in n or "text_embedding" in n}
    for (name, ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters()):
        if p.grad is None:
            raise AssertionError(f"{name}: no gradient under FSDP2 (DDP gives every parameter one)")
        grad = p.grad.full_tensor()
        scale = ref.grad.abs().max().clamp_min(1e-12)
        worst = max(worst, float((grad - ref.grad).abs().max() / scale))
        if name in text_names:
            text_grads.append(float(grad.abs().max()))
    return {"ok": True, "error": None, "max_rel_diff": worst, "zero_text_grads": max(text_grads) == 0.0}


def run_checks(out: str, rank: int, world: int) -> None:
    """Every case on this rank (all ranks call it together); writes ``<out>/model_checks.rank<r>.json``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for case in ("mixed_text", "no_text", "packed"):
        try:
            results[case] = run_case(case, rank, world, mesh)
        except Exception as exc:  # reported per case; the test decides
            results[case] = {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        dist.barrier()
    with open(os.path.join(out, f"model_checks.rank{rank}.json"), "w") as f:
        json.dump(results, f)

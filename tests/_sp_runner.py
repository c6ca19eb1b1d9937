"""One rank of a CPU (gloo) run of Ulysses sequence parallelism (launched by tests/models/test_sequence_parallel.py
through ``tests/_ddp_data_runner.launch``, torchrun-style environment). No Lightning. Its tiny model
and batches (``tiny_model``, ``CASES``) are also the test's single-process reference.

Usage::

    python tests/_sp_runner.py CONFIG.json

CONFIG: {"out": dir, "world": N, "degree": G, "cases": [names of ``CASES``], "checkpointing": bool, "fsdp2": bool, "fused": bool,
"compile": bool}, or
{"out", "world", "fit": {...}} for a Lightning fit under a strategy (see :func:`fit`).
The ranks form N / G sequence groups of G consecutive ranks (the mesh ("data", "sequence"), data outer). Every
rank runs each case on the whole batch under ``VideoDiT.set_sequence_group`` and writes
``<out>/<case>.rank<r>.pt``: the output, and every parameter's gradient averaged over its sequence group.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig


def tiny_model(checkpointing: bool = False) -> VideoDiT:
    """The ``tiny`` preset (4 heads), float32, with a non-zero head (a zero head would zero every other
    gradient) and the same weights in every process."""
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    torch.nn.init.normal_(model.head.head.weight, std=0.1)
    if checkpointing:
        model.set_activation_checkpointing(True)
    return model.train()


def _batch(seed: int, shape: tuple[int, ...], text: bool, per_token: bool = False):
    g = torch.Generator().manual_seed(seed)
    b = shape[0]
    seq = shape[2] * (shape[3] // 2) * (shape[4] // 2)
    x = torch.randn(shape, generator=g)
    t = torch.rand((b, seq) if per_token else (b,), generator=g) * 1000
    ctx = mask = None
    if text:
        ctx = torch.randn(b, 5, 32, generator=g)
        mask = torch.ones(b, 5, dtype=torch.bool)
        mask[0, 3:] = False
    weight = torch.randn(shape, generator=g)  # the loss is (out * weight).sum()
    return (x, t, ctx, mask), weight


CASES = {
    "clip": lambda: _batch(1, (2, 16, 3, 4, 4), True),  # 12 tokens per sample
    "images": lambda: _batch(2, (3, 16, 1, 6, 6), True),  # 9 tokens: padded to 10 (G=2) or 12 (G=4)
    "no_text": lambda: _batch(3, (2, 16, 2, 4, 6), False),  # 12 tokens, no cross-attention
    "per_token_time": lambda: _batch(4, (1, 16, 3, 2, 6), True, per_token=True),  # 9 tokens, Wan 2.2 times
}



def fit_batches() -> list[dict]:
    """Six batches of the data path's contract (two per data rank and step at 2 data ranks), alternating a
    clip with text (12 tokens) and images without (9 tokens: padded under G = 2)."""
    out = []
    for i in range(6):
        g = torch.Generator().manual_seed(100 + i)
        clip = i % 2 == 0
        shape = (2, 16, 3, 4, 4) if clip else (2, 16, 1, 6, 6)
        batch = {"latents": torch.randn(shape, generator=g)}
        if clip:
            batch["text"] = torch.randn(2, 5, 32, generator=g)
            batch["text_mask"] = torch.ones(2, 5, dtype=torch.bool)
        out.append(batch)
    return out


def fit(cfg: dict) -> None:
    """``cfg["fit"]``: {"strategy": "ddp" | "fsdp2" | "sp_ddp" | "sp_fsdp2", "degree": G, "init_from": weights,
    "max_steps": n}. Every rank appends ``{"step", "loss"}`` lines to ``<out>/<strategy>.rank<r>.jsonl``."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_adaptiveload.models.module import (
        OptimizerSettings,
        SequenceParallelFSDPStrategy,
        SequenceParallelStrategy,
        VideoDiTModule,
    )

    run = cfg["fit"]
    name, degree = run["strategy"], int(run.get("degree", 1))
    strategy = {
        "ddp": lambda: DDPStrategy(process_group_backend="gloo"),
        # data_parallel_size: Lightning's default (the node count) would give both ranks the same batches
        "fsdp2": lambda: ModelParallelStrategy(2, 1, process_group_backend="gloo"),
        "sp_ddp": lambda: SequenceParallelStrategy(degree, process_group_backend="gloo"),
        "sp_fsdp2": lambda: SequenceParallelFSDPStrategy(degree, process_group_backend="gloo"),
    }[name]()
    path = os.path.join(cfg["out"], f"{name}.rank{os.environ['RANK']}.jsonl")

    class Recording(VideoDiTModule):
        def training_step(self, batch, batch_idx):
            loss, mse = self.compute_loss(batch)
            with open(path, "a") as f:
                f.write(json.dumps({"step": self.global_step, "loss": float(mse)}) + "\n")
            return loss

        def on_before_optimizer_step(self, optimizer):
            sq = 0.0
            for p in self.parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    sq += float(g.double().square().sum())
            with open(path, "a") as f:
                f.write(json.dumps({"step": self.global_step, "grad_sq": sq}) + "\n")

    pl.seed_everything(0)
    # eps >> |gradient|: AdamW's step is then about lr / eps x the gradient (a gradient off by G shows in
    # the next loss; AdamW's usual step, the gradient's sign, would hide it).
    module = Recording(
        preset="tiny", init_from=run["init_from"], optimizer=OptimizerSettings(lr=30.0, eps=100.0)
    )
    loader = torch.utils.data.DataLoader(fit_batches(), batch_size=None, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(cfg["world"]),
        strategy=strategy,
        max_steps=int(run["max_steps"]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)


def main() -> None:
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    if "fit" in cfg:
        return fit(cfg)
    dist.init_process_group("gloo")
    rank, world, degree = dist.get_rank(), dist.get_world_size(), int(cfg["degree"])
    groups = [dist.new_group(list(range(s, s + degree))) for s in range(0, world, degree)]
    group = groups[rank // degree]
    model = tiny_model(checkpointing=bool(cfg.get("checkpointing")))
    model.set_sequence_group(group)
    if cfg.get("fused"):  # the fused norm-modulate op at every site (on CPU: its reference path)
        for m in model.modules():
            if hasattr(m, "fused"):
                m.fused = True
    if cfg.get("compile"):  # each block compiled (aot_eager: dynamo and autograd tracing, no C++ build)
        for block in model.blocks:
            block.compile(backend="aot_eager")
    fsdp2 = bool(cfg.get("fsdp2"))
    if fsdp2:  # sharded over every rank: the reduce-scatter averages over the world (the strategy's layout)
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_adaptiveload.models.sharding import default_mp_policy, shard_model

        shard_model(model, init_device_mesh("cpu", (world,)), default_mp_policy("cpu"))
    for name in cfg["cases"]:
        model.zero_grad(set_to_none=True)
        inputs, weight = CASES[name]()
        out = model(*inputs)
        (out * weight).sum().backward()
        grads = {}
        for n, p in model.named_parameters():
            if fsdp2:  # every data group had the same batch: the world average is the reference
                grads[n] = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)
            grads[n] = g / degree
        torch.save({"out": out.detach(), "grads": grads}, os.path.join(cfg["out"], f"{name}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Ulysses sequence parallelism in a DiT of your own: three calls around your attention.

A plain-PyTorch transformer (token embedding, blocks of RoPE-free self-attention and an MLP, a head) whose
token sequence is split over the ranks of a process group. The model changes in three places only:

1. ``shard_sequence(tokens, group)`` after the embedding: each rank keeps S/G tokens (zero padded when
   G does not divide S);
2. ``ulysses_attention(q, k, v, group, seq_len=S)`` instead of the attention call: one all-to-all to head
   shards, attention over the whole sequence, one all-to-all back (the padded keys masked);
3. ``gather_sequence(out, group, length=S)`` before the loss: the whole output on every rank.

Every rank of the group must get the same batch. The gradients each rank holds average over the group to
one process's (``gather_sequence``'s ``grad_scale="mean"``), so DDP or FSDP over all ranks is exact.
Run it (CPU, gloo; spawns the processes itself and checks against one process)::

    python examples/sequence_parallel/own_model_ulysses.py --world 2
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lightning_adaptiveload.models.sequence_parallel import gather_sequence, shard_sequence, ulysses_attention


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, group=None, seq_len: int | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.n1(x)).unflatten(-1, (3, self.heads, -1)).unbind(2)  # (B, S or S/G, H, d)
        if group is None:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            a = a.transpose(1, 2)
        else:
            a = ulysses_attention(q, k, v, group, seq_len=seq_len)  # (B, S/G, H, d), the whole sequence seen
        x = x + self.o(a.flatten(2))
        return x + self.mlp(self.n2(x))


class TinyDiT(nn.Module):
    def __init__(self, in_dim: int = 8, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(in_dim, dim), nn.Linear(dim, in_dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, tokens: torch.Tensor, group=None) -> torch.Tensor:
        """tokens (B, S, in_dim), the same on every rank of ``group``; returns (B, S, in_dim) on every rank."""
        seq_len = tokens.shape[1]
        h = self.embed(tokens)
        if group is not None:
            h = shard_sequence(h, group)  # (1) this rank's tokens
        for block in self.blocks:
            h = block(h, group, seq_len)  # (2) inside: ulysses_attention
        out = self.head(h)
        return out if group is None else gather_sequence(out, group, length=seq_len)  # (3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 11, 8, generator=g), torch.randn(2, 11, 8, generator=g)  # 11 tokens: padded


def _model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, (x, target) = _model(), _batch()
    loss = F.mse_loss(model(x, dist.group.WORLD), target)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # what DDP does: the mean over ranks
        grads[name] = p.grad / world
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": grads}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="sequence-parallel ranks (divides the 4 heads)")
    parser.add_argument("--out", default="ulysses_example.pt", help="where rank 0 writes its result")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.world, port, args.out), nprocs=args.world)
    got = torch.load(args.out)
    model, (x, target) = _model(), _batch()
    loss = F.mse_loss(model(x), target)
    loss.backward()
    worst = max(float((got["grads"][n] - p.grad).abs().max()) for n, p in model.named_parameters())
    print(f"loss: {float(got['loss']):.6f} on {args.world} ranks, {loss.item():.6f} on one process")
    print(f"largest gradient difference: {worst:.2e}")
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-4, atol=1e-6)
    os.remove(args.out)
    print("sequence-parallel result equals one process's")


if __name__ == "__main__":
    main()

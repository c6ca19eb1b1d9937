"""Ulysses sequence parallelism: one sample's token sequence split over the G ranks of a process group.

Mental model. Every rank of a *sequence group* holds the same batch, and keeps 1/G of its tokens (a
contiguous run of the sequence, :func:`shard_sequence`). Everything that works token by token (norms,
modulation, the FFN, cross-attention to the full text, the head) runs on the local shard unchanged. Only
self-attention needs every token: :func:`ulysses_attention` trades the sequence split for a head split with
one all-to-all (B, S/G, H, d) -> (B, S, H/G, d), attends over the whole sequence with 1/G of the heads, and
trades back with a second all-to-all. :func:`gather_sequence` reassembles the output at the end.

Gradients. The autograd of an all-to-all is the reverse all-to-all, so the backward is exact. Each rank's
parameter gradients then hold the part that flowed through its own tokens; the full-batch gradient is their
**sum** over the group. :func:`gather_sequence` multiplies the gradient it passes back by G, so that the
**mean** over the group is that sum: data parallelism that averages over every rank of the mesh (DDP or
FSDP2 over the whole world) then gives exactly the gradient of DDP over the data-parallel groups alone.

Uneven lengths. A sequence of S tokens with S % G != 0 is zero padded to the next multiple of G
(:func:`padded_length`); the padded keys are masked out of self-attention and the padded rows dropped by
:func:`gather_sequence`, so the result is exact (the padding costs (G - S % G) tokens of work).

Plain torch and torch.distributed (no Lightning): works on gloo (CPU) and NCCL. See
``docs/sequence_parallel.md`` for a user's own model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_adaptiveload.models import attention as _attention

__all__ = [
    "GroupRef",
    "SequenceShard",
    "all_to_all",
    "gather_sequence",
    "padded_length",
    "shard_sequence",
    "ulysses_attention",
]


def _degree_and_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def padded_length(seq_len: int, degree: int) -> int:
    """``seq_len`` rounded up to a multiple of ``degree`` (the length every shard is cut from)."""
    return -(-int(seq_len) // int(degree)) * int(degree)


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    g = dist.get_world_size(group)
    if x.shape[scatter_dim] % g:
        raise ValueError(
            f"all_to_all: dimension {scatter_dim} of a {tuple(x.shape)} tensor is not divisible by the group's "
            f"{g} ranks"
        )
    # (G, ...) with chunk j of the scattered dimension first: all_to_all_single sends row j to rank j.
    send = torch.stack(x.chunk(g, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # row j came from rank j: rank order along gather_dim


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the reverse all-to-all (scatter and gather dimensions swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into G chunks along ``scatter_dim``, send chunk j to rank j of ``group``, and concatenate
    what arrives along ``gather_dim`` in rank order. Differentiable (the backward is the reverse exchange).

    Example: (B, S/G, H, d) with ``scatter_dim=2, gather_dim=1`` -> (B, S, H/G, d)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def shard_sequence(x: torch.Tensor, group: Any, dim: int = 1, pad_value: float = 0.0) -> torch.Tensor:
    """This rank's contiguous run of ``x`` along ``dim``, after padding that dimension to a multiple of G
    with ``pad_value``. Differentiable (a slice: the gradient is zero outside the shard).

    Args:
        x: any tensor, the same on every rank of ``group`` (e.g. (B, S, D) tokens or (S, d/2) RoPE tables).
        group: the sequence group (G ranks).
        dim: the sequence dimension.

    Returns:
        ``x`` narrowed to ``padded_length(S, G) / G`` entries along ``dim``, starting at rank x that length.
    """
    g, r = _degree_and_rank(group)
    dim = dim % x.dim()
    s = x.shape[dim]
    pad = padded_length(s, g) - s
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, widths, value=pad_value)
    local = x.shape[dim] // g
    return x.narrow(dim, r * local, local)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dimension; the backward keeps this rank's slice of the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, scale: float) -> torch.Tensor:
        g, r = _degree_and_rank(group)
        ctx.group, ctx.dim, ctx.scale, ctx.rank, ctx.local = group, dim, scale, r, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(g)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        return mine * ctx.scale if ctx.scale != 1 else mine.contiguous(), None, None, None


def gather_sequence(
    x: torch.Tensor, group: Any, dim: int = 1, length: int | None = None, grad_scale: str = "mean"
) -> torch.Tensor:
    """The whole sequence from every rank's shard (the inverse of :func:`shard_sequence`), on every rank.

    Args:
        x: this rank's shard, (..., S/G, ...) along ``dim``; the same shape on every rank.
        group: the sequence group.
        dim: the sequence dimension.
        length: the true length S, to drop :func:`shard_sequence`'s padding; None keeps every row.
        grad_scale: ``"mean"`` (default): the gradient passed back is G x this rank's slice, so that the
            mean of the ranks' parameter gradients over the group (what DDP and FSDP compute) is the
            full-sequence gradient; ``"sum"``: the plain slice (then sum the gradients over the group).

    Returns:
        (..., S, ...) on every rank.
    """
    if grad_scale not in ("mean", "sum"):
        raise ValueError(f"gather_sequence: grad_scale must be 'mean' or 'sum', got {grad_scale!r}")
    dim = dim % x.dim()
    scale = float(dist.get_world_size(group)) if grad_scale == "mean" else 1.0
    out = _GatherSequence.apply(x, group, dim, scale)
    return out if length is None else out.narrow(dim, 0, int(length))


def _check_heads(num_heads: int, degree: int) -> None:
    if num_heads % degree:
        raise ValueError(
            f"Ulysses sequence parallelism splits the attention heads over the sequence group: {num_heads} "
            f"heads are not divisible by the sequence-parallel degree {degree}; use a degree that divides "
            f"{num_heads} (e.g. {', '.join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)})"
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    seq_len: int | None = None,
    attend: Callable[..., torch.Tensor] | None = None,
    backends: Any = None,
) -> torch.Tensor:
    """Self-attention over a sequence split across ``group``: all-to-all to head shards, attention, back.

    Args:
        q, k, v: (B, S/G, H, d) this rank's shard of the queries, keys and values (after RoPE), the same
            shape on every rank; H divisible by G.
        group: the sequence group (G ranks; rank i holds tokens [i * S/G, (i + 1) * S/G)).
        seq_len: the true sequence length S when the shards were padded (:func:`shard_sequence`): keys at
            and after it are masked out. None: no padding.
        attend: ``attend(q, k, v, mask)`` on (B, H/G, S, d) tensors with ``mask`` None or a (1, 1, 1, S)
            bool key mask, returning (B, H/G, S, d); default :func:`~lightning_adaptiveload.models.attention.sdpa`
            with ``backends``.
        backends: SDPA kernels for the default ``attend``.

    Returns:
        (B, S/G, H, d): this rank's shard of the attention output, as if one process had attended over
        the whole sequence.

    Raises:
        ValueError: H not divisible by G (the message names both), or shards of different shapes.
    """
    g = dist.get_world_size(group)
    _check_heads(q.shape[2], g)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"ulysses_attention: q, k, v must have one shape (B, S/G, H, d), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    # One exchange for all three: (3, B, S/G, H, d) -> (3, B, S, H/G, d).
    qkv = all_to_all(torch.stack((q, k, v)), group, scatter_dim=3, gather_dim=2)
    qh, kh, vh = (t.transpose(1, 2) for t in qkv.unbind(0))  # (B, H/G, S, d)
    total = qh.shape[2]
    mask = None
    if seq_len is not None and int(seq_len) < total:
        mask = (torch.arange(total, device=q.device) < int(seq_len))[None, None, None, :]
    if attend is None:
        out = _attention.sdpa(qh, kh, vh, mask, backends)
    else:
        out = attend(qh, kh, vh, mask)
    return all_to_all(out.transpose(1, 2), group, scatter_dim=1, gather_dim=2)  # (B, S/G, H, d)


class GroupRef:
    """A process group held by a module: copies of the module (``copy.deepcopy``: an EMA copy, the monitor's
    meta copy) share it instead of trying to copy it (a ``ProcessGroup`` cannot be copied)."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> GroupRef:
        return GroupRef(self.group)


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """How one batch's sequence is split over a sequence group: what a block needs to run on its shard.

    Built once per batch (:meth:`build`) and passed to every block of
    :class:`~lightning_adaptiveload.models.VideoDiT` in place of pack segments.

    Attributes:
        group: the sequence group (G ranks).
        degree: G.
        rank: this rank's index in the group.
        seq_len: the true sequence length S.
        padded_len: S rounded up to a multiple of G.
    """

    group: Any
    degree: int
    rank: int
    seq_len: int
    padded_len: int

    @classmethod
    def build(cls, group: Any, seq_len: int, num_heads: int) -> SequenceShard:
        """The split of ``seq_len`` tokens over ``group``; refuses ``num_heads`` not divisible by G."""
        g, r = _degree_and_rank(group)
        _check_heads(num_heads, g)
        return cls(group, g, r, int(seq_len), padded_length(seq_len, g))

    @property
    def local_len(self) -> int:
        """Tokens per shard (padding included)."""
        return self.padded_len // self.degree

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of ``x`` (the whole sequence along ``dim``); see :func:`shard_sequence`."""
        return shard_sequence(x, self.group, dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence (padding dropped) from the shards; see :func:`gather_sequence`."""
        return gather_sequence(x, self.group, dim, self.seq_len)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: Any = None) -> torch.Tensor:
        """:func:`ulysses_attention` of this shard's (B, S/G, H, d) q, k, v, padded keys masked."""
        padded = self.padded_len != self.seq_len
        return ulysses_attention(q, k, v, self.group, self.seq_len if padded else None, backends=backends)

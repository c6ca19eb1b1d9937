"""Packed sequences: samples of any shapes run as one token sequence, each attending only to itself.

A *pack* (the ``packed`` schedule's batch, see ``docs/data_path.md``) holds N samples of different latent
shapes. The model patchifies each, concatenates the tokens to one sequence of ``sum S_i`` tokens, and
keeps every sample apart where samples could mix:

- **positions**: each sample's 3-D RoPE angles start at its own (0, 0, 0) (:func:`packed_rope`);
- **self-attention**: confined to each sample (block-diagonal; :func:`segment_attention`);
- **cross-attention**: each sample's tokens attend to its own text only;
- **timestep modulation**: per token, from its sample's timestep (the fused op's per-token layout
  ``(1, S, D)`` shift/scale);
- **loss**: summed per token, so a pack and the same samples as separate batches give the same loss.

Helpers a user's own model needs to adopt the contract: :func:`cu_seqlens` (token offsets),
:func:`segment_ids` (sample of every token), :func:`packed_rope` (per-sample positions) and
:func:`segment_attention` (exact on CPU, variable-length kernels on CUDA where torch has them).

Which attention runs (:func:`attention_route`, logged once per route and device): a pack whose samples all
have the same token count runs as a dense batch ``(N, S, ...)`` through SDPA, exactly as a bucketed batch
does; only a pack of mixed lengths takes the segment path. On the H100 the variable-length kernel took
7.0 ms against 20.1 ms for padded SDPA on a mixed pack, but was 1.7x to 1.9x slower than plain SDPA on
equal lengths (``docs/performance.md``), where a dense batch needs neither padding nor offsets.
Plain PyTorch: no Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_ROUTES",
    "attention_route",
    "cu_seqlens",
    "flow_loss_packed",
    "packed_forward",
    "packed_rope",
    "segment_attention",
    "segment_ids",
    "varlen_attention_available",
]


log = logging.getLogger(__name__)

ATTENTION_ROUTES = ("dense", "segments")
_logged_routes: set[tuple[str, str, bool]] = set()


def attention_route(seq_lens: Sequence[int]) -> str:
    """How a pack's attention runs: ``"dense"`` when all its samples have one token count, else ``"segments"``.

    ``"dense"``: the pack is viewed as a batch (N, S, ...) and self- and cross-attention run through
    batched SDPA, the bucketed path. ``"segments"``: self-attention is confined to each sample by
    :func:`segment_attention` (one variable-length kernel on CUDA, per-sample SDPA elsewhere) and each
    sample's cross-attention runs on its own. Text lengths do not enter the choice: both routes attend to
    the same zero-padded text through the same mask, so the dense route is exact for any text lengths.

    Args:
        seq_lens: the N token counts of the pack (host ints).
    """
    if len(seq_lens) == 0:
        raise ValueError("attention_route: a pack holds at least one sample")
    return "dense" if len({int(s) for s in seq_lens}) == 1 else "segments"


def _log_route_once(route: str, q: torch.Tensor, n: int) -> None:
    # One line per (route, device, kernel family), not per step: which path a run takes is a setting of
    # its data, and the varlen kernel's speed differs from SDPA's by up to 3x either way.
    varlen = route == "segments" and _varlen_applies(q)
    key = (route, q.device.type, varlen)
    if key in _logged_routes:
        return
    _logged_routes.add(key)
    if route == "dense":
        what = f"a batch of {n} equal-length samples through batched SDPA"
    elif varlen:
        what = "mixed lengths through the variable-length kernel (torch.nn.attention.varlen)"
    else:
        what = "mixed lengths through SDPA per sample"
    log.info("packed attention on %s: %s", q.device.type, what)


def cu_seqlens(
    seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """Token offsets of a pack: ``[0, S_0, S_0 + S_1, ...]`` as int32 (N + 1,), FlashAttention's layout."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
    return F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)


def segment_ids(
    seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """The sample index of every token of a pack: int64 (sum S_i,), e.g. ``[0, 0, 0, 1, 1]`` for (3, 2)."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)


def packed_rope(
    model: Any, grids: Sequence[tuple[int, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of every sample's own 3-D RoPE, concatenated: each (sum S_i, d/2) float32.

    Args:
        model: a :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` (its per-grid RoPE cache).
        grids: per sample, its token grid (F, H', W').
        device: where the tables live.
    """
    parts = [model._rope(tuple(int(v) for v in g), device) for g in grids]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def varlen_attention_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (the stock variable-length kernel).

    It appeared in torch 2.10 (docs 2.10 onward; CUDA only, FlashAttention-based; 2.10 has an ``is_causal``
    keyword, 2.12 on ``window_size``: only the positional arguments are used here); 2.9 and older lack it.
    """
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return hasattr(varlen, "varlen_attn")


def _varlen_applies(q: torch.Tensor) -> bool:
    return q.is_cuda and varlen_attention_available() and q.dtype in (torch.float16, torch.bfloat16)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    lens: Sequence[int],
    backends: Any = None,
) -> torch.Tensor:
    """Self-attention confined to each sample of a pack (block-diagonal), no mask materialised.

    Args:
        q, k, v: (1, H, S_total, d) of the packed sequence.
        cu: int32 (N + 1,) token offsets (:func:`cu_seqlens`).
        lens: the N sample lengths (host ints, to slice without a device sync).
        backends: SDPA kernel order for the per-sample path (see ``models/attention.py``).

    Returns:
        (1, H, S_total, d). On CUDA with ``torch.nn.attention.varlen`` (torch >= 2.10) one variable-length
        kernel runs for the whole pack; elsewhere each sample's slice runs through SDPA, which is the
        per-sample computation exactly.
    """
    if _varlen_applies(q):
        from torch.nn.attention.varlen import varlen_attn

        m = max(int(s) for s in lens)
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # (S_total, H, d)
        out = varlen_attn(qt, kt, vt, cu, cu, m, m)
        return out.transpose(0, 1)[None]
    from lightning_adaptiveload.models import attention as _attention

    outs = []
    start = 0
    for s in lens:
        end = start + int(s)
        outs.append(
            _attention.sdpa(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], backends=backends)
        )
        start = end
    return torch.cat(outs, dim=2)


def _self_attention(
    attn: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu: torch.Tensor,
    lens: Sequence[int],
    route: str,
) -> torch.Tensor:
    """The block's :class:`SelfAttention` on a packed sequence x (1, S, D), attention per sample."""
    from lightning_adaptiveload.models import attention as _attention
    from lightning_adaptiveload.models.layers import normed_rope

    h = attn.num_heads
    q = normed_rope(attn.norm_q, attn.q(x), h, cos, sin)  # (1, S_total, H, d)
    k = normed_rope(attn.norm_k, attn.k(x), h, cos, sin)
    v = attn.v(x).unflatten(-1, (h, -1))
    if route == "dense":
        # Equal lengths: the packed sequence is N samples back to back, so a view makes it a batch.
        n = len(lens)
        q, k, v = (t.reshape(n, int(lens[0]), h, -1).transpose(1, 2) for t in (q, k, v))  # (N, H, S, d)
        if not torch.compiler.is_compiling():
            _log_route_once(route, q, n)
        out = _attention.sdpa(q, k, v, backends=attn.backends)
        return attn.o(out.transpose(1, 2).flatten(2).reshape(x.shape))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if not torch.compiler.is_compiling():
        _log_route_once(route, q, len(lens))
    out = segment_attention(q, k, v, cu, lens, attn.backends)
    return attn.o(out.transpose(1, 2).flatten(2))


def _cross_attention(
    attn: Any, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None, lens: Sequence[int], route: str
) -> torch.Tensor:
    """Each sample's tokens of x (1, S, D) attend to their own text ``ctx[i]`` (N, L, D) only."""
    if route == "dense":
        n = len(lens)
        return attn(x.reshape(n, int(lens[0]), -1), ctx, mask).reshape(x.shape)
    outs = []
    start = 0
    for i, s in enumerate(lens):
        end = start + int(s)
        m = None if mask is None else mask[i : i + 1]
        outs.append(attn(x[:, start:end], ctx[i : i + 1], m))
        start = end
    return torch.cat(outs, dim=1)


def _block_forward(
    block: Any,
    x: torch.Tensor,
    e0: torch.Tensor,
    seg: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx: torch.Tensor | None,
    mask: torch.Tensor | None,
    cu: torch.Tensor,
    lens: Sequence[int],
    route: str = "segments",
) -> torch.Tensor:
    """One :class:`DiTBlock` on a pack: x (1, S, D); e0 (N, 6, D) fp32 per-sample time projection and
    ``seg`` (S,) each token's sample; ``route`` from :func:`attention_route`.

    The six modulation rows are expanded to tokens one at a time, where they are used: a (S, 6, D) fp32
    table would take 4.8 GB at 131,040 tokens of wan-1.3b, kept for the whole backward as a checkpoint
    input, which made full packs run out of memory where a bucketed batch of the same tokens fits.
    """
    mod = block.modulation.float() + e0  # (N, 6, D)

    def row(i: int) -> torch.Tensor:  # (1, S, D): the per-token layout of the fused op
        return mod[:, i][seg][None]

    y = _self_attention(block.self_attn, block.norm1(x, row(0), row(1)), cos, sin, cu, lens, route)
    x = (x + y * row(2)).to(x.dtype)
    if ctx is not None:
        x = (x + _cross_attention(block.cross_attn, block.norm3(x), ctx, mask, lens, route)).to(x.dtype)
    y = block.ffn(block.norm2(x, row(3), row(4)))
    return (x + y * row(5)).to(x.dtype)


def packed_forward(
    model: Any,
    latents: Sequence[torch.Tensor],
    timestep: torch.Tensor,
    context: torch.Tensor | None = None,
    context_mask: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Run a :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` on a pack (``VideoDiT.forward_packed``).

    Args:
        model: the VideoDiT.
        latents: N noisy latents, each (C_in, T_i, H_i, W_i), any shapes divisible by the patch.
        timestep: (N,) per-sample diffusion time in the model's units.
        context: (N, L, text_dim) per-sample text, zero padded to the longest, or None.
        context_mask: (N, L) bool, True at each sample's real text states; None: all real.

    Returns:
        N predictions, each (C_out, T_i, H_i, W_i): the same as running each sample alone.
    """
    from lightning_adaptiveload.models.checkpointing import run_block
    from lightning_adaptiveload.models.layers import sinusoidal_embedding

    n = len(latents)
    if n == 0 or timestep.shape != (n,):
        raise ValueError(
            f"a pack needs N >= 1 latents and timestep of shape (N,) = ({n},), got {tuple(timestep.shape)}"
        )
    grids = [model._check_input(x[None]) for x in latents]
    lens = [f * h * w for f, h, w in grids]
    device = latents[0].device
    param_dtype = model.patch_embedding.weight.dtype
    low_precision = param_dtype in (torch.float16, torch.bfloat16)
    if low_precision and not torch.is_autocast_enabled(device.type):
        stream_dtype = param_dtype
    else:
        stream_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
    h = torch.cat(
        [model.patch_embedding(x[None].to(param_dtype)).flatten(2).transpose(1, 2) for x in latents], dim=1
    )
    h = h.to(stream_dtype).contiguous()  # (1, S_total, D)
    seg = segment_ids(lens, device)
    cu = cu_seqlens(lens, device)
    with torch.autocast(device.type, enabled=False):
        w_dtype = model.time_embedding[0].weight.dtype
        e = model.time_embedding(sinusoidal_embedding(timestep, model.config.freq_dim).to(w_dtype)).float()
        e0 = model.time_projection(e.to(w_dtype)).float().unflatten(1, (6, model.config.dim))  # (N, 6, D)
    e_tok = e[seg]  # per token, for the head (the blocks expand e0 row by row, see _block_forward)
    ctx = None
    if context is not None:
        if context.dim() != 3 or context.shape[0] != n or context.shape[2] != model.config.text_dim:
            raise ValueError(
                f"pack text must have shape (N={n}, L, text_dim={model.config.text_dim}), got {tuple(context.shape)}"
            )
        ctx = model.text_embedding(context.to(param_dtype))
        if context_mask is not None:
            context_mask = context_mask.to(device=ctx.device, dtype=torch.bool)
    cos, sin = packed_rope(model, grids, device)
    route = attention_route(lens)
    model._apply_attention_backend(device)
    for block in model.blocks:
        args = (block, h, e0, seg, cos, sin, ctx, context_mask, cu, lens, route)
        h = run_block(block.checkpoint_policy, model.training, _block_forward, *args)
    head = model.head
    shift, scale = (head.modulation.float() + e_tok[:, None, :]).transpose(0, 1)[:, None].unbind(0)
    tokens = head.head(head.norm(h, shift, scale))[0]  # (S_total, C_out * patch volume)
    if ctx is None and model.training and torch.is_grad_enabled():
        # As in VideoDiT.forward: keep the text path in the graph for DDP (zero gradients).
        tokens = tokens + 0.0 * sum(p.sum() for p in model._text_path_parameters()).to(tokens.dtype)
    outs = []
    for part, grid in zip(tokens.split(lens), grids):
        outs.append(model.unpatchify(part[None], grid)[0])
    return outs


def flow_loss_packed(
    model: Any,
    latents: Sequence[torch.Tensor],
    t: torch.Tensor,
    noise: Sequence[torch.Tensor],
    num_train_timesteps: float,
    text: torch.Tensor | None,
    text_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Summed per-token rectified-flow error of a pack: ``(sum over tokens of |v - (noise - x0)|^2 / e, tokens)``.

    ``e`` is the latent elements per token (C_in times the patch volume), as in the bucketed loss, so that
    a pack and the same samples as separate batches give the same sum (and, weighted by the global token
    count, the same loss and gradients).

    Args:
        latents: N clean latents x0, each (C, T_i, H_i, W_i).
        t: (N,) rectified-flow times in [0, 1].
        noise: N noise tensors of the latents' shapes.
        num_train_timesteps: the model sees ``t * num_train_timesteps``.
        text, text_mask: (N, L, D) and (N, L) or None.
    """
    x0 = [x.float() for x in latents]
    x_t = [(1.0 - ti) * a + ti * z for a, z, ti in zip(x0, noise, t.float())]
    pred = packed_forward(model, x_t, t * num_train_timesteps, text, text_mask)
    cfg = model.config
    elems = cfg.in_channels * cfg.patch_volume
    err = sum((p.float() - (z - a)).square().sum() for p, z, a in zip(pred, noise, x0)) / elems
    tokens = sum(int(a.numel()) // elems for a in x0)
    return err, tokens

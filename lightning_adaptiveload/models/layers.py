"""The leaf layers of :mod:`~lightning_adaptiveload.models.video_dit`: initialised Linear and patch Conv3d,
the norms (``NormModulate``, the fused op's site, ``RMSNorm``, ``FP32LayerNorm``), the sinusoidal time
features, Wan's 3-D RoPE, and the self- and cross-attention layers built from them (their kernels chosen by
:mod:`~lightning_adaptiveload.models.attention`).

The RoPE splits each head's dimension d over the three axes like Wan: T gets d - 4*(d//6), H and W get
2*(d//6) each, with frequencies 1 / 10000^(2i/d_axis) per axis and adjacent channel pairs rotated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lightning_adaptiveload import ops as _ops
from lightning_adaptiveload.models import attention as _attention
from lightning_adaptiveload.models import packing as _packing
from lightning_adaptiveload.models import sequence_parallel as _sp
from lightning_adaptiveload.ops import norm_kernels as _norm_kernels

if TYPE_CHECKING:
    from lightning_adaptiveload.models.config import VideoDiTConfig

__all__ = [
    "FP32LayerNorm",
    "Head",
    "Linear",
    "MatmulBiasLinear",
    "NormModulate",
    "PatchEmbed",
    "RMSNorm",
    "apply_rope",
    "normed_rope",
    "rope_3d",
    "sinusoidal_embedding",
]


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def _norm_kernels_on(x: torch.Tensor, site: str) -> bool:
    """Whether a norm runs :mod:`~lightning_adaptiveload.ops.norm_kernels`' Triton kernels: on CUDA, inside
    ``torch.compile``, where ``norm_kernels.ENABLED[site]`` is True and Triton imports. Eager calls keep the
    plain-PyTorch forms."""
    return (
        _norm_kernels.ENABLED.get(site, False)
        and x.is_cuda
        and torch.compiler.is_compiling()
        and _norm_kernels.available()
    )


def _output_dtype(x: torch.Tensor, feeds_matmul: bool) -> torch.dtype:
    """x's dtype; the autocast dtype for a norm whose output only a matmul reads (what autocast would cast
    it to anyway), so that the gradient comes back at that width."""
    if feeds_matmul and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Linear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` applies Wan 2.1's initialisation for its role.

    Every module with parameters of its own has a ``reset_parameters`` that gives Wan's init, so that a model
    built on the meta device (FSDP) is materialised exactly as an eagerly built one. ``init`` is
    ``"xavier"`` (Xavier-uniform weight, zero bias), ``"normal"`` (N(0, 0.02) weight, zero bias: the text
    and time embeddings) or ``"zeros"`` (the output projection).
    """

    def __init__(self, in_features: int, out_features: int, init: str = "xavier") -> None:
        self.init = init
        super().__init__(in_features, out_features)

    def reset_parameters(self) -> None:
        if self.init == "xavier":
            nn.init.xavier_uniform_(self.weight)
        elif self.init == "normal":
            nn.init.normal_(self.weight, std=0.02)
        else:
            nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)


class _BiasAdd(torch.autograd.Function):
    """``h + bias`` whose bias gradient is a (1 x S) @ (S x N) matmul.

    A Linear's bias gradient is the column sum of the output gradient. Inside a compiled block inductor
    fuses that sum into the kernel that makes the gradient (for the FFN's first Linear: the GELU backward),
    and that kernel, a pointwise pass plus a column reduction over all tokens, ran at about 1.4 TB/s on an
    H100 (1.24 ms per block at 32,760 x 8,960). As a matmul the sum is an extern cuBLAS call that inductor
    leaves alone, so the GELU backward stays a plain pointwise kernel.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.bias_dtype = bias.dtype
        return h + bias.to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.reshape(-1, grad.shape[-1])
        bias_grad = torch.mm(rows.new_ones(1, rows.shape[0]), rows).reshape(-1)
        return grad, bias_grad.to(ctx.bias_dtype)


class MatmulBiasLinear(Linear):
    """:class:`Linear` whose bias gradient, under ``torch.compile``, is a matmul (``_BiasAdd``); in eager mode
    it is ``nn.Linear``. Same parameters and state-dict keys as :class:`Linear`.

    For a Linear whose output gradient comes out of an elementwise kernel, such as the FFN's first
    projection before the GELU: inside a compiled block inductor fuses the bias gradient (a column sum over
    all tokens) into that kernel, which then mixes a pointwise pass with a reduction across tokens.
    ``bias_grad_by_matmul = False`` restores the plain Linear under compile too (benchmarks compare the two).

    Measured on one H100 with wan-1.3b (``docs/lab_notebook.md``): the FFN's first Linear
    made this way ran the clip step in 1,662 against 1,666 ms (same process), and the epoch's batches of
    images and short clips ran 12-28% faster than in an earlier epoch without it (another machine, not a
    strict A/B). Every
    projection of the block made so ran the clip in 1,711 ms (another machine, 1.3% slower on the eager
    baseline), so :class:`~lightning_adaptiveload.models.VideoDiT` uses it for the FFN's first Linear only.
    """

    bias_grad_by_matmul = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None or not (self.bias_grad_by_matmul and torch.compiler.is_compiling()):
            return super().forward(x)
        return _BiasAdd.apply(F.linear(x, self.weight), self.bias)


class PatchEmbed(nn.Conv3d):
    """Conv3d patch embedding with Wan's init: Xavier-uniform on the flattened kernel, zero bias."""

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight.view(self.weight.shape[0], -1))
        nn.init.zeros_(self.bias)


class NormModulate(nn.Module):
    """``LayerNorm(x) * (1 + scale) + shift``: every adaLN site of the model.

    With ``fused = False`` the eager form runs (LayerNorm and modulation in fp32, output cast back to
    ``x.dtype``); with ``fused = True`` it calls :func:`lightning_adaptiveload.ops.layer_norm_modulate`.
    Flipping ``fused`` (see ``lightning_adaptiveload.fusion.fuse_norm_modulate``) changes no parameter.
    Unfused, on CUDA inside ``torch.compile``, a per-sample modulation takes its backward from the Triton
    kernel of :func:`lightning_adaptiveload.ops.norm_kernels.layer_norm_affine` (inductor's own gave wrong
    modulation gradients at batch 1 and 32,760 tokens with torch 2.11); the forward stays PyTorch, for
    inductor to fuse. ``feeds_matmul = True`` (set by the model where only a matmul reads the output)
    returns the autocast dtype there.

    Args:
        dim: normalised width D.
        eps: LayerNorm epsilon.
        elementwise_affine: learn a LayerNorm weight and bias (D,), applied before the modulation.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.fused = False
        # Only a matmul reads the output (set by the model's blocks): on the Triton path the output is then
        # in the autocast dtype, the same values the matmul would cast it to.
        self.feeds_matmul = False
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Args: x (B, S, D); shift, scale (B, 1, D) or (B, S, D). Returns (B, S, D) in x.dtype."""
        if self.fused:
            # Looked up at call time so that a later swap of the op's dispatch is picked up.
            return _ops.layer_norm_modulate(x, shift, scale, self.weight, self.bias, self.eps)
        if _norm_kernels_on(x, "layer_norm") and _per_sample(x, shift) and _per_sample(x, scale):
            mult, add = torch.broadcast_tensors(1.0 + scale.float(), shift.float())
            one_plus = mult
            if self.weight is not None:
                mult = self.weight.float() * one_plus
                add = self.bias.float() * one_plus + add
            return _norm_kernels.layer_norm_affine(
                x, mult, add, self.eps, _output_dtype(x, self.feeds_matmul)
            )
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), (self.dim,), weight, bias, self.eps)
        return (y * (1.0 + scale.float()) + shift.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}, fused={self.fused}"


def _per_sample(x: torch.Tensor, m: torch.Tensor) -> bool:
    """Whether modulation m is one (1, D) row per sample of x (B, S, D): (B, 1, D) or (1, 1, D)."""
    return (
        x.dim() == 3
        and m.dim() == 3
        and m.shape[1] == 1
        and m.shape[2] == x.shape[2]
        and m.shape[0] in (1, x.shape[0])
    )


class RMSNorm(nn.Module):
    """RMSNorm over the last axis in fp32 with a learned (D,) weight; output in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _norm_kernels_on(x, "rms_norm"):
            return _norm_kernels.rms_norm_rope(x, self.weight, None, None, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def forward_rope(
        self, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """``apply_rope(self(x) split into heads, cos, sin)``: x (B, S, D), cos/sin (S, d/2) or, per sample,
        (B, S, d/2); returns (B, S, heads, d). On the Triton path (shared tables) one kernel each way,
        without the rounding between the two."""
        if _norm_kernels_on(x, "rms_norm_rope") and x.dim() == 3 and cos.dim() == 2:
            return _norm_kernels.rms_norm_rope(x, self.weight, cos, sin, self.eps).unflatten(
                -1, (num_heads, -1)
            )
        return apply_rope(self(x).unflatten(-1, (num_heads, -1)), cos, sin)


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 (Wan's ``norm3`` before cross-attention); output in the input's dtype."""

    feeds_matmul = False  # as NormModulate's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        if (
            _norm_kernels_on(x, "layer_norm")
            and x.dim() == 3
            and len(self.normalized_shape) == 1
            and weight is not None
            and bias is not None
        ):
            shape = (1, 1, x.shape[-1])
            return _norm_kernels.layer_norm_affine(
                x, weight.view(shape), bias.view(shape), self.eps, _output_dtype(x, self.feeds_matmul)
            )
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's sinusoidal features: ``[cos(t * f_i), sin(t * f_i)]`` with ``f_i = 10000^(-i / (dim/2))``.

    Args:
        t: (B,) diffusion time in the model's units ([0, 1000] for rectified flow x 1000).
        dim: even feature width.

    Returns:
        (B, dim) float32.
    """
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, device=t.device, dtype=torch.float64) / half)
    angles = t.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).float()


def rope_3d(
    grid: tuple[int, int, int], head_dim: int, theta: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the 3D rotary embedding for a (F, H, W) token grid.

    The head dimension d is split as Wan does: d - 4*(d//6) channels rotate with the frame index,
    2*(d//6) with the row and 2*(d//6) with the column. Tokens are in (F, H, W) raster order, the order of
    ``Conv3d(...).flatten(2)``.

    Returns:
        (cos, sin), each (F*H*W, d/2) float32.
    """
    split = (head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6))
    angles = []
    for axis, (n, d_axis) in enumerate(zip(grid, split)):
        inv_freq = 1.0 / theta ** (torch.arange(0, d_axis, 2, device=device, dtype=torch.float64) / d_axis)
        a = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (n, d_axis/2)
        view = [1, 1, 1, d_axis // 2]
        view[axis] = n
        angles.append(a.view(view).expand(*grid, d_axis // 2))
    full = torch.cat(angles, dim=-1).reshape(-1, head_dim // 2)
    return torch.cos(full).float(), torch.sin(full).float()


def normed_rope(
    norm: nn.Module, x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The rotated queries or keys of attention: ``apply_rope(norm(x) split into heads, cos, sin)``.

    x (B, S, D); returns (B, S, heads, d). An :class:`RMSNorm` does both in one pass on the Triton path
    (:meth:`RMSNorm.forward_rope`); any other norm (``nn.Identity`` without qk-norm) runs as written.
    """
    if isinstance(norm, RMSNorm):
        return norm.forward_rope(x, num_heads, cos, sin)
    return apply_rope(norm(x).unflatten(-1, (num_heads, -1)), cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` (B, S, H, d) by the angles of ``cos``/``sin``: (S, d/2) shared
    by the batch, or (B, S, d/2) per sample (a pack of equal token counts on different grids)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[..., None, :], sin[..., None, :]  # (S, 1, d/2) or (B, S, 1, d/2) against (B, S, H, d/2)
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


class SelfAttention(nn.Module):
    """Full (bidirectional) self-attention over the video tokens with q/k RMSNorm and 3D RoPE."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = Linear(dim, dim)
        self.k = Linear(dim, dim)
        self.v = Linear(dim, dim)
        self.o = Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        # SDPA kernels in priority order (None: PyTorch's choice); set by VideoDiT.set_attention_backend.
        self.backends = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: _packing.PackSegments | _sp.SequenceShard | None = None,
    ) -> torch.Tensor:
        """Args: x (B, S, D); cos, sin (S, d/2), or (B, S, d/2) per sample; segments: None, or for a pack of
        mixed lengths (x (1, S, D)) its :class:`~lightning_adaptiveload.models.packing.PackSegments`, each
        sample attending to itself only; or a :class:`~lightning_adaptiveload.models.sequence_parallel.SequenceShard`:
        x (B, S/G, D) and cos, sin (S/G, d/2) are this rank's shard, attended through the whole sequence
        (Ulysses all-to-all). Returns (B, S, D)."""
        h = self.num_heads
        q, k = (
            normed_rope(self.norm_q, self.q(x), h, cos, sin),
            normed_rope(self.norm_k, self.k(x), h, cos, sin),
        )
        v = self.v(x).unflatten(-1, (h, -1))
        if isinstance(segments, _sp.SequenceShard):  # (B, S/G, H, d) shards: all-to-all over the heads
            return self.o(segments.attention(q, k, v, self.backends).flatten(2))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if segments is not None:
            out = _packing.segment_self_attention(q, k, v, segments, self.backends)
            return self.o(out.transpose(1, 2).flatten(2))
        if not torch.compiler.is_compiling():
            _attention.log_kernel_once("VideoDiT self-attention", q, k, v, None, self.backends)
        # No mask: a batch holds samples of one shape (never padded), so the fastest kernels apply.
        out = _attention.sdpa(q, k, v, backends=self.backends)
        return self.o(out.transpose(1, 2).flatten(2))


class CrossAttention(nn.Module):
    """Attention from video tokens to text states, ignoring padded text positions."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = Linear(dim, dim)
        self.k = Linear(dim, dim)
        self.v = Linear(dim, dim)
        self.o = Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.backends = None
        # Query splits of one long sample (attention.sdpa_split_queries); set by VideoDiT for its device.
        self.query_splits = 1

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor | None,
        segments: _packing.PackSegments | None = None,
    ) -> torch.Tensor:
        """Args: x (B, S, D); context (B, L, D); context_mask (B, L) bool, True = real token, or None;
        segments: None, or for a pack of mixed lengths (x (1, S, D), context (N, L, D)) its
        :class:`~lightning_adaptiveload.models.packing.PackSegments`: each sample's tokens attend to its
        own text only.

        Returns (B, S, D). A sample whose mask is all False gets 0 (attention to nothing) rather than NaN.
        """
        h = self.num_heads
        q = self.norm_q(self.q(x)).unflatten(-1, (h, -1)).transpose(1, 2)
        k = self.norm_k(self.k(context)).unflatten(-1, (h, -1)).transpose(1, 2)
        v = self.v(context).unflatten(-1, (h, -1)).transpose(1, 2)
        if segments is not None:
            out = _packing.segment_cross_attention(
                q, k, v, context_mask, segments, self._attend, self.backends
            )
        else:
            out = self._attend(q, k, v, context_mask)
        return self.o(out.transpose(1, 2).flatten(2))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, H, S, d), k and v (B, H, L, d), context_mask (B, L) or None -> (B, H, S, d)."""
        attn_mask = keep = None
        if context_mask is not None:
            # A fully masked row makes softmax NaN; let it attend everywhere, then zero its output. Done
            # arithmetically so that no host sync is needed to find such rows.
            keep = context_mask.any(dim=-1)  # (B,)
            attn_mask = (context_mask | ~keep[:, None])[:, None, None, :]  # (B, 1, 1, L)
        # One sample, training: cut its queries into chunks so that the backward fills the GPU (see
        # attention.sdpa_split_queries); batches of several samples have the parallelism already, and the
        # forward alone does not gain. (B = 1 and grad mode have graphs of their own under torch.compile
        # anyway, so this adds no recompile.)
        splits = self.query_splits if q.shape[0] == 1 and torch.is_grad_enabled() else 1
        out = _attention.sdpa_split_queries(q, k, v, attn_mask, self.backends, splits)
        if keep is not None:
            out = out * keep[:, None, None, None].to(out.dtype)
        return out


class Head(nn.Module):
    """Output head: NormModulate with its own (1, 2, D) table added to e, then a Linear to patch pixels."""

    def __init__(self, cfg: VideoDiTConfig) -> None:
        super().__init__()
        self.norm = NormModulate(cfg.dim, cfg.eps)
        self.norm.feeds_matmul = True
        self.head = Linear(cfg.dim, cfg.out_channels * cfg.patch_volume, init="zeros")
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.modulation.normal_(std=self.modulation.shape[-1] ** -0.5)

    def forward(
        self, x: torch.Tensor, e: torch.Tensor, segments: _packing.PackSegments | None = None
    ) -> torch.Tensor:
        """Args: x (B, S, D); e (B, D) fp32, or (B, S, D) per token; segments: None, or for a pack of mixed
        lengths (x (1, S, D), e (N, D) per sample) its
        :class:`~lightning_adaptiveload.models.packing.PackSegments`. Returns (B, S, C_out * pt * ph * pw)."""
        if segments is not None:  # per sample, spread to tokens: two (1, S, D) tables
            mod = self.modulation.float() + e[:, None, :]  # (N, 2, D)
            shift, scale = (_packing.segment_rows(mod[:, i], segments) for i in (0, 1))
        elif e.dim() == 3:  # per token: (1, 1, 2, D) + (B, S, 1, D) -> two (B, S, D) tables
            shift, scale = (self.modulation.float()[None] + e[:, :, None, :]).unbind(-2)
        else:
            shift, scale = (self.modulation.float() + e[:, None, :]).chunk(2, dim=1)
        return self.head(self.norm(x, shift, scale))

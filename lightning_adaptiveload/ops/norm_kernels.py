"""Triton kernels for the norm sites of a compiled block: LayerNorm-affine backward, RMSNorm + RoPE.

Inside a ``torch.compile``-d block inductor writes every elementwise kernel itself, and it fuses the norms'
forward passes well (with the gated residual before them and the casts after them). Their backward passes
mix a reduction along each row with one down each column: a LayerNorm backward whose affine is per sample
(adaLN's ``1 + scale``) sums over all tokens for the modulation's gradient, and the q/k RMSNorm with RoPE
does the same for its weight. With torch 2.11 on an H100, inductor's kernels for the LayerNorm case gave a
wan-1.3b block wrong modulation gradients at one 32,760-token sample (right at two samples and at short
sequences; ``docs/lab_notebook.md``): PyTorch's bug pytorch/pytorch#193061 in its mix-order
reductions. The kernels here make one pass over the rows, with the column sums kept in registers per
program and added up by a small reduction after; they match eager mode there, with or without those
reductions (``acceleration.SAFE_REDUCTIONS`` alone also fixes inductor's kernels, checked on an H100).
Speed (H100): a tie with inductor's norms over one clip's compiled step and over the epoch.

- :func:`layer_norm_affine`: ``LN(x) * mult + add`` (``mult``, ``add`` per sample (B, 1, D) or shared
  (1, 1, D)). Forward in plain PyTorch, so that inductor keeps fusing it; backward one Triton kernel
  (:func:`layer_norm_affine_backward`).
- :func:`rms_norm_rope`: ``rope(x * rsqrt(mean(x^2) + eps) * w)``, RoPE optional, forward and backward
  Triton kernels (the input is a matmul's output and the output goes to attention: nothing to fuse with).

Arithmetic is fp32; x and the gradients keep their dtypes. ``available()`` says whether Triton imports;
callers (:mod:`lightning_adaptiveload.models.layers`) use these only on CUDA under ``torch.compile``, for the
sites ``ENABLED`` names. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests do this).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ENABLED",
    "available",
    "layer_norm_affine",
    "layer_norm_affine_backward",
    "rms_norm_rope",
    "rms_norm_rope_backward",
]

# Which sites the layers run through these kernels (inside torch.compile, on CUDA): "rms_norm_rope" (the
# self-attention's q and k), "rms_norm" (the cross-attention's q and k) and "layer_norm" (the adaLN sites
# and the cross-attention's LayerNorm). All on: with inductor's own LayerNorm backward, torch 2.11 gave a
# compiled wan-1.3b block wrong gradients for the modulation (scale, shift) at one 32,760-token sample
# (docs/lab_notebook.md; pytorch/pytorch#193061); these kernels match eager mode there, at the same
# step time. compile_blocks' safe_reductions fixes inductor's kernels too (checked on an H100), but a block
# compiled by a plain torch.compile keeps PyTorch's reductions: with every site on, it is right either way.
# RMSNorm + RoPE alone tied with all sites over a wan21_480p epoch on an H100.
# benchmarks/model/bench_step.py compares settings; a change recompiles.
ENABLED = {"rms_norm_rope": True, "rms_norm": True, "layer_norm": True}

try:  # Triton comes with CUDA builds of PyTorch; CPU builds have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# Programs per launch to aim for: every SM of an H100 (132) eight times over (chosen from a sweep of launch
# sizes on an H100).
_TARGET_PROGRAMS = 1056


def available() -> bool:
    """Whether Triton is importable (the kernels compile on first use)."""
    return triton is not None


def _block_d(D: int) -> int:
    return triton.next_power_of_2(D)


def _launch_shape(
    rows_per_group: int,
    groups: int,
    D: int,
    warps: int,
    *,
    programs: int = _TARGET_PROGRAMS,
    block_m: int = 0,
    num_warps: int = 0,
) -> tuple[int, int, int, int]:
    """(block_m, rows per program, programs per group, warps) for rows of width D.

    ``programs``, ``block_m`` and ``num_warps`` (0: the heuristic's) are for benchmarks, which sweep them
    by wrapping this function (benchmarks/kernels/bench_norm_kernels.py); the kernels call it with none.
    """
    block_d = _block_d(D)
    block_m = block_m or max(1, min(16, 4096 // block_d))
    per_group = max(1, programs // max(groups, 1))
    rows_per_prog = max(block_m, math.ceil(rows_per_group / per_group))
    rows_per_prog = math.ceil(rows_per_prog / block_m) * block_m
    n_programs = max(1, math.ceil(rows_per_group / rows_per_prog))
    warps = num_warps or (warps if block_d >= 2048 else 4)
    return block_m, rows_per_prog, n_programs, warps


if triton is not None:

    @triton.jit
    def _rows(first_row, r, last, cols, cmask, D, BLOCK_M: tl.constexpr):
        """Offsets and mask of the (BLOCK_M, BLOCK_D) tile of rows [r, r + BLOCK_M) (row index within the
        program's range ending at ``last``, ``first_row`` added for the tensor's row)."""
        rows = r + tl.arange(0, BLOCK_M)
        rmask = rows < last
        offs = (first_row + rows)[:, None].to(tl.int64) * D + cols[None, :]
        return rows, offs, rmask[:, None] & cmask[None, :]

    # Each program takes a contiguous range of rows, BLOCK_M at a time, and loads the next tile's inputs
    # before it works on the current one: the loads are then in flight during the row reductions, which
    # is what keeps a pass over a few rows per program near the memory bandwidth.

    @triton.jit
    def _ln_affine_bwd_kernel(
        X,  # (groups * rows_per_group, D), any float dtype
        DY,  # same rows, any float dtype
        MEAN,  # (rows,) fp32, the forward's statistics
        RSTD,
        MULT,  # (groups or 1, D) fp32; MULT_STRIDE 0 when shared
        DX,  # like X
        PMULT,  # (groups, programs, D) fp32 partial column sums of dy * xhat
        PADD,  # (groups, programs, D) fp32 partial column sums of dy
        rows_per_group,
        D,
        MULT_STRIDE,
        rows_per_prog,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        g = tl.program_id(1)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        mult = tl.load(MULT + g * MULT_STRIDE + cols, mask=cmask, other=0.0).to(tl.float32)
        acc_mult = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_add = tl.zeros([BLOCK_D], dtype=tl.float32)
        first = pid * rows_per_prog
        last = tl.minimum(first + rows_per_prog, rows_per_group)
        base = g.to(tl.int64) * rows_per_group
        rows_n, offs_n, m_n = _rows(base, first, last, cols, cmask, D, BLOCK_M)
        x_n = tl.load(X + offs_n, mask=m_n, other=0.0)
        dy_n = tl.load(DY + offs_n, mask=m_n, other=0.0)
        mean_n = tl.load(MEAN + base + rows_n, mask=rows_n < last, other=0.0)
        rstd_n = tl.load(RSTD + base + rows_n, mask=rows_n < last, other=0.0)
        for r in range(first, last, BLOCK_M):
            offs, m2 = offs_n, m_n
            x, dy, mean, rstd = x_n.to(tl.float32), dy_n.to(tl.float32), mean_n, rstd_n
            rows_n, offs_n, m_n = _rows(base, r + BLOCK_M, last, cols, cmask, D, BLOCK_M)
            x_n = tl.load(X + offs_n, mask=m_n, other=0.0)
            dy_n = tl.load(DY + offs_n, mask=m_n, other=0.0)
            mean_n = tl.load(MEAN + base + rows_n, mask=rows_n < last, other=0.0)
            rstd_n = tl.load(RSTD + base + rows_n, mask=rows_n < last, other=0.0)

            xh = tl.where(m2, (x - mean[:, None]) * rstd[:, None], 0.0)
            acc_mult += tl.sum(dy * xh, axis=0)
            acc_add += tl.sum(dy, axis=0)
            gx = dy * mult[None, :]
            c_xh = tl.sum(gx * xh, axis=1) / D
            c_1 = tl.sum(gx, axis=1) / D
            dx = (gx - c_1[:, None] - xh * c_xh[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)
        out = (g.to(tl.int64) * programs + pid) * D + cols
        tl.store(PMULT + out, acc_mult, mask=cmask)
        tl.store(PADD + out, acc_add, mask=cmask)

    @triton.jit
    def _rope_tile(y, COS, SIN, rows, last, tokens, D, half_head, INVERSE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr):  # fmt: skip
        """Rotates the channel pairs (2i, 2i + 1) of a (BLOCK_M, BLOCK_D) tile of rows by the angles of
        (COS, SIN) (tokens x half_head) at token ``row % tokens``; INVERSE rotates back (the transpose, for
        gradients)."""
        j = tl.arange(0, BLOCK_D // 2)
        trig = (rows % tokens)[:, None].to(tl.int64) * half_head + (j % half_head)[None, :]
        m = (rows < last)[:, None] & (j < D // 2)[None, :]
        c = tl.load(COS + trig, mask=m, other=1.0)
        s = tl.load(SIN + trig, mask=m, other=0.0)
        if INVERSE:
            s = -s
        e, o = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_D // 2, 2)))
        return tl.reshape(tl.join(e * c - o * s, e * s + o * c), (BLOCK_M, BLOCK_D))

    @triton.jit
    def _rms_program(pid, W, n_rows, D, rows_per_prog, BLOCK_D: tl.constexpr):
        """An RMSNorm program's columns, their mask, the weight (fp32) and its range of rows [first, last)."""
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        first = pid * rows_per_prog
        return cols, cmask, w, first, tl.minimum(first + rows_per_prog, n_rows)

    @triton.jit
    def _rms_rope_fwd_kernel(
        X,  # (rows, D)
        W,  # (D,) fp32
        COS,  # (tokens, half_head) fp32
        SIN,
        Y,  # (rows, D) in X's dtype
        n_rows,
        tokens,  # rows of one sample: row r is token r % tokens
        D,
        half_head,
        eps,
        rows_per_prog,
        HAS_ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols, cmask, w, first, last = _rms_program(pid, W, n_rows, D, rows_per_prog, BLOCK_D)
        rows_n, offs_n, m_n = _rows(0, first, last, cols, cmask, D, BLOCK_M)
        x_n = tl.load(X + offs_n, mask=m_n, other=0.0)
        for r in range(first, last, BLOCK_M):
            rows, offs, m2, x = rows_n, offs_n, m_n, x_n.to(tl.float32)
            rows_n, offs_n, m_n = _rows(0, r + BLOCK_M, last, cols, cmask, D, BLOCK_M)
            x_n = tl.load(X + offs_n, mask=m_n, other=0.0)

            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
            y = x * rstd[:, None] * w[None, :]
            if HAS_ROPE:
                y = _rope_tile(y, COS, SIN, rows, last, tokens, D, half_head, False, BLOCK_M, BLOCK_D)
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m2)

    @triton.jit
    def _rms_rope_bwd_kernel(
        X,
        DY,
        W,
        COS,
        SIN,
        DX,  # like X
        PW,  # (programs, D) fp32 partial column sums of the weight gradient
        n_rows,
        tokens,
        D,
        half_head,
        eps,
        rows_per_prog,
        HAS_ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols, cmask, w, first, last = _rms_program(pid, W, n_rows, D, rows_per_prog, BLOCK_D)
        acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
        rows_n, offs_n, m_n = _rows(0, first, last, cols, cmask, D, BLOCK_M)
        x_n = tl.load(X + offs_n, mask=m_n, other=0.0)
        dy_n = tl.load(DY + offs_n, mask=m_n, other=0.0)
        for r in range(first, last, BLOCK_M):
            rows, offs, m2 = rows_n, offs_n, m_n
            x, gy = x_n.to(tl.float32), dy_n.to(tl.float32)
            rows_n, offs_n, m_n = _rows(0, r + BLOCK_M, last, cols, cmask, D, BLOCK_M)
            x_n = tl.load(X + offs_n, mask=m_n, other=0.0)
            dy_n = tl.load(DY + offs_n, mask=m_n, other=0.0)

            if HAS_ROPE:  # the gradient before the rotation: rotate it back
                gy = _rope_tile(gy, COS, SIN, rows, last, tokens, D, half_head, True, BLOCK_M, BLOCK_D)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
            xh = x * rstd[:, None]
            acc_w += tl.sum(gy * xh, axis=0)
            gx = gy * w[None, :]
            c_xh = tl.sum(gx * xh, axis=1) / D
            dx = (gx - xh * c_xh[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)
        tl.store(PW + pid.to(tl.int64) * D + cols, acc_w, mask=cmask)


def _rope_tables(x, cos, sin):
    """(whether to rotate, cos, sin) as the kernels read them: fp32, contiguous; a 1 x 1 stand-in without
    RoPE (the kernel does not read it then)."""
    if cos is None:
        return False, x.new_ones((1, 1), dtype=torch.float32), x.new_zeros((1, 1), dtype=torch.float32)
    return True, cos.float().contiguous(), sin.float().contiguous()


def _require_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(
            f"{what} needs Triton, which is not installed (it comes with CUDA builds of PyTorch)"
        )


# ---------------------------------------------------------------------------------------------------------
# Custom operators: one node each in a compiled graph (inductor calls them, it does not trace into them).


@torch.library.custom_op("lightning_adaptiveload::layer_norm_affine_backward", mutates_args=())
def _ln_affine_backward_op(
    x: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, mult: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _require_triton("layer_norm_affine_backward")
    D = x.shape[-1]
    groups = x.shape[0]
    rows_per_group = x[0].numel() // D if groups else 0
    x2, dy2 = x.contiguous(), dy.contiguous()
    mult2 = mult.reshape(-1, D).float().contiguous()
    dx = torch.empty_like(x2)
    block_m, rows_per_prog, programs, warps = _launch_shape(rows_per_group, groups, D, warps=8)
    # Every program writes its full row of partial sums.
    pmult = x.new_empty((groups, programs, D), dtype=torch.float32)
    padd = x.new_empty((groups, programs, D), dtype=torch.float32)
    if x.numel():
        _ln_affine_bwd_kernel[(programs, groups)](
            x2, dy2, mean.float().contiguous(), rstd.float().contiguous(), mult2, dx, pmult, padd,
            rows_per_group, D, D if mult2.shape[0] > 1 else 0, rows_per_prog,
            BLOCK_M=block_m, BLOCK_D=_block_d(D), num_warps=warps,
        )  # fmt: skip
    else:
        pmult.zero_(), padd.zero_()
    return dx, pmult.sum(1), padd.sum(1)


@_ln_affine_backward_op.register_fake
def _(x, dy, mean, rstd, mult):
    D = x.shape[-1]
    return (
        torch.empty_like(x),
        x.new_empty((x.shape[0], D), dtype=torch.float32),
        x.new_empty((x.shape[0], D), dtype=torch.float32),
    )


def layer_norm_affine_backward(
    x: torch.Tensor, dy: torch.Tensor, mult: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``y = LN(x) * mult + add`` (LayerNorm without its own affine, fp32 statistics).

    Args:
        x: (B, S, D), any float dtype.
        dy: (B, S, D), the gradient of y, any float dtype.
        mult: (B, 1, D) per sample or (1, 1, D) shared.
        eps: LayerNorm epsilon.

    Returns:
        ``(dx, dmult, dadd)``: dx like x; dmult = sum over tokens of ``dy * LN(x)`` and dadd = sum of dy,
        each (B, D) fp32 per sample (sum them over B for a shared ``mult``).
    """
    _, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), (x.shape[-1],), None, None, float(eps))
    return _ln_affine_backward_op(x, dy, mean, rstd, mult)


class _LayerNormAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mult, add, eps, out_dtype):
        xhat, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), (x.shape[-1],), None, None, eps)
        y = xhat * mult + add
        ctx.save_for_backward(x, mean, rstd, mult)
        ctx.add_shape = add.shape
        # A new tensor even where the cast is a no-op: with torch 2.11 a compiled block otherwise handed this
        # Function's backward a zero gradient for the fp32 output (norm1's); inductor removes the copy.
        return y.to(out_dtype) if y.dtype != out_dtype else y.clone()

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, mult = ctx.saved_tensors
        dx, dmult, dadd = _ln_affine_backward_op(x, dy, mean, rstd, mult)
        if mult.shape[0] != x.shape[0]:
            dmult = dmult.sum(0, keepdim=True)
        if ctx.add_shape[0] != x.shape[0]:
            dadd = dadd.sum(0, keepdim=True)
        return dx, dmult.reshape(mult.shape), dadd.reshape(ctx.add_shape), None, None


def layer_norm_affine(
    x: torch.Tensor, mult: torch.Tensor, add: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(LN(x) * mult + add).to(out_dtype)`` with the backward of :func:`layer_norm_affine_backward`.

    Args:
        x: (B, S, D). mult, add: fp32, (B, 1, D) per sample or (1, 1, D) shared. eps: LayerNorm epsilon.
        out_dtype: the output's dtype (x's, or the autocast dtype when a matmul reads the output).
    """
    return _LayerNormAffine.apply(x, mult, add, float(eps), out_dtype)


@torch.library.custom_op("lightning_adaptiveload::rms_norm_rope", mutates_args=())
def _rms_rope_op(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float
) -> torch.Tensor:
    _require_triton("rms_norm_rope")
    D = x.shape[-1]
    x2 = x.contiguous()
    y = torch.empty_like(x2)
    n_rows = x2.numel() // D if D else 0
    block_m, rows_per_prog, programs, warps = _launch_shape(n_rows, 1, D, warps=4)
    has_rope, cos_t, sin_t = _rope_tables(x, cos, sin)
    if n_rows:
        _rms_rope_fwd_kernel[(programs,)](
            x2, weight.float().contiguous(), cos_t, sin_t, y, n_rows, cos_t.shape[0], D, cos_t.shape[1], eps,
            rows_per_prog, HAS_ROPE=has_rope, BLOCK_M=block_m, BLOCK_D=_block_d(D), num_warps=warps,
        )  # fmt: skip
    return y


@_rms_rope_op.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty_like(x)


@torch.library.custom_op("lightning_adaptiveload::rms_norm_rope_backward", mutates_args=())
def _rms_rope_backward_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _require_triton("rms_norm_rope_backward")
    D = x.shape[-1]
    x2, dy2 = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x2)
    n_rows = x2.numel() // D if D else 0
    block_m, rows_per_prog, programs, warps = _launch_shape(n_rows, 1, D, warps=4)
    pw = x.new_empty((programs, D), dtype=torch.float32)
    has_rope, cos_t, sin_t = _rope_tables(x, cos, sin)
    if n_rows:
        _rms_rope_bwd_kernel[(programs,)](
            x2, dy2, weight.float().contiguous(), cos_t, sin_t, dx, pw, n_rows, cos_t.shape[0], D,
            cos_t.shape[1], eps, rows_per_prog, HAS_ROPE=has_rope, BLOCK_M=block_m, BLOCK_D=_block_d(D),
            num_warps=warps,
        )  # fmt: skip
    else:
        pw.zero_()
    return dx, pw.sum(0)


@_rms_rope_backward_op.register_fake
def _(x, dy, weight, cos, sin, eps):
    return torch.empty_like(x), x.new_empty((x.shape[-1],), dtype=torch.float32)


def rms_norm_rope_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx, dweight)`` of :func:`rms_norm_rope` (dweight fp32 (D,), dx like x)."""
    return _rms_rope_backward_op(x, dy, weight, cos, sin, float(eps))


def _setup_rms(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward_rms(ctx, dy):
    x, weight, cos, sin = ctx.saved_tensors
    dx, dw = _rms_rope_backward_op(x, dy, weight, cos, sin, ctx.eps)
    return dx, dw.to(weight.dtype), None, None, None


_rms_rope_op.register_autograd(_backward_rms, setup_context=_setup_rms)


def _check_rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    if (cos is None) != (sin is None):
        raise ValueError("rms_norm_rope: give both cos and sin, or neither")
    if cos is None:
        return
    D = x.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or D % (2 * cos.shape[1]) != 0:
        raise ValueError(
            f"rms_norm_rope: cos and sin must be (tokens, d/2) with D = {D} a multiple of d; got cos "
            f"{tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    tokens = x.shape[-2] if x.dim() >= 2 else 1
    if cos.shape[0] != tokens:
        raise ValueError(
            f"rms_norm_rope: cos has {cos.shape[0]} rows for {tokens} tokens of x {tuple(x.shape)}"
        )


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``rope(x * rsqrt(mean(x^2) + eps) * weight)`` in x's dtype (fp32 arithmetic, one rounding).

    Args:
        x: (..., S, D) with D = heads x d; channel pairs (2i, 2i + 1) of each head rotate.
        weight: (D,) RMSNorm weight.
        cos, sin: (S, d/2) rotation of token s, or both None for no RoPE.
        eps: added to the mean square.

    Returns:
        Like x. Differentiable in x and weight.
    """
    _check_rope(x, cos, sin)
    return _rms_rope_op(x, weight, cos, sin, float(eps))

"""One Triton kernel for AdamW over fp32 master weights of low-precision parameters.

:class:`~lightning_adaptiveload.models.master_weights.MasterWeightAdamW` keeps bf16 parameters in the model
and fp32 masters with Adam's moments in the optimizer. Done with PyTorch's ops, one step is three passes
over every parameter: the gradient cast to fp32 (a Python loop over the tensors), PyTorch's fused AdamW on
the masters, and a copy of the masters back into the parameters. This kernel does it in one pass, reading
the gradient (2 bytes), the master and both moments (12) and writing master, moments and parameter (14):
28 bytes per parameter, what PyTorch's fused AdamW moves for fp32 weights alone.

The masters and moments live in three flat fp32 buffers (one segment per parameter, padded to
``SEGMENT_ALIGN`` elements); the parameters and their gradients stay where they are and are reached by their
offsets from the first of them, one program per ``BLOCK`` elements of one tensor (whole blocks without a
mask, so that every access is a 16-byte vector where the addresses are aligned). :class:`AdamWPlan` holds
the launch table for a fixed list of tensors.

Arithmetic is PyTorch's AdamW (decoupled weight decay, bias correction; no amsgrad, no maximize) in fp32.
``available()`` says whether Triton imports. With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the
tests do this).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["BLOCK", "SEGMENT_ALIGN", "AdamWPlan", "available", "segment_offsets"]

try:  # Triton comes with CUDA builds of PyTorch; CPU builds have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# Elements per program, and the padding of each tensor's segment in the flat buffers (fp32: 256 bytes), so
# that every segment starts aligned for vector loads.
BLOCK = 2048
SEGMENT_ALIGN = 64
WARPS = 8

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    """Whether Triton is importable (the kernel compiles on first use)."""
    return triton is not None


def segment_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``numels`` elements in a flat buffer, each padded to ``SEGMENT_ALIGN``, and the
    buffer's length."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-int(n) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    return offsets, total


if triton is not None:

    @triton.jit
    def _adamw_update(g, w, m, v, beta1, beta2, eps, decay, step_size, bc2_sqrt):
        """PyTorch's AdamW on fp32 values: the new (master, exp_avg, exp_avg_sq)."""
        g = g.to(tl.float32)
        w = w * decay
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        w = w - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        return w, m, v

    @triton.jit
    def _master_adamw_kernel(
        CHUNK_TENSOR,  # (chunks,) int32: the tensor of each program
        CHUNK_START,  # (chunks,) int64: its first element within that tensor
        NUMEL,  # (tensors,) int64
        OFFSET,  # (tensors,) int64: the tensor's segment in the flat buffers
        PG_OFFSET,  # (2 * tensors,) int64: parameters' element offsets from P, then gradients' from G
        P,  # the first parameter (every parameter is reached from it)
        G,  # the first gradient
        MASTER,  # flat fp32 buffers
        EXP_AVG,
        EXP_AVG_SQ,
        n_tensors,
        beta1,
        beta2,
        eps,
        decay,  # 1 - lr * weight_decay
        step_size,  # lr / (1 - beta1 ** step)
        bc2_sqrt,  # sqrt(1 - beta2 ** step)
        P_VEC: tl.constexpr,  # elements per 16 bytes of every parameter's address, 1 where not all aligned
        G_VEC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(CHUNK_TENSOR + pid)
        start = tl.multiple_of(tl.load(CHUNK_START + pid), BLOCK)
        numel = tl.load(NUMEL + t)
        # Hints (the offsets come from memory, so the compiler cannot see them): 16-byte aligned starts let
        # the loads and stores be vectors.
        flat = tl.multiple_of(tl.load(OFFSET + t), 64) + start
        p_at = tl.multiple_of(tl.load(PG_OFFSET + t), P_VEC) + start
        g_at = tl.multiple_of(tl.load(PG_OFFSET + n_tensors + t), G_VEC) + start
        idx = tl.arange(0, BLOCK)
        if start + BLOCK <= numel:  # a whole block: no mask, so nothing keeps the accesses from vectors
            w, m, v = _adamw_update(
                tl.load(G + g_at + idx),
                tl.load(MASTER + flat + idx),
                tl.load(EXP_AVG + flat + idx),
                tl.load(EXP_AVG_SQ + flat + idx),
                beta1, beta2, eps, decay, step_size, bc2_sqrt,
            )  # fmt: skip
            tl.store(MASTER + flat + idx, w)
            tl.store(EXP_AVG + flat + idx, m)
            tl.store(EXP_AVG_SQ + flat + idx, v)
            tl.store(P + p_at + idx, w.to(P.dtype.element_ty))
        else:  # a tensor's last, partial block
            mask = start + idx < numel
            w, m, v = _adamw_update(
                tl.load(G + g_at + idx, mask=mask, other=0.0),
                tl.load(MASTER + flat + idx, mask=mask, other=0.0),
                tl.load(EXP_AVG + flat + idx, mask=mask, other=0.0),
                tl.load(EXP_AVG_SQ + flat + idx, mask=mask, other=0.0),
                beta1, beta2, eps, decay, step_size, bc2_sqrt,
            )  # fmt: skip
            tl.store(MASTER + flat + idx, w, mask=mask)
            tl.store(EXP_AVG + flat + idx, m, mask=mask)
            tl.store(EXP_AVG_SQ + flat + idx, v, mask=mask)
            tl.store(P + p_at + idx, w.to(P.dtype.element_ty), mask=mask)


class AdamWPlan:
    """The launch table of the master-weight AdamW kernel for a fixed list of tensors.

    Args:
        numels: elements of each tensor, in order.
        offsets: each tensor's segment in the flat master and moment buffers (``segment_offsets``).
        device: where the tables (and the buffers) live.
        block, warps: elements per program and warps per program (benchmarks sweep them, e.g. by wrapping
            this class; benchmarks/model/bench_optimizer.py).
    """

    def __init__(
        self,
        numels: Sequence[int],
        offsets: Sequence[int],
        device: torch.device,
        *,
        block: int = BLOCK,
        warps: int = WARPS,
    ) -> None:
        if not available():
            raise RuntimeError("the master-weight AdamW kernel needs Triton, which is not installed")
        if len(numels) != len(offsets):
            raise ValueError(f"AdamWPlan: {len(numels)} numels but {len(offsets)} offsets")
        if any(o % SEGMENT_ALIGN for o in offsets):
            raise ValueError(f"AdamWPlan: every offset must be a multiple of {SEGMENT_ALIGN}")
        self.n = len(numels)
        self.block = int(block)
        self.warps = int(warps)
        if self.block & (self.block - 1) or not SEGMENT_ALIGN <= self.block:
            raise ValueError(f"AdamWPlan: the block must be a power of two of at least {SEGMENT_ALIGN}")
        block = self.block
        chunks = [math.ceil(n / block) for n in numels]
        self.device = torch.device(device)
        self.chunk_tensor = torch.repeat_interleave(
            torch.arange(self.n, dtype=torch.int32), torch.tensor(chunks, dtype=torch.int64)
        ).to(self.device)
        self.chunk_start = torch.cat(
            [torch.arange(c, dtype=torch.int64) * block for c in chunks]
            or [torch.zeros(0, dtype=torch.int64)]
        ).to(self.device)
        self.numel = torch.tensor(list(numels), dtype=torch.int64, device=self.device)
        self.offset = torch.tensor(list(offsets), dtype=torch.int64, device=self.device)
        self.chunks = int(sum(chunks))

    def step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
    ) -> None:
        """One AdamW step (step number ``step``, from 1) on the masters, written back into ``params``.

        ``params`` and ``grads`` match the plan's tensors in order and size, are contiguous, and share one
        dtype each (bf16, fp16 or fp32); the three buffers are flat fp32 on the plan's device.
        """
        if len(params) != self.n or len(grads) != self.n:
            raise ValueError(
                f"AdamWPlan.step: the plan has {self.n} tensors, got {len(params)} and {len(grads)}"
            )
        if self.n == 0:
            return
        p_dtype, g_dtype = params[0].dtype, grads[0].dtype
        for kind, tensors, dtype in (("parameter", params, p_dtype), ("gradient", grads, g_dtype)):
            if dtype not in _DTYPES or any(x.dtype != dtype for x in tensors):
                raise TypeError(f"AdamWPlan.step: every {kind} must have one dtype among bf16, fp16, fp32")
            if not all(x.is_contiguous() for x in tensors):
                raise ValueError(f"AdamWPlan.step: every {kind} must be contiguous")
        for name, buf in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if buf.dtype != torch.float32 or buf.dim() != 1 or not buf.is_contiguous():
                raise TypeError(f"AdamWPlan.step: {name} must be a flat contiguous fp32 buffer")
        offsets, vecs = [], []
        for tensors in (params, grads):
            base, size = tensors[0].data_ptr(), tensors[0].element_size()
            addrs = [x.data_ptr() for x in tensors]
            if any((a - base) % size for a in addrs):
                raise ValueError("AdamWPlan.step: a tensor's address is not a whole number of elements away")
            offsets += [(a - base) // size for a in addrs]
            # 16-byte aligned everywhere: offsets from the (aligned) first tensor are multiples of 16 bytes.
            vecs.append(16 // size if all(a % 16 == 0 for a in addrs) else 1)
        pg_offset = torch.tensor(offsets, dtype=torch.int64).to(self.device, non_blocking=True)
        _master_adamw_kernel[(self.chunks,)](
            self.chunk_tensor,
            self.chunk_start,
            self.numel,
            self.offset,
            pg_offset,
            params[0],
            grads[0],
            master,
            exp_avg,
            exp_avg_sq,
            self.n,
            float(beta1),
            float(beta2),
            float(eps),
            1.0 - float(lr) * float(weight_decay),
            float(lr) / (1.0 - float(beta1) ** step),
            math.sqrt(1.0 - float(beta2) ** step),
            P_VEC=vecs[0],
            G_VEC=vecs[1],
            BLOCK=self.block,
            num_warps=self.warps,
        )

"""Self-attention of a mixed pack on the dense attention kernels, as one opaque op (eager and compiled).

A mixed pack is one sequence (1, H, S, d) of samples of different lengths, each attending to itself only.
Its samples, in pack order, form runs of equal length ((1560, 1560, 17160) -> two runs). Each run is a
dense batch (count, H, L, d), exactly what a bucketed batch of those samples gives SDPA, so it can run on
the fastest dense kernel of the machine (cuDNN on Hopper, FlashAttention where FA3/FA4 are registered)
rather than on the stock variable-length kernel, which ran 1.4x slower than cuDNN on a clip
(``docs/lab_notebook.md``).

Looping over runs needs the lengths on the host. Inside ``torch.compile`` a host loop would bake each pack's
composition into the block's graph (a recompile per composition), so the loop lives in a custom op
(``adaptiveload::pack_runs_attention``) whose inputs are tensors only: the runs are a CPU int64 tensor
(R, 2) of (length, count), built once per pack outside the compiled blocks. The op saves each run's
log-sum-exp and its backward calls the same kernel's backward, so nothing is recomputed.

Kernels: ``"cudnn"`` (``aten._scaled_dot_product_cudnn_attention``), ``"flash"``
(``aten._scaled_dot_product_flash_attention``, which FA3/FA4 replace when registered) and ``"cpu"``
(``aten._scaled_dot_product_flash_attention_for_cpu``; tests). :func:`runs_kernel` picks one from the
model's SDPA backend order. Where the cuDNN kernel raises (an unsupported shape or build), the op warns once and
takes FlashAttention for the rest of the process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend

log = logging.getLogger(__name__)

__all__ = ["RUNS_KERNELS", "equal_runs", "pack_runs_attention", "pack_runs_op", "runs_kernel", "runs_tensor"]

RUNS_KERNELS = ("cudnn", "flash", "cpu")

# Kernels that raised on this process's inputs: later calls take FlashAttention instead (warned once).
_FAILED: set[str] = set()


def _effective(kernel: str) -> str:
    return "flash" if kernel == "cudnn" and "cudnn" in _FAILED else kernel


def _give_up(kernel: str, err: Exception) -> None:
    if kernel not in _FAILED:
        log.warning(
            "pack_runs_attention: the %s kernel failed (%s); mixed packs' self-attention falls back to "
            "FlashAttention for the rest of the process",
            kernel,
            str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
        )
    _FAILED.add(kernel)


def equal_runs(lens: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive equal lengths as (length, count): (1560, 1560, 1560, 17160) -> [(1560, 3), (17160, 1)]."""
    runs: list[tuple[int, int]] = []
    for s in lens:
        s = int(s)
        if s <= 0:
            raise ValueError(f"equal_runs: sample lengths must be positive, got {s}")
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def runs_tensor(lens: Sequence[int]) -> torch.Tensor:
    """The runs of ``lens`` as the op's CPU int64 (R, 2) tensor of (length, count)."""
    runs = equal_runs(lens)
    # Built whole, not as a view: dynamo guards a view's base too, and duck sizing tied the base's size to
    # another size of the first pack (a recompile at the next pack).
    return torch.tensor(runs, dtype=torch.int64) if runs else torch.zeros((0, 2), dtype=torch.int64)


@torch.compiler.assume_constant_result
def runs_kernel(device: torch.device, backends: Sequence[SDPBackend] | None) -> str | None:
    """The kernel of :func:`pack_runs_attention` on ``device`` for the model's SDPA order, or None (none fits).

    On CUDA: the first of cuDNN and FlashAttention in ``backends`` (the model's ``attention_backend``), or,
    without an order, cuDNN where PyTorch has it enabled and the GPU is Hopper or newer (where SDPA picks it),
    else FlashAttention. On CPU: the CPU flash kernel. Inside ``torch.compile`` it is evaluated once while
    tracing (a constant of the graph).
    """
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return None
    if backends:
        for b in backends:
            if b == SDPBackend.CUDNN_ATTENTION and torch.backends.cuda.cudnn_sdp_enabled():
                return "cudnn"
            if b == SDPBackend.FLASH_ATTENTION and torch.backends.cuda.flash_sdp_enabled():
                return "flash"
        return None
    major = torch.cuda.get_device_capability(device)[0]
    if major >= 9 and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    return "flash" if torch.backends.cuda.flash_sdp_enabled() else None


def _pairs(runs: torch.Tensor, tokens: int) -> list[tuple[int, int]]:
    """The runs as host (length, count) pairs, checked to cover the pack's ``tokens``."""
    pairs = [(int(length), int(count)) for length, count in runs.tolist()]
    total = sum(length * count for length, count in pairs)
    if total != tokens:
        raise ValueError(f"pack_runs_attention: the runs cover {total} tokens, the pack holds {tokens}")
    return pairs


def _run_views(x: torch.Tensor, pairs: list[tuple[int, int]]):
    """Yield (start, end, view) per run: ``x`` (1, H, S, d) sliced to (count, H, L, d) views (no copy)."""
    start = 0
    for length, count in pairs:
        end = start + length * count
        yield start, end, x[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1)
        start = end


def _lse_out(lse: torch.Tensor, kernel: str) -> torch.Tensor:
    """A kernel's log-sum-exp of one run as (count, H, L) float32."""
    if kernel == "cudnn":  # (count, H, L, 1)
        lse = lse.squeeze(-1)
    return lse.float()


def _lse_in(lse: torch.Tensor, kernel: str) -> torch.Tensor:
    """Back to the layout the kernel's backward takes."""
    if kernel == "cudnn":
        return lse.unsqueeze(-1).contiguous()
    return lse.contiguous()


def _forward_run(q, k, v, kernel: str):
    if kernel == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
        return res[0], res[1]
    if kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
        return res[0], res[1]
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    raise ValueError(f"pack_runs_attention: kernel {kernel!r} is not one of {RUNS_KERNELS}")


def _backward_run(go, q, k, v, out, lse, kernel: str):
    length = q.shape[2]
    if kernel == "cudnn":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            go, q, k, v, out, lse, seed, seed, None, None, None, length, length, 0.0, False
        )
    if kernel == "flash":
        rng = torch.zeros((2,), dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            go, q, k, v, out, lse, None, None, length, length, 0.0, False, rng, unused
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        go, q, k, v, out, lse, 0.0, False
    )


@torch.library.custom_op("adaptiveload::pack_runs_attention", mutates_args=())
def _pack_runs_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: torch.Tensor, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[2]), dtype=torch.float32)
    pairs = _pairs(runs, q.shape[2])
    for (start, end, qr), (_, _, kr), (_, _, vr) in zip(
        _run_views(q, pairs), _run_views(k, pairs), _run_views(v, pairs)
    ):
        used = _effective(kernel)
        try:
            o, run_lse = _forward_run(qr, kr, vr, used)
        except RuntimeError as err:
            if used != "cudnn":
                raise
            _give_up(used, err)
            used = "flash"
            o, run_lse = _forward_run(qr, kr, vr, used)
        out[0, :, start:end].unflatten(1, (o.shape[0], o.shape[2])).transpose(0, 1).copy_(o)
        lse[:, start:end].unflatten(1, (o.shape[0], o.shape[2])).transpose(0, 1).copy_(_lse_out(run_lse, used))
    return out, lse


@_pack_runs_fwd.register_fake
def _(q, k, v, runs, kernel):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[2]), dtype=torch.float32)


@torch.library.custom_op("adaptiveload::pack_runs_attention_backward", mutates_args=())
def _pack_runs_bwd(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    runs: torch.Tensor,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pairs = _pairs(runs, q.shape[2])
    views = zip(*(_run_views(t, pairs) for t in (grad, q, k, v, out, dq, dk, dv)))
    for (start, end, gr), (_, _, qr), (_, _, kr), (_, _, vr), (_, _, orr), (_, _, dqr), (_, _, dkr), (
        _,
        _,
        dvr,
    ) in views:
        count, length = qr.shape[0], qr.shape[2]
        lr = lse[:, start:end].unflatten(1, (count, length)).transpose(0, 1)
        used = _effective(kernel)
        try:
            gq, gk, gv = _backward_run(gr, qr, kr, vr, orr, _lse_in(lr, used), used)
        except RuntimeError as err:
            if used != "cudnn":
                raise
            _give_up(used, err)  # the forward's cuDNN statistics: recompute them with FlashAttention
            o, run_lse = _forward_run(qr, kr, vr, "flash")
            gq, gk, gv = _backward_run(gr, qr, kr, vr, o, _lse_in(_lse_out(run_lse, "flash"), "flash"), "flash")
        dqr.copy_(gq)
        dkr.copy_(gk)
        dvr.copy_(gv)
    return dq, dk, dv


@_pack_runs_bwd.register_fake
def _(grad, q, k, v, out, lse, runs, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, runs, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, runs)
    ctx.kernel = kernel


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
    q, k, v, out, lse, runs = ctx.saved_tensors
    dq, dk, dv = _pack_runs_bwd(grad_out, q, k, v, out, lse, runs, ctx.kernel)
    return dq, dk, dv, None, None


_pack_runs_fwd.register_autograd(_backward, setup_context=_setup)


def pack_runs_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: torch.Tensor, kernel: str
) -> torch.Tensor:
    """Self-attention of a pack, each sample attending to itself, one dense kernel call per run.

    Args:
        q, k, v: (1, H, S, d) of the packed sequence (any strides with a unit last stride).
        runs: CPU int64 (R, 2): (length, count) of the pack's runs of equal-length samples, in pack order
            (:func:`runs_tensor`); their tokens sum to S.
        kernel: one of :data:`RUNS_KERNELS` (:func:`runs_kernel`).

    Returns:
        (1, H, S, d), equal to SDPA applied to each sample alone.
    """
    if kernel not in RUNS_KERNELS:
        raise ValueError(f"pack_runs_attention: kernel {kernel!r} is not one of {RUNS_KERNELS}")
    if runs.device.type != "cpu" or runs.dtype != torch.int64 or runs.dim() != 2 or runs.shape[1] != 2:
        raise ValueError(
            f"pack_runs_attention: runs must be a CPU int64 (R, 2) tensor of (length, count), got "
            f"{tuple(runs.shape)} {runs.dtype} on {runs.device}"
        )
    return _pack_runs_fwd(q, k, v, runs, kernel)[0]


def pack_runs_op() -> Any:
    """The op's overload as checkpoint policies see it (``torch.ops.adaptiveload.pack_runs_attention.default``)."""
    return torch.ops.adaptiveload.pack_runs_attention.default

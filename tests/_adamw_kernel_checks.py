"""Run by tests/ops/test_adamw_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported),
and imported by its GPU tests. Prints one JSON line of named worst differences (or failures) against
PyTorch's AdamW on fp32 copies, which the test bounds."""

from __future__ import annotations

import json
import sys

import torch

from lightning_adaptiveload.models.master_weights import MasterWeightAdamW
from lightning_adaptiveload.ops.adamw_kernels import BLOCK


def _shapes(scale: int) -> list[tuple[int, ...]]:
    # Ragged against the kernel's programs: one element, under a block, a block and 3, two blocks, a matrix.
    return [(1,), (37,), (BLOCK + 3,), (2 * BLOCK,), (scale, 29)]


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30)).item()
        for x, y in zip(a, b)
    )


def _reference_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().float().clone().requires_grad_(False) for p in params]


def _against_torch(device: str, dtype: torch.dtype, steps: int, scale: int, seed: int) -> dict[str, float]:
    """The kernel's masters and parameters against torch.optim.AdamW on fp32 copies fed the same (rounded)
    gradients, over two groups (weight decay on one), a learning rate that changes, and one tensor whose
    gradient is missing on one step."""
    g = torch.Generator().manual_seed(seed)
    shapes = _shapes(scale)
    params = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]
    ref = _reference_params(params)
    groups = [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]
    ref_groups = [{"params": ref[:3], "weight_decay": 0.1}, {"params": ref[3:], "weight_decay": 0.0}]
    opt = MasterWeightAdamW(groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, implementation="triton")
    ref_opt = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, foreach=False)
    for step in range(steps):
        for group in (*opt.param_groups, *ref_opt.param_groups):
            group["lr"] = 3e-3 * (0.5 + step)
        for i, (p, r) in enumerate(zip(params, ref)):
            if step == 1 and i == 1:  # no gradient: skipped, its step count lags behind the others'
                p.grad, r.grad = None, None
                continue
            grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
            p.grad, r.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
    masters = [m for group in opt.inner.param_groups for m in group["params"]]
    # Each parameter is its master rounded to its dtype (relative, per element).
    rounded = max(
        ((p.float() - m.to(dtype).float()).abs() / m.to(dtype).float().abs().clamp_min(1e-30)).max().item()
        for p, m in zip(params, masters)
    )
    return {"masters": _worst(masters, ref), "params_vs_rounded_masters": rounded}


def _state_round_trip(device: str, scale: int) -> dict[str, float]:
    """A state dict saved by the kernel loads into the torch implementation and back, and training goes on
    as if uninterrupted."""
    g = torch.Generator().manual_seed(3)
    shapes = _shapes(scale)
    init = [torch.randn(s, generator=g).to(device=device, dtype=torch.bfloat16) for s in shapes]
    grads = [
        [torch.randn(s, generator=g).to(device=device, dtype=torch.bfloat16) for s in shapes]
        for _ in range(4)
    ]

    def run(impls: list[str]) -> list[torch.Tensor]:
        params = [p.clone() for p in init]
        opt = MasterWeightAdamW(params, lr=1e-2, implementation=impls[0])
        for step, grad in enumerate(grads):
            if step == 2 and len(impls) > 1:
                state = opt.state_dict()
                opt = MasterWeightAdamW(params, lr=1e-2, implementation=impls[1])
                opt.load_state_dict(state)
            for p, gr in zip(params, grad):
                p.grad = gr
            opt.step()
        return [m.clone() for m in opt.inner.param_groups[0]["params"]]

    straight = run(["triton"])
    return {
        "resume_triton_to_torch": _worst(run(["triton", "torch"]), straight),
        "resume_torch_to_triton": _worst(run(["torch", "triton"]), straight),
        "resume_triton_to_triton": _worst(run(["triton", "triton"]), straight),
    }


def _unaligned_gradient(device: str) -> dict[str, float]:
    """Gradients that are views at an odd offset of a larger buffer (as in a gradient bucket)."""
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=g).to(device=device, dtype=torch.bfloat16) for n in (BLOCK + 5, 7)]
    ref = _reference_params(params)
    opt = MasterWeightAdamW(params, lr=1e-2, implementation="triton")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    bucket = torch.randn(1 + sum(p.numel() for p in params), generator=g).to(
        device=device, dtype=torch.bfloat16
    )
    start = 1
    for p, r in zip(params, ref):
        p.grad = bucket[start : start + p.numel()]
        r.grad = p.grad.float()
        start += p.numel()
    opt.step()
    ref_opt.step()
    return {"unaligned_gradients": _worst([m for m in opt.inner.param_groups[0]["params"]], ref)}


def run(device: str, scale: int = 40) -> dict[str, float]:
    results: dict[str, float] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        for key, value in _against_torch(device, dtype, 3, scale, seed=1).items():
            results[f"{name}/{key}"] = value
    results.update(_state_round_trip(device, scale))
    results.update(_unaligned_gradient(device))
    return results


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "cpu")))

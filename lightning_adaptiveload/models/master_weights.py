"""bf16 weights with an fp32 master copy in the optimizer: no weight casts in the forward.

Under bf16 autocast with fp32 parameters every Linear casts its weight to bf16 at each call, and activation
checkpointing casts them again in the recompute: for wan-1.3b about 4,000 copy kernels per step, which
dominate the host time of small (image) steps. Keeping the model's parameters in bf16 removes them; the
optimizer keeps an fp32 copy of every parameter (the "master"), applies the update there, and writes the
rounded result back to the bf16 parameter once per optimizer step, so small updates are not lost to bf16
rounding.

:class:`MasterWeightAdamW` is an ``AdamW`` whose ``param_groups`` hold the model's (bf16) parameters, so
Lightning's gradient clipping, ``zero_grad``, learning-rate schedulers and DDP see the usual objects; the
fp32 masters and Adam's moments live in an inner ``torch.optim.AdamW``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MasterWeightAdamW"]


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of low-precision parameters.

    Args:
        params: the model's parameters (any float dtype) or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; group values override them.
        fused: use the fused CUDA AdamW for the masters when they are on CUDA.

    Example:
        >>> model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        >>> opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
        >>> model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fused: bool | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        inner_groups = []
        for group in self.param_groups:
            masters = [p.detach().float().clone() for p in group["params"]]
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        on_cuda = all(m.is_cuda for g in inner_groups for m in g["params"])
        self.inner = torch.optim.AdamW(
            inner_groups, fused=bool(on_cuda if fused is None else fused and on_cuda)
        )

    @torch.no_grad()
    def step(self, closure=None):
        """Copy gradients onto the masters (fp32), update them, write the parameters back (one cast)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner[key] = group[key]  # schedulers change the outer groups
            params = [p for p in group["params"] if p.grad is not None]
            masters = [m for p, m in zip(group["params"], inner["params"]) if p.grad is not None]
            for p, m in zip(params, masters):
                m.grad = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
        self.inner.step()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            masters = [m for p, m in zip(group["params"], inner["params"]) if p.grad is not None]
            if params:
                torch._foreach_copy_(params, masters)
            for m in masters:
                m.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:
        outer = super().state_dict()
        outer["inner"] = self.inner.state_dict()
        outer["masters"] = [[m.detach().clone() for m in g["params"]] for g in self.inner.param_groups]
        return outer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        inner = state_dict.pop("inner")
        masters = state_dict.pop("masters")
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(inner)
        with torch.no_grad():
            for g, saved in zip(self.inner.param_groups, masters):
                for m, s in zip(g["params"], saved):
                    m.copy_(s)

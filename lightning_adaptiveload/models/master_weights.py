"""bf16 weights with an fp32 master copy in the optimizer: no weight casts in the forward.

Under bf16 autocast with fp32 parameters every Linear casts its weight to bf16 at each call, and activation
checkpointing casts them again in the recompute: for wan-1.3b about 4,000 copy kernels per step, which
dominate the host time of small (image) steps. Keeping the model's parameters in bf16 removes them; the
optimizer keeps an fp32 copy of every parameter (the "master"), applies the update there, and writes the
rounded result back to the bf16 parameter once per optimizer step, so small updates are not lost to bf16
rounding.

:class:`MasterWeightAdamW` is an ``AdamW`` whose ``param_groups`` hold the model's (bf16) parameters, so
Lightning's gradient clipping, ``zero_grad``, learning-rate schedulers and DDP see the usual objects. The
masters of a group are views into one flat fp32 buffer. On CUDA with Triton (``implementation="auto"``)
Adam's moments are flat buffers too, and one kernel (:mod:`lightning_adaptiveload.ops.adamw_kernels`) reads
each gradient once and updates master, moments and the bf16 parameter in a single pass. Elsewhere an inner
``torch.optim.AdamW`` updates the masters (fused on CUDA) after the gradients are cast to fp32, and the
result is copied back. Both keep their state in the inner optimizer's format, so a checkpoint of one loads
into the other.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

__all__ = ["MasterWeightAdamW"]

_HYPER = ("lr", "betas", "eps", "weight_decay")


class _FlatGroup:
    """One param group's flat fp32 masters (and, for the kernel, moments) with each tensor's segment."""

    def __init__(self, params: list[torch.Tensor], moments: bool) -> None:
        from lightning_adaptiveload.ops.adamw_kernels import segment_offsets

        self.numels = [p.numel() for p in params]
        self.offsets, total = segment_offsets(self.numels)
        devices = {p.device for p in params}
        if len(devices) > 1:  # (the torch implementation only) one master per parameter, on its device
            self.master = None
            self.masters = [p.detach().float().clone() for p in params]
        else:
            device = next(iter(devices), torch.device("cpu"))
            self.master = torch.zeros(total, dtype=torch.float32, device=device)
            self.masters = [self.view(self.master, i, p.shape) for i, p in enumerate(params)]
            with torch.no_grad():
                for m, p in zip(self.masters, params):
                    m.copy_(p.detach())
        self.exp_avg = torch.zeros_like(self.master) if moments else None
        self.exp_avg_sq = torch.zeros_like(self.master) if moments else None
        self.steps = [0] * len(params)
        self._plans: dict[tuple[int, ...], Any] = {}

    def view(self, flat: torch.Tensor, i: int, shape: torch.Size) -> torch.Tensor:
        return flat[self.offsets[i] : self.offsets[i] + self.numels[i]].view(shape)

    def plan(self, idx: tuple[int, ...]):
        """The kernel's launch table for the tensors ``idx`` (cached: the set is the same every step)."""
        if idx not in self._plans:
            from lightning_adaptiveload.ops.adamw_kernels import AdamWPlan

            self._plans[idx] = AdamWPlan(
                [self.numels[i] for i in idx], [self.offsets[i] for i in idx], self.master.device
            )
        return self._plans[idx]


def _resolve_implementation(implementation: str, params: list[torch.Tensor]) -> str:
    from lightning_adaptiveload.ops import adamw_kernels

    if implementation not in ("auto", "triton", "torch"):
        raise ValueError(
            f"MasterWeightAdamW: implementation must be 'auto', 'triton' or 'torch', got {implementation!r}"
        )
    if implementation == "torch":
        return "torch"
    devices = {p.device for p in params}
    why = None  # why the kernel cannot run here
    if not adamw_kernels.available():
        why = "Triton is not installed"
    elif len(devices) > 1 or not all(p.is_contiguous() for p in params):
        why = "the parameters are not all contiguous on one device"
    elif not devices or any(d.type != "cuda" for d in devices):
        # Triton's interpreter runs the kernel on CPU tensors (the tests ask for it); "auto" never picks that.
        if implementation == "auto" or os.environ.get("TRITON_INTERPRET") != "1":
            why = f"the parameters are on {sorted(str(d) for d in devices)}, not CUDA"
    if why is None:
        return "triton"
    if implementation == "auto":
        return "torch"
    raise ValueError(f"MasterWeightAdamW: implementation='triton' is not usable here: {why}")


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of low-precision parameters.

    Args:
        params: the model's parameters (any float dtype) or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; group values override them.
        fused: for ``implementation="torch"``: use PyTorch's fused CUDA AdamW for the masters when they are
            on CUDA (default: yes).
        implementation: ``"auto"`` (the Triton kernel where the parameters are on CUDA and Triton is
            installed, else ``"torch"``), ``"triton"`` (one kernel per step; raises where it cannot run) or
            ``"torch"`` (gradients cast to fp32, PyTorch's AdamW, the masters copied back).

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
        implementation: Literal["auto", "triton", "torch"] = "auto",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.implementation = _resolve_implementation(implementation, all_params)
        kernel = self.implementation == "triton"
        self._flat = [_FlatGroup(g["params"], moments=kernel) for g in self.param_groups]
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": f.masters}
            for g, f in zip(self.param_groups, self._flat)
        ]
        on_cuda = all(p.is_cuda for p in all_params)
        self.inner = torch.optim.AdamW(
            inner_groups, fused=bool(on_cuda if fused is None else fused and on_cuda)
        )
        if kernel:
            self._point_state_at_flat_buffers()
        self._ready = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError(
                "MasterWeightAdamW: parameter groups cannot be added after construction; build the optimizer "
                "with every group"
            )
        super().add_param_group(param_group)

    def _point_state_at_flat_buffers(self) -> None:
        """Make the inner optimizer's state of every master views into the flat moment buffers (for the
        kernel), copying what it holds (after a ``load_state_dict``) into them first."""
        with torch.no_grad():
            for flat, inner in zip(self._flat, self.inner.param_groups):
                for i, m in enumerate(inner["params"]):
                    state = self.inner.state[m]
                    for key, buf in (("exp_avg", flat.exp_avg), ("exp_avg_sq", flat.exp_avg_sq)):
                        view = flat.view(buf, i, m.shape)
                        if key in state and state[key].data_ptr() != view.data_ptr():
                            view.copy_(state[key])
                        state[key] = view
                    flat.steps[i] = int(state["step"].item()) if "step" in state else 0
                    state["step"] = torch.tensor(float(flat.steps[i]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """Update the masters from the parameters' gradients and write them back into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for key in _HYPER:
                inner[key] = group[key]  # schedulers change the outer groups
        if self.implementation == "triton":
            self._kernel_step()
        else:
            self._torch_step()
        return loss

    def _kernel_step(self) -> None:
        for group, flat in zip(self.param_groups, self._flat):
            params = group["params"]
            buckets: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterWeightAdamW does not support sparse gradients")
                flat.steps[i] += 1
                buckets.setdefault((flat.steps[i], p.dtype, p.grad.dtype), []).append(i)
            beta1, beta2 = group["betas"]
            for (step, _, _), idx in buckets.items():
                flat.plan(tuple(idx)).step(
                    [params[i] for i in idx],
                    [params[i].grad.contiguous() for i in idx],
                    flat.master,
                    flat.exp_avg,
                    flat.exp_avg_sq,
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    step=step,
                )

    def _torch_step(self) -> None:
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for p, m in zip(group["params"], inner["params"]):
                if p.grad is not None:
                    m.grad = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
        self.inner.step()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            masters = [m for p, m in zip(group["params"], inner["params"]) if p.grad is not None]
            if params:
                torch._foreach_copy_(params, masters)
            for m in masters:
                m.grad = None

    def state_dict(self) -> dict[str, Any]:
        if self.implementation == "triton":
            for flat, inner in zip(self._flat, self.inner.param_groups):
                for i, m in enumerate(inner["params"]):
                    self.inner.state[m]["step"] = torch.tensor(float(flat.steps[i]), dtype=torch.float32)
        outer = super().state_dict()
        outer["inner"] = self.inner.state_dict()
        outer["masters"] = [[m.detach() for m in g["params"]] for g in self.inner.param_groups]
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
        if self.implementation == "triton":
            self._point_state_at_flat_buffers()

"""Does a compiled module train like the eager one? Gradients of a compiled block against eager mode.

``torch.compile`` can be wrong where eager mode is right, and a wrong gradient trains silently: with torch
2.10 and 2.11, inductor's mix-order reductions gave adaLN blocks wrong modulation gradients
(pytorch/pytorch#193061; ``docs/lab_notebook.md``), which no loss curve shows at once.
:func:`compare_compiled` runs a module eagerly and compiled on the same inputs, back-propagates the same
output gradient through both, and reports, per output, input gradient and parameter gradient, the largest
difference relative to the eager value's largest magnitude (:func:`relative_difference`). Under bf16
autocast about 1e-2 is rounding; a value near 1 means the gradient is unusable.

Run it on the GPU and at the shape you train (the bug above showed only at batch 1 and 32,760 tokens), with
the settings you compile with (by default those of :func:`~lightning_adaptiveload.models.acceleration.compile_blocks`).
:func:`capture_inputs` takes a block's real inputs from one forward of the whole model::

    args, kwargs = capture_inputs(model.blocks[0], lambda: model(**batch))
    diffs = compare_compiled(model.blocks[0], args, kwargs, ignore=["k.bias"])
    diffs = compare_compiled(model.blocks[0], args, kwargs, settings=CompileSettings(mode="max-autotune"))

``benchmarks/checks/check_block_grads.py`` runs the check on one wan-1.3b block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

__all__ = ["CompileSettings", "capture_inputs", "compare_compiled", "relative_difference"]

#: ``torch.compile``'s modes (None: its default).
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True, kw_only=True)
class CompileSettings:
    """How :func:`compare_compiled` compiles: the arguments of
    :func:`~lightning_adaptiveload.models.acceleration.compile_blocks`, whose defaults these are.

    Raises:
        ValueError: a bad value; the message names the field and the value.
    """

    dynamic: bool | None = True
    """Passed to ``torch.compile``: True traces symbolic sizes, False specialises, None decides itself."""

    fullgraph: bool = True
    """Passed to ``torch.compile``: a graph break is an error."""

    backend: str = "inductor"
    """``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` to test the autograd tracing alone)."""

    mode: CompileMode | None = None
    """``torch.compile``'s mode; None: its default."""

    options: Mapping[str, Any] | None = None
    """Inductor options (``{"triton.tile_reductions": True}``); they win over ``mode`` and ``safe_reductions``."""

    safe_reductions: bool = True
    """Turn inductor's mix-order reductions off (they gave adaLN blocks wrong gradients in torch 2.10-2.11)."""

    def __post_init__(self) -> None:
        if self.dynamic not in (True, False, None):
            raise ValueError(f"CompileSettings: dynamic must be True, False or None, got {self.dynamic!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(
                f"CompileSettings: backend must be a torch.compile backend name such as 'inductor', "
                f"got {self.backend!r}"
            )
        if self.mode is not None and self.mode not in get_args(CompileMode):
            raise ValueError(
                f"CompileSettings: mode must be one of {get_args(CompileMode)} or None, got {self.mode!r}"
            )
        if self.options is not None:
            if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
                raise ValueError(
                    f"CompileSettings: options must map inductor option names to values, got {self.options!r}"
                )
            object.__setattr__(self, "options", dict(self.options))


def relative_difference(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|``, in fp32 (the denominator floored at 1e-30, so that two zero tensors
    give 0)."""
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def compare_compiled(
    module: nn.Module,
    args: Sequence = (),
    kwargs: Mapping | None = None,
    *,
    grad_output: torch.Tensor | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    settings: CompileSettings | None = None,
    ignore: Iterable[str] = (),
    seed: int = 0,
) -> dict[str, float]:
    """Relative differences between ``module`` compiled and eager: forward, then backward of one gradient.

    Args:
        module: the module to check (a transformer block, say), in the mode it trains in. It is compiled with
            ``torch.compile`` into a wrapper; the module itself is not changed, but its parameters' and the
            inputs' ``.grad`` are overwritten (they hold the compiled run's gradients after). Random ops
            (dropout) must be off, or the two runs differ by design.
        args, kwargs: its inputs. Tensors with ``requires_grad`` get their gradients compared, named
            ``args[i]`` and by their keyword; other inputs pass through.
        grad_output: the output's gradient; None draws a standard normal one (seeded by ``seed``). The
            output is the module's return value, or its first element if that is a tuple or list.
        autocast_dtype: run both under ``torch.autocast`` of the inputs' device with this dtype (None: off).
        settings: how to compile (a :class:`CompileSettings`); None: the defaults of
            :func:`~lightning_adaptiveload.models.acceleration.compile_blocks`.
        ignore: name endings of parameters to leave out, for gradients that are zero in theory and rounding
            in practice (a key projection's bias: softmax ignores a shift shared by all keys; ``"k.bias"``).
        seed: for ``grad_output``.

    Returns:
        ``{"out": ..., "args[0]": ..., "<kwarg>": ..., "<parameter name>": ...}``: each a
        :func:`relative_difference` of the compiled value from the eager one. A gradient that is None counts
        as zeros (0.0 where both are None).

    Raises:
        TypeError: the module returned no tensor (nor a tuple or list starting with one).
    """
    from lightning_adaptiveload.models.acceleration import _inductor_settings

    cfg = CompileSettings() if settings is None else settings
    kwargs = dict(kwargs or {})
    ignore = tuple(ignore)
    leaves = [(f"args[{i}]", a) for i, a in enumerate(args) if _is_leaf_input(a)]
    leaves += [(k, v) for k, v in kwargs.items() if _is_leaf_input(v)]
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and not n.endswith(ignore)]
    device = next(
        (t.device for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)),
        next((p.device for _, p in params), torch.device("cpu")),
    )
    dy: list[torch.Tensor] = [] if grad_output is None else [grad_output]

    def run(fn) -> dict[str, torch.Tensor]:
        for _, t in leaves:
            t.grad = None
        module.zero_grad(set_to_none=True)
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            out = fn(*args, **kwargs)
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"compare_compiled: {type(module).__name__} returned {type(out).__name__}; it needs a tensor "
                "(or a tuple or list whose first element is one)"
            )
        if not dy:
            generator = torch.Generator(device="cpu").manual_seed(seed)
            dy.append(torch.randn(out.shape, generator=generator).to(out.device))
        out.backward(dy[0].to(out.dtype))
        got = {"out": out.detach().float().clone()}
        for name, t in leaves + params:
            got[name] = t.grad.detach().clone() if t.grad is not None else None
        return got

    eager = run(module)
    options = dict(cfg.options) if cfg.options is not None else None
    mode, options = _inductor_settings(cfg.backend, cfg.mode, options, cfg.safe_reductions)
    compiled = run(
        torch.compile(
            module,
            dynamic=cfg.dynamic,
            fullgraph=cfg.fullgraph,
            backend=cfg.backend,
            mode=mode,
            options=options,
        )
    )
    diffs = {}
    for name, ref in eager.items():
        got = compiled[name]
        if ref is None and got is None:
            diffs[name] = 0.0
        else:  # a gradient missing in one run only counts as zeros there
            ref = torch.zeros_like(got) if ref is None else ref
            diffs[name] = relative_difference(torch.zeros_like(ref) if got is None else got, ref)
    return diffs


def capture_inputs(block: nn.Module, run: Callable[[], object]) -> tuple[tuple, dict]:
    """The inputs that ``block`` receives at its first call while ``run()`` executes (under ``no_grad``), for
    :func:`compare_compiled`: tensors are detached copies, and the floating-point ones require grad (so that
    their gradients are compared too); other values are kept as they are.

    Raises:
        RuntimeError: ``run()`` did not call ``block``.
    """
    captured: list = []

    def hook(module, args, kwargs):
        if not captured:
            captured.append((args, dict(kwargs)))

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"capture_inputs: run() never called the {type(block).__name__} given")
    args, kwargs = captured[0]
    return tuple(_as_leaf(a) for a in args), {k: _as_leaf(v) for k, v in kwargs.items()}


def _as_leaf(value):
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().clone()
    return value.requires_grad_() if value.is_floating_point() else value


def _is_leaf_input(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad

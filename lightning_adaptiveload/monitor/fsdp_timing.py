"""Compute time apart from waiting under FSDP2 (``fully_shard``), for :class:`LoadBalanceMonitor`.

Under DDP one point splits a step: the end of the rank's own backward (``timing.BackwardTimer``), after
which it only waits for the gradient all-reduce. FSDP2 also communicates all through the step: every sharded unit all-gathers its parameters
before its forward and again before its backward, and those collectives make a fast rank wait for a slow
one block by block. So the rank's compute time here is::

    compute = (end of the rank's backward) - (step start) - (time spent waiting for all-gathers)

* The end of the backward is marked by an autograd-engine callback queued from the root unit's output
  gradient hook, ahead of FSDP's own final callback: it runs when this rank has produced its last
  gradient, before FSDP issues the root unit's reduce-scatter and waits for all of them.
* Each wait is bracketed by two marks around FSDP's own hooks: a forward pre-hook registered in front of
  FSDP's pre-forward (which waits for the unit's all-gather) and one behind it; in the backward, two
  gradient hooks on the unit's output, one registered before FSDP's pre-backward hook (which waits for the
  backward all-gather) and one after. On CUDA the marks are events on the compute stream, so a stream wait
  for the all-gather lies between them; on CPU (gloo) they are host clocks around the blocking wait.

Not bracketed, and so counted as compute: gradient reduce-scatters that block the compute stream before
the end of the backward (none on CUDA, where they run on their own stream; on CPU/gloo they may block),
and the time FSDP spends copying gathered parameters in and out. The marks are resolved at the monitor's
flush, like the DDP hook's, so no host synchronisation is added per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["FsdpStepMarks", "FsdpStepTimer", "fsdp2_roots", "install_fsdp2_timer"]


@dataclass
class FsdpStepMarks:
    """The clock marks of one step of one rank: the end of the backward and the bracketed waits."""

    end: Any = None
    waits: list[tuple[Any, Any]] = field(default_factory=list)

    def compute_seconds(self, clock: Any, start: Any) -> float:
        """``end - start`` minus the waits, in seconds (``clock``: the monitor's host or CUDA clock)."""
        total = clock.seconds(start, self.end)
        waited = sum(clock.seconds(before, after) for before, after in self.waits)
        return max(0.0, total - waited)


def fsdp2_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost ``FSDPModule``s inside ``model`` (FSDP2 roots): units with no sharded ancestor."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return []
    roots: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, FSDPModule):
            roots.append(m)
            return
        for child in m.children():
            visit(child)

    visit(model)
    return roots


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _grad_tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _grad_tensors(o)]
    return []


class FsdpStepTimer:
    """Timing hooks on every FSDP2 unit; the monitor starts and stops it with every step.

    Attributes (the interface the monitor reads): ``active`` (hooks record only between ``start_step`` and
    the step end), ``mark`` (this step's :class:`FsdpStepMarks`), ``buckets`` (1 once the backward ended).
    """

    def __init__(self, clock: Any, roots: list[nn.Module]) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.clock = clock
        self.active = False
        self.mark: FsdpStepMarks | None = None
        self.buckets = 0
        self._open: dict[int, Any] = {}
        self._handles: list[Any] = []
        for root in roots:
            for unit in root.modules():
                if isinstance(unit, FSDPModule):
                    self._hook_unit(unit, is_root=unit is root)

    def start_step(self) -> None:
        self.mark = FsdpStepMarks()
        self.buckets = 0
        self._open.clear()
        self.active = True

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.active = False

    # -- hooks ------------------------------------------------------------------------------------

    def _hook_unit(self, unit: nn.Module, is_root: bool) -> None:
        key = id(unit)
        # FSDP registered its pre-forward with prepend=True when it sharded the unit: ours, prepended now,
        # runs before it; the appended one after it. Likewise for the forward hooks below, whose gradient
        # hooks then sit before and after FSDP's pre-backward hook on the same output tensors.
        self._handles.append(
            unit.register_forward_pre_hook(lambda m, a: self._open_wait(("f", key)), prepend=True)
        )
        self._handles.append(unit.register_forward_pre_hook(lambda m, a: self._close_wait(("f", key))))
        self._handles.append(
            unit.register_forward_hook(
                lambda m, a, out: self._on_output(out, key, "before", is_root), prepend=True
            )
        )
        self._handles.append(
            unit.register_forward_hook(lambda m, a, out: self._on_output(out, key, "after", False))
        )

    def _open_wait(self, key: Any) -> None:
        if self.active:
            self._open[key] = self.clock.mark()

    def _close_wait(self, key: Any) -> None:
        if self.active and key in self._open and self.mark is not None:
            self.mark.waits.append((self._open.pop(key), self.clock.mark()))

    def _on_output(self, output: Any, key: int, which: str, is_root: bool) -> None:
        if not (self.active and torch.is_grad_enabled()):
            return
        tensors = _grad_tensors(output)
        if not tensors:
            return
        fired = [False]  # one bracket per unit and backward, whichever output's gradient comes first

        def hook(grad: torch.Tensor) -> None:
            if fired[0] or not self.active:
                return
            fired[0] = True
            if which == "before":
                self._open_wait(("b", key))
                if is_root:
                    # Queued before FSDP queues its final callback (from its pre-backward hook, which runs
                    # after this one): it runs when this rank's last gradient is computed.
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            else:
                self._close_wait(("b", key))

        for t in tensors:
            t.register_hook(hook)

    def _end_backward(self) -> None:
        if self.active and self.mark is not None:
            self.mark.end = self.clock.mark()
            self.buckets = 1


def install_fsdp2_timer(clock: Any, model: nn.Module) -> FsdpStepTimer | None:
    """Hook an :class:`FsdpStepTimer` onto the FSDP2 units of ``model``; None if nothing is sharded."""
    roots = fsdp2_roots(model)
    return FsdpStepTimer(clock, roots) if roots else None

"""Clocks of the LoadBalanceMonitor: a rank's own compute time, apart from its wait for the others.

Owns the host and CUDA clocks (a *mark* is a reading; CUDA events are resolved at the flush, so a step costs
no host synchronisation), the :class:`BackwardTimer` that marks the end of a rank's own backward (before
any wait for slower ranks) and the end of its gradient synchronisation, and the resolution of one step's
marks into the record of :data:`lightning_adaptiveload.monitor.steps.FIELDS`. Torch only, no Lightning.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HostClock",
    "ManualClock",
    "CudaClock",
    "BackwardTimer",
    "PendingStep",
    "CompileWatch",
    "COMPILE_WATCH",
    "compile_count",
    "StepCompiles",
    "StallStacks",
]


class HostClock:
    """Host wall clock (CPU training): a mark is a ``time.perf_counter()`` reading in seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def wait(self, mark: Any) -> None:
        pass


class ManualClock:
    """A clock that moves only when told: a mark is the seconds :meth:`advance` has added so far.

    For tests and simulations that replace the measured time by a known one: pass it as
    ``LoadBalanceMonitor(clock=...)`` and advance it inside ``training_step`` by the step's true cost (the
    compute time is then exactly that cost, and the wait for other ranks 0).
    """

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` (>= 0)."""
        if not seconds >= 0:
            raise ValueError(f"ManualClock.advance: seconds must be >= 0, got {seconds!r}")
        self.now += float(seconds)

    def mark(self) -> float:
        return self.now

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def wait(self, mark: Any) -> None:
        pass


class CudaClock:
    """CUDA events on the current stream: no host synchronisation per step, resolved at the flush."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        # The current stream of this thread for the monitored device: the autograd engine runs final
        # callbacks on the stream that called backward, so a mark taken there is ordered after the backward.
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def wait(self, mark: torch.cuda.Event) -> None:
        # The whole device, not just `mark`: FSDP's wait marks may sit on the autograd engine's stream.
        torch.cuda.synchronize(self.device)


class BackwardTimer:
    """Marks the two moments that split a rank's step: the end of its own backward, and the end of the
    gradient synchronisation that follows it.

    * **Backward end**: an autograd-engine callback, queued from a gradient hook on the loss (the first node
      the backward runs), so that it is queued ahead of every strategy's own final callback (DDP's
      ``finalize_backward``, FSDP's post-backward). The engine runs final callbacks in order once this
      rank's last gradient is computed, on the stream the backward was called from: the mark lies after
      this rank's backward kernels and before the stream's wait for the gradient all-reduce.
    * **Sync end**: a mark on the current stream right after ``loss.backward()`` returned (Lightning's
      ``on_after_backward``). By then DDP's (or FSDP's) final callback has made the stream wait for the
      gradient collectives, so the mark completes when this rank's gradients are synchronised: after the
      slowest rank's backward.

    ``sync_end - backward_end`` is the time this rank spent waiting for its peers plus the gradient
    collective's own tail: the wait, measured on the device, not derived from the other ranks' times.

    An earlier version marked the last DDP gradient bucket in a Python communication hook that recorded a
    CUDA event. On GPUs under Lightning, with that hook registered, the fast ranks' backward kernels ended
    only when the slowest rank's did, so every rank read about the slowest compute time (2 x H200: 2.74 s
    against 1.58 s without it; ``benchmarks/balance/monitor_truth.py``, ``docs/monitor.md``). No hook is
    registered now, so users' own communication hooks (compression, PowerSGD) keep working too.
    """

    def __init__(self, clock: HostClock | ManualClock | CudaClock) -> None:
        self.clock = clock
        self.active = False
        self.backward_end: Any = None
        self.sync_end: Any = None

    def start_step(self) -> None:
        self.backward_end = None
        self.sync_end = None
        self.active = True

    def watch(self, loss: Any) -> bool:
        """Hook the backward of ``loss`` (called just before ``loss.backward()``); False if it has no graph."""
        if not (self.active and isinstance(loss, torch.Tensor) and loss.requires_grad):
            return False
        loss.register_hook(self._on_loss_grad)
        return True

    def _on_loss_grad(self, grad: torch.Tensor) -> None:
        if self.active:
            torch.autograd.Variable._execution_engine.queue_callback(self._mark_backward_end)

    def _mark_backward_end(self) -> None:
        if self.active:
            # Re-marked by each backward of the step (gradient accumulation inside one batch): the last wins.
            self.backward_end = self.clock.mark()

    def after_backward(self) -> None:
        """Called right after ``loss.backward()`` returned: the end of the gradient synchronisation."""
        if self.active and self.backward_end is not None:
            self.sync_end = self.clock.mark()


@dataclass
class PendingStep:
    """One step of this rank, before its clock marks are resolved to seconds at the flush.

    ``backward_end`` and ``sync_end`` are :class:`BackwardTimer`'s marks (None when the step was not timed
    that way); ``fsdp`` is :class:`~lightning_adaptiveload.monitor.fsdp_timing.FsdpStepMarks` under FSDP2,
    whose all-gather waits are taken off the compute time.
    """

    batch_idx: int
    step: int
    epoch: int
    work: tuple[float, ...]
    flops: float
    start: Any
    end: Any
    prev_end: Any
    backward_end: Any
    sync_end: Any
    fsdp: Any
    memory: tuple[float, float, float, float]
    flags: int

    def resolve(self, clock: HostClock | CudaClock) -> list[float]:
        """The step's record, in the order of :data:`lightning_adaptiveload.monitor.steps.FIELDS`."""
        step_time = clock.seconds(self.start, self.end)
        sync_wait = math.nan
        if self.fsdp is not None and self.fsdp.end is not None:
            compute = self.fsdp.compute_seconds(clock, self.start)
        elif self.backward_end is not None:
            compute = clock.seconds(self.start, self.backward_end)
        else:
            compute = step_time
        if self.backward_end is not None and self.sync_end is not None:
            sync_wait = max(0.0, clock.seconds(self.backward_end, self.sync_end))
        if self.prev_end is not None:
            iter_time = clock.seconds(self.prev_end, self.end)
            data_time = clock.seconds(self.prev_end, self.start)
        else:
            iter_time, data_time = step_time, math.nan
        return [
            float(self.batch_idx),
            float(self.step),
            float(self.epoch),
            *self.work,
            self.flops,
            compute,
            sync_wait,
            step_time,
            iter_time,
            data_time,
            *self.memory,
            float(self.flags),
        ]


class CompileWatch:
    """Counts ``torch.compile``'s compilations in this process through dynamo's compile callbacks
    (``torch._dynamo.callback_handler``): a frame's compile or recompile, and the lazy compile of a graph's
    backward (which dynamo's frame counter does not see). ``events`` is the number of compilations ended,
    ``seconds`` their total wall time. Installs itself on first use once ``torch._dynamo`` is loaded (a
    process that never compiles never loads it)."""

    def __init__(self) -> None:
        self.events = 0
        self.seconds = 0.0
        self.installed = False
        self._started: float | None = None

    def install(self) -> bool:
        """Register the callbacks where they are not registered (``torch._dynamo.reset()`` clears them);
        False while dynamo is not loaded or has no callback handler."""
        handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
        if handler is None:
            return False
        if self._end not in getattr(handler, "end_callbacks", ()):
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
        self.installed = True
        return True

    def _start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, *args: Any) -> None:
        self.events += 1
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None


#: The process's one :class:`CompileWatch` (dynamo's callbacks are process-wide).
COMPILE_WATCH = CompileWatch()


def compile_count() -> int:
    """A count that moves whenever ``torch.compile`` compiles in this process: dynamo's compiled frames plus
    the compilations :data:`COMPILE_WATCH` saw (lazy backward compiles included); 0 when dynamo was never
    loaded. Compare two readings: only a change means something."""
    COMPILE_WATCH.install()
    utils = sys.modules.get("torch._dynamo.utils")
    frames = int(sum(utils.counters["frames"].values())) if utils is not None else 0
    return frames + COMPILE_WATCH.events


class StepCompiles:
    """Whether ``torch.compile`` compiled between :meth:`start` and :meth:`end` (one step), and the log of
    this rank's compiling steps: ``[step, seconds compiling]`` each."""

    def __init__(self) -> None:
        self.log: list[list[float]] = []
        self._count = 0
        self._seconds = 0.0

    def start(self) -> None:
        self._count, self._seconds = compile_count(), COMPILE_WATCH.seconds

    def end(self, step: int) -> bool:
        """True when something compiled since :meth:`start`; the step joins :attr:`log`."""
        if compile_count() == self._count:
            return False
        self.log.append([int(step), round(COMPILE_WATCH.seconds - self._seconds, 3)])
        return True


class StallStacks:
    """Where a slow step spends its time: when a step runs longer than ``after_s`` seconds, every Python
    thread's stack (the training loop's, the autograd engine's, the data threads') is appended to a file,
    and again every ``after_s`` until the step ends. A watchdog thread reads the stacks with
    ``sys._current_frames()`` (under the GIL, so safe; ``faulthandler``'s watchdog reads them without it and
    crashed a compiling 4-GPU run). A step that ends in time writes nothing. The first line of each dump
    gives the step and how long it had run when the dump was taken: a dump much later than due means the
    loop held the GIL in native code that long."""

    def __init__(self, after_s: float) -> None:
        if not (isinstance(after_s, int | float) and math.isfinite(after_s) and after_s > 0):
            raise ValueError(f"stall_stacks_s must be a number of seconds > 0, got {after_s!r}")
        self.after_s = float(after_s)
        self.path: str | None = None
        self._file: Any = None
        self._cv = threading.Condition()
        self._running: tuple[int, float, int] | None = None  # (step, start, dumps so far)
        self._thread: threading.Thread | None = None

    def open(self, path: str) -> None:
        self.close()
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held for the fit)
        self._thread = threading.Thread(target=self._watch, name="adaptiveload-stall-stacks", daemon=True)
        self._thread.start()

    def start(self, step: int) -> None:
        """``step`` begins: dump the stacks if it is still running ``after_s`` from now."""
        with self._cv:
            self._running = (int(step), time.monotonic(), 0)
            self._cv.notify()

    def end(self) -> None:
        with self._cv:
            self._running = None
            self._cv.notify()

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            with self._cv:
                self._running = None
                self._cv.notify()
            thread.join(timeout=10)
        if self._file is not None:
            self._file.close()
            self._file = None

    def _watch(self) -> None:
        me = threading.current_thread()
        with self._cv:
            while self._thread is me:
                if self._running is None:
                    self._cv.wait()
                    continue
                step, began, dumps = self._running
                left = began + self.after_s * (dumps + 1) - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._running = (step, began, dumps + 1)
                self._cv.release()  # the loop's start()/end() never wait for a dump
                try:
                    self._dump(step, time.monotonic() - began)
                finally:
                    self._cv.acquire()

    def _dump(self, step: int, seconds: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"== step {step}: running for {seconds:.1f} s\n"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            lines.append(f"Thread {names.get(ident, '?')} ({ident:#x}), most recent call first:\n")
            # Innermost first, names and line numbers only (no source lines read: no file I/O).
            for f, lineno in traceback.walk_stack(frame):
                lines.append(f'  File "{f.f_code.co_filename}", line {lineno} in {f.f_code.co_name}\n')
        self._file.writelines(lines)
        self._file.flush()

"""Where a training step's time goes, step by step: a Lightning callback for benchmark runs.

The monitor says how long each rank's step took; this says why two steps of identical work differ. Per
step and rank it records, into ``step_probe_rank{R}.csv`` under the trainer's log folder:

- the GPU time of the forward, the backward and the optimizer (CUDA events on the current stream at
  ``on_train_batch_start``, ``on_before_backward``, ``on_after_backward`` and ``on_train_batch_end``;
  read one step late, so the probe adds no synchronisation);
- the host time of the same spans (``time.perf_counter``): a GPU span close to its host span means the GPU
  was waiting for the host to launch work;
- Python's garbage collections during the step: how many, of which generation, and their host seconds
  (``gc.callbacks``).

Optionally (``profile_steps``) it runs ``torch.profiler`` on every other step of a window and writes, per
profiled step, the GPU kernel time by kernel, the GPU's busy time and the idle gaps inside the step
(``step_probe_profile_rank{R}.json``), and keeps the Chrome traces of the slowest and the fastest profiled
step (``step_probe_trace_rank{R}_step{N}.json.gz``), so that a slow step can be compared with a fast one of
the same shape. Profiling slows the host side of a step; the rows say which steps were profiled.

Used by ``ddp_modes.py --callback`` (``PROBE=1`` in ``gpu_ddp_modes_x4.sh``); read the CSVs with
``step_probe_summary.py``. A benchmark tool, not part of the library.
"""

from __future__ import annotations

import csv
import gc
import gzip
import json
import os
import shutil
import time
from collections import defaultdict
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lightning_adaptiveload.monitor.timing import CudaClock

FIELDS = [
    "rank",
    "step",
    "batch_idx",
    "num_tokens",
    "batch_size",
    "profiled",
    "gpu_forward_s",
    "gpu_backward_s",
    "gpu_optimizer_s",
    "gpu_step_s",
    "host_forward_s",
    "host_backward_s",
    "host_optimizer_s",
    "host_step_s",
    "gc_count",
    "gc_gen2",
    "gc_s",
]


def _batch_shape(batch: Any) -> tuple[int, int]:
    """(tokens, samples) of a batch of the data path: bucketed (B, C, T, H, W) or a pack (a list)."""
    latents = batch.get("latents") if isinstance(batch, dict) else None
    if isinstance(latents, torch.Tensor) and latents.dim() == 5:
        b, _, t, h, w = latents.shape
        return int(b * t * h * w // 4), int(b)
    if isinstance(latents, (list, tuple)):
        return int(sum(x.shape[-3] * x.shape[-2] * x.shape[-1] // 4 for x in latents)), len(latents)
    return 0, 0


def _is_annotation(event: Any) -> bool:
    if getattr(event, "is_user_annotation", lambda: False)():
        return True
    return "annotation" in str(
        getattr(event, "activity_type", lambda: "")()
    ).lower() or event.name().startswith("ProfilerStep#")


def kernel_summary(events: list[tuple[str, int, int]], top: int = 25) -> dict[str, Any]:
    """GPU time of one profiled step from its device events ``(name, start_ns, end_ns)``.

    Returns the span (first start to last end), the busy time (the union of the intervals), the idle time
    inside the span and its largest gaps, and the kernels' summed time by name (the ``top`` largest).
    """
    if not events:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "gaps_s": [], "kernels": {}, "events": 0}
    events = sorted(events, key=lambda e: e[1])
    by_name: dict[str, int] = defaultdict(int)
    busy = 0
    gaps: list[int] = []
    cur_start, cur_end = events[0][1], events[0][2]
    for name, start, end in events:
        by_name[name] += end - start
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(e[2] for e in events) - events[0][1]
    kernels = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:top])
    return {
        "span_s": span / 1e9,
        "busy_s": busy / 1e9,
        "idle_s": (span - busy) / 1e9,
        "gaps_s": [g / 1e9 for g in sorted(gaps, reverse=True)[:10]],
        "gaps_over_1ms": sum(1 for g in gaps if g > 1_000_000),
        "kernels": {k: v / 1e9 for k, v in kernels.items()},
        "events": len(events),
    }


class StepProbe(Callback):
    """Per-step GPU and host times of forward, backward and optimizer, with GC pauses (see the module).

    Args:
        profile_steps: ``[first, last)`` global steps over which every other step is profiled with
            ``torch.profiler`` (``None``: no profiler).
        top_kernels: kernels kept by name in each profiled step's summary.
    """

    def __init__(self, profile_steps: list[int] | None = None, top_kernels: int = 25) -> None:
        if profile_steps is not None and (len(profile_steps) != 2 or profile_steps[0] >= profile_steps[1]):
            raise ValueError(
                f"StepProbe: profile_steps must be [first, last) with first < last, got {profile_steps}"
            )
        self.profile_steps = profile_steps
        self.top_kernels = int(top_kernels)
        self._rows: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self._cur: dict[str, Any] | None = None
        self._clock: CudaClock | None = None  # set in setup where CUDA is
        self._gc_t0 = 0.0
        self._gc: list[tuple[int, float]] = []
        self._prof: Any = None
        self._profiled: dict[int, dict[str, Any]] = {}
        self._traces: dict[int, str] = {}
        self._dir = "."
        self._rank = 0

    # --- garbage collections -------------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._cur is not None:
            self._gc.append((int(info.get("generation", -1)), time.perf_counter() - self._gc_t0))

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._rank = int(trainer.global_rank)
        # The monitor's clock: CUDA events on the current stream, read one step late (no added sync).
        self._clock = (
            CudaClock(torch.device("cuda", torch.cuda.current_device()))
            if torch.cuda.is_available()
            else None
        )
        log_dir = getattr(trainer, "log_dir", None) or trainer.default_root_dir
        self._dir = str(log_dir)
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    # --- the marks of a step ------------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        if self._cur is None:
            return
        if self._clock is not None:
            self._cur["events"][name] = self._clock.mark()
        self._cur["host"][name] = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        step = int(trainer.global_step) + 1
        self._maybe_profile(step)
        tokens, samples = _batch_shape(batch)
        self._gc = []
        self._cur = {
            "step": step,
            "batch_idx": batch_idx,
            "num_tokens": tokens,
            "batch_size": samples,
            "profiled": int(self._prof is not None and self._profiling_now(step)),
            "events": {},
            "host": {},
        }
        self._mark("start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._cur is None:
            return
        self._mark("end")
        cur, self._cur = self._cur, None
        cur["gc"] = list(self._gc)
        self._finish(self._pending)  # the step before: its events are done by now (one step of slack)
        self._pending = cur
        if self._prof is not None:
            self._prof.step()

    def _finish(self, cur: dict[str, Any] | None) -> None:
        if cur is None:
            return
        ev, host = cur["events"], cur["host"]
        row: dict[str, Any] = {
            k: cur[k] for k in ("step", "batch_idx", "num_tokens", "batch_size", "profiled")
        }
        row["rank"] = self._rank
        spans = (
            ("forward", "start", "forward"),
            ("backward", "forward", "backward"),
            ("optimizer", "backward", "end"),
        )
        marks = {"start", "forward", "backward", "end"}
        if marks <= set(ev):
            ev["end"].synchronize()
            for name, a, b in spans:
                row[f"gpu_{name}_s"] = self._clock.seconds(ev[a], ev[b])
            row["gpu_step_s"] = self._clock.seconds(ev["start"], ev["end"])
        if marks <= set(host):
            for name, a, b in spans:
                row[f"host_{name}_s"] = host[b] - host[a]
            row["host_step_s"] = host["end"] - host["start"]
        row["gc_count"] = len(cur["gc"])
        row["gc_gen2"] = sum(1 for g, _ in cur["gc"] if g == 2)
        row["gc_s"] = sum(s for _, s in cur["gc"])
        self._rows.append(row)

    # --- the profiler ---------------------------------------------------------------------------------
    def _profiling_now(self, step: int) -> bool:
        first, last = self.profile_steps or (0, 0)
        return first <= step < last and (step - first) % 2 == 1

    def _maybe_profile(self, step: int) -> None:
        if self.profile_steps is None or self._prof is not None or step != self.profile_steps[0]:
            return
        if not torch.cuda.is_available():
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        first, last = self.profile_steps
        self._prof = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=0, warmup=1, active=1, repeat=(last - first) // 2),
            on_trace_ready=self._on_trace,
        )
        self._prof.__enter__()

    def _on_trace(self, prof) -> None:
        # Called after each active step: that step is the one just ended (self._pending).
        step = self._pending["step"] if self._pending is not None else -1
        events = []
        for e in prof.profiler.kineto_results.events():
            # Kernels, copies and memsets; not the annotations mirrored on the GPU's timeline (ProfilerStep#N,
            # Optimizer.step#...), which span the whole step.
            if e.device_type() == torch.autograd.DeviceType.CUDA and not _is_annotation(e):
                start = e.start_ns()
                events.append((e.name(), start, start + e.duration_ns()))
        self._profiled[step] = kernel_summary(events, self.top_kernels)
        path = os.path.join(self._dir, f"step_probe_trace_rank{self._rank}_step{step}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        self._traces[step] = path + ".gz"

    def on_train_end(self, trainer, pl_module) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
        self._finish(self._pending)
        self._pending = None
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, f"step_probe_rank{self._rank}.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(self._rows)
        if self._profiled:
            gpu = {r["step"]: r.get("gpu_step_s") for r in self._rows}
            for step, summary in self._profiled.items():
                summary["gpu_step_s"] = gpu.get(step)
            shape = {r["step"]: (r["num_tokens"], r["batch_size"]) for r in self._rows}
            timed = [s for s in self._profiled if gpu.get(s) is not None]
            # The slowest and the fastest profiled step of the most common profiled shape: comparable work.
            common = (
                max(timed, key=lambda s: sum(shape.get(t) == shape.get(s) for t in timed)) if timed else None
            )
            same = [s for s in timed if shape.get(s) == shape.get(common)]
            keep = {min(same, key=gpu.get), max(same, key=gpu.get)} if same else set()
            for step, trace in self._traces.items():
                if step not in keep and os.path.exists(trace):
                    os.remove(trace)
            with open(os.path.join(self._dir, f"step_probe_profile_rank{self._rank}.json"), "w") as f:
                json.dump({"kept_traces": sorted(keep), "steps": self._profiled}, f, indent=1)
